"""Every segment of a per-slot product in one cuBLAS call (``cublasGemmGroupedBatchedEx``,
cuBLAS 12.5 or newer), for the products ``itif.runtime.gemm`` would otherwise run as a loop.

Why: under a serving load the daemon's forward is bound by its Python calls, each of which gives
the GIL to the gRPC front end (docs/gpu.md, "A third session"). A ragged batch of 16 float16
tenants runs each product as 16 ``torch.mm`` calls (torch 2.11's float16 ``_grouped_mm`` reads
its offsets on the host, a synchronisation); this runs them as one C call, which also releases
the GIL once rather than 16 times.

How: one *problem* per segment, rows ``start:end`` against slot ``slot``. In cuBLAS's
column-major terms a row-major ``y = x @ w[slot].T`` is ``y' = op_T(w') @ x'`` with
``m = N``, ``n = rows``, ``k = K``, ``lda = ldb = K``, ``ldc = N``. The sizes and leading
dimensions are host arrays built once per segment list (cached); the three device arrays of
pointers (weights, inputs, outputs) are written on the host from the tensors' addresses plus
precomputed byte offsets, and copied to the device in one non-blocking copy from pinned memory.
Nothing is read back, so nothing synchronises.

**On by default on CUDA in float16 and bfloat16** (compute in float32) since a paired H100
serving sweep (bert-base x16, 4 ingress processes, same arrivals) saturated at 2103.9 req/s with
it and 1706.2 with the loop (docs/gpu.md, "A sixth session"). ``ITIF_GROUPED_GEMM=loop`` turns it
off (the loop of ``torch.mm`` runs), as does a cuBLAS without the function (older than 12.5).
It is never used while a CUDA graph is being captured (a copy from pinned host memory inside a
graph would read that memory at every replay), so captured structures keep the loop; its kernels
differ from ``torch.mm``'s, so in float32 a ragged batch would answer in other last bits eagerly
than from its graph (measured on the H100: up to 1.5e-7 on bert-tiny), and float32 keeps the
loop unless ``ITIF_GROUPED_GEMM=cublas`` asks for it. In float16 / bfloat16 the GPU tests found
graph and eager answers identical with it. The CPU tests run the argument packing
against a stand-in that computes the same column-major products on host memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

ENV = "ITIF_GROUPED_GEMM"
_OP_N, _OP_T = 0, 1
_DATA_TYPE = {torch.float16: 2, torch.float32: 0, torch.bfloat16: 14}  # cudaDataType_t
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F (no TF32: float32 stays exact)
_CACHE_MAX = 1024
_refused: set = set()  # (device index, dtype) where cuBLAS refused a grouped call: the loop runs
log = logging.getLogger("itif.runtime")


class Refused(RuntimeError):
    """cuBLAS answered the grouped call with a status other than success."""


def _int_array(values) -> ctypes.Array:
    return (ctypes.c_int * len(values))(*values)


@dataclass(frozen=True)
class Problems:
    """The host side of one grouped call: sizes, leading dimensions and scalars per problem
    (ctypes arrays that cuBLAS reads during the call) and the byte offsets of each problem's
    weight slot, input rows and output rows from their tensors' first elements."""

    count: int
    transa: ctypes.Array
    transb: ctypes.Array
    m: ctypes.Array
    n: ctypes.Array
    k: ctypes.Array
    lda: ctypes.Array
    ldb: ctypes.Array
    ldc: ctypes.Array
    alpha: ctypes.Array
    beta: ctypes.Array
    group_size: ctypes.Array
    offsets: np.ndarray  # int64 [3, count]: weight, input, output byte offsets


_cache: dict[tuple, Problems] = {}
_cache_lock = threading.Lock()


def problems(start, end, slot, N: int, K: int, slot_stride: int, element: int) -> Problems:
    """The problems of segments ``(start[i], end[i], slot[i])`` for a ``[rows, K] @ [N, K].T``
    product whose weight slots lie ``slot_stride`` elements apart (cached)."""
    key = (tuple(start), tuple(end), tuple(slot), N, K, slot_stride, element)
    with _cache_lock:
        p = _cache.get(key)
    if p is not None:
        return p
    g = len(start)
    rows = [e - s for s, e in zip(start, end)]
    offsets = np.empty((3, g), np.int64)
    offsets[0] = np.asarray(slot, np.int64) * slot_stride * element
    offsets[1] = np.asarray(start, np.int64) * K * element
    offsets[2] = np.asarray(start, np.int64) * N * element
    p = Problems(
        count=g, transa=_int_array([_OP_T] * g), transb=_int_array([_OP_N] * g),
        m=_int_array([N] * g), n=_int_array(rows), k=_int_array([K] * g),
        lda=_int_array([K] * g), ldb=_int_array([K] * g), ldc=_int_array([N] * g),
        alpha=(ctypes.c_float * g)(*([1.0] * g)), beta=(ctypes.c_float * g)(*([0.0] * g)),
        group_size=_int_array([1] * g), offsets=offsets)
    with _cache_lock:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = p
    return p


def _cublas_path() -> str | None:
    """The libcublas this process loaded (torch loads it with its first cuBLAS handle)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                name = os.path.basename(path)
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def _function():
    """``cublasGemmGroupedBatchedEx`` of the cuBLAS torch uses, or None (no CUDA, or a cuBLAS
    older than 12.5)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.current_blas_handle()  # makes sure torch has loaded cuBLAS
    path = _cublas_path()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).cublasGemmGroupedBatchedEx
    except (OSError, AttributeError):
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, p, p, p, p, p, p, p, i, p, p, i, p, p, p, i, p, i, p, i]
    fn.restype = i
    return fn


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products on ``device`` in ``dtype`` go through the grouped call: on CUDA outside a
    graph capture, with the function there, in float16 / bfloat16 unless
    ``ITIF_GROUPED_GEMM=loop``, in float32 only with ``ITIF_GROUPED_GEMM=cublas``."""
    asked = os.environ.get(ENV, "")
    if asked == "loop" or device.type != "cuda" or dtype not in _DATA_TYPE:
        return False
    if (dtype == torch.float32 and asked != "cublas") or (device.index, dtype) in _refused:
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    return _function() is not None


def usable(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """The layouts the problems assume: rows of x and out dense, each weight slot a dense
    [N, K] matrix."""
    N, K = w.shape[1], w.shape[2]
    return (x.stride() == (K, 1) and out.stride() == (N, 1) and w.stride(1) == K
            and w.stride(2) == 1 and x.dtype == w.dtype == out.dtype)


def run(x: torch.Tensor, w: torch.Tensor, start, end, slot, out: torch.Tensor,
        function=None) -> torch.Tensor:
    """Every segment's product in one ``cublasGemmGroupedBatchedEx`` call (float32 compute).
    Raises Refused (a RuntimeError) with cuBLAS's status when it refuses.

    Semantics:
        out[t, n] = sum_k x[t, k] w[slot[i], n, k]    (start[i] <= t < end[i], every segment i)

    Rows no segment covers are left as they are. Returns out.

    Args:
        x: Shape: [T, K], rows dense (``usable``). DType: float16, bfloat16 or float32.
            Read only.
        w: Shape: [C, N, K], each slot dense. DType: x's. Read only.
        start: Type: sequence of int, each segment's first row (``Segments.start``).
        end: Type: sequence of int, each segment's end row, exclusive.
        slot: Type: sequence of int, each segment's slot of w, in [0, C).
        out: Shape: [T, N], rows dense. DType: x's. Written in place and returned.
        function: Type: callable or None: stands in for cuBLAS's function (tests).
    """
    fn = function if function is not None else _function()
    N, K = w.shape[1], w.shape[2]
    p = problems(start, end, slot, N, K, w.stride(0), x.element_size())
    g = p.count
    pin = x.is_cuda
    host = torch.empty(3 * g, dtype=torch.int64, pin_memory=pin)
    a = host.numpy().reshape(3, g)
    np.add(p.offsets, np.array([[w.data_ptr()], [x.data_ptr()], [out.data_ptr()]], np.int64),
           out=a)
    ptrs = host.to(x.device, non_blocking=True) if pin else host
    base = ptrs.data_ptr()
    handle = torch.cuda.current_blas_handle() if x.is_cuda else 0
    dt = _DATA_TYPE[x.dtype]
    status = fn(handle, ctypes.addressof(p.transa), ctypes.addressof(p.transb),
                ctypes.addressof(p.m), ctypes.addressof(p.n), ctypes.addressof(p.k),
                ctypes.addressof(p.alpha), base, dt, ctypes.addressof(p.lda),
                base + 8 * g, dt, ctypes.addressof(p.ldb), ctypes.addressof(p.beta),
                base + 16 * g, dt, ctypes.addressof(p.ldc), g, ctypes.addressof(p.group_size),
                _COMPUTE_32F)
    if status != 0:
        raise Refused(f"cublasGemmGroupedBatchedEx returned status {status} for {g} "
                           f"products of [*, {K}] x [{N}, {K}].T in {x.dtype}")
    return out


def run_or_refuse(x: torch.Tensor, w: torch.Tensor, segs, out: torch.Tensor) -> bool:
    """:func:`run` (its contract) over ``segs`` (``Segments``); False where cuBLAS refuses the
    call (a status, :class:`Refused`), so the caller runs the loop, which writes every row of
    ``out`` again. The device and dtype are then left to the loop for the rest of the process
    (one warning, not one a product). Any other error (out of memory, say) propagates as the
    loop's would."""
    try:
        run(x, w, segs.start, segs.end, segs.slot, out)
    except Refused as e:
        _refused.add((x.device.index, x.dtype))
        log.warning("grouped cuBLAS GEMM refused on %s %s (%s); products there run as a loop of "
                    "torch.mm", x.device, x.dtype, e)
        return False
    return True


__all__ = ["ENV", "Problems", "Refused", "enabled", "problems", "run", "run_or_refuse", "usable"]
