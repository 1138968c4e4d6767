"""``kvroute serve --processes N``: the shared load table and the metrics merge alone, then a real
2-process gateway over two `kvroute sim` workers: both processes answer on one port, one prefix
goes to one worker whichever process routes it, a request in flight through one process counts
in the other's load, admin changes reach every process, ``/admin/decisions`` and ``/metrics``
cover both, and a killed process is started again."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, wait_http, wait_until
from kvcore.index import chain_rows
from router.config.schema import WorkerConfig
from router.processes import supervisor
from router.processes.group import ENV_RUN_DIR, LOAD_FILE, merge_metrics
from router.processes.supervisor import sweep_stale_run_dirs
from router.shared.load_table import MAX_WORKERS, STALE_S, SharedLoadTable, create_table, prefill_end_of
from router.workers.registry import WorkerRegistry
from test_gateway_e2e import BLOCK, Sim, _sim_argv, chat_body


def test_shared_table_sums_the_other_live_rows(tmp_path):
    path = create_table(tmp_path / "load", 3)
    a, b, c = (SharedLoadTable(path, 3, row) for row in range(3))
    assert a.slot("w0") == b.slot("w0") == 0 and b.slot("w1") == 1 == a.slot("w1")  # one name table
    a.publish(a.slot("w1"), in_flight=2, prefill_tokens=300, decoding=1, prefill_end_s=100.0)
    b.publish(b.slot("w1"), in_flight=1, prefill_tokens=50, decoding=0, prefill_end_s=float("inf"))
    seen_by_c = c.others(c.slot("w1"))
    assert (seen_by_c.in_flight, seen_by_c.prefill_tokens, seen_by_c.decoding) == (3, 350, 1)
    assert seen_by_c.prefill_end_s == float("inf")  # one prefill without a prediction
    seen_by_a = a.others(a.slot("w1"))
    assert (seen_by_a.in_flight, seen_by_a.prefill_tokens, seen_by_a.prefill_end_s) == (1, 50, float("inf"))
    assert c.others(c.slot("w0")).in_flight == 0
    # a row whose heartbeat stopped (a dead process) no longer counts
    b.heartbeat(now=time.monotonic() - STALE_S - 1)
    assert c.others(c.slot("w1")).in_flight == 2
    # a restarted process starts from an empty row
    restarted = SharedLoadTable(path, 3, 0)
    assert c.others(c.slot("w1")).in_flight == 0
    with pytest.raises(ValueError):
        restarted.slot("x" * 200)
    with pytest.raises(ValueError):
        SharedLoadTable(path, 4, 0)  # another size
    assert prefill_end_of([]) == 0.0 and prefill_end_of([3.0, 7.5]) == 7.5 and prefill_end_of([3.0, None]) == float("inf")
    assert MAX_WORKERS >= 1024
    for t in (a, b, c, restarted):
        t.close()


def test_a_hold_published_by_one_process_closes_the_worker_to_the_others(tmp_path):
    """A dispatch queue's hold (a reservation, before the request is in flight) counts as a
    pending prefill in every process, with when it was taken, so no other process sends a
    second request there in the meantime."""
    path = create_table(tmp_path / "load", 2)
    tables = [SharedLoadTable(path, 2, row) for row in range(2)]
    regs = []
    for table in tables:
        registry = WorkerRegistry(shared_load=table)
        regs.append(registry.add(WorkerConfig(id="w0", url="http://127.0.0.1:1", model="m")))
    a, b = regs
    key = object()
    held_s = time.monotonic() - 1.0
    a.reserve(key, end_s=None, now_s=held_s)
    assert a.prefills_pending() == 1 and b.prefills_pending() == 1
    assert b.newest_pending_s() == held_s and b.others().pending == 1
    handle = b.begin(100, predicted_ttft_ms=500.0)  # b's own request, sent now
    assert a.prefills_pending() == 2 and a.newest_pending_s() == handle.dispatch_s > held_s
    assert a.unreserve(key) and not a.unreserve(key)
    handle.first_byte()
    assert a.prefills_pending() == b.prefills_pending() == 0 and a.newest_pending_s() == 0.0
    handle.finish()
    for table in tables:
        table.close()


def test_a_claim_excludes_every_other_process(tmp_path):
    """:meth:`SharedLoadTable.claim` is the file's exclusive lock: a second claim (another open
    of the file, as another process has) waits until the first is released."""
    path = create_table(tmp_path / "load", 2)
    a, b = SharedLoadTable(path, 2, 0), SharedLoadTable(path, 2, 1)
    order: list[str] = []
    entered = threading.Event()

    def second() -> None:
        entered.set()
        with b.claim():
            order.append("b")

    with a.claim():
        thread = threading.Thread(target=second)
        thread.start()
        assert entered.wait(10)
        thread.join(0.2)  # b is blocked on the lock, whatever the wait
        assert thread.is_alive()
        order.append("a")
    thread.join(10)
    assert order == ["a", "b"]
    a.close()
    b.close()


def test_merged_metrics_label_each_process():
    one = ('# HELP kvroute_requests_total Requests.\n# TYPE kvroute_requests_total counter\n'
           'kvroute_requests_total{worker="w0",status="200"} 3.0\n'
           '# HELP kvroute_worker_in_flight In flight.\n# TYPE kvroute_worker_in_flight gauge\n'
           'kvroute_worker_in_flight{worker="w0"} 1.0\n')
    two = ('# HELP kvroute_requests_total Requests.\n# TYPE kvroute_requests_total counter\n'
           'kvroute_requests_total{worker="w0",status="200"} 4.0\n')
    merged = merge_metrics({0: one, 1: two}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert fams["kvroute_requests"].type == "counter"
    assert sorted((s.labels["process"], s.value) for s in fams["kvroute_requests"].samples) == [("0", 3.0), ("1", 4.0)]
    assert [(s.labels, s.value) for s in fams["kvroute_worker_in_flight"].samples] == [
        ({"worker": "w0", "process": "0"}, 1.0)]


# ---- a real 2-process gateway --------------------------------------------------------------------
def _fresh(method: str, url: str, **kw) -> httpx.Response:
    """One request on a new connection (the kernel picks the process per connection)."""
    headers = {"Connection": "close", **kw.pop("headers", {})}
    return httpx.request(method, url, headers=headers, timeout=30, **kw)


def _admin(base: str, method: str, path: str, **kw) -> httpx.Response:
    return _fresh(method, base + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, **kw)


def _each_process(base: str, path: str, tries: int = 200) -> dict[str, httpx.Response]:
    """``GET path`` (admin) on fresh connections until both processes have answered."""
    got: dict[str, httpx.Response] = {}
    for _ in range(tries):
        r = _admin(base, "GET", path)
        assert r.status_code == 200, r.text
        got.setdefault(r.headers["x-kvroute-process"], r)
        if len(got) == 2:
            return got
    raise AssertionError(f"only processes {sorted(got)} answered {tries} connections")


def _children(pgid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and b"serve" in cmd and b"--processes" not in cmd and b"timeout" not in cmd[0]:
                out.add(int(d))
    return out


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory, tiny_model):
    log_dir = tmp_path_factory.mktemp("serve-processes")
    started: list[Proc] = []
    try:
        ports = iter(free_ports(7))  # per simulator HTTP, KV events, replay; then the gateway
        sims, events = {}, {}
        for name in ("w0", "w1"):
            sim_port, ev, rp = next(ports), next(ports), next(ports)
            argv = _sim_argv(tiny_model, sim_port)
            argv[argv.index("--speedup") + 1] = "1"  # real decode speed: a long answer stays in flight
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"})]
            events[name] = {"events": f"tcp://127.0.0.1:{ev}", "replay": f"tcp://127.0.0.1:{rp}"}
            proc = Proc(name, argv, log_dir)
            started.append(proc)
            sims[name] = Sim(name, f"http://127.0.0.1:{sim_port}", proc)
        for sim in sims.values():
            wait_http(sim.url + "/health", sim.proc, timeout_s=180)
        import yaml

        port = next(ports)
        cfg = {"listen": {"host": "127.0.0.1", "port": port},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
               "workers": [{"id": n, "url": s.url, "model": "tiny", **events[n]} for n, s in sims.items()],
               "policy": {"name": "kv_aware"}}
        path = log_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Proc("gateway", kvroute_argv("serve", "--config", str(path), "--processes", "2"), log_dir)
        started.append(gw)
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health", gw, timeout_s=180)
        wait_until(lambda: len(_children(gw.popen.pid)) == 2, what="two gateway processes")
        yield base, sims, gw
    finally:
        for p in reversed(started):
            p.stop()


def test_both_processes_route_one_prefix_to_one_worker(two_procs):
    base, _, _ = two_procs
    answers = _each_process(base, "/admin/workers")
    for r in answers.values():  # every process has both workers, healthy, and hears their KV events
        assert {w["id"]: (w["healthy"], w["events_live"]) for w in r.json()["workers"]} == {
            "w0": (True, True), "w1": (True, True)}
    first = _fresh("POST", base + "/v1/chat/completions", json=chat_body("processes-shared", "q0"))
    home = first.headers["x-kvroute-worker"]
    # one process writes the worker's KV events into the index both read: wait until both credit it
    body = chat_body("processes-shared", "another question")
    def credited_by(process: str) -> bool:
        for _ in range(50):
            r = _admin(base, "POST", "/admin/explain", json=body)
            if r.headers["x-kvroute-process"] == process:
                return r.json()["chosen"] == home and r.json()["reason"] == "prefix_hit"
        raise AssertionError(f"process {process} never answered")

    wait_until(lambda: credited_by("0") and credited_by("1"), what="both processes crediting the prefix")
    workers = {_fresh("POST", base + "/v1/chat/completions", json=chat_body("processes-shared", f"q{i}"))
               .headers["x-kvroute-worker"] for i in range(8)}
    assert workers == {home}
    decisions = _admin(base, "GET", "/admin/decisions").json()["decisions"]
    assert len(decisions) >= 9 and {d["worker"] for d in decisions[:8]} == {home}
    times = [d["time_unix_s"] for d in decisions]
    assert times == sorted(times, reverse=True)  # merged over both processes, newest first


def test_in_flight_through_one_process_counts_in_the_other(two_procs):
    base, _, _ = two_procs
    body = {**chat_body("processes-load", "tell a long story"), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:  # one connection: one process holds the stream
        with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            worker = resp.headers["x-kvroute-worker"]
            lines = resp.iter_lines()  # kept: dropping the iterator would close the stream
            first = next(lines)  # the answer is under way
            assert first.startswith("data: {"), first
            answers = _each_process(base, "/admin/workers")
            for r in answers.values():
                entry = {w["id"]: w for w in r.json()["workers"]}[worker]
                assert entry["in_flight"] == entry["decoding"] == 1, (r.headers["x-kvroute-process"], entry)
            assert sum(1 for line in lines if line.startswith("data: {")) >= 400
    wait_until(lambda: all({w["id"]: w for w in r.json()["workers"]}[worker]["in_flight"] == 0
                           for r in _each_process(base, "/admin/workers").values()),
               what="the finished stream released in every process")


def test_admin_changes_reach_every_process(two_procs):
    base, sims, _ = two_procs
    r = _admin(base, "DELETE", "/admin/workers/w1")
    assert r.status_code == 200
    for r in _each_process(base, "/admin/workers").values():
        assert [w["id"] for w in r.json()["workers"]] == ["w0"]
    r = _admin(base, "POST", "/admin/workers", json={"id": "w1", "url": sims["w1"].url, "model": "tiny"})
    assert r.status_code == 201, r.text
    wait_until(lambda: all(sorted(w["id"] for w in r.json()["workers"]) == ["w0", "w1"]
                           for r in _each_process(base, "/admin/workers").values()), what="w1 back everywhere")
    policy = {"name": "least_load"}
    assert _admin(base, "PUT", "/admin/policy", json=policy).status_code == 200
    for _ in range(20):
        assert _admin(base, "GET", "/admin/policy").json()["name"] == "least_load"
    assert _admin(base, "PUT", "/admin/policy", json={"name": "kv_aware"}).status_code == 200
    merged = _fresh("GET", base + "/metrics").text
    processes = {s.labels.get("process") for f in text_string_to_metric_families(merged)
                 if f.name == "kvroute_in_flight" for s in f.samples}
    assert processes == {"0", "1"}


def test_one_process_probes_and_scrapes_the_workers_for_both(two_procs):
    """Process 0 calls the workers; process 1 only applies its results (router.shared.probe_table)."""
    base, _, _ = two_procs

    def counts() -> tuple[dict, dict]:
        fams = {f.name: f for f in text_string_to_metric_families(_fresh("GET", base + "/metrics").text)}
        return tuple({(x.labels["process"], x.labels["kind"]): x.value for x in fams[name].samples}
                     for name in ("kvroute_worker_calls", "kvroute_worker_results_applied"))

    made0, applied0 = counts()
    wait_until(lambda: counts()[0][("0", "scrape")] >= made0[("0", "scrape")] + 6,
               timeout_s=30, what="process 0 scraping both workers 3 more times")
    made1, applied1 = counts()
    assert made1[("1", "scrape")] == made0[("1", "scrape")] and made1[("1", "health")] == made0[("1", "health")]
    # process 1 applied each worker's first results at least (idle workers' later ones change
    # nothing, so their records do not move), and keeps their figures' age from the records
    assert applied1[("1", "scrape")] >= 2 and applied1[("1", "health")] >= 2
    assert applied1.get(("0", "scrape"), 0) == applied0.get(("0", "scrape"), 0)  # the prober applies nothing
    for proc, r in _each_process(base, "/admin/workers").items():
        for w in r.json()["workers"]:
            assert w["healthy"] is True and w["engine"]["running"] is not None, (proc, w)
            assert w["engine"]["scrape_age_s"] < 3.0, (proc, w)  # scrape interval 1 s


def _credited_everywhere(base: str, body: dict, home: str) -> bool:
    """Whether both processes find ``body``'s prefix cached on ``home`` (gpu blocks > 0). The one
    that routed the first request also has its own speculative entries; the other has only what
    the index's writer ingested from the worker's KV events."""
    seen: dict[str, bool] = {}
    for _ in range(60):
        r = _admin(base, "POST", "/admin/explain", json=body)
        cand = {c["worker"]: c for c in r.json()["candidates"]}
        seen[r.headers["x-kvroute-process"]] = cand[home]["matched_blocks"]["gpu"] > 0
        if len(seen) == 2:
            return all(seen.values())
    raise AssertionError(f"only processes {sorted(seen)} answered")


def test_one_index_for_both_and_a_reader_takes_over_when_the_writer_dies(two_procs):
    """The processes share one host index (one writer ingests the KV events); killing the
    writer hands the writing to the other, and new prefixes are indexed again."""
    base, sims, gw = two_procs
    index = {p: r.json() for p, r in _each_process(base, "/admin/index").items()}
    views = {p: v["host_index"] for p, v in index.items()}
    assert sorted(v["writer"] for v in views.values()) == [False, True]
    passes = "native" if chain_rows.native is not None else "numpy"  # the C extension where it is built
    assert {v["lookup_passes"] for v in index.values()} == {passes}
    assert len({v["writer_pid"] for v in views.values()}) == 1
    writer_pid = views["0"]["writer_pid"]
    assert writer_pid in _children(gw.popen.pid)
    takeovers = views["0"]["takeovers"]
    for r in _each_process(base, "/admin/workers").values():  # the reader follows the writer's streams
        assert {w["id"]: w["events_live"] for w in r.json()["workers"]}["w0"] is True
    def states() -> list:
        return [r.json()["workers"]["w0"]["kv_events"] for r in _each_process(base, "/admin/index").values()]
    for state in wait_until(lambda: all(states()) and states(), what="the writer's ingest state on the board"):
        assert (state["worker"], state["index_synced"]) == ("w0", True)

    assert _admin(base, "POST", "/admin/workers/w1/drain").status_code == 200  # w0 has the events
    home = _fresh("POST", base + "/v1/chat/completions", json=chat_body("host-index-before", "q")).headers["x-kvroute-worker"]
    assert home == "w0"
    wait_until(lambda: _credited_everywhere(base, chat_body("host-index-before", "other"), home),
               what="both processes crediting the prefix from the one index")

    os.kill(writer_pid, signal.SIGKILL)

    def taken_over() -> bool:
        try:
            views = [r.json()["host_index"] for r in _each_process(base, "/admin/index").values()]
        except httpx.HTTPError:  # a connection the kernel queued on the killed process's socket
            return False
        return all(v["takeovers"] == takeovers + 1 and v["writer_pid"] != writer_pid for v in views)

    wait_until(taken_over, timeout_s=60, what="another process writing the index")
    # the restarted process has w1 undrained (admin changes are not replayed to a new process):
    # new prefixes until one lands on w0, whose events the new writer ingests
    prefix = next(f"host-index-after-{i}" for i in range(20) if _fresh(
        "POST", base + "/v1/chat/completions", json=chat_body(f"host-index-after-{i}", "q")).headers["x-kvroute-worker"] == "w0")
    wait_until(lambda: _credited_everywhere(base, chat_body(prefix, "other"), "w0"),
               timeout_s=60, what="a prefix sent after the takeover credited by both processes")
    for r in _each_process(base, "/admin/workers").values():
        assert {w["id"]: w["events_live"] for w in r.json()["workers"]}["w0"] is True
    assert _admin(base, "DELETE", "/admin/workers/w1").status_code == 200  # undrained for the next test
    assert _admin(base, "POST", "/admin/workers", json={"id": "w1", "url": sims["w1"].url, "model": "tiny"}).status_code == 201


def test_a_killed_process_is_started_again(two_procs):
    base, _, gw = two_procs
    before = _children(gw.popen.pid)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(_children(gw.popen.pid)) == 2 and victim not in _children(gw.popen.pid),
               timeout_s=60, what="a new gateway process")
    wait_until(lambda: len(_each_process(base, "/admin/workers")) == 2, timeout_s=60, what="both answering")
    assert _fresh("POST", base + "/v1/chat/completions", json=chat_body("after-restart")).status_code == 200


def test_gateway_processes_stop_when_the_supervisor_is_killed(tmp_path, tiny_model):
    import yaml

    port, dead = free_ports(2)
    cfg = {"listen": {"host": "127.0.0.1", "port": port},
           "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
           "workers": [{"id": "w0", "url": f"http://127.0.0.1:{dead}", "model": "tiny"}]}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw = Proc("gateway", kvroute_argv("serve", "--config", str(path), "--processes", "2"), tmp_path)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", gw, timeout_s=120)
        wait_until(lambda: len(_children(gw.popen.pid)) == 2, what="two gateway processes")
        children = _children(gw.popen.pid)
        run_dir = Path(_environ(min(children))[ENV_RUN_DIR])
        assert (run_dir / LOAD_FILE).is_file()
        supervisor = next(int(d) for d in os.listdir("/proc") if d.isdigit() and _is_supervisor(int(d), gw.popen.pid))
        os.kill(supervisor, signal.SIGKILL)
        wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in children),
                   timeout_s=60, what="the gateway processes ending with their supervisor")
        # SIGKILL left the run folder behind; the next supervisor's sweep removes it
        assert run_dir.is_dir()
        assert run_dir in sweep_stale_run_dirs(str(run_dir.parent))
        assert not run_dir.exists()
    finally:
        gw.stop()


def test_the_sweep_removes_only_run_folders_no_live_supervisor_holds(tmp_path):
    live = tmp_path / "kvroute-serve-live"
    dead = tmp_path / "kvroute-serve-dead"
    young = tmp_path / "kvroute-serve-young"
    old = tmp_path / "kvroute-serve-old"
    other = tmp_path / "not-ours"
    for d in (live, dead, young, old, other):
        d.mkdir()
        (d / LOAD_FILE).write_bytes(b"x")
    (dead / "owner.lock").touch()
    held = supervisor._take_lock(live / "owner.lock")
    assert held is not None
    try:
        now = time.time()
        os.utime(old, (now - 3600, now - 3600))
        os.utime(other, (now - 3600, now - 3600))
        removed = sweep_stale_run_dirs(str(tmp_path), now_s=now)
        assert sorted(p.name for p in removed) == ["kvroute-serve-dead", "kvroute-serve-old"]
        assert live.is_dir() and young.is_dir() and other.is_dir()
        assert not dead.exists() and not old.exists()
        assert supervisor._take_lock(live / "owner.lock") is None  # still held: left alone
    finally:
        os.close(held)
    assert [p.name for p in sweep_stale_run_dirs(str(tmp_path), now_s=time.time())] == ["kvroute-serve-live"]


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _is_supervisor(pid: int, pgid: int) -> bool:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(stat[2]) == pgid and b"--processes" in cmd and b"timeout" not in cmd[0]


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_supervisor_sleeps_until_a_signal_or_a_due_restart():
    """Between checks the supervisor sleeps on the signals' wake-up fd: a signal (here SIGCHLD,
    sent before the sleep, as one landing just before it would be) ends the sleep at once; the
    sleep is otherwise as long as the next restart's back-off allows, at most IDLE_WAIT_S."""
    from router.processes import supervisor as sv

    wake = sv._SignalWake()
    try:
        os.kill(os.getpid(), signal.SIGCHLD)
        t0 = time.monotonic()
        wake.wait(600.0)
        assert time.monotonic() - t0 < 60.0  # the signal, not the 600 s timeout, ended it
    finally:
        wake.close()
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL

    sup = sv.Supervisor.__new__(sv.Supervisor)  # only _wait_s's fields
    sup.children = [object(), None, None]
    sup.restart_at = [0.0, 100.25, 100.75]
    assert sup._wait_s(100.0) == 0.25
    assert sup._wait_s(101.0) == 0.0
    sup.children = [object(), object(), object()]
    assert sup._wait_s(100.0) == sv.IDLE_WAIT_S


def test_prefill_left_is_the_latest_predicted_end_of_every_process(tmp_path):
    """A worker's predicted prefill left (the dispatch queue's opening rule) is the latest end
    among this process's requests, its holds and the other processes' requests: inf once any of
    them is unpredicted or past its end without a first byte, 0 with none pending."""
    path = create_table(tmp_path / "load", 2)
    tables = [SharedLoadTable(path, 2, row) for row in range(2)]
    a, b = (WorkerRegistry(shared_load=t).add(WorkerConfig(id="w0", url="http://127.0.0.1:1", model="m"))
            for t in tables)
    now = time.monotonic()
    assert a.prefill_left_ms(now) == b.prefill_left_ms(now) == 0.0
    mine = a.begin(100, predicted_ttft_ms=400.0)
    now = mine.dispatch_s
    assert a.prefill_left_ms(now) == pytest.approx(400.0) and b.prefill_left_ms(now) == pytest.approx(400.0)
    theirs = b.begin(100, predicted_ttft_ms=900.0)  # the other process's, ending later
    assert a.prefill_left_ms(now) == pytest.approx((theirs.dispatch_s + 0.9 - now) * 1000.0)
    key = object()
    a.reserve(key, end_s=now + 2.0, now_s=now)  # a hold ending later still
    assert a.prefill_left_ms(now) == pytest.approx(2000.0) and b.prefill_left_ms(now) == pytest.approx(2000.0)
    assert a.prefill_left_ms(now + 0.5) == float("inf")  # mine is past its end without a first byte
    mine.first_byte()
    assert a.prefill_left_ms(now + 0.5) == pytest.approx(1500.0)
    assert a.prefill_left_ms(now + 1.0) == float("inf")  # theirs overdue, seen through the table
    a.unreserve(key)
    unpredicted = b.begin(50)
    assert a.prefill_left_ms(now) == float("inf") == b.prefill_left_ms(now)
    for handle in (mine, theirs, unpredicted):
        handle.first_byte()
        handle.finish()
    assert a.prefill_left_ms(now) == b.prefill_left_ms(now) == 0.0
    for table in tables:
        table.close()
