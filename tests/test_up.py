"""`kvroute up` (simulated engine): starts workers + gateway, prints the URL, routes, and stops every
process it started on SIGINT or when a child dies; with tiers and the embedded index, an agent per
worker that uses the gateway as its index."""
import array
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from conftest import free_port, kvroute_argv


def _wait_line(proc, pattern: str, timeout_s: float = 90) -> re.Match:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        m = re.search(pattern, proc.log_path.read_text(errors="replace"))
        if m:
            return m
        if not proc.alive():
            pytest.fail(f"kvroute up exited early:\n{proc.log_tail()}")
        time.sleep(0.2)
    pytest.fail(f"no line matching {pattern!r}:\n{proc.log_tail()}")


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.fixture
def up(procs, tiny_model, tmp_path):
    port = free_port()
    p = procs("up", kvroute_argv("up", "--workers", "2", "--model", str(tiny_model),
                                 "--served-model-name", "tiny", "--port", str(port),
                                 "--speedup", "50", "--log-dir", str(tmp_path / "up-logs")),
              env={"KVROUTE_ADMIN_TOKEN": "up-token"})
    m = _wait_line(p, r"gateway ready: (http://\S+)/v1")
    return p, m.group(1)


def test_up_serves_routes_and_stops_everything_on_sigint(up):
    proc, base = up
    cli = OpenAI(base_url=base + "/v1", api_key="x")
    msgs = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "hi"}]
    first = cli.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=4)
    again = cli.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=4)
    assert first.headers["x-kvroute-worker"] in {"w0", "w1"}
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert again.parse().usage.prompt_tokens_details.cached_tokens >= 32
    workers = httpx.get(base + "/admin/workers", headers={"Authorization": "Bearer up-token"}).json()
    assert sorted(w["id"] for w in workers["workers"]) == ["w0", "w1"]

    # `timeout` wraps the process in the fixture: the `kvroute up` python is its child.
    up_pid = psutil.Process(proc.popen.pid).children()[0].pid
    children = _descendants(up_pid)
    assert len(children) >= 3  # two sims and the gateway
    psutil.Process(up_pid).send_signal(signal.SIGINT)
    proc.popen.wait(30)
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert alive == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(base + "/health", timeout=2)


def test_up_stops_everything_when_a_child_dies(up):
    proc, base = up
    up_pid = psutil.Process(proc.popen.pid).children()[0].pid
    children = _descendants(up_pid)
    sims = [c for c in children if "sim" in " ".join(c.cmdline())]
    assert sims
    sims[0].kill()
    assert proc.popen.wait(30) != 0
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert alive == []
    assert "exited with" in proc.log_path.read_text()


def test_up_vllm_command_line_and_environment(monkeypatch, tmp_path):
    """The vLLM launch line `up --engine vllm` uses (the e2e suite runs it for real)."""
    from kvroute.cli import build_parser
    from kvroute.engines import vllm_argv, vllm_env

    args = build_parser().parse_args([
        "up", "--engine", "vllm", "--vllm-python", "/opt/vllm/bin/python", "--model", str(tmp_path),
        "--served-model-name", "m", "--block-size", "64", "--num-gpu-blocks-override", "100",
        "--max-model-len", "2048", "--vllm-args", "--enforce-eager --dtype 'float32'"])
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    argv = vllm_argv(args, 8101, events)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert argv[argv.index("--model") + 1] == str(tmp_path.resolve())
    assert argv[argv.index("--port") + 1] == "8101" and argv[argv.index("--block-size") + 1] == "64"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "100"
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert json.loads(argv[argv.index("--kv-events-config") + 1]) == events
    assert argv[-3:] == ["--enforce-eager", "--dtype", "float32"]

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    envs = [vllm_env(i, 2) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5"]
    assert all(e["VLLM_CPU_KVCACHE_SPACE"] == "1" for e in envs)
    binds = [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs]
    assert len(set(binds)) == 2 or len(os.sched_getaffinity(0)) == 1  # own cores when there are enough
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "all")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # fewer GPUs than workers: left alone
    assert vllm_env(1, 2) == {}


def test_up_vllm_refuses_a_missing_interpreter(tmp_path):
    done = subprocess.run(kvroute_argv("up", "--engine", "vllm", "--vllm-python", str(tmp_path / "nope"),
                                       "--model", str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--vllm-python" in done.stderr and "KVR_VLLM_PYTHON" in done.stderr


def test_up_vllm_tier_flags_load_our_connector_with_a_folder_per_worker(tmp_path):
    """--cpu-tier-bytes/--ssd-tier-* become vLLM's --kv-transfer-config (tests/e2e runs it for real)."""
    from kvroute.cli import build_parser
    from kvroute.engines import tier_argv_env

    args = build_parser().parse_args([
        "up", "--engine", "vllm", "--vllm-python", "/opt/vllm/bin/python", "--model", str(tmp_path),
        "--cpu-tier-bytes", str(64 << 20), "--ssd-tier-dir", str(tmp_path / "ssd"),
        "--ssd-tier-bytes", str(256 << 20)])
    argv, env = tier_argv_env(args, 1)
    assert argv[0] == "--kv-transfer-config"
    cfg = json.loads(argv[1])
    assert cfg["kv_connector"] == "KVRouteTierConnector"
    assert cfg["kv_connector_module_path"] == "offload_agent.connector.vllm_connector"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector_extra_config"] == {"cpu_tier_bytes": 64 << 20,
                                                "ssd_tier_dir": str((tmp_path / "ssd" / "w1").resolve()),
                                                "ssd_tier_bytes": 256 << 20}
    repo_root = str(Path(__file__).resolve().parents[1])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == repo_root
    no_tiers = build_parser().parse_args(["up", "--engine", "vllm", "--model", str(tmp_path)])
    assert tier_argv_env(no_tiers, 0) == ([], {})


def test_up_tier_options_reach_the_connector_settings(tmp_path):
    from kvroute.cli import build_parser
    from kvroute.engines import tier_argv_env

    args = build_parser().parse_args([
        "up", "--engine", "vllm", "--vllm-python", "/opt/vllm/bin/python", "--model", str(tmp_path),
        "--cpu-tier-bytes", str(1 << 20), "--tier-option", "peer_locate_timeout_ms=5000",
        "--tier-option", "peer_pull_min_blocks=2"])
    extra = json.loads(tier_argv_env(args, 0, "/tmp/a.sock")[0][1])["kv_connector_extra_config"]
    assert extra == {"cpu_tier_bytes": 1 << 20, "agent_socket": "/tmp/a.sock",
                     "peer_locate_timeout_ms": 5000.0, "peer_pull_min_blocks": 2.0}


@pytest.mark.parametrize("flags, message", [
    (["--cpu-tier-bytes", "1000"], "need --engine vllm"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--ssd-tier-dir", "/tmp/x",
      "--ssd-tier-bytes", "10"], "--cpu-tier-bytes must be > 0"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--cpu-tier-bytes", "1000",
      "--ssd-tier-dir", "/tmp/x"], "go together"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--tier-option", "peer_pull_min_blocks=2"],
     "--tier-option needs the tiers"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--cpu-tier-bytes", "1000",
      "--tier-option", "peer_locate_ms=5"], "KEY one of peer_locate_timeout_ms"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--cpu-tier-bytes", "1000",
      "--tier-option", "peer_pull_deadline_ms=-1"], "peer_pull_deadline_ms must be a number >= 0"),
])
def test_up_rejects_incomplete_tier_flags(tmp_path, flags, message):
    done = subprocess.run(kvroute_argv("up", "--model", str(tmp_path), *flags),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_up_pd_plans_prefill_then_decode_workers_and_a_pd_gateway_config(tmp_path):
    """--prefill-workers P --decode-workers D: ids p0.., d0.., indices over all (seeds, core
    slices), roles in the gateway config, policy.pd on; the config passes the gateway's own
    validation. --workers N: w0.., no roles, no pd (today's config)."""
    from kvroute.cli import build_parser
    from kvroute.up import WorkerPlan, gateway_config, plan_workers
    from router.config.schema import parse_config

    def parse(*flags: str):
        return build_parser().parse_args(["up", "--model", str(tmp_path), "--served-model-name", "m", *flags])

    args = parse("--prefill-workers", "2", "--decode-workers", "3", "--policy", "kv_aware")
    plan = plan_workers(args)
    assert plan == [WorkerPlan("p0", 0, "prefill"), WorkerPlan("p1", 1, "prefill"), WorkerPlan("d0", 2, "decode"),
                    WorkerPlan("d1", 3, "decode"), WorkerPlan("d2", 4, "decode")]
    entries = [{"id": w.id, "url": f"http://127.0.0.1:{9000 + w.index}", "model": "m", "role": w.role} for w in plan]
    cfg = gateway_config(args, entries, 8000)
    assert cfg["policy"] == {"name": "kv_aware", "pd": {"enabled": True}}
    gw = parse_config(cfg)
    assert [(w.id, w.role) for w in gw.workers] == [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"),
                                                    ("d1", "decode"), ("d2", "decode")]
    assert gw.policy["pd"] == {"enabled": True}

    plain = parse("--workers", "3")
    assert plan_workers(plain) == [WorkerPlan("w0", 0), WorkerPlan("w1", 1), WorkerPlan("w2", 2)]
    entries = [{"id": w.id, "url": f"http://127.0.0.1:{9000 + w.index}", "model": "m"} for w in plan_workers(plain)]
    cfg = gateway_config(plain, entries, 8000)
    assert cfg["policy"] == {"name": "ttft"} and all(w.role == "both" for w in parse_config(cfg).workers)


def test_up_pd_vllm_agents_and_tier_folders_are_named_after_the_worker(tmp_path):
    """With --engine vllm a P/D cluster's agents take the gateway's worker ids (the prefill side's
    params name its agent's id, the decode side pulls from it), and each gets its own SSD folder."""
    from kvroute.cli import build_parser
    from kvroute.engines import agent_argv, tier_argv_env

    args = build_parser().parse_args([
        "up", "--engine", "vllm", "--vllm-python", "/opt/vllm/bin/python", "--model", str(tmp_path),
        "--served-model-name", "m", "--block-size", "16", "--prefill-workers", "1", "--decode-workers", "1",
        "--cpu-tier-bytes", str(1 << 20), "--ssd-tier-dir", str(tmp_path / "ssd"), "--ssd-tier-bytes", str(1 << 22)])
    argv = agent_argv(args, 1, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "http://127.0.0.1:8000",
                      "/run/d0.sock", "/dev/shm/t-d0", "d0")
    assert argv[argv.index("--worker-id") + 1] == "d0"
    assert argv[argv.index("--ssd-tier-dir") + 1] == str((tmp_path / "ssd" / "d0").resolve())
    assert argv[argv.index("--serve-peers") + 1] == "127.0.0.1:0"  # the decode side pulls from it
    tier_args, _ = tier_argv_env(args, 0, "/run/p0.sock", "p0")
    extra = json.loads(tier_args[1])["kv_connector_extra_config"]
    assert extra["ssd_tier_dir"] == str((tmp_path / "ssd" / "p0").resolve())
    assert extra["agent_socket"] == str(Path("/run/p0.sock").resolve())


@pytest.mark.parametrize("flags,message", [
    (["--workers", "2", "--prefill-workers", "1", "--decode-workers", "1"], "are exclusive"),
    (["--prefill-workers", "1"], "go together"),
    (["--decode-workers", "2"], "go together"),
    (["--prefill-workers", "0", "--decode-workers", "1"], "must be >= 1"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--prefill-workers", "1", "--decode-workers", "1"],
     "give --cpu-tier-bytes N"),
])
def test_up_rejects_bad_pd_flags(tmp_path, flags, message):
    done = subprocess.run(kvroute_argv("up", "--model", str(tmp_path), *flags),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_up_pd_sims_serve_a_split_completion(procs, tiny_model, tmp_path):
    """`kvroute up --engine sim --prefill-workers 1 --decode-workers 1`: both roles listed in
    /admin/workers and exported, P/D on in the gateway's policy, and a completion through the
    openai SDK served by d0 after p0's prefill leg (a prompt over min_prefill_tokens)."""
    port, logs = free_port(), tmp_path / "up-logs"
    p = procs("up", kvroute_argv("up", "--engine", "sim", "--prefill-workers", "1", "--decode-workers", "1",
                                 "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
                                 "--speedup", "50", "--log-dir", str(logs)),
              env={"KVROUTE_ADMIN_TOKEN": "up-token"})
    base = _wait_line(p, r"gateway ready: (http://\S+)/v1").group(1)
    assert "starting 1 prefill + 1 decode sim worker(s)" in p.log_path.read_text()
    auth = {"Authorization": "Bearer up-token"}
    listed = httpx.get(base + "/admin/workers", headers=auth, timeout=10).json()["workers"]
    assert sorted((w["id"], w["role"], w["healthy"]) for w in listed) == [("d0", "decode", True),
                                                                         ("p0", "prefill", True)]
    assert httpx.get(base + "/admin/policy", headers=auth, timeout=10).json()["pd"]["enabled"] is True
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert 'kvroute_worker_role{role="prefill",worker="p0"} 1.0' in metrics
    assert 'kvroute_worker_role{role="decode",worker="d0"} 1.0' in metrics

    cli = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    prompt = " ".join(f"word{i % 50}" for i in range(600))  # well over min_prefill_tokens (256)
    raw = cli.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4)
    done = raw.parse()
    assert raw.headers["x-kvroute-worker"] == "d0" and raw.headers["x-kvroute-prefill-worker"] == "p0"
    assert done.usage.completion_tokens == 4 and done.usage.prompt_tokens >= 600
    assert done.choices[0].text


def test_up_agent_command_lines_follow_the_index(tmp_path):
    """With a Redis index an agent writes its worker's events there; with the embedded index (and
    tiers) it only owns the tiers and uses the gateway as its index."""
    from kvroute.cli import build_parser
    from kvroute.engines import agent_argv

    def parse(*index: str):
        return build_parser().parse_args([
            "up", "--engine", "vllm", "--vllm-python", "/opt/vllm/bin/python", "--model", str(tmp_path),
            "--served-model-name", "m", "--block-size", "16", "--cpu-tier-bytes", str(1 << 20), *index])

    events, replay, gw = "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "http://127.0.0.1:8000"
    embedded = agent_argv(parse(), 1, events, replay, gw, "/run/w1.sock", "/dev/shm/t-w1")
    assert embedded[embedded.index("agent") + 1:] == [
        "--worker-id", "w1", "--model", "m", "--block-size", "16", "--index", gw,
        "--tier-socket", "/run/w1.sock", "--tier-shm", "/dev/shm/t-w1", "--cpu-tier-bytes", str(1 << 20),
        "--serve-peers", "127.0.0.1:0", "--remove-tiers-on-exit"]
    with pytest.raises(ValueError, match="tier socket"):
        agent_argv(parse(), 1, events, replay, gw, None, "/dev/shm/t-w1")
    redis = agent_argv(parse("--index", "redis://h:6379/0"), 0, events, replay, gw, None, "/dev/shm/t-w0")
    assert redis[redis.index("agent") + 1:] == [
        "--worker-id", "w0", "--model", "m", "--block-size", "16", "--events", events, "--replay", replay,
        "--index", "redis://h:6379/0"]


FAKE_VLLM = '''#!{python}
"""A stand-in for vLLM's interpreter: `FAKE -m vllm.entrypoints.openai.api_server FLAGS` records its
flags, says hello to its agent's tier socket as kvroute's KV connector does at vLLM's
start, then becomes a `kvroute sim` with the flags the simulator shares with vLLM."""
import argparse, json, os, sys, time

assert sys.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], sys.argv
p = argparse.ArgumentParser()
for flag in ("--model", "--served-model-name", "--port", "--block-size", "--kv-events-config", "--kv-transfer-config"):
    p.add_argument(flag)
a, _ = p.parse_known_args(sys.argv[3:])
with open(os.path.join(os.environ["FAKE_VLLM_RECORD"], a.port + ".json"), "w") as f:
    json.dump({{"argv": sys.argv[1:]}}, f)
sock = json.loads(a.kv_transfer_config)["kv_connector_extra_config"].get("agent_socket")
if sock:
    from offload_agent.agent_link import AgentLink
    end = time.monotonic() + 20
    while not os.path.exists(sock) and time.monotonic() < end:
        time.sleep(0.05)
    answer = AgentLink(sock).call({{"op": "hello", "role": "worker", "pid": os.getpid(), "block_bytes": 512,
                                    "fingerprint": {{}}, "fingerprint_digest": "{digest}"}})
    assert answer["ok"], answer
os.execv(sys.executable, [sys.executable, "-m", "kvroute", "sim", "--model", a.model, "--served-model-name",
                          a.served_model_name, "--host", "127.0.0.1", "--port", a.port, "--block-size", a.block_size,
                          "--kv-events-config", a.kv_events_config, "--enable-prompt-tokens-details",
                          "--speedup", "50"])
'''


def test_up_with_tiers_and_the_embedded_index_starts_an_agent_per_worker(procs, tiny_model, tmp_path):
    """`kvroute up --engine vllm --cpu-tier-bytes N` (index memory): an agent per worker, started
    before its worker and pointed at the gateway, owns the tiers (the connector's hello reaches
    it), publishes its peer state to the gateway and locates peers through it; Ctrl-C stops all
    and removes the CPU tier files. vLLM is stood in for by a `kvroute sim` behind a fake
    interpreter (tests/e2e runs real vLLM)."""
    from offload_agent.agent_link import AgentLink

    digest = "5a" * 16
    record = tmp_path / "record"
    record.mkdir()
    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, digest=digest))
    fake.chmod(0o755)
    port, logs = free_port(), tmp_path / "up-logs"
    p = procs("up", kvroute_argv("up", "--engine", "vllm", "--vllm-python", str(fake), "--workers", "2",
                                 "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
                                 "--block-size", "32", "--cpu-tier-bytes", str(64 * 512), "--log-dir", str(logs)),
              env={"KVROUTE_ADMIN_TOKEN": "up-token", "FAKE_VLLM_RECORD": str(record)})
    base = _wait_line(p, r"gateway ready: (http://\S+)/v1").group(1)
    auth = {"Authorization": "Bearer up-token"}

    up_pid = psutil.Process(p.popen.pid).children()[0].pid
    children = _descendants(up_pid)
    agents = {c.cmdline()[c.cmdline().index("--worker-id") + 1]: c.cmdline() for c in children
              if "agent" in c.cmdline()}
    assert sorted(agents) == ["w0", "w1"]
    for wid, argv in agents.items():
        assert argv[argv.index("--index") + 1] == f"http://127.0.0.1:{port}" and "--events" not in argv
        assert argv[argv.index("--tier-socket") + 1] == str(logs / f"{wid}-tiers.sock")
    recorded = [json.loads(f.read_text()) for f in sorted(record.iterdir())]
    sockets = sorted(json.loads(r["argv"][r["argv"].index("--kv-transfer-config") + 1])
                     ["kv_connector_extra_config"]["agent_socket"] for r in recorded)
    assert sockets == [str(logs / "w0-tiers.sock"), str(logs / "w1-tiers.sock")]

    def workers() -> dict:
        got = httpx.get(base + "/admin/workers", headers=auth, timeout=10).json()["workers"]
        return {w["id"]: w for w in got}
    published = wait_with(lambda: all((w["peer"] or {}).get("fingerprint") == digest for w in workers().values()),
                          "both agents' peer states in /admin/workers", p)
    assert published
    listed = workers()
    assert all(w["peer"]["serve"].startswith("127.0.0.1:") and w["peer"]["pull"] for w in listed.values())

    # a prompt w0 computed: w1's agent finds it on w0 through the gateway, and explain credits w1
    tokens = [10 + (i * 37) % 300 for i in range(6 * 32 + 3)]
    r = httpx.post(listed["w0"]["url"] + "/v1/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200

    def indexed() -> bool:
        got = httpx.post(base + "/admin/index/match", headers=auth, json={"model": "tiny", "token_ids": tokens},
                         timeout=10).json()["matches"]
        return got == {"w0": {"gpu": 6, "cpu": 0, "ssd": 0}}
    assert wait_with(indexed, "w0's blocks in the gateway's index", p)
    payload = array.array("I", tokens[:6 * 32])
    located = AgentLink(str(logs / "w1-tiers.sock")).call(
        {"op": "locate", "start_block": 0, "max_blocks": 6}, memoryview(payload).cast("B"))
    assert located == {"ok": True, "peer": "w0", "blocks": 6}
    explain = httpx.post(base + "/admin/explain", headers=auth, timeout=10,
                         json={"model": "tiny", "prompt": tokens, "max_tokens": 1}).json()
    w1 = next(c for c in explain["candidates"] if c["worker"] == "w1")
    assert (w1["peer_blocks"], w1["peer_worker"]) == (6, "w0")

    tier_files = [Path(f"/dev/shm/kvroute-tier-{up_pid}-{w}") for w in ("w0", "w1")]
    assert all(f.exists() for f in tier_files)                    # made by the agents at the hello
    psutil.Process(up_pid).send_signal(signal.SIGINT)
    p.popen.wait(60)
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert alive == []
    assert not any(f.exists() for f in tier_files)                # removed by the agents at their stop


def wait_with(check, what: str, proc, timeout_s: float = 30.0):
    """``check()`` until truthy (its value), failing with ``proc``'s log after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            pytest.fail(f"{what} not reached in {timeout_s}s:\n{proc.log_tail()}")
        time.sleep(0.1)


@pytest.mark.parametrize("flags", [
    ["--cpu-tier-bytes", "1000"],
    ["--prefill-workers", "1", "--decode-workers", "1", "--cpu-tier-bytes", "1000"],
])
def test_up_configures_a_hybrid_models_window_and_refuses_what_its_connector_cannot_move(tmp_path, flags):
    from kvroute.cli import build_parser
    from kvroute.up import gateway_config

    (tmp_path / "config.json").write_text(json.dumps(
        {"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}))
    args = build_parser().parse_args(["up", "--model", str(tmp_path), "--served-model-name", "m"])
    cfg = gateway_config(args, [{"url": "http://127.0.0.1:9000", "model": "m"}], 8000)
    assert cfg["models"][0]["sliding_window_tokens"] == 128
    done = subprocess.run(kvroute_argv("up", "--engine", "vllm", "--vllm-python", sys.executable,
                                       "--model", str(tmp_path), *flags), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "is a hybrid model (sliding-window layers)" in done.stderr


def test_up_opens_vllms_render_endpoints_for_a_model_with_a_vision_tower(tmp_path):
    from kvroute.cli import build_parser
    from kvroute.engines import vllm_argv
    from kvroute.up import model_has_media_inputs

    args = build_parser().parse_args(["up", "--engine", "vllm", "--model", str(tmp_path)])
    assert not model_has_media_inputs(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not model_has_media_inputs(str(tmp_path))
    args.media_inputs = False
    assert "--enable-scale-out" not in vllm_argv(args, 8101, {})
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"image_size": 224}, "text_config": {}}))
    assert model_has_media_inputs(str(tmp_path))
    args.media_inputs = True
    assert "--enable-scale-out" in vllm_argv(args, 8101, {})


def test_free_ports_never_returns_a_port_to_avoid(monkeypatch):
    """The gateway's port is chosen before the workers but bound after them: the kernel may offer it
    again for a worker's event socket (a CI run lost the gateway that way), so it is skipped."""
    from kvroute import up as up_mod
    offered = iter([43107, 43107, 5001, 43107, 5002])

    class ScriptedSocket:
        def bind(self, _addr):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(up_mod.socket, "socket", ScriptedSocket)
    assert up_mod.free_ports(2, avoid={43107}) == [5001, 5002]
