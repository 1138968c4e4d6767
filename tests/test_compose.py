"""docker-compose.yml and its prefill-decode variant docker-compose.pd.yml, checked without Docker (it does not run here): the YAML parses, every file it
references exists, every kvroute command parses with kvroute's CLI and the gateway config with the
gateway's validator, vLLM's own argument parser accepts the workers' command line (KV events and
our tiers connector config included) and the connector module imports in vLLM's interpreter, and
the services agree with each other (names, ports, model name, block size, volumes, GPUs). The P/D
variant: the gateway config gives p0 role prefill and d0 role decode (each service labelled
kvroute.io/role with its worker's role) with policy.pd on, and its workers run exactly the vLLM
command of docker-compose.yml (which vLLM's parser checks)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from kvroute.cli import build_parser
from offload_agent.connector.config import CONNECTOR_CLASS, CONNECTOR_MODULE, TierSettings
from router.config.schema import load_config

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
USER_PROVIDED = {"./models"}  # the model folder; README says how to fill it


# compose file -> (its gateway config, its worker ids)
VARIANTS = {"docker-compose.yml": ("configs/gateway.compose.yaml", ("w0", "w1")),
            "docker-compose.pd.yml": ("configs/gateway.compose-pd.yaml", ("p0", "d0"))}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> tuple[dict, Path, tuple[str, ...]]:
    """``(the parsed compose file, its gateway config path, its worker ids)``, for each file."""
    config, ids = VARIANTS[request.param]
    return yaml.safe_load((REPO / request.param).read_text()), REPO / config, ids


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--name=value`` / ``--flag`` items of a vLLM command list."""
    out: dict[str, str | None] = {}
    for item in argv:
        name, eq, value = item.partition("=")
        out[name] = value if eq else None
    return out


def _bind_mounts(service: dict) -> list[tuple[str, str]]:
    return [(v.split(":")[0], v.split(":")[1]) for v in service.get("volumes", []) if v.startswith(".")]


def _named_volumes(service: dict) -> dict[str, str]:
    return {v.split(":")[0]: v.split(":")[1] for v in service.get("volumes", []) if not v.startswith((".", "/"))}


def test_services_and_referenced_files_exist(variant):
    compose, _, ids = variant
    services = compose["services"]
    assert set(services) == {"redis", "gateway", *(f"vllm-{w}" for w in ids), *(f"agent-{w}" for w in ids)}
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            dockerfile = REPO / build["context"] / build["dockerfile"]
            assert dockerfile.is_file(), name
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY ") and "--from=" not in line:  # not from an earlier stage
                    for src in line.split()[1:-1]:
                        assert (REPO / build["context"] / src).exists(), f"{dockerfile.name}: COPY {src}"
        for host, _ in _bind_mounts(svc):
            assert host in USER_PROVIDED or (REPO / host).exists(), f"{name} mounts missing {host}"
        for vol in _named_volumes(svc):
            assert vol in compose["volumes"], f"{name} uses undeclared volume {vol}"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
    assert "models/" in (REPO / "README.md").read_text()  # how to provide ./models


def test_kvroute_commands_parse_and_gateway_config_validates(variant):
    compose, config, ids = variant
    services = compose["services"]
    parser = build_parser()
    for name in ("gateway", *(f"agent-{w}" for w in ids)):
        args = parser.parse_args(services[name]["command"])
        assert callable(args.func), name
    mounts = dict((target, host) for host, target in _bind_mounts(services["gateway"]))
    config_path = services["gateway"]["command"][services["gateway"]["command"].index("--config") + 1]
    assert REPO / mounts[config_path] == config
    cfg = load_config(config)
    assert cfg.index.backend == "redis"
    assert cfg.policy["name"] == "kv_aware"
    assert [w.id for w in cfg.workers] == list(ids)


def test_pd_variant_gives_roles_and_turns_pd_on(compose):
    pd = yaml.safe_load((REPO / "docker-compose.pd.yml").read_text())["services"]
    cfg = load_config(REPO / "configs/gateway.compose-pd.yaml")
    assert [(w.id, w.role) for w in cfg.workers] == [("p0", "prefill"), ("d0", "decode")]
    assert cfg.policy["pd"]["enabled"] is True and cfg.policy["pd"].get("models", []) == []
    for w in cfg.workers:
        assert pd[f"vllm-{w.id}"]["labels"] == pd[f"agent-{w.id}"]["labels"] == {"kvroute.io/role": w.role}
        # the same vLLM server as docker-compose.yml's (test_vllm_accepts_the_worker_command checks it)
        assert pd[f"vllm-{w.id}"]["command"] == compose["services"]["vllm-w0"]["command"]
    assert load_config(REPO / "configs/gateway.compose.yaml").policy.get("pd", {}).get("enabled") is not True


def test_services_agree(variant):
    compose, config, ids = variant
    services = compose["services"]
    cfg = load_config(config)
    (model,) = cfg.models
    vllm = {w: _flags(services[f"vllm-{w}"]["command"]) for w in ids}
    assert vllm[ids[0]] == vllm[ids[1]]
    flags = vllm[ids[0]]
    assert flags["--served-model-name"] == model.name
    assert int(flags["--block-size"]) == model.block_size
    assert "--enable-prefix-caching" in flags and "--enable-prompt-tokens-details" in flags
    assert flags["--model"].removeprefix("/models/") == Path(model.tokenizer).name  # same folder
    events = json.loads(flags["--kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["replay_endpoint"]
    ev_port, replay_port = (re.search(r":(\d+)$", events[k]).group(1) for k in ("endpoint", "replay_endpoint"))
    transfer = json.loads(flags["--kv-transfer-config"])
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
    tiers = TierSettings.from_extra(transfer["kv_connector_extra_config"])
    gpus = set()
    for w in cfg.workers:
        svc = f"vllm-{w.id}"
        assert w.url == f"http://{svc}:{flags['--port']}" and w.events is None  # agents publish to Redis
        agent = build_parser().parse_args(services[f"agent-{w.id}"]["command"])
        assert (agent.worker_id, agent.model, agent.block_size) == (w.id, model.name, model.block_size)
        assert agent.events == f"tcp://{svc}:{ev_port}" and agent.replay == f"tcp://{svc}:{replay_port}"
        assert agent.index == cfg.index.model_dump()["url"]
        assert agent.index.startswith("redis://redis:")
        # The agent owns the tiers: the connector finds it on the socket, the CPU tier file and the
        # socket sit in a tmpfs volume both mount, the SSD folder in a volume both mount, and no
        # other worker's; the agent serves peers where the other agents can reach it.
        worker_vols, agent_vols = _named_volumes(services[svc]), _named_volumes(services[f"agent-{w.id}"])
        assert agent.tier_socket == tiers.agent_socket and agent.ssd_tier_dir == tiers.ssd_tier_dir
        assert (agent.cpu_tier_bytes, agent.ssd_tier_bytes) == (tiers.cpu_tier_bytes, tiers.ssd_tier_bytes)
        (cpu_vol,) = [v for v, target in worker_vols.items() if target == str(Path(tiers.agent_socket).parent)]
        assert agent_vols.get(cpu_vol) == str(Path(agent.tier_shm).parent) == str(Path(agent.tier_socket).parent)
        assert compose["volumes"][cpu_vol]["driver_opts"]["type"] == "tmpfs" and cpu_vol.endswith(w.id)
        (ssd_vol,) = [v for v, target in worker_vols.items() if target == tiers.ssd_tier_dir]
        assert agent_vols.get(ssd_vol) == tiers.ssd_tier_dir and ssd_vol.endswith(w.id)
        assert agent.serve_peers == "0.0.0.0:7601" and agent.advertise == f"agent-{w.id}:7601"
        assert agent.peer_secret_env in services[f"agent-{w.id}"]["environment"]
        assert services[svc]["depends_on"] == {f"agent-{w.id}": {"condition": "service_started"}}
        (dev,) = services[svc]["deploy"]["resources"]["reservations"]["devices"]
        gpus.update(dev["device_ids"])
        assert services[svc]["environment"]["PYTHONPATH"] == "/opt/kvroute"
        assert ("./offload_agent", "/opt/kvroute/offload_agent") in [
            (h, t) for h, t in _bind_mounts(services[svc])]
    assert len(gpus) == 2  # one GPU each
    assert services["gateway"]["ports"] == [f"{cfg.listen.port}:{cfg.listen.port}"]


_VLLM_CHECK = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
import vllm.entrypoints.openai.api_server  # the compose entrypoint module
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
import importlib
conn = getattr(importlib.import_module(args.kv_transfer_config.kv_connector_module_path),
               args.kv_transfer_config.kv_connector)
print(json.dumps({"block_size": args.block_size, "served": args.served_model_name,
                  "events_enabled": args.kv_events_config.enable_kv_cache_events,
                  "connector": conn.__name__, "prefix_caching": args.enable_prefix_caching}))
"""


def test_vllm_accepts_the_worker_command(compose, vllm_snippets):
    """vLLM's own parser (the version the compose pins, 0.32) takes the workers' flags, including
    the KV events and tiers connector JSON, and the connector class imports in its interpreter."""
    svc = compose["services"]["vllm-w0"]
    assert svc["image"].endswith(":v0.32.0")
    argv = svc["command"]
    done = vllm_snippets.run(_VLLM_CHECK, [json.dumps(argv)])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"block_size": 16, "served": ["qwen2.5-1.5b-instruct"], "events_enabled": True,
                    "connector": CONNECTOR_CLASS, "prefix_caching": True}


def test_the_gateway_images_build_stage_makes_a_wheel_with_the_c_extensions(tmp_path):
    # the build stage of docker/gateway.Dockerfile without Docker: only what its COPY lines
    # bring (less .dockerignore's patterns), `pip wheel` as its RUN line runs it; the wheel must
    # carry the compiled lookups and block keys, and the kvcore it holds must import them
    dockerfile = REPO / "docker" / "gateway.Dockerfile"
    (stage,) = [st for st in dockerfile.read_text().split("\nFROM ") if st.split("\n")[0].endswith(" AS build")]
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")
    src = tmp_path / "src"
    src.mkdir()
    for line in stage.splitlines():
        if line.startswith("COPY "):
            *names, dest = line.split()[1:]
            for name in names:
                path = REPO / name
                target = src / (path.name if dest.endswith("/") else dest)
                if path.is_dir():
                    shutil.copytree(path, target, ignore=ignore)
                else:
                    shutil.copy(path, target)
    assert "pip wheel --no-cache-dir --no-deps -w /wheels ." in stage
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheels"),
                           "."], cwd=src, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("kvroute-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("kvcore/index/_chain_native.") and n.endswith(".so")], names
    assert [n for n in names if n.startswith("kvcore/_block_keys_native.") and n.endswith(".so")], names
    assert "libxxhash-dev" in stage  # the header the block keys' extension compiles the hash from
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = subprocess.run(
        [sys.executable, "-c", "import kvcore, kvcore.index.chain_rows as c, kvcore.block_keys as k; "
                               "print(kvcore.__file__, c.NATIVE, k.NATIVE)"],
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    where, native, native_keys = probe.stdout.split()
    assert (where, native, native_keys) == (str(tmp_path / "site" / "kvcore" / "__init__.py"), "True", "True"), \
        probe.stderr[-2000:]
