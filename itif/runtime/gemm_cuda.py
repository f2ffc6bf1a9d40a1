"""GPU backends for the per-slot GEMMs, reading the weight buffer in place (never copying it).

Every backend has the signature ``(x, w, start, end, slot, out=None) -> y`` with the contract of
``itif.runtime.gemm.grouped_linear``: x [T, K], w [capacity, N, K] (a weight buffer), and three
equal-length int sequences meaning ``y[start[i]:end[i]] = x[start[i]:end[i]] @ w[slot[i]].T``.
Segments are in row order and do not overlap; zero-length segments are skipped. Rows that no
segment covers are left as they were in ``out`` (zeros when y is allocated here). A backend
that cannot take a given plan returns None; ``choose`` names the first that can, in the order:

1. ``single_mm``: every (non-empty) segment reads one slot over contiguous rows: one GEMM.
2. ``bmm_consecutive``: equal lengths, equally spaced rows, slots in arithmetic progression
   (consecutive slots, step >= 1): one strided-batched GEMM (torch.bmm on views).
3. ``pointer_batched``: equal lengths, arbitrary slots: cuBLAS ``cublasGemmBatchedEx`` with
   device arrays of pointers into x, w and y (one launch).
4. ``grouped_mm``: bf16 on sm90, contiguous rows, slots non-decreasing: ``torch._grouped_mm``
   over the slot range [min, max] of the buffer; unused slots in between are empty groups.
5. ``streams``: one ``torch.mm`` per segment round-robin over side CUDA streams (the thesis'
   CUDA stream optimisation, 4.2.1).
6. ``loop``: one ``torch.mm`` per segment on the current stream (the CPU contract).

Segment lists arrive as Python ints (``gemm.Segments``); CUDA tensors are accepted but reading
them synchronises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger("itif.runtime.gemm_cuda")

IntSeq = Sequence[int] | torch.Tensor
Backend = Callable[..., "torch.Tensor | None"]

STREAMS = 3  # side streams for linear_streams (the thesis uses three)


# ---------------------------------------------------------------------------------------------
# validation and plans


@dataclass(frozen=True)
class Plan:
    """The validated, non-empty segments of one call."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    slot: tuple[int, ...]
    covers_all: bool  # the segments tile [0, T) exactly


def _ints(name: str, seq: IntSeq) -> list[int]:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1 or seq.is_floating_point() or seq.is_complex():
            raise ValueError(f"{name} must be a 1-D integer sequence, got {seq.dtype} "
                             f"{tuple(seq.shape)}")
        return [int(v) for v in seq.tolist()]
    try:
        return [int(v) for v in seq]
    except TypeError as e:
        raise ValueError(f"{name} must be a sequence of ints, got {type(seq).__name__}") from e


def plan_segments(x: torch.Tensor, w: torch.Tensor, start: IntSeq, end: IntSeq, slot: IntSeq,
                  out: torch.Tensor | None = None) -> Plan:
    """Validate one call's arguments (ValueError naming both values) and drop empty segments."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, K], got {getattr(x, 'shape', type(x))}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"w must be a 3-D buffer [capacity, N, K], got "
                         f"{getattr(w, 'shape', type(w))}")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device} but x is on {x.device}")
    if w.dtype != x.dtype:
        raise ValueError(f"w has dtype {w.dtype} but x has {x.dtype}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w has K={w.shape[2]} but x has K={x.shape[1]}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous, got strides {w.stride()}")
    T, N = x.shape[0], w.shape[1]
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, N):
            raise ValueError(f"out has shape {tuple(getattr(out, 'shape', ()))} but x and w "
                             f"need ({T}, {N})")
        if out.device != x.device or out.dtype != x.dtype:
            raise ValueError(f"out is {out.dtype} on {out.device} but x is {x.dtype} on "
                             f"{x.device}")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    s, e, sl = _ints("start", start), _ints("end", end), _ints("slot", slot)
    if not len(s) == len(e) == len(sl):
        raise ValueError(f"start, end, slot have lengths {len(s)}, {len(e)}, {len(sl)}; "
                         "they must be equal")
    cap = w.shape[0]
    keep_s, keep_e, keep_sl = [], [], []
    prev_end = 0
    for i, (a, b, c) in enumerate(zip(s, e, sl)):
        if not 0 <= a <= b <= T:
            raise ValueError(f"segment {i} rows {a}:{b} are not within x's {T} rows")
        if a < prev_end:
            raise ValueError(f"segment {i} starts at row {a}, before the previous segment's "
                             f"end {prev_end}: segments must be in order, non-overlapping")
        if not 0 <= c < cap:
            raise ValueError(f"segment {i} slot {c} is not within w's capacity {cap}")
        prev_end = b
        if b > a:
            keep_s.append(a)
            keep_e.append(b)
            keep_sl.append(c)
    covered = sum(b - a for a, b in zip(keep_s, keep_e))
    return Plan(tuple(keep_s), tuple(keep_e), tuple(keep_sl), covered == T)


def _alloc(x: torch.Tensor, w: torch.Tensor, plan: Plan, out: torch.Tensor | None) -> torch.Tensor:
    if out is not None:
        return out
    make = torch.empty if plan.covers_all else torch.zeros
    return make(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)


def _contiguous_rows(plan: Plan) -> bool:
    return all(plan.end[i] == plan.start[i + 1] for i in range(len(plan.start) - 1))


def _arith(seq: Sequence[int]) -> int | None:
    """The common step of an arithmetic progression (0 for a single element), else None."""
    if len(seq) < 2:
        return 0
    step = seq[1] - seq[0]
    return step if all(seq[i + 1] - seq[i] == step for i in range(len(seq) - 1)) else None


# ---------------------------------------------------------------------------------------------
# loop and single GEMM


def linear_loop(x, w, start, end, slot, out=None):
    """One ``torch.mm`` per segment on the current stream: the reference of the others."""
    plan = plan_segments(x, w, start, end, slot, out)
    out = _alloc(x, w, plan, out)
    for a, b, c in zip(plan.start, plan.end, plan.slot):
        torch.mm(x[a:b], w[c].t(), out=out[a:b])
    return out


def _single_applicable(plan: Plan) -> bool:
    return len(set(plan.slot)) <= 1 and _contiguous_rows(plan)


def linear_single_slot(x, w, start, end, slot, out=None):
    """All segments read one slot over one contiguous run of rows: a single GEMM."""
    plan = plan_segments(x, w, start, end, slot, out)
    if not _single_applicable(plan):
        return None
    out = _alloc(x, w, plan, out)
    if plan.start:
        a, b = plan.start[0], plan.end[-1]
        torch.mm(x[a:b], w[plan.slot[0]].t(), out=out[a:b])
    return out


# ---------------------------------------------------------------------------------------------
# (a) strided-batched GEMM on views


def _bmm_applicable(plan: Plan) -> tuple[int, int, int] | None:
    """(m, row step, slot step) when lengths are equal, rows equally spaced and slots in an
    arithmetic progression of step >= 1; else None."""
    k = len(plan.start)
    if k == 0:
        return None
    m = plan.end[0] - plan.start[0]
    if any(b - a != m for a, b in zip(plan.start, plan.end)):
        return None
    rs, ds = _arith(plan.start), _arith(plan.slot)
    if rs is None or ds is None:
        return None
    if k > 1 and (rs < m or ds < 1):
        return None  # overlapping rows cannot happen (validated); one slot is single_mm's job
    return m, (rs if k > 1 else m), (ds if k > 1 else 1)


def linear_bmm_consecutive(x, w, start, end, slot, out=None):
    """Equal-length segments, equally spaced rows, consecutive slots (or any constant slot
    step >= 1): ``torch.bmm`` of x's rows viewed [k, m, K] against w's slots viewed [k, K, N]
    (transposed in place, batch stride = slot step). Returns None when not applicable."""
    plan = plan_segments(x, w, start, end, slot, out)
    shape = _bmm_applicable(plan)
    if shape is None:
        return None
    m, rs, ds = shape
    k = len(plan.start)
    K, N = x.shape[1], w.shape[1]
    s0, sl0 = plan.start[0], plan.slot[0]
    xa = x.as_strided((k, m, K), (rs * K, K, 1), x.storage_offset() + s0 * K)
    wb = w.as_strided((k, K, N), (ds * N * K, 1, K), w.storage_offset() + sl0 * N * K)
    out = _alloc(x, w, plan, out)
    if rs == m:
        torch.bmm(xa, wb, out=out[s0 : s0 + k * m].view(k, m, N))
    else:
        dst = out.as_strided((k, m, N), (rs * N, N, 1), out.storage_offset() + s0 * N)
        dst.copy_(torch.bmm(xa, wb))
    return out


# ---------------------------------------------------------------------------------------------
# (b) cuBLAS pointer-array batched GEMM (cublasGemmBatchedEx through ctypes)
#
# CuPy's cupy.cuda.cublas binds only the fp32/fp64 pointer-array gemmBatched and the strided
# gemmStridedBatchedEx, not cublasGemmBatchedEx, so the call goes through ctypes to the cuBLAS
# library already loaded in the process, with a handle of our own from that same library.

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F, _CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_GEMM_DEFAULT = -1
_CUDA_TYPE = {torch.float32: _CUDA_R_32F, torch.float16: _CUDA_R_16F,
              torch.bfloat16: _CUDA_R_16BF}


def _loaded_cublas_paths() -> list[str]:
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.rsplit(None, 1)[-1]
                name = os.path.basename(p)
                if name.startswith("libcublas.so") and p not in paths:
                    paths.append(p)
    except OSError:
        pass
    return paths


class _Cublas:
    """cublasGemmBatchedEx with one handle per device, from one libcublas."""

    def __init__(self) -> None:
        torch.cuda.current_blas_handle()  # makes torch load its libcublas, so maps lists it
        candidates = _loaded_cublas_paths() + [
            n for n in ("libcublas.so.13", "libcublas.so.12", ctypes.util.find_library("cublas"))
            if n
        ]
        lib, errors = None, []
        for c in candidates:
            try:
                lib = ctypes.CDLL(c)
                lib.cublasGemmBatchedEx  # noqa: B018 - probe the symbol
                break
            except (OSError, AttributeError) as e:
                errors.append(f"{c}: {e}")
                lib = None
        if lib is None:
            raise RuntimeError(f"no usable libcublas ({'; '.join(errors) or 'none found'})")
        self.lib = lib
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasCreate_v2.restype = i
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetStream_v2.restype = i
        lib.cublasGemmBatchedEx.argtypes = [
            vp, i, i, i, i, i,  # handle, transa, transb, m, n, k
            vp, vp, i, i,  # alpha, Aarray, Atype, lda
            vp, i, i,  # Barray, Btype, ldb
            vp, vp, i, i,  # beta, Carray, Ctype, ldc
            i, i, i,  # batchCount, computeType, algo
        ]
        lib.cublasGemmBatchedEx.restype = i
        self.handles: dict[int, int] = {}
        self.lock = threading.Lock()

    def handle(self, device: torch.device) -> int:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        h = self.handles.get(idx)
        if h is None:
            with self.lock:
                h = self.handles.get(idx)
                if h is None:
                    hp = ctypes.c_void_p()
                    with torch.cuda.device(idx):
                        st = self.lib.cublasCreate_v2(ctypes.byref(hp))
                    if st != 0:
                        raise RuntimeError(f"cublasCreate failed with status {st}")
                    h = self.handles[idx] = hp.value
        return h


@functools.cache
def _cublas() -> _Cublas | None:
    try:
        return _Cublas()
    except Exception as e:  # noqa: BLE001 - any failure means: this backend declines
        log.warning("cuBLAS pointer-array GEMM unavailable (%s)", e)
        return None


def _device_ints(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a blocking copy (pinned, stream-ordered)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _pointer_applicable(x: torch.Tensor, plan: Plan) -> bool:
    if not x.is_cuda or x.dtype not in _CUDA_TYPE or not plan.start:
        return False
    m = plan.end[0] - plan.start[0]
    return all(b - a == m for a, b in zip(plan.start, plan.end))


def linear_pointer_batched(x, w, start, end, slot, out=None):
    """Equal-length segments, arbitrary slots: one ``cublasGemmBatchedEx`` whose A/B/C pointer
    arrays point at w[slot[i]], x[start[i]:] and y[start[i]:]. CUDA only; None when the
    segments differ in length or cuBLAS cannot be loaded."""
    plan = plan_segments(x, w, start, end, slot, out)
    if not _pointer_applicable(x, plan):
        return None
    blas = _cublas()
    if blas is None:
        return None
    out = _alloc(x, w, plan, out)
    k = len(plan.start)
    m = plan.end[0] - plan.start[0]
    K, N = x.shape[1], w.shape[1]
    es = x.element_size()
    xp, wp, yp = x.data_ptr(), w.data_ptr(), out.data_ptr()
    ptrs = ([wp + c * N * K * es for c in plan.slot]
            + [xp + a * K * es for a in plan.start]
            + [yp + a * N * es for a in plan.start])
    dev_ptrs = _device_ints(ptrs, torch.int64, x.device)
    a_arr, b_arr, c_arr = (dev_ptrs.data_ptr() + i * k * 8 for i in range(3))
    tf32 = x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    compute = _CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 else _CUBLAS_COMPUTE_32F
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    ctype = _CUDA_TYPE[x.dtype]
    handle = blas.handle(x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    # Row-major y_i[m, N] = x_i[m, K] @ w_i[N, K]^T is column-major y_i^T (N x m, ld N) =
    # op(A) (N x K) @ B (K x m) with A = w_i read as K x N (ld K) transposed, B = x_i as K x m.
    with blas.lock:  # the handle's stream is shared state
        st = blas.lib.cublasSetStream_v2(handle, stream)
        if st == 0:
            st = blas.lib.cublasGemmBatchedEx(
                handle, _CUBLAS_OP_T, _CUBLAS_OP_N, N, m, K,
                ctypes.byref(alpha), a_arr, ctype, K,
                b_arr, ctype, K,
                ctypes.byref(beta), c_arr, ctype, N,
                k, compute, _CUBLAS_GEMM_DEFAULT,
            )
    if st != 0:
        raise RuntimeError(f"cublasGemmBatchedEx failed with status {st} "
                           f"(batch {k}, m={m}, N={N}, K={K}, {x.dtype})")
    return out


# ---------------------------------------------------------------------------------------------
# (c) torch._grouped_mm


def _grouped_mm_supported(device: torch.device) -> bool:
    """torch._grouped_mm's fast path: CUDA sm90 (tests may patch this to exercise the plan)."""
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


def _grouped_applicable(x: torch.Tensor, w: torch.Tensor, plan: Plan) -> bool:
    return (
        x.dtype == torch.bfloat16
        and bool(plan.start)
        and x.shape[1] % 8 == 0  # 16-byte row strides, as the kernel requires
        and w.shape[1] % 8 == 0
        and _contiguous_rows(plan)
        and all(plan.slot[i] <= plan.slot[i + 1] for i in range(len(plan.slot) - 1))
        and _grouped_mm_supported(x.device)
    )


def grouped_offsets(plan: Plan) -> tuple[int, int, list[int]]:
    """(lo, hi, offs): slots lo..hi become groups; offs[g] is the end (relative to the first
    row) of group g's rows, cumulative, so a slot without rows is an empty group."""
    lo, hi = plan.slot[0], plan.slot[-1]
    base = plan.start[0]
    offs = [0] * (hi - lo + 1)
    for b, c in zip(plan.end, plan.slot):
        offs[c - lo] = b - base
    for g in range(1, len(offs)):  # empty groups end where the previous group ended
        offs[g] = max(offs[g], offs[g - 1])
    return lo, hi, offs


def linear_grouped_mm(x, w, start, end, slot, out=None):
    """bf16 on sm90: one ``torch._grouped_mm`` of the contiguous rows against w[lo:hi+1]
    (slots sorted; slots without rows are empty groups, which the kernel skips). int32
    cumulative offsets. None when not applicable."""
    plan = plan_segments(x, w, start, end, slot, out)
    if not _grouped_applicable(x, w, plan):
        return None
    lo, hi, offs = grouped_offsets(plan)
    a, b = plan.start[0], plan.end[-1]
    offs_t = _device_ints(offs, torch.int32, x.device)
    y = torch._grouped_mm(x[a:b], w[lo : hi + 1].transpose(-2, -1), offs=offs_t)
    if out is None and a == 0 and b == x.shape[0] and y.is_contiguous():
        return y
    out = _alloc(x, w, plan, out)
    out[a:b].copy_(y)
    return out


# ---------------------------------------------------------------------------------------------
# (d) one GEMM per segment over side streams

_side: dict[tuple[int, int], list[torch.cuda.Stream]] = {}
_side_lock = threading.Lock()


def _side_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, n)
    s = _side.get(key)
    if s is None:
        with _side_lock:
            s = _side.get(key)
            if s is None:
                s = _side[key] = [torch.cuda.Stream(device=idx) for _ in range(n)]
    return s


def linear_streams(x, w, start, end, slot, out=None):
    """One ``torch.mm`` per segment, round-robin over ``STREAMS`` side streams. The side
    streams first wait for the current stream (inputs ready), and the current stream then
    waits for each of them, so callers see an ordinary stream-ordered op. On the CPU this is
    the loop. Always applicable."""
    plan = plan_segments(x, w, start, end, slot, out)
    out = _alloc(x, w, plan, out)
    if not x.is_cuda or len(plan.start) <= 1:
        for a, b, c in zip(plan.start, plan.end, plan.slot):
            torch.mm(x[a:b], w[c].t(), out=out[a:b])
        return out
    cur = torch.cuda.current_stream(x.device)
    sides = _side_streams(x.device, min(STREAMS, len(plan.start)))
    ready = torch.cuda.Event()
    ready.record(cur)
    for s in sides:
        s.wait_event(ready)
    for i, (a, b, c) in enumerate(zip(plan.start, plan.end, plan.slot)):
        with torch.cuda.stream(sides[i % len(sides)]):
            torch.mm(x[a:b], w[c].t(), out=out[a:b])
    for s in sides:
        done = torch.cuda.Event()
        done.record(s)
        cur.wait_event(done)
    # The tensors were allocated on `cur` and `cur` now waits for every side stream, so the
    # caching allocator cannot hand their memory out again before the side work has finished.
    return out


# ---------------------------------------------------------------------------------------------
# (e) policy


def choose(x, w, start, end, slot, out=None) -> tuple[str, Backend]:
    """The first applicable backend (see the module docstring for the order), by name."""
    plan = plan_segments(x, w, start, end, slot, out)
    if _single_applicable(plan):
        return "single_mm", linear_single_slot
    if _bmm_applicable(plan) is not None:
        return "bmm_consecutive", linear_bmm_consecutive
    if _pointer_applicable(x, plan) and _cublas() is not None:
        return "pointer_batched", linear_pointer_batched
    if _grouped_applicable(x, w, plan):
        return "grouped_mm", linear_grouped_mm
    if x.is_cuda:
        return "streams", linear_streams
    return "loop", linear_loop


def grouped_linear_cuda(x, w, start, end, slot, out=None) -> torch.Tensor:
    """Run the backend ``choose`` picks (falling through should one decline after all)."""
    _, fn = choose(x, w, start, end, slot, out)
    y = fn(x, w, start, end, slot, out)
    return y if y is not None else linear_loop(x, w, start, end, slot, out)


BACKENDS: dict[str, Backend] = {
    "loop": linear_loop,
    "single_mm": linear_single_slot,
    "bmm_consecutive": linear_bmm_consecutive,
    "pointer_batched": linear_pointer_batched,
    "grouped_mm": linear_grouped_mm,
    "streams": linear_streams,
}
