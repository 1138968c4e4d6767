"""The TTFT split of a kvroute run (``kvbench/ttft_split.py``): client records paired with
the gateway's decision log by workload index, each part's p50/p90/mean."""
from __future__ import annotations

from kvbench.ttft_split import describe, ttft_split


def _decision(index: int, gateway_ms, queue_ms, worker_ms) -> dict:
    return {"request_id": f"bench-{index}-0123abcd", "gateway_ms": gateway_ms, "queue_wait_ms": queue_ms,
            "upstream_ttft_ms": worker_ms}


def test_parts_add_up_to_the_client_ttft_and_unpaired_requests_are_left_out():
    records = [{"index": i, "ttft_ms": ttft} for i, ttft in enumerate([100.0, 60.0, 200.0, 50.0, None])]
    decisions = [
        _decision(0, 4.0, 0.0, 90.0),     # relay 6
        _decision(1, 2.0, 10.0, 40.0),    # relay 8
        _decision(2, 10.0, 100.0, 80.0),  # relay 10
        _decision(3, None, 0.0, 40.0),    # sent by a gateway that logs no gateway_ms: left out
        _decision(4, 3.0, 0.0, 30.0),     # the client saw no first token: left out
        _decision(9, 3.0, 0.0, 30.0),     # no such record
        {"request_id": "other-1", "gateway_ms": 1.0, "upstream_ttft_ms": 1.0},  # not the bench's
    ]
    split = ttft_split(records, decisions)
    assert split["requests"] == 3
    assert split["gateway"] == {"p50": 4.0, "p90": 8.8, "mean": 5.3}
    assert split["queue"] == {"p50": 10.0, "p90": 82.0, "mean": 36.7}
    assert split["worker"] == {"p50": 80.0, "p90": 88.0, "mean": 70.0}
    assert split["relay"] == {"p50": 8.0, "p90": 9.6, "mean": 8.0}
    assert describe(split) == "TTFT split, mean/p90 ms: gateway 5/9, queue 37/82, worker 70/88, relay 8/10"


def test_nothing_paired_is_none():
    assert ttft_split([{"index": 0, "ttft_ms": 10.0}], [_decision(0, None, 0.0, 5.0)]) is None
    assert ttft_split([], []) is None
