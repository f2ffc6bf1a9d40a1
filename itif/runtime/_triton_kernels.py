"""The Triton kernel behind ``itif.runtime.triton_gemm`` (read that module first).

Kept apart so it is imported only on first use: Triton decides when a kernel is defined whether
it runs compiled or under its interpreter (``TRITON_INTERPRET=1``), and it resolves a kernel's
helpers through the module's globals.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

if (os.environ.get("TRITON_INTERPRET", "") == "1") != isinstance(tl.sigmoid, InterpretedFunction):
    raise RuntimeError("TRITON_INTERPRET changed after Triton was imported; set it before (Triton "
                       "defines its own helpers, tl.sigmoid among them, when it is imported)")

# (BN, BK, warps, pipeline stages) the autotuner tries on CUDA: narrow column blocks fill the
# GPU when there are few tiles (T = 4 at 128 rows: 4 tiles), wide ones reuse each row block
CONFIGS = ((32, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 3))
FIXED = (64, 64, 4, 3)  # ITIF_TRITON_AUTOTUNE=0: this one, no tuning (one compile a kernel)


@triton.jit
def _act(v, ACT: tl.constexpr):
    if ACT == 1:  # gelu (erf)
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation: tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        v = v * tl.sigmoid(2.0 * u)
    elif ACT == 3:  # relu; NaN stays NaN, as torch.relu and the rotation kernel keep it
        v = tl.where(v < 0.0, 0.0, v)
    elif ACT == 4:  # silu
        v = v * tl.sigmoid(v)
    elif ACT == 5:  # tanh
        v = 2.0 * tl.sigmoid(2.0 * v) - 1.0
    return v


@triton.jit
def seg_gemm(x_ptr, w_ptr, out_ptr, tiles_ptr, bias_ptr, bslot_ptr, N, fill,
             K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # fill (tiles x column blocks, bucketed) only keys the autotuner: how full the grid is
    t = tl.program_id(0)
    pn = tl.program_id(1)
    start = tl.load(tiles_ptr + 3 * t).to(tl.int64)
    end = tl.load(tiles_ptr + 3 * t + 1).to(tl.int64)
    slot = tl.load(tiles_ptr + 3 * t + 2).to(tl.int64)
    rows = start + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < end
    cmask = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + rows[:, None] * K + ks[None, :]
    b_ptrs = w_ptr + slot * N * K + cols.to(tl.int64)[:, None] * K + ks[None, :]  # [BN, BK]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=cmask[:, None], other=0.0)
        else:
            kmask = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    omask = rmask[:, None] & cmask[None, :]
    if HAS_BIAS:
        bs = tl.load(bslot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        bias = tl.load(bias_ptr + bs[:, None] * N + cols[None, :], mask=omask, other=0.0)
        acc += bias.to(tl.float32)
    acc = _act(acc, ACT)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=omask)


@functools.lru_cache(maxsize=1)
def tuned():
    """``seg_gemm`` under ``triton.autotune``: the column block, K step, warps and pipeline depth
    chosen per (N, K, BM, fill) on the first call of each."""
    configs = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
               for bn, bk, w, s in CONFIGS]
    return triton.autotune(configs=configs, key=["N", "K", "BM", "fill"])(seg_gemm)
