"""Per-tenant queues and weighted fair batch formation on numpy arrays (no object a request).

The policy is the scheduler's (``itif.scheduler``, ``fairqueue.py``), restated for columns:

- *Start-time fair queueing in tokens.* Every tenant has a virtual tag; a batch takes rows in
  the order of their start tags, where a tenant's k-th queued row starts at its tag plus the
  ``max(tokens, 1) / weight`` of the rows before it. That order is exactly the scheduler's
  "take the head of the tenant with the smallest tag, advance its tag" (a merge of the
  tenants' sorted tag sequences; ties go to the tenant registered first). Taking rows advances
  each tenant's tag by their cost; the system virtual time is the largest start tag taken. A
  tenant whose queue was empty restarts at the virtual time (idling banks no credit).
- *Within a tenant:* higher ``priority`` first, then arrival order.
- *Budget:* a row that does not fit the rest of ``max_tokens`` leaves its tenant out of this
  batch only (it keeps the smallest tag); the first row always fits; at most ``max_rows``.
- *No run-ahead tail:* in a batch of several tenants, its last rows, if all one tenant's,
  starting at or after the finish tag of every other tenant's rows in it and more tokens than
  the rest of the batch, wait for the next batch (tags kept). Else a tenant back from idle
  rides in a batch filled with a flood's rows (this CPU: a one-row call in a 13-row batch,
  9 ms, not 3; bench/hostile_load.py --parts fair). Backlogged tenants interleave by weight.
- *Deadlines:* rows whose deadline passed leave at batch formation (and at ``push``) with
  DEADLINE_EXCEEDED, never run.
- *Limits at push:* unknown or removed tenant (NOT_FOUND), longer than the tenant's
  ``max_seq_len`` or outside the engine's limits (INVALID_ARGUMENT), a tenant's queue over
  ``max_queue`` (RESOURCE_EXHAUSTED). A call is all or nothing, and a batch's calls of a
  tenant are taken in order until the first that does not fit: it and the later ones are
  refused (a later call never overtakes a refused one; ``submit_many``, one call at a time,
  would still take a later, smaller one).
- *Parked* tenants (weights loading) keep their rows out of batches.
- *Triggers* (``due``): full, hungry, lazy timeout, the starvation guard, as
  ``itif.scheduler.triggers`` decides them. One difference: a row's arrival time is when the
  engine read it from its ring, between batches or, during one, at most every few ms
  (``itif.server.column_door``), so rows that came late in a batch look as if they came after
  it, and "hungry" (a row waited while the engine was busy) would not hold for them; they
  waited out ``max_wait_ms`` after a batch (2 of every 11 ms of a flood). So the first look
  after a batch counts every row it finds as hungry.

Cost: ``push`` and ``take`` make a fixed number of numpy calls over the queued rows, plus one
Python iteration for each tenant that a row did not fit the budget for in that batch (at most
the number of tenants, never the number of rows). ``due`` is one pass of numpy. Rows live in
growing column arrays (and their token ids in one flat arena) compacted, vectorised, when dead
rows outnumber live ones. Not thread-safe: one engine loop owns it.

The engine calls these for every batch of a few rows, where a numpy call's fixed cost (about a
microsecond) is the whole cost, so the common case is kept to few calls (bench/hostpath_cost.py
measures it): Python ints count the queue's rows and tokens, the oldest arrival and the next
deadline while they are exact; a push of rows that all pass checks its limits with one gather
and two reductions; a take that finds every queued row alive, none due to expire and all of
them within the budget (the queue drained by each batch, under a moderate load) reads the
columns by slices, skips the budget walk and starts the columns over, with nothing to mark
dead; ``due`` then decides from those counters without a numpy call. Otherwise each falls back
to the general path, which computes the same values (tests/test_hostpath_fastpaths.py).

Tenants are indices into a table that only grows (``add_tenant`` appends; ``remove_tenant``
marks the index dead, and it is never reused), so a front end's arrivals made with an older
version of the table still name the right tenants.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from itif.hostpath.columns import STATUS, Arrivals
from itif.scheduler.tickets import TenantQuota
from itif.scheduler.triggers import fire

__all__ = ["ColumnQueue", "Taken"]

OK, INVALID, NOT_FOUND, EXHAUSTED, EXPIRED = (STATUS.index(c) for c in (
    "OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"))

_ROW_COLS = (("call_id", np.int64), ("tenant", np.int32), ("start", np.int64),
             ("length", np.int64), ("deadline", np.float64), ("enqueued", np.float64),
             ("alive", np.bool_), ("key", np.int64))
_TENANT_COLS = (("weight", np.float64), ("max_queue", np.int64), ("max_seq_len", np.int64),
                ("_limit", np.int64), ("_half_target", np.float64),
                ("target_s", np.float64), ("tag", np.float64), ("depth", np.int64),
                ("live", np.bool_), ("parked", np.bool_), ("submitted", np.int64),
                ("rejected", np.int64), ("expired", np.int64), ("taken", np.int64),
                ("tokens_run", np.int64))
# the ufuncs' own reductions: a fraction of what the ndarray methods (.min(), .all()) cost
_MIN, _MAX, _ADD, _COUNT = np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.count_nonzero
_CUMSUM = np.add.accumulate


@dataclass
class Taken:
    """A formed batch, in the order the rows were chosen, and the rows that expired."""

    call_id: np.ndarray  # int64 [n]
    tenant: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n+1] into ids
    ids: np.ndarray  # int32
    enqueued: np.ndarray  # float64 [n]
    expired_call_id: np.ndarray  # int64: rows whose deadline passed (DEADLINE_EXCEEDED)
    expired_tenant: np.ndarray  # int32

    def __len__(self) -> int:
        return self.call_id.size


_NONE_I8, _NONE_I4 = np.zeros(0, np.int64), np.zeros(0, np.int32)


def _grow(a: np.ndarray, n: int) -> np.ndarray:
    if n <= a.size:
        return a
    out = np.zeros(max(n, 2 * a.size, 64), a.dtype)
    out[: a.size] = a
    return out


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the concatenated ranges ``[starts[i], starts[i] + lengths[i])``."""
    ends = _CUMSUM(lengths)
    total = int(ends[-1]) if ends.size else 0
    if total == 0:
        return _NONE_I8
    idx = (starts - (ends - lengths)).repeat(lengths)
    idx += np.arange(total)
    return idx


def _trim_tail(chosen: np.ndarray, t: np.ndarray, lengths: np.ndarray, start_tag: np.ndarray,
               cost: np.ndarray) -> np.ndarray:
    """``chosen`` (positions in start-tag order) less its run-ahead tail (the module
    docstring): the last rows, all of one tenant, that start at or after the finish tag of
    every other tenant's rows in the batch, when they hold more tokens than the rest."""
    tc = t[chosen]
    last = tc[-1]
    other = tc != last
    if not other.any():
        return chosen  # one tenant's batch
    finish = float(_MAX((start_tag[chosen] + cost[chosen])[other]))
    k = int(np.flatnonzero(other)[-1]) + 1  # the tail starts after the others' last row
    k += int(_COUNT(start_tag[chosen[k:]] < finish))
    cum = _CUMSUM(lengths[chosen])
    return chosen[:k] if 2 * int(cum[k - 1]) < int(cum[-1]) else chosen


class ColumnQueue:
    """Every tenant's queue as columns; ``push`` arrivals, ``take`` a batch (module docstring).

    ``max_len`` / ``vocab``: the engine's limits (the backbone's positions and vocabulary),
    checked at ``push`` so that a taken batch is valid for ``Engine.infer_columns`` as a whole.
    """

    def __init__(self, *, max_len: int | None = None, vocab: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_len, self.vocab, self._clock = max_len, vocab, clock
        self.names: list[str] = []
        self.version = 0
        self.vtime = 0.0
        self._parked_n = 0
        self._n = 0  # rows used in the row columns (alive or dead)
        self._live_rows = 0
        self._live_tokens = 0
        # the earliest deadline pushed since the last scan: a bound, exact while
        # ``_deadline_exact``; the oldest live row's arrival, None when not known
        self._next_deadline = math.inf
        self._deadline_exact = True
        self._oldest: float | None = math.inf
        self._end_seen = -math.inf  # the batch end ``due`` last saw
        self._arena = np.zeros(1 << 16, np.int32)
        self._arena_used = 0
        for name, dtype in _ROW_COLS:
            setattr(self, "_" + name, np.zeros(256, dtype))
        for name, dtype in _TENANT_COLS:
            setattr(self, name, np.zeros(0, dtype))
        self._limits()
        self.version = 0

    # ---- the tenant table ------------------------------------------------------------------
    def add_tenant(self, name: str, quota: TenantQuota | None = None) -> int:
        """Append a tenant (or change a live one's quota, or take back a removed one); its
        index."""
        quota = quota if quota is not None else TenantQuota()
        try:
            i = self.names.index(name)
        except ValueError:
            i = len(self.names)
            self.names.append(name)
            for col, _ in _TENANT_COLS:
                setattr(self, col, _grow(getattr(self, col), i + 1)[: i + 1])
            self.tag[i] = self.vtime
        self.weight[i] = quota.weight
        self.max_queue[i] = quota.max_queue
        self.max_seq_len[i] = quota.max_seq_len or 0
        # the longest row it takes: its own max_seq_len within the engine's positions
        self._limit[i] = min(quota.max_seq_len or 1 << 62, self.max_len or 1 << 62)
        self.target_s[i] = quota.latency_target_ms / 1000.0
        self._half_target[i] = self.target_s[i] / 2.0
        self.live[i] = True
        self._limits()
        return i

    def _limits(self) -> None:
        """What ``push`` and ``due`` check with one gather or none: the longest row each
        tenant takes as an unsigned cap (0 for a removed one and, at index T, for an index
        outside the table: ``length - 1 < cap`` holds for exactly the rows that fit), the
        smallest ``max_queue`` (a push that keeps the queue within it needs no per-tenant
        check) and the starvation guard's half target when every tenant has the same."""
        self._row_cap = np.append(np.where(self.live, self._limit, 0), 0).astype(np.uint64)
        self._queue_min = int(_MIN(self.max_queue)) if self.names else 0
        half = self._half_target
        self._half_const = (float(half[0]) if half.size and _COUNT(half != half[0]) == 0
                            else None)
        self.version += 1

    def remove_tenant(self, name: str) -> None:
        """Refuse the tenant's new rows (NOT_FOUND); what is queued still runs."""
        self.live[self.names.index(name)] = False
        self._limits()

    def park(self, name: str, parked: bool = True) -> None:
        """Hold a tenant's rows out of batches (``parked``) or let them back in at the
        virtual time."""
        i = self.names.index(name)
        if self.parked[i] and not parked:
            self.tag[i] = max(self.tag[i], self.vtime)
        self._parked_n += int(parked) - int(self.parked[i])
        self.parked[i] = parked

    @property
    def queued(self) -> int:
        return self._live_rows

    @property
    def next_deadline(self) -> float:
        """No queued row's deadline is earlier (a bound; ``inf``: none): before it,
        :meth:`expire` has nothing to drop."""
        return self._next_deadline

    def withdraw(self, call_ids: np.ndarray | None = None) -> np.ndarray:
        """Drop the queued rows of calls ``call_ids`` (their callers cancelled; None: every
        row, the engine stops); the dropped rows' call ids. Rows already taken run."""
        live = self._live()
        gone = live if call_ids is None else live[np.isin(self._call_id[live], call_ids)]
        call = self._call_id[gone]
        if gone.size:
            self._drop(gone, self._tenant[gone])
        return call

    # ---- in --------------------------------------------------------------------------------
    def push(self, a: Arrivals, now: float | None = None) -> np.ndarray:
        """Queue a batch of arrivals; the STATUS code of each row (OK: queued)."""
        now = self._clock() if now is None else now
        n, T = len(a), len(self.names)
        if n == 0 or T == 0:
            return np.full(n, NOT_FOUND, np.int8)
        t, ids = a.tenant, a.ids
        lengths = a.offsets[1:] - a.offsets[:-1]
        if lengths.dtype != np.int64:
            lengths = lengths.astype(np.int64)
        # a negative index wraps past T, where the cap is 0, as it is for a removed tenant
        fits = (lengths - 1).view(np.uint64) < self._row_cap.take(t.view(np.uint32),
                                                                   mode="clip")
        dmin = float(_MIN(a.deadline))
        if self.vocab is None or not ids.size:
            ids_ok = True
        elif ids.dtype == np.int32:  # a negative id is past the vocabulary as unsigned
            ids_ok = int(_MAX(ids.view(np.uint32))) < self.vocab
        else:
            ids_ok = int(_MIN(ids)) >= 0 and int(_MAX(ids)) < self.vocab
        if ids_ok and dmin > now and _COUNT(fits) == n:  # the common case
            got = np.bincount(t, minlength=T)
            if (self._live_rows + n <= self._queue_min
                    or not _COUNT(got > self.max_queue - self.depth)):
                self.submitted += got
                self._append(a, None, t, lengths, now, got, dmin)
                return np.zeros(n, np.int8)
        slot = np.minimum(t.view(np.uint32), T)
        known = slot < T
        if not known.all():
            t = np.where(known, t, 0)
        return self._push_slow(a, t, known, lengths, ids_ok, now)

    def _push_slow(self, a: Arrivals, t: np.ndarray, known: np.ndarray, lengths: np.ndarray,
                   ids_ok: bool, now: float) -> np.ndarray:
        """``push`` with refusals: each row's status, then the rows that fit."""
        n, T = len(a), len(self.names)
        status = np.zeros(n, np.int8)
        known = known & self.live[t]
        status[~known] = NOT_FOUND
        bad = known & ((lengths < 1) | (lengths > self._limit[t]))
        if not ids_ok:  # rows holding an id outside the vocabulary
            out = (a.ids < 0) | (a.ids >= self.vocab)
            bad[np.searchsorted(a.offsets, np.flatnonzero(out), side="right") - 1] = True
        status[bad & known] = INVALID
        status[(a.deadline <= now) & (status == OK)] = EXPIRED
        ok = status == OK
        # room: each tenant's OK rows, in arrival order, up to max_queue - depth
        order = np.argsort(np.where(ok, t, -1), kind="stable")
        ts = np.where(ok, t, -1)[order]
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n) - np.searchsorted(ts, ts, side="left")
        full = ok & (rank >= (self.max_queue - self.depth)[t])
        if full.any():  # a call is all or nothing
            full |= ok & np.isin(a.call_id, a.call_id[full])
            status[full] = EXHAUSTED
            ok &= ~full
        self.submitted += np.bincount(t[ok | (known & (status == EXPIRED))], minlength=T)
        self.rejected += np.bincount(t[known & (status == EXHAUSTED)], minlength=T)
        self.expired += np.bincount(t[known & (status == EXPIRED)], minlength=T)
        rows = np.flatnonzero(ok)
        if rows.size:
            self._append(a, rows, t[rows], lengths[rows], now,
                         np.bincount(t[rows], minlength=T))
        return status

    def _append(self, a: Arrivals, rows: np.ndarray | None, t: np.ndarray,
                lengths: np.ndarray, now: float, got: np.ndarray,
                dmin: float | None = None) -> None:
        """Append the arrivals' ``rows`` (None: all) of tenants ``t``; ``got``: rows a tenant;
        ``dmin``: their earliest deadline, when known."""
        k = len(a) if rows is None else rows.size
        if self._n + k > self._call_id.size:
            self._compact(self._n + k)
        src = a.ids if rows is None else a.ids[_segments(a.offsets[rows], lengths)]
        base = self._arena_used
        need = base + src.size
        if need > self._arena.size:
            self._compact(self._n + k, need)
            base = self._arena_used
            need = base + src.size
        self._arena[base:need] = src
        s = slice(self._n, self._n + k)
        if rows is None:
            self._start[s] = a.offsets[:-1]
            self._call_id[s] = a.call_id
            self._deadline[s] = a.deadline
            prio = a.priority
        else:
            _CUMSUM(lengths, out=self._start[s])
            self._start[s] -= lengths
            self._call_id[s] = a.call_id[rows]
            self._deadline[s] = a.deadline[rows]
            prio = a.priority[rows]
            dmin = float(_MIN(self._deadline[s]))
        if base:
            self._start[s] += base
        self._tenant[s] = t
        self._length[s] = lengths
        # the queue order as one sort key: tenant, then priority (higher first); a stable sort
        # of the rows (kept in arrival order) on it breaks the ties by arrival
        key = self._key[s]
        np.multiply(t, 256, out=key, dtype=np.int64)
        key -= prio
        self._enqueued[s] = now
        self._alive[s] = True
        self._arena_used = need
        self._next_deadline = min(self._next_deadline, dmin)
        if self._oldest is not None:
            self._oldest = min(self._oldest, float(now))
        idle = got > 0  # (re)activated: no credit for the idle time
        if self._live_rows:
            idle &= self.depth == 0
        np.maximum(self.tag, self.vtime, out=self.tag, where=idle)
        self.depth += got
        self._n += k
        self._live_rows += k
        self._live_tokens += need - base

    def _compact(self, rows_needed: int, arena_needed: int = 0) -> None:
        """Drop dead rows and their ids; size the columns for ``rows_needed`` rows and the
        arena for ``arena_needed`` ids (both counted before compaction), with room to grow."""
        live = np.flatnonzero(self._alive[: self._n])
        lengths = self._length[live].astype(np.int64)
        keep = self._arena[_segments(self._start[live], lengths)]
        rows = max(256, 2 * (live.size + max(rows_needed - self._n, 0)))
        for name, _ in _ROW_COLS:
            old = getattr(self, "_" + name)
            new = np.zeros(rows, old.dtype)
            new[: live.size] = old[live]
            setattr(self, "_" + name, new)
        self._start[: live.size] = _CUMSUM(lengths) - lengths
        ids = max(1 << 16, 2 * (keep.size + max(arena_needed - self._arena_used, 0)))
        self._arena = np.zeros(ids, np.int32)
        self._arena[: keep.size] = keep
        self._arena_used = keep.size
        self._n = live.size

    # ---- out -------------------------------------------------------------------------------
    def _live(self) -> np.ndarray:
        return self._alive[: self._n].nonzero()[0]

    def _drop(self, rows: np.ndarray, t: np.ndarray) -> None:
        self._alive[rows] = False
        self._live_rows -= rows.size
        self._live_tokens -= int(self._length[rows].sum())
        self._oldest = None
        self.depth -= np.bincount(t, minlength=len(self.names))
        if self._n > 2 * self._live_rows + 4096:
            self._compact(self._n)

    def _expire(self, live: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Drop the ``live`` rows whose deadline passed: (live rows left, their call ids,
        their tenants). ``_next_deadline`` (a bound: the earliest deadline pushed since the
        last scan) spares the scan until one may be due."""
        if now < self._next_deadline:
            return live, _NONE_I8, _NONE_I4
        deadlines = self._deadline[live]
        due = deadlines <= now
        later = deadlines[~due]
        self._next_deadline = float(later.min()) if later.size else math.inf
        self._deadline_exact = True
        if not due.any():
            return live, _NONE_I8, _NONE_I4
        gone = live[due]
        call, tenant = self._call_id[gone], self._tenant[gone]
        self.expired += np.bincount(tenant, minlength=len(self.names))
        self._drop(gone, tenant)
        return self._live(), call, tenant

    def expire(self, now: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Drop every queued row whose deadline passed: (call ids, tenants)."""
        now = self._clock() if now is None else now
        return self._expire(self._live(), now)[1:]

    def take(self, max_tokens: int, max_rows: int, now: float | None = None) -> Taken:
        """Form one batch (the module docstring's policy): the chosen rows' columns, copied
        out, and the rows that expired on the way."""
        now = self._clock() if now is None else now
        n = self._n
        if now < self._next_deadline and not self._parked_n and n == self._live_rows:
            live = None  # rows [0, n), all alive, none due: slices, not gathers
            exp_call, exp_tenant = _NONE_I8, _NONE_I4
        else:
            live, exp_call, exp_tenant = self._expire(self._live(), now)
            if live.size and self._parked_n:
                live = live[~self.parked[self._tenant[live]]]
            n = live.size
        if not n or max_rows < 1:
            return self._taken(_NONE_I8, _NONE_I4, _NONE_I8, exp_call, exp_tenant)
        if live is None:
            rows = self._key[:n].argsort(kind="stable")  # queue order (``_append``'s key)
        else:
            rows = live[self._key[live].argsort(kind="stable")]
        t = self._tenant[rows]
        lengths = self._length[rows]
        cost = lengths / self.weight[t]  # every row has at least one token (``push``)
        cum = _CUMSUM(cost)
        start_tag = cum - cost
        T = len(self.names)
        whole = live is None and n <= max_rows and self._live_tokens <= max_tokens
        if whole and t[0] == t[-1]:  # one tenant's rows, all of them: tag order is queue order
            return self._take_one(int(t[0]), rows, t, lengths, cum, start_tag)
        first = t.searchsorted(t)  # each row's tenant's first position
        start_tag += self.tag[t] - start_tag[first]  # tenant's tag + its earlier rows' cost
        # start-tag order; a stable sort keeps ties in (tenant, queue) order
        pick = start_tag.argsort(kind="stable")
        if whole:
            chosen = pick  # everything fits
        else:
            chosen = self._budget(pick, t, lengths, max_tokens, max_rows)
        tc, lc = t[chosen], lengths[chosen]  # a tail runs ahead only with over half the tokens
        if 2 * int(_ADD(lc, where=tc == tc[-1])) > int(_ADD(lc)):
            kept = _trim_tail(chosen, t, lengths, start_tag, cost)
            if kept.size < chosen.size:
                chosen, tc, lc = kept, tc[: kept.size], lc[: kept.size]
        got = rows[chosen]
        self.vtime = max(self.vtime, float(start_tag[chosen[-1]]))
        self.tag += np.bincount(tc, cost[chosen], T)
        n_t = np.bincount(tc, minlength=T)
        self.taken += n_t
        np.add(self.tokens_run, np.bincount(tc, lc, T), out=self.tokens_run, casting="unsafe")
        out = self._taken(got, tc, lc, exp_call, exp_tenant)
        if got.size == self._live_rows:
            return self._drained(out)
        self._alive[got] = False
        self._live_rows -= got.size
        self._live_tokens -= int(out.offsets[-1])
        self._deadline_exact, self._oldest = False, None
        self.depth -= n_t
        if self._n > 2 * self._live_rows + 4096:
            self._compact(self._n)
        return out

    def _take_one(self, i: int, rows: np.ndarray, t: np.ndarray, lengths: np.ndarray,
                  cum: np.ndarray, start_tag: np.ndarray) -> Taken:
        """``take`` of every queued row when they are all tenant ``i``'s: what the general
        path computes (the start tags are its tag plus the costs before them, so they keep
        the queue order; its tag grows by the costs' sum, accumulated in the same order),
        without the tag sort and the per-tenant bincounts."""
        start_tag += self.tag[i]
        self.vtime = max(self.vtime, float(start_tag[-1]))
        self.tag[i] += cum[-1]
        self.taken[i] += rows.size
        out = self._taken(rows, t, lengths, _NONE_I8, _NONE_I4)
        self.tokens_run[i] += int(out.offsets[-1])
        return self._drained(out)

    def _drained(self, out: Taken) -> Taken:
        """The queue is empty after ``out``: its columns start over (no row to mark dead)."""
        self._n = self._arena_used = self._live_rows = self._live_tokens = 0
        self._next_deadline, self._deadline_exact, self._oldest = math.inf, True, math.inf
        self.depth[:] = 0
        return out

    @staticmethod
    def _budget(pick: np.ndarray, t: np.ndarray, lengths: np.ndarray, max_tokens: int,
                max_rows: int) -> np.ndarray:
        """Positions (in ``pick`` order) that fit: walk the start-tag order taking every row
        that fits the rest of the budget; a row that does not excludes its tenant from the
        rest of this batch. One iteration per excluded tenant."""
        chosen: list[np.ndarray] = []
        used_tok = used_rows = 0
        pos = pick
        window = pos[:max_rows]
        cum = _CUMSUM(lengths[window])
        if cum[-1] <= max_tokens:  # the common case: everything up to max_rows fits
            return window
        while pos.size and used_rows < max_rows and (used_rows == 0 or used_tok < max_tokens):
            window = pos[: max_rows - used_rows]
            cum = used_tok + _CUMSUM(lengths[window])
            over = cum > max_tokens
            if used_rows == 0:
                over[0] = False  # the first row of a batch always fits
            k = int(np.argmax(over)) if over.any() else window.size
            if k:
                chosen.append(window[:k])
                used_rows += k
                used_tok = int(cum[k - 1])
            if k == window.size:
                break  # everything fit, or max_rows reached
            rest = pos[k + 1 :]
            pos = rest[t[rest] != t[window[k]]]
        if not chosen:
            return np.zeros(0, np.int64)
        return chosen[0] if len(chosen) == 1 else np.concatenate(chosen)

    def _taken(self, got: np.ndarray, tenant: np.ndarray, lengths: np.ndarray,
               exp_call: np.ndarray, exp_tenant: np.ndarray) -> Taken:
        """The rows ``got`` (of ``tenant`` and ``lengths``) copied out, in that order."""
        offsets = np.empty(got.size + 1, np.int64)
        offsets[0] = 0
        _CUMSUM(lengths, out=offsets[1:])
        total = int(offsets[-1])
        if total:
            idx = (self._start[got] - offsets[:-1]).repeat(lengths)
            idx += np.arange(total)
            ids = self._arena[idx]
        else:
            ids = _NONE_I4
        return Taken(self._call_id[got], tenant, offsets, ids, self._enqueued[got],
                     exp_call, exp_tenant)

    # ---- when a batch runs -----------------------------------------------------------------
    def due(self, now: float, *, max_tokens: int, max_rows: int, max_wait_ms: float,
            last_end: float, estimate_ms: Callable[[int, int], float],
            stopping: bool = False) -> tuple[bool, float | None]:
        """(run a batch now?, else when to look again): the triggers of
        ``itif.scheduler.triggers`` on the columns. From the counters alone while they are
        exact (no parked tenant, every tenant the same latency target). The first look after
        a batch ended (``last_end`` newer than at the last look) finds rows that arrived while
        it ran: hungry (the module docstring)."""
        if last_end > self._end_seen:
            self._end_seen = last_end
            if self._live_rows:
                last_end = now
        if not self._live_rows:
            return False, None
        half = self._half_const
        if self._parked_n or half is None or self._oldest is None or not self._deadline_exact:
            return self._due_scan(now, max_tokens, max_rows, max_wait_ms, last_end,
                                  estimate_ms, stopping)
        next_deadline = self._next_deadline if self._next_deadline < math.inf else None
        return fire(now, queued=self._live_rows, tokens=self._live_tokens, oldest=self._oldest,
                    guard=self._oldest + half, next_deadline=next_deadline, stopping=stopping,
                    max_batch_tokens=max_tokens, max_batch_size=max_rows,
                    max_wait_ms=max_wait_ms, last_end=last_end, estimate=estimate_ms)

    def _due_scan(self, now, max_tokens, max_rows, max_wait_ms, last_end, estimate_ms,
                  stopping) -> tuple[bool, float | None]:
        """``due`` over the live rows' columns (parked tenants, mixed targets, or counters
        not known since a partial batch)."""
        live = self._live()
        next_deadline = float(_MIN(self._deadline[live]))
        if not self._parked_n:
            self._next_deadline, self._deadline_exact = next_deadline, True
        if not math.isfinite(next_deadline):
            next_deadline = None
        if self._parked_n:
            live = live[~self.parked[self._tenant[live]]]
            if not live.size:
                return False, next_deadline
        enq = self._enqueued[live]
        oldest = float(_MIN(enq))
        if not self._parked_n:
            self._oldest = oldest
        # the tenants' guards at their oldest rows: the earliest is the rows' earliest
        guard = float(_MIN(enq + self._half_target[self._tenant[live]]))
        return fire(now, queued=live.size, tokens=int(self._length[live].sum()), oldest=oldest,
                    guard=guard, next_deadline=next_deadline, stopping=stopping,
                    max_batch_tokens=max_tokens, max_batch_size=max_rows,
                    max_wait_ms=max_wait_ms, last_end=last_end, estimate=estimate_ms)
