"""Per-slot GEMMs over the token buffer without copying weights: one plan, a few backends.

Rows of the token buffer are ordered so each tenant's rows are contiguous (``row_tenant [T]``:
each row's position in the batch's tenant list); a parameter kind's slot table (``[tenants]``:
the slot of each tenant) turns those runs into *segments* ``(start, end, slot)``: rows
``start:end`` multiply slot ``slot`` of the kind's weight buffer ``w [capacity, N, K]``. The
words and index notation are those of the ops (``itif.ops.dispatch``): a *slot* is the index
a row reads its tenant's parameters at. Adjacent runs whose tenants
share the slot (frozen or identical layers) merge into one segment, so shared weights cost one
GEMM, not one per tenant.

``plan_gemm`` picks a backend once per segment list (the batch caches it, so every layer that
reads the same slot table reuses it); ``run_gemm`` launches it. Every backend reads the weight
buffer in place (views, never a gathered copy):

* ``mm``, 1 launch: one segment (one tenant, or every tenant shares the slot);
* ``bmm``, 1 launch: equal-length segments whose slots step evenly (``slot0 + i*step``): the
  buffer's slots are a strided view ``w[slot0::step]``;
* ``grouped_mm``, 1 launch: strictly increasing slots, any lengths:
  ``torch.nn.functional.grouped_mm`` over the slot range, unused slots as empty groups
  (offsets are precomputed, so nothing is read on the host);
* ``loop``, a launch per segment: anything else, one ``torch.mm`` per segment.

On CUDA a ``loop`` plan runs as one ``cublasGemmGroupedBatchedEx`` call for all its segments
(``itif.runtime.cublas_grouped``; ``ITIF_GROUPED_GEMM=loop`` keeps the loop).

On the CPU in float32, a product whose longest segment has ``cpu_gemm.MIN_ROWS`` to
``cpu_gemm.MAX_ROWS`` rows goes to itif's own kernel instead (``itif.runtime.cpu_gemm``: every
segment in one call, the weights read in place), whatever the plan's backend.

Why ``grouped_mm`` before ``loop`` on the CPU too (issue 65, measured on the 2-core AMD EPYC
at a quiet moment, load 0.8, float32, 2 threads, median of 7-25; ms for grouped_mm / loop):
8 segments x 1,700 rows [256 -> 768] 30.8 / 30.9, [256 -> 512] 20.8 / 20.9, [512 -> 256] 20.4 /
20.7; x 256 rows 5.3 / 5.3, 3.7 / 4.1, 3.3 / 3.5; x 96 rows 2.4 / 2.4, 1.6 / 1.7, 1.4 / 1.5;
x 16 rows 0.69 / 0.75, 0.45 / 0.49, 0.49 / 0.54 (the few-rows kernel: 0.48, 0.33, 0.35). Equal
or better everywhere, so the order stays. The long products of a CPU encoder do not come here
at all: ``itif.runtime.cpu_linear`` runs them (bias, activation, residual and LayerNorm fused,
every segment in one parallel region), which is what closed the 8-tenant gap of issue 65.

The same plan drives the per-row parameters of the memory-bound ops on the CPU reference
(``broadcast_rows``, which lives in ``itif.ops.rows`` below the ops that use it and is
re-exported here): ``mm`` and ``bmm`` plans broadcast a parameter over its rows as a view, so a
bias add is one op whatever the tenant count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from itif.ops.rows import broadcast_rows
from itif.runtime import cpu_gemm, cublas_grouped

BACKENDS = ("mm", "bmm", "grouped_mm", "loop")
GROUPED_MAX_EMPTY = 4  # grouped_mm only when the slot range is at most this many x the segments


@dataclass(frozen=True)
class Segments:
    """Row segments of one parameter kind over ``rows`` rows (python ints: plans read them)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    slot: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.start)


@dataclass(frozen=True)
class GemmPlan:
    """How one segment list runs. ``offs`` (grouped_mm) is the cumulative end row of every slot
    in ``[lo, hi]``; the batch uploads it with its other index arrays."""

    backend: str
    segs: Segments
    rows: int
    n: int = 0  # bmm: segments
    L: int = 0  # bmm: rows per segment
    slot0: int = 0  # bmm: first slot; mm: the slot
    step: int = 1  # bmm: slot stride
    lo: int = 0  # grouped_mm: slot range
    hi: int = -1
    offs: tuple[int, ...] = ()
    max_rows: int = 0  # the longest segment (picks the CPU few-rows kernel, ``cpu_gemm``)

    @property
    def launches(self) -> int:
        return len(self.segs) if self.backend == "loop" else 1


def tenant_runs(row_tenant: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of equal tenant: (start, end, tenant) arrays. row_tenant: [T] int."""
    if row_tenant.size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    cut = np.flatnonzero(row_tenant[1:] != row_tenant[:-1]) + 1
    start = np.concatenate([[0], cut])
    end = np.concatenate([cut, [row_tenant.size]])
    return start, end, row_tenant[start]


def segments_for(runs: tuple[np.ndarray, np.ndarray, np.ndarray],
                 slot_table: np.ndarray) -> Segments:
    """Merge tenant runs into slot segments. slot_table: [n_batch_tenants] slot of each tenant."""
    start, end, tenant = runs
    slot = slot_table[tenant]
    keep = np.concatenate([[True], slot[1:] != slot[:-1]]) if slot.size else np.zeros(0, bool)
    first = np.flatnonzero(keep)
    last_end = np.concatenate([first[1:], [slot.size]]) - 1
    return Segments(
        tuple(start[first].tolist()), tuple(end[last_end].tolist()), tuple(slot[first].tolist())
    )


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """``torch.nn.functional.grouped_mm`` (torch's public name for its ``_grouped_mm``) exists
    and runs this dtype here: float32 and bfloat16 on the CPU; on CUDA bfloat16 only (sm90 has
    a bf16 kernel; float16 runs, but slower than a loop there, and float32 copies between host
    and device inside, which a CUDA graph cannot capture)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return False


def plan_gemm(segs: Segments, rows: int, device: torch.device | None = None,
              dtype: torch.dtype | None = None, backend: str | None = None) -> GemmPlan:
    """The cheapest backend that can run ``segs`` (or ``backend``, ValueError if it cannot).

    Segments must tile ``[0, rows)`` in row order (as ``segments_for`` makes them).
    """
    n = len(segs)
    if n == 0 or segs.start[0] != 0 or segs.end[-1] != rows or any(
            segs.start[i + 1] != segs.end[i] for i in range(n - 1)):
        raise ValueError(f"segments {segs} do not tile rows [0, {rows})")
    options = {"loop": GemmPlan("loop", segs, rows)}
    if n == 1:
        options["mm"] = GemmPlan("mm", segs, rows, slot0=segs.slot[0])
    L = segs.end[0] - segs.start[0]
    step = segs.slot[1] - segs.slot[0] if n > 1 else 1
    if (n > 1 and step > 0 and all(e - s == L for s, e in zip(segs.start, segs.end))
            and all(segs.slot[i + 1] - segs.slot[i] == step for i in range(n - 1))):
        options["bmm"] = GemmPlan("bmm", segs, rows, n=n, L=L, slot0=segs.slot[0], step=step)
    increasing = all(segs.slot[i + 1] > segs.slot[i] for i in range(n - 1))
    lo, hi = segs.slot[0], segs.slot[-1]
    if (n > 1 and increasing and hi - lo + 1 <= GROUPED_MAX_EMPTY * n
            and (device is None or grouped_mm_supported(device, dtype))):
        ends = np.zeros(hi - lo + 1, np.int64)
        idx = np.asarray(segs.slot) - lo
        ends[idx] = np.asarray(segs.end) - np.asarray(segs.start)
        options["grouped_mm"] = GemmPlan("grouped_mm", segs, rows, lo=lo, hi=hi,
                                         offs=tuple(np.cumsum(ends).tolist()))
    longest = max(e - s for s, e in zip(segs.start, segs.end))
    options = {k: dataclasses.replace(v, max_rows=longest) for k, v in options.items()}
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown GEMM backend {backend!r}; choose from {BACKENDS}")
        if backend not in options:
            raise ValueError(f"GEMM backend {backend!r} cannot run segments {segs}")
        return options[backend]
    for name in ("mm", "bmm", "grouped_mm", "loop"):
        if name in options:
            return options[name]
    raise AssertionError("unreachable")


#: On the CPU a few rows against a wide weight (a vocabulary head in a decode step) run faster
#: as ``(w @ x.T).T``: MKL then streams the weight as the long operand. Measured at 2 threads
#: (marian-decoding's head, 8 tenants x 16 rows against [8000, 512] each): 20.0 ms including the
#: transposing copy, against 23.1 ms for ``x @ w.T``; for square and FFN shapes the copy eats
#: the gain, hence the width rule.
WEIGHT_FIRST_MAX_ROWS = 32
WEIGHT_FIRST_MIN_WIDTH = 8  # N >= this x K


def _weight_first(x: torch.Tensor, N: int, rows: int) -> bool:
    return (x.device.type == "cpu" and rows <= WEIGHT_FIRST_MAX_ROWS
            and N >= WEIGHT_FIRST_MIN_WIDTH * x.shape[1])


def run_gemm(x: torch.Tensor, w: torch.Tensor, plan: GemmPlan, offs: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Each segment's rows times its slot's weight matrix, on the plan's backend; every
    backend reads ``w`` in place (views, never a gathered copy).

    Semantics:
        out[t, n] = sum_k x[t, k] w[slot_i, n, k]    (start_i <= t < end_i, every segment i)

    where ``(start_i, end_i, slot_i)`` are ``plan.segs``, which tile the rows. Returns out.

    Args:
        x: Shape: [T, K]. DType: float. Read only.
        w: Shape: [C, N, K], a weight kind's buffer. DType: x's. Read only.
        plan: Type: ``GemmPlan`` of T rows (``plan_gemm``), chosen once per segment list.
        offs: Shape: [hi - lo + 1], the plan's ``offs`` on x's device; None unless the
            backend is grouped_mm. DType: int32. Read only.
        out: Shape: [T, N], or None (a new tensor). DType: x's. Written in place and returned.
    """
    rows, N = x.shape[0], w.shape[1]
    if cpu_gemm.applies(plan.max_rows, x.device, x.dtype) and cpu_gemm.usable(x, w):
        dst = out if out is not None and out.is_contiguous() else torch.empty(
            rows, N, dtype=x.dtype, device=x.device)
        cpu_gemm.seg_gemm(x, w, plan.segs.start, plan.segs.end, plan.segs.slot, dst)
        if out is not None and dst is not out:
            out.copy_(dst)
            return out
        return dst
    b = plan.backend
    if b == "grouped_mm":
        y = F.grouped_mm(x, w[plan.lo : plan.hi + 1].transpose(1, 2), offs=offs)
        if out is not None:
            out.copy_(y)
            return out
        return y
    if out is None:
        out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    if b == "mm":
        if _weight_first(x, N, rows):
            out.copy_(torch.mm(w[plan.slot0], x.t()).t())
        else:
            torch.mm(x, w[plan.slot0].t(), out=out)
    elif b == "bmm":
        ws = w[plan.slot0 : plan.slot0 + plan.step * (plan.n - 1) + 1 : plan.step]
        xs, ys = x.view(plan.n, plan.L, x.shape[1]), out.view(plan.n, plan.L, N)
        if _weight_first(x, N, plan.L):
            ys.copy_(torch.bmm(ws, xs.transpose(1, 2)).transpose(1, 2))
        else:
            torch.bmm(xs, ws.transpose(1, 2), out=ys)
    elif not (cublas_grouped.enabled(x.device, x.dtype) and cublas_grouped.usable(x, w, out)
              and cublas_grouped.run_or_refuse(x, w, plan.segs, out)):
        # Every segment in one cuBLAS call where that runs (CUDA; ITIF_GROUPED_GEMM=loop turns
        # it off); otherwise one split of each side, then a product per segment: two Python
        # calls a segment (select, mm) rather than five. Under a serving load this loop runs 16
        # tenants x 4 products x 12 layers times a bert-base forward, and each call gives the
        # GIL away.
        segs = plan.segs
        wt = w.transpose(1, 2)
        sizes = [e - s for s, e in zip(segs.start, segs.end)]
        for xi, yi, slot in zip(x.split(sizes), out.split(sizes), segs.slot):
            torch.mm(xi, wt[slot], out=yi)
    return out


def check_operands(x: torch.Tensor, w: torch.Tensor, segs: Segments,
                   out: torch.Tensor | None = None) -> None:
    """ValueError naming both values when ``x``, ``w``, ``segs`` (and ``out``) cannot form a
    grouped linear. The forward builds its operands itself and skips this; callers from outside
    (tests, benchmarks) go through ``grouped_linear``, which runs it."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [rows, K], got {getattr(x, 'shape', type(x))}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"w must be a 3-D buffer [capacity, N, K], got "
                         f"{getattr(w, 'shape', type(w))}")
    if w.device != x.device or w.dtype != x.dtype:
        raise ValueError(f"w is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w has K={w.shape[2]} but x has K={x.shape[1]}")
    bad = [s for s in segs.slot if not 0 <= s < w.shape[0]]
    if bad:
        raise ValueError(f"slot {bad[0]} is not within w's capacity {w.shape[0]}")
    if out is not None and (tuple(out.shape) != (x.shape[0], w.shape[1]) or out.dtype != x.dtype
                            or out.device != x.device):
        raise ValueError(f"out has shape {tuple(out.shape)} ({out.dtype}); needs "
                         f"{(x.shape[0], w.shape[1])} ({x.dtype})")


def grouped_linear(x: torch.Tensor, w: torch.Tensor, segs: Segments,
                   backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One-off convenience (tests, benchmarks): check, plan ``segs`` and run it. The forward
    plans once per batch instead (offsets uploaded with the batch)."""
    check_operands(x, w, segs, out)
    plan = plan_gemm(segs, x.shape[0], x.device, x.dtype, backend)
    offs = (torch.tensor(plan.offs, dtype=torch.int32, device=x.device)
            if plan.backend == "grouped_mm" else None)
    return run_gemm(x, w, plan, offs, out)


__all__ = ["BACKENDS", "GemmPlan", "Segments", "broadcast_rows", "check_operands", "grouped_linear",
           "grouped_mm_supported", "plan_gemm", "run_gemm", "segments_for", "tenant_runs"]
