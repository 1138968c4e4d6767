"""kvroute: a KV-cache-aware router and offload agent for vLLM clusters (CLI composition)."""
__version__ = "0.1.0"
