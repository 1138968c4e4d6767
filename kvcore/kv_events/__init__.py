"""vLLM KV events into the cluster index: ``wire`` (the message types and their decoder),
``subscriber`` (ZMQ, with replay and restart detection), ``translate`` (engine hashes to our block
keys), ``ingest`` (write the index). Run by the offload agent and, in embedded mode, by the gateway;
the simulator imports ``wire`` alone (it publishes events, never subscribes), so this package's
``__init__`` loads nothing.
"""
