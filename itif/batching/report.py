"""``itif plan``: plan one batch with every strategy, run it on the engine, report the figures.

Output: ``{"backbone", "device", "workload", "tenants", "requests", "strategies": {name:
{"padded_tokens", "useful_tokens", "predicted_ms", "measured_ms", "plan_us_per_request",
"gemm_calls"}}}``. Tenants get random weights (timing does not depend on values).
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


def sample_tenants(n_tenants: int, n: int, skew: str | None, rng: np.random.Generator) -> np.ndarray:
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
    b = prepare(engine.spec, layout, tenants, view, engine._slot_tables(view, tenants),
                engine.device, engine.dtype, ids=ids)
    per_set = {i: sum(len(b.params.segments(f"layers.{i}.{k}")[1]) for k in GEMM_KINDS)
               for i in range(engine.spec.num_param_layers)}
    return sum(per_set[engine.spec.layer_params(layer)] for layer in range(engine.spec.layers))


def plan_report(backbone: str, workload: str, n_tenants: int, n_requests: int,
                skew: str | None = None, seed: int = 0, repeats: int = 3,
                engine: Engine | None = None) -> dict:
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

    reqs = [Request(names[t], rng.integers(0, spec.vocab_size, n)) for t, n in zip(tenant_of, lengths)]
    ids = np.concatenate([r.input_ids for r in reqs])
    engine.get_cost_model()
    out = {}
    for name in STRATEGIES:
        t0 = time.perf_counter()
        for _ in range(20):
            layout = engine.plan(tenant_of, lengths, name)
        plan_s = (time.perf_counter() - t0) / 20
        engine.infer(reqs, strategy=name)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.infer(reqs, strategy=name)
            times.append(time.perf_counter() - t0)
        out[name] = dict(
            padded_tokens=layout.padded_tokens, useful_tokens=layout.useful_tokens,
            predicted_ms=round(float(layout.predicted_ms), 3),
            measured_ms=round(float(np.median(times)) * 1e3, 3),
            plan_us_per_request=round(plan_s * 1e6 / n_requests, 3),
            gemm_calls=gemm_calls(engine, layout, names, ids),
        )
    return dict(backbone=spec.name, device=device_name(engine.device), workload=workload,
                tenants=n_tenants, requests=n_requests, skew=skew, strategies=out)
