"""Every limit of ``admission`` holds for the gateway as a whole with ``kvroute serve
--processes 2`` (router.route.shared_admission), end to end: one worker (tests/bad_worker.py ``slow``:
it holds each request 2 s and counts how many it holds at once) behind a real 2-process gateway,
10 concurrent requests on new connections (the kernel spreads connections over the processes):

- ``max_in_flight_per_worker: 1, max_queued: 0``: one request at the worker at a time, the other
  nine refused with admission's 429 in the OpenAI error shape, and ``/metrics`` (every process's
  series, labelled ``process``) sums to those counts;
- ``max_queued: 2``: at most 2 wait in the whole gateway; 3 are served one after another;
- a process killed (``SIGKILL``) while it holds the slot: the slot is free again at once for the
  other process, while the worker still holds the dead process's request.

Each check runs on bursts until both processes have had requests (so a burst that the kernel
happened to give to one process alone proves nothing and is sent again)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Proc, free_ports, kvroute_argv, wait_http, wait_until
from test_gateway_e2e import BLOCK, chat_body
from test_serve_processes import _children, _each_process, _environ, _fresh

HERE = Path(__file__).resolve().parent
HOLD_S = 2.0
BURST = 10


@pytest.fixture
def cluster(tmp_path, tiny_model):
    """``start(admission) -> (gateway URL, gateway Proc, worker URL)``: a slow worker and a
    2-process gateway in front of it; all stopped at teardown."""
    started: list[Proc] = []

    def start(admission: dict) -> tuple[str, Proc, str]:
        import yaml

        worker_port, port = free_ports(2)
        worker = Proc("slow", [sys.executable, str(HERE / "bad_worker.py"), "--port", str(worker_port),
                               "--mode", "slow", "--hold-s", str(HOLD_S), "--life-s", "300"], tmp_path)
        started.append(worker)
        worker_url = f"http://127.0.0.1:{worker_port}"
        wait_http(worker_url + "/health", worker, timeout_s=30)
        cfg = {"listen": {"host": "127.0.0.1", "port": port},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
               "workers": [{"id": "w0", "url": worker_url, "model": "tiny"}],
               "timeouts": {"shutdown_grace_s": 2},
               "admission": admission}
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Proc("gateway", kvroute_argv("serve", "--config", str(path), "--processes", "2"), tmp_path,
                  deadline_s=300)
        started.append(gw)
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health", gw, timeout_s=180)
        wait_until(lambda: len(_children(gw.popen.pid)) == 2, what="two gateway processes")
        wait_until(lambda: all(r.json()["workers"][0]["healthy"] for r in _each_process(base, "/admin/workers").values()),
                   timeout_s=60, what="w0 healthy in both processes")
        return base, gw, worker_url

    yield start
    for p in reversed(started):
        p.stop()


def _stats(worker_url: str) -> dict:
    return httpx.get(worker_url + "/stats", timeout=10).json()


def _series(base: str) -> dict[str, list]:
    """The merged ``/metrics``: samples by name."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(_fresh("GET", base + "/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _total(series: dict[str, list], name: str, **labels) -> float:
    """A metric summed over the processes (and any label not given)."""
    return sum(s.value for s in series.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def _by_process(series: dict[str, list], name: str, **labels) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in series.get(name, []):
        if all(s.labels.get(k) == v for k, v in labels.items()):
            out[s.labels["process"]] = out.get(s.labels["process"], 0.0) + s.value
    return out


def _burst(base: str, tag: str, n: int = BURST, **extra) -> tuple[list, list[threading.Thread]]:
    """``n`` chat requests at once, each on a new connection; returns the answer list (filled as
    they come: ``httpx.Response`` or the exception) and the threads."""
    answers: list = []
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait(30)
        try:
            answers.append(_fresh("POST", base + "/v1/chat/completions",
                                  json=chat_body(f"{tag}-{i}", "q", **extra)))
        except httpx.HTTPError as exc:
            answers.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return answers, threads


def _assert_overloaded(r: httpx.Response) -> None:
    """Admission's refusal, as a single process answers it."""
    assert r.status_code == 429, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "rate_limit_error",
                                  "param": None, "code": "gateway_overloaded"}}
    assert "capacity" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1


def _requests_by_process(base: str) -> dict[str, float]:
    return _by_process(_series(base), "kvroute_requests_total")


def test_one_slot_means_one_request_at_the_worker_whatever_the_process(cluster):
    base, _, worker = cluster({"max_in_flight_per_worker": 1, "max_queued": 0})
    bursts = 0
    while True:
        bursts += 1
        served_before = _stats(worker)["served"]
        answers, threads = _burst(base, f"cap{bursts}")
        wait_until(lambda: len(answers) >= BURST - 1, timeout_s=60, what="nine answers")
        assert [getattr(a, "status_code", a) for a in answers[:BURST - 1]] == [429] * (BURST - 1)  # at once
        during = _series(base)  # the admitted request is still at the worker (2 s)
        assert _total(during, "kvroute_admission_in_flight") == 1
        assert _total(during, "kvroute_admission_queued") == 0
        assert _stats(worker)["active"] == 1
        for t in threads:
            t.join(60)
        assert not any(isinstance(a, Exception) for a in answers), answers
        ok = [a for a in answers if a.status_code == 200]
        assert len(ok) == 1 and ok[0].headers["x-kvroute-worker"] == "w0"
        for a in answers:
            if a.status_code != 200:
                _assert_overloaded(a)
        stats = _stats(worker)
        assert stats["max_active"] == 1 and stats["served"] == served_before + 1, stats
        if len(_requests_by_process(base)) == 2 or bursts == 4:
            break
    assert len(_requests_by_process(base)) == 2, "the kernel gave every connection to one process"
    after = wait_until(lambda: (s := _series(base)) and _total(s, "kvroute_admission_in_flight") == 0 and s,
                       what="the slot released")
    assert _total(after, "kvroute_admission_rejected_total", reason="queue_full") == 9 * bursts
    assert _total(after, "kvroute_requests_total", worker="w0", status="200") == bursts
    assert _total(after, "kvroute_requests_total", worker="none", status="429") == 9 * bursts
    assert _total(after, "kvroute_admission_queued") == 0


def test_at_most_max_queued_wait_in_the_whole_gateway(cluster):
    base, _, worker = cluster({"max_in_flight_per_worker": 1, "max_queued": 2, "queue_timeout_s": 60})
    bursts = 0
    while True:
        bursts += 1
        served_before = _stats(worker)["served"]
        answers, threads = _burst(base, f"queue{bursts}")
        wait_until(lambda: len(answers) >= BURST - 3, timeout_s=60, what="seven answers")
        assert [getattr(a, "status_code", a) for a in answers[:BURST - 3]] == [429] * (BURST - 3)  # at once
        during = _series(base)
        assert _total(during, "kvroute_admission_in_flight") == 1
        assert _total(during, "kvroute_admission_queued") == 2  # 1 at the worker, 2 waiting, the rest refused
        for t in threads:
            t.join(60)
        assert not any(isinstance(a, Exception) for a in answers), answers
        assert sorted(a.status_code for a in answers) == [200] * 3 + [429] * 7
        for a in answers:
            if a.status_code == 429:
                _assert_overloaded(a)
        stats = _stats(worker)
        assert stats["max_active"] == 1 and stats["served"] == served_before + 3, stats
        if len(_requests_by_process(base)) == 2 or bursts == 4:
            break
    assert len(_requests_by_process(base)) == 2, "the kernel gave every connection to one process"
    after = wait_until(lambda: (s := _series(base)) and _total(s, "kvroute_admission_in_flight") == 0 and s,
                       what="the slots released")
    assert _total(after, "kvroute_admission_rejected_total", reason="queue_full") == 7 * bursts
    assert _total(after, "kvroute_admission_queued") == 0
    assert _total(after, "kvroute_admission_wait_seconds_count") == 2 * bursts  # the two that waited


def test_a_killed_process_frees_its_slot_for_the_other(cluster):
    base, gw, worker = cluster({"max_in_flight_per_worker": 1, "max_queued": 0})
    long_answer: list = []

    def held() -> None:  # held 60 s at the worker: its end cannot be what frees the slot
        try:
            long_answer.append(httpx.post(base + "/v1/chat/completions", headers={"Connection": "close"},
                                          json=chat_body("killed-holder", "q", test_hold_s=60), timeout=90))
        except httpx.HTTPError as exc:
            long_answer.append(exc)

    threading.Thread(target=held, daemon=True).start()
    holder = wait_until(lambda: [p for p, v in _by_process(_series(base), "kvroute_admission_in_flight").items() if v == 1],
                        what="a process holding the slot")[0]
    assert _stats(worker)["active"] == 1
    other = "1" if holder == "0" else "0"
    # the other process has no slot either: its requests are refused while the holder lives
    for i in range(60):
        r = _fresh("POST", base + "/v1/chat/completions", json=chat_body(f"killed-before-{i}", "q", test_hold_s=0.1))
        _assert_overloaded(r)
        if _by_process(_series(base), "kvroute_admission_rejected_total").get(other, 0) >= 1:
            break
    else:
        raise AssertionError("no request reached the process without the slot")
    pid = next(p for p in _children(gw.popen.pid) if _environ(p).get("KVROUTE_PROCESS_INDEX") == holder)
    os.kill(pid, signal.SIGKILL)

    def admitted() -> httpx.Response | None:
        try:
            r = _fresh("POST", base + "/v1/chat/completions", json=chat_body("killed-after", "q", test_hold_s=0.1))
        except httpx.HTTPError:  # a connection the kernel queued on the killed process's socket
            return None
        return r if r.status_code == 200 else None

    r = wait_until(admitted, timeout_s=60, what="a request admitted after the holder was killed")
    assert r.headers["x-kvroute-worker"] == "w0"
    assert _stats(worker)["active"] == 1  # the dead process's request is still at the worker
    wait_until(lambda: isinstance(long_answer[0], Exception) if long_answer else False, what="the holder's client cut off")
    after = wait_until(lambda: (s := _series(base)) and len(_by_process(s, "kvroute_requests_total")) >= 1
                       and _total(s, "kvroute_admission_in_flight") == 0 and s, what="no slot held")
    assert _total(after, "kvroute_admission_queued") == 0
