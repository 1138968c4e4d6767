"""``kvroute bench rig --pd P:D``: the flag's parsing, the routers it runs, the gateway config a
kvroute-pd target gets (roles, policy.pd), the split share read from the gateway's counter, and
the flag errors (exit 2 before any worker starts); the peers' own P/D modes (vllm-router, smg):
their command lines, the refusals, the split read from the workers' counters, and one rig run of
vllm-router's P/D over two real sims."""
from __future__ import annotations

import argparse
import json
import subprocess

import pytest
from conftest import kvroute_argv

from kvbench.peers import RigWorker
from kvbench.peers_pd import PD_PEERS, SmgPd, VllmRouterPd, engine_split
from kvbench.rig import RigSpec, is_kvroute, kvroute_note, launch_router, pd_share
from kvbench.rig_cli import _router_list, pd_roles, pd_split


def test_pd_flag_parses_p_colon_d():
    assert pd_split("2:6") == (2, 6) and pd_roles((2, 6)) == ["prefill"] * 2 + ["decode"] * 6
    for bad in ("2", "0:6", "2:x", "2:-1", ":"):
        with pytest.raises(argparse.ArgumentTypeError):
            pd_split(bad)


def test_with_pd_the_default_routers_are_kvroute_unified_and_pd_on_the_same_workers():
    args = argparse.Namespace(pd=(2, 6), routers=None, block_size=16)
    assert _router_list(args, {}) == (["kvroute:ttft", "kvroute-pd:ttft", "vllm-router-pd:cache_aware",
                                       "vllm-router-pd:kv_aware", "smg-pd:cache_aware"], [])
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
    rejected = pd_share({"split": 6, "whole": 1, "prefill_rejected": 1})  # a 4xx from the prefill worker
    assert (rejected["prefill_rejected"], rejected["split_share"]) == (1, 0.75)
    assert rejected["describe"] == "6 split, 1 whole, 0 prefill failed, 1 prefill rejected (4xx) (75% split)"


def test_bad_pd_flags_exit_2_before_any_worker_starts(tiny_model):
    base = ["bench", "rig", "--workload", "shared-prefix", "--model", "tiny", "--tokenizer", str(tiny_model)]
    for extra, message in ((["--pd", "2:6", "--workers", "3"], "--pd 2:6 runs 8 workers, not --workers 3"),
                           (["--pd", "1:1", "--engine", "vllm"], "--pd runs on --engine sim"),
                           (["--routers", "kvroute-pd:ttft"], "kvroute-pd:ttft needs --pd P:D"),
                           (["--pd-min-prefill-tokens", "64"], "--pd-min-prefill-tokens needs --pd"),
                           (["--pd", "2"], "want P:D")):
        r = subprocess.run(kvroute_argv(*base, *extra), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr[-800:])


# ---- the peers' own P/D modes ------------------------------------------------------------------
PD_RIG = [RigWorker(f"w{i}", f"http://127.0.0.1:{8100 + i}", f"tcp://127.0.0.1:{5500 + i}",
                    f"tcp://127.0.0.1:{5600 + i}") for i in range(3)]


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_vllm_router_pd_gets_the_prefill_and_decode_pools_and_for_kv_aware_the_prefill_events(tmp_path, tiny_model):
    roles = pd_roles((1, 2))
    launch = VllmRouterPd("cache_aware").launch_pd(8300, PD_RIG, roles, tiny_model, "tiny", 16, tmp_path)
    a = launch.argv
    assert a[1:3] == ["-m", "vllm_router.launch_router"] and "--vllm-pd-disaggregation" in a
    assert _after(a, "--prefill") == ["http://127.0.0.1:8100"]
    assert _after(a, "--decode") == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert _after(a, "--policy") == ["cache_aware"] and _after(a, "--kv-connector") == ["nixl"]
    assert _after(a, "--pd-kv-events") == [] and "--worker-urls" not in a and "--disable-retries" in a
    assert launch.env == {"VLLM_ROUTER_TOKENIZER": str(tiny_model)}
    assert (launch.base_url, launch.ready_path) == ("http://127.0.0.1:8300", "/readiness")
    kv = VllmRouterPd("kv_aware").launch_pd(8301, PD_RIG, roles, tiny_model, "tiny", 16, tmp_path).argv
    # only the prefill workers' events: its P/D index scores the prefill pool
    assert _after(kv, "--pd-kv-events") == ["http://127.0.0.1:8100=tcp://127.0.0.1:5500"]
    with pytest.raises(ValueError, match="both pools"):
        VllmRouterPd("cache_aware").launch_pd(8302, PD_RIG, ["prefill"] * 3, tiny_model, "tiny", 16, tmp_path)


def test_smg_pd_lists_the_workers_with_their_role_and_nixl_in_a_discovery_manifest(tmp_path, tiny_model):
    launch = SmgPd().launch_pd(8400, PD_RIG, pd_roles((2, 1)), tiny_model, "tiny", 32, tmp_path)
    a = launch.argv
    manifest = tmp_path / "smg-pd-cache_aware-workers.json"
    assert _after(a, "--discovery-file") == [str(manifest)] and _after(a, "--discovery-provider") == ["file"]
    assert "--pd-disaggregation" in a and _after(a, "--block-size") == ["32"] and "--prefill" not in a
    assert json.loads(manifest.read_text()) == {"version": 1, "workers": [
        {"url": "http://127.0.0.1:8100", "worker_type": "prefill", "kv_connector": "NixlConnector"},
        {"url": "http://127.0.0.1:8101", "worker_type": "prefill", "kv_connector": "NixlConnector"},
        {"url": "http://127.0.0.1:8102", "worker_type": "decode", "kv_connector": "NixlConnector"}]}


def test_pd_peer_names_need_pd_sglang_pd_is_refused_and_kv_aware_needs_block_size_16(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="needs --pd"):
        _router_list(argparse.Namespace(pd=None, routers="vllm-router-pd:cache_aware", block_size=16), {})
    with pytest.raises(ValueError, match="SGLang's bootstrap protocol"):
        _router_list(argparse.Namespace(pd=(1, 1), routers="sglang-pd:cache_aware", block_size=16), {})
    with pytest.raises(ValueError, match="--block-size 16"):
        _router_list(argparse.Namespace(pd=(1, 1), routers="vllm-router-pd:kv_aware", block_size=32), {})
    run, skipped = _router_list(argparse.Namespace(pd=(1, 1), routers=None, block_size=32), {})
    assert "vllm-router-pd:kv_aware" not in run and "vllm-router-pd:cache_aware" in run
    assert skipped == ["vllm-router-pd:kv_aware: vllm-router-pd:kv_aware reads the prefill workers' KV events at "
                       "block size 16 only (--pd-kv-events): run the rig with --block-size 16"]
    spec = RigSpec(3, "sim", tiny_model, "tiny", 16, tmp_path, None)
    with pytest.raises(ValueError, match="needs worker roles"):
        launch_router("vllm-router-pd:cache_aware", spec, PD_RIG, 8500)
    r = subprocess.run(kvroute_argv("bench", "rig", "--workload", "shared-prefix", "--model", "tiny", "--tokenizer",
                                    str(tiny_model), "--pd", "1:1", "--routers", "sglang-pd:cache_aware"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "sglang-pd:cache_aware: sglang-router's --pd-disaggregation speaks" in r.stderr


def test_engine_split_reads_the_loads_and_tokens_off_the_decode_workers():
    zero = {"requests": 0.0, "prompt_tokens": 0.0, "local_hit_tokens": 0.0, "transferred_tokens": 0.0, "kv_loads": 0.0}
    before = {"w0": dict(zero), "w1": {**zero, "requests": 3.0, "prompt_tokens": 300.0}, "w2": dict(zero)}
    after = {"w0": {**zero, "requests": 10.0, "prompt_tokens": 3000.0, "local_hit_tokens": 1200.0},
             "w1": {"requests": 9.0, "prompt_tokens": 2100.0, "local_hit_tokens": 400.0, "transferred_tokens": 1280.0,
                    "kv_loads": 5.0},
             "w2": {"requests": 4.0, "prompt_tokens": 1200.0, "local_hit_tokens": 0.0, "transferred_tokens": 1152.0,
                    "kv_loads": 3.0}}
    out = engine_split(before, after, {"w0": "prefill", "w1": "decode", "w2": "decode"}, 10)
    assert {k: v for k, v in out.items() if k != "describe"} == {
        "prefill_legs": 10, "decode_requests": 10, "kv_loads": 8, "transferred_tokens": 2432,
        "decode_local_hit_tokens": 400, "decode_computed_tokens": 168, "split_share": 0.8}
    assert out["describe"] == ("workers: 8 decode requests loaded KV from a prefill worker (80% of 10), 10 "
                               "prefill-worker requests; decode prompt tokens 2432 transferred, 400 cached, 168 computed")
    none = engine_split(before, before, {"w0": "prefill", "w1": "decode", "w2": "decode"}, 4)
    assert none["split_share"] == 0.0 and none["describe"].endswith("P/D NOT engaged: no KV reached a decode worker")


def test_vllm_router_pd_metrics_line():
    text = ('vllm_router_pd_prefill_requests_total{worker="http://127.0.0.1:1"} 6\n'
            'vllm_router_pd_decode_requests_total{worker="http://127.0.0.1:2"} 4\n'
            'vllm_router_pd_decode_requests_total{worker="http://127.0.0.1:3"} 2\n'
            'vllm_router_kv_placement_lookups_total{result="miss"} 2\n'
            'vllm_router_kv_placement_lookups_total{result="hit"} 4\n'
            'vllm_router_pd_credited_prefix_tokens_total 1024\n')
    assert PD_PEERS["vllm-router-pd:cache_aware"].event_path(text) == "vllm-router P/D legs: prefill 6, decode 6"
    assert PD_PEERS["vllm-router-pd:kv_aware"].event_path(text) == (
        "vllm-router P/D legs: prefill 6, decode 6; kv_aware prefill events engaged: lookups hit=4, miss=2, "
        "credited prefix tokens 1024")


@pytest.mark.skipif(not PD_PEERS["vllm-router-pd:kv_aware"].installed(), reason="vllm-router not installed")
def test_rig_runs_vllm_router_pd_over_two_sims_and_the_decode_sim_loads_the_kv(tiny_model, tmp_path):
    out = tmp_path / "pd.json"
    r = subprocess.run(kvroute_argv(
        "bench", "rig", "--pd", "1:1", "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
        "--shared-tokens", "256", "--own-tokens", "64", "--output-tokens", "8", "--concurrency", "2",
        "--model", "tiny", "--tokenizer", str(tiny_model), "--block-size", "16", "--no-progress",
        "--routers", "vllm-router-pd:cache_aware,vllm-router-pd:kv_aware", "--json", str(out),
        "--log-dir", str(tmp_path / "logs")), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    targets = {t["name"]: t for t in json.loads(out.read_text())["targets"]}
    for name in ("vllm-router-pd:cache_aware", "vllm-router-pd:kv_aware"):
        t = targets[name]
        assert (t["requests"], t["errors"]) == (6, 0)
        # every request: one prefill leg on w0, then w1 loaded its prompt's KV over the link
        engine = t["pd"]["engine"]
        assert (engine["prefill_legs"], engine["decode_requests"], engine["kv_loads"]) == (6, 6, 6)
        assert t["pd"]["split_share"] == 1.0 and engine["transferred_tokens"] > 0
        assert t["per_worker"]["w0"]["requests"] == 6 and t["per_worker"]["w1"]["requests"] == 6
    # two groups of three prompts sharing 256 tokens: after each group's first, the prefill worker's
    # KV events let kv_aware credit the shared prefix
    assert "kv_aware prefill events engaged" in targets["vllm-router-pd:kv_aware"]["note"]
