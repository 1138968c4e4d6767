"""The scheduler side's peer lookup (``locate``) over a real Unix socket: the request is asked
about again (``None``) while the agent has not answered, the answer is taken once it comes, a
lookup past ``peer_locate_timeout_ms`` gives up (the blocks are computed), one answered late but
within it is taken, and a prefix no peer
holds is not asked about again for ``NO_PEER_TTL_S``. The agent here is a stand-in speaking the
link's frames (:mod:`offload_agent.agent_link`), answering when the test lets it. Runs in vLLM's
interpreter (the connector imports vLLM)."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from offload_agent.agent_link import encode_frame
from offload_agent.connector import vllm_connector as vc
from offload_agent.connector.config import TierSettings

BLOCK = 4


class SlowAgent:
    """Answers each ``locate`` with ``answer`` once ``go`` is set; records the headers and tokens."""

    def __init__(self, path: str, answer: dict) -> None:
        self.answer, self.go = answer, threading.Event()
        self.asked: list[tuple[dict, list[int]]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.sock.settimeout(10)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(30)
        with conn:
            while True:
                prefix = conn.recv(4, socket.MSG_WAITALL)
                if len(prefix) < 4:
                    return
                header = json.loads(conn.recv(int.from_bytes(prefix, "big"), socket.MSG_WAITALL))
                raw = conn.recv(header.get("payload_bytes", 0), socket.MSG_WAITALL) if header.get("payload_bytes") else b""
                self.asked.append((header, list(memoryview(raw).cast("I"))))
                assert self.go.wait(30)
                conn.sendall(b"".join(bytes(p) for p in encode_frame(self.answer)))


def _scheduler(sock_path: str, timeout_ms: float) -> vc.KVRouteTierConnector:
    """The scheduler-side lookup state alone (no vLLM engine)."""
    c = object.__new__(vc.KVRouteTierConnector)
    c.settings = TierSettings.from_extra({"cpu_tier_bytes": 1 << 20, "agent_socket": sock_path,
                                          "peer_locate_timeout_ms": timeout_ms})
    c.layout = SimpleNamespace(block_size=BLOCK)
    c._no_peer, c._locator, c._locate_link = {}, None, None
    c.stats = vc.Counter()
    return c


def _request(n_blocks: int) -> vc._ReqState:
    st = vc._ReqState(SimpleNamespace(request_id="r1", prompt_token_ids=list(range(n_blocks * BLOCK + 1)),
                                      cache_salt=None), b"root")
    st.keys = [bytes([i]) * 16 for i in range(n_blocks)]
    return st


def _until(fn, timeout_s: float = 10.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        out = fn()
        if out is not None:
            return out
        time.sleep(0.005)
    raise AssertionError("no answer")


def test_lookup_is_asked_again_until_the_agent_answers(tmp_path):
    agent = SlowAgent(str(tmp_path / "a.sock"), {"ok": True, "peer": "w0", "blocks": 5})
    c = _scheduler(str(tmp_path / "a.sock"), timeout_ms=30_000)
    st = _request(8)
    assert c._locate(st, 2, 8) is None              # asked in the background: the request waits
    assert c._locate(st, 2, 8) is None              # the same lookup, not a second one
    agent.go.set()
    assert _until(lambda: c._locate(st, 2, 8)) == ("w0", 5)
    assert len(agent.asked) == 1
    header, tokens = agent.asked[0]
    assert (header["op"], header["start_block"], header["max_blocks"]) == ("locate", 2, 6)
    assert tokens == list(range(8 * BLOCK))         # the prompt's tokens up to the last block asked
    assert c.stats["locate_timeouts"] == 0


def test_an_answer_after_a_second_is_taken_within_the_locate_timeout(tmp_path):
    """The link to the agent waits as long as the scheduler may (``peer_locate_timeout_ms``): an
    agent busy for 1.5 s still names the peer (a 1 s link bound made that "no peer", silently)."""
    agent = SlowAgent(str(tmp_path / "a.sock"), {"ok": True, "peer": "w0", "blocks": 5})
    c = _scheduler(str(tmp_path / "a.sock"), timeout_ms=5_000)
    st = _request(8)
    t0 = time.monotonic()
    assert c._locate(st, 2, 8) is None
    threading.Timer(1.5, agent.go.set).start()
    assert _until(lambda: c._locate(st, 2, 8)) == ("w0", 5)
    assert time.monotonic() - t0 >= 1.5 and c.stats["locate_failures"] == 0 and c.stats["locate_timeouts"] == 0


def test_a_late_answer_gives_up_and_a_prefix_no_peer_holds_is_not_asked_again(tmp_path, caplog):
    agent = SlowAgent(str(tmp_path / "a.sock"), {"ok": True, "peer": None, "blocks": 0})
    c = _scheduler(str(tmp_path / "a.sock"), timeout_ms=50)
    st = _request(8)
    assert c._locate(st, 0, 8) is None
    with caplog.at_level("INFO", logger=vc.logger.name):
        assert _until(lambda: c._locate(st, 0, 8), 5) == (None, 0)   # past 50 ms: computed
    assert c.stats["locate_timeouts"] == 1
    assert "no answer within 50 ms on which peer holds blocks 0..7" in caplog.text
    agent.go.set()                                  # the agent answers late: no peer
    _until(lambda: st.locating.future.done() or None)
    st.locating = None                              # the next step's lookup for this request
    assert _until(lambda: c._locate(st, 0, 8)) == (None, 0)
    asked = len(agent.asked)
    assert asked == 2 and st.keys[0] in c._no_peer
    assert c._locate(st, 0, 8) == (None, 0)          # within NO_PEER_TTL_S: not asked again
    st.locating = None
    assert c._locate(st, 0, 8) == (None, 0) and len(agent.asked) == asked


@pytest.mark.parametrize("answer", [{"ok": False, "error": "index down"}, {"ok": True, "peer": "w1", "blocks": 99}])
def test_a_failed_lookup_means_no_peer_and_blocks_are_capped(tmp_path, answer):
    agent = SlowAgent(str(tmp_path / "a.sock"), answer)
    agent.go.set()
    c = _scheduler(str(tmp_path / "a.sock"), timeout_ms=30_000)
    st = _request(8)
    got = _until(lambda: c._locate(st, 3, 8))
    assert got == ((None, 0) if not answer["ok"] else ("w1", 5))     # at most the 5 blocks asked
