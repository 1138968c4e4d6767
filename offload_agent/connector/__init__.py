"""kvroute's vLLM KV connector: saves full blocks into the CPU/SSD tiers and loads them back.

The connector class lives in :mod:`offload_agent.connector.vllm_connector` (imports vLLM; only
vLLM's process imports it). :mod:`offload_agent.connector.config` builds vLLM's
``--kv-transfer-config`` and environment without importing vLLM.
"""
