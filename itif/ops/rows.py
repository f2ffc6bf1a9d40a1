"""Per-row parameter views shared by the reference ops and the GEMM paths.

``broadcast_rows`` lives here, below ``itif.runtime``, because the ops (``reference``) and the
runtime's GEMM and forward both read a parameter buffer through a batch's GEMM plan: the ops
layer must not import the runtime that calls it. It reads only the plan's ``backend``,
``slot0``, ``step`` and ``n`` (``itif.runtime.gemm.GemmPlan``'s fields), so it needs no type
from above.
"""

from __future__ import annotations

import torch

__all__ = ["broadcast_rows"]


def broadcast_rows(buf: torch.Tensor, plan) -> torch.Tensor | None:
    """Per-row values of a parameter buffer ``buf [capacity, N]`` as a view that broadcasts
    against ``x.view(plan.n, plan.L, N)`` (bmm) or ``x`` (mm); None for other plans (the rows'
    slots are then not one evenly spaced run, and the caller indexes per row)."""
    if plan.backend == "mm":
        return buf[plan.slot0]
    if plan.backend == "bmm":
        return buf[plan.slot0 : plan.slot0 + plan.step * (plan.n - 1) + 1 : plan.step].unsqueeze(1)
    return None
