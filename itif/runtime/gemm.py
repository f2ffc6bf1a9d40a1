"""Per-slot GEMMs over the token buffer without copying weights.

Rows of the token buffer are ordered so each tenant's rows are contiguous; a parameter kind's
slot table turns those runs into *segments* ``(start, end, slot)``: rows ``start:end`` multiply
slot ``slot`` of the kind's weight buffer. Adjacent runs whose tenants share the slot (frozen or
identical layers) merge into one segment, so shared weights cost one GEMM, not one per tenant.

The CPU backend is one ``torch.mm`` per segment straight into a slice of the output: at most one
loop step per GEMM segment, never per request or token. CUDA backends with the same signature
(batched, grouped, multi-stream) live in ``itif.runtime.gemm_cuda``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Segments:
    """A GEMM plan for one parameter kind over ``rows`` rows (python ints: the loop reads them)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    slot: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.start)


def tenant_runs(row_tenant: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of equal tenant: (start, end, tenant) arrays. row_tenant: [T] int."""
    if row_tenant.size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    cut = np.flatnonzero(row_tenant[1:] != row_tenant[:-1]) + 1
    start = np.concatenate([[0], cut])
    end = np.concatenate([cut, [row_tenant.size]])
    return start, end, row_tenant[start]


def segments_for(runs: tuple[np.ndarray, np.ndarray, np.ndarray], slot_table: np.ndarray) -> Segments:
    """Merge tenant runs into slot segments. slot_table: [n_batch_tenants] slot of each tenant."""
    start, end, tenant = runs
    slot = slot_table[tenant]
    keep = np.concatenate([[True], slot[1:] != slot[:-1]]) if slot.size else np.zeros(0, bool)
    first = np.flatnonzero(keep)
    last_end = np.concatenate([first[1:], [slot.size]]) - 1
    return Segments(
        tuple(start[first].tolist()), tuple(end[last_end].tolist()), tuple(slot[first].tolist())
    )


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, segs: Segments, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``y[s:e] = x[s:e] @ w[slot].T`` for every segment.

    x: [T, K]; w: [capacity, N, K] weight buffer (read in place, never copied); returns [T, N].
    """
    if out is None:
        out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for s, e, slot in zip(segs.start, segs.end, segs.slot):
        torch.mm(x[s:e], w[slot].t(), out=out[s:e])
    return out
