"""Peer pull: each offload agent serves its worker's KV blocks (CPU tier slab, SSD files) to other
agents over TCP, so a worker missing a prefix can fetch its KV from a peer instead of recomputing it.

- :mod:`offload_agent.peer.protocol`: the wire format (documented byte by byte there), pure.
- :mod:`offload_agent.peer.server`: :class:`PeerServer` over a :class:`BlockSource` (or several: :class:`BlockSources`).
- :mod:`offload_agent.peer.client`: :class:`PeerClient` and its :class:`PullResult`.
- :mod:`offload_agent.peer.sockio`: the socket reads/writes both use.
"""
from offload_agent.peer.client import PeerClient, PullResult
from offload_agent.peer.protocol import FrameError, Status
from offload_agent.peer.server import BlockSource, BlockSources, PeerServer

__all__ = ["PeerClient", "PullResult", "PeerServer", "BlockSource", "BlockSources", "FrameError", "Status"]
