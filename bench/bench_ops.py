"""Benchmark the memory-bound ops: per-tenant launches (SEQ) vs fused rotation (one launch).

Table 5.3 of the thesis: per-op times of SEQ (one launch per tenant) against the fused launch.
BERT-base shapes by default (hidden 768, FFN 3072, 4 tenants x 128 tokens). For each op it times,
with CUDA events after a warm-up, the median over repeats of:

* ``seq_kernel``: the same CUDA kernel launched once per tenant on its slice of rows (what a
  per-tenant engine does), with that tenant's parameters;
* ``seq_torch``: plain torch ops per tenant (the unfused baseline);
* ``reference``: the torch reference over all rows (index_select of per-row parameters);
* ``fused``: one CUDA kernel over all rows with per-row slots (model weights rotation), under
  each launch configuration (Eq. 4.3-4.4 rows / flat / block / warp, vectorised or not).

Attention (SDPA vs bmm + masked softmax) and the per-slot GEMM backends of
``itif.runtime.gemm`` (``BACKENDS``: mm, bmm, grouped_mm, loop; a backend that cannot run a plan
is recorded as skipped with its ValueError) are timed too. ``loop`` is one ``torch.mm`` a segment
(``ITIF_GROUPED_GEMM=loop`` around it: the SEQ of the GEMM rows); where the grouped cuBLAS call
serves the loop's plans (CUDA, float16 / bfloat16) it is timed as ``grouped_cublas``. On CUDA the
four products of a bert layer (T = --tenants and 32) are timed as the forward runs them with
cuBLAS (plus ``bias_act`` after qkv and ffn_in) and with itif's Triton GEMM, the bias and
activation in its epilogue (``triton_gemm_<kind>_T<n>``; ``itif.runtime.triton_gemm``). Every
section runs on its own: one that fails is recorded under ``errors`` and the others still run.

Without CUDA (or with ``--cpu``) it runs a reduced CPU pass: small shapes, the GEMM backends only
(timed with perf_counter), the CUDA/CuPy sections recorded under ``skipped`` with the reason.
Writes ``--out`` (default bench/results/ops_<device>.json).

    python bench/bench_ops.py [--dtype float16] [--tenants 4] [--tokens 128] [--hidden 768]
    python bench/bench_ops.py --cpu --out /tmp/ops.json      # the dry run's reduced pass
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from itif.platform import cupy_module  # noqa: E402


def timeit(fn: Callable[[], object], warmup: int, repeats: int, inner: int,
           cuda: bool = True) -> dict:
    """Median/p10/p90 microseconds per call; each sample times ``inner`` calls with CUDA events
    (``cuda``) or perf_counter (CPU)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1000.0 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / inner)
    samples.sort()
    q = lambda f: samples[min(len(samples) - 1, int(f * len(samples)))]  # noqa: E731 (a one-line local helper)
    return {"median_us": statistics.median(samples), "p10_us": q(0.1), "p90_us": q(0.9)}


def gemm_api():
    """``(BACKENDS, Segments, grouped_linear, plan_gemm, run_gemm)`` of ``itif.runtime.gemm``, or
    the reason it is not there yet (plan_gemm/run_gemm may be None: grouped_linear is then timed,
    checks and planning included)."""
    try:
        from itif.runtime import gemm as G  # noqa: PLC0415
    except ImportError as e:
        return None, f"itif.runtime.gemm does not import: {e}"
    missing = [n for n in ("BACKENDS", "Segments", "grouped_linear") if not hasattr(G, n)]
    if missing:
        return None, f"itif.runtime.gemm has no {', '.join(missing)} yet"
    return (G.BACKENDS, G.Segments, G.grouped_linear, getattr(G, "plan_gemm", None),
            getattr(G, "run_gemm", None)), None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                    help="default float16 on CUDA, float32 on the CPU")
    ap.add_argument("--tenants", type=int, default=None, help="default 4 (CPU pass: 2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per tenant (128; CPU 16)")
    ap.add_argument("--hidden", type=int, default=None, help="768 (CPU pass: 64)")
    ap.add_argument("--ffn", type=int, default=None, help="3072 (CPU pass: 256)")
    ap.add_argument("--heads", type=int, default=None, help="12 (CPU pass: 4)")
    ap.add_argument("--warmup", type=int, default=None, help="20 (CPU pass: 2)")
    ap.add_argument("--repeats", type=int, default=None, help="50 (CPU pass: 5)")
    ap.add_argument("--inner", type=int, default=None, help="20 (CPU pass: 2)")
    ap.add_argument("--cpu", action="store_true",
                    help="the reduced CPU pass (automatic without CUDA)")
    ap.add_argument("--emulate-kernels", action="store_true",
                    help="CPU pass only: run the kernel and attention sections too, with the torch "
                    "references (same signatures) standing in for the CUDA wrappers; checks the "
                    "script, not the kernels")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    on_gpu = torch.cuda.is_available() and not args.cpu
    small = dict(tenants=2, tokens=16, hidden=64, ffn=256, heads=4, warmup=2, repeats=5, inner=2)
    full = dict(tenants=4, tokens=128, hidden=768, ffn=3072, heads=12, warmup=20, repeats=50,
                inner=20)
    for k, v in (full if on_gpu else small).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dtype is None:
        args.dtype = "float16" if on_gpu else "float32"
    skipped: list[dict] = []
    errors: list[dict] = []
    cp = cupy_module() if on_gpu else None
    emulate = args.emulate_kernels and not on_gpu
    if emulate:
        print("bench_ops.py: reduced CPU pass with the torch references standing in for the "
              "CUDA wrappers (--emulate-kernels)", file=sys.stderr)
        kernels_why = None
    elif not on_gpu:
        why = ("--cpu" if args.cpu else "no CUDA device (torch.cuda.is_available() is False)")
        print(f"bench_ops.py: reduced CPU pass ({why}): GEMM backends only", file=sys.stderr)
        kernels_why = f"needs CUDA and CuPy; {why}"
    elif cp is None:
        kernels_why = "needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)"
    else:
        kernels_why = None

    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda" if on_gpu else "cpu")
    nt, tok, H, FF = args.tenants, args.tokens, args.hidden, args.ffn
    T = nt * tok
    torch.manual_seed(0)
    spans = [(t * tok, (t + 1) * tok) for t in range(nt)]
    timing = {"warmup": args.warmup, "repeats": args.repeats, "inner": args.inner}
    results: list[dict] = []

    def record(op, variant, fn, **extra):
        r = timeit(fn, **timing, cuda=on_gpu)
        results.append({"op": op, "variant": variant, **extra, **r})
        print(f"{op:28s} {variant:34s} {r['median_us']:9.2f} us")

    def section(name: str, fn: Callable[[], None], skip_reason: str | None = None) -> None:
        if skip_reason is not None:
            skipped.append({"section": name, "reason": skip_reason})
            print(f"{name:28s} skipped: {skip_reason}")
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            errors.append({"section": name, "error": f"{type(e).__name__}: {e}"})
            print(f"{name:28s} ERROR {type(e).__name__}: {e}", file=sys.stderr)

    x_h, x_f, res = (torch.randn(T, w, device=dev, dtype=dtype) for w in (H, FF, H))

    rot_state: dict = {}

    def ops_module():
        if not emulate:
            from itif.ops import cuda  # noqa: PLC0415

            return cuda
        import types  # noqa: PLC0415

        from itif.ops import reference  # noqa: PLC0415
        from itif.ops.launch import launch_policy  # noqa: PLC0415

        names = ("bias_act", "bias_residual", "bias_residual_layernorm", "embed_text", "attention")
        return types.SimpleNamespace(launch_policy=launch_policy,
                                     **{n: getattr(reference, n) for n in names})

    def rotation_setup():
        from itif.ops import reference  # noqa: PLC0415
        from itif.ops.reference import RotParam  # noqa: PLC0415

        cuda = ops_module()

        slot = torch.arange(nt, device=dev).repeat_interleave(tok)  # tenant t -> slot t

        def rot(width):
            return RotParam(torch.randn(nt, width, device=dev, dtype=dtype), slot)

        def tenant_rot(p, t: int):  # one tenant's slice, its own slot
            a, b = spans[t]
            return RotParam(p.buf, p.slot[a:b])

        b_h, b_f, gamma, beta = rot(H), rot(FF), rot(H), rot(H)
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
        rot_state.update(cuda=cuda, reference=reference, RotParam=RotParam, slot=slot,
                         tenant_rot=tenant_rot, b_h=b_h, b_f=b_f, gamma=gamma, beta=beta,
                         ew_policies=ew_policies, ln_policies=ln_policies)

    def bias_act_ops():
        cuda, reference, tenant_rot, b_f, ew_policies = (rot_state[k] for k in (
            "cuda", "reference", "tenant_rot", "b_f", "ew_policies"))

        # -- bias + GELU over the FFN intermediate ------------------------------------------
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

    def bias_residual_ops():
        cuda, reference, tenant_rot, b_h, ew_policies = (rot_state[k] for k in (
            "cuda", "reference", "tenant_rot", "b_h", "ew_policies"))

        # -- bias + residual (pre-LN residual add) -------------------------------------------
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

    def layernorm_ops():
        cuda, reference, tenant_rot, b_h, gamma, beta, ln_policies = (rot_state[k] for k in (
            "cuda", "reference", "tenant_rot", "b_h", "gamma", "beta", "ln_policies"))

        # -- bias + residual + LayerNorm -------------------------------------------------------
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

    def embed_ops():
        cuda, reference, RotParam, slot, tenant_rot, ew_policies = (rot_state[k] for k in (
            "cuda", "reference", "RotParam", "slot", "tenant_rot", "ew_policies"))

        # -- embeddings --------------------------------------------------------------------------
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

    def attention_ops():
        from itif.ops.reference import AttnGroup  # noqa: PLC0415

        cuda = ops_module()

        qkv = torch.randn(T, 3 * H, device=dev, dtype=dtype)
        view = [AttnGroup(n=nt, L=tok)]
        lengths = torch.randint(tok // 2, tok + 1, (nt,))
        km = (torch.arange(tok)[None] < lengths[:, None])
        rows = torch.where(km, torch.arange(T).view(nt, tok), 0)
        valid = torch.nonzero(km.reshape(-1)).squeeze(1)
        gather = [AttnGroup(n=nt, L=tok, rows=rows.to(dev), valid=valid.to(dev),
                            dest=rows.reshape(-1)[valid].to(dev),
                            key_mask=km.view(nt, 1, 1, tok).to(dev))]
        for gname, groups in (("view", view), ("gather_masked", gather)):
            for mode in ("sdpa", "softmax_bmm"):
                with cuda.launch_policy(attention=mode):
                    record(f"attention_{gname}", mode,
                           lambda groups=groups: cuda.attention(qkv, groups, args.heads))

    def gemm_ops():
        api, why = gemm_api()
        if api is None:
            skipped.append({"section": "gemm", "reason": why})
            print(f"{'gemm':28s} skipped: {why}")
            return
        backends, Segments, grouped_linear, plan_gemm, run_gemm = api
        from itif.runtime import cublas_grouped  # noqa: PLC0415
        cap = 2 * nt  # room for strided slots
        w = torch.randn(cap, 3 * H, H, device=dev, dtype=dtype) / H**0.5
        starts = tuple(a for a, _ in spans)
        ends = tuple(b for _, b in spans)
        plans = {
            "consecutive_slots": Segments(starts, ends, tuple(range(nt))),
            "strided_slots": Segments(starts, ends, tuple(2 * t for t in range(nt))),
            "arbitrary_slots": Segments(starts, ends, tuple((3 * t + 1) % nt for t in range(nt))),
            "shared_slot": Segments((0,), (T,), (0,)),  # every tenant shares the layer
        }
        out = torch.empty(T, 3 * H, device=dev, dtype=dtype)
        for pname, segs in plans.items():
            op = f"gemm_qkv_{pname}"
            with mock.patch.dict(os.environ, {cublas_grouped.ENV: "loop"}):
                ref = grouped_linear(x_h, w, segs, backend="loop").float()
            chosen = None
            if plan_gemm is not None:
                try:
                    chosen = plan_gemm(segs, T, dev, dtype).backend
                except ValueError as e:
                    chosen = f"none: {e}"
            # the loop backend twice where the grouped cuBLAS call serves it: one torch.mm a
            # segment (ITIF_GROUPED_GEMM=loop, the SEQ of Table 5.3) and one call for all
            variants = [(b, b, {cublas_grouped.ENV: "loop"} if b == "loop" else {})
                        for b in backends]
            if "loop" in backends and cublas_grouped.enabled(x_h.device, x_h.dtype):
                variants.append(("grouped_cublas", "loop", {}))
            for name, b, env in variants:
                with mock.patch.dict(os.environ, env):
                    try:
                        y = grouped_linear(x_h, w, segs, backend=b)
                    except ValueError as e:  # this backend cannot run this plan
                        results.append({"op": op, "variant": name, "skipped": str(e)})
                        print(f"{op:28s} {name:34s}   skipped: {e}")
                        continue
                    err = float((y.float() - ref).abs().max())
                    if plan_gemm is not None and run_gemm is not None:
                        plan = plan_gemm(segs, T, dev, dtype, b)
                        offs = (torch.tensor(plan.offs, dtype=torch.int32, device=dev)
                                if b == "grouped_mm" else None)
                        fn = (lambda plan=plan, offs=offs: run_gemm(x_h, w, plan, offs, out))  # noqa: E731 (a one-line local helper)
                        how = "run_gemm (planned once)"
                    else:
                        fn = (lambda b=b, segs=segs: grouped_linear(x_h, w, segs, backend=b,  # noqa: E731 (a one-line local helper)
                                                                    out=out))
                        how = "grouped_linear"
                    record(op, name, fn, max_abs_err_vs_loop=err, chosen_by_planner=chosen == b,
                           method=how, segments=len(segs))

    def triton_ops():
        """Each product of a bert layer at T = --tenants and 32 (128 rows a tenant, consecutive
        slots): cuBLAS as the forward plans it, then ``bias_act`` where the layer has a bias
        pass, against itif's Triton GEMM with the bias / activation in its epilogue."""
        from itif.ops import dispatch  # noqa: PLC0415
        from itif.ops.reference import RotParam  # noqa: PLC0415
        from itif.runtime import triton_gemm as tg  # noqa: PLC0415
        from itif.runtime.gemm import Segments, plan_gemm, run_gemm  # noqa: PLC0415

        kinds = {"qkv": (3 * H, H, "none"), "attn_out": (H, H, None),
                 "ffn_in": (FF, H, "gelu"), "ffn_out": (H, FF, None)}  # N, K, epilogue
        for n in sorted({nt, 32 if on_gpu else nt}):  # interpreted (CPU), T = 32 takes minutes
            rows = n * tok
            segs = Segments(tuple(range(0, rows, tok)), tuple(range(tok, rows + 1, tok)),
                            tuple(range(n)))
            plan = plan_gemm(segs, rows, dev, dtype)
            bm = tg.block_rows(plan.max_rows)
            tiles = torch.from_numpy(tg.tile_table(segs, bm)).to(dev)
            slot = torch.arange(n, device=dev).repeat_interleave(tok)
            for kind, (N, K, act) in kinds.items():
                x = torch.randn(rows, K, device=dev, dtype=dtype)
                w = torch.randn(n, N, K, device=dev, dtype=dtype) / K**0.5
                bias = (RotParam(torch.randn(n, N, device=dev, dtype=dtype), slot, plan)
                        if act is not None else None)
                out = torch.empty(rows, N, device=dev, dtype=dtype)

                def unfused(x=x, w=w, bias=bias, act=act, out=out, plan=plan):
                    run_gemm(x, w, plan, None, out)
                    if bias is not None:
                        dispatch.bias_act(out, bias, act)

                def fused(x=x, w=w, bias=bias, act=act or "none", out=out, tiles=tiles, bm=bm):
                    tg.run(x, w, tiles, bm, bias.buf if bias else None,
                           bias.slot if bias else None, act, out)

                unfused()
                ref = out.float().clone()
                fused()
                err = float((out.float() - ref).abs().max())
                op = f"triton_gemm_{kind}_T{n}"
                extra = dict(weight_bytes=n * N * K * out.element_size(), rows=rows)
                record(op, plan.backend + ("+bias_act" if bias is not None else ""), unfused,
                       **extra)
                record(op, "triton" + ("_epilogue" if bias is not None else ""), fused,
                       max_abs_err_vs_cublas=err, **extra)

    section("rotation_ops", rotation_setup, kernels_why)
    if rot_state:  # each op on its own: one failing op keeps the others' numbers
        section("bias_act", bias_act_ops)
        section("bias_residual", bias_residual_ops)
        section("bias_residual_layernorm", layernorm_ops)
        section("embed_text", embed_ops)
    section("attention", attention_ops, None if on_gpu or emulate else
            "needs CUDA (SDPA kernels vs bmm + masked softmax on the GPU)")
    section("gemm", gemm_ops)
    from itif.runtime import triton_gemm  # noqa: PLC0415

    triton_why = None
    if not (on_gpu or emulate):
        triton_why = "needs CUDA (on the CPU Triton only interprets: no times worth having)"
    elif not triton_gemm.runnable(dev, dtype):  # the emulated pass: TRITON_INTERPRET=1
        triton_why = (f"Triton's GEMM cannot run {args.dtype} on {dev.type} here (Triton "
                      f"installed: {triton_gemm.available()}; on the CPU it needs "
                      "TRITON_INTERPRET=1)")
    section("triton_gemm", triton_ops, triton_why)

    # -- summary: Table 5.3 (SEQ vs fused per op) --------------------------------------------
    speedups = {}
    table53 = []
    for op in sorted({r["op"] for r in results}):
        rs = {r["variant"]: r["median_us"] for r in results if r["op"] == op and "median_us" in r}
        fused = {k: v for k, v in rs.items() if k.startswith("fused_")}
        if fused and "seq_kernel" in rs:
            best = min(fused, key=fused.get)
            speedups[op] = {"best_fused": best, "seq_kernel_over_best_fused":
                            rs["seq_kernel"] / fused[best]}
            table53.append({"op": op, "seq_kernel_us": rs["seq_kernel"],
                            "seq_torch_us": rs.get("seq_torch"), "fused_us": fused[best],
                            "fused_variant": best,
                            "speedup_seq_kernel": rs["seq_kernel"] / fused[best]})
        elif op.startswith("gemm_") and "loop" in rs:
            best = min(rs, key=rs.get)
            table53.append({"op": op, "seq_kernel_us": rs["loop"], "seq_torch_us": None,
                            "fused_us": rs[best], "fused_variant": best,
                            "speedup_seq_kernel": rs["loop"] / rs[best]})
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    report = {
        "device": device_name,
        "capability": list(torch.cuda.get_device_capability()) if on_gpu else None,
        "torch": torch.__version__,
        "cupy": cp.__version__ if cp is not None else None,
        "dtype": args.dtype,
        "reduced_cpu_pass": not on_gpu,
        "emulated_kernels": emulate,
        "shapes": {"tenants": nt, "tokens_per_tenant": tok, "hidden": H, "ffn": FF,
                   "heads": args.heads},
        "timing": {**timing, "method": ("CUDA events" if on_gpu else "perf_counter") +
                   " around `inner` calls; median of repeats"},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
        "speedups": speedups,
        "table_5_3": table53,
        "skipped": skipped,
        "errors": errors,
    }
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_").lower()
    out_path = args.out or ROOT / "bench" / "results" / f"ops_{slug}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_path}")
    for op, s in speedups.items():
        print(f"{op:28s} seq_kernel / {s['best_fused']}: {s['seq_kernel_over_best_fused']:.2f}x")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
