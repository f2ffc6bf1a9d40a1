"""Where one fused forward's time goes on a GPU: host work, graph replay, and kernels by kind.

    python bench/profile_forward.py [--models bert-base vit-base:32 ...] [--tenants 4 32]
        [--out OUT/profile.json]

For each model and each T (``--tenants``, or the model's own list after a colon; the engine holds
the largest T and smaller T use its first tenants), for T
full fine-tunes with one 128-token request each (ViT: one image each), it times
``Engine.infer`` with CUDA graphs on and off; the GPU time of one graph replay alone (CUDA
events around the replay, inputs already in place); the host part (``infer`` with the forward
replaced by a no-op) and the host functions that take it (cProfile of ``infer`` with graphs on,
by own time); and, under ``torch.profiler``, the kernels of one eager forward summed by
name and by kind (GEMM, attention, itif RawKernels, other), with launches counted. It also
reports the weight-bandwidth bound: distinct weight bytes of the batch over a measured
device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import itif  # noqa: E402
from itif.backbones.spec import load_spec  # noqa: E402
from itif.bench.tenants import tenant_weights  # noqa: E402
from itif.runtime import forward  # noqa: E402


def _ms(f, n: int = 20) -> float:
    f()
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def kind_of(name: str) -> str:
    n = name.lower()
    # attention first: flash-attention's kernels name their cutlass types
    # ("pytorch_flash::flash_fwd_kernel<...cutlass::half_t...>")
    if any(k in n for k in ("flash", "fmha", "attention", "efficient")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "ampere_", "cublas",
                            "nvjet", "s16816")):
        return "gemm"
    if any(k in n for k in ("bias_act", "layernorm", "embed_text", "masked_softmax")):
        return "itif_rawkernel"
    return "other"


def host_functions(f, n: int = 20, top: int = 12) -> list[dict]:
    """The host functions of ``f`` by own time (cProfile, ``n`` calls): where its host part goes."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    f()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        f()
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # (cc, nc, tt, ct, callers)
    return [dict(function=f"{Path(k[0]).name}:{k[1]}({k[2]})", calls_per_run=v[1] / n,
                 own_ms_per_run=round(v[2] / n * 1e3, 4), cum_ms_per_run=round(v[3] / n * 1e3, 4))
            for k, v in rows]


def parse_models(models: list[str], tenants: list[int]) -> list[tuple[str, list[int]]]:
    """``name`` (the common ``--tenants``) or ``name:T1,T2`` (its own)."""
    out = []
    for m in models:
        name, _, ts = m.partition(":")
        out.append((name, [int(t) for t in ts.split(",")] if ts else list(tenants)))
    return out


def profile_one(eng, spec, T: int, dtype: str) -> dict:
    rng = np.random.default_rng(0)
    if spec.is_text:
        reqs = [itif.Request(f"t{i}", input_ids=rng.integers(0, spec.vocab_size, 128))
                for i in range(T)]
    else:
        shape = (spec.num_channels, spec.image_size, spec.image_size)
        reqs = [itif.Request(f"t{i}", pixel_values=rng.standard_normal(shape).astype(np.float32))
                for i in range(T)]
    res: dict = dict(model=spec.name, tenants=T, dtype=dtype, device=torch.cuda.get_device_name())
    eng.cuda_graphs = "on"  # captured on first sight: a repeated structure
    res["infer_graphs_ms"] = _ms(lambda: eng.infer(reqs))
    g = eng._graphs._graphs[next(reversed(eng._graphs._graphs))]  # the graph just replayed
    eng.cuda_graphs = False
    res["infer_eager_ms"] = _ms(lambda: eng.infer(reqs))
    # GPU time of one replay alone
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.graph.replay()
    s.record()
    for _ in range(10):
        g.graph.replay()
    e.record()
    e.synchronize()
    res["graph_replay_gpu_ms"] = s.elapsed_time(e) / 10
    # host part: infer with the forward replaced by a no-op of the right size
    real = forward.run
    forward.run = lambda spec_, b, ints, floats=None: torch.zeros(sum(b.out_sizes),
                                                                  device="cuda")
    try:
        res["infer_host_only_ms"] = _ms(lambda: eng.infer(reqs))
    finally:
        forward.run = real
    res["infer_not_host_not_replay_ms"] = (res["infer_graphs_ms"] - res["infer_host_only_ms"]
                                           - res["graph_replay_gpu_ms"])
    eng.cuda_graphs = "on"
    res["host_functions"] = host_functions(lambda: eng.infer(reqs))
    eng.cuda_graphs = False
    # kernels of one eager forward
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    eng.infer(reqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        eng.infer(reqs)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and ev.name and (
                "memcpy" not in ev.name.lower() and "memset" not in ev.name.lower()):
            us = getattr(ev, "device_time_total", 0.0) or ev.time_range.elapsed_us()
            kernels.setdefault(ev.name, []).append(us)
    by_kind: dict[str, dict] = {}
    for name, ts in kernels.items():
        k = by_kind.setdefault(kind_of(name), {"us": 0.0, "launches": 0})
        k["us"] += sum(ts)
        k["launches"] += len(ts)
    res["eager_kernels"] = sum(len(v) for v in kernels.values())
    res["eager_kernel_us_by_kind"] = {k: {"us": round(v["us"], 1), "launches": v["launches"]}
                                      for k, v in sorted(by_kind.items())}
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    res["top_kernels"] = [dict(name=n[:120], us=round(sum(t), 1), launches=len(t)) for n, t in top]
    from itif.bench.roofline import batch_weight_bytes, copy_bandwidth  # noqa: PLC0415

    bw, _ = copy_bandwidth(torch.device("cuda"))
    wbytes = batch_weight_bytes(eng, [f"t{i}" for i in range(T)], T * 128)
    res["copy_bandwidth_tb_s"] = bw / 1e12
    res["weight_bytes"] = wbytes
    res["weight_bound_ms"] = wbytes / bw * 1e3
    res["weight_bound_fraction_latency"] = res["weight_bound_ms"] / res["infer_graphs_ms"]
    res["weight_bound_fraction_gpu"] = res["weight_bound_ms"] / res["graph_replay_gpu_ms"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["bert-base"])
    ap.add_argument("--tenants", nargs="+", type=int, default=[4, 32])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_forward: SKIPPED (no CUDA: this profiles the GPU path)")
        return 0
    rows = []
    for model, tenants in parse_models(args.models, args.tenants):
        spec = load_spec(model)
        eng = itif.Engine(spec, device="cuda", dtype=args.dtype)
        for i in range(max(tenants)):
            eng.add_tenant(f"t{i}", tenant_weights(spec, i))
        for T in tenants:
            try:
                r = profile_one(eng, spec, T, args.dtype)
            except Exception as e:  # noqa: BLE001 - keep the other rows; say what broke
                r = dict(model=spec.name, tenants=T, error=f"{type(e).__name__}: {e}")
            print(json.dumps({k: v for k, v in r.items()
                              if k not in ("top_kernels", "host_functions")}), flush=True)
            rows.append(r)
            if args.out:  # after every row: a timeout still leaves what was measured
                Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        del eng
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
