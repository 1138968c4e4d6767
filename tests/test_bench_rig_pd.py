"""``kvroute bench rig --pd P:D``: the flag's parsing, the routers it runs, the gateway config a
kvroute-pd target gets (roles, policy.pd), the split share read from the gateway's counter, and
the flag errors (exit 2 before any worker starts)."""
from __future__ import annotations

import argparse
import json
import subprocess

import pytest
from conftest import kvroute_argv

from kvroute.bench.peers import RigWorker
from kvroute.bench.rig import RigSpec, is_kvroute, kvroute_note, launch_router, pd_share
from kvroute.bench.rig_cli import _router_list, pd_roles, pd_split


def test_pd_flag_parses_p_colon_d():
    assert pd_split("2:6") == (2, 6) and pd_roles((2, 6)) == ["prefill"] * 2 + ["decode"] * 6
    for bad in ("2", "0:6", "2:x", "2:-1", ":"):
        with pytest.raises(argparse.ArgumentTypeError):
            pd_split(bad)


def test_with_pd_the_default_routers_are_kvroute_unified_and_pd_on_the_same_workers():
    args = argparse.Namespace(pd=(2, 6), routers=None)
    assert _router_list(args, {}) == (["kvroute:ttft", "kvroute-pd:ttft"], [])
    args = argparse.Namespace(pd=(1, 1), routers="kvroute-pd:kv_aware,kvroute:round_robin")
    assert _router_list(args, {})[0] == ["kvroute-pd:kv_aware", "kvroute:round_robin"]
    assert is_kvroute("kvroute-pd:ttft") and is_kvroute("kvroute:ttft") and not is_kvroute("smg:cache_aware")
    with pytest.raises(ValueError, match="needs --pd"):
        _router_list(argparse.Namespace(pd=None, routers="kvroute-pd:ttft"), {})


def test_a_pd_target_gets_the_roles_and_policy_pd_a_unified_one_neither(tmp_path, tiny_model):
    spec = RigSpec(3, "sim", tiny_model, "tiny", 32, tmp_path, None, roles=pd_roles((1, 2)),
                   pd_policy={"min_prefill_tokens": 64})
    workers = [RigWorker(f"w{i}", f"http://127.0.0.1:{9000 + i}", f"tcp://127.0.0.1:{9100 + i}",
                         f"tcp://127.0.0.1:{9200 + i}") for i in range(3)]
    launch = launch_router("kvroute-pd:ttft", spec, workers, 8123)
    cfg = json.loads((tmp_path / "kvroute-pd-ttft.yaml").read_text())
    assert launch.argv[-5:] == ["serve", "--config", str(tmp_path / "kvroute-pd-ttft.yaml"), "--processes", "1"]
    assert [(w["id"], w["role"]) for w in cfg["workers"]] == [("w0", "prefill"), ("w1", "decode"), ("w2", "decode")]
    assert cfg["policy"] == {"name": "ttft", "pd": {"enabled": True, "min_prefill_tokens": 64}}
    launch_router("kvroute:ttft", spec, workers, 8124)
    cfg = json.loads((tmp_path / "kvroute-ttft.yaml").read_text())
    assert cfg["policy"] == {"name": "ttft"} and all("role" not in w for w in cfg["workers"])


def test_split_share_comes_from_the_gateways_pd_counter():
    text = ('# TYPE kvroute_pd_requests_total counter\n'
            'kvroute_pd_requests_total{model="tiny",outcome="split"} 30.0\n'
            'kvroute_pd_requests_total{model="tiny",outcome="whole"} 9.0\n'
            'kvroute_pd_requests_total{model="tiny",outcome="prefill_failed"} 1.0\n')
    note = kvroute_note(text)
    assert note["pd_requests_by_outcome"] == {"prefill_failed": 1, "split": 30, "whole": 9}
    share = pd_share(note["pd_requests_by_outcome"])
    assert (share["split"], share["whole"], share["prefill_failed"], share["split_share"]) == (30, 9, 1, 0.75)
    assert share["describe"] == "30 split, 9 whole, 1 prefill failed (75% split)"
    assert kvroute_note("")["pd_requests_by_outcome"] == {} and pd_share({})["split_share"] is None


def test_bad_pd_flags_exit_2_before_any_worker_starts(tiny_model):
    base = ["bench", "rig", "--workload", "shared-prefix", "--model", "tiny", "--tokenizer", str(tiny_model)]
    for extra, message in ((["--pd", "2:6", "--workers", "3"], "--pd 2:6 runs 8 workers, not --workers 3"),
                           (["--pd", "1:1", "--engine", "vllm"], "--pd runs on --engine sim"),
                           (["--routers", "kvroute-pd:ttft"], "kvroute-pd:ttft needs --pd P:D"),
                           (["--pd-min-prefill-tokens", "64"], "--pd-min-prefill-tokens needs --pd"),
                           (["--pd", "2"], "want P:D")):
        r = subprocess.run(kvroute_argv(*base, *extra), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr[-800:])
