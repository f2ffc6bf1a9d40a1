"""The house in order: module sizes, the import graph, and which layers load what (CPU, fast).

- no module in ``itif/`` is over 600 lines (the generated ``_proto`` stubs aside);
- no import cycle among itif's modules (the graph of every import, read with ``ast``: those
  inside functions count, since they run too; only ``if TYPE_CHECKING:`` ones, which never
  run, are not edges);
- the layers run one way: every import goes down :data:`LAYERS` or stays inside its package;
- the scheduler, the request types and the HTTP JSON workers' module load without torch; the
  daemon loads neither grpc nor the metrics (the server layer wires those up);
- no module reads the daemon's or the engine's private members (``daemon._visible``,
  ``engine._validate_text``) outside the class's own file, but for an allow-list that may
  only shrink: the servers go through the daemon's public front door (``Daemon.admit``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import Counter
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


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import in the module, wherever it sits (a function-local import is an edge too:
    it runs when the function does), but for those under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the itif modules it imports (``lazy``: anywhere in it, else only those that run
    at import time). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
    else to ``pkg``; ``import a.b.x`` where ``a.b.x`` is no module is an edge to ``a.b``;
    importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, but those are edges of
    their own only where written."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in (_all_imports if lazy else _top_level_imports)(tree):
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
                while t.startswith("itif.") and t not in mods:
                    t = t.rpartition(".")[0]
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


# ---- layers ---------------------------------------------------------------------------------
#: itif's packages and top-level modules, lowest first: each may import only those before it
#: (and itself). ``itif`` is the package's ``__init__`` (the public names, loaded lazily).
LAYERS: list[tuple[str, str]] = [
    ("platform", "what the machine is (devices, threads); imports no itif module"),
    ("errors", "the exception types every layer raises"),
    ("observer", "the event sink the daemon reports to; no itif imports"),
    ("daemon_state", "the daemon's plain state records; no itif imports"),
    ("requests", "the request and result types the clients and engines share"),
    ("safetensors_io", "reads and writes .safetensors files, for backbones and weights alike"),
    ("ops", "the per-row LoRA/delta ops, reference and CUDA, and the row helpers they share"),
    ("batching", "batch layouts, strategies and the cost model they plan with (no engine)"),
    ("backbones", "backbone specs and Hugging Face loading"),
    ("config", "the daemon's configuration schema, checked against backbones and strategies"),
    ("scheduler", "the fair queues and triggers, without torch"),
    ("hostpath", "the host-side request columns the scheduler feeds"),
    ("weights", "tenant weights: the store, tiers, deltas and blobs"),
    ("faults", "fault injection into the weight store, for the reliability tests"),
    ("runtime", "the encoder Engine: GEMMs, forward, CUDA graphs"),
    ("generation", "the decoder GenEngine, built on runtime's GEMMs"),
    ("itif", "``import itif``: the public names, Engine and GenEngine loaded on first use"),
    ("calibration", "measures the engine to fit the cost model, and ``itif plan``'s report"),
    ("decoder_backend", "the daemon's adapter to GenEngine"),
    ("daemon_tenants", "the daemon's tenant table"),
    ("daemon_tiers", "the daemon's weight tiers"),
    ("daemon_config", "the daemon's live settings"),
    ("daemon", "the daemon: queues, engines, tenants"),
    ("metrics", "Prometheus metrics over a daemon"),
    ("server", "gRPC, HTTP and KServe front ends over the daemon"),
    ("client", "the Python client (the server's protocol stubs)"),
    ("serve_ray", "Ray Serve deployment of the server"),
    ("demo", "the demo tenants, through the client"),
    ("bench", "the benchmark suites, over everything below"),
    ("cli", "the ``itif`` command"),
    ("__main__", "``python -m itif``"),
]
#: Imports that still run up :data:`LAYERS`, each in a file another change owned when the rest
#: was moved: (importer, imported) -> why. It may only shrink: a new one fails the test, and so
#: does an entry that is gone (delete it).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
#: Module cycles left for the same reason: the modules of each (sorted) -> why. May only shrink.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _unit(module: str) -> str:
    """The layer of a module: its package under itif, or its own name at the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward(graph: dict[str, set[str]], layers: list[str]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "a -> b" for each edge that goes up ``layers`` or leaves them."""
    rank = {u: i for i, u in enumerate(layers)}
    out = {}
    for a, deps in graph.items():
        for b in deps:
            ua, ub = _unit(a), _unit(b)
            if ua != ub and rank.get(ub, len(rank)) >= rank.get(ua, -1):
                out[(a, b)] = f"{ua} -> {ub}"
    return out


def test_no_import_cycle():
    graph = _graph()
    assert graph["itif.daemon"], "the import graph found no edges: the parser is broken"
    cycles = {tuple(c) for c in _cycles(graph)}
    new = cycles - set(KNOWN_CYCLES)
    assert not new, f"import cycles (imports inside functions count): {sorted(new)}"
    gone = set(KNOWN_CYCLES) - cycles
    assert not gone, f"no longer a cycle: delete from KNOWN_CYCLES: {sorted(gone)}"


def test_layers_run_one_way():
    layers = [u for u, _ in LAYERS]
    units = {_unit(m) for m in _modules()}
    assert sorted(layers) == sorted(units), (
        f"LAYERS must name each package and top-level module once: missing "
        f"{sorted(units - set(layers))}, unknown {sorted(set(layers) - units)}")
    up = _upward(_graph(), layers)
    new = {e: why for e, why in up.items() if e not in KNOWN_UPWARD}
    assert not new, f"imports that run up LAYERS (move the code down or up): {new}"
    gone = set(KNOWN_UPWARD) - set(up)
    assert not gone, f"no longer imported upward: delete from KNOWN_UPWARD: {sorted(gone)}"


def test_lazy_public_names_load_from_below():
    """``itif.__getattr__`` loads ``itif.Engine`` and the like by name (``importlib``, which the
    import walker cannot read): those modules too must sit below the ``itif`` layer."""
    import itif  # noqa: PLC0415

    rank = {u: i for i, (u, _) in enumerate(LAYERS)}
    assert itif._LAZY, "itif's lazy names moved: read them where they are now"
    above = {m for m in itif._LAZY.values() if rank[_unit(m)] >= rank["itif"]}
    assert not above, f"itif loads these lazily from above its layer: {sorted(above)}"


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_import_walker_counts_lazy_imports_and_finds_upward_ones():
    tree = ast.parse("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    import a\ndef f():\n    from b import c\n"
                     "class K:\n    def m(self):\n        import d.e\n")
    assert sorted(ast.unparse(n) for n in _all_imports(tree)) == [
        "from b import c", "from typing import TYPE_CHECKING", "import d.e", "import os"]
    assert [ast.unparse(n) for n in _top_level_imports(tree)] == [
        "import os", "from typing import TYPE_CHECKING"]
    graph = {"itif.low.x": {"itif.high.y"}, "itif.high.y": {"itif.low.x", "itif.high.z"},
             "itif.high.z": set(), "itif.errors": set()}
    assert _upward(graph, ["errors", "low", "high"]) == {
        ("itif.low.x", "itif.high.y"): "low -> high"}
    assert _unit("itif.daemon") == "daemon" and _unit("itif") == "itif"


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


# ---- private members read from outside their class ----------------------------------------
#: The classes whose private members stay theirs: file -> class.
PRIVATE_OWNERS = {"itif/daemon.py": "Daemon", "itif/runtime/engine.py": "Engine"}
#: Receivers taken for a Daemon or an Engine: these names (``d._x``, ``self.daemon._x``, ...),
#: and any parameter annotated ``Daemon`` or ``Engine`` whatever its name.
RECEIVERS = {"daemon", "d", "engine", "eng"}
#: What still reads them, file -> {expression: times}. It may only shrink: a new read fails the
#: test, and so does an entry that is no longer read (delete it). 22 reads at 7cd3de2, none now.
PRIVATE_READS_ALLOWED: dict[str, dict[str, int]] = {}


def _private_members(tree: ast.Module, cls: str) -> set[str]:
    """The private names of class ``cls``: its ``_methods``, class attributes and the
    ``self._attrs`` it assigns (dunders aside)."""
    names: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(n.name)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"):
                names.add(n.attr)
            elif isinstance(n, ast.Assign):  # ``_a = ...`` and ``_a, _b = ...``
                names.update(t.id for target in n.targets for t in ast.walk(target)
                             if isinstance(t, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reads(tree: ast.Module, members: set[str]) -> Counter:
    """Expression -> times, of ``<receiver>.<member>`` in ``tree``: a receiver named as in
    :data:`RECEIVERS` (or ``<anything>.<such a name>``), or a parameter annotated with one of
    :data:`PRIVATE_OWNERS`' classes."""
    owners = set(PRIVATE_OWNERS.values())
    typed = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and a.annotation is not None
             and ast.unparse(a.annotation).strip("'\"").split("|")[0].strip() in owners}
    found: Counter = Counter()
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr in members):
            continue
        v = n.value
        if ((isinstance(v, ast.Name) and v.id in RECEIVERS | typed)
                or (isinstance(v, ast.Attribute) and v.attr in RECEIVERS)):
            found[ast.unparse(n)] += 1
    return found


def test_private_read_finder_finds_them():
    members = _private_members(ast.parse(
        "class Daemon:\n    _k, _j = 1, 2\n    def __init__(self):\n        self._lock = None\n"
        "    def _visible(self):\n        return self.__class__\n"), "Daemon")
    assert members == {"_j", "_k", "_lock", "_visible"}
    src = ("def f(d, daemon: 'Daemon', x: Daemon, y):\n"
           "    d._lock; daemon._visible(); x._k; self.daemon._lock; y._lock; d._other\n"
           "    d.__class__; d.public\n")
    assert _private_reads(ast.parse(src), members) == Counter(
        {"d._lock": 1, "daemon._visible": 1, "x._k": 1, "self.daemon._lock": 1})


def test_no_private_daemon_or_engine_reads_outside_their_class():
    members: set[str] = set()
    for rel, cls in PRIVATE_OWNERS.items():
        members |= _private_members(ast.parse((REPO / rel).read_text(encoding="utf-8")), cls)
    assert "_visible" in members and "_validate" in members, "the member finder is broken"
    found = {}
    for path in _modules().values():
        rel = path.relative_to(REPO).as_posix()
        if _generated(path) or rel in PRIVATE_OWNERS:
            continue
        reads = _private_reads(ast.parse(path.read_text(encoding="utf-8")), members)
        if reads:
            found[rel] = dict(reads)
    new = {f: {e: n for e, n in r.items() if n > PRIVATE_READS_ALLOWED.get(f, {}).get(e, 0)}
           for f, r in found.items()}
    new = {f: r for f, r in new.items() if r}
    assert not new, (f"private members of {sorted(PRIVATE_OWNERS.values())} read from outside "
                     f"their class (use or add a public method): {new}")
    assert found == PRIVATE_READS_ALLOWED, (
        "fewer private reads than allowed: shrink PRIVATE_READS_ALLOWED to what is left: "
        f"{found}")
