"""Peer routers of ``kvroute bench rig`` (kvbench/peers.py), each launched with its own
command line in front of two real ``kvroute sim`` workers (KV events and replay on), driven by the
``openai`` SDK: streaming completions and chat answers come through with their usage
(``prompt_tokens`` equal to the worker's own /tokenize count, ``cached_tokens`` > 0 when a long
prompt is repeated), the request reaches the workers, and the router exits on SIGTERM. A peer that
is not installed is skipped with the reason; unit tests of the launch lines and of vllm-router's
event-path summary need nothing installed.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from conftest import Proc, free_port, free_ports, kvroute_argv, wait_http
from kvbench.peers import PEERS, RigWorker, VllmRouterKvAware, installed_peers

BLOCK = 32
MAX_TOKENS = 6
READY_TIMEOUT_S = 60
# peers that keep a request on the worker holding its prefix whenever load is even
STICKY = {"sglang:cache_aware"}


def _sim_argv(model: Path, port: int, events: int, replay: int, seed: int) -> list[str]:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
           "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
    return kvroute_argv("sim", "--model", str(model), "--served-model-name", "tiny", "--host", "127.0.0.1",
                        "--port", str(port), "--block-size", str(BLOCK), "--enable-prompt-tokens-details",
                        "--max-model-len", "16384", "--speedup", "10", "--seed", str(seed),
                        "--kv-events-config", json.dumps(cfg))


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("peers")
    started: list[Proc] = []
    rig: list[RigWorker] = []
    try:
        ports = iter(free_ports(6))  # 3 per simulator: HTTP, events, replay
        for i in range(2):
            port, events, replay = next(ports), next(ports), next(ports)
            started.append(Proc(f"w{i}", _sim_argv(tiny_model, port, events, replay, seed=i), log_dir))
            rig.append(RigWorker(f"w{i}", f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}",
                                 f"tcp://127.0.0.1:{replay}"))
        for w, p in zip(rig, started):
            wait_http(w.url + "/health", p, timeout_s=180)
        yield rig, log_dir
    finally:
        for p in reversed(started):
            p.stop()


def _wait_ready(url: str, proc: Proc, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until ``url`` answers exactly 200 (a router up but without its workers answers 503)."""
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            last = httpx.get(url, timeout=2)
            if last.status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready in {timeout_s}s (last: {last}):\n{proc.log_tail()}")


def _requests_seen(w: RigWorker) -> int:
    return sum(1 for r in httpx.get(w.url + "/sim/requests", timeout=10).json()["requests"]
               if r["path"] in ("/v1/completions", "/v1/chat/completions"))


def _tokens(w: RigWorker, body: dict) -> int:
    """The worker's own token count of a prompt (vLLM's /tokenize)."""
    r = httpx.post(w.url + "/tokenize", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _stream_completion(cli: OpenAI, prompt: str):
    text, usage, finish = "", None, None
    for ch in cli.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                     stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    return text, usage, finish


def _stream_chat(cli: OpenAI, content: str):
    text, usage, finish = "", None, None
    for ch in cli.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, stream=True,
                                          stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    return text, usage, finish


def _check(usage, finish, text, expected_prompt_tokens: int) -> int:
    assert usage is not None, "no usage chunk came through"
    assert usage.prompt_tokens == expected_prompt_tokens
    assert usage.completion_tokens == MAX_TOKENS and finish == "length"
    assert text
    assert usage.prompt_tokens_details is not None, "prompt_tokens_details dropped by the router"
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 <= cached < usage.prompt_tokens and cached % BLOCK == 0
    return cached


@pytest.mark.parametrize("key", list(PEERS))
def test_peer_routes_streams_and_caches(key, workers, tiny_model):
    peer = PEERS[key]
    if not peer.installed():
        pytest.skip(f"{peer.name} is not installed (module {peer.module}; "
                    f"`pip install '.[bench]'`, smg in .venv-peers-smg)")
    rig, log_dir = workers
    port = free_port()
    launch = peer.launch(port, rig, tiny_model, "tiny", BLOCK)
    assert launch.base_url == f"http://127.0.0.1:{port}"
    proc = Proc(key.replace(":", "_"), launch.argv, log_dir, env=launch.env, deadline_s=300)
    try:
        _wait_ready(launch.base_url + launch.ready_path, proc)
        before = [_requests_seen(w) for w in rig]
        cli = OpenAI(base_url=launch.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        # A long shared prefix (~45 blocks) no worker has seen: unique per test run.
        prefix = f"[{key} {uuid.uuid4().hex}] " + " ".join(f"shared{i} alpha beta" for i in range(80))

        cmpl_cached = []
        for q in range(3):
            prompt = f"{prefix} question {q}?"
            text, usage, finish = _stream_completion(cli, prompt)
            cmpl_cached.append(_check(usage, finish, text, _tokens(rig[0], {"prompt": prompt})))
        chat_cached = []
        for q in range(3):
            content = f"{prefix} chat {q}?"
            body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
            text, usage, finish = _stream_chat(cli, content)
            chat_cached.append(_check(usage, finish, text, _tokens(rig[0], body)))

        assert cmpl_cached[0] == 0, f"a cold prefix reported cached tokens: {cmpl_cached}"
        assert max(cmpl_cached[1:]) > 0 and max(chat_cached[1:]) > 0, (cmpl_cached, chat_cached)
        if key in STICKY:
            assert all(c > 0 for c in cmpl_cached[1:] + chat_cached[1:]), (cmpl_cached, chat_cached)
        seen = [_requests_seen(w) - b for w, b in zip(rig, before)]
        assert sum(seen) == 6, f"the workers saw {seen} requests for 6 sent (a retry or a lost request)"
        if key.endswith("round_robin"):
            assert seen == [3, 3], seen

        if launch.metrics_url:
            metrics = httpx.get(launch.metrics_url, timeout=10)
            assert metrics.status_code == 200
            line = peer.event_path(metrics.text)
            if isinstance(peer, VllmRouterKvAware):
                # The sims' block hashes are their own (xxh3), so vllm-router can never credit a
                # prefix from their events: the summary must say so, with the lookups it made.
                assert line is not None and "NOT engaged" in line and "lookups" in line, line
            else:
                assert line is None
    finally:
        t0 = time.monotonic()
        proc.signal(signal.SIGTERM)
        try:
            proc.popen.wait(15)
        except subprocess.TimeoutExpired:
            pass
        exited = not proc.alive()
        proc.stop()
    assert exited, f"{peer.name} did not exit within 15 s of SIGTERM"
    assert time.monotonic() - t0 < 15


# ---- no processes --------------------------------------------------------------------------------
RIG = [RigWorker("w0", "http://127.0.0.1:8101", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
       RigWorker("w1", "http://127.0.0.1:8102", "tcp://127.0.0.1:5567", "tcp://127.0.0.1:5568")]


def test_peer_keys_and_installed_list():
    assert list(PEERS) == ["sglang:cache_aware", "sglang:round_robin", "smg:cache_aware", "vllm-router:kv_aware"]
    assert set(installed_peers()) <= set(PEERS)
    assert [k for k in PEERS if PEERS[k].installed()] == installed_peers()


def test_peer_virtualenvs_are_looked_up_beside_the_repository(tmp_path, monkeypatch):
    import kvbench.peers as peers
    assert (peers.REPO_ROOT / "pyproject.toml").is_file()
    assert (peers.REPO_ROOT / "kvbench" / "peers.py").is_file()
    monkeypatch.setattr(peers, "REPO_ROOT", tmp_path)
    (tmp_path / ".venv-peers-x").mkdir()
    monkeypatch.setenv("KVR_PEER_VENVS", "/opt/first")
    assert peers._venvs()[0] == Path("/opt/first")
    assert peers._venvs()[-1] == tmp_path / ".venv-peers-x"


@pytest.mark.parametrize("key", list(PEERS))
def test_launch_line(key, tiny_model):
    peer = PEERS[key]
    if not peer.installed():
        pytest.skip(f"{peer.name} is not installed")
    launch = peer.launch(9000, RIG, tiny_model, "tiny", 32)
    argv = launch.argv
    assert argv[1:3] == ["-m", peer.module]
    assert argv[argv.index("--port") + 1] == "9000" and argv[argv.index("--host") + 1] == "127.0.0.1"
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == [w.url for w in RIG]
    assert "--disable-retries" in argv
    assert launch.base_url == "http://127.0.0.1:9000" and launch.ready_path.startswith("/")
    assert launch.metrics_url and launch.metrics_url.startswith("http://127.0.0.1:")
    policy = argv[argv.index("--policy") + 1]
    assert policy == key.split(":")[1]
    if key == "vllm-router:kv_aware":
        assert launch.env == {"VLLM_ROUTER_TOKENIZER": str(tiny_model)}
        sources = [argv[j + 1] for j, a in enumerate(argv) if a == "--kv-event-source"]
        replays = [argv[j + 1] for j, a in enumerate(argv) if a == "--kv-event-replay-source"]
        assert sources == [f"{w.url}={w.events}" for w in RIG]
        assert replays == [f"{w.url}={w.replay}" for w in RIG]
        assert argv[argv.index("--kv-event-block-size") + 1] == "32"
        assert argv[argv.index("--kv-event-model") + 1] == "tiny"
    if key == "smg:cache_aware":
        assert argv[argv.index("--block-size") + 1] == "32"


def test_vllm_router_event_path_summary():
    peer = VllmRouterKvAware()
    assert "no placement lookups" in peer.event_path("# nothing here\n")
    cold = ('vllm_router_kv_routing_inputs_total{transport="http",result="tokenize"} 12\n'
            'vllm_router_prefix_routing_decisions_total{policy="kv_aware",stage="regular",outcome="prefix_cost"} 6\n'
            'vllm_router_kv_placement_lookups_total{result="miss"} 6\n')
    line = peer.event_path(cold)
    assert line.startswith("kv_aware event path NOT engaged: 0 of 6") and "tokenize=12" in line
    warm = cold + 'vllm_router_kv_placement_lookups_total{result="hit"} 4\n'
    assert peer.event_path(warm).startswith("kv_aware event path engaged: 4 of 10 placement lookups hit")
    for key in ("sglang:cache_aware", "sglang:round_robin", "smg:cache_aware"):
        assert PEERS[key].event_path(warm) is None
