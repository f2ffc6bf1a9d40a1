"""Batching planner: the ITIF two-stage DP (thesis §4.1) and the TurboTransformers baseline.

Stage 1 (thesis Algorithm 1, Eq. 4.1) packs each tenant's requests into mini-batches. With one
tenant's requests sorted by length ``len[0] <= ... <= len[n-1]``, a mini-batch is a contiguous run
``[j, i]`` padded to ``len[i]`` and costs ``A[len[i]][i - j + 1]`` (:meth:`CostModel.single`)::

    state[0] = 0,   state[i + 1] = min_{0 <= j <= i} state[j] + A[len[i]][i - j + 1]

Why contiguous runs suffice (the thesis asserts it): take any partition into blocks and order the
blocks by their longest request, ``M_1 <= M_2 <= ...`` with sizes ``s_1, s_2, ...``. Blocks 1..k
hold ``S_k = s_1 + ... + s_k`` requests, all no longer than ``M_k``, so the ``S_k``-th shortest
request is no longer than ``M_k``. Re-cutting the sorted list into consecutive runs of sizes
``s_1, s_2, ...`` therefore keeps every size and never raises a padded length, so it costs no more
whenever A is non-decreasing in length (``CostModel`` guarantees that). The DP searches exactly
those runs, so it is optimal over all partitions.

Stage 2 (Algorithm 2, Eq. 4.2) decides which mini-batches run as one batched GEMM. A batched GEMM
needs identical sub-GEMM shapes, so only mini-batches with equal (padded length, size) can share
one. Mini-batches are sorted by that shape; each class of ``m`` equal shapes is split into groups
by a DP over the group size ``n``::

    state[0] = 0,   state[i] = min_{1 <= n <= i} state[i - n] + g(n),
    g(1) = A[len][size] (a plain GEMM),   g(n) = B[len][n][size] (:meth:`CostModel.batched`)

Members of a class are interchangeable, so consecutive groups lose nothing against arbitrary
subsets. Members may share a tenant (stage 1 can emit two equal mini-batches for one tenant when
that is cheaper than one double-size mini-batch); the group's stacked weights then repeat it.

Bounded windows (why planning is O(n) per tenant, not O(n^2)). :class:`CostModel` extrapolates
beyond its largest profiled batch ``Bt`` (``cost.batches[-1]``) in proportion to the members:
``A[len][s] = A[len][Bt] * s / Bt`` for ``s >= Bt``. A run ``[j, i]`` of ``s >= 2 Bt`` requests
therefore splits into a prefix run of ``s1 >= Bt`` and a suffix run of ``s - s1 >= Bt`` that cost
``A[len[j + s1 - 1]][s1] + A[len[i]][s - s1] <= A[len[i]][s1] + A[len[i]][s - s1] = A[len[i]][s]``
(monotone in length, then exactly linear in size), and both pieces still respect any
``max_batch``. Repeating, some optimal plan uses only runs of fewer than ``2 Bt`` requests, so
Eq. 4.1 only tries ``j >= i + 2 - 2 Bt``: the window costs nothing, the DP stays exactly optimal
(equal cost up to float rounding; on exact ties it may pick more launches than the unbounded DP
would), and its cost table is ``[max_len, 2 Bt]`` instead of ``[max_len, n]``. Likewise B is
proportional to ``n`` beyond the largest profiled group ``Nt`` (``cost.ns[-1]``), so a group of
``n >= 2 N`` (``N = max(Nt, 2)``, keeping both pieces batched) splits into two groups of ``>= N``
at the same cost, and Eq. 4.2 only tries groups of fewer than ``2 N`` mini-batches. Both DPs are
then ``O(n * window)``. :func:`reference_split` is the unbounded DP the tests compare against.
The argument rests on that proportional extrapolation: a cost model that extrapolated
sub-linearly beyond its grid would need the unbounded DP.

Ties go to fewer, larger launches. All arrays are numpy; request and mini-batch indices int64.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from itif.batching.layer_cost import CostModel

from itif.batching.layout import GemmOp  # noqa: E402 - the one enum of GEMM kinds

OP_GEMM = GemmOp.SINGLE
"""``Groups.op`` of a group that runs one mini-batch as a plain GEMM."""
OP_BATCHED_GEMM = GemmOp.BATCHED
"""``Groups.op`` of a group that runs several same-shaped mini-batches as one batched GEMM."""

MIXED_TENANTS = -1
"""``MiniBatches.mb_tenant`` of a :func:`turbo_dp` mini-batch, which may mix tenants."""


@dataclass(frozen=True, eq=False)
class MiniBatches:
    """Stage-1 plan, structure of arrays. R requests in M mini-batches.

    Attributes:
        order: ``[R]`` request indices in mini-batch order; mini-batch k is
            ``order[mb_start[k] : mb_start[k] + mb_size[k]]``, shortest request first.
        mb_start: ``[M]`` offset of each mini-batch into ``order``.
        mb_size: ``[M]`` requests per mini-batch (>= 1).
        mb_len: ``[M]`` padded length: the longest member's length.
        mb_tenant: ``[M]`` tenant of every member, or :data:`MIXED_TENANTS`.
        mb_cost: ``[M]`` predicted ms, ``A[mb_len][mb_size]``.
    """

    order: np.ndarray
    mb_start: np.ndarray
    mb_size: np.ndarray
    mb_len: np.ndarray
    mb_tenant: np.ndarray
    mb_cost: np.ndarray

    def __len__(self) -> int:
        return int(self.mb_start.size)

    @property
    def total_cost(self) -> float:
        """Predicted ms if every mini-batch ran as its own GEMM."""
        return float(self.mb_cost.sum())

    def members(self, k: int) -> np.ndarray:
        """Request indices of mini-batch ``k``, shortest first."""
        start = int(self.mb_start[k])
        return self.order[start : start + int(self.mb_size[k])]


@dataclass(frozen=True, eq=False)
class Groups:
    """Stage-2 plan over M mini-batches in G groups (one GEMM or batched GEMM each).

    Attributes:
        mb_group: ``[M]`` group of each mini-batch.
        members: ``[M]`` mini-batch indices in group order; group g is
            ``members[g_start[g] : g_start[g] + size[g]]``.
        g_start: ``[G]`` offset of each group into ``members``.
        size: ``[G]`` mini-batches per group.
        op: ``[G]`` :data:`OP_GEMM` (size 1) or :data:`OP_BATCHED_GEMM`.
        seq_len: ``[G]`` padded length shared by the group's mini-batches.
        batch: ``[G]`` requests per mini-batch, shared by the group.
        cost: ``[G]`` predicted ms: ``A[seq_len][batch]`` or ``B[seq_len][size][batch]``.
        total_cost: sum of ``cost``.

    Groups are ordered by (seq_len, batch).
    """

    mb_group: np.ndarray
    members: np.ndarray
    g_start: np.ndarray
    size: np.ndarray
    op: np.ndarray
    seq_len: np.ndarray
    batch: np.ndarray
    cost: np.ndarray
    total_cost: float

    def __len__(self) -> int:
        return int(self.size.size)


def _as_lengths(lengths: np.ndarray, name: str) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {lengths.shape}")
    if lengths.size and lengths.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"{name} must be >= 1, got {lengths.min()}")
    return lengths


def _no_minibatches() -> MiniBatches:
    empty = np.zeros(0, dtype=np.int64)
    return MiniBatches(empty, empty, empty, empty, empty, np.zeros(0))


def _check_max_batch(max_batch: int | None) -> None:
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")


def _run_window(cost: CostModel, max_batch: int | None) -> int:
    """Largest run Eq. 4.1 needs to try: under ``2 * cost.batches[-1]`` (module docstring)."""
    window = 2 * int(cost.batches[-1]) - 1
    return window if max_batch is None else min(window, max_batch)


def _group_window(cost: CostModel) -> int:
    """Largest group Eq. 4.2 needs to try: under ``2 * max(cost.ns[-1], 2)``."""
    return 2 * max(int(cost.ns[-1]), 2) - 1


def _split(lengths: np.ndarray, table: np.ndarray, window: int) -> np.ndarray:
    """Eq. 4.1 on ascending ``lengths`` [n] over runs of at most ``window`` requests;
    ``table[len, size]`` is A for sizes up to ``window``. Returns run starts. O(n * window)."""
    n = lengths.size
    state = np.zeros(n + 1)  # state[i]: cheapest plan for the first i requests
    best_start = np.empty(n, dtype=np.int64)  # start of the last run in that plan
    # rev[len][w - s] = A[len][s] for s = w..1, so one row slice lines up with state.
    w = min(window, n)
    rev = table[:, w:0:-1]
    lens = lengths.tolist()
    argmin = np.argmin
    for i in range(w):  # windows not yet full: runs may start anywhere in [0, i]
        cand = state[: i + 1] + rev[lens[i], w - i - 1 :]
        k = int(argmin(cand))  # first minimum: the longest run, i.e. fewer launches on ties
        state[i + 1] = cand[k]
        best_start[i] = k
    for i in range(w, n):
        lo = i + 1 - w
        cand = state[lo : i + 1] + rev[lens[i]]
        k = int(argmin(cand))
        state[i + 1] = cand[k]
        best_start[i] = lo + k
    starts = []
    i = n - 1
    while i >= 0:
        starts.append(best_start[i])
        i = best_start[i] - 1
    return np.asarray(starts[::-1], dtype=np.int64)


def split_sorted(
    lengths_sorted: np.ndarray, cost: CostModel, max_batch: int | None = None
) -> np.ndarray:
    """Stage 1 for one tenant (or all requests, tenant-agnostic): Eq. 4.1.

    Args:
        lengths_sorted: ``[n]`` ascending request lengths (ints >= 1).
        cost: supplies A.
        max_batch: largest allowed mini-batch, or None for no cap.

    Returns:
        ``[M]`` ascending start indices of the mini-batches (``[0, ...]``; empty if n == 0).
        Mini-batch k is ``lengths_sorted[starts[k] : starts[k + 1]]``, padded to its last length.
    """
    lengths = _as_lengths(lengths_sorted, "lengths_sorted")
    _check_max_batch(max_batch)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    if np.any(lengths[1:] < lengths[:-1]):
        raise ValueError("lengths_sorted must be ascending")
    window = min(lengths.size, _run_window(cost, max_batch))
    return _split(lengths, cost.single_table(int(lengths[-1]), window), window)


def _pack(
    order: np.ndarray,
    lengths_in_order: np.ndarray,
    starts: np.ndarray,
    tenant: np.ndarray,
    table: np.ndarray,
) -> MiniBatches:
    """Assemble MiniBatches from run starts over ``order`` (lengths ascending within runs)."""
    size = np.diff(np.append(starts, order.size))
    mb_len = lengths_in_order[starts + size - 1]
    return MiniBatches(order=order, mb_start=starts, mb_size=size, mb_len=mb_len,
                       mb_tenant=tenant, mb_cost=table[mb_len, size])


def stage1(
    tenant: np.ndarray, lengths: np.ndarray, cost: CostModel, max_batch: int | None = None
) -> MiniBatches:
    """Algorithm 1: per tenant, sort its requests by length (stable) and run Eq. 4.1.

    Args:
        tenant: ``[R]`` tenant id of each request (any ints).
        lengths: ``[R]`` request lengths (ints >= 1).
        cost: supplies A.
        max_batch: largest allowed mini-batch, or None for no cap.

    Returns:
        Mini-batches ordered by tenant id, then by padded length.
    """
    lengths = _as_lengths(lengths, "lengths")
    tenant = np.asarray(tenant)
    if tenant.shape != lengths.shape:
        raise ValueError(f"tenant shape {tenant.shape} != lengths shape {lengths.shape}")
    _check_max_batch(max_batch)
    if lengths.size == 0:
        return _no_minibatches()
    order = np.lexsort((lengths, tenant))  # by tenant, then length; stable
    t_sorted, l_sorted = tenant[order], lengths[order]
    bounds = np.flatnonzero(t_sorted[1:] != t_sorted[:-1]) + 1
    t_start = np.concatenate(([0], bounds))
    t_end = np.append(bounds, lengths.size)
    window = min(int((t_end - t_start).max()), _run_window(cost, max_batch))
    table = cost.single_table(int(l_sorted.max()), window)
    starts = np.concatenate(
        [_split(l_sorted[a:b], table, window) + a for a, b in zip(t_start, t_end)]
    )
    return _pack(order.astype(np.int64), l_sorted, starts, t_sorted[starts], table)


def turbo_dp(lengths: np.ndarray, cost: CostModel, max_batch: int | None = None) -> MiniBatches:
    """TurboTransformers' single-stage DP: all requests sorted by length, then Eq. 4.1.

    Tenant-agnostic, so mini-batches may mix tenants (``mb_tenant`` is :data:`MIXED_TENANTS`).
    lengths: ``[R]`` ints >= 1.
    """
    lengths = _as_lengths(lengths, "lengths")
    _check_max_batch(max_batch)
    if lengths.size == 0:
        return _no_minibatches()
    order = np.argsort(lengths, kind="stable").astype(np.int64)
    l_sorted = lengths[order]
    window = min(lengths.size, _run_window(cost, max_batch))
    table = cost.single_table(int(l_sorted[-1]), window)
    starts = _split(l_sorted, table, window)
    return _pack(order, l_sorted, starts, np.full(starts.size, MIXED_TENANTS, np.int64), table)


def _group_sizes(g: np.ndarray, m: int) -> list[int]:
    """Eq. 4.2 on one class of ``m`` equal shapes; ``g[n - 1]`` costs a group of n, for n up to
    ``g.size`` (the window: groups larger than that are never tried).

    Returns group sizes summing to m, in member order.
    """
    w = g.size
    state = np.zeros(m + 1)
    best_n = np.zeros(m + 1, dtype=np.int64)
    g_rev = g[::-1]  # g_rev[w - n] = g(n)
    argmin = np.argmin
    for i in range(1, m + 1):
        # cand[k] = state[i - n] + g(n) for n = top - k, top = min(i, w): largest group first,
        # so the first minimum gives ties to the largest group.
        top = min(i, w)
        cand = state[i - top : i] + g_rev[w - top :]
        k = int(argmin(cand))
        state[i] = cand[k]
        best_n[i] = top - k
    sizes = []
    i = m
    while i > 0:
        sizes.append(int(best_n[i]))
        i -= best_n[i]
    return sizes[::-1]


def stage2(mb: MiniBatches, cost: CostModel) -> Groups:
    """Algorithm 2: group equal-shaped mini-batches into batched GEMMs where that is cheaper.

    Args:
        mb: a stage-1 plan (M mini-batches).
        cost: supplies A and B.

    Returns:
        The cheapest grouping under Eq. 4.2 (see the module docstring).
    """
    m_total = len(mb)
    by_shape = np.lexsort((mb.mb_size, mb.mb_len)).astype(np.int64)
    lens, sizes = mb.mb_len[by_shape], mb.mb_size[by_shape]
    new_class = (lens[1:] != lens[:-1]) | (sizes[1:] != sizes[:-1])
    c_start = np.flatnonzero(np.concatenate(([m_total > 0], new_class)))
    c_count = np.diff(np.append(c_start, m_total))
    c_len, c_size = lens[c_start], sizes[c_start]
    single = cost.single_v(c_len, c_size) if m_total else np.zeros(0)

    # One vectorised B query for every (class, 2 <= n <= window) pair of the classes that can
    # batch: class c's costs for n = 2..min(count, window) sit at b_cost[b_off[c] :][:reps[c]].
    window = _group_window(cost)
    reps = np.clip(c_count, 1, window) - 1
    b_off = np.cumsum(reps) - reps
    q_class = np.repeat(np.arange(c_count.size), reps)
    q_n = np.arange(q_class.size) - b_off[q_class] + 2
    b_cost = cost.batched_v(c_len[q_class], q_n, c_size[q_class]) if q_class.size else None

    g_size: list[int] = []
    g_class: list[int] = []
    g_cost: list[float] = []
    for c, count in enumerate(c_count.tolist()):
        if count == 1:
            parts, costs = [1], single[c : c + 1]
        else:
            off = int(b_off[c])
            costs = np.concatenate((single[c : c + 1], b_cost[off : off + int(reps[c])]))
            parts = _group_sizes(costs, count)
        g_size.extend(parts)
        g_class.extend([c] * len(parts))
        g_cost.extend(float(costs[n - 1]) for n in parts)
    size = np.asarray(g_size, dtype=np.int64)
    cls = np.asarray(g_class, dtype=np.int64)
    mb_group = np.empty(m_total, dtype=np.int64)
    mb_group[by_shape] = np.repeat(np.arange(size.size), size)
    cost_arr = np.asarray(g_cost, dtype=np.float64)
    return Groups(mb_group=mb_group, members=by_shape, g_start=np.cumsum(size) - size,
                  size=size, op=np.where(size > 1, OP_BATCHED_GEMM, OP_GEMM).astype(np.int8),
                  seq_len=c_len[cls], batch=c_size[cls], cost=cost_arr,
                  total_cost=float(cost_arr.sum()))


# -- exhaustive references, for tests only ----------------------------------------------------


def reference_split(
    lengths_sorted: np.ndarray, cost: CostModel, max_batch: int | None = None
) -> tuple[float, np.ndarray]:
    """Eq. 4.1 without the window: every run ``[j, i]`` up to ``max_batch`` is tried, costed
    with :meth:`CostModel.single_v`. Returns ``(cost_ms, starts)``. O(n^2): tests only."""
    lengths = _as_lengths(lengths_sorted, "lengths_sorted")
    n = lengths.size
    if n == 0:
        return 0.0, np.zeros(0, dtype=np.int64)
    state = np.zeros(n + 1)
    best_start = np.empty(n, dtype=np.int64)
    for i in range(n):
        lo = 0 if max_batch is None else max(0, i + 1 - max_batch)
        cand = state[lo : i + 1] + cost.single_v(int(lengths[i]), np.arange(i + 1 - lo, 0, -1))
        k = int(np.argmin(cand))
        state[i + 1] = cand[k]
        best_start[i] = lo + k
    starts = []
    i = n - 1
    while i >= 0:
        starts.append(int(best_start[i]))
        i = int(best_start[i]) - 1
    return float(state[n]), np.asarray(starts[::-1], dtype=np.int64)


def brute_force_split(
    lengths_sorted: np.ndarray, cost: CostModel, max_batch: int | None = None
) -> tuple[float, np.ndarray]:
    """Cheapest partition of ascending ``lengths_sorted`` [n] into contiguous runs, by trying all
    ``2^(n-1)`` of them. Returns ``(cost_ms, starts)``. Exponential: small n only."""
    lengths = _as_lengths(lengths_sorted, "lengths_sorted")
    n = lengths.size
    if n == 0:
        return 0.0, np.zeros(0, dtype=np.int64)
    run_cost = {
        (j, i): cost.single(int(lengths[i]), i - j + 1)
        for i in range(n)
        for j in range(i + 1)
        if max_batch is None or i - j + 1 <= max_batch
    }
    best = (float("inf"), [])
    for cuts in range(1 << (n - 1)):
        # Bit b set: a new run starts at request b + 1.
        starts = [0] + [b + 1 for b in range(n - 1) if cuts >> b & 1]
        ends = starts[1:] + [n]
        if any((j, e - 1) not in run_cost for j, e in zip(starts, ends)):
            continue
        total = sum(run_cost[(j, e - 1)] for j, e in zip(starts, ends))
        if total < best[0]:
            best = (total, starts)
    return best[0], np.asarray(best[1], dtype=np.int64)


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1 :]]


def brute_force_stage2(mb: MiniBatches, cost: CostModel) -> float:
    """Cheapest grouping of ``mb`` over every set partition whose blocks share one shape
    (Bell(M) partitions: small M only). Returns the predicted ms."""
    shape = list(zip(mb.mb_len.tolist(), mb.mb_size.tolist()))
    block_cost: dict[tuple[int, int, int], float] = {}
    best = float("inf")
    for partition in _set_partitions(list(range(len(mb)))):
        total = 0.0
        for block in partition:
            seq_len, size = shape[block[0]]
            if any(shape[k] != (seq_len, size) for k in block):
                break
            key = (seq_len, len(block), size)
            if key not in block_cost:
                block_cost[key] = (cost.single(seq_len, size) if len(block) == 1
                                   else cost.batched(seq_len, len(block), size))
            total += block_cost[key]
        else:
            best = min(best, total)
    return best
