"""The import layers of the tree, read from every module's imports (``tools/import_graph.py``):
no cycle anywhere (function-local and ``TYPE_CHECKING`` imports count), the top-level parts in
their order, and ``router/``'s packages in the order a request passes them, no import upward."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import import_graph  # noqa: E402

# top-level parts: each may import only the parts listed for it
ALLOWED_PARTS = {
    "kvcore": set(),
    "router": {"kvcore"},
    "offload_agent": {"kvcore"},
    "simulator": {"kvcore"},
    "kvbench": {"kvcore", "kvroute", "router", "simulator"},
    "kvroute": {"kvcore", "router", "offload_agent", "simulator", "kvbench"},
}

# router/, bottom to top: a module may import its own package and any lower layer; two packages
# of one layer never import each other (route and relay meet only in edge)
ROUTER_LAYERS = [
    {"router", "router.errors", "router.upstream_http", "router.estimates", "router.shared"},
    {"router.policies"},
    {"router.config"},
    {"router.workers"},
    {"router.telemetry"},
    {"router.route", "router.relay"},
    {"router.processes"},
    {"router.gateway"},
    {"router.edge"},
    {"router.cli", "router.client_auth"},
]

# pure: no event loop, sockets, HTTP, Redis or Prometheus (the clock and randomness come in)
PURE = ("router.policies", "router.estimates", "router.workers.discovery.pods")
IMPURE_MODULES = {"asyncio", "socket", "aiohttp", "httpx", "redis", "zmq", "prometheus_client", "fastapi",
                  "starlette", "uvicorn", "kubernetes"}


@pytest.fixture(scope="module")
def graph():
    return import_graph.graph(ROOT)


def _unit(module: str) -> str:
    """The layer unit of a router module: its package under router/, or the module at router/'s top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def _layer(module: str) -> int:
    unit = _unit(module)
    for i, layer in enumerate(ROUTER_LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"{module}: its package {unit} has no layer in ROUTER_LAYERS")


def test_no_import_cycles(graph):
    known, edges = graph
    assert import_graph.cycles(sorted(known), edges) == []


def test_top_level_parts_import_only_below_them(graph):
    _, edges = graph
    wrong = sorted(f"{e.source}:{e.line} imports {e.target}" for e in edges
                   if (s := e.source.split(".")[0]) != (t := e.target.split(".")[0]) and t not in ALLOWED_PARTS[s])
    assert wrong == []


def _upward(edges) -> list[str]:
    """The router edges that break ROUTER_LAYERS."""
    wrong = []
    for e in edges:
        if not (e.source.startswith("router") and e.target.startswith("router")):
            continue
        src, dst = _unit(e.source), _unit(e.target)
        if src == dst:
            continue
        ls, ld = _layer(e.source), _layer(e.target)
        if ld > ls or (ld == ls and src != "router" and dst != "router"):
            wrong.append(f"{e.source}:{e.line} ({e.kind}) imports {e.target}")
    return wrong


def test_router_never_imports_upward(graph):
    known, edges = graph
    for name in known:  # every router package has a layer
        if name.startswith("router"):
            _layer(name)
    assert _upward(edges) == []


def test_pure_packages_do_no_io(graph):
    known, _ = graph
    wrong = []
    for name, path in known.items():
        if not name.startswith(PURE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            wrong += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in IMPURE_MODULES]
    assert wrong == []


def test_the_layer_rules_catch_an_upward_import(tmp_path):
    """The checks above fail on a tree that breaks them (so they cannot pass vacuously)."""
    pkg = tmp_path / "router"
    (pkg / "policies").mkdir(parents=True)
    (pkg / "edge").mkdir()
    for f in ("__init__.py", "policies/__init__.py", "edge/__init__.py", "edge/app.py"):
        (pkg / f).write_text("")
    (pkg / "policies" / "base.py").write_text("def f():\n    from router.edge.app import x\n")
    (pkg / "edge" / "app.py").write_text("from router.policies.base import f\n")
    known, edges = import_graph.graph(tmp_path, ("router",))
    assert {(e.source, e.target, e.kind) for e in edges} == {
        ("router.policies.base", "router.edge.app", "local"), ("router.edge.app", "router.policies.base", "module")}
    assert import_graph.cycles(sorted(known), edges) == [["router.edge.app", "router.policies.base"]]
    assert _upward(edges) == ["router.policies.base:2 (local) imports router.edge.app"]
