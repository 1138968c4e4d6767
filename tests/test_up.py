"""`kvroute up` (simulated engine): starts workers + gateway, prints the URL, routes, and stops every
process it started on SIGINT or when a child dies."""
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


@pytest.mark.parametrize("flags, message", [
    (["--cpu-tier-bytes", "1000"], "need --engine vllm"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--ssd-tier-dir", "/tmp/x",
      "--ssd-tier-bytes", "10"], "--cpu-tier-bytes must be > 0"),
    (["--engine", "vllm", "--vllm-python", sys.executable, "--cpu-tier-bytes", "1000",
      "--ssd-tier-dir", "/tmp/x"], "go together"),
])
def test_up_rejects_incomplete_tier_flags(tmp_path, flags, message):
    done = subprocess.run(kvroute_argv("up", "--model", str(tmp_path), *flags),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
