"""``kvroute bench``: replay workloads against OpenAI endpoints and compare routers.

The data flow, one module per step:

    words (one-token words of the tokenizer) -> trace / synthetic (workload expansion, exact token
    ids) -> workload (requests, ideal hit rate) -> arrivals (when to send) -> client (one streamed
    request, timed) -> runner (a workload against a target) -> stats (figures) -> report / plots

The ``kvroute bench`` subcommands (:mod:`kvbench.cli`) run it. ``rig`` starts workers
(``kvroute sim`` or vLLM) and routers (kvroute's policies, and the peers of :mod:`kvbench.peers`)
and runs the same workload through each in turn; ``calibrate`` fits the simulator's timing model
to a real worker. The benchmark scripts' own modules (figures,
process sampling, network namespaces) are ``benchmarks/lab/``, beside them.
"""
