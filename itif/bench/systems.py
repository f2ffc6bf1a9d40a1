"""The systems ``itif bench`` compares, all on the same tenants' weights and the same inputs.

Contract of a system: ``load(requests)`` stages one workload's inputs (untimed); ``run()``
answers every request once and returns when the outputs are on the host (timed; a system that
times itself returns its own milliseconds); ``logits()`` gives the last run's logits in request
order (for the same-weights check); ``close()`` frees it.

- ``itif``: one :class:`~itif.Engine` holding every tenant, one fused forward per run (one system
  per planner strategy, all sharing the engine);
- ``seq``: one engine per tenant holding only that tenant ("one model instance per tenant"),
  tenants run one after another (the thesis' SEQ);
- ``multi_stream``: the same per-tenant engines, each tenant on its own thread and, on CUDA, its
  own ``torch.cuda.Stream``;
- ``hf``: one Hugging Face ``transformers`` model per tenant, eager PyTorch (no compile), each
  tenant's requests as one padded batch with an attention mask, tenants one after another;
- ``hf_compiled``: the same models, each wrapped in ``torch.compile(model, mode=MODE)``
  (``max-autotune`` by default; ``default`` on the CPU), compiled and warmed for the workload's
  exact shapes in ``load()`` (never in a timed run);
- ``itif_nographs``: the fused engine with CUDA graphs off (CUDA only; ``itif`` has them on), the
  same engine as ``itif`` with ``engine.cuda_graphs`` set around each run;
- ``mps``: one process per tenant under NVIDIA MPS (:mod:`itif.bench.mps`).

:func:`op_counts` counts what one run launches, outside the timed runs: CUDA kernels and launch
calls (torch.profiler) on CUDA, dispatched aten ops (a ``TorchDispatchMode``) on the CPU.
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from itif.runtime.engine import Engine, Request

__all__ = ["System", "Fused", "Seq", "MultiStream", "HF", "HFCompiled", "measure", "by_tenant",
           "op_counts", "compile_mode_for", "compile_options", "host_probe_ms", "measure_alone",
           "load_all", "failure"]


def by_tenant(requests: list[Request]) -> dict[str, list[int]]:
    """Request indices per tenant, tenants in first-seen order."""
    out: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        out[r.tenant].append(i)
    return dict(out)


class System:
    name = "system"
    strategy: str | None = None

    def load(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def run(self) -> float | None:
        raise NotImplementedError

    def logits(self) -> np.ndarray | None:
        return None

    def close(self) -> None:
        pass

    def count_run(self) -> None:
        """One run for :func:`op_counts` (in the calling thread where that matters)."""
        self.run()

    countable = True  # op_counts can observe a run (False: runs in other processes)


def engine_graphs(engine: Engine) -> bool | None:
    """Whether ``engine`` replays CUDA graphs (None: an engine without the switch)."""
    return getattr(engine, "cuda_graphs", None) if hasattr(engine, "cuda_graphs") else None


GRAPH_WARMUP_RUNS = 32  # Fused.load's bound: the engine captures a structure within a few runs


class Fused(System):
    """The fused engine with one planner strategy; ``graphs`` True/False sets the engine's CUDA
    graphs switch around every run (``itif`` / ``itif_nographs`` share one engine), None leaves
    it as it is."""

    name = "itif"

    def __init__(self, engine: Engine, strategy: str, graphs: bool | None = None) -> None:
        self.engine, self.strategy = engine, strategy
        self.graphs = graphs
        if graphs is False:
            self.name = "itif_nographs"
        self._reqs: list[Request] = []
        self._out = None

    def _switch(self) -> None:
        if self.graphs is not None and hasattr(self.engine, "cuda_graphs") \
                and self.engine.cuda_graphs != self.graphs:
            self.engine.cuda_graphs = self.graphs

    @property
    def graphs_used(self) -> bool | None:
        self._switch()
        return engine_graphs(self.engine)

    def load(self, requests):
        self._reqs = requests
        self._switch()
        if engine_graphs(self.engine):  # untimed, until a run replays graphs only: captured
            for _ in range(GRAPH_WARMUP_RUNS):
                before = self.engine.graph_stats()["eager"]
                self.engine.infer(self._reqs, strategy=self.strategy)
                if self.engine.graph_stats()["eager"] == before:
                    break

    def run(self):
        self._switch()
        self._out = self.engine.infer(self._reqs, strategy=self.strategy)

    def logits(self):
        return None if self._out is None else np.stack([r.logits for r in self._out])


class _PerTenant(System):
    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines
        self.strategy = next(iter(engines.values())).strategy
        self._groups: dict[str, list[int]] = {}
        self._reqs: dict[str, list[Request]] = {}
        self._out: dict[str, list] = {}
        self._n = 0

    def load(self, requests):
        self._groups = by_tenant(requests)
        self._reqs = {t: [requests[i] for i in idx] for t, idx in self._groups.items()}
        self._n = len(requests)
        self._out = {}

    def logits(self):
        if not self._out:
            return None
        out = [None] * self._n
        for t, idx in self._groups.items():
            for i, r in zip(idx, self._out[t]):
                out[i] = r.logits
        return np.stack(out)


class Seq(_PerTenant):
    """One engine per tenant, tenants one after another."""

    name = "seq"

    def run(self):
        for t, reqs in self._reqs.items():
            self._out[t] = self.engines[t].infer(reqs)


class MultiStream(_PerTenant):
    """One engine per tenant, each on its own thread (and CUDA stream)."""

    name = "multi_stream"

    def __init__(self, engines: dict[str, Engine], device: torch.device) -> None:
        super().__init__(engines)
        self._pool = ThreadPoolExecutor(max(1, len(engines)), thread_name_prefix="bench-stream")
        self._streams = ({t: torch.cuda.Stream(device) for t in engines}
                         if device.type == "cuda" else None)

    def _one(self, t: str):
        if self._streams is None:
            return self.engines[t].infer(self._reqs[t])
        # The current stream is per thread: every kernel of this tenant's forward, its uploads
        # and the final device-to-host copy (which synchronises) go to this tenant's stream.
        with torch.cuda.stream(self._streams[t]):
            return self.engines[t].infer(self._reqs[t])

    def run(self):
        futs = {t: self._pool.submit(self._one, t) for t in self._reqs}
        for t, f in futs.items():
            self._out[t] = f.result()

    def count_run(self):
        # A TorchDispatchMode is thread-local: on the CPU count the same forwards in this thread
        # (the ops are the engines'; the threads add none). CUDA's profiler sees every thread.
        if self._streams is None:
            for t, reqs in self._reqs.items():
                self._out[t] = self.engines[t].infer(reqs)
        else:
            self.run()

    def close(self):
        self._pool.shutdown(wait=True)


def hf_inputs(requests: list[Request], is_text: bool) -> dict[str, torch.Tensor]:
    """One tenant's requests as one Hugging Face batch (text padded, with an attention mask)."""
    if not is_text:
        px = np.stack([np.asarray(r.pixel_values, np.float32) for r in requests])
        return dict(pixel_values=torch.from_numpy(px))
    L = max(len(r.input_ids) for r in requests)
    ids = torch.zeros(len(requests), L, dtype=torch.long)
    mask = torch.zeros(len(requests), L, dtype=torch.long)
    for j, r in enumerate(requests):
        ids[j, : len(r.input_ids)] = torch.as_tensor(np.asarray(r.input_ids))
        mask[j, : len(r.input_ids)] = 1
    return dict(input_ids=ids, attention_mask=mask)


@torch.inference_mode()
def hf_forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor],
               device: torch.device) -> np.ndarray:
    """Logits (float32, on the host) of one Hugging Face batch: inputs go to the device in the
    model's dtype, logits come back."""
    dtype = next(model.parameters()).dtype
    kw = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
          for k, v in inputs.items()}
    return model(**kw).logits.float().cpu().numpy()


class HF(System):
    """One ``transformers`` model per tenant, eager, tenants one after another."""

    name = "hf"

    def __init__(self, models: dict[str, torch.nn.Module], is_text: bool,
                 device: torch.device) -> None:
        self.models, self.is_text, self.device = models, is_text, device
        self._groups: dict[str, list[int]] = {}
        self._inputs: dict[str, dict[str, torch.Tensor]] = {}
        self._out: dict[str, np.ndarray] = {}
        self._n = 0
        first = next(iter(models.values()))
        self.attn_implementation = getattr(first.config, "_attn_implementation", None)

    def load(self, requests):
        self._groups = by_tenant(requests)
        self._n = len(requests)
        self._out = {}
        self._inputs = {t: hf_inputs([requests[i] for i in idx], self.is_text)
                        for t, idx in self._groups.items()}

    def run(self):
        # Inputs go to the device and logits come back inside the timed region, as the engines'.
        for t, inputs in self._inputs.items():
            self._out[t] = hf_forward(self.models[t], inputs, self.device)

    def logits(self):
        if not self._out:
            return None
        out = [None] * self._n
        for t, idx in self._groups.items():
            for i, row in zip(idx, self._out[t]):
                out[i] = row
        return np.stack(out)


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# Bounds on max-autotune's compile time (``--compile-bound``): keep the GEMM autotuning (what the
# mode is for) but skip coordinate-descent tuning of every pointwise/reduction kernel and the
# CPU GEMM templates.
AUTOTUNE_BOUNDS = {"coordinate_descent_tuning": False, "max_autotune_gemm_backends": "ATEN,TRITON",
                   "max_autotune_gemm_search_space": "DEFAULT", "max_autotune_pointwise": False}


def compile_mode_for(device: torch.device, mode: str) -> str:
    """The torch.compile mode used on ``device``: the CPU gets ``default`` (max-autotune's CPU
    GEMM templates take minutes to tune and reduce-overhead's CUDA graphs do not exist there)."""
    return mode if device.type == "cuda" else "default"


def compile_options(mode: str, bound: bool) -> dict | None:
    """Inductor options for ``mode`` with :data:`AUTOTUNE_BOUNDS` applied (None: plain mode).
    Only keys this torch knows are kept (torch.compile rejects unknown ones)."""
    if not bound or mode == "default":
        return None
    import torch._inductor as inductor  # noqa: PLC0415
    import torch._inductor.config as icfg  # noqa: PLC0415

    known = icfg.get_config_copy()
    opts = dict(inductor.list_mode_options(mode))
    if opts.get("max_autotune"):
        opts.update({k: v for k, v in AUTOTUNE_BOUNDS.items() if k in known})
    return {k: v for k, v in opts.items() if k in known}


class HFCompiled(HF):
    """The ``hf`` models, each wrapped in ``torch.compile(model, mode=...)``, tenants one after
    another. The wrapped models are the same modules (no second copy of the weights); compiled
    code is shared by every tenant of a backbone (same class, same shapes), so only the first
    tenant compiles; with CUDA graphs (reduce-overhead, max-autotune) every tenant records its
    own graph (its parameters live at their own addresses). ``load`` runs every tenant until
    compiled, recorded and replaying, for the workload's exact shapes: nothing of it is timed.
    """

    name = "hf_compiled"

    def __init__(self, models: dict[str, torch.nn.Module], is_text: bool, device: torch.device,
                 mode: str = "max-autotune", bound: bool = False) -> None:
        self.mode_requested = mode
        self.mode = compile_mode_for(device, mode)
        self.options = compile_options(self.mode, bound)
        if self.options is not None:
            compiled = {t: torch.compile(m, options=self.options) for t, m in models.items()}
            cudagraphs = bool(self.options.get("triton.cudagraphs"))
        else:
            compiled = {t: torch.compile(m, mode=self.mode) for t, m in models.items()}
            cudagraphs = self.mode in CUDAGRAPH_MODES and device.type == "cuda"
        super().__init__(compiled, is_text, device)
        # CUDA graph trees: the first call warms up, the second records, the third replays.
        self.warmup_runs = 3 if cudagraphs else 1
        self.cudagraphs = cudagraphs
        self.warmup_s: float | None = None  # the last load's compile + warm-up time
        self.compile_s = 0.0  # every load's, summed

    def load(self, requests):
        super().load(requests)
        t0 = time.perf_counter()
        for _ in range(self.warmup_runs):
            self.run()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t0
        self.compile_s += self.warmup_s

    def describe(self) -> dict:
        return dict(compile_mode=self.mode, compile_mode_requested=self.mode_requested,
                    compile_options=self.options, compile_cudagraphs=self.cudagraphs,
                    compile_warmup_s=None if self.warmup_s is None else round(self.warmup_s, 3))


# ---- what one run launches ---------------------------------------------------------------------
#: (``_linear_pointwise``: oneDNN's fused product, ``itif.runtime.cpu_linear``)
MATMUL_OPS = frozenset({"mm", "bmm", "addmm", "matmul", "_grouped_mm", "linear", "baddbmm",
                        "_linear_pointwise"})
_LAUNCH_API = re.compile(r"^(cuda|cu)(LaunchKernel(ExC?)?|LaunchCooperativeKernel|GraphLaunch)"
                         r"(_v\d+|_ptsz|_ptds)?$")


def launch_api(name: str) -> bool:
    """A runtime/driver API event that launches work: cudaLaunchKernel, cuLaunchKernel(Ex),
    cudaLaunchKernelExC, cudaGraphLaunch, ... (version suffixes allowed)."""
    return bool(_LAUNCH_API.match(name))


def cuda_counts(fn) -> dict:
    """Kernels (device-side kernel events) and launch calls (runtime/driver API events) of one
    call of ``fn``, by torch.profiler. A CUDA graph replay shows one ``cudaGraphLaunch`` call and,
    as CUPTI traces graph nodes, each of its kernels."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = memops = 0
    launches: Counter = Counter()
    for e in prof.events():
        name = e.name
        if e.device_type == DeviceType.CUDA:
            if name.startswith(("Memcpy", "Memset")) or name.lower().startswith(("memcpy",
                                                                                "memset")):
                memops += 1
            else:
                kernels += 1
        elif launch_api(name):
            launches[name] += 1
    return dict(kernels_per_run=kernels, launch_calls_per_run=sum(launches.values()),
                launch_calls_by_api=dict(sorted(launches.items())), memops_per_run=memops,
                count_method="torch.profiler (CUDA)")


class _OpCounter:
    """Counts every aten op dispatched while active (a TorchDispatchMode; thread-local)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

        counter = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.counter = counter
        self.mode = Mode()


def dispatch_counts(fn) -> dict:
    """Aten ops and matmul-family ops (:data:`MATMUL_OPS`) dispatched by one call of ``fn``."""
    c = _OpCounter()
    with c.mode:
        fn()
    ops = c.counter
    return dict(aten_ops_per_run=int(sum(ops.values())),
                matmul_ops_per_run=int(sum(v for k, v in ops.items() if k in MATMUL_OPS)),
                count_method="TorchDispatchMode")


def profiler_aten_counts(fn) -> dict:
    """Top-level aten ops of one call of ``fn`` from the CPU profiler: compiled code (which an
    active TorchDispatchMode would send back to eager) calls its extern kernels as aten ops and
    runs its own fused kernels outside aten, so this counts what compiled code dispatches."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops: Counter = Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = getattr(e, "cpu_parent", None)
        nested = False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = getattr(parent, "cpu_parent", None)
        if not nested:
            ops[e.name.removeprefix("aten::")] += 1
    return dict(aten_ops_per_run=int(sum(ops.values())),
                matmul_ops_per_run=int(sum(v for k, v in ops.items() if k in MATMUL_OPS)),
                count_method="torch.profiler (CPU, top-level aten ops)")


def op_counts(system: System, device: torch.device) -> dict:
    """What one run of ``system`` launches (one extra, untimed run)."""
    if not system.countable:
        return {}
    if device.type == "cuda":
        return cuda_counts(system.count_run)
    if isinstance(system, HFCompiled):
        return profiler_aten_counts(system.count_run)
    return dispatch_counts(system.count_run)


def failure(e: BaseException) -> str:
    """How a system's failure reads on its row."""
    return f"{type(e).__name__}: {e}"


def load_all(loads, on_error) -> list[System]:
    """Load each ``(system, requests)`` of ``loads``; the systems that loaded, in order. One
    that raises is left out and ``on_error(system, exc)`` hears of it (its row reports it)."""
    live = []
    for s, reqs in loads:
        try:
            s.load(reqs)
            live.append(s)
        except Exception as e:  # noqa: BLE001 - reported on its row; the others still run
            on_error(s, e)
    return live


def measure(systems: list[System], repeats: int, warmup: int = 1,
            on_error=None) -> dict[int, list[float]]:
    """Milliseconds of ``repeats`` runs of every system (after ``warmup`` runs), interleaved
    round-robin with a rotating start so drift on a shared machine hits every system alike.
    A system that raises is dropped; ``on_error(system, exc)`` hears of it."""
    live = list(systems)
    times: dict[int, list[float]] = {id(s): [] for s in systems}

    def call(s: System) -> float | None:
        try:
            t0 = time.perf_counter()
            own = s.run()
            return float(own) if own is not None else (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - one failing baseline must not stop the others
            live.remove(s)
            if on_error is not None:
                on_error(s, e)
            return None

    for s in list(live):
        for _ in range(warmup):
            if s in live:
                call(s)
    for r in range(repeats):
        order = list(live)
        k = r % max(1, len(order))
        for s in order[k:] + order[:k]:
            if s in live:
                ms = call(s)
                if ms is not None:
                    times[id(s)].append(ms)
    return times


#: Iterations of :func:`host_probe_ms`'s loop: about a millisecond on a 2020s server core.
HOST_PROBE_N = 20_000


def host_probe_ms(repeats: int = 5) -> float:
    """Milliseconds of a fixed pure-Python loop (median of ``repeats``), on every row as
    ``host_probe_ms``: how fast the host ran while the workload was measured. Launch-bound rows
    would move with it: on the H100 of 2026-11-26 every system's bert-base T = 4 row was
    1.13-1.78x slower than on 11-23 (itif 1.80 ms against 1.44) and every T = 8 row faster,
    for no cause the results could show."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc = 0
        for i in range(HOST_PROBE_N):
            acc += i * i
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 4)


def measure_alone(systems: list[System], repeats: int, warmup: int = 1,
                  on_error=None) -> dict[int, dict]:
    """Each system's repeats in a row (a warm-up first), one system after another, by
    ``id(system)``: ``latency_ms_alone`` (median), or ``alone_error`` where it raised
    (``on_error(system, message)`` hears of it). ``itif bench --back-to-back`` runs it after
    :func:`measure`. The interleaved median is the table's figure (drift hits every system
    alike); this one says what a system costs when nothing else ran on the device between its
    runs, as for a server that runs one of them. On an H100 the fused engine's bert-base T = 4
    forward took 1.80 ms in the interleaved table and 1.19 ms back to back in
    bench/profile_forward.py (docs/gpu.md, "Where the time goes"); this measures both in one
    run."""
    out: dict[int, dict] = {}
    for s in systems:
        err: list[str] = []
        ms = measure([s], repeats, warmup,
                     lambda _s, e, err=err: err.append(f"{type(e).__name__}: {e}"))[id(s)]
        if err:
            if on_error is not None:
                on_error(s, err[0])
            out[id(s)] = dict(alone_error=err[0])
        else:
            out[id(s)] = dict(latency_ms_alone=round(float(np.median(ms)), 4))
    return out
