"""The connector's P/D disaggregation (vLLM's ``kv_transfer_params`` protocol over the agents' peer
protocol), scheduler side without an engine, and the worker side's pull that waits for blocks the
prefill side saves late:

- prefill side: a ``do_remote_decode`` request finishes with our params (the agent's worker id,
  the full prompt blocks the tiers hold from the first, the engine digest) and holds no GPU block;
  it is refused (no params, a warning) without an agent, with an agent that serves no peers, and
  for a request the tiers do not store;
- decode side: our params make the prompt's blocks past the local tiers an asynchronous peer load
  from the named peer, without a lookup, planned once, marked to wait for late blocks; NIXL's
  params or another engine's are served as any other request;
- the pull with ``wait``: asks again from the first missing block until every block has come or
  the deadline passes.

Runs in vLLM's interpreter (the connector imports vLLM)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from offload_agent.agent_link import LinkPull
from offload_agent.connector import vllm_connector as vc
from offload_agent.connector.config import TierSettings
from offload_agent.tiers.ops import LoadCpu, LoadPeer
from offload_agent.tiers.planner import TierPlanner
from vllm.v1.request import RequestStatus

BLOCK = 4
ENGINE = bytes(range(16))
NIXL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
        "remote_block_ids": [1, 2], "remote_host": "10.0.0.1", "remote_port": 5600}
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _scheduler(agent: dict | None = None, peer_pull: bool = True, slots: int = 64) -> vc.KVRouteTierConnector:
    """The scheduler side's state alone (no vLLM engine): ``agent`` is the agent's hello answer."""
    c = object.__new__(vc.KVRouteTierConnector)
    c.settings = TierSettings.from_extra({"cpu_tier_bytes": 1 << 20, "agent_socket": "/nonexistent",
                                          "peer_locate_timeout_ms": 30_000.0})
    c.layout = SimpleNamespace(block_size=BLOCK, ok=True)
    c.engine_digest = ENGINE
    c.agent_info = agent
    c.peer_pull = peer_pull and agent is not None
    c.planner = TierPlanner(slots, 0)
    c._reqs, c._pending_load, c._hit_tiers, c._no_peer = {}, {}, {}, {}
    c._pre_ops, c._async_loads = [], {}
    c._locator, c._locate_link = None, None
    c.stats = vc.Counter()
    return c


AGENT = {"ok": True, "worker_id": "p0", "peer_pull": True, "serves_peers": True}


def _request(n_tokens: int, params: dict | None, rid: str = "r1", **extra) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(100, 100 + n_tokens)), cache_salt=None,
                           kv_transfer_params=params, block_hashes=[], lora_request=None, mm_features=None,
                           prompt_embeds=None, status=RequestStatus.FINISHED_LENGTH_CAPPED, **extra)


def _save_prompt(c: vc.KVRouteTierConnector, req, blocks: int) -> None:
    """The planner holds the request's first ``blocks`` blocks (as the step computing them saves)."""
    st = c._state(req)
    for i, key in enumerate(c._keys(st, blocks)[:blocks]):
        c.planner.plan_save(key, i)
    st.saved_upto = blocks


# ---- prefill side --------------------------------------------------------------------------------
def test_a_remote_decode_request_answers_where_its_blocks_are():
    c = _scheduler(AGENT)
    req = _request(10 * BLOCK + 3, PREFILL_LEG)            # 10 full prompt blocks
    _save_prompt(c, req, 10)
    assert c.request_finished(req, [1, 2, 3]) == (False, {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None, "kvroute_peer": "p0", "kvroute_blocks": 10,
        "kvroute_engine": ENGINE.hex()})
    assert "r1" not in c._reqs and c.stats["pd_prefills"] == 1


def test_the_blocks_answered_are_the_run_the_tiers_hold_from_the_first():
    c = _scheduler(AGENT, slots=6)                          # a tier smaller than the prompt
    req = _request(10 * BLOCK, PREFILL_LEG)
    _save_prompt(c, req, 10)                                # blocks 0..3 evicted by 6..9
    assert c.request_finished(req, [])[1]["kvroute_blocks"] == 0
    c = _scheduler(AGENT)
    req = _request(10 * BLOCK, PREFILL_LEG)
    _save_prompt(c, req, 7)                                 # the last step's saves not planned
    assert c.request_finished(req, [])[1]["kvroute_blocks"] == 7


def test_a_request_without_remote_decode_answers_nothing():
    c = _scheduler(AGENT)
    for params in (None, {}, NIXL):
        req = _request(3 * BLOCK, params)
        _save_prompt(c, req, 3)
        assert c.request_finished(req, []) == (False, None)


@pytest.mark.parametrize("agent, why", [
    (None, "no offload agent"),
    ({**AGENT, "serves_peers": False}, "the agent does not serve peers (start it with --serve-peers)"),
])
def test_a_prefill_nothing_can_serve_is_refused_with_a_warning(agent, why, caplog):
    c = _scheduler(agent)
    req = _request(5 * BLOCK, PREFILL_LEG)
    _save_prompt(c, req, 5)
    with caplog.at_level("WARNING", logger=vc.logger.name):
        assert c.request_finished(req, []) == (False, None)
    assert f"request r1 asked for remote decode, refused: {why}" in caplog.text
    assert c.stats["pd_refused"] == 1


def test_a_request_the_tiers_do_not_store_is_refused(caplog):
    c = _scheduler(AGENT)
    req = _request(5 * BLOCK, PREFILL_LEG)
    req.lora_request = object()
    c._state(req)
    with caplog.at_level("WARNING", logger=vc.logger.name):
        assert c.request_finished(req, []) == (False, None)
    assert "LoRA, multimodal inputs or prompt embeddings" in caplog.text


def test_an_aborted_prefill_answers_nothing():
    c = _scheduler(AGENT)
    req = _request(5 * BLOCK, PREFILL_LEG)
    _save_prompt(c, req, 5)
    req.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(req, []) == (False, None) and c.stats["pd_refused"] == 0


# ---- decode side ---------------------------------------------------------------------------------
def _decode_params(blocks: int, peer: str = "p0", engine: bytes = ENGINE) -> dict:
    return vc.prefill_answer(peer, blocks, engine.hex())


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def test_our_params_load_the_missing_blocks_from_the_named_peer_without_a_lookup():
    c = _scheduler({**AGENT, "worker_id": "d0"})
    req = _request(10 * BLOCK + 1, _decode_params(10))     # 10 creditable blocks
    c.on_new_request(req)
    st = c._reqs["r1"]
    for i, key in enumerate(c._keys(st, 3)[:3]):            # the local CPU tier holds the first 3
        c.planner.plan_save(key, 50 + i)
    assert c.get_num_new_matched_tokens(req, 0) == (10 * BLOCK, True)   # asynchronous
    assert c._locator is None                                # no lookup asked
    c.update_state_after_alloc(req, _Blocks(list(range(20, 31))), 10 * BLOCK)
    assert [type(op) for op in c._pre_ops] == [LoadCpu] * 3
    (op,) = c._async_loads["r1"]
    assert type(op) is LoadPeer and op.peer == "p0" and op.gpu_blocks == list(range(23, 30)) and op.pd is True
    assert op.keys == st.keys[3:10]
    assert c.get_external_cache_hit_sources(req, 10 * BLOCK) == {
        vc.CacheHitSource.HOST: 3 * BLOCK, vc.CacheHitSource.P2P: 7 * BLOCK}
    # asked again after a failed load (vLLM re-queues the request): not pulled from the peer again
    c._locator = SimpleNamespace(submit=lambda *a: pytest.fail("no lookup for a P/D request's first offer"))
    c.peer_pull = False                                      # the normal path alone (no lookup either)
    assert c.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, False)


def test_the_offer_stops_at_the_blocks_the_prefill_side_saved_and_at_the_last_token():
    c = _scheduler({**AGENT, "worker_id": "d0"})
    req = _request(10 * BLOCK + 1, _decode_params(6), rid="short")
    assert c.get_num_new_matched_tokens(req, 2 * BLOCK) == (4 * BLOCK, True)    # blocks 2..5
    req = _request(10 * BLOCK, _decode_params(10), rid="whole")
    assert c.get_num_new_matched_tokens(req, 0) == (9 * BLOCK, True)           # never the last token


@pytest.mark.parametrize("params", [NIXL, {**PREFILL_LEG}, None])
def test_other_connectors_params_are_served_as_any_other_request(params):
    c = _scheduler({**AGENT, "worker_id": "d0"}, peer_pull=False)
    req = _request(10 * BLOCK + 1, params)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.stats["pd_refused"] == 0


@pytest.mark.parametrize("params, why", [
    (_decode_params(10, engine=bytes(16)), "is another engine's"),
    ({**_decode_params(10), "kvroute_blocks": "ten"}, "kvroute_blocks must be an integer"),
])
def test_unusable_params_of_ours_are_computed_with_a_warning(params, why, caplog):
    c = _scheduler({**AGENT, "worker_id": "d0"}, peer_pull=False)
    req = _request(10 * BLOCK + 1, params)
    with caplog.at_level("WARNING", logger=vc.logger.name):
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert why in caplog.text and caplog.text.count("P/D params not usable") == 1


def test_without_peer_pull_our_params_are_computed(caplog):
    c = _scheduler(None)
    c.agent_info = None
    req = _request(10 * BLOCK + 1, _decode_params(10))
    with caplog.at_level("WARNING", logger=vc.logger.name):
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "peer pull is off" in caplog.text


# ---- the pull that waits for late blocks -----------------------------------------------------------
BB = 16


class LateLink:
    """``pull`` hands back the keys that have "landed" (``landed(key)``), in order; bytes = the
    key's first byte repeated."""

    def __init__(self, landed) -> None:
        self.hello_answer = {"ok": True, "pull_bytes": 64 * BB}
        self.landed = landed
        self.calls: list[list[bytes]] = []
        self.connect_timeouts_ms: list[float | None] = []

    def pull(self, peer, keys, digest, deadline_ms, into, connect_timeout_ms=None):
        self.calls.append(list(keys))
        self.connect_timeouts_ms.append(connect_timeout_ms)
        got = 0
        for i, k in enumerate(keys):
            if not self.landed(k):
                return LinkPull(got, "miss: not held", None)
            into[i * BB:(i + 1) * BB] = k[:1] * BB
            got += 1
        return LinkPull(got, None, None)


def _puller(link, deadline_ms: float, **extra) -> vc._AgentPuller:
    settings = TierSettings.from_extra({"cpu_tier_bytes": 1 << 20, "agent_socket": "/nonexistent",
                                        "peer_pull_deadline_ms": deadline_ms, **extra})
    p = vc._AgentPuller(settings, {"op": "hello", "role": "worker", "block_bytes": BB}, b"d" * 16)
    p.link, p.greeted = link, True
    return p


def test_a_waiting_pull_asks_again_for_the_tail_until_it_lands():
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    t0 = time.monotonic()
    link = LateLink(lambda k: k[0] <= 5 or time.monotonic() - t0 > 0.05)    # blocks 6..8 land after 50 ms
    into = bytearray(len(keys) * BB)
    assert _puller(link, 5000, peer_connect_timeout_ms=2500)("p0", keys, memoryview(into), wait=True) == (8, None)
    assert link.calls[0] == keys and all(c == keys[5:] for c in link.calls[1:]) and len(link.calls) >= 2
    assert bytes(into) == b"".join(k[:1] * BB for k in keys)
    assert set(link.connect_timeouts_ms) == {2500.0}  # each try bounds the agent's connect by the setting


def test_a_waiting_pull_gives_up_at_its_deadline_and_a_plain_one_at_once():
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    link = LateLink(lambda k: k[0] <= 3)
    t0 = time.monotonic()
    got, error = _puller(link, 200)("p0", keys, memoryview(bytearray(len(keys) * BB)), wait=True)
    took = time.monotonic() - t0
    assert got == 3 and error.startswith("miss: not held, after ") and error.endswith(" retries")
    assert 0.1 <= took < 1.0 and len(link.calls) >= 3
    link = LateLink(lambda k: k[0] <= 3)
    assert _puller(link, 200)("p0", keys, memoryview(bytearray(len(keys) * BB))) == (3, "miss: not held")
    assert len(link.calls) == 1


@pytest.mark.parametrize("first", [None, "connection: connect to 10.0.0.9:7000: refused",
                                   "deadline: handshake timed out at the pull's deadline"])
def test_a_waiting_pull_stops_asking_a_peer_its_agent_skips(first):
    """A P/D pull asks again while the peer lacks the blocks or a transfer failed, but once its
    agent answers that it skips the peer (``breaker``: the peer stopped answering), it ends at once
    instead of asking again until the deadline."""
    breaker = "breaker: peer 'p0' skipped for 1.0 s more after 1 failed pulls in a row"

    class DownLink(LateLink):
        def pull(self, peer, keys, digest, deadline_ms, into, connect_timeout_ms=None):
            self.calls.append(list(keys))
            return LinkPull(0, first if first and len(self.calls) == 1 else breaker, None)

    link = DownLink(lambda k: False)
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    got, error = _puller(link, 5_000)("p0", keys, memoryview(bytearray(len(keys) * BB)), wait=True)
    assert got == 0 and error.startswith(breaker)
    assert len(link.calls) == (2 if first else 1)


def test_a_waiting_pull_asks_again_after_a_corrupted_transfer():
    keys = [bytes([i]) * 16 for i in range(1, 9)]

    class CorruptOnce(LateLink):
        def pull(self, peer, keys, digest, deadline_ms, into, connect_timeout_ms=None):
            if not self.calls:
                self.calls.append(list(keys))
                return LinkPull(2, "checksum: block 2 differs", None)
            return super().pull(peer, keys, digest, deadline_ms, into, connect_timeout_ms)

    link = CorruptOnce(lambda k: True)
    into = bytearray(len(keys) * BB)
    assert _puller(link, 5_000)("p0", keys, memoryview(into), wait=True) == (8, None)
    assert link.calls[1] == keys[2:]
