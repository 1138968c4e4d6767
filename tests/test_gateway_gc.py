"""The gateway process freezes what start-up made out of the cyclic GC's reach (router/edge/app.py),
so a full collection walks only what requests created since."""
from __future__ import annotations

import gc

from starlette.testclient import TestClient

from conftest import free_ports
from router.config.schema import parse_config
from router.edge.app import create_app
from router.gateway import Gateway


def test_start_up_objects_are_frozen_out_of_the_cyclic_collector(tiny_model):
    port = free_ports(1)[0]  # nobody listens: the worker is only registered
    cfg = parse_config({"models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": 16}],
                        "health": {"timeout_s": 0.5}, "load_scrape": {"enabled": False},
                        "workers": [{"id": "w0", "url": f"http://127.0.0.1:{port}", "model": "tiny"}]})
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        with TestClient(create_app(Gateway(cfg)).app) as client:
            frozen = gc.get_freeze_count()
            assert frozen > 10_000  # the imports and the tokenizer's objects, at least
            assert client.get("/health").status_code == 200
            gc.collect()
            assert gc.get_freeze_count() > frozen * 0.9  # still out of reach (a few died by refcount)
    finally:
        gc.unfreeze()
