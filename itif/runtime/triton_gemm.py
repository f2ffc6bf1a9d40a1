"""A per-slot GEMM of itif's own in Triton, with the bias and activation in its epilogue.

Why: on the H100 the fused bert-base forward spends its time in cuBLAS's batched GEMMs and in
the bias / activation passes that follow two of the four products of every layer
(docs/gpu.md, "Where the time goes"): at T = 32 the GEMMs reach 72% of the copy bandwidth and
the memory-bound passes cost 0.66 ms more; at T = 4, 24 of the 50 memory-bound launches are
``bias_act``. This kernel reads each tile's weight slot in place (no gathered copy), adds each
row's own bias (read through the row's slot, as the rotation kernels do) and applies the
activation before the one store: ``qkv`` and ``ffn_in`` then cost one launch instead of two
and their outputs are written once.

How: the rows of a segment list (``itif.runtime.gemm.Segments``) are cut into *tiles* of at
most ``BM`` rows, none straddling two segments; ``tile_table`` lists them as
``(start, end, slot)`` on the host, the batch packs the table with its other index arrays, and
one launch covers every tile x every ``BN``-wide column block: ``grid = (tiles, cdiv(N, BN))``.
``BM`` follows the longest segment (16 to 128 rows, ``ITIF_TRITON_MAX_BM`` lowers the cap) so
a 128-row request reads each weight tile once; the batch keeps it (``tile_rows``). On CUDA
``triton.autotune`` picks the column block, pipeline depth and warps per (N, K, BM, fill) on
the first call of a shape (the graph cache's eager warm-ups run it before any capture; four
configurations, each a compile of its own); ``ITIF_TRITON_AUTOTUNE=0`` runs one fixed
configuration instead (the GPU tests: one compile per kernel variant). On the CPU, under
Triton's interpreter (``TRITON_INTERPRET=1``, the tests), a small fixed one runs.

**Opt-in**: ``ITIF_TRITON_GEMM=1`` turns it on for batches prepared afterwards, on CUDA in
float16 / bfloat16 (and on the CPU only under the interpreter). Measured on an H100
(2026-11-28, docs/gpu.md "A ninth session"), it is no faster than cuBLAS in the forward
(bert-base itif: 1.35 / 1.27 ms with 128- / 64-row tiles against 1.21 at 4 tenants, level at
32), so it stays off by default: ``bench/bench_ops.py`` (per product: it loses on the products
without an epilogue, attention-out and FFN-out) and ``bench/triton_forward.py`` (the forward;
``gpu_suite.sh --steps triton``) time it beside cuBLAS. Products with LoRA updates, the heads
and the pooler keep ``run_gemm``.

Numerics: the sum is float32 and the bias is added to it before the one rounding to the
storage type; the unfused path rounds the product first, then adds the bias. The two differ
in last bits only.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import torch

from itif.runtime.gemm import Segments

ENV = "ITIF_TRITON_GEMM"
AUTOTUNE_ENV = "ITIF_TRITON_AUTOTUNE"  # "0": one fixed configuration, no tuning
MAX_BM_ENV = "ITIF_TRITON_MAX_BM"  # the largest tile (max_block_rows)
ACT_CODES = {"none": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "relu": 3, "silu": 4,
             "tanh": 5}
MAX_BM = 128
MIN_BM = 16


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Triton is installed here (not imported: it reads ``TRITON_INTERPRET`` when it is).
    Cached: every batch prepared with the switch on asks."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def runnable(device: torch.device, dtype: torch.dtype) -> bool:
    """Triton installed, and either CUDA in float16 / bfloat16 or the CPU under Triton's
    interpreter (where float32 runs too)."""
    if not available():
        return False
    if device.type == "cuda":
        return dtype in (torch.float16, torch.bfloat16)
    return device.type == "cpu" and interpreted()


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether batches prepared now on ``device`` in ``dtype`` use this kernel: asked for with
    ``ITIF_TRITON_GEMM=1`` and ``runnable`` there."""
    return os.environ.get(ENV, "") == "1" and runnable(device, dtype)


def max_block_rows() -> int:
    """The largest tile: 128 rows, or ``ITIF_TRITON_MAX_BM`` (16, 32 or 64: more, smaller tiles
    fill more SMs when a batch has few tenants, each re-reading its weight tile)."""
    asked = os.environ.get(MAX_BM_ENV, "")
    if not asked:
        return MAX_BM
    if asked not in ("16", "32", "64", "128"):
        raise ValueError(f"{MAX_BM_ENV}={asked!r}: choose 16, 32, 64 or 128")
    return int(asked)


def block_rows(max_rows: int, largest: int = MAX_BM) -> int:
    """Rows a tile holds: the longest segment rounded up to a power of two, 16 to ``largest``."""
    return int(min(largest, max(MIN_BM, 1 << max(0, int(max_rows) - 1).bit_length())))


def tile_table(segs: Segments, bm: int) -> np.ndarray:
    """``[tiles, 3]`` int64 rows ``(start, end, slot)``: each segment cut into runs of at most
    ``bm`` rows, in row order."""
    start = np.asarray(segs.start, np.int64)
    end = np.asarray(segs.end, np.int64)
    slot = np.asarray(segs.slot, np.int64)
    count = -(-(end - start) // bm)  # tiles per segment (segments are never empty)
    seg = np.repeat(np.arange(len(start)), count)
    first = np.repeat(np.cumsum(count) - count, count)
    t0 = start[seg] + (np.arange(seg.size) - first) * bm
    return np.stack([t0, np.minimum(t0 + bm, end[seg]), slot[seg]], axis=1)


def _kernels():
    """``itif.runtime._triton_kernels``, imported on first use so that the interpreter setting
    in force then applies (Triton reads it when it is imported)."""
    from itif.runtime import _triton_kernels

    return _triton_kernels


def run(x: torch.Tensor, w: torch.Tensor, tiles: torch.Tensor, bm: int,
        bias: torch.Tensor | None = None, bias_slot: torch.Tensor | None = None,
        act: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """The per-slot product with each row's own bias and the activation in its epilogue, in one
    launch. Launches only: nothing is read on the host.

    Semantics:
        out[t, n] = act(sum_k x[t, k] w[slot_i, n, k] + bias[bias_slot[t], n])
                    (start_i <= t < end_i, every tile i)

    where ``(start_i, end_i, slot_i)`` are the rows of ``tiles``, which tile the rows; without
    a bias its term drops. Returns out.

    Args:
        x: Shape: [T, K]. DType: float16 or bfloat16 (float32 too under the interpreter).
            Read only (copied first if not contiguous).
        w: Shape: [C, N, K], each slot dense. DType: x's. Read only.
        tiles: Shape: [tiles, 3] or flattened, ``tile_table(segs, bm)`` on x's device.
            DType: int32 or int64. Read only.
        bm: Type: int, rows a tile holds (``block_rows``), at least the longest tile's.
        bias: Shape: [C_b, N], or None. DType: x's. Read only.
        bias_slot: Shape: [T], or None (given with bias, or neither). DType: int64. Read only.
        act: Type: str, a key of ``ACT_CODES``.
        out: Shape: [T, N], or None (a new tensor). DType: x's. Written in place and returned.
    """
    x = x.contiguous()  # a no-op for the forward's operands
    rows, K = x.shape
    N = w.shape[1]
    if out is None:
        out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    n_tiles = tiles.numel() // 3
    if n_tiles == 0:
        return out
    code = ACT_CODES[act]
    has_bias = bias is not None
    b, bs = (bias, bias_slot) if has_bias else (out, tiles)  # placeholders, never read
    kernels = _kernels()
    if interpreted():
        kernels.seg_gemm[(n_tiles, -(-N // 32))](x, w, out, tiles, b, bs, N, 0, K=K,
                                                 HAS_BIAS=has_bias, ACT=code, BM=bm, BN=32, BK=32)
    elif os.environ.get(AUTOTUNE_ENV, "1") == "0":
        bn, bk, warps, stages = kernels.FIXED
        kernels.seg_gemm[(n_tiles, -(-N // bn))](x, w, out, tiles, b, bs, N, 0, K=K,
                                                 HAS_BIAS=has_bias, ACT=code, BM=bm, BN=bn, BK=bk,
                                                 num_warps=warps, num_stages=stages)
    else:
        fill = min(1 << max(0, n_tiles * -(-N // 64) - 1).bit_length(), 512)
        kernels.tuned()[lambda meta: (n_tiles, -(-N // meta["BN"]))](
            x, w, out, tiles, b, bs, N, fill, K=K, HAS_BIAS=has_bias, ACT=code, BM=bm)
    return out


__all__ = ["ACT_CODES", "AUTOTUNE_ENV", "ENV", "MAX_BM_ENV", "available", "block_rows", "enabled",
           "interpreted", "max_block_rows", "run", "runnable", "tile_table"]
