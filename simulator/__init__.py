"""``kvroute sim``: a simulated vLLM server that speaks vLLM 0.32's wire formats.

Modules, in the order a request meets them: ``cli`` (flags, vLLM's names) -> ``server`` (uvicorn)
-> ``app`` (OpenAI HTTP routes, ``openai_format`` bodies, ``metrics``) -> ``engine`` (continuous
batching, ``timing``, ``outputs``) -> ``block_pool`` (prefix cache, KV events) -> ``events`` (ZMQ
PUB + replay ROUTER).
"""
