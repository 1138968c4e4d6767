"""The gateway process freezes what start-up made out of the cyclic GC's reach (router/edge/app.py),
so a full collection walks only what requests created since, and runs young collections every
``GC_YOUNG_THRESHOLD`` allocations rather than CPython's 700 (put back when it stops)."""
from __future__ import annotations

import gc

from starlette.testclient import TestClient

from conftest import free_ports
from router.config.schema import parse_config
from router.edge.app import GC_YOUNG_THRESHOLD, create_app
from router.gateway import Gateway


def test_start_up_objects_are_frozen_and_young_collections_run_less_often(tiny_model):
    port = free_ports(1)[0]  # nobody listens: the worker is only registered
    cfg = parse_config({"models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": 16}],
                        "health": {"timeout_s": 0.5}, "load_scrape": {"enabled": False},
                        "workers": [{"id": "w0", "url": f"http://127.0.0.1:{port}", "model": "tiny"}]})
    gc.unfreeze()
    before = gc.get_threshold()
    try:
        assert gc.get_freeze_count() == 0
        with TestClient(create_app(Gateway(cfg)).app) as client:
            assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:]) and before[0] != GC_YOUNG_THRESHOLD
            frozen = gc.get_freeze_count()
            assert frozen > 10_000  # the imports and the tokenizer's objects, at least
            assert client.get("/health").status_code == 200
            gc.collect()
            assert gc.get_freeze_count() > frozen * 0.9  # still out of reach (a few died by refcount)
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
