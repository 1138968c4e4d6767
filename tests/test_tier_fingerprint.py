"""Shard fingerprints, the stored format's version, and the set-ups the tiers connector refuses
(gpu_readiness.md §3.3, §3.5, §3.6): no torch or vLLM needed."""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest

from offload_agent.connector.config import TierSettings, unsupported_setup
from offload_agent.tiers.keys import FORMAT, TierFingerprint, layer_names_digest, tier_block_keys, tier_root
from offload_agent.tiers.ssd_file import engine_shard_dir

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(32)]
BASE = TierFingerprint(model="llama", num_layers=16, dtype="bfloat16", block_size=16, block_bytes=16 * 65536,
                       layout="8x16x512", heads="8x128", tp_size=2, pp_size=2, layers=layer_names_digest(LAYERS[:16]))


def test_shards_differ_engine_is_shared():
    rank1 = replace(BASE, tp_rank=1)
    stage1 = replace(BASE, pp_rank=1, layers=layer_names_digest(LAYERS[16:]))
    digests = {fp.digest() for fp in (BASE, rank1, stage1)}
    assert len(digests) == 3
    assert len({fp.dir_name() for fp in (BASE, rank1, stage1)}) == 3
    # every shard and the scheduler (no page shape, its own layer count) root the same tier keys
    scheduler = replace(BASE, layout="", num_layers=32, block_bytes=32 * 65536)
    assert {fp.engine_digest() for fp in (BASE, rank1, stage1, scheduler)} == {BASE.engine_digest()}
    toks = list(range(64))
    assert tier_block_keys(toks, 16, tier_root(rank1.engine_digest())) == \
        tier_block_keys(toks, 16, tier_root(scheduler.engine_digest()))


def test_pipeline_stages_with_equal_layer_counts_differ():
    a = replace(BASE, pp_rank=0, layers=layer_names_digest(LAYERS[:16]))
    b = replace(BASE, pp_rank=1, layers=layer_names_digest(LAYERS[16:]))
    assert (a.num_layers, a.block_bytes) == (b.num_layers, b.block_bytes)
    assert a.digest() != b.digest()
    # even a re-partition of the same rank's layers changes it
    assert replace(a, layers=layer_names_digest(LAYERS[1:17])).digest() != a.digest()


def test_dtype_and_format_are_part_of_the_digest():
    fp8 = replace(BASE, dtype="fp8_e4m3")
    fp8_e5 = replace(BASE, dtype="fp8_e5m2")
    assert len({BASE.digest(), fp8.digest(), fp8_e5.digest()}) == 3
    assert len({BASE.engine_digest(), fp8.engine_digest(), fp8_e5.engine_digest()}) == 3
    assert BASE.format == FORMAT
    older = replace(BASE, format="kvroute-kv-v1")
    assert older.digest() != BASE.digest() and older.engine_digest() != BASE.engine_digest()


def _fp_dir(root, fields: dict) -> None:
    fp_dir = root / TierFingerprint(**fields).dir_name() if "format" in fields else root / "fp-0123456789abcdef"
    fp_dir.mkdir(parents=True)
    (fp_dir / "fingerprint.json").write_text(json.dumps(fields))
    return fp_dir


def test_engine_shard_dir_finds_the_shard_and_the_stale_folders(tmp_path):
    shard0 = _fp_dir(tmp_path, asdict(BASE))
    _fp_dir(tmp_path, asdict(replace(BASE, tp_rank=1)))
    other_model = _fp_dir(tmp_path, asdict(replace(BASE, model="other")))
    old = {k: v for k, v in asdict(BASE).items() if k not in ("format", "heads", "pp_rank", "pp_size", "layers")}
    stale = _fp_dir(tmp_path, old)  # written before the format field existed
    found, fp, stale_dirs = engine_shard_dir(tmp_path, BASE.engine_digest(), "llama")
    assert found == shard0 and fp == BASE
    assert stale_dirs == [stale]
    found1, fp1, _ = engine_shard_dir(tmp_path, BASE.engine_digest(), "llama", tp_rank=1)
    assert fp1.tp_rank == 1 and found1 != shard0
    assert other_model.exists()  # another model's folder is never listed
    assert engine_shard_dir(tmp_path / "missing", BASE.engine_digest(), "llama") == (None, None, [])


def _vllm_config(**parallel):
    fields = {"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1, "data_parallel_size": 1}
    fields.update(parallel)
    return SimpleNamespace(parallel_config=SimpleNamespace(**fields))


@pytest.mark.parametrize("parallel, extra, machine, expect", [
    ({}, {}, "x86_64", None),
    ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, {"agent_socket": "/s"}, "x86_64", None),
    ({"decode_context_parallel_size": 2}, {}, "x86_64", "decode_context_parallel_size = 2"),
    ({"prefill_context_parallel_size": 2}, {}, "x86_64", "prefill_context_parallel_size = 2"),
    ({"data_parallel_size": 2}, {}, "x86_64", None),
    ({"data_parallel_size": 2}, {"agent_socket": "/s"}, "x86_64", "data_parallel_size > 1"),
    ({"data_parallel_size": 2}, {"ssd_tier_dir": "/d", "ssd_tier_bytes": 10}, "x86_64", "data_parallel_size > 1"),
    ({}, {"agent_socket": "/s"}, "aarch64", "agent_socket on aarch64"),
    ({}, {}, "aarch64", None),
])
def test_unsupported_setups_are_named(parallel, extra, machine, expect):
    settings = TierSettings.from_extra({"cpu_tier_bytes": 1 << 20, **extra})
    problem = unsupported_setup(_vllm_config(**parallel), settings, machine=machine)
    if expect is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expect), problem
