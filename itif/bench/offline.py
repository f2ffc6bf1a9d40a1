"""Offline measurements: every system answers the same batch of requests; latency per call.

One group per ``(model, tenants)``: the systems are built once (fused engine, per-tenant engines,
Hugging Face models), then each workload of the group is staged and measured, systems interleaved
round-robin (:func:`itif.bench.systems.measure`). When the systems together would not fit the
memory at hand, each family runs in its own phase and is freed before the next; a family that
does not fit even alone is reported as skipped with the reason. MPS runs last, in processes.

Besides latency, every row carries (outside the timed runs): what one run launches
(:func:`itif.bench.systems.op_counts`), the largest logit difference against Hugging Face in
float32 (one reference model per backbone, loaded tenant by tenant; on the CPU only for small
presets) and, on fused rows, the roofline and the weight-bandwidth bound (distinct weight bytes
over the measured copy bandwidth).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from itif.backbones.spec import load_spec
from itif.batching.strategies import DEFAULT_STRATEGY
from itif.bench import mps as mps_mod
from itif.bench.roofline import (
    Peak,
    batch_weight_bytes,
    forward_flops,
    roofline,
    weight_bound,
)
from itif.bench.systems import (
    HF,
    Fused,
    HFCompiled,
    MultiStream,
    Seq,
    System,
    engine_graphs,
    failure,
    hf_forward,
    hf_inputs,
    host_probe_ms,
    load_all,
    measure,
    measure_alone,
    op_counts,
)
from itif.bench.tenants import hf_model, load_hf_weights, tenant_bytes, tenant_weights
from itif.bench.workloads import Workload, make_requests, tenant_names
from itif.platform import cupy_module, device_name, resolve_device, resolve_dtype, tune_host_malloc
from itif.runtime.engine import Engine

log = logging.getLogger("itif.bench")

SYSTEMS = ("seq", "multi_stream", "mps", "hf", "hf_compiled", "itif", "itif_nographs")
# --quick leaves out hf_compiled: compiling takes longer than the rest of a smoke run
QUICK_SYSTEMS = tuple(s for s in SYSTEMS if s != "hf_compiled")
BASELINES = ("seq", "hf", "hf_compiled")  # speedup_vs_<name> on every measured row
_CACHE_WEIGHTS_BYTES = 2 << 30  # keep generated weights between families below this
_CPU_REFERENCE_MAX_BYTES = 32 << 20  # float32 reference on the CPU: small presets only


@dataclass(frozen=True)
class OfflineSettings:
    device: str
    dtype: str
    systems: tuple[str, ...]
    strategies: tuple[str, ...]
    repeats: int
    warmup: int
    fine_tune: str
    seed: int = 0
    compile_mode: str = "max-autotune"
    compile_bound: bool = False  # bound max-autotune's compile time (systems.AUTOTUNE_BOUNDS)
    mps_max_tenants: int | None = None  # mps rows above this tenant count: skipped
    hf_reference: str = "auto"  # float32 Hugging Face reference: auto (CUDA; CPU small), on, off
    counts: bool = True  # kernels / launches / aten ops of one run, on every row
    bandwidth: float | None = None  # measured copy bandwidth (bytes/s) for weight_bound_ms
    # also time every system back to back (its repeats in a row, after the interleaved ones):
    # latency_ms_alone and speedup_vs_<baseline>_alone on each row (``--back-to-back``)
    alone: bool = False


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        cp = cupy_module()
        if cp is not None:  # the weight store's buffers come from CuPy's pool
            cp.get_default_memory_pool().free_all_blocks()


def hf_unavailable() -> str | None:
    try:
        import transformers  # noqa: F401, PLC0415
    except ImportError as e:
        return f"transformers is not installed ({e}); pip install 'itif[bench]'"
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# ---- generated weights, kept between the groups of one backbone --------------------------------
_WEIGHTS: dict[int, object] = {}
_WEIGHTS_OWNER: list = [None]  # (model, fine_tune) the kept weights belong to


def _weights_for(spec, model: str, fine_tune: str, n: int, keep: bool):
    """``weights(i)`` for tenants ``0..n-1``. When ``keep``, every tenant's weights are generated
    up front in parallel threads (torch releases the GIL; each tenant has its own generator, so
    the values are those of :func:`tenant_weights`) and kept for the next group of the same
    backbone; otherwise each call generates."""
    owner = (model, fine_tune)
    if _WEIGHTS_OWNER[0] != owner:
        _WEIGHTS.clear()
        _WEIGHTS_OWNER[0] = owner
    if keep:
        missing = [i for i in range(n) if i not in _WEIGHTS]
        if missing:
            workers = max(1, min(len(missing), (os.cpu_count() or 2) // 2, 16))
            with ThreadPoolExecutor(workers, thread_name_prefix="bench-weights") as ex:
                for i, w in zip(missing, ex.map(lambda i: tenant_weights(spec, i, fine_tune),
                                                missing)):
                    _WEIGHTS[i] = w

    def weights(i: int):
        if i in _WEIGHTS:
            return _WEIGHTS[i]
        return tenant_weights(spec, i, fine_tune)

    return weights


# ---- Hugging Face models, kept between the groups of one backbone while memory allows ------------
_HF_MODELS: dict[int, torch.nn.Module] = {}
_HF_OWNER: list = [None]  # (model, fine_tune, dtype, device) the kept models belong to


def _hf_models(spec, model: str, fine_tune: str, names, weights, device, dtype,
               keep: bool) -> dict[str, torch.nn.Module]:
    """One HF model per tenant; with ``keep`` the models stay for the next group of the same
    backbone (a group of 32 tenants after one of 8 builds 24), otherwise none is kept."""
    owner = (model, fine_tune, str(dtype), str(device))
    if _HF_OWNER[0] != owner or not keep:
        _HF_MODELS.clear()
        _HF_OWNER[0] = owner
    out = {}
    for i, t in enumerate(names):
        m = _HF_MODELS.get(i)
        if m is None:
            m = hf_model(spec, weights(i), device, dtype)
            if keep:
                _HF_MODELS[i] = m
        out[t] = m
    return out


def release_kept_models() -> None:
    """Drop the HF models and reference kept between groups (the next backbone's turn)."""
    _HF_MODELS.clear()
    _HF_OWNER[0] = None
    _REF_MODEL.clear()


# ---- the float32 Hugging Face reference ----------------------------------------------------------
_REF_MODEL: dict[tuple, torch.nn.Module] = {}
_REF_LOGITS: dict[tuple, np.ndarray] = {}


def _request_digest(r) -> str:
    a = r.input_ids if r.input_ids is not None else r.pixel_values
    return hashlib.sha1(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()


def reference_reason(spec, device: torch.device, mode: str) -> str | None:
    """Why the float32 reference is not computed, or None."""
    if mode == "off":
        return "--hf-reference off"
    missing = hf_unavailable()
    if missing:
        return missing
    if mode == "auto" and device.type != "cuda" and tenant_bytes(spec,
                                                                 4) > _CPU_REFERENCE_MAX_BYTES:
        return (f"CPU: the float32 reference runs for presets up to "
                f"{_CPU_REFERENCE_MAX_BYTES >> 20} MiB (--hf-reference on forces it)")
    return None


def reference_logits(spec, model: str, device: torch.device, fine_tune: str, names, weights,
                     workloads, requests) -> dict:
    """Logits of every workload's requests from Hugging Face in float32 on ``device``: one model
    per backbone (kept between groups), each tenant's weights loaded into it in turn, each
    tenant's requests as one batch. Cached per (tenant, request) across groups."""
    key = (model, str(device))
    ref = _REF_MODEL.get(key)
    if ref is None:
        _REF_MODEL.clear()
        if _HF_OWNER[0] is not None and _HF_OWNER[0][0] != model:
            _HF_MODELS.clear()  # another backbone's models: free them before this one's
            _HF_OWNER[0] = None
        _free(device)
        ref = hf_model(spec, weights(0), device, torch.float32)
        ref.loaded_tenant = 0
        _REF_MODEL[key] = ref
    for i, t in enumerate(names):
        need = {}
        for w in workloads:
            for r in requests[w]:
                if r.tenant == t:
                    k = (model, fine_tune, i, _request_digest(r))
                    if k not in _REF_LOGITS:
                        need[k] = r
        if not need:
            continue
        if getattr(ref, "loaded_tenant", None) != i:
            load_hf_weights(ref, spec, weights(i))
            ref.loaded_tenant = i
        logits = hf_forward(ref, hf_inputs(list(need.values()), spec.is_text), device)
        for k, row in zip(need, logits):
            _REF_LOGITS[k] = row
    index = {t: i for i, t in enumerate(names)}
    return {w: np.stack([_REF_LOGITS[(model, fine_tune, index[r.tenant], _request_digest(r))]
                         for r in requests[w]]) for w in workloads}


# ---- one group -----------------------------------------------------------------------------------
def run_group(model: str, n_tenants: int, workloads: list[Workload], opt: OfflineSettings,
              peak: Peak | None) -> list[dict]:
    """Rows of every workload of one (model, tenants) group, every system."""
    spec = load_spec(model)
    device = resolve_device(opt.device)
    tune_host_malloc(device)  # before the HF baselines, as the engines do
    dtype = resolve_dtype(opt.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    elem = torch.empty((), dtype=dtype).element_size()
    names = tenant_names(n_tenants)
    if _HF_OWNER[0] is not None and _HF_OWNER[0][0] != model:
        release_kept_models()  # the previous backbone's: free them before building this one's
        _free(device)
    requests = {w: make_requests(spec, w, seed=opt.seed) for w in workloads}
    rows: dict[tuple, dict] = {}
    reference: dict[Workload, np.ndarray] = {}  # fused logits, for the same-weights check

    one = tenant_bytes(spec, elem)
    # Generated weights are kept for the next family and group when they fit (on CUDA the
    # host's memory is otherwise idle; on the CPU it is what the systems themselves need).
    limit = (0.3 * available_bytes(torch.device("cpu")) if device.type == "cuda"
             else _CACHE_WEIGHTS_BYTES)
    keep = n_tenants * tenant_bytes(spec, 4) <= limit
    weights = _weights_for(spec, model, opt.fine_tune, n_tenants, keep)

    base_of = {}
    for w in workloads:
        L = w.seq_len if spec.is_text else spec.num_patches + 1
        size = spec.image_size
        name = f"fixed:{w.seq_len}" if spec.is_text else f"image:{size}x{size}"
        base_of[w] = dict(suite=w.suite, model=model, tenants=w.tenants,
                          requests_per_tenant=w.requests_per_tenant, seq_len=int(L),
                          workload=name, device=device_name(device), dtype=dtype_name,
                          fine_tune=opt.fine_tune)

    def skip(system: str, strategy: str | None, reason: str, status: str = "skipped") -> None:
        for w in workloads:
            rows[(w, system, strategy)] = dict(base_of[w], system=system, strategy=strategy,
                                               status=status, reason=reason, latency_ms=None)

    # ---- which systems --------------------------------------------------------------------
    want = [s for s in SYSTEMS if s in opt.systems]
    if "itif_nographs" in want and device.type != "cuda":
        skip("itif_nographs", None, "CUDA graphs need CUDA; on the CPU itif runs without them")
        want.remove("itif_nographs")
    fam_systems = {"itif": [s for s in ("itif", "itif_nographs") if s in want],
                   "per_tenant": [s for s in ("seq", "multi_stream") if s in want],
                   "hf": [s for s in ("hf", "hf_compiled") if s in want]}

    def skip_family(fam: str, reason: str, status: str = "skipped") -> None:
        for s in fam_systems[fam]:
            if s.startswith("itif"):
                for st in opt.strategies:
                    skip(s, st, reason, status)
            else:
                skip(s, None, reason, status)

    # ---- the float32 reference (untimed, before anything else is on the device) ------------
    ref32: dict[Workload, np.ndarray] = {}
    why = reference_reason(spec, device, opt.hf_reference)
    if why is None:
        try:
            ref32 = reference_logits(spec, model, device, opt.fine_tune, names, weights,
                                     workloads, requests)
        except Exception as e:  # noqa: BLE001 - the check is lost, not the measurements
            log.warning("%s: float32 reference failed: %s: %s", model, type(e).__name__, e)
            why = f"reference failed: {type(e).__name__}: {e}"
    if why is not None:
        log.info("%s x%d: no float32 reference (%s)", model, n_tenants, why)

    # ---- families and phases ------------------------------------------------------------
    families = []
    if fam_systems["itif"]:
        cap = 1 << max(0, n_tenants - 1).bit_length()  # the store grows by doubling
        families.append(("itif", 1.5 * cap * one))
    if fam_systems["per_tenant"]:
        families.append(("per_tenant", 1.1 * n_tenants * one))
    if fam_systems["hf"]:
        reason = hf_unavailable()
        if reason:
            skip_family("hf", reason)
        else:
            # compiled code, autotuning and CUDA graph pools want room beyond the weights
            extra = (1 << 30) if "hf_compiled" in fam_systems["hf"] and device.type == "cuda" \
                else 0
            families.append(("hf", 1.1 * n_tenants * one + extra))
    avail = available_bytes(device)
    together = sum(b for _, b in families) <= 0.7 * avail
    phases = [families] if together else [[f] for f in families]
    log.info("%s x%d tenants: %s, %s available, families %s", model, n_tenants,
             "interleaved" if together else "one family at a time", _gib(avail),
             [f for f, _ in families])

    ctx = _Context(spec, names, opt, device, peak, ref32)
    for phase in phases:
        systems: list[System] = []
        for fam, need in phase:
            have = available_bytes(device) if not together else avail
            if need > 0.8 * have:
                skip_family(fam, f"needs about {_gib(need)} for {n_tenants} tenants, "
                                 f"{_gib(have)} available")
                continue
            try:
                systems += _build(fam, spec, names, weights, device, dtype, opt, fam_systems[fam],
                                  model=model, keep_models=together)
            except Exception as e:  # noqa: BLE001
                log.warning("%s: building %s failed: %s", model, fam, e)
                skip_family(fam, f"build failed: {type(e).__name__}: {e}", "error")
        for w in workloads:
            _measure_workload(w, systems, requests[w], rows, base_of[w], reference, ctx)
        for s in systems:
            s.close()
        del systems
        _free(device)

    if "mps" in want:
        _run_mps(model, spec, device, dtype_name, names, workloads, requests, opt, rows, base_of,
                 reference, ctx)
    out = list(rows.values())
    speedups(out)
    return out


@dataclass
class _Context:
    spec: object
    names: list
    opt: OfflineSettings
    device: torch.device
    peak: Peak | None
    ref32: dict


def _build(fam, spec, names, weights, device, dtype, opt, systems, model: str = "",
           keep_models: bool = False) -> list[System]:
    dtype_name = str(dtype).removeprefix("torch.")
    # Every system repeats one batch structure here: graphs are captured on first sight (in the
    # untimed warm-up), fused and per-tenant engines alike; the daemon's "auto" waits until a
    # structure has repeated, and reaches the same replays once it has.
    graphs = "on"
    if fam == "itif":
        engine = Engine(spec, device=str(device), dtype=dtype_name, cuda_graphs=graphs)
        for i, t in enumerate(names):
            engine.add_tenant(t, weights(i))
        if any(s in ("itif_two_stage", "turbo_dp") for s in opt.strategies):
            engine.get_cost_model()  # profile (or load) before anything is timed
        has_switch = engine_graphs(engine) is not None
        out: list[System] = []
        if "itif" in systems:
            # graphs on where the engine has them (CUDA); the CPU engine has none to switch
            on = True if has_switch and device.type == "cuda" else None
            out += [Fused(engine, s, graphs=on) for s in opt.strategies]
        if "itif_nographs" in systems:
            if not has_switch:
                raise RuntimeError("this Engine has no cuda_graphs switch")
            out += [Fused(engine, s, graphs=False) for s in opt.strategies]
        return out
    if fam == "per_tenant":
        per = {}
        for i, t in enumerate(names):
            e = Engine(spec, device=str(device), dtype=dtype_name, cuda_graphs=graphs)
            e.add_tenant(t, weights(i))
            per[t] = e
        out = []
        if "seq" in systems:
            out.append(Seq(per))
        if "multi_stream" in systems:
            out.append(MultiStream(per, device))
        return out
    models = _hf_models(spec, model, opt.fine_tune, names, weights, device, dtype, keep_models)
    out = []
    if "hf" in systems:
        out.append(HF(models, spec.is_text, device))
    if "hf_compiled" in systems:
        import torch._dynamo  # noqa: PLC0415

        cfg = torch._dynamo.config
        for k in ("recompile_limit", "cache_size_limit"):  # one entry per input shape
            if hasattr(cfg, k) and getattr(cfg, k) < 64:
                setattr(cfg, k, 64)
        out.append(HFCompiled(models, spec.is_text, device, opt.compile_mode, opt.compile_bound))
    return out


def _key(s: System):
    return (s.name, s.strategy if s.name.startswith("itif") else None)


def _measure_workload(w, systems, reqs, rows, base, reference, ctx: _Context):
    if not systems:
        return
    spec, names, opt, device, peak = ctx.spec, ctx.names, ctx.opt, ctx.device, ctx.peak
    failed: dict[int, str] = {}

    def on_error(s, e):
        failed[id(s)] = failure(e)
        log.warning("%s %s failed: %s", w, s.name, e)

    live = load_all(((s, reqs) for s in systems), on_error)
    base = dict(base, host_probe_ms=host_probe_ms())
    times = measure(live, opt.repeats, opt.warmup, on_error)
    alone = {}
    if opt.alone:
        alone = measure_alone([s for s in live if id(s) not in failed], opt.repeats, opt.warmup,
                              lambda s, e: log.warning("%s %s failed back to back: %s", w,
                                                       s.name, e))
    n = len(reqs)
    lengths = [len(r.input_ids) if spec.is_text else spec.num_patches + 1 for r in reqs]
    ref_strategy = DEFAULT_STRATEGY if DEFAULT_STRATEGY in opt.strategies else opt.strategies[0]
    for s in systems:
        system, strategy = _key(s)
        if id(s) in failed:
            rows[(w, system, strategy)] = dict(base, system=system, strategy=strategy,
                                               status="error", reason=failed[id(s)],
                                               latency_ms=None)
            continue
        ms = np.asarray(times[id(s)])
        row = dict(base, system=system, strategy=s.strategy, status="ok",
                   latency_ms=round(float(np.median(ms)), 4),
                   latency_ms_min=round(float(ms.min()), 4),
                   latency_ms_max=round(float(ms.max()), 4), repeats=int(ms.size),
                   throughput_rps=round(n / float(np.median(ms)) * 1e3, 3))
        if id(s) in alone:
            row.update(alone[id(s)])
        logits = s.logits()
        if isinstance(s, Fused):
            row["graphs"] = s.graphs_used
            if s.strategy == ref_strategy and (w not in reference or s.graphs is not False):
                reference[w] = logits
            wbytes = batch_weight_bytes(s.engine, names, int(sum(lengths)))
            if peak is not None:
                row.update(roofline(forward_flops(spec, lengths), wbytes, row["latency_ms"],
                                    peak))
            if opt.bandwidth:
                row.update(weight_bound(wbytes, row["latency_ms"], opt.bandwidth))
        elif isinstance(s, (Seq, MultiStream)):
            row["graphs"] = engine_graphs(next(iter(s.engines.values())))
        if isinstance(s, HF):
            row["attn_implementation"] = s.attn_implementation
        if isinstance(s, HFCompiled):
            row.update(s.describe())
        if opt.counts:
            try:
                row.update(op_counts(s, device))
            except Exception as e:  # noqa: BLE001 - a count is a diagnostic, not the result
                row["counts_error"] = f"{type(e).__name__}: {e}"
                log.warning("%s %s: counting failed: %s", w, s.name, e)
        row["_logits"] = logits
        rows[(w, system, strategy)] = row
    # same-weights check: every system's answers against the fused engine's, and against
    # Hugging Face in float32
    ref = reference.get(w)
    ref32 = ctx.ref32.get(w)
    for s in systems:
        row = rows[(w, *_key(s))]
        got = row.pop("_logits", None)
        if got is None:
            continue
        if ref is not None and got.shape == ref.shape:
            row["max_abs_diff_vs_itif"] = float(np.abs(got - ref).max())
        if ref32 is not None and got.shape == ref32.shape:
            row["max_abs_diff_vs_hf_fp32"] = float(np.abs(got - ref32).max())


def _run_mps(model, spec, device, dtype_name, names, workloads, requests, opt, rows, base_of,
             reference, ctx) -> None:
    reason = mps_mod.unavailable(device)
    cap = opt.mps_max_tenants
    if reason is None and cap is not None and len(names) > cap:
        reason = (f"mps runs up to {cap} tenants here (--mps-max-tenants: one process per "
                  f"tenant takes too long to start for this run's time budget)")
    if reason is None:
        try:
            with tempfile.TemporaryDirectory(prefix="itif-bench-mps-") as tmp, \
                    mps_mod.mps_server(Path(tmp)) as env:
                sysm = mps_mod.ProcessPerTenant(model, device, dtype_name, names, opt.fine_tune,
                                                env)
                try:
                    for w in workloads:
                        _measure_workload(w, [sysm], requests[w], rows, base_of[w], reference,
                                          _Context(spec, names, opt, device, None, ctx.ref32))
                finally:
                    sysm.close()
            return
        except Exception as e:  # noqa: BLE001 - MPS setups fail in many ways; report, go on
            reason = f"MPS run failed: {type(e).__name__}: {e}"
            log.warning("%s", reason)
    for w in workloads:
        if (w, "mps", None) not in rows:
            rows[(w, "mps", None)] = dict(base_of[w], system="mps", strategy=None,
                                          status="skipped", reason=reason, latency_ms=None)


def speedups(rows: list[dict]) -> None:
    """speedup_vs_<baseline> (seq, hf, hf_compiled) on every measured row: the baseline's
    latency / its own; speedup_vs_<baseline>_alone the same of ``latency_ms_alone`` where
    both rows have it. Safe to run again on merged rows (it recomputes)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("suite") in ("serve", "serve_saturation", "serve_at_fraction"):
            continue
        groups.setdefault((r["suite"], r["model"], r["tenants"], r["requests_per_tenant"],
                           r["seq_len"], r.get("fine_tune")), []).append(r)
    for g in groups.values():
        base = {r["system"]: r["latency_ms"] for r in g if r.get("status") == "ok"
                and r["system"] in BASELINES}
        alone = {r["system"]: r["latency_ms_alone"] for r in g if r.get("status") == "ok"
                 and r["system"] in BASELINES and r.get("latency_ms_alone")}
        for r in g:
            for b in BASELINES:
                r.pop(f"speedup_vs_{b}", None)
                r.pop(f"speedup_vs_{b}_alone", None)
            if r.get("status") != "ok":
                continue
            for b, ms in base.items():
                r[f"speedup_vs_{b}"] = round(ms / r["latency_ms"], 4)
            if r.get("latency_ms_alone"):
                for b, ms in alone.items():
                    r[f"speedup_vs_{b}_alone"] = round(ms / r["latency_ms_alone"], 4)


_speedups = speedups  # the old name
