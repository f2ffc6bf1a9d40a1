"""Benchmark the memory-bound ops: per-tenant launches (SEQ) vs fused rotation (one launch).

GPU only. BERT-base shapes by default (hidden 768, FFN 3072, 4 tenants x 128 tokens). For each
op it times, with CUDA events after a warm-up, the median over repeats of:

* ``seq_kernel``: the same CUDA kernel launched once per tenant on its slice of rows (what a
  per-tenant engine does), with that tenant's parameters;
* ``seq_torch``: plain torch ops per tenant (the unfused baseline);
* ``reference``: the torch reference over all rows (index_select of per-row parameters);
* ``fused``: one CUDA kernel over all rows with per-row slots (model weights rotation), under
  each launch configuration (Eq. 4.3-4.4 rows / flat / block / warp, vectorised or not).

Attention (SDPA vs bmm + masked softmax) and the per-slot GEMM backends are timed too.
Writes bench/results/ops_<device>.json.

    python bench/bench_ops.py [--dtype float16] [--tenants 4] [--tokens 128] [--hidden 768]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from itif.ops import cuda, reference
from itif.ops.reference import AttnGroup, RotParam
from itif.platform import cupy_module
from itif.runtime import gemm_cuda


def timeit(fn: Callable[[], object], warmup: int, repeats: int, inner: int) -> dict:
    """Median/p10/p90 microseconds per call; each sample times ``inner`` calls with events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1000.0 / inner)
    samples.sort()
    q = lambda f: samples[min(len(samples) - 1, int(f * len(samples)))]
    return {"median_us": statistics.median(samples), "p10_us": q(0.1), "p90_us": q(0.9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per tenant")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("bench_ops.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing run.",
              file=sys.stderr)
        return 2
    if cupy_module() is None:
        print("bench_ops.py needs CuPy (pip install cupy-cuda12x or cupy-cuda13x).",
              file=sys.stderr)
        return 2

    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    nt, tok, H, FF = args.tenants, args.tokens, args.hidden, args.ffn
    T = nt * tok
    torch.manual_seed(0)
    slot = torch.arange(nt, device=dev).repeat_interleave(tok)  # tenant t -> slot t
    spans = [(t * tok, (t + 1) * tok) for t in range(nt)]

    def rot(width):
        return RotParam(torch.randn(nt, width, device=dev, dtype=dtype), slot)

    def tenant_rot(p: RotParam, t: int) -> RotParam:  # one tenant's slice, its own slot
        a, b = spans[t]
        return RotParam(p.buf, p.slot[a:b])

    x_h, x_f, res = (torch.randn(T, w, device=dev, dtype=dtype) for w in (H, FF, H))
    b_h, b_f, gamma, beta = rot(H), rot(FF), rot(H), rot(H)
    timing = {"warmup": args.warmup, "repeats": args.repeats, "inner": args.inner}
    results: list[dict] = []

    def record(op, variant, fn, **extra):
        r = timeit(fn, **timing)
        results.append({"op": op, "variant": variant, **extra, **r})
        print(f"{op:28s} {variant:34s} {r['median_us']:9.2f} us")

    ew_policies = {
        "rows_eq43_vec": {"elementwise": "rows", "vectorize": True},
        "rows_eq43_scalar": {"elementwise": "rows", "vectorize": False},
        "flat_vec": {"elementwise": "flat", "vectorize": True},
        "flat_scalar": {"elementwise": "flat", "vectorize": False},
    }
    ln_policies = {
        "block_eq43_vec_smem": {"layernorm": "block"},
        "block_eq43_vec_nocache": {"layernorm": "block", "ln_smem_cache": False},
        "block_eq43_scalar": {"layernorm": "block", "vectorize": False},
        "warp4_vec_smem": {"layernorm": "warp", "warps_per_block": 4},
        "warp8_vec_smem": {"layernorm": "warp", "warps_per_block": 8},
        "warp4_vec_nocache": {"layernorm": "warp", "ln_smem_cache": False},
    }

    # -- bias + GELU over the FFN intermediate ----------------------------------------------
    def seq_kernel_bias_act():
        for t, (a, b) in enumerate(spans):
            cuda.bias_act(x_f[a:b], tenant_rot(b_f, t), "gelu")

    def seq_torch_bias_act():
        for t, (a, b) in enumerate(spans):
            v = x_f[a:b]
            v.add_(b_f.buf[t])
            v.copy_(F.gelu(v))

    record("bias_act_gelu", "seq_kernel", seq_kernel_bias_act)
    record("bias_act_gelu", "seq_torch", seq_torch_bias_act)
    record("bias_act_gelu", "reference", lambda: reference.bias_act(x_f, b_f, "gelu"))
    for name, pol in ew_policies.items():
        with cuda.launch_policy(**pol):
            record("bias_act_gelu", f"fused_{name}", lambda: cuda.bias_act(x_f, b_f, "gelu"))

    # -- bias + residual (pre-LN residual add) -----------------------------------------------
    def seq_kernel_bias_res():
        for t, (a, b) in enumerate(spans):
            cuda.bias_residual(x_h[a:b], tenant_rot(b_h, t), res[a:b])

    def seq_torch_bias_res():
        for t, (a, b) in enumerate(spans):
            x_h[a:b].add_(b_h.buf[t]).add_(res[a:b])

    record("bias_residual", "seq_kernel", seq_kernel_bias_res)
    record("bias_residual", "seq_torch", seq_torch_bias_res)
    record("bias_residual", "reference", lambda: reference.bias_residual(x_h, b_h, res))
    for name, pol in ew_policies.items():
        with cuda.launch_policy(**pol):
            record("bias_residual", f"fused_{name}", lambda: cuda.bias_residual(x_h, b_h, res))
    x_h.normal_()  # the repeated adds grew it

    # -- bias + residual + LayerNorm -----------------------------------------------------------
    def seq_kernel_ln():
        for t, (a, b) in enumerate(spans):
            cuda.bias_residual_layernorm(x_h[a:b], tenant_rot(b_h, t), res[a:b],
                                         tenant_rot(gamma, t), tenant_rot(beta, t), 1e-12)

    def seq_torch_ln():
        for t, (a, b) in enumerate(spans):
            F.layer_norm(x_h[a:b] + b_h.buf[t] + res[a:b], (H,), gamma.buf[t], beta.buf[t],
                         1e-12)

    record("bias_residual_layernorm", "seq_kernel", seq_kernel_ln)
    record("bias_residual_layernorm", "seq_torch", seq_torch_ln)
    record("bias_residual_layernorm", "reference",
           lambda: reference.bias_residual_layernorm(x_h, b_h, res, gamma, beta, 1e-12))
    for name, pol in ln_policies.items():
        with cuda.launch_policy(**pol):
            record("bias_residual_layernorm", f"fused_{name}",
                   lambda: cuda.bias_residual_layernorm(x_h, b_h, res, gamma, beta, 1e-12))

    # -- embeddings ------------------------------------------------------------------------------
    vocab, npos = 30522, 512
    word = RotParam(torch.randn(nt, vocab, H, device=dev, dtype=dtype), slot)
    pos = RotParam(torch.randn(nt, npos, H, device=dev, dtype=dtype), slot)
    typ = RotParam(torch.randn(nt, 2, H, device=dev, dtype=dtype), slot)
    ids = torch.randint(0, vocab, (T,), device=dev)
    positions = torch.arange(tok, device=dev).repeat(nt)
    types = torch.zeros(T, dtype=torch.int64, device=dev)

    def seq_kernel_embed():
        for t, (a, b) in enumerate(spans):
            cuda.embed_text(tenant_rot(word, t), tenant_rot(pos, t), tenant_rot(typ, t),
                            ids[a:b], positions[a:b], types[a:b])

    def seq_torch_embed():
        for t, (a, b) in enumerate(spans):
            F.embedding(ids[a:b], word.buf[t]) + F.embedding(positions[a:b], pos.buf[t]) \
                + F.embedding(types[a:b], typ.buf[t])

    record("embed_text", "seq_kernel", seq_kernel_embed)
    record("embed_text", "seq_torch", seq_torch_embed)
    record("embed_text", "reference",
           lambda: reference.embed_text(word, pos, typ, ids, positions, types))
    for name, pol in ew_policies.items():
        with cuda.launch_policy(**pol):
            record("embed_text", f"fused_{name}",
                   lambda: cuda.embed_text(word, pos, typ, ids, positions, types))

    # -- attention: SDPA vs bmm + masked softmax ---------------------------------------------
    qkv = torch.randn(T, 3 * H, device=dev, dtype=dtype)
    view = [AttnGroup(n=nt, L=tok)]
    lengths = torch.randint(tok // 2, tok + 1, (nt,))
    km = (torch.arange(tok)[None] < lengths[:, None])
    rows = torch.where(km, torch.arange(T).view(nt, tok), 0)
    valid = torch.nonzero(km.reshape(-1)).squeeze(1)
    gather = [AttnGroup(n=nt, L=tok, rows=rows.to(dev), valid=valid.to(dev),
                        dest=rows.reshape(-1)[valid].to(dev), key_mask=km.view(nt, 1, 1, tok)
                        .to(dev))]
    for gname, groups in (("view", view), ("gather_masked", gather)):
        for mode in ("sdpa", "softmax_bmm"):
            with cuda.launch_policy(attention=mode):
                record(f"attention_{gname}", mode,
                       lambda groups=groups: cuda.attention(qkv, groups, args.heads))

    # -- per-slot GEMM backends (QKV projection shape) -----------------------------------------
    w = torch.randn(nt, 3 * H, H, device=dev, dtype=dtype) / H**0.5
    seg_start = [a for a, _ in spans]
    seg_end = [b for _, b in spans]
    plans = {
        "consecutive_slots": list(range(nt)),
        "arbitrary_slots": [(3 * t + 1) % nt for t in range(nt)],
        "one_slot": [0] * nt,
    }
    for pname, seg_slot in plans.items():
        out = torch.empty(T, 3 * H, device=dev, dtype=dtype)
        for bname, fn in gemm_cuda.BACKENDS.items():
            if fn(x_h, w, seg_start, seg_end, seg_slot, out=out) is None:
                continue
            record(f"gemm_qkv_{pname}", bname,
                   lambda fn=fn, s=seg_slot, o=out: fn(x_h, w, seg_start, seg_end, s, out=o))

    # -- summary ---------------------------------------------------------------------------------
    speedups = {}
    for op in sorted({r["op"] for r in results}):
        rs = {r["variant"]: r["median_us"] for r in results if r["op"] == op}
        fused = {k: v for k, v in rs.items() if k.startswith("fused_")}
        if fused and "seq_kernel" in rs:
            best = min(fused, key=fused.get)
            speedups[op] = {"best_fused": best, "seq_kernel_over_best_fused":
                            rs["seq_kernel"] / fused[best]}
    device_name = torch.cuda.get_device_name()
    report = {
        "device": device_name,
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cupy": cupy_module().__version__,
        "dtype": args.dtype,
        "shapes": {"tenants": nt, "tokens_per_tenant": tok, "hidden": H, "ffn": FF,
                   "heads": args.heads},
        "timing": {**timing, "method": "CUDA events around `inner` calls; median of repeats"},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
        "speedups": speedups,
    }
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_").lower()
    out_path = args.out or ROOT / "bench" / "results" / f"ops_{slug}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_path}")
    for op, s in speedups.items():
        print(f"{op:28s} seq_kernel / {s['best_fused']}: {s['seq_kernel_over_best_fused']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
