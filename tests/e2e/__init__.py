"""End-to-end suite on two real vLLM servers (CPU build): `kvroute up --engine vllm`, the gateway
with its embedded index, one `kvroute agent` per worker writing to Redis, the `openai` SDK as the
client. Needs vLLM (``$KVR_VLLM_PYTHON``, installed by `make install-vllm`); fails without it."""
