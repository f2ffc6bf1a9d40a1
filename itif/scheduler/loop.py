"""The :class:`Scheduler`: configuration, submission, lifecycle, and the batching loop that
runs ``run_batch`` (bisecting per-request errors). The policy is written in ``itif.scheduler``."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from itif import threadnames
from itif.config.fields import check
from itif.config.schema import SchedulerConfig
from itif.errors import (
    Busy,
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    ItifError,
    TenantNotFound,
    Unavailable,
    is_out_of_memory,
)
from itif.requests import Request, Result
from itif.scheduler.estimate import BatchTimeEstimate, split_for_latency
from itif.scheduler.fairqueue import FairQueue
from itif.scheduler.outcomes import PER_REQUEST_ERRORS, by_tenant, count, wrap
from itif.scheduler.sources import ColumnSource
from itif.scheduler.tickets import (
    DONE,
    QUEUED,
    InternalError,
    SchedulerStats,
    SchedulerTicket,
    TenantQuota,
    TenantStats,
    clone,
)
from itif.scheduler.triggers import decide
from itif.scheduler.wakeup import Wakeup

log = logging.getLogger("itif.scheduler")


__all__ = ["Scheduler"]



class Scheduler:
    """Per-tenant bounded queues, one batching loop, one ``run_batch`` (see ``itif.scheduler``)."""

    def __init__(
        self,
        run_batch: Callable[[list[Request]], list[Result]],
        *,
        max_batch_tokens: int = SchedulerConfig.max_batch_tokens,
        max_batch_size: int = SchedulerConfig.max_batch_size,
        max_wait_ms: float = SchedulerConfig.max_wait_ms,
        estimate_ms: Callable[[int, int], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        isolate_tenants: bool = SchedulerConfig.isolate_tenants,
        latency_sizing: bool = SchedulerConfig.latency_sizing,
    ) -> None:
        self._run_batch = run_batch
        #: Each batch holds one tenant's requests only (the per-tenant baseline of itif bench).
        self.isolate_tenants = bool(isolate_tenants)
        #: Batches sized by latency (see "How big a batch" in ``itif.scheduler``).
        self.latency_sizing = bool(latency_sizing)
        self._estimate_fn = estimate_ms
        self._clock = clock
        self._lock = threading.Lock()
        self._wakeup = Wakeup(self._lock)  # how the loop sleeps (``itif.scheduler.wakeup``)
        self.max_batch_tokens = 0
        self.max_batch_size = 0
        self.max_wait_ms = 0.0
        self.configure(max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
                       max_wait_ms=max_wait_ms)
        self._q = FairQueue()
        self._seq = 0
        self._inflight: list[SchedulerTicket] = []
        self._last_end = -math.inf
        self._learned = BatchTimeEstimate()  # fixed + per request + per token, from runs
        self._batches = 0
        self._runs = 0
        self._requests_run = 0
        self._tokens_run = 0
        self._last_size = 0
        self._last_tokens = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._grace_end = math.inf
        #: A second source of batches run on this loop's thread (``attach_columns``).
        self._columns: ColumnSource | None = None
        self._column_turn = False  # both due: which goes first, alternating
        self._column_due = False

    @classmethod
    def from_config(cls, run_batch: Callable[[list[Request]], list[Result]], scheduler: Any,
                    tenants: Iterable[Any] = (), **kw: Any) -> Scheduler:
        """From ``itif.config.SchedulerConfig`` and ``config.Tenant`` objects."""
        s = cls(run_batch, max_batch_tokens=scheduler.max_batch_tokens,
                max_batch_size=scheduler.max_batch_size, max_wait_ms=scheduler.max_wait_ms,
                isolate_tenants=getattr(scheduler, "isolate_tenants", False),
                latency_sizing=getattr(scheduler, "latency_sizing", False), **kw)
        for t in tenants:
            s.set_tenant(t.id, TenantQuota.from_tenant(t))
        return s

    # ---- configuration ---------------------------------------------------------------------
    def configure(self, *, max_batch_tokens: int | None = None, max_batch_size: int | None = None,
                  max_wait_ms: float | None = None, isolate_tenants: bool | None = None,
                  latency_sizing: bool | None = None) -> None:
        """Change batch limits live (a config reload); applies from the next batch. The limits
        are those of ``itif.config.SchedulerConfig`` (InvalidConfig outside them)."""
        with self._lock:
            if max_batch_tokens is not None:
                self.max_batch_tokens = check(SchedulerConfig, "max_batch_tokens",
                                              max_batch_tokens)
            if max_batch_size is not None:
                self.max_batch_size = check(SchedulerConfig, "max_batch_size", max_batch_size)
            if max_wait_ms is not None:
                self.max_wait_ms = check(SchedulerConfig, "max_wait_ms", max_wait_ms)
            if isolate_tenants is not None:
                self.isolate_tenants = bool(isolate_tenants)
            if latency_sizing is not None:
                self.latency_sizing = bool(latency_sizing)
            self._wakeup.notify()

    def set_tenant(self, tenant: str, quota: TenantQuota | None = None) -> None:
        """Add a tenant or change its quota live (a smaller max_queue only refuses new requests;
        a removed tenant still draining is taken back)."""
        quota = quota if quota is not None else TenantQuota()
        if not isinstance(quota, TenantQuota):
            raise TypeError(f"quota must be a TenantQuota, got {type(quota).__name__}")
        with self._lock:
            self._q.set_tenant(tenant, quota)
            self._wakeup.notify()

    def remove_tenant(self, tenant: str) -> None:
        """Refuse the tenant's new submissions (TenantNotFound); what is already queued or running
        still runs. Its counters stay in ``stats``."""
        with self._lock:
            self._q.remove_tenant(tenant)

    def park(self, tenant: str, parked: bool = True) -> None:
        """Hold (``parked``) or release a tenant's queued and future requests: a parked
        tenant's requests are accepted and queued as usual (limits, deadlines, cancel) but no
        batch takes them until it is unparked (``itif.weights.tiers``: its weights are being
        loaded). O(1); batches of other tenants are not held up."""
        with self._lock:
            self._q.park(tenant, parked)
            if not parked:
                self._wakeup.notify()

    def fail_parked(self, tenant: str, error: BaseException) -> int:
        """Fail every queued request of a parked tenant with (a copy of) ``error``; returns
        how many (its weights could not be loaded)."""
        with self._lock:
            tq = self._q.tenants.get(tenant)
            if tq is None or not tq.parked:
                return 0
            left = tq.queued()
            for t in left:
                self._q.dequeue(t)
        for t in left:
            self._complete(t, None, clone(error))
        return len(left)

    def tenants(self) -> list[str]:
        with self._lock:
            return [n for n, tq in self._q.tenants.items() if not tq.removed]

    def outstanding(self, tenant: str) -> int:
        """The tenant's accepted requests not finished yet (queued or running); O(1), where
        ``stats`` copies every tenant's counters."""
        with self._lock:
            st = self._q.stats.get(tenant)
            n = 0 if st is None else (st.submitted - st.completed - st.failed - st.expired
                                      - st.cancelled)
            cols = self._columns
        return n + (cols.outstanding(tenant) if cols is not None else 0)

    def queue_depth(self, tenant: str) -> int:
        """Requests of the tenant waiting (not running); 0 for a tenant the scheduler lacks."""
        with self._lock:
            tq = self._q.tenants.get(tenant)
            depth = tq.depth if tq is not None else 0
            cols = self._columns
        return depth + (cols.queue_depth(tenant) if cols is not None else 0)

    @property
    def stats(self) -> SchedulerStats:
        with self._lock:
            q = self._q
            tenants = {}
            for name, st in q.stats.items():
                tq = q.tenants.get(name)
                tenants[name] = replace(st, queued=tq.depth if tq is not None else 0)
            return SchedulerStats(
                tenants=tenants, batches=self._batches, runs=self._runs,
                requests_run=self._requests_run, tokens_run=self._tokens_run,
                last_batch_size=self._last_size, last_batch_tokens=self._last_tokens,
                batch_time=self._learned.parts, queued=q.queued,
                queued_tokens=q.queued_tokens)

    @property
    def in_batch(self) -> bool:
        """Whether a batch runs now (a lockless hint: the tiers' loader waits for the gaps)."""
        return bool(self._inflight)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ---- submission ------------------------------------------------------------------------
    def submit(self, request: Request, *, tokens: int, deadline: float | None = None,
               priority: int = 0) -> SchedulerTicket:
        """Queue one request; never blocks. ``tokens`` is its length (for the batch token
        budget), ``deadline`` an absolute ``clock()`` time, ``priority`` orders requests within
        the tenant (higher first). Raises Busy (queue full), TenantNotFound, InvalidRequest
        (longer than the tenant's max_seq_len) or Unavailable (stopped)."""
        return self.submit_many([request], tokens=[tokens], deadline=deadline, priority=priority)[0]

    def submit_many(self, requests: Sequence[Request], *, tokens: Sequence[int],
                    deadline: float | None = None, priority: int = 0) -> list[SchedulerTicket]:
        """Queue several requests all-or-nothing (a batch RPC): if any tenant's queue cannot take
        all of its requests, Busy is raised and nothing is queued."""
        requests = list(requests)
        tokens = [count(n, f"request {i}: tokens") for i, n in enumerate(tokens)]
        if len(tokens) != len(requests):
            raise InvalidRequest(f"tokens has {len(tokens)} entries for {len(requests)} requests")
        if any(n < 0 for n in tokens):
            raise InvalidRequest(f"tokens must be >= 0, got {min(tokens)}")
        priority = count(priority, "priority")
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise InvalidRequest(f"deadline must be a clock() time in seconds, got {deadline!r}")
        expired: list[SchedulerTicket] = []
        with self._lock:
            q = self._q
            if self._stopping:
                raise Unavailable("the scheduler is shutting down; not accepting requests")
            want: dict[str, int] = {}
            for i, r in enumerate(requests):
                tq = q.live(r.tenant)
                if tq is None:
                    raise TenantNotFound(f"tenant {r.tenant!r} not found")
                limit = tq.quota.max_seq_len
                if limit is not None and tokens[i] > limit:
                    raise InvalidRequest(
                        f"request {i}: length {tokens[i]} exceeds tenant {r.tenant!r}'s "
                        f"max_seq_len {limit}")
                want[r.tenant] = want.get(r.tenant, 0) + 1
            for name, n in want.items():
                tq = q.tenants[name]
                tq.quota.refuse_call(name, n)
                if tq.depth + n > tq.quota.max_queue:
                    for nm, k in want.items():
                        q.stats[nm].rejected += k
                    what = "a request" if len(requests) == 1 else f"{n} requests"
                    raise Busy(
                        f"tenant {name!r} queue is full ({tq.depth} queued, max_queue="
                        f"{tq.quota.max_queue}); cannot take {what}, retry later")
            now = self._clock()
            tickets = []
            for r, n in zip(requests, tokens):
                self._seq += 1
                t = SchedulerTicket(self, q.tenants[r.tenant], r, n, priority, deadline,
                                    self._seq, now)
                tickets.append(t)
                q.stats[r.tenant].submitted += 1
                if deadline is not None and deadline <= now:
                    t.mark(DONE)
                    q.stats[r.tenant].expired += 1
                    expired.append(t)
                    continue
                q.push(t)
            if len(tickets) > len(expired):
                self._wakeup.notify()
        for t in expired:
            self._complete(t, None, self._deadline_error(t, now), count=False)
        return tickets

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Scheduler:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("scheduler already started")
            if self._stopping:
                raise RuntimeError("scheduler was stopped; make a new one")
            self._wakeup.open()
            self._thread = threading.Thread(target=self._loop, name="itif-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new requests (Unavailable); let queued and in-flight ones finish for up to
        ``grace_s``; then fail what is left with Unavailable and join the loop thread."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._grace_end = self._clock() + max(0.0, grace_s)
            self._wakeup.notify()
            thread = self._thread
            grace_end = self._grace_end
        own = thread is threading.current_thread()
        if thread is not None and not own:
            # The loop drains back to back and exits when the queue is empty or the grace is
            # over, so past the grace it can only be stuck inside run_batch.
            thread.join(max(0.0, grace_end - self._clock()))
        # Whatever is left (never started, or run_batch stuck past the grace): fail it.
        with self._lock:
            left = self._q.take_all() + [t for t in self._inflight if t.state != DONE]
        err = Unavailable("the scheduler shut down before the request finished")
        for t in left:
            self._complete(t, None, clone(err))
        if thread is not None and not own and thread.is_alive():
            thread.join(0.1)
            if thread.is_alive():
                log.warning("scheduler thread still inside run_batch after the %.1f s grace; "
                            "its requests were failed with UNAVAILABLE", grace_s)

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- a second source of batches (``itif.scheduler.sources``) ---------------------------
    def attach_columns(self, source: ColumnSource | None) -> None:
        """Also run ``source``'s batches, on this loop's thread (the engine has one caller)."""
        with self._lock:
            self._columns = source
            self._wakeup.notify()

    def wake(self) -> None:
        """Look for work now."""
        with self._lock:
            self._wakeup.notify()

    # ---- ticket hooks ----------------------------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        """The lock that guards the queues and every ticket's state (tickets take it to add
        their done callbacks)."""
        return self._lock

    def now(self) -> float:
        """The scheduler's clock (monotonic seconds, or the one given for tests)."""
        return self._clock()

    def cancel(self, t: SchedulerTicket) -> bool:
        """Withdraw a queued ticket (``SchedulerTicket.cancel``): True, or False once it runs."""
        with self._lock:
            if t.state != QUEUED:
                return False
            self._q.dequeue(t)
            self._q.stats[t.tenant].cancelled += 1
        self._complete(t, None, Cancelled(f"request of tenant {t.tenant!r} was cancelled"),
                       count=False)
        return True

    def expire(self, t: SchedulerTicket) -> None:
        """Fail a queued ticket whose deadline passed (``SchedulerTicket.result`` saw it)."""
        with self._lock:
            if t.state != QUEUED:
                return
            self._q.dequeue(t)
            self._q.stats[t.tenant].expired += 1
            now = self._clock()
        self._complete(t, None, self._deadline_error(t, now), count=False)

    def _deadline_error(self, t: SchedulerTicket, now: float) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"request of tenant {t.tenant!r}: deadline passed after "
            f"{(now - t.enqueued_at) * 1e3:.0f} ms in the queue, before it could run")

    # ---- decisions (lock held) -------------------------------------------------------------
    def _estimate_locked(self, n: int, tokens: int) -> float:
        if self._estimate_fn is not None:
            try:
                return float(self._estimate_fn(n, tokens))
            except Exception:
                log.exception("estimate_ms(%d, %d) failed; using the learned estimate", n, tokens)
        return self._learned(n, tokens)

    def _decide_locked(self, now: float) -> tuple[bool, float | None]:
        """(run a batch now?, else when to look again): ``itif.scheduler.triggers``."""
        return decide(self._q, now, stopping=self._stopping,
                      max_batch_tokens=self.max_batch_tokens, max_batch_size=self.max_batch_size,
                      max_wait_ms=self.max_wait_ms, last_end=self._last_end,
                      estimate=self._estimate_locked)

    def _form_locked(self, now: float
                     ) -> tuple[list[SchedulerTicket], list[tuple[SchedulerTicket, BaseException]]]:
        """The next batch: ``FairQueue.form`` with this scheduler's limits."""
        sizing = self.latency_sizing and not self._stopping
        return self._q.form(now, max_tokens=self.max_batch_tokens, max_size=self.max_batch_size,
                            isolate=self.isolate_tenants,
                            estimate=self._estimate_locked if sizing else None,
                            error=self._deadline_error)

    # ---- the loop --------------------------------------------------------------------------
    def _next(self) -> tuple[list[SchedulerTicket], list[tuple[SchedulerTicket, BaseException]],
                             bool, list[SchedulerTicket]]:
        """Block until there is something to do: (batch to run, tickets to fail, exit?, tickets
        the shutdown fails). The first are counted where they were dropped (expired); the
        last are counted as failed when failed, as ``stop`` counts those it takes."""
        with self._lock:
            while True:
                now = self._clock()
                dropped = self._q.expire_due(now, self._deadline_error)
                cols = self._columns
                if self._stopping and ((self._q.queued == 0 and not (cols and cols.pending()))
                                       or now >= self._grace_end):
                    return [], dropped, True, self._q.take_all()
                if dropped:
                    return [], dropped, False, []
                run, wake = self._decide_locked(now)
                if cols is not None and (not run or self._column_turn):
                    crun, cwake = cols.decide(now, last_end=self._last_end,
                                              estimate_ms=self._estimate_locked,
                                              stopping=self._stopping)
                    if crun:
                        self._column_turn = False
                        self._column_due = True
                        return [], [], False, []
                    if cwake is not None:
                        wake = cwake if wake is None else min(wake, cwake)
                if run:
                    self._column_turn = cols is not None
                    batch, dropped = self._form_locked(now)
                    self._inflight = batch
                    return batch, dropped, False, []
                timeout = None if wake is None else min(1.0, max(0.0, wake - now))
                if self._stopping:  # parked requests may be all that is left: the grace ends it
                    timeout = min(1.0 if timeout is None else timeout,
                                  max(0.0, self._grace_end - now))
                self._wakeup.sleep(timeout, self._columns)

    def _loop(self) -> None:
        threadnames.adopt()
        try:
            self._serve()
        finally:
            with self._lock:
                self._wakeup.close()

    def _serve(self) -> None:
        while True:
            batch: list[SchedulerTicket] = []
            try:
                batch, dropped, exit_, shut = self._next()
                for t, err in dropped:
                    self._complete(t, None, err, count=False)
                err = Unavailable("the scheduler shut down before the request could run")
                for t in shut:
                    self._complete(t, None, clone(err))
                if batch:
                    cols = self._columns  # it takes arrivals in meanwhile (refusals at once)
                    if cols is not None:
                        cols.forwarding(True)
                    try:
                        self._execute(batch)
                    finally:
                        if cols is not None:
                            cols.forwarding(False)
                if self._column_due:
                    self._column_due = False
                    self._run_columns()
                if exit_:
                    if self._columns is not None:
                        self._columns.stopped()
                    return
            except BaseException as e:  # the loop must never die
                log.exception("scheduler loop error; continuing")
                err = InternalError(f"scheduler error: {type(e).__name__}: {e}")
                for t in batch:
                    if t.state != DONE:
                        self._complete(t, None, clone(err))
                time.sleep(0.01)
            finally:
                with self._lock:
                    self._inflight = []

    def _run_columns(self) -> None:
        """One batch of the column source; its time teaches the estimate like any batch."""
        start, shape = time.perf_counter(), None
        try:
            shape = self._columns.run()
        finally:
            with self._lock:
                self._last_end = self._clock()
                if shape:
                    self._batches += 1
                    self._runs += 1
                    self._requests_run += shape[0]
                    self._tokens_run += shape[1]
                    self._learned.observe(*shape, (time.perf_counter() - start) * 1000.0)

    def _execute(self, batch: list[SchedulerTicket]) -> None:
        """Run one batch (bisecting per-request errors) and deliver every ticket."""
        n = len(batch)
        tokens = sum(t.tokens for t in batch)
        with self._lock:
            self._batches += 1
            self._requests_run += n
            self._tokens_run += tokens
            self._last_size, self._last_tokens = n, tokens
            for t in batch:
                self._q.stats[t.tenant].tokens_run += t.tokens
        extra_left = 4 * math.ceil(math.log2(n)) if n > 1 else 0
        stack = [batch]
        if self.latency_sizing and n > 1:  # short members first when long ones hold them back
            by_len = sorted(batch, key=lambda t: t.tokens)
            with self._lock:
                k = split_for_latency([t.tokens for t in by_len], self._estimate_locked)
            if k is not None:
                stack = [by_len[k:], by_len[:k]]  # the short part runs first
        try:
            while stack:
                part = stack.pop()
                out = self._call(part)
                if not isinstance(out, BaseException):
                    for t, r in zip(part, out):
                        self._complete(t, r, None)
                    continue
                per_request = isinstance(out, PER_REQUEST_ERRORS)
                if per_request and len(part) > 1 and extra_left >= 2:
                    extra_left -= 2
                    mid = len(part) // 2
                    stack.append(part[mid:])
                    stack.append(part[:mid])  # left half runs first
                    continue
                # past bisection's budget, and on out-of-memory (once: a part of one tenant is
                # not split again), each tenant's part runs alone: one tenant's error, or rows
                # that do not fit, never reach another's tickets
                if (per_request or is_out_of_memory(out)) and len(part) > 1:
                    groups = by_tenant(part)
                    if len(groups) > 1:
                        stack.extend(reversed(groups))
                        continue
                err = wrap(out, part)
                for t in part:
                    self._complete(t, None, clone(err))
        finally:
            with self._lock:
                self._last_end = self._clock()

    def _call(self, part: list[SchedulerTicket]) -> list[Result] | BaseException:
        """One run_batch call; its results, or the exception it raised."""
        requests = [t.request for t in part]
        start = time.perf_counter()
        try:
            results = self._run_batch(requests)
        except BaseException as e:
            with self._lock:
                self._runs += 1
            if not isinstance(e, ItifError):
                log.warning("run_batch failed for %d requests (%d tokens; tenants %s): %s: %s",
                            len(part), sum(t.tokens for t in part),
                            sorted({t.tenant for t in part}), type(e).__name__, e)
            return e
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        with self._lock:
            self._runs += 1
            self._learned.observe(len(part), sum(t.tokens for t in part), elapsed_ms)
        try:
            results = list(results)
        except Exception as e:
            return InternalError(f"run_batch returned {type(results).__name__}, not a list: {e}")
        if len(results) != len(part):
            return InternalError(
                f"run_batch returned {len(results)} results for {len(part)} requests")
        return results

    def _complete(self, t: SchedulerTicket, result: Result | None, error: BaseException | None,
                  count: bool = True) -> bool:
        """Finish a ticket once (first writer wins); callbacks run outside the lock.
        ``count``: bump completed/failed (the other outcomes were counted by the caller)."""
        now = self._clock()
        with self._lock:
            if t.settled:
                return False
            if count:
                st = self._q.stats.setdefault(t.tenant, TenantStats())
                if error is None:
                    st.completed += 1
                else:
                    st.failed += 1
            callbacks = t.settle(result, error, now)
        t.wake(callbacks)
        return True

