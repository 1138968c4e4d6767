"""The gateway (``kvroute serve``): an OpenAI-compatible front for a pool of vLLM workers that
sends each request where its prompt's KV cache already is.

One module per step of a request, in order:

- :mod:`router.config`: the YAML config (DESIGN.md), validated at start and by the admin API;
- :mod:`router.edge.endpoints`: raw ASGI endpoints (body bytes read once, parsed once);
- :mod:`router.route.prompt_blocks`: prompt token ids exactly as vLLM makes them, and block keys;
- :mod:`router.route.planner`: index lookup, candidates, the policy's decision, speculative inserts;
- :mod:`router.policies`: the policies (one file each) and their factory;
- :mod:`router.relay.upstream`: the pooled upstream client and the byte-exact relay;
- :mod:`router.relay.stream_usage`: the worker's cached-token usage read from responses.

Around them: :mod:`router.workers.registry` (workers, health, in-flight), :mod:`router.workers.probes`
(health probe, engine-load scrape), :mod:`router.workers.embedded_events` (KV events in embedded mode),
:mod:`router.workers.peers` (workers' peer-pull states and the worth of a pulled block),
:mod:`router.telemetry.metrics`, :mod:`router.errors`, :mod:`router.edge.admin`, :mod:`router.gateway` (the parts
wired together), :mod:`router.edge.app` (the ASGI app) and :mod:`router.cli`.
"""
