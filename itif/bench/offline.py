"""Offline measurements: every system answers the same batch of requests; latency per call.

One group per ``(model, tenants)``: the systems are built once (fused engine, per-tenant engines,
Hugging Face models), then each workload of the group is staged and measured, systems interleaved
round-robin (:func:`itif.bench.systems.measure`). When the systems together would not fit the
memory at hand, each family runs in its own phase and is freed before the next; a family that
does not fit even alone is reported as skipped with the reason. MPS runs last, in processes.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from itif.backbones.spec import load_spec
from itif.batching.strategies import DEFAULT_STRATEGY
from itif.bench import mps as mps_mod
from itif.bench.roofline import Peak, batch_weight_bytes, forward_flops, roofline
from itif.bench.systems import HF, Fused, MultiStream, Seq, System, measure
from itif.bench.tenants import hf_model, tenant_bytes, tenant_weights
from itif.bench.workloads import Workload, make_requests, tenant_names
from itif.platform import cupy_module, device_name, resolve_device, resolve_dtype
from itif.runtime.engine import Engine

log = logging.getLogger("itif.bench")

SYSTEMS = ("seq", "multi_stream", "mps", "hf", "itif")
_CACHE_WEIGHTS_BYTES = 2 << 30  # keep generated weights between families below this


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


def run_group(model: str, n_tenants: int, workloads: list[Workload], opt: OfflineSettings,
              peak: Peak | None) -> list[dict]:
    """Rows of every workload of one (model, tenants) group, every system."""
    spec = load_spec(model)
    device = resolve_device(opt.device)
    dtype = resolve_dtype(opt.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    elem = torch.empty((), dtype=dtype).element_size()
    names = tenant_names(n_tenants)
    requests = {w: make_requests(spec, w, seed=opt.seed) for w in workloads}
    rows: dict[tuple, dict] = {}
    reference: dict[Workload, np.ndarray] = {}  # fused logits, for the same-weights check

    one = tenant_bytes(spec, elem)
    cache: dict[int, object] = {}
    # Generated weights are kept for the next family when they fit (on CUDA the host's memory
    # is otherwise idle; on the CPU it is what the systems themselves need).
    limit = (0.3 * available_bytes(torch.device("cpu")) if device.type == "cuda"
             else _CACHE_WEIGHTS_BYTES)
    keep = n_tenants * tenant_bytes(spec, 4) <= limit

    def weights(i: int):
        if i in cache:
            return cache[i]
        w = tenant_weights(spec, i, opt.fine_tune)
        if keep:
            cache[i] = w
        return w

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

    # ---- families and phases ------------------------------------------------------------
    want = [s for s in SYSTEMS if s in opt.systems]
    families = []
    if "itif" in want:
        cap = 1 << max(0, n_tenants - 1).bit_length()  # the store grows by doubling
        families.append(("itif", 1.5 * cap * one))
    if "seq" in want or "multi_stream" in want:
        families.append(("per_tenant", 1.1 * n_tenants * one))
    if "hf" in want:
        reason = hf_unavailable()
        if reason:
            skip("hf", None, reason)
        else:
            families.append(("hf", 1.1 * n_tenants * one))
    avail = available_bytes(device)
    together = sum(b for _, b in families) <= 0.7 * avail
    phases = [families] if together else [[f] for f in families]
    log.info("%s x%d tenants: %s, %s available, families %s", model, n_tenants,
             "interleaved" if together else "one family at a time", _gib(avail),
             [f for f, _ in families])

    for phase in phases:
        systems: list[System] = []
        engines: list[Engine] = []
        for fam, need in phase:
            have = available_bytes(device) if not together else avail
            if need > 0.8 * have:
                reason = f"needs about {_gib(need)} for {n_tenants} tenants, {_gib(have)} available"
                for s in ({"itif": ["itif"], "hf": ["hf"]}.get(fam)
                          or [x for x in ("seq", "multi_stream") if x in want]):
                    for st in (opt.strategies if s == "itif" else [None]):
                        skip(s, st, reason)
                continue
            try:
                systems += _build(fam, spec, model, names, weights, device, dtype, opt, want,
                                  engines)
            except Exception as e:  # noqa: BLE001
                log.warning("%s: building %s failed: %s", model, fam, e)
                for s in ({"itif": ["itif"], "hf": ["hf"]}.get(fam) or ["seq", "multi_stream"]):
                    for st in (opt.strategies if s == "itif" else [None]):
                        if s in want:
                            skip(s, st, f"build failed: {type(e).__name__}: {e}", "error")
        for w in workloads:
            _measure_workload(w, systems, requests[w], opt, rows, base_of[w], reference, spec,
                              engines, names, peak)
        for s in systems:
            s.close()
        del systems, engines
        _free(device)

    if "mps" in want:
        _run_mps(model, spec, device, dtype_name, names, workloads, requests, opt, rows, base_of,
                 reference)
    out = list(rows.values())
    _speedups(out)
    return out


def _build(fam, spec, model, names, weights, device, dtype, opt, want, engines) -> list[System]:
    if fam == "itif":
        engine = Engine(model, device=str(device), dtype=str(dtype).removeprefix("torch."))
        for i, t in enumerate(names):
            engine.add_tenant(t, weights(i))
        engines.append(engine)
        if any(s in ("itif_two_stage", "turbo_dp") for s in opt.strategies):
            engine.get_cost_model()  # profile (or load) before anything is timed
        return [Fused(engine, s) for s in opt.strategies]
    if fam == "per_tenant":
        per = {}
        for i, t in enumerate(names):
            e = Engine(model, device=str(device), dtype=str(dtype).removeprefix("torch."))
            e.add_tenant(t, weights(i))
            per[t] = e
        out: list[System] = []
        if "seq" in want:
            out.append(Seq(per))
        if "multi_stream" in want:
            out.append(MultiStream(per, device))
        return out
    models = {t: hf_model(spec, weights(i), device, dtype) for i, t in enumerate(names)}
    return [HF(models, spec.is_text, device)]


def _key(s: System):
    return (s.name, s.strategy if s.name == "itif" else None)


def _measure_workload(w, systems, reqs, opt, rows, base, reference, spec, engines, names, peak):
    if not systems:
        return
    failed: dict[int, str] = {}

    def on_error(s, e):
        failed[id(s)] = f"{type(e).__name__}: {e}"
        log.warning("%s %s failed: %s", w, s.name, e)

    live = []
    for s in systems:
        try:
            s.load(reqs)
            live.append(s)
        except Exception as e:  # noqa: BLE001 - reported on its rows
            on_error(s, e)
    times = measure(live, opt.repeats, opt.warmup, on_error)
    n = len(reqs)
    lengths = [len(r.input_ids) if spec.is_text else spec.num_patches + 1 for r in reqs]
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
        logits = s.logits()
        ref_strategy = DEFAULT_STRATEGY if DEFAULT_STRATEGY in opt.strategies else opt.strategies[0]
        if isinstance(s, Fused) and s.strategy == ref_strategy:
            reference[w] = logits
        if isinstance(s, Fused) and peak is not None:
            flops = forward_flops(spec, lengths)
            wbytes = batch_weight_bytes(s.engine, names, int(sum(lengths)))
            row.update(roofline(flops, wbytes, row["latency_ms"], peak))
        if isinstance(s, HF):
            row["attn_implementation"] = s.attn_implementation
        row["_logits"] = logits
        rows[(w, system, strategy)] = row
    # same-weights check: every system's answers against the fused engine's
    ref = reference.get(w)
    for s in systems:
        row = rows[(w, *_key(s))]
        got = row.pop("_logits", None)
        if ref is not None and got is not None and got.shape == ref.shape:
            row["max_abs_diff_vs_itif"] = float(np.abs(got - ref).max())


def _run_mps(model, spec, device, dtype_name, names, workloads, requests, opt, rows, base_of,
             reference) -> None:
    reason = mps_mod.unavailable(device)
    if reason is None:
        try:
            with tempfile.TemporaryDirectory(prefix="itif-bench-mps-") as tmp, \
                    mps_mod.mps_server(Path(tmp)) as env:
                sysm = mps_mod.ProcessPerTenant(model, device, dtype_name, names, opt.fine_tune,
                                                env)
                try:
                    for w in workloads:
                        _measure_workload(w, [sysm], requests[w], opt, rows, base_of[w],
                                          reference, spec, [], names, None)
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


def _speedups(rows: list[dict]) -> None:
    """speedup_vs_seq / speedup_vs_hf on every measured row (the baseline's latency / its own)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["suite"], r["model"], r["tenants"], r["requests_per_tenant"],
                           r["seq_len"]), []).append(r)
    for g in groups.values():
        base = {r["system"]: r["latency_ms"] for r in g if r["status"] == "ok"
                and r["system"] in ("seq", "hf")}
        for r in g:
            if r["status"] != "ok":
                continue
            for b, ms in base.items():
                r[f"speedup_vs_{b}"] = round(ms / r["latency_ms"], 4)
