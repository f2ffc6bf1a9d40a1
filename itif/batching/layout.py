"""Layout: where every request of a batch lives, as flat arrays (the thesis' linked list).

One node per request (thesis 4.2.3): tenant, length, offset of its first row in the token buffer,
mini-batch, GEMM group, padded length and operator type, kept as a struct of numpy arrays so
planning costs microseconds per request. Requests tile the token buffer ``[total_rows, H]``
mini-batch by mini-batch; a request owns rows ``[offset, offset + padded_len)`` of which the
first ``length`` hold tokens. The engine reads mini-batch *views* of that one buffer for
attention and GEMMs and the whole buffer for memory-bound ops: nothing moves between them, only
index arrays change.

A mini-batch with ``mb_len > 0`` pads each of its requests to ``mb_len`` rows (a dense
``[mb_size, mb_len]`` view); ``mb_len == 0`` marks a packed mini-batch whose requests sit back to
back without padding. Inside a mini-batch, rows are ordered by tenant so each tenant's rows are
one contiguous GEMM segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class GemmOp(IntEnum):
    """How the planner means a group of mini-batches to multiply (one enum for the planner, the
    DP and the layouts; the runtime's backend per slot table is ``itif.runtime.gemm.GemmPlan``)."""

    SINGLE = 0  # one mini-batch, one GEMM
    BATCHED = 1  # several same-shaped mini-batches, one batched GEMM
    GROUPED = 2  # variable segments, one grouped GEMM


SINGLE_GEMM, BATCHED_GEMM, GROUPED_GEMM = GemmOp.SINGLE, GemmOp.BATCHED, GemmOp.GROUPED
OP_NAMES = {GemmOp.SINGLE: "gemm", GemmOp.BATCHED: "batched_gemm", GemmOp.GROUPED: "grouped_gemm"}


@dataclass(frozen=True)
class Layout:
    strategy: str
    # per request, in the caller's order
    tenant: np.ndarray  # int32 batch-tenant index
    length: np.ndarray  # int32 tokens
    offset: np.ndarray  # int64 first row in the token buffer
    padded_len: np.ndarray  # int32 rows owned (>= length)
    minibatch: np.ndarray  # int32 mini-batch id
    # per mini-batch, in row order
    mb_start: np.ndarray  # int64 first row
    mb_size: np.ndarray  # int32 requests
    mb_len: np.ndarray  # int32 padded length, 0 = packed (variable)
    mb_group: np.ndarray  # int32 GEMM group id
    # per GEMM group
    group_op: np.ndarray  # int8 SINGLE_GEMM | BATCHED_GEMM | GROUPED_GEMM
    total_rows: int
    predicted_ms: float = float("nan")
    row_order: np.ndarray = field(default=None, repr=False)  # requests sorted by offset

    @property
    def num_requests(self) -> int:
        return int(self.length.shape[0])

    @property
    def useful_tokens(self) -> int:
        return int(self.length.sum())

    @property
    def padded_tokens(self) -> int:
        """Rows computed that hold no token."""
        return int(self.total_rows - self.length.sum())

    def view(self, x, m: int):
        """Mini-batch ``m`` of a dense layout as a ``[size, len, ...]`` view of the buffer ``x``
        (no copy: compute-bound ops read mini-batches, memory-bound ops the whole buffer)."""
        L = int(self.mb_len[m])
        if L == 0:
            raise ValueError(f"mini-batch {m} is packed (variable lengths): it has no dense view")
        start, n = int(self.mb_start[m]), int(self.mb_size[m])
        return x[start : start + n * L].view(n, L, *x.shape[1:])

    def node(self, i: int) -> dict:
        """Request ``i``'s node, for debugging and reports (not for the hot path)."""
        mb = int(self.minibatch[i])
        group = int(self.mb_group[mb])
        return dict(
            tenant=int(self.tenant[i]), length=int(self.length[i]), offset=int(self.offset[i]),
            padded_len=int(self.padded_len[i]), minibatch=mb, gemm_group=group,
            op=OP_NAMES[int(self.group_op[group])],
        )

    def check(self) -> None:
        """Assert the invariants (tests and debugging)."""
        order = np.argsort(self.offset, kind="stable")
        ends = self.offset[order] + self.padded_len[order]
        assert self.offset[order][0] == 0 and np.all(self.offset[order][1:] == ends[:-1])
        assert ends[-1] == self.total_rows
        assert np.all(self.padded_len >= self.length) and np.all(self.length >= 1)
        dense = self.mb_len[self.minibatch] > 0
        assert np.all(self.padded_len[dense] == self.mb_len[self.minibatch][dense])
        assert np.all(self.padded_len[~dense] == self.length[~dense])
        sizes = np.bincount(self.minibatch, minlength=len(self.mb_size))
        assert np.array_equal(sizes, self.mb_size)


def build_layout(
    strategy: str,
    tenant: np.ndarray,
    length: np.ndarray,
    mb_members: list[np.ndarray],
    mb_len: np.ndarray,
    mb_group: np.ndarray,
    group_op: np.ndarray,
    predicted_ms: float = float("nan"),
) -> Layout:
    """Assemble a Layout from mini-batches given as arrays of request indices.

    Mini-batches are laid out in the given order; inside each, requests are ordered by tenant
    (stable) so a tenant's rows are contiguous. ``mb_len[m] == 0`` packs mini-batch m.
    """
    tenant = np.asarray(tenant, dtype=np.int32)
    length = np.asarray(length, dtype=np.int32)
    n = length.shape[0]
    mb_len = np.asarray(mb_len, dtype=np.int32)
    sizes = np.fromiter((len(m) for m in mb_members), dtype=np.int32, count=len(mb_members))
    order = np.concatenate(mb_members).astype(np.int64) if n else np.zeros(0, np.int64)
    mb_of = np.repeat(np.arange(len(mb_members), dtype=np.int32), sizes)
    # Stable sort by (mini-batch, tenant): tenants contiguous inside each mini-batch.
    key = mb_of.astype(np.int64) * (int(tenant.max(initial=0)) + 1) + tenant[order]
    perm = np.argsort(key, kind="stable")
    order, mb_of = order[perm], mb_of[perm]
    rows = np.where(mb_len[mb_of] > 0, mb_len[mb_of], length[order]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    offset = np.empty(n, np.int64)
    offset[order] = starts
    padded = np.empty(n, np.int32)
    padded[order] = rows
    minibatch = np.empty(n, np.int32)
    minibatch[order] = mb_of
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    mb_start = starts[first] if n else np.zeros(0, np.int64)
    return Layout(
        strategy=strategy, tenant=tenant, length=length, offset=offset, padded_len=padded,
        minibatch=minibatch, mb_start=mb_start, mb_size=sizes, mb_len=mb_len,
        mb_group=np.asarray(mb_group, dtype=np.int32), group_op=np.asarray(group_op, np.int8),
        total_rows=int(rows.sum()), predicted_ms=predicted_ms, row_order=order,
    )


def _per_tenant_members(tenant: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
    """Request indices of each present tenant, each sorted by length (stable)."""
    order = np.lexsort((length, tenant))
    bounds = np.flatnonzero(np.diff(tenant[order])) + 1
    return np.split(order, bounds)


def layout_packed(tenant: np.ndarray, length: np.ndarray) -> Layout:
    """No padding at all: each tenant's requests back to back, one grouped GEMM over segments."""
    tenant = np.asarray(tenant, np.int32)
    length = np.asarray(length, np.int32)
    members = _per_tenant_members(tenant, length)
    m = len(members)
    return build_layout(
        "packed", tenant, length, members, np.zeros(m, np.int32), np.zeros(m, np.int32),
        np.array([GROUPED_GEMM], np.int8),
    )


def layout_pad_per_tenant(tenant: np.ndarray, length: np.ndarray) -> Layout:
    """One mini-batch per tenant padded to that tenant's longest request; one GEMM each."""
    tenant = np.asarray(tenant, np.int32)
    length = np.asarray(length, np.int32)
    members = _per_tenant_members(tenant, length)
    mb_len = np.fromiter((length[m].max() for m in members), np.int32, count=len(members))
    k = len(members)
    return build_layout(
        "pad_per_tenant", tenant, length, members, mb_len, np.arange(k, dtype=np.int32),
        np.full(k, SINGLE_GEMM, np.int8),
    )


def layout_pad_to_max(tenant: np.ndarray, length: np.ndarray) -> Layout:
    """Everything in one mini-batch padded to the longest request (the naive baseline)."""
    tenant = np.asarray(tenant, np.int32)
    length = np.asarray(length, np.int32)
    return build_layout(
        "pad_to_max", tenant, length, [np.arange(len(length))],
        np.array([length.max()], np.int32), np.zeros(1, np.int32),
        np.array([SINGLE_GEMM], np.int8),
    )
