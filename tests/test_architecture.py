"""The house in order: module sizes, the import graph, and which layers load what (CPU, fast).

- no module in ``itif/`` is over 600 lines (the generated ``_proto`` stubs aside);
- no import cycle among itif's modules (the graph of every import, read with ``ast``: those
  inside functions count, since they run too; only ``if TYPE_CHECKING:`` ones, which never
  run, are not edges);
- the layers run one way: every import goes down :data:`LAYERS` or stays inside its package;
- the scheduler, the request types and the HTTP JSON workers' module load without torch; the
  daemon loads neither grpc nor the metrics (the server layer wires those up);
- no module uses another object's or module's private names: ``other._x`` (anything but
  ``self``, ``cls``, ``super()`` or a class of the same file), ``getattr(other, "_x")``, or an
  import of ``_helper`` or through a private module from outside its package. Where a file needs
  one, its owner gets a public method or name (``Daemon.admit``, ``Scheduler.expire``); torch's
  and the standard library's internals that itif must use are listed with a reason each, and
  reads in files other changes owned when the rule came in are listed to shrink.
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
    ("clib", "the C library through ctypes; imports no itif module"),
    ("threadnames", "gives itif's threads their names in the OS, through clib"),
    ("platform", "what the machine is (devices, threads); imports only clib"),
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
    ("tenant_series", "per-tenant Prometheus series counted in bulk (numpy)"),
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


# ---- private names used outside their owner -------------------------------------------------
#: A private package that is everyone's to import all the same: its name -> why.
OPEN_PRIVATE_MODULES = {
    "itif.server._proto": "the generated gRPC stubs (``itif.server.protogen``), private so the API "
                          "docs skip them; the client, the CLI and the benchmarks speak the "
                          "protocol through them",
}
#: Internals of torch, Hugging Face and the standard library that itif must use, having no
#: public way to do the same: file -> {what is read: why}. An entry nothing reads any more
#: fails the test (delete it).
FOREIGN_INTERNALS: dict[str, dict[str, str]] = {
    "itif/bench/offline.py": {
        "torch._dynamo": "the recompile limits of torch.compile live only in its config",
    },
    "itif/bench/systems.py": {
        "torch._inductor": "Inductor's mode options and config keys, to bound max-autotune",
        "first.config._attn_implementation": "the attention Transformers picked (reported "
                                             "beside the timings); read, never set",
        "torch.utils._python_dispatch": "TorchDispatchMode counts aten ops (no public home)",
    },
    "itif/ops/cuda_loader.py": {
        "torch._C": "the raw cudaStream_t of torch's current stream, for the CuPy kernels",
        "torch._C._cuda_getCurrentRawStream": "the same, as a function",
    },
    "itif/platform.py": {
        "cpu._is_avx512_bf16_supported": "torch.cpu's probes of native bf16/fp16 matmuls, to "
                                         "warn of emulation",
        "cpu._is_amx_tile_supported": "the same probe, AMX",
        "cpu._is_amx_fp16_supported": "the same probe, AMX-FP16",
    },
    "itif/weights/store.py": {
        "t._version": "torch.Tensor's in-place version counter: a digest goes stale when its "
                      "tensor is changed in place",
    },
    "itif/hostpath/ring.py": {
        "shm._name": "SharedMemory's name as registered with the resource tracker (with its "
                     "leading slash), to unregister an attached segment (Python 3.11)",
    },
    "itif/runtime/cpu_linear.py": {
        "torch.ops.mkldnn._linear_pointwise": "oneDNN's matmul with the bias, activation or "
                                              "residual fused in (the op Inductor's CPU freezing "
                                              "uses); torch has no public name for it",
        "torch.ops.mkldnn._is_mkldnn_bf16_supported": "whether that op runs bf16 natively",
    },
    "itif/runtime/cpu_gemm.py": {
        "torch.utils.cpp_extension._get_build_directory": "where torch builds the extension, "
                                                          "to find it again",
    },
}
_CALLS_BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    """``_x`` and ``__x``, not ``__x__`` (nor ``_``)."""
    return name.startswith("_") and name != "_" and not (
        name.startswith("__") and name.endswith("__"))


def _own(receiver: ast.expr, classes: set[str]) -> bool:
    """An object's own members: through ``self``, ``cls``, ``super()`` or a class of the file."""
    if isinstance(receiver, ast.Name):
        return receiver.id in {"self", "cls"} | classes
    return (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super")


def _private_path(path: str, importer: str) -> str | None:
    """The dotted path up to the first private part of ``path`` the importer may not import
    (a private module is its package's: open to the modules inside it), or None."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not _private(part):
            continue
        owner, upto = ".".join(parts[:i]), ".".join(parts[: i + 1])
        if not (importer == owner or importer.startswith(owner + ".")
                or upto in OPEN_PRIVATE_MODULES):
            return upto
    return None


def _private_uses(tree: ast.Module, module: str, is_pkg: bool = False) -> Counter:
    """What module ``module`` reads of other objects' and modules' private names, each as a
    dotted expression -> times: ``<expr>._x`` (read, written or called) where ``<expr>`` is not
    the object itself (:func:`_own`), ``getattr(<expr>, "_x")`` and its kin, and imports of a
    private name or through a private module (``from m import _helper``, ``import torch._C``)."""
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found: Counter = Counter()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr) and not _own(n.value, classes):
            found[ast.unparse(n)] += 1
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in _CALLS_BY_NAME and len(n.args) >= 2
              and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
              and _private(n.args[1].value) and not _own(n.args[0], classes)):
            found[f"{ast.unparse(n.args[0])}.{n.args[1].value}"] += 1
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            if isinstance(n, ast.Import):
                paths = [a.name for a in n.names]
            else:
                base = n.module or ""
                if n.level:
                    parent = module.split(".") if is_pkg else module.split(".")[:-1]
                    parent = parent[: len(parent) - (n.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                paths = [f"{base}.{a.name}" for a in n.names if a.name != "*"]
            for path in paths:
                bad = _private_path(path, module)
                if bad is not None:
                    found[bad] += 1
    return found


def test_private_use_finder_finds_them():
    src = ("import os, torch._C\nfrom itif.x import _helper, public\nfrom . import _sibling\n"
           "from ..other import _far\nfrom itif.server._proto import stub\n"
           "class K:\n    _k = 1\n    def m(self, other):\n"
           "        self._a; cls._b; K._k; super()._c; self.__class__; other.__dict__\n"
           "        other._d; self.peer._e = 1; other._f(); getattr(other, '_g', None)\n"
           "        getattr(self, '_h'); hasattr(other, 'public'); x[0]._i; other._d\n")
    assert _private_uses(ast.parse(src), "itif.pkg.mod") == Counter({
        "torch._C": 1, "itif.x._helper": 1, "itif.other._far": 1, "other._d": 2,
        "self.peer._e": 1, "other._f": 1, "other._g": 1, "x[0]._i": 1})
    # a package's own private module is open to it; the stubs to everyone
    assert _private_uses(ast.parse("from . import _kernels\n"), "itif.pkg", is_pkg=True) == {}
    assert _private_uses(ast.parse("from itif.pkg import _kernels\n"), "itif.other.m") == {
        "itif.pkg._kernels": 1}


def test_no_module_uses_another_objects_private_names():
    """Where a file needs another object's ``_`` member (or another module's ``_helper``), its
    owner gets a public method or name: issue 64, item 2."""
    allowed = {rel: set(reads) for rel, reads in FOREIGN_INTERNALS.items()}
    found: dict[str, set[str]] = {}
    for name, path in _modules().items():
        if _generated(path):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        uses = _private_uses(tree, name, path.name == "__init__.py")
        if uses:
            found[path.relative_to(REPO).as_posix()] = set(uses)
    assert found, "the finder found no private use at all (torch._C is one): it is broken"
    new = {f: sorted(u - allowed.get(f, set())) for f, u in found.items()}
    new = {f: u for f, u in new.items() if u}
    assert not new, ("private names of other objects or modules used (give the owner a public "
                     f"method or name): {new}")
    gone = {f: sorted(a - found.get(f, set())) for f, a in allowed.items()
            if (REPO / f).is_file()}
    gone = {f: a for f, a in gone.items() if a}
    assert not gone, f"no longer used: delete from FOREIGN_INTERNALS: {gone}"
