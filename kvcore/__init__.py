"""Pieces shared by the gateway, the offload agent and the simulator: block keys, prompt
tokenization, vLLM KV-event wire types, and the cluster index interface with its backends."""
