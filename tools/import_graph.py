#!/usr/bin/env python3
"""The file-level import graph of kvroute's own packages: which module imports which, how deep the
graph is, its cycles, and the imports that hide inside functions.

Every ``import`` and ``from ... import`` counts, wherever it sits; each edge is marked
``module`` (runs on import), ``local`` (inside a function body: runs when called) or
``typing`` (under ``if TYPE_CHECKING:``: never runs). ``from a.b import c`` points at module
``a.b.c`` when that is a module of ours, else at ``a.b``. A C extension's source (``a/b/c.c``,
built as module ``a.b.c``) is a module of ours that imports none. Tests, benchmarks and tools are
not counted.

Usage: python tools/import_graph.py [--under router] [--depth 2] [--json]
  prints modules, edges, levels (the longest chain of imports; a module importing none of ours
  is level 0) and every cycle (strongly connected set of more than one module), for the modules
  whose name starts with ``--under`` (edges leaving that set are dropped). ``tests/test_layering.py``
  uses the same functions to hold the layer rules.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcore", "router", "offload_agent", "simulator", "kvroute", "kvbench")


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``; ``kind``: ``module``, ``local`` or ``typing``."""

    source: str
    target: str
    line: int
    kind: str


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the packages (``pkg/__init__.py``
    is ``pkg``) and every C extension source (``.c``: the module it builds)."""
    out: dict[str, Path] = {}
    for pkg in packages:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted([*base.rglob("*.py"), *base.rglob("*.c")]):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """The edges from module ``name`` (its file ``path``) to modules in ``known`` (none from a C
    extension's source)."""
    if path.suffix != ".py":
        return []
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: list[Edge] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [t for t in (_resolve(a.name, known) for a in node.names) if t]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        out = []
        for alias in node.names:
            full = f"{base}.{alias.name}" if base else alias.name
            target = full if full in known else _resolve(base, known)
            if target:
                out.append(target)
        return out

    def walk(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "module":
                child_kind = "local"
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    walk_one(sub, "typing")
                for sub in child.orelse:
                    walk_one(sub, kind)
                continue
            walk_one(child, child_kind)

    def walk_one(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in dict.fromkeys(targets(node)):
                if target != name:
                    edges.append(Edge(name, target, node.lineno, kind))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "module":
            walk(node, "local")
            return
        walk(node, kind)

    walk(tree, "module")
    return edges


def graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, Path], list[Edge]]:
    """Every module of the packages and every edge between them."""
    known = modules(root, packages)
    edges = [e for name, path in known.items() for e in imports_of(name, path, known)]
    return known, edges


def cycles(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        if e.source in succ and e.target in succ:
            succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for n in nodes:
        if n not in index:
            visit(n)
    return sorted(found)


def levels(nodes: list[str], edges: list[Edge]) -> dict[str, int]:
    """Each module's level: 0 when it imports none of ``nodes``, else one more than the highest
    level it imports. Modules of one cycle share a level (the cycle counts as one unit)."""
    groups = {n: n for n in nodes}
    for group in cycles(nodes, edges):
        for n in group:
            groups[n] = group[0]
    succ: dict[str, set[str]] = {groups[n]: set() for n in nodes}
    for e in edges:
        if e.source in groups and e.target in groups and groups[e.source] != groups[e.target]:
            succ[groups[e.source]].add(groups[e.target])
    memo: dict[str, int] = {}

    def level(g: str) -> int:
        if g not in memo:
            memo[g] = 1 + max((level(t) for t in succ[g]), default=-1)
        return memo[g]

    return {n: level(groups[n]) for n in nodes}


def collapse(name: str, depth: int | None) -> str:
    """``name`` cut to its first ``depth`` parts (``router.route.planner`` at 2: ``router.route``)."""
    return name if depth is None else ".".join(name.split(".")[:depth])


def summary(under: str | None = None, root: Path = ROOT, depth: int | None = None) -> dict:
    """Modules, edges, levels, cycles and function-local imports for the modules under ``under``
    (all of ours when None), as a dict (the ``--json`` output). ``depth``: count packages rather
    than modules, each name cut to its first ``depth`` parts (:func:`collapse`); edges inside one
    unit drop out."""
    known, edges = graph(root)
    inside_modules = {n for n in known if under is None or n == under or n.startswith(under + ".")}
    edges = [Edge(collapse(e.source, depth), collapse(e.target, depth), e.line, e.kind) for e in edges
             if e.source in inside_modules and e.target in inside_modules]
    edges = [e for e in edges if e.source != e.target]
    lines = sum(len(known[n].read_text().splitlines()) for n in inside_modules)
    known = {collapse(n, depth): known[n] for n in sorted(inside_modules, reverse=True)}
    nodes = sorted(known)
    lv = levels(nodes, edges)
    return {
        "under": under or "all",
        "modules": len(nodes),
        "lines": lines,
        "edges": len({(e.source, e.target) for e in edges}),
        "levels": 1 + max(lv.values(), default=-1),
        "cycles": cycles(nodes, edges),
        "local_imports": sorted(f"{e.source}:{e.line} -> {e.target}" for e in edges if e.kind == "local"),
        "typing_imports": sorted(f"{e.source}:{e.line} -> {e.target}" for e in edges if e.kind == "typing"),
        "by_level": {str(k): sorted(n for n in nodes if lv[n] == k) for k in sorted(set(lv.values()))},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--under", help="only modules under this dotted name (e.g. router)")
    ap.add_argument("--depth", type=int, help="count packages: names cut to their first DEPTH parts")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    s = summary(args.under, depth=args.depth)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    unit = "units" if args.depth else "modules"
    print(f"{s['under']}: {s['modules']} {unit}, {s['lines']} lines, {s['edges']} edges, {s['levels']} levels")
    print(f"cycles ({len(s['cycles'])}):")
    for group in s["cycles"]:
        print("  " + " <-> ".join(group))
    print(f"function-local imports ({len(s['local_imports'])}):")
    for line in s["local_imports"]:
        print("  " + line)
    print(f"TYPE_CHECKING imports ({len(s['typing_imports'])}):")
    for line in s["typing_imports"]:
        print("  " + line)
    print("by level:")
    for k, names in s["by_level"].items():
        print(f"  {k}: {' '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
