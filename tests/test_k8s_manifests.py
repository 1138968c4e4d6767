"""deploy/k8s (the kustomize base), checked without a cluster: every rendered document validates
against Kubernetes' own OpenAPI schemas (the ``kubernetes-validate`` package ships them as JSON
schemas, strict: an unknown field fails) for the oldest and newest versions it names; the parts
agree with each other (discovery selector and worker pod labels, named ports, service account and
RBAC, config map and mounts, Redis service and index URLs, model name and block size), with
docker-compose.yml (the same vLLM flags), with kvroute's CLI (the agent sidecar's arguments)
and with the gateway's config validator; vLLM's own parser takes the worker's command line.

Rendering: ``resources`` of kustomization.yaml loaded file by file (the base uses no other
kustomize feature); when ``kubectl`` is on PATH its ``kubectl kustomize`` must render the same.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError as SchemaError

from kvroute.cli import build_parser
from offload_agent.connector.config import CONNECTOR_CLASS, CONNECTOR_MODULE, TierSettings
from router.config.schema import parse_config
from test_compose import _VLLM_CHECK, _flags

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "deploy" / "k8s"
K8S_VERSIONS = ("1.29.0", "1.37.0")  # the schemas checked: an older cluster and the newest known


def load_base(base: Path = BASE) -> list[dict]:
    """The documents of the kustomization at ``base``, as kustomize renders them: each file of
    ``resources`` in order, every non-empty YAML document. Raises AssertionError when the
    kustomization uses anything else (this loader would not render it faithfully)."""
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    extra = set(kust) - {"apiVersion", "kind", "resources"}
    assert not extra, f"kustomization.yaml uses {sorted(extra)}: render it with kustomize in this test"
    docs = []
    for name in kust["resources"]:
        docs.extend(d for d in yaml.safe_load_all((base / name).read_text()) if d)
    return docs


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return load_base()


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(pod_spec: dict, name: str, init: bool = False) -> dict:
    (c,) = [c for c in pod_spec["initContainers" if init else "containers"] if c["name"] == name]
    return c


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def mounts(c: dict) -> dict[str, str]:
    """volume name -> mount path"""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector (``k=v,k2=v2``) against ``labels``."""
    terms = [t.split("=", 1) for t in selector.split(",")]
    assert all(len(t) == 2 and "!" not in t[0] for t in terms), f"only k=v terms here: {selector}"
    return all(labels.get(k.strip()) == v.strip() for k, v in terms)


def test_kustomization_renders_every_file(docs):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("ServiceAccount", "kvroute-gateway"), ("Role", "kvroute-pod-reader"),
        ("RoleBinding", "kvroute-gateway-pod-reader"), ("ConfigMap", "kvroute-gateway-config"),
        ("Deployment", "kvroute-gateway"), ("Service", "kvroute-gateway"),
        ("Deployment", "kvroute-redis"), ("Service", "kvroute-redis"), ("Deployment", "kvroute-vllm")])
    kubectl = shutil.which("kubectl")
    if kubectl:  # the real renderer, where there is one, agrees with the loader
        done = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(rendered, key=key) == sorted(docs, key=key)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_document_validates_against_the_kubernetes_schema(docs, version):
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {exc}")


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(pathh="/x"),
    lambda d: d["spec"].update(replicas="two"),
    lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("image") and
    d["spec"]["template"]["spec"]["containers"][0].pop("name"),
])
def test_the_schema_check_catches_a_bad_field(docs, break_it):
    """The validation above is real: one unknown field, wrong type or missing required field fails."""
    bad = copy.deepcopy(find(docs, "Deployment", "kvroute-gateway"))
    break_it(bad)
    with pytest.raises(SchemaError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def gateway_config(docs: list[dict]):
    cm = find(docs, "ConfigMap", "kvroute-gateway-config")
    return parse_config(yaml.safe_load(cm["data"]["gateway.yaml"]))


def test_gateway_config_discovers_the_worker_pods(docs):
    cfg = gateway_config(docs)
    k8s = cfg.discovery.kubernetes
    assert k8s is not None and cfg.workers == [] and k8s.namespace is None  # the gateway's namespace
    vllm = find(docs, "Deployment", "kvroute-vllm")
    pod = vllm["spec"]["template"]
    assert selector_matches(k8s.label_selector, pod["metadata"]["labels"])
    for d in docs:  # and nothing else the base makes
        if d is not vllm and d["kind"] == "Deployment":
            assert not selector_matches(k8s.label_selector, d["spec"]["template"]["metadata"]["labels"])
    for d in docs:
        if d["kind"] == "Deployment":
            sel = d["spec"]["selector"]["matchLabels"]
            assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items(), d["metadata"]["name"]
    server = container(pod["spec"], "vllm")
    flags = _flags(server["args"])
    assert ports(server)[k8s.port] == int(flags["--port"])  # discovery's port is vLLM's
    assert k8s.events_port is None  # the agent sidecars write the Redis index
    events = json.loads(flags["--kv-events-config"])
    for name, key in (("kv-events", "endpoint"), ("kv-replay", "replay_endpoint")):
        assert events[key] == f"tcp://*:{ports(server)[name]}"  # named for an embedded-mode config
    assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    (model,) = cfg.models
    assert k8s.model == model.name == flags["--served-model-name"]
    assert model.block_size == int(flags["--block-size"])


def test_gateway_deployment_rbac_and_service(docs):
    dep = find(docs, "Deployment", "kvroute-gateway")
    spec = dep["spec"]["template"]["spec"]
    sa = find(docs, "ServiceAccount", spec["serviceAccountName"])
    binding = find(docs, "RoleBinding", "kvroute-gateway-pod-reader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"]}]
    role = find(docs, "Role", binding["roleRef"]["name"])
    assert binding["roleRef"]["kind"] == "Role"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    gw = container(spec, "gateway")
    args = build_parser().parse_args(gw["args"])
    assert args.command == "serve"
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_dir = mounts(gw)["config"]
    assert Path(args.config).parent == Path(config_dir)
    cm_name = volumes["config"]["configMap"]["name"]
    assert Path(args.config).name in find(docs, "ConfigMap", cm_name)["data"]
    cfg = gateway_config(docs)
    assert ports(gw)["http"] == cfg.listen.port and cfg.listen.host == "0.0.0.0"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {e["name"] for e in gw["env"]} >= {cfg.admin.token_env}
    assert spec["terminationGracePeriodSeconds"] > cfg.timeouts.shutdown_grace_s
    # the tokenizer folder of the config is where the init container puts it
    fetch = container(spec, "fetch-tokenizer", init=True)
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert mounts(fetch)["models"] == mounts(gw)["models"] == "/models"
    assert cfg.models[0].tokenizer == f"/models/{env['MODEL_DIR']}"
    svc = find(docs, "Service", "kvroute-gateway")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] in ports(gw)
    assert cfg.index.backend == "redis" and dep["spec"]["replicas"] >= 2  # replicas share the index


def test_worker_pod_matches_compose_and_runs_the_agent(docs):
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    cfg = gateway_config(docs)
    spec = find(docs, "Deployment", "kvroute-vllm")["spec"]["template"]["spec"]
    server = container(spec, "vllm")
    assert server["image"] == compose["services"]["vllm-w0"]["image"] == "vllm/vllm-openai:v0.32.0"
    assert server["command"] == compose["x-vllm-worker"]["entrypoint"]
    flags, compose_flags = _flags(server["args"]), _flags(compose["services"]["vllm-w0"]["command"])
    assert set(flags) == set(compose_flags)
    for same in ("--model", "--served-model-name", "--port", "--block-size", "--kv-events-config"):
        assert flags[same] == compose_flags[same], same
    transfer = json.loads(flags["--kv-transfer-config"])
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
    tiers = TierSettings.from_extra(transfer["kv_connector_extra_config"])
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # the connector's code: copied from the kvroute image into the volume vLLM imports it from
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["PYTHONPATH"] == mounts(server)["connector"] == "/opt/kvroute"
    copier = container(spec, "kvroute-connector", init=True)
    assert copier["command"][-1] == f"cp -r /opt/kvroute/offload_agent {mounts(copier)['connector']}/"
    dockerfile = (REPO / "docker" / "gateway.Dockerfile").read_text()
    assert "WORKDIR /opt/kvroute" in dockerfile and "COPY offload_agent ./offload_agent" in dockerfile
    # the model folder the init container fills is the one vLLM loads
    fetch = container(spec, "fetch-model", init=True)
    fenv = {e["name"]: e.get("value") for e in fetch["env"]}
    assert flags["--model"] == f"{mounts(fetch)['models']}/{fenv['MODEL_DIR']}"
    assert mounts(server)["models"] == mounts(fetch)["models"]
    # the agent sidecar: the pod's name as worker id, vLLM's ports on localhost, the gateway's index
    agent = container(spec, "kvroute-agent")
    argv = [a.replace("$(POD_NAME)", "kvroute-vllm-5d9f-abcde") for a in agent["args"]]
    args = build_parser().parse_args(argv)
    assert args.command == "agent" and args.worker_id == "kvroute-vllm-5d9f-abcde"
    (pod_name,) = [e for e in agent["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    events = json.loads(flags["--kv-events-config"])
    for url, key in ((args.events, "endpoint"), (args.replay, "replay_endpoint")):
        assert url == "tcp://127.0.0.1:" + events[key].rsplit(":", 1)[1]
    assert args.index == cfg.index.model_dump()["url"]
    assert (args.model, args.block_size) == (cfg.models[0].name, cfg.models[0].block_size)
    # the agent owns the tiers (as in docker-compose.yml): the connector's socket and the CPU tier
    # file in a memory volume both mount, the SSD folder in a volume both mount, peers on the pod IP
    assert mounts(server)["kv-ssd"] == mounts(agent)["kv-ssd"] == tiers.ssd_tier_dir == args.ssd_tier_dir
    assert args.tier_socket == tiers.agent_socket
    assert mounts(server)["kv-cpu"] == mounts(agent)["kv-cpu"] == str(Path(args.tier_shm).parent) \
        == str(Path(args.tier_socket).parent)
    (kv_cpu,) = [v for v in spec["volumes"] if v["name"] == "kv-cpu"]
    assert kv_cpu["emptyDir"]["medium"] == "Memory"
    assert (args.cpu_tier_bytes, args.ssd_tier_bytes) == (tiers.cpu_tier_bytes, tiers.ssd_tier_bytes)
    assert args.serve_peers == "0.0.0.0:7601" and args.advertise == "$(POD_IP):7601"
    agent_env = {e["name"]: e.get("valueFrom") for e in agent["env"]}
    assert agent_env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert agent_env[args.peer_secret_env]["secretKeyRef"]["name"] == "kvroute-peer"
    assert {"name": "kv-peer", "containerPort": 7601, "protocol": "TCP"} in agent["ports"]
    volumes = {v["name"] for v in spec["volumes"]}
    for c in [*spec["containers"], *spec["initContainers"]]:
        assert set(mounts(c)) <= volumes, c["name"]


def test_redis_service_is_the_index_url(docs):
    cfg = gateway_config(docs)
    m = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", cfg.index.model_dump()["url"])
    assert m
    svc = find(docs, "Service", m.group(1))
    (port,) = svc["spec"]["ports"]
    assert port["port"] == int(m.group(2))
    dep = find(docs, "Deployment", m.group(1))
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert port["targetPort"] in ports(container(dep["spec"]["template"]["spec"], "redis"))


def test_vllm_accepts_the_worker_command(docs, vllm_snippets):
    """vLLM 0.32's own parser takes the worker's flags (KV events and tiers connector JSON) and
    the connector class imports in its interpreter."""
    server = container(find(docs, "Deployment", "kvroute-vllm")["spec"]["template"]["spec"], "vllm")
    done = vllm_snippets.run(_VLLM_CHECK, [json.dumps(server["args"])])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"block_size": 16, "served": ["qwen2.5-1.5b-instruct"], "events_enabled": True,
                    "connector": CONNECTOR_CLASS, "prefix_caching": True}


# --- the P/D variant: deploy/k8s-pd, an overlay of the base (beside it: kustomize refuses an
# overlay inside its base's folder). It uses patches, so it is rendered by kustomize itself.
PD = REPO / "deploy" / "k8s-pd"


@pytest.fixture(scope="module")
def pd_docs() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl (kustomize) is not installed: the P/D overlay uses patches")
    done = subprocess.run([kubectl, "kustomize", str(PD)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_pd_overlay_replaces_the_worker_set(pd_docs, docs):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in pd_docs)
    base = sorted((d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"]["name"] != "kvroute-vllm")
    assert kinds == sorted(base + [("Deployment", "kvroute-vllm-prefill"), ("Deployment", "kvroute-vllm-decode")])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pd_every_document_validates(pd_docs, version):
    for doc in pd_docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_worker_sets_carry_role_and_connector(pd_docs, docs, role):
    cfg = gateway_config(pd_docs)
    assert cfg.policy["pd"]["enabled"] is True
    k8s = cfg.discovery.kubernetes
    assert k8s.role_label == "kvroute.io/role" and cfg.workers == []
    dep = find(pd_docs, "Deployment", f"kvroute-vllm-{role}")
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"]["kvroute.io/role"] == role
    assert dep["spec"]["selector"]["matchLabels"]["kvroute.io/role"] == role
    assert selector_matches(k8s.label_selector, pod["metadata"]["labels"])
    server = container(pod["spec"], "vllm")
    base_server = container(find(docs, "Deployment", "kvroute-vllm")["spec"]["template"]["spec"], "vllm")
    assert server["args"] == base_server["args"] and server["env"] == base_server["env"]
    transfer = json.loads(_flags(server["args"])["--kv-transfer-config"])
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"], transfer["kv_role"]) == \
        (CONNECTOR_CLASS, CONNECTOR_MODULE, "kv_both")
    agent = build_parser().parse_args(container(pod["spec"], "kvroute-agent")["args"])
    assert agent.serve_peers == "0.0.0.0:7601"
    assert agent.cpu_tier_bytes == TierSettings.from_extra(transfer["kv_connector_extra_config"]).cpu_tier_bytes


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_vllm_accepts_the_worker_command(pd_docs, role, vllm_snippets):
    server = container(find(pd_docs, "Deployment", f"kvroute-vllm-{role}")["spec"]["template"]["spec"], "vllm")
    done = vllm_snippets.run(_VLLM_CHECK, [json.dumps(server["args"])])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["connector"] == CONNECTOR_CLASS and seen["block_size"] == 16
