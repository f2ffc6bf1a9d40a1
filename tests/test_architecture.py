"""The house in order: module sizes, the import graph, and which layers load what (CPU, fast).

- no module in ``itif/`` is over 600 lines (the generated ``_proto`` stubs aside);
- no import cycle among itif's modules (the graph of module-level imports, read with ``ast``;
  imports inside functions and under ``if TYPE_CHECKING:`` are not edges);
- the scheduler, the request types and the HTTP JSON workers' module load without torch; the
  daemon loads neither grpc nor the metrics (the server layer wires those up).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "itif"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the itif package (stubs included)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _generated(path: Path) -> bool:
    return "_proto" in path.relative_to(PKG).parts


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: at top level, or inside top-level
    ``try``/``if``/``with`` blocks (``if TYPE_CHECKING:`` excepted)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the itif modules it imports at import time. ``from pkg import name`` is an edge
    to ``pkg.name`` when that is a module, else to ``pkg``; importing ``a.b.c`` also runs the
    ``__init__`` of ``a`` and ``a.b``, but those are edges of their own only where written."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in _top_level_imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = name.split(".") if is_pkg else name.split(".")[:-1]
                    parent = parent[: len(parent) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_module_over_600_lines():
    big = {}
    for name, path in _modules().items():
        if _generated(path):
            continue
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            big[name] = n
    assert not big, f"modules over {MAX_LINES} lines (split them along their seams): {big}"


def test_no_import_cycle():
    graph = _graph()
    assert graph["itif.daemon"], "the import graph found no edges: the parser is broken"
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _loaded(module: str) -> set[str]:
    """The modules a fresh interpreter holds after ``import module``."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _has(loaded: set[str], top: str) -> bool:
    return top in loaded or any(m.startswith(top + ".") for m in loaded)


@pytest.mark.parametrize("module", ["itif.scheduler", "itif.requests", "itif.config",
                                    "itif.server.json_procs"])  # a JSON worker starts light
def test_light_modules_load_without_torch(module):
    loaded = _loaded(module)
    assert not _has(loaded, "torch"), f"import {module} loads torch"
    assert "itif.runtime.engine" not in loaded


def test_daemon_loads_neither_grpc_nor_metrics():
    loaded = _loaded("itif.daemon")
    assert not _has(loaded, "grpc"), "import itif.daemon loads grpc"
    assert "itif.metrics" not in loaded
    assert not _has(loaded, "prometheus_client")
    assert not _has(loaded, "itif.server")
