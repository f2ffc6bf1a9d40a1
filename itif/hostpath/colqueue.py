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
  ``itif.scheduler.triggers`` decides them.

Cost: ``push`` and ``take`` make a fixed number of numpy calls over the queued rows, plus one
Python iteration for each tenant that a row did not fit the budget for in that batch (at most
the number of tenants, never the number of rows). ``due`` is one pass of numpy. Rows live in
growing column arrays (and their token ids in one flat arena) compacted, vectorised, when dead
rows outnumber live ones. Not thread-safe: one engine loop owns it.

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

__all__ = ["ColumnQueue", "Taken"]

OK, INVALID, NOT_FOUND, EXHAUSTED, EXPIRED = (STATUS.index(c) for c in (
    "OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"))

_ROW_COLS = (("call_id", np.int64), ("tenant", np.int32), ("start", np.int64),
             ("length", np.int64), ("deadline", np.float64), ("priority", np.int8),
             ("seq", np.int64), ("enqueued", np.float64), ("alive", np.bool_),
             ("key", np.int64))
_TENANT_COLS = (("weight", np.float64), ("max_queue", np.int64), ("max_seq_len", np.int64),
                ("_limit", np.int64),
                ("target_s", np.float64), ("tag", np.float64), ("depth", np.int64),
                ("live", np.bool_), ("parked", np.bool_), ("submitted", np.int64),
                ("rejected", np.int64), ("expired", np.int64), ("taken", np.int64),
                ("tokens_run", np.int64))


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
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    if total == 0:
        return _NONE_I8
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


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
        self._next_deadline = math.inf
        self._parked_n = 0
        self._n = 0  # rows used in the row columns (alive or dead)
        self._live_rows = 0
        self._next_seq = 0
        self._arena = np.zeros(1 << 16, np.int32)
        self._arena_used = 0
        for name, dtype in _ROW_COLS:
            setattr(self, "_" + name, np.zeros(256, dtype))
        for name, dtype in _TENANT_COLS:
            setattr(self, name, np.zeros(0, dtype))

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
        self.live[i] = True
        self._limits()
        return i

    def _limits(self) -> None:
        """The longest row each tenant takes, -1 for a removed one, and -1 at index T for an
        index outside the table: ``push`` checks a row with one gather."""
        self._row_limit = np.append(np.where(self.live, self._limit, -1), -1)
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

    # ---- in --------------------------------------------------------------------------------
    def push(self, a: Arrivals, now: float | None = None) -> np.ndarray:
        """Queue a batch of arrivals; the STATUS code of each row (OK: queued)."""
        now = self._clock() if now is None else now
        n, T = len(a), len(self.names)
        if n == 0 or T == 0:
            return np.full(n, NOT_FOUND, np.int8)
        t = a.tenant
        slot = np.minimum(t.view(np.uint32), T)  # a negative index wraps past T
        lengths = a.offsets[1:] - a.offsets[:-1]
        good = (lengths >= 1) & (lengths <= self._row_limit[slot]) & (a.deadline > now)
        ids_ok = (not a.ids.size or self.vocab is None
                  or (a.ids.min() >= 0 and a.ids.max() < self.vocab))
        if ids_ok and good.all():  # the common case: a few numpy calls for the whole batch
            got = np.bincount(t, minlength=T)
            if (got <= self.max_queue - self.depth).all():
                self.submitted += got
                self._append(a, None, t, lengths, now, got)
                return np.zeros(n, np.int8)
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
                lengths: np.ndarray, now: float, got: np.ndarray) -> None:
        """Append the arrivals' ``rows`` (None: all) of tenants ``t``; ``got``: rows a tenant."""
        k = len(a) if rows is None else rows.size
        if self._n + k > self._call_id.size:
            self._compact(self._n + k)
        src = a.ids if rows is None else a.ids[_segments(a.offsets[rows], lengths)]
        need = self._arena_used + src.size
        if need > self._arena.size:
            self._compact(self._n + k, need)
            need = self._arena_used + src.size
        self._arena[self._arena_used : need] = src
        s = slice(self._n, self._n + k)
        if rows is None:
            self._start[s] = a.offsets[:-1]
            self._start[s] += self._arena_used
            self._call_id[s] = a.call_id
            self._deadline[s] = a.deadline
            self._priority[s] = a.priority
        else:
            np.cumsum(lengths, out=self._start[s])
            self._start[s] += self._arena_used - lengths
            self._call_id[s] = a.call_id[rows]
            self._deadline[s] = a.deadline[rows]
            self._priority[s] = a.priority[rows]
        self._arena_used = need
        self._tenant[s] = t
        self._length[s] = lengths
        seq = self._seq[s]
        seq[:] = np.arange(self._next_seq, self._next_seq + k)
        # the queue order as one sort key: tenant, then priority (higher first), then arrival
        key = self._key[s]
        np.left_shift(t, 48, out=key, dtype=np.int64, casting="unsafe")
        key |= (127 - self._priority[s].astype(np.int64)) << 40
        key |= seq & ((1 << 40) - 1)
        self._enqueued[s] = now
        self._alive[s] = True
        self._next_deadline = min(self._next_deadline, float(a.deadline[rows].min()
                                                             if rows is not None
                                                             else a.deadline.min()))
        self._next_seq += k
        self._n += k
        self._live_rows += k
        woke = (got > 0) & (self.depth == 0)  # (re)activated: no credit for the idle time
        self.tag[woke] = np.maximum(self.tag[woke], self.vtime)
        self.depth += got

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
        self._start[: live.size] = np.cumsum(lengths) - lengths
        ids = max(1 << 16, 2 * (keep.size + max(arena_needed - self._arena_used, 0)))
        self._arena = np.zeros(ids, np.int32)
        self._arena[: keep.size] = keep
        self._arena_used = keep.size
        self._n = live.size

    # ---- out -------------------------------------------------------------------------------
    def _live(self) -> np.ndarray:
        return np.flatnonzero(self._alive[: self._n])

    def _drop(self, rows: np.ndarray, t: np.ndarray) -> None:
        self._alive[rows] = False
        self._live_rows -= rows.size
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
        live, exp_call, exp_tenant = self._expire(self._live(), now)
        if live.size and self._parked_n:
            live = live[~self.parked[self._tenant[live]]]
        if not live.size or max_rows < 1:
            return self._taken(_NONE_I8, _NONE_I4, exp_call, exp_tenant)
        rows = live[np.argsort(self._key[live])]  # queue order (``_append``'s key)
        t = self._tenant[rows]
        lengths = self._length[rows]
        cost = np.maximum(lengths, 1) / self.weight[t]
        cum = np.cumsum(cost)
        first = np.searchsorted(t, t, side="left")  # each row's tenant's first position
        start_tag = cum - cost
        start_tag += self.tag[t] - start_tag[first]  # tenant's tag + its earlier rows' cost
        # start-tag order; a stable sort keeps ties in (tenant, queue) order
        pick = np.argsort(start_tag, kind="stable")
        chosen = self._budget(pick, t, lengths, max_tokens, max_rows)
        got, tc = rows[chosen], t[chosen]
        T = len(self.names)
        self.vtime = max(self.vtime, float(start_tag[chosen[-1]]))
        self.tag += np.bincount(tc, weights=cost[chosen], minlength=T)
        n_t = np.bincount(tc, minlength=T)
        self.taken += n_t
        self.tokens_run += np.bincount(tc, weights=lengths[chosen], minlength=T).astype(np.int64)
        out = self._taken(got, tc, exp_call, exp_tenant)
        self._alive[got] = False
        self._live_rows -= got.size
        self.depth -= n_t
        if self._n > 2 * self._live_rows + 4096:
            self._compact(self._n)
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
        cum = np.cumsum(lengths[window])
        if cum[-1] <= max_tokens:  # the common case: everything up to max_rows fits
            return window
        while pos.size and used_rows < max_rows and (used_rows == 0 or used_tok < max_tokens):
            window = pos[: max_rows - used_rows]
            cum = used_tok + np.cumsum(lengths[window])
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

    def _taken(self, rows: np.ndarray, tenant: np.ndarray, exp_call: np.ndarray,
               exp_tenant: np.ndarray) -> Taken:
        lengths = self._length[rows]
        offsets = np.zeros(rows.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = self._arena[_segments(self._start[rows], lengths)]
        return Taken(self._call_id[rows], tenant, offsets, ids, self._enqueued[rows],
                     exp_call, exp_tenant)

    # ---- when a batch runs -----------------------------------------------------------------
    def due(self, now: float, *, max_tokens: int, max_rows: int, max_wait_ms: float,
            last_end: float, estimate_ms: Callable[[int, int], float],
            stopping: bool = False) -> tuple[bool, float | None]:
        """(run a batch now?, else when to look again): the triggers of
        ``itif.scheduler.triggers`` on the columns."""
        live = self._live()
        next_deadline = float(self._deadline[live].min()) if live.size else None
        if next_deadline is not None and not math.isfinite(next_deadline):
            next_deadline = None
        if live.size:
            live = live[~self.parked[self._tenant[live]]]
        if not live.size:
            return False, next_deadline
        if stopping:
            return True, None
        queued, tokens = live.size, int(self._length[live].sum())
        if tokens >= max_tokens or queued >= max_rows:
            return True, None  # full
        est_s = estimate_ms(min(queued, max_rows), min(tokens, max_tokens)) / 1000.0
        t = self._tenant[live]
        oldest = np.full(len(self.names), np.inf)
        np.minimum.at(oldest, t, self._enqueued[live])
        busy = np.isfinite(oldest)
        guard_at = oldest[busy] + self.target_s[busy] / 2.0 - est_s
        if (now >= guard_at).any():
            return True, None  # starvation guard
        oldest_all = float(oldest[busy].min())
        if oldest_all <= last_end:
            return True, None  # hungry
        lazy_at = oldest_all + max_wait_ms / 1000.0
        if now >= lazy_at:
            return True, None  # lazy timeout
        wake = min(float(guard_at.min()), lazy_at)
        if next_deadline is not None:
            wake = min(wake, next_deadline)
        return False, wake
