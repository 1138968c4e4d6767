"""The gateway (`kvroute serve`) with Kubernetes discovery on, against the fake API server of
tests/fake_kube_api.py (the real ``kubernetes`` client inside the gateway talks to it) and two
real `kvroute sim` workers standing in for the pods: each fake pod's IP is 127.0.0.1 and its
containerPort named ``http`` is one simulator's port. Checked through ``GET /admin/workers`` and
requests made with the ``openai`` SDK (``x-kvroute-worker``): a pod becomes a worker when Ready,
is drained when it turns not Ready and removed when that lasts, comes back when Ready, is removed
when deleted or missing from the re-list after 410 Gone, and SIGHUP keeps discovered workers; with
a second gateway whose not-ready removal is far off, no ghost workers: an evicted pod whose IP was
cleared, and pods deleted or replaced while the watch was down, leave the worker set at once."""
from __future__ import annotations

import signal

import httpx
import openai
import pytest
import yaml
from openai import OpenAI

from conftest import ADMIN_TOKEN, Proc, free_ports, kvroute_argv, wait_http, wait_until
from fake_kube_api import FakeKubeAPI, make_pod
from test_gateway_e2e import BLOCK, _sim_argv

NS = "kvroute-test"
SELECTOR = "app.kubernetes.io/name=vllm-worker,app.kubernetes.io/part-of=kvroute"
LABELS = {"app.kubernetes.io/name": "vllm-worker", "app.kubernetes.io/part-of": "kvroute"}
NOT_READY_REMOVE_S = 3


@pytest.fixture(scope="module")
def k8s_cluster(tmp_path_factory, tiny_model):
    """``(gateway base URL, fake API, sim ports by pod name, gateway Proc, config path)``."""
    log_dir = tmp_path_factory.mktemp("k8s-gateway")
    started: list[Proc] = []
    fake = FakeKubeAPI().start()
    try:
        *sim_ports, port = free_ports(3)
        sims = {}
        for name, sim_port in zip(("vllm-a", "vllm-b"), sim_ports):
            proc = Proc(name, _sim_argv(tiny_model, sim_port), log_dir)
            started.append(proc)
            sims[name] = sim_port
            wait_http(f"http://127.0.0.1:{sim_port}/health", proc, timeout_s=180)
        cfg = {
            "listen": {"host": "127.0.0.1", "port": port},
            "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
            "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
            "index": {"backend": "memory"},
            "policy": {"name": "kv_aware"},
            "health": {"interval_s": 0.5, "rise_threshold": 1},
            "discovery": {"kubernetes": {
                "api_server": fake.url, "namespace": NS, "label_selector": SELECTOR, "model": "tiny",
                "port": "http", "not_ready_remove_s": NOT_READY_REMOVE_S, "watch_timeout_s": 5,
                "backoff_initial_s": 0.1, "backoff_max_s": 1}},
        }
        path = log_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Proc("gateway", kvroute_argv("serve", "--config", str(path), "--log-level", "info"), log_dir)
        started.append(gw)
        yield f"http://127.0.0.1:{port}", fake, sims, gw, path
    finally:
        for p in reversed(started):
            p.stop()
        fake.stop()


def pod(name: str, sims: dict[str, int], ready: bool = True, labels: dict[str, str] | None = None,
        **kw) -> dict:
    return make_pod(name, sims[name], ready=ready, namespace=NS, labels=labels or LABELS, **kw)


def workers(base: str) -> dict[str, dict]:
    r = httpx.get(base + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    r.raise_for_status()
    return {w["id"]: w for w in r.json()["workers"]}


def routed_to(base: str, text: str) -> str:
    """The worker the gateway sent one chat request to (``x-kvroute-worker``), via the SDK."""
    cli = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = cli.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4)
    assert r.parse().choices[0].message.content is not None
    return r.headers["x-kvroute-worker"]


def test_pods_become_workers_and_go(k8s_cluster):
    base, fake, sims, gw, config_path = k8s_cluster
    fake.put_pod(pod("vllm-a", sims))
    fake.put_pod(pod("vllm-b", sims, ready=False))
    fake.put_pod(pod("vllm-b", sims) | {"metadata": {"name": "redis-0", "namespace": NS,
                                                     "labels": {"app.kubernetes.io/name": "redis"}}})
    wait_http(base + "/health", gw, timeout_s=180)

    # Ready pods only, named after the pod, at the pod IP and its `http` containerPort
    wait_until(lambda: set(workers(base)) == {"vllm-a"}, what="vllm-a discovered")
    a = workers(base)["vllm-a"]
    assert a["url"] == f"http://127.0.0.1:{sims['vllm-a']}" and a["model"] == "tiny"
    wait_until(lambda: workers(base)["vllm-a"]["healthy"], what="vllm-a healthy")
    assert routed_to(base, "hello") == "vllm-a"

    fake.put_pod(pod("vllm-b", sims))  # turns Ready
    wait_until(lambda: set(workers(base)) == {"vllm-a", "vllm-b"}, what="vllm-b discovered")
    wait_until(lambda: all(w["healthy"] for w in workers(base).values()), what="both healthy")

    # a config reload (SIGHUP) applies the file's workers (none) but keeps the discovered ones
    cfg = yaml.safe_load(config_path.read_text())
    config_path.write_text(yaml.safe_dump(cfg | {"policy": {"name": "least_load"}}))
    gw.signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded from" in gw.log_path.read_text(errors="replace"), what="reload")
    assert set(workers(base)) == {"vllm-a", "vllm-b"}

    # not Ready: drained at once (no new requests), still listed
    fake.put_pod(pod("vllm-a", sims, ready=False))
    wait_until(lambda: workers(base)["vllm-a"]["draining"], what="vllm-a drained")
    assert {routed_to(base, f"question {i}") for i in range(4)} == {"vllm-b"}
    fake.put_pod(pod("vllm-a", sims))  # Ready again before not_ready_remove_s: undrained
    wait_until(lambda: not workers(base)["vllm-a"]["draining"], what="vllm-a undrained")

    # not Ready for longer than not_ready_remove_s: removed; Ready again: added again
    fake.put_pod(pod("vllm-a", sims, ready=False))
    wait_until(lambda: set(workers(base)) == {"vllm-b"}, timeout_s=NOT_READY_REMOVE_S + 20, what="vllm-a removed")
    fake.put_pod(pod("vllm-a", sims))
    wait_until(lambda: set(workers(base)) == {"vllm-a", "vllm-b"}, what="vllm-a back")

    # 410 Gone: the gateway lists again and drops the pod deleted while its watch was broken
    lists_before = fake.count(watch=False)
    fake.delete_pod("vllm-a", namespace=NS, record=False)
    fake.compact()
    wait_until(lambda: set(workers(base)) == {"vllm-b"}, what="vllm-a gone after the re-list")
    assert fake.count(watch=False) == lists_before + 1 and fake.gone_sent == ["event"]
    assert {routed_to(base, f"after relist {i}") for i in range(2)} == {"vllm-b"}

    # deleted: removed; no worker left, so the SDK sees the gateway's 503
    fake.delete_pod("vllm-b", namespace=NS)
    wait_until(lambda: workers(base) == {}, what="vllm-b removed")
    with pytest.raises(openai.APIStatusError) as err:
        routed_to(base, "anyone?")
    assert err.value.status_code == 503
    assert httpx.get(base + "/health/ready", timeout=10).status_code == 503
    log = gw.log_path.read_text(errors="replace")
    assert "resourceVersion" in log and "is gone (410): listing again" in log


@pytest.fixture(scope="module")
def k8s_ghosts(k8s_cluster, tmp_path_factory, tiny_model):
    """A second gateway on the same simulators, with its own fake API and not_ready_remove_s
    600: a removal seen within a test's wait is never the not-ready timer's.
    ``(base URL, fake API, sim ports by pod name, gateway Proc)``."""
    _, _, sims, _, _ = k8s_cluster
    log_dir = tmp_path_factory.mktemp("k8s-ghosts")
    fake = FakeKubeAPI().start()
    gw = None
    try:
        (port,) = free_ports(1)
        cfg = {
            "listen": {"host": "127.0.0.1", "port": port},
            "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
            "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK}],
            "index": {"backend": "memory"},
            "policy": {"name": "kv_aware"},
            "health": {"interval_s": 0.5, "rise_threshold": 1},
            "discovery": {"kubernetes": {
                "api_server": fake.url, "namespace": NS, "label_selector": SELECTOR, "model": "tiny",
                "port": "http", "not_ready_remove_s": 600, "watch_timeout_s": 30,
                "backoff_initial_s": 0.1, "backoff_max_s": 0.5}},
        }
        path = log_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Proc("gateway-ghosts", kvroute_argv("serve", "--config", str(path), "--log-level", "info"), log_dir)
        yield f"http://127.0.0.1:{port}", fake, sims, gw
    finally:
        if gw is not None:
            gw.stop()
        fake.stop()


def test_no_ghost_workers(k8s_ghosts):
    base, fake, sims, gw = k8s_ghosts
    fake.put_pod(pod("vllm-a", sims))
    fake.put_pod(pod("vllm-b", sims))
    wait_http(base + "/health", gw, timeout_s=180)
    wait_until(lambda: set(workers(base)) == {"vllm-a", "vllm-b"}, what="both discovered")
    wait_until(lambda: all(w["healthy"] for w in workers(base).values()), what="both healthy")

    # production-stack #1008: the kubelet evicts vllm-a and clears its IP (the phase may say
    # Failed only later): no engine is left there, so the worker goes now, not in 600 s
    fake.put_pod(pod("vllm-a", sims, ready=False, ip=None))
    wait_until(lambda: set(workers(base)) == {"vllm-b"}, what="evicted vllm-a removed")
    assert {routed_to(base, f"after eviction {i}") for i in range(3)} == {"vllm-b"}
    fake.put_pod(pod("vllm-a", sims, uid="uid-vllm-a-2"))  # its replacement, Ready
    wait_until(lambda: set(workers(base)) == {"vllm-a", "vllm-b"}, what="vllm-a's replacement added")

    # production-stack #1091: the watch is cut and cannot reconnect for a while; meanwhile
    # vllm-a is deleted and vllm-b deleted and created again (not Ready yet, same address), and
    # the history is compacted: on resume the gateway lists again (410) and keeps neither
    fake.refuse_watches(503)
    fake.drop_watches()
    wait_until(lambda: fake.open_watches == 0, what="the watch cut")
    fake.delete_pod("vllm-a", namespace=NS)
    fake.delete_pod("vllm-b", namespace=NS)
    fake.put_pod(pod("vllm-b", sims, ready=False, uid="uid-vllm-b-2"))
    fake.compact()
    fake.refuse_watches(None)
    wait_until(lambda: workers(base) == {}, what="vllm-a and the old vllm-b removed")
    fake.put_pod(pod("vllm-b", sims, uid="uid-vllm-b-2"))
    wait_until(lambda: set(workers(base)) == {"vllm-b"} and workers(base)["vllm-b"]["healthy"],
               what="the new vllm-b added")
    assert routed_to(base, "after the gap") == "vllm-b"
