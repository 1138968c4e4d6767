"""The worker pool and the background I/O that keeps it true: the registry, health probes and load
scrapes, peer-pull states, KV events in embedded mode, discovery."""
