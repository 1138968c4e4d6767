"""vLLM's data parallelism as seen from outside one server: ``--data-parallel-size N`` runs N
engine cores behind one API server, each with its own KV cache. A request names its rank with
the ``X-data-parallel-rank`` header (``_get_data_parallel_rank``,
vllm/entrypoints/generate/base/serving.py; without it vLLM's own balancer picks one), each rank
publishes its KV events on its own endpoint (:func:`rank_endpoint`) tagged with its rank, and the
server's ``/metrics`` labels each rank's figures ``engine="<rank>"``."""
from __future__ import annotations

DP_RANK_HEADER = "X-data-parallel-rank"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The ZMQ endpoint rank ``rank`` publishes on, as vLLM's ``offset_endpoint_port``
    (vllm/distributed/kv_events.py, 0.32) derives it from the configured one: unchanged for rank
    0, ``tcp://host:port`` -> ``tcp://host:(port + rank)`` (port 0 kept), ``inproc://name`` ->
    ``inproc://name_dp<rank>``. Raises ValueError for another scheme with rank > 0 (vLLM does)."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or not port.isdigit():
            return endpoint
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ValueError(f"cannot derive data parallel rank {rank}'s endpoint from {endpoint!r}: "
                     "vLLM offsets only tcp and inproc endpoints")
