"""Kubernetes worker discovery without a cluster: the pure pod -> worker mapping, the config
section, and :class:`router.workers.discovery.kubernetes.KubernetesDiscovery` with the real
``kubernetes`` client against the fake API server of tests/fake_kube_api.py (list, watch from
the list's resourceVersion, 410 Gone as an event and as a status, API errors with backoff,
prompt stop, role labels), changing a stand-in gateway that has the real worker registry. The gateway
process itself with discovery on is tests/test_k8s_gateway_e2e.py."""
from __future__ import annotations

import asyncio
import time

import pytest
import yaml

from fake_kube_api import FakeKubeAPI, make_pod
from router.config.discovery import KubernetesDiscoveryConfig
from router.config.schema import WorkerConfig, parse_config, same_target
from router.errors import WorkerExists
from router.workers.discovery.kubernetes import KubernetesDiscovery
from router.workers.discovery.pods import map_pod, resolve_port
from router.workers.registry import WorkerRegistry

SELECTOR = "app.kubernetes.io/name=vllm-worker"


def k8s_cfg(**kw) -> KubernetesDiscoveryConfig:
    base = {"label_selector": SELECTOR, "model": "tiny", "port": "http"}
    return KubernetesDiscoveryConfig.model_validate({**base, **kw})


# ---- the pure mapping ------------------------------------------------------------------------
def test_ready_pod_maps_to_worker_named_after_it():
    pod = make_pod("vllm-0", 8000, ip="10.1.2.3", extra_ports={"kv-events": 5557, "kv-replay": 5558})
    view = map_pod(pod, k8s_cfg(events_port="kv-events", replay_port="kv-replay"))
    assert view.state == "ready" and view.reason == ""
    assert view.worker == WorkerConfig(id="vllm-0", url="http://10.1.2.3:8000", model="tiny",
                                       events="tcp://10.1.2.3:5557", replay="tcp://10.1.2.3:5558")
    # numbers are used as they are; https; no events without events_port (an agent sidecar feeds Redis)
    view = map_pod(pod, k8s_cfg(port=9000, scheme="https"))
    assert view.worker == WorkerConfig(id="vllm-0", url="https://10.1.2.3:9000", model="tiny")
    assert view.worker.events is None and view.worker.replay is None


def test_ipv6_pod_ip_in_brackets():
    view = map_pod(make_pod("p", 8000, ip="fd00::12", extra_ports={"kv-events": 5557}),
                   k8s_cfg(events_port="kv-events"))
    assert view.worker.url == "http://[fd00::12]:8000" and view.worker.events == "tcp://[fd00::12]:5557"


@pytest.mark.parametrize("change,state,reason", [
    (lambda p: p["status"]["conditions"][1].update(status="False"), "not_ready", "condition Ready"),
    (lambda p: p["status"].update(conditions=[]), "not_ready", "condition Ready"),
    (lambda p: p["status"].pop("podIP"), "not_ready", "no pod IP"),
    (lambda p: p["status"].update(phase="Pending"), "not_ready", "phase Pending"),
    (lambda p: p["spec"]["containers"][0]["ports"].clear(), "not_ready", "no containerPort named 'http'"),
    (lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"), "gone", "terminating"),
    (lambda p: p["status"].update(phase="Failed"), "gone", "phase Failed"),
    (lambda p: p["status"].update(phase="Succeeded"), "gone", "phase Succeeded"),
    # a kubelet eviction: phase Failed, reason Evicted, the IP cleared; the reason alone is enough
    (lambda p: (p["status"].update(phase="Failed", reason="Evicted"), p["status"].pop("podIP")),
     "gone", "phase Failed (Evicted)"),
    (lambda p: p["status"].update(reason="Evicted"), "gone", "evicted"),
])
def test_pods_that_do_not_serve(change, state, reason):
    pod = make_pod("p", 8000)
    change(pod)
    view = map_pod(pod, k8s_cfg())
    assert (view.state, view.worker) == (state, None) and view.reason.startswith(reason)


ROLE = "kvroute.io/role"
WORKER_LABELS = {"app.kubernetes.io/name": "vllm-worker"}


def test_role_label_gives_the_worker_role():
    assert map_pod(make_pod("p", 8000), k8s_cfg()).worker.role == "both"  # no label: both
    for role in ("prefill", "decode", "both"):
        view = map_pod(make_pod("p", 8000, labels={**WORKER_LABELS, ROLE: role}), k8s_cfg())
        assert view.worker == WorkerConfig(id="p", url="http://127.0.0.1:8000", model="tiny", role=role)
    # another label name; the default one is then just a label
    pod = make_pod("p", 8000, labels={**WORKER_LABELS, "example.com/leg": "decode", ROLE: "prefill"})
    assert map_pod(pod, k8s_cfg(role_label="example.com/leg")).worker.role == "decode"
    assert map_pod(pod, k8s_cfg(role_label="leg")).worker.role == "both"


@pytest.mark.parametrize("value", ["Prefill", "prefiller", "", "decode "])
def test_bad_role_label_refuses_the_pod(value):
    pod = make_pod("p", 8000, labels={**WORKER_LABELS, ROLE: value})
    with pytest.raises(ValueError, match=f"label {ROLE}={value!r} is not one of both, prefill, decode"):
        map_pod(pod, k8s_cfg())
    with pytest.raises(ValueError):  # not ready yet: refused all the same (the operator hears early)
        map_pod(make_pod("p", 8000, ready=False, labels={**WORKER_LABELS, ROLE: value}), k8s_cfg())
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # going anyway: just gone
    assert map_pod(pod, k8s_cfg()).state == "gone"


def test_named_port_first_container_wins_and_missing_name():
    pod = make_pod("p", 8000)
    pod["spec"]["containers"].append({"name": "agent", "ports": [{"name": "http", "containerPort": 9999},
                                                                 {"name": "metrics", "containerPort": 9100}]})
    assert resolve_port(pod, "http") == 8000 and resolve_port(pod, "metrics") == 9100
    assert resolve_port(pod, "nope") is None and resolve_port(pod, 1234) == 1234
    with pytest.raises(ValueError):
        map_pod({"metadata": {}}, k8s_cfg())


def test_discovery_config_validated_with_the_gateway_config():
    base = {"models": [{"name": "tiny", "block_size": 16}], "policy": {"name": "kv_aware"}}
    cfg = parse_config({**base, "discovery": {"kubernetes": {"label_selector": SELECTOR, "model": "tiny"}}})
    k = cfg.discovery.kubernetes
    assert (k.port, k.scheme, k.events_port, k.namespace, k.not_ready_remove_s) == (8000, "http", None, None, 30.0)
    assert k.role_label == "kvroute.io/role"
    assert parse_config(base).discovery.kubernetes is None
    bad = [
        ({"label_selector": SELECTOR, "model": "other"}, "is not a model"),
        ({"label_selector": SELECTOR, "model": "tiny", "port": "HTTP"}, "containerPort name"),
        ({"label_selector": SELECTOR, "model": "tiny", "port": 70000}, "not in 1..65535"),
        ({"label_selector": SELECTOR, "model": "tiny", "scheme": "ftp"}, "scheme"),
        ({"label_selector": SELECTOR, "model": "tiny", "replay_port": 5558}, "replay_port needs events_port"),
        ({"label_selector": SELECTOR, "model": "tiny", "api_server": "127.0.0.1:8001"}, "api_server"),
        ({"label_selector": "", "model": "tiny"}, "label_selector"),
        ({"label_selector": SELECTOR, "model": "tiny", "role_label": "kvroute.io/"}, "role_label"),
        ({"label_selector": SELECTOR, "model": "tiny", "role_label": "Bad_Prefix/role"}, "role_label"),
        ({"label_selector": SELECTOR, "model": "tiny", "role_label": "x" * 64}, "role_label"),
        ({"label_selector": SELECTOR, "model": "tiny", "namespace_": "x"}, "Extra inputs"),
    ]
    for section, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_config({**base, "discovery": {"kubernetes": section}})


# ---- the watch against the fake API server ---------------------------------------------------
class StandInGateway:
    """The part of router.gateway.Gateway discovery uses, over the real WorkerRegistry (no
    per-worker tasks): add_worker, remove_worker, drain_worker, registry."""

    def __init__(self) -> None:
        self.registry = WorkerRegistry()
        self.changes: list[tuple[str, str]] = []

    async def add_worker(self, wcfg: WorkerConfig):
        if wcfg.id in self.registry:
            raise WorkerExists(wcfg.id)
        if any(same_target(r.cfg, wcfg) for r in self.registry.all()):  # as Gateway.add_worker
            raise WorkerExists(f"another worker serves {wcfg.url}")
        self.changes.append(("add", wcfg.id))
        return self.registry.add(wcfg)

    async def remove_worker(self, worker_id: str):
        self.changes.append(("remove", worker_id))
        return await self.registry.remove(worker_id)

    async def drain_worker(self, worker_id: str):
        reg = self.registry.get(worker_id)
        if reg is None:
            raise KeyError(worker_id)
        reg.draining = True
        return reg

    def ids(self) -> set[str]:
        return {r.id for r in self.registry.all()}


async def until(check, timeout_s: float = 15.0, what: str = "condition"):
    """Await ``check()`` truthy (polled every 20 ms); AssertionError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not (last := check()):
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached in {timeout_s}s (last: {last!r})")
        await asyncio.sleep(0.02)
    return last


@pytest.fixture
def fake():
    api = FakeKubeAPI().start()
    yield api
    api.stop()


@pytest.fixture
async def discovered(fake):
    """``start(**cfg) -> (discovery, gateway)`` against ``fake``; every discovery is stopped."""
    started: list[KubernetesDiscovery] = []

    async def start(**kw):
        gw = StandInGateway()
        kw.setdefault("backoff_initial_s", 0.05)
        kw.setdefault("backoff_max_s", 0.2)
        d = KubernetesDiscovery(gw, k8s_cfg(api_server=fake.url, namespace="ns1", **kw))
        await d.start()
        started.append(d)
        return d, gw

    yield start
    for d in started:
        await d.stop()


async def test_list_then_watch_from_its_resource_version(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.put_pod(make_pod("b", 8102, namespace="ns1", ready=False))
    fake.put_pod(make_pod("other", 8103, namespace="ns1", labels={"app.kubernetes.io/name": "redis"}))
    fake.put_pod(make_pod("elsewhere", 8104, namespace="ns2"))
    d, gw = await discovered()
    await until(lambda: gw.ids() == {"a"}, what="a added")
    assert gw.registry.get("a").url == "http://127.0.0.1:8101" and gw.registry.get("a").model == "tiny"
    await until(lambda: fake.count(watch=True) >= 1, what="a watch")
    (list_path, list_q), (watch_path, watch_q) = fake.requests[:2]
    assert list_path == watch_path == "/api/v1/namespaces/ns1/pods"
    assert list_q["labelSelector"] == watch_q["labelSelector"] == SELECTOR
    assert watch_q["resourceVersion"] == d.state()["resource_version"] == "1004"  # the list's
    assert watch_q["timeoutSeconds"] == "300" and watch_q["allowWatchBookmarks"].lower() == "true"
    assert fake.authorizations[0] is None  # api_server: no credentials (kubectl proxy)

    fake.put_pod(make_pod("b", 8102, namespace="ns1"))  # turns Ready
    await until(lambda: gw.ids() == {"a", "b"}, what="b added")
    reg_a = gw.registry.get("a")
    fake.put_pod(make_pod("a", 8101, namespace="ns1", labels={SELECTOR.split("=")[0]: "vllm-worker", "x": "y"}))
    fake.delete_pod("b", namespace="ns1")
    await until(lambda: gw.ids() == {"a"}, what="b removed")
    assert gw.registry.get("a") is reg_a  # an unrelated change re-registers nothing
    fake.put_pod(make_pod("a", 8105, namespace="ns1"))  # same pod name, new address
    await until(lambda: gw.registry.get("a") is not None and gw.registry.get("a").url.endswith(":8105"),
                what="a re-added at its new address")
    assert d.owns("a") and not d.owns("b")
    assert d.state()["errors"] == 0 and d.state()["lists"] == 1


async def test_not_ready_drains_then_removes(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=1.0)
    await until(lambda: gw.ids() == {"a"}, what="a added")
    reg = gw.registry.get("a")
    fake.put_pod(make_pod("a", 8101, namespace="ns1", ready=False))
    await until(lambda: reg.draining, what="a drained")
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))  # back before the removal
    await until(lambda: not reg.draining, what="a undrained")
    assert gw.registry.get("a") is reg and gw.changes == [("add", "a")]
    t0 = time.monotonic()
    fake.put_pod(make_pod("a", 8101, namespace="ns1", ready=False))
    await until(lambda: gw.ids() == set(), what="a removed after not_ready_remove_s")
    assert time.monotonic() - t0 >= 0.9
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    await until(lambda: gw.ids() == {"a"}, what="a added again")
    # an operator's drain is theirs: a not-ready spell and back leaves it drained
    reg = gw.registry.get("a")
    reg.draining = True
    fake.put_pod(make_pod("a", 8101, namespace="ns1", ready=False))
    last_rv = fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    await until(lambda: d._pods["a"].resource_version == last_rv, what="both events applied")
    assert reg.draining and gw.registry.get("a") is reg
    # a terminating pod goes at once
    pod = make_pod("a", 8101, namespace="ns1")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    fake.put_pod(pod)
    await until(lambda: gw.ids() == set(), what="terminating a removed")


async def test_not_ready_remove_zero_removes_at_once(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=0)
    await until(lambda: gw.ids() == {"a"}, what="a added")
    fake.put_pod(make_pod("a", 8101, namespace="ns1", ready=False))
    await until(lambda: gw.ids() == set(), what="a removed")
    assert gw.changes == [("add", "a"), ("remove", "a")]


async def test_role_label_sets_and_changes_the_role_and_a_bad_one_skips_the_pod(fake, discovered, caplog):
    fake.put_pod(make_pod("p0", 8101, namespace="ns1", labels={**WORKER_LABELS, ROLE: "prefill"}))
    fake.put_pod(make_pod("d0", 8102, namespace="ns1", labels={**WORKER_LABELS, ROLE: "decode"}))
    fake.put_pod(make_pod("x0", 8103, namespace="ns1", labels={**WORKER_LABELS, ROLE: "fast"}))
    fake.put_pod(make_pod("b0", 8104, namespace="ns1"))
    d, gw = await discovered()
    await until(lambda: gw.ids() == {"p0", "d0", "b0"}, what="the well-labelled pods added")
    assert {r.id: r.role for r in gw.registry.all()} == {"p0": "prefill", "d0": "decode", "b0": "both"}
    skipped = [r for r in caplog.records if "pod x0 skipped" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelname == "WARNING" and "kvroute.io/role='fast'" in skipped[0].getMessage()

    reg = gw.registry.get("d0")
    fake.put_pod(make_pod("d0", 8102, namespace="ns1", labels={**WORKER_LABELS, ROLE: "both"}))
    await until(lambda: reg.role == "both", what="d0's role changed")
    assert gw.registry.get("d0") is reg and reg.cfg.role == "both"  # in place: not re-registered
    assert gw.changes.count(("add", "d0")) == 1

    fake.put_pod(make_pod("p0", 8101, namespace="ns1", labels={**WORKER_LABELS, ROLE: "Prefill"}))
    await until(lambda: "p0" not in gw.ids(), what="p0 removed once its label turned bad")
    fake.put_pod(make_pod("p0", 8101, namespace="ns1", labels={**WORKER_LABELS, ROLE: "Prefill", "x": "1"}))
    # events apply in order: once d0's next change shows, p0's event before it has been applied
    fake.put_pod(make_pod("d0", 8102, namespace="ns1", labels={**WORKER_LABELS, ROLE: "decode"}))
    await until(lambda: reg.role == "decode", what="d0's role changed back")
    assert sum("pod p0 skipped" in r.getMessage() for r in caplog.records) == 1  # warned once per value
    assert "p0" not in gw.ids()
    fake.put_pod(make_pod("p0", 8101, namespace="ns1", labels={**WORKER_LABELS, ROLE: "prefill"}))
    await until(lambda: "p0" in gw.ids(), what="p0 back with a good label")
    assert gw.registry.get("p0").role == "prefill"
    fake.put_pod(make_pod("x0", 8103, namespace="ns1", labels={**WORKER_LABELS}))  # label dropped: both
    await until(lambda: "x0" in gw.ids(), what="x0 added once its label went")
    assert gw.registry.get("x0").role == "both"


async def test_gone_event_relists_and_reconciles(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    d, gw = await discovered()
    await until(lambda: gw.ids() == {"a", "b"}, what="a, b added")
    await until(lambda: fake.count(watch=True) >= 1, what="a watch")
    # changes the watch never sees: only the list after 410 shows them
    fake.delete_pod("a", namespace="ns1", record=False)
    fake.put_pod(make_pod("c", 8103, namespace="ns1"), record=False)
    fake.compact()
    await until(lambda: gw.ids() == {"b", "c"}, what="re-list applied")
    assert d.state()["relists_gone"] == 1 and d.state()["lists"] == 2 and d.state()["errors"] == 0
    assert fake.gone_sent == ["event"]
    fake.put_pod(make_pod("d", 8104, namespace="ns1"))  # and the watch goes on after it
    await until(lambda: gw.ids() == {"b", "c", "d"}, what="d added")


async def test_gone_status_on_resume_relists(discovered):
    fake = FakeKubeAPI(bookmarks=False).start()  # the watch resumes from its last event's version
    try:
        fake.put_pod(make_pod("a", 8101, namespace="ns1"))
        gw = StandInGateway()
        d = KubernetesDiscovery(gw, k8s_cfg(api_server=fake.url, namespace="ns1", watch_timeout_s=1,
                                            backoff_initial_s=0.05))
        await d.start()
        try:
            await until(lambda: gw.ids() == {"a"}, what="a added")
            fake.delete_pod("a", namespace="ns1", record=False)
            fake.compact(gone_as_status=True, end_open_watches=False)
            await until(lambda: gw.ids() == set(), what="a removed by the re-list")
            assert d.state()["relists_gone"] == 1 and d.state()["errors"] == 0
            assert fake.gone_sent == ["status"]
        finally:
            await d.stop()
    finally:
        fake.stop()


async def test_api_errors_back_off_then_recover(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.fail_next(3, 500)
    d, gw = await discovered(backoff_initial_s=0.1, backoff_max_s=0.25, watch_timeout_s=1)
    await until(lambda: gw.ids() == {"a"}, what="a added after the failures")
    assert d.state()["errors"] == 3 and "500" in d.state()["last_error"]
    lists = [t for (_, q), t in zip(fake.requests, fake.request_times) if "watch" not in q]
    assert len(lists) == 4
    gaps = [b - a for a, b in zip(lists, lists[1:])]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.24  # doubling, capped
    # a failed watch (the next one, after the 1 s server timeout) resumes from its version
    fake.fail_next(1, 403)
    await until(lambda: d.state()["errors"] == 4, what="the watch failure")
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    await until(lambda: gw.ids() == {"a", "b"}, what="b added")
    assert fake.count(watch=False) == 4 and "403" in d.state()["last_error"]


async def test_stop_is_prompt_and_leaves_workers(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    d, gw = await discovered(watch_timeout_s=600)
    await until(lambda: gw.ids() == {"a"} and fake.count(watch=True) >= 1, what="watching")
    t0 = time.monotonic()
    await d.stop()
    assert time.monotonic() - t0 < 2.0 and not d._thread.is_alive()
    assert gw.ids() == {"a"}  # the gateway is stopping: it closes its registry itself


async def test_worker_of_the_same_id_not_owned_is_left_alone(fake, discovered):
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    gw = StandInGateway()
    static = gw.registry.add(WorkerConfig(id="a", url="http://127.0.0.1:9999", model="tiny"))
    d = KubernetesDiscovery(gw, k8s_cfg(api_server=fake.url, namespace="ns1"))
    await d.start()
    try:
        await until(lambda: gw.ids() == {"a", "b"} and d.owns("b"), what="b added")
        assert gw.registry.get("a") is static and not d.owns("a")
        fake.delete_pod("a", namespace="ns1")
        fake.delete_pod("b", namespace="ns1")
        await until(lambda: gw.ids() == {"a"}, what="b removed, a kept")
    finally:
        await d.stop()


async def test_kubeconfig_context_gives_server_and_namespace(fake, tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "other",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "dev", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "dev", "context": {"cluster": "fake", "user": "dev", "namespace": "ns-ctx"}},
                     {"name": "other", "context": {"cluster": "fake", "user": "dev"}}]}))
    fake.put_pod(make_pod("a", 8101, namespace="ns-ctx"))
    gw = StandInGateway()
    d = KubernetesDiscovery(gw, KubernetesDiscoveryConfig(label_selector=SELECTOR, model="tiny",
                                                          kubeconfig=str(kubeconfig), context="dev"))
    await d.start()
    try:
        assert d.namespace == "ns-ctx"
        await until(lambda: gw.ids() == {"a"}, what="a added")
        assert fake.authorizations[0] == "Bearer t0ken"
    finally:
        await d.stop()
    with pytest.raises(ValueError, match="cannot load a Kubernetes client configuration"):
        await KubernetesDiscovery(gw, k8s_cfg(kubeconfig=str(tmp_path / "missing"))).start()


# ---- ghosts: workers whose pod is gone must not stay ------------------------------------------
# not_ready_remove_s is long in these: a removal they wait for is never the not-ready timer's
LONG = 600


def owned_registered(d: KubernetesDiscovery, gw: StandInGateway) -> bool:
    """The discovery's own account of its workers agrees with the registry."""
    return set(d.state()["workers"]) == gw.ids()


async def test_evicted_pod_whose_ip_was_cleared_is_removed_at_once(fake, discovered):
    """production-stack #1008: the kubelet evicts a pod and clears its IP in one status write;
    the phase may say Failed only later. No engine is left at the worker's address: it goes at
    once, not after not_ready_remove_s."""
    for name, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
        fake.put_pod(make_pod(name, 8000, namespace="ns1", ip=ip))
    d, gw = await discovered(not_ready_remove_s=LONG)
    await until(lambda: gw.ids() == {"a", "b", "c"}, what="a, b, c added")
    fake.put_pod(make_pod("a", 8000, namespace="ns1", ip=None, ready=False))  # Running, no IP
    await until(lambda: gw.ids() == {"b", "c"}, what="a removed once its IP was cleared")
    fake.put_pod(make_pod("b", 8000, namespace="ns1", ip=None, ready=False, phase="Failed", reason="Evicted"))
    await until(lambda: gw.ids() == {"c"}, what="b removed (phase Failed, Evicted)")
    # not Ready with another IP: the old address is dead too; Ready there: added at it
    fake.put_pod(make_pod("c", 8000, namespace="ns1", ip="10.0.0.9", ready=False))
    await until(lambda: gw.ids() == set(), what="c removed once its IP changed")
    fake.put_pod(make_pod("c", 8000, namespace="ns1", ip="10.0.0.9"))
    await until(lambda: gw.ids() == {"c"}, what="c back at its new IP")
    assert gw.registry.get("c").url == "http://10.0.0.9:8000"
    assert gw.changes == [("add", "a"), ("add", "b"), ("add", "c"), ("remove", "a"), ("remove", "b"),
                          ("remove", "c"), ("add", "c")]
    assert owned_registered(d, gw) and d.state()["pods"] == {"a": "not_ready", "c": "ready"}
    # a not-ready spell that keeps the IP still only drains
    fake.put_pod(make_pod("c", 8000, namespace="ns1", ip="10.0.0.9", ready=False))
    await until(lambda: gw.registry.get("c").draining, what="c drained")
    assert gw.ids() == {"c"}


@pytest.mark.parametrize("compacted", [False, True], ids=["history-kept", "compacted-410"])
@pytest.mark.parametrize("clean", [False, True], ids=["cut", "clean-end"])
async def test_changes_while_no_watch_is_open(fake, discovered, compacted, clean):
    """production-stack #1091: the watch drops (cut mid-stream, or ended by the server) and
    cannot reconnect for a while; meanwhile a pod is deleted and another is deleted and created
    again under its name (a StatefulSet pod; its new incarnation not Ready yet, at the same
    address). Resuming (the server replays the gap, or answers 410 and discovery lists again)
    must leave neither worker: the recreated pod is not the engine whose cache was indexed."""
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    fake.put_pod(make_pod("c", 8103, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=LONG)
    await until(lambda: gw.ids() == {"a", "b", "c"} and fake.open_watches == 1, what="a, b, c added, watching")
    old_b = gw.registry.get("b")
    fake.refuse_watches(503)
    fake.drop_watches(clean=clean)
    await until(lambda: fake.open_watches == 0, what="the watch ended")
    fake.delete_pod("a", namespace="ns1")
    fake.delete_pod("b", namespace="ns1")
    fake.put_pod(make_pod("b", 8102, namespace="ns1", ready=False, uid="uid-b-2"))
    if compacted:
        fake.compact()
    fake.refuse_watches(None)
    await until(lambda: gw.ids() == {"c"}, what="a and the old b removed")
    assert d.state()["pods"] == {"b": "not_ready", "c": "ready"} and owned_registered(d, gw)
    fake.put_pod(make_pod("b", 8102, namespace="ns1", uid="uid-b-2"))
    await until(lambda: gw.ids() == {"b", "c"}, what="the new b added")
    assert gw.registry.get("b") is not old_b and not gw.registry.get("b").draining
    if compacted:
        assert fake.gone_sent or d.state()["relists_after_errors"] >= 1


async def test_pod_replaced_in_a_relist_is_a_new_worker_even_at_the_same_address(fake, discovered):
    """The same name, another uid, Ready at the same address, seen only in a re-list: the old
    registration (and the index entries of the old engine's cache) must go; a new one comes."""
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=LONG)
    await until(lambda: gw.ids() == {"a"} and fake.open_watches == 1, what="a added, watching")
    old = gw.registry.get("a")
    fake.delete_pod("a", namespace="ns1", record=False)
    fake.put_pod(make_pod("a", 8101, namespace="ns1", uid="uid-a-2"), record=False)
    fake.compact()
    await until(lambda: gw.registry.get("a") is not None and gw.registry.get("a") is not old,
                what="a registered anew")
    assert gw.changes == [("add", "a"), ("remove", "a"), ("add", "a")] and old.removed


@pytest.mark.parametrize("refusal", [
    (504, "Timeout", "Too large resource version: 1010, current: 1005", True),
    (504, "Timeout", "Too large resource version: 1010, current: 1005", False),
    (500, "InternalError", "etcdserver: request timed out", False),
], ids=["too-large-rv-event", "too-large-rv-status", "always-500"])
async def test_a_watch_that_cannot_resume_lists_again(fake, discovered, refusal):
    """A server that cannot serve the cursor (behind it after a failover: "Too large resource
    version"), or a watch that fails every time while lists work: discovery must not retry the
    same cursor forever while the pods it shows as workers are deleted."""
    status, reason, message, in_stream = refusal
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=LONG, backoff_max_s=0.1)
    await until(lambda: gw.ids() == {"a", "b"} and fake.open_watches == 1, what="a, b added, watching")
    fake.refuse_watches(status, message, reason, in_stream=in_stream)
    fake.drop_watches()
    fake.delete_pod("a", namespace="ns1")
    await until(lambda: gw.ids() == {"b"}, what="a removed by a re-list")
    state = d.state()
    if status == 504:
        assert state["relists_gone"] >= 1
    else:
        assert state["relists_after_errors"] >= 1 and "500" in state["last_error"]
    fake.refuse_watches(None)
    fake.put_pod(make_pod("c", 8103, namespace="ns1"))
    await until(lambda: gw.ids() == {"b", "c"}, what="c added once watches work again")


async def test_ready_pod_at_the_address_of_another_discovered_worker_replaces_it(fake, discovered):
    """An evicted pod's IP went to a new pod before the eviction reached us (the old pod is not
    Ready, its status still shows the IP): the new Ready pod at that address is the engine there;
    the old worker is removed and the new pod added, not refused as a duplicate URL."""
    fake.put_pod(make_pod("a", 8000, namespace="ns1", ip="10.0.0.5"))
    d, gw = await discovered(not_ready_remove_s=LONG)
    await until(lambda: gw.ids() == {"a"}, what="a added")
    fake.put_pod(make_pod("a", 8000, namespace="ns1", ip="10.0.0.5", ready=False))
    await until(lambda: gw.registry.get("a").draining, what="a drained")
    fake.put_pod(make_pod("b", 8000, namespace="ns1", ip="10.0.0.5"))
    await until(lambda: gw.ids() == {"b"}, what="a replaced by b at 10.0.0.5")
    assert gw.registry.get("b").url == "http://10.0.0.5:8000" and owned_registered(d, gw)
    fake.put_pod(make_pod("a", 8000, namespace="ns1", ip=None, ready=False, phase="Failed", reason="Evicted"))
    last = fake.put_pod(make_pod("b", 8000, namespace="ns1", ip="10.0.0.5", labels={**WORKER_LABELS, "x": "1"}))
    await until(lambda: d._pods["b"].resource_version == last, what="both events applied")
    assert gw.ids() == {"b"}


async def test_pod_leaving_the_selector_is_removed_and_coming_back_is_added(fake, discovered):
    """A real API server's watch sends DELETED for a pod whose labels stop matching the selector
    (and ADDED when they match again); the fake does too now."""
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=LONG)
    await until(lambda: gw.ids() == {"a", "b"}, what="a, b added")
    fake.put_pod(make_pod("a", 8101, namespace="ns1", labels={"app.kubernetes.io/name": "maintenance"}))
    await until(lambda: gw.ids() == {"b"}, what="a removed once out of the selector")
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    await until(lambda: gw.ids() == {"a", "b"}, what="a back in the selector")


class FlakyGateway(StandInGateway):
    """Adding ``bad`` fails with an error discovery does not expect."""

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad

    async def add_worker(self, wcfg: WorkerConfig):
        if wcfg.id == self.bad:
            raise RuntimeError("boom")
        return await super().add_worker(wcfg)


async def test_one_pod_failing_to_apply_does_not_stop_the_rest_of_a_relist(fake):
    fake.put_pod(make_pod("b", 8102, namespace="ns1"))
    gw = FlakyGateway("a")
    d = KubernetesDiscovery(gw, k8s_cfg(api_server=fake.url, namespace="ns1", not_ready_remove_s=LONG,
                                        backoff_initial_s=0.05, backoff_max_s=0.2))
    await d.start()
    try:
        await until(lambda: gw.ids() == {"b"} and fake.open_watches == 1, what="b added, watching")
        # seen only in the re-list, in this order: a (whose add fails), then b evicted
        fake.put_pod(make_pod("a", 8101, namespace="ns1"), record=False)
        fake.put_pod(make_pod("b", 8102, namespace="ns1", ip=None, ready=False, phase="Failed", reason="Evicted"),
                     record=False)
        fake.compact()
        await until(lambda: gw.ids() == set(), what="b removed despite a's failure")
        assert d.state()["lists"] == 2
    finally:
        await d.stop()


async def test_worker_added_by_hand_under_a_discovered_id_is_not_discoverys(fake, discovered):
    """A discovered worker removed through the admin API and added again by hand (another URL)
    is the operator's: the pod's deletion leaves it alone, and discovery does not report it."""
    fake.put_pod(make_pod("a", 8101, namespace="ns1"))
    d, gw = await discovered(not_ready_remove_s=LONG)
    await until(lambda: gw.ids() == {"a"}, what="a added")
    await gw.remove_worker("a")
    by_hand = gw.registry.add(WorkerConfig(id="a", url="http://127.0.0.1:9999", model="tiny"))
    assert not d.owns("a") and d.state()["workers"] == []
    fake.delete_pod("a", namespace="ns1")
    await until(lambda: "a" not in d.state()["pods"], what="the deletion applied")
    assert gw.registry.get("a") is by_hand
