"""The host path's fast paths (issue #61) give what its general paths give, on random inputs.

The engine side keeps its per-batch cost down with shortcuts for the common batch:
``Arrivals.unpack_many`` (one wake-up's ring slots as one batch), ``pack_into`` copying small
columns as bytes, and in ``ColumnQueue`` a push of clean rows, a take that finds every row alive
and within the budget, and a ``due`` decided from counters. Each is checked here against the
path it shortcuts: the same columns, statuses, tags, counters and decisions, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from itif.hostpath.colqueue import ColumnQueue
from itif.hostpath.columns import STATUS, Arrivals, Results
from itif.scheduler import TenantQuota

OK, NOT_FOUND = STATUS.index("OK"), STATUS.index("NOT_FOUND")
COLS = ("call_id", "tenant", "offsets", "ids", "deadline", "priority")


def _random_arrivals(rng, n: int, tenants: int, call0: int, now: float = 0.0,
                     max_len: int = 40, vocab: int = 1000, one: bool = False) -> Arrivals:
    """``n`` random rows of ``tenants`` (``one``: all of one of them)."""
    lengths = rng.integers(1, max_len + 1, n)
    off = np.concatenate(([0], np.cumsum(lengths)))
    deadline = np.where(rng.random(n) < 0.3, now + rng.random(n) * 0.05, np.inf)
    tenant = np.full(n, rng.integers(0, tenants)) if one else rng.integers(0, tenants, n)
    return Arrivals.build(np.arange(call0, call0 + n), tenant, off,
                          rng.integers(0, vocab, int(off[-1])), deadline,
                          rng.integers(-2, 3, n), table_version=int(rng.integers(0, 5)))


# ---- the formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_unpack_many_equals_concat_of_unpacks_and_is_a_copy(seed):
    rng = np.random.default_rng(seed)
    parts = [_random_arrivals(rng, int(rng.integers(0, 6)), 7, 100 * i)
             for i in range(int(rng.integers(1, 6)))]
    slab = bytearray(sum(p.nbytes() for p in parts) + 64 * len(parts))
    views, at = [], 8  # the slots lie back to back in one buffer, as in a ring's segment
    for p in parts:
        size = p.pack_into(slab, at)
        views.append(memoryview(slab)[at : at + size])
        at += size + 56
    want = Arrivals.concat([Arrivals.unpack(v) for v in views])
    got = Arrivals.unpack_many(views)
    assert got.table_version == max(p.table_version for p in parts)
    for col in COLS:
        x, y = getattr(want, col), getattr(got, col)
        assert x.dtype == y.dtype and np.array_equal(x, y), col
    before = got.ids.copy(), got.offsets.copy()
    slab[:] = bytes(len(slab))  # the slots are reused: the batch keeps its rows
    assert np.array_equal(got.ids, before[0]) and np.array_equal(got.offsets, before[1])
    got.offsets[0] = 0  # writable, like unpack's views of a slot


def test_pack_into_copies_as_bytes_what_numpy_would_write():
    """Columns that take the bytes shortcut (right dtype, contiguous, small) and those that do
    not (another dtype, a strided view, a large column) pack to the same bytes."""
    rng = np.random.default_rng(7)
    n, width = 6, 3
    values = rng.random(n * width).astype(np.float32)
    exact = Results.build(np.arange(n), np.zeros(n), np.arange(0, n * width + 1, width), values,
                          {2: "bad row", 4: "another"})
    loose = Results(
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.int64),
        np.arange(0, 19, 3, np.int32),
        np.repeat(values, 2)[::2],
        exact.err_row.astype(np.int64),
        exact.err_offsets,
        exact.err_text,
    )
    assert loose.to_bytes() == exact.to_bytes()
    big = rng.random(1 << 15).astype(np.float32)  # 128 KiB: past the shortcut
    r = Results.ok(np.arange(2), np.array([0, 1 << 14, 1 << 15]), big)
    back = Results.unpack(r.to_bytes())
    assert back.values.tobytes() == big.tobytes() and back.offsets.tolist() == [0, 1 << 14, 1 << 15]


# ---- the column queue -------------------------------------------------------------------------
def _queues(tenants: int, rng) -> tuple[ColumnQueue, ColumnQueue]:
    """Two equal queues; the second has one more tenant, parked and never sent a row, which
    sends its take and due down the general path every time."""
    fast, general = ColumnQueue(max_len=48, vocab=1000), ColumnQueue(max_len=48, vocab=1000)
    for i in range(tenants):
        quota = TenantQuota(max_queue=int(rng.integers(4, 40)),
                            weight=float(2.0 ** rng.integers(-1, 3)), latency_target_ms=20.0)
        fast.add_tenant(f"t{i}", quota)
        general.add_tenant(f"t{i}", quota)
    general.add_tenant("parked", TenantQuota(latency_target_ms=20.0))
    general.park("parked")
    return fast, general


def _with_unknown_row(a: Arrivals, tenants: int) -> Arrivals:
    """``a`` plus one row of a tenant outside the table: its push takes the slow path."""
    return Arrivals(np.append(a.call_id, -1), np.append(a.tenant, tenants + 5).astype(np.int32),
                    np.append(a.offsets, a.offsets[-1] + 1), np.append(a.ids, 1).astype(np.int32),
                    np.append(a.deadline, np.inf), np.append(a.priority, 0).astype(np.int8),
                    a.table_version)


def _same_state(fast: ColumnQueue, general: ColumnQueue, T: int) -> None:
    assert fast.vtime == general.vtime and fast.queued == general.queued
    for col in ("tag", "depth", "submitted", "rejected", "expired", "taken", "tokens_run"):
        assert np.array_equal(getattr(fast, col), getattr(general, col)[:T]), col


@pytest.mark.parametrize("seed", range(6))
def test_column_queue_fast_paths_equal_the_general_path(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(1, 6))
    fast, general = _queues(T, rng)
    scans = {"fast": 0}
    scan = ColumnQueue._due_scan

    def counting(self, *args):
        scans["fast"] += self is fast
        return scan(self, *args)

    monkeypatch.setattr(ColumnQueue, "_due_scan", counting)
    taken_one = {"multi": 0}
    take_one = ColumnQueue._take_one

    def counting_one(self, i, rows, *args):
        taken_one["multi"] += rows.size > 1
        return take_one(self, i, rows, *args)

    monkeypatch.setattr(ColumnQueue, "_take_one", counting_one)
    now, call = 0.0, 0
    decided = 0

    def estimate(rows, tokens):
        return 0.01 * rows + 0.001 * tokens

    for _ in range(120):
        now += float(rng.random() * 0.01)
        op = rng.random()
        if op < 0.4 or (op < 0.8 and not fast.queued):
            a = _random_arrivals(rng, int(rng.integers(1, 8)), T, call, now, max_len=50,
                                 one=rng.random() < 0.5)
            call += len(a)
            want = general.push(_with_unknown_row(a, T), now)
            assert want[-1] == NOT_FOUND
            assert fast.push(a, now).tolist() == want[:-1].tolist()
        elif op < 0.8:
            budget = int(rng.choice([10**6, int(rng.integers(20, 200))]))
            rows = int(rng.choice([256, int(rng.integers(1, 6))]))
            got, want = fast.take(budget, rows, now), general.take(budget, rows, now)
            for col in ("call_id", "tenant", "offsets", "ids", "enqueued", "expired_call_id",
                        "expired_tenant"):
                x, y = getattr(got, col), getattr(want, col)
                assert x.dtype == y.dtype and np.array_equal(x, y), col
        else:
            kw = {"max_tokens": int(rng.choice([60, 10**6])), "max_rows": 256,
                  "max_wait_ms": float(rng.choice([1.0, 50.0, 1000.0])),
                  "last_end": float(now - rng.random() * 0.05), "estimate_ms": estimate,
                  "stopping": bool(rng.random() < 0.1)}
            assert fast.due(now, **kw) == general.due(now, **kw)
            decided += 1
        _same_state(fast, general, T)
    for q in (fast, general):  # and one tenant's rows alone in the queue, taken all at once
        q.take(10**9, 10**6, now)
        q.push(_random_arrivals(np.random.default_rng(seed), 4, T, call, now, one=True), now)
    got, want = fast.take(10**9, 256, now), general.take(10**9, 256, now)
    assert got.call_id.tolist() == want.call_id.tolist() and np.array_equal(got.ids, want.ids)
    _same_state(fast, general, T)
    assert decided and scans["fast"] < decided  # the counters decided some of them
    assert taken_one["multi"], "no take found one tenant's rows only"
