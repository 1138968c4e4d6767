"""The connector's pulls through its agent (``_AgentPuller``): a pull longer than the agent's pull
area goes in parts, each into its own place of the destination, within one deadline; a part that
falls short ends the pull with what came. Runs in vLLM's interpreter (the connector imports vLLM)."""
from __future__ import annotations

from offload_agent.agent_link import LinkPull
from offload_agent.connector.config import TierSettings
from offload_agent.connector.vllm_connector import _AgentPuller

BB = 16


class FakeLink:
    """``pull`` hands back ``have`` blocks per key set (bytes = the key's first byte repeated)."""

    def __init__(self, area_blocks: int, missing: set[bytes] = frozenset()) -> None:
        self.hello_answer = {"ok": True, "pull_bytes": area_blocks * BB}
        self.missing = missing
        self.calls: list[tuple[list[bytes], int, float]] = []

    def call(self, header):
        return {"ok": True}

    def pull(self, peer, keys, digest, deadline_ms, into, connect_timeout_ms=None):
        self.calls.append((list(keys), into.nbytes, deadline_ms))
        got = 0
        for i, k in enumerate(keys):
            if k in self.missing:
                return LinkPull(got, "miss: not held", None)
            into[i * BB:(i + 1) * BB] = k[:1] * BB
            got += 1
        return LinkPull(got, None, None)


def _puller(link: FakeLink) -> _AgentPuller:
    settings = TierSettings.from_extra({"cpu_tier_bytes": 1 << 20, "agent_socket": "/nonexistent",
                                        "peer_pull_deadline_ms": 500})
    p = _AgentPuller(settings, {"op": "hello", "role": "worker", "block_bytes": BB}, b"d" * 16)
    p.link, p.greeted = link, True
    return p


def test_a_pull_longer_than_the_area_goes_in_parts():
    keys = [bytes([i]) * 16 for i in range(1, 8)]
    link = FakeLink(area_blocks=3)
    into = bytearray(len(keys) * BB)
    assert _puller(link)("a", keys, memoryview(into)) == (7, None)
    assert [c[0] for c in link.calls] == [keys[0:3], keys[3:6], keys[6:7]]
    assert [c[1] for c in link.calls] == [3 * BB, 3 * BB, BB]
    assert all(0 < c[2] <= 500 for c in link.calls)
    assert bytes(into) == b"".join(k[:1] * BB for k in keys)


def test_a_short_part_ends_the_pull():
    keys = [bytes([i]) * 16 for i in range(1, 8)]
    link = FakeLink(area_blocks=3, missing={keys[4]})
    into = bytearray(len(keys) * BB)
    assert _puller(link)("a", keys, memoryview(into)) == (4, "miss: not held")
    assert len(link.calls) == 2
