"""``itif plan``: plan one batch with every strategy, run it on the engine, report the figures.

Output: ``{"backbone", "device", "workload", "tenants", "requests", "strategies": {name:
{"padded_tokens", "useful_tokens", "predicted_ms", "measured_ms", "plan_us_per_request",
"gemm_calls"}}, "prediction": {...}}``. Tenants get random weights (timing does not depend on
values).

``predicted_ms`` is the whole-batch cost model's prediction (``itif.calibration.batch_cost``: the
GEMM backend of every plan, attention per group, memory-bound ops, embeddings, heads and host
overhead, calibrated offline on this device, no online correction) of one forward of the planned
layout; ``measured_ms`` is the median wall time of that forward through ``Engine.infer`` with
the plan fixed (prepare, forward, results; planning is ``plan_us_per_request``), best of
``repeats`` rounds in which the strategies take turns (the median is in ``prediction``), on
``batch_cost.clock``: the thread's CPU time at one torch thread (``--threads 1``), else wall
time (best wall time in ``prediction`` too). ``prediction``
holds each strategy's relative error, the layer cost model's old estimate
(``legacy_predicted_ms``, what the DP planners optimise), the strategy rankings both imply and
``discordant_pairs``: ``[faster, slower]`` pairs, measured more than 5 % apart, that the
predictions order the other way (empty: the rankings agree up to ties).
"""

from __future__ import annotations

import re
import time

import numpy as np

from itif.backbones.random import random_weights
from itif.batching.strategies import STRATEGIES
from itif.errors import InvalidRequest
from itif.platform import device_name
from itif.runtime.batch import prepare
from itif.runtime.engine import Engine

GEMM_KINDS = ("qkv.weight", "attn_out.weight", "ffn_in.weight", "ffn_out.weight")


def sample_lengths(workload: str, n: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """``uniform:LO-HI`` or ``normal:MEAN:VAR`` (clipped to 1..max_len)."""
    m = re.fullmatch(r"uniform:(\d+)-(\d+)", workload)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi:
            raise InvalidRequest(f"workload {workload!r}: need 1 <= LO <= HI")
        lens = rng.integers(lo, hi + 1, n)
    else:
        m = re.fullmatch(r"normal:([\d.]+):([\d.]+)", workload)
        if not m:
            raise InvalidRequest(f"workload {workload!r} is not uniform:LO-HI or normal:MEAN:VAR")
        lens = np.rint(rng.normal(float(m.group(1)), np.sqrt(float(m.group(2))), n))
    return np.clip(lens, 1, max_len).astype(np.int32)


def sample_tenants(n_tenants: int, n: int, skew: str | None,
                   rng: np.random.Generator) -> np.ndarray:
    """Tenant of each request: uniform, or ``zipf:A`` popularity (tenant i ~ 1 / (i+1)^A)."""
    if not skew:
        return rng.integers(0, n_tenants, n).astype(np.int32)
    m = re.fullmatch(r"zipf:([\d.]+)", skew)
    if not m:
        raise InvalidRequest(f"skew {skew!r} is not zipf:A")
    p = 1.0 / np.arange(1, n_tenants + 1) ** float(m.group(1))
    return rng.choice(n_tenants, n, p=p / p.sum()).astype(np.int32)


def gemm_calls(engine: Engine, layout, tenants, ids) -> int:
    """GEMM launches of one forward on the CPU path: one per row segment per linear layer."""
    view = engine.store.view
    b = prepare(engine.spec, layout, tenants, view, engine.slot_tables(view, tenants),
                engine.device, engine.dtype, ids=ids)
    per_set = {i: sum(len(b.params.segments(f"layers.{i}.{k}")[1]) for k in GEMM_KINDS)
               for i in range(engine.spec.num_param_layers)}
    return sum(per_set[engine.spec.layer_params(layer)] for layer in range(engine.spec.layers))


def plan_report(backbone: str, workload: str, n_tenants: int, n_requests: int,
                skew: str | None = None, seed: int = 0, repeats: int = 9,
                engine: Engine | None = None, threads: int | None = None) -> dict:
    """``threads``: torch's CPU thread count for this report (restored afterwards); 1 gives
    steadier figures on a CPU shared with other work (no parallel region waits out a
    descheduled thread). Calibration is cached per thread count."""
    if threads is not None:
        import torch  # noqa: PLC0415

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return plan_report(backbone, workload, n_tenants, n_requests, skew, seed, repeats,
                               engine)
        finally:
            torch.set_num_threads(before)
    rng = np.random.default_rng(seed)
    if engine is None:
        engine = Engine(backbone)
        for i in range(n_tenants):
            engine.add_tenant(f"t{i}", random_weights(engine.spec, num_labels=2, seed=i))
    spec = engine.spec
    if not spec.is_text:
        raise InvalidRequest("itif plan takes a text backbone (ViT requests all have one length)")
    lengths = sample_lengths(workload, n_requests, spec.max_position, rng)
    tenant_of = sample_tenants(n_tenants, n_requests, skew, rng)
    names = tuple(f"t{i}" for i in range(n_tenants))
    from itif.runtime.engine import Request  # noqa: PLC0415

    reqs = [
        Request(names[t], rng.integers(0, spec.vocab_size, n)) for t, n in zip(tenant_of, lengths)
    ]
    # plan with the tenant indices the engine's own forward gives them: the batch's tenants
    # only (a tenant that drew no request has none), in the engine's order
    batch = engine.batch_tenants(engine.store.view, [r.tenant for r in reqs])
    index = {t: i for i, t in enumerate(batch)}
    tenant_of = np.array([index[r.tenant] for r in reqs], np.int64)
    ids = np.concatenate([r.input_ids for r in reqs])
    engine.get_cost_model()
    from itif.calibration.batch_cost import BatchCostModel, clock, measure_layout, prepare_for  # noqa: PLC0415

    model = BatchCostModel.cached(engine)
    out, legacy, err, medians, layouts, predicted = {}, {}, {}, {}, {}, {}
    for name in STRATEGIES:
        t0 = time.perf_counter()
        for _ in range(20):
            layout = engine.plan(tenant_of, lengths, name)
        plan_s = (time.perf_counter() - t0) / 20
        layouts[name] = layout
        predicted[name] = model.predict_batch(layout, prepare_for(engine, reqs, layout), key=())
        legacy[name] = round(float(layout.predicted_ms), 3)
        out[name] = dict(
            padded_tokens=layout.padded_tokens, useful_tokens=layout.useful_tokens,
            predicted_ms=round(predicted[name], 3), measured_ms=0.0,
            plan_us_per_request=round(plan_s * 1e6 / n_requests, 3),
            gemm_calls=gemm_calls(engine, layout, batch, ids),
        )
    # Strategies take turns, one forward each per round, so a burst of load from other work
    # on the machine lands on all of them rather than on one strategy's samples.
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    walls: dict[str, float] = {name: float("inf") for name in STRATEGIES}
    for r in range(max(repeats, 1)):
        for name in STRATEGIES:
            stats: dict = {}
            times[name].append(measure_layout(engine, reqs, layouts[name], repeats=1,
                                              warmup=r == 0, stats=stats))
            walls[name] = min(walls[name], round(stats["wall_ms"], 3))
    for name in STRATEGIES:
        measured = min(times[name])
        medians[name] = round(float(np.median(times[name])), 3)
        err[name] = round((predicted[name] - measured) / measured, 4)
        out[name]["measured_ms"] = round(measured, 3)
    by = lambda field: sorted(out, key=lambda k: out[k][field])  # noqa: E731
    # Pairs the predictions order against a clear (> 5 %) measured difference; closer pairs
    # are ties within the noise of one shared machine and do not count against the ranking.
    discordant = [[a, b] for a in out for b in out
                  if out[b]["measured_ms"] > 1.05 * out[a]["measured_ms"]
                  and out[b]["predicted_ms"] <= out[a]["predicted_ms"]]
    prediction = dict(discordant_pairs=discordant, clock=clock()[1], measured_wall_ms=walls,
                      rel_err=err, max_abs_rel_err=max(abs(e) for e in err.values()),
                      legacy_predicted_ms=legacy, measured_median_ms=medians,
                      ranking_predicted=by("predicted_ms"),
                      ranking_measured=by("measured_ms"))
    return dict(backbone=spec.name, device=device_name(engine.device), workload=workload,
                tenants=n_tenants, requests=n_requests, skew=skew, strategies=out,
                prediction=prediction)
