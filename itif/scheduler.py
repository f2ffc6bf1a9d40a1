"""The scheduler: per-tenant bounded queues in front of ONE fused engine.

    sched = Scheduler(engine.infer, max_batch_tokens=8192, max_batch_size=256, max_wait_ms=5)
    sched.set_tenant("acme", TenantQuota(max_queue=64, weight=2.0, latency_target_ms=100))
    sched.start()
    ticket = sched.submit(Request("acme", input_ids=ids), tokens=len(ids), deadline=now + 0.5)
    result = ticket.result()          # raises the request's typed error (itif.errors)
    sched.stop(grace_s=10)

One background thread forms batches from every tenant's queue and calls ``run_batch`` (normally
``Engine.infer``), so requests of many tenants run in one fused forward. Python work is per
request (heap pushes/pops), never per token.

When a batch runs (the triggers; TurboTransformers' "hungry" and "lazy" strategies)
-----------------------------------------------------------------------------------
The loop is the only caller of ``run_batch``, so the engine is idle exactly when the loop is
deciding. With queued work it runs a batch now when any of these holds:

1. *full*: the queued work fills a batch (``max_batch_tokens`` or ``max_batch_size``);
2. *hungry*: the oldest queued request arrived while the engine was busy (it has already waited a
   whole batch; waiting longer buys nothing) -- under load batches run back to back;
3. *lazy timeout*: the oldest queued request has waited ``max_wait_ms`` (a request reaching an
   idle engine waits at most that long for company);
4. *starvation guard*: for some tenant, its oldest request's wait plus the estimated run time of
   the next batch reaches half its ``latency_target_ms``;
5. the scheduler is stopping (drain as fast as possible).

Otherwise it sleeps until the earliest of those times, the next deadline, or a new submission.

How big a batch (latency sizing)
--------------------------------
A fused batch costs more the more it holds, and every member waits for all of it. With
``latency_sizing`` (off by default until the serving sweep shows it pays) a batch stops growing at the first request whose addition would
make a member miss its tenant's ``latency_target_ms`` that it would still meet in the batch as
formed so far (predicted with the run-time estimate). Members already past their target do not
hold a batch back: under overload batches still grow to the limits, which is what throughput
needs. Off, batches grow to ``max_batch_tokens`` / ``max_batch_size``.

Which requests (weighted fairness)
----------------------------------
Start-time fair queueing over tenants, counted in tokens: every tenant has a virtual tag; a
batch repeatedly takes the head request of the tenant with the smallest tag and advances that
tag by ``tokens / weight``. A tenant whose queue was empty restarts at the system virtual time
(the tag of the last request taken), so idling banks no credit and a quiet tenant's new request
has the smallest tag: it goes into the very next batch however hard another tenant floods.
Backlogged tenants are served tokens in proportion to their weights. A head request that does
not fit the rest of the token budget leaves its tenant out of *this* batch only (it keeps the
smallest tag, so it is first in the next one); the first request of a batch always fits, even
when it alone exceeds ``max_batch_tokens``. Within a tenant: higher ``priority`` first, then
FIFO. Requests whose deadline passed are failed with :class:`DeadlineExceeded` and never run;
cancelled ones are skipped.

Failures
--------
If ``run_batch`` raises for a batch, a per-request error (:class:`InvalidRequest`,
:class:`TenantNotFound`, :class:`NoWeights`) is isolated by bisection: the halves run again, so
only the bad requests fail (one bad request among n costs at most 2*ceil(log2 n) extra runs; the
budget is twice that, past it a still-failing part fails as a whole). Other typed errors fail the
batch as they are; out-of-memory becomes :class:`OutOfMemory` (RESOURCE_EXHAUSTED) and anything
else :class:`InternalError` (INTERNAL). The loop logs and carries on; it never dies.
"""

from __future__ import annotations

import copy
import heapq
import logging
import math
import operator
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from itif.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidConfig,
    InvalidRequest,
    ItifError,
    NoWeights,
    Overloaded,
    TenantNotFound,
    Unavailable,
)
from itif.runtime.engine import Request, Result

log = logging.getLogger("itif.scheduler")

__all__ = [
    "InternalError",
    "OutOfMemory",
    "Scheduler",
    "SchedulerStats",
    "TenantQuota",
    "TenantStats",
    "Ticket",
]


class InternalError(ItifError):
    """An unexpected failure while running a batch (a bug, not the caller's fault)."""

    code = "INTERNAL"


class OutOfMemory(Overloaded):
    """The device ran out of memory running the request's batch; the request may be retried."""

    code = "RESOURCE_EXHAUSTED"


#: Errors that belong to one request, not to the whole batch: isolated by bisection.
_PER_REQUEST_ERRORS = (InvalidRequest, TenantNotFound, NoWeights)
_REQUEST_PREFIX = re.compile(r"^request \d+: ")

# Ticket states
_QUEUED, _RUNNING, _DONE = 0, 1, 2


# ------------------------------------------------------------------------------------------------
# Public value types
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's share of the scheduler (the scheduling fields of ``config.Tenant``)."""

    max_queue: int = 64
    weight: float = 1.0
    latency_target_ms: float = 100.0
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        q = self.max_queue
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise InvalidConfig(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        w = self.weight
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise InvalidConfig(f"weight must be a finite number > 0, got {self.weight!r}")
        t = self.latency_target_ms
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise InvalidConfig(f"latency_target_ms must be a finite number > 0, got {t!r}")
        m = self.max_seq_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InvalidConfig(f"max_seq_len must be an integer >= 1 or None, got {m!r}")

    @classmethod
    def from_tenant(cls, tenant: Any) -> TenantQuota:
        """From an ``itif.config.Tenant`` (or anything with the same attributes)."""
        return cls(max_queue=tenant.max_queue, weight=tenant.weight,
                   latency_target_ms=tenant.latency_target_ms, max_seq_len=tenant.max_seq_len)


@dataclass
class TenantStats:
    """Per-tenant counters. Every accepted request ends in exactly one of completed, failed,
    expired or cancelled (``submitted`` minus those four is what is queued or running)."""

    submitted: int = 0  # accepted into the queue
    completed: int = 0  # ran and returned a result
    failed: int = 0  # ran (or was shut down) and got an error
    rejected: int = 0  # refused at submit with Overloaded (queue full)
    expired: int = 0  # deadline passed while queued; never ran
    cancelled: int = 0  # cancelled while queued; never ran
    tokens_run: int = 0  # tokens of this tenant handed to run_batch (first run of each request)
    queued: int = 0  # queue depth at the time of the snapshot


@dataclass
class SchedulerStats:
    """A consistent snapshot (``Scheduler.stats``); safe to read from any thread."""

    tenants: dict[str, TenantStats] = field(default_factory=dict)
    batches: int = 0  # batches formed and run
    runs: int = 0  # calls of run_batch (batches plus bisection re-runs)
    requests_run: int = 0
    tokens_run: int = 0
    last_batch_size: int = 0
    last_batch_tokens: int = 0
    ms_per_token: float = 0.0  # learned EWMA (successful runs)
    queued: int = 0
    queued_tokens: int = 0


# ------------------------------------------------------------------------------------------------
# Ticket: one request's future
# ------------------------------------------------------------------------------------------------


class Ticket:
    """The future of one submitted request.

    ``result()`` returns the :class:`Result` or raises the request's typed error. If the request's
    deadline passes while it is still queued, a waiter in ``result()`` fails it right away (even
    while the engine is busy with another batch); once running it finishes normally.
    """

    __slots__ = (
        "request", "tenant", "tokens", "priority", "deadline", "seq",
        "enqueued_at", "started_at", "finished_at",
        "_sched", "_tq", "_state", "_result", "_error", "_event", "_callbacks",
    )

    def __init__(self, sched: Scheduler, tq: _TenantQ | None, request: Request, tokens: int,
                 priority: int, deadline: float | None, seq: int, now: float) -> None:
        self.request = request
        self.tenant = request.tenant
        self.tokens = tokens
        self.priority = priority
        self.deadline = deadline
        self.seq = seq
        self.enqueued_at = now
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._sched = sched
        self._tq = tq
        self._state = _QUEUED
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[Ticket], Any]] | None = []

    # -- future API ------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def cancelled(self) -> bool:
        return self._event.is_set() and isinstance(self._error, Cancelled)

    def cancel(self) -> bool:
        """Withdraw the request if it is still queued (then it never runs): True. False once it
        is running or done."""
        return self._sched._cancel(self)

    def _wait(self, timeout: float | None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        while not self._event.is_set():
            waits = []
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"request of tenant {self.tenant!r} not done after {timeout} s")
                waits.append(left)
            if self.deadline is not None and self._state == _QUEUED:
                left = self.deadline - self._sched._clock()
                if left <= 0:
                    self._sched._expire_one(self)
                    continue
                waits.append(left)
            self._event.wait(min(waits) if waits else None)

    def result(self, timeout: float | None = None) -> Result:
        """Block until done; the Result, or raise its error (``TimeoutError`` after timeout s)."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Ticket], Any]) -> None:
        """Call ``fn(ticket)`` when done (at once, on this thread, if it already is). Callbacks run
        on the thread that finishes the ticket (usually the scheduler's) and must be quick;
        exceptions are logged."""
        with self._sched._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    # -- timings (metrics) -----------------------------------------------------------------------
    @property
    def queued_ms(self) -> float:
        """Time spent queued: submit to batch start (or to the end, if it never ran)."""
        end = self.started_at if self.started_at is not None else self.finished_at
        if end is None:
            end = self._sched._clock()
        return max(0.0, (end - self.enqueued_at) * 1000.0)

    @property
    def compute_ms(self) -> float | None:
        """Batch start to result (including any bisection re-runs); None if it never ran."""
        if self.started_at is None:
            return None
        end = self.finished_at if self.finished_at is not None else self._sched._clock()
        return max(0.0, (end - self.started_at) * 1000.0)

    def __repr__(self) -> str:
        state = {_QUEUED: "queued", _RUNNING: "running", _DONE: "done"}[self._state]
        return f"<Ticket {self.tenant!r} #{self.seq} {state}>"


def _call_back(fn: Callable[[Ticket], Any], ticket: Ticket) -> None:
    try:
        fn(ticket)
    except Exception:
        log.exception("done callback of a request of tenant %r failed", ticket.tenant)


# ------------------------------------------------------------------------------------------------
# Per-tenant queue
# ------------------------------------------------------------------------------------------------


class _TenantQ:
    """A tenant's queue: a heap by (-priority, seq) to take from, a FIFO deque to find the oldest.
    Entries that left out of order (cancelled, expired, taken by priority) are dropped lazily and
    both containers are compacted when they hold more than twice the live entries."""

    __slots__ = ("name", "quota", "order", "heap", "fifo", "depth", "tag", "removed")

    def __init__(self, name: str, quota: TenantQuota, order: int, tag: float) -> None:
        self.name = name
        self.quota = quota
        self.order = order
        self.heap: list[tuple[int, int, Ticket]] = []
        self.fifo: deque[Ticket] = deque()
        self.depth = 0
        self.tag = tag
        self.removed = False

    def push(self, t: Ticket) -> None:
        heapq.heappush(self.heap, (-t.priority, t.seq, t))
        self.fifo.append(t)
        self.depth += 1

    def head(self) -> Ticket | None:
        heap = self.heap
        while heap and heap[0][2]._state != _QUEUED:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def oldest(self) -> Ticket | None:
        fifo = self.fifo
        while fifo and fifo[0]._state != _QUEUED:
            fifo.popleft()
        return fifo[0] if fifo else None

    def left(self, t: Ticket) -> None:
        """``t`` (queued until now) left the queue; the caller already changed its state."""
        self.depth -= 1
        if len(self.heap) > 2 * self.depth + 32:
            self.heap = [e for e in self.heap if e[2]._state == _QUEUED]
            heapq.heapify(self.heap)
        if len(self.fifo) > 2 * self.depth + 32:
            self.fifo = deque(x for x in self.fifo if x._state == _QUEUED)

    def queued(self) -> list[Ticket]:
        return [e[2] for e in self.heap if e[2]._state == _QUEUED]


# ------------------------------------------------------------------------------------------------
# Scheduler
# ------------------------------------------------------------------------------------------------


class Scheduler:
    """Per-tenant bounded queues, one batching loop, one ``run_batch`` (see the module doc)."""

    #: Prior of the learned cost (ms per token) before any batch ran.
    PRIOR_MS_PER_TOKEN = 0.01
    EWMA_ALPHA = 0.2

    def __init__(
        self,
        run_batch: Callable[[list[Request]], list[Result]],
        *,
        max_batch_tokens: int = 8192,
        max_batch_size: int = 256,
        max_wait_ms: float = 5.0,
        estimate_ms: Callable[[int, int], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        isolate_tenants: bool = False,
        latency_sizing: bool = False,
    ) -> None:
        self._run_batch = run_batch
        #: Each batch holds one tenant's requests only (the per-tenant baseline of itif bench).
        self.isolate_tenants = bool(isolate_tenants)
        #: Batches sized by latency (see "How big a batch" in the module doc).
        self.latency_sizing = bool(latency_sizing)
        self._estimate_fn = estimate_ms
        self._clock = clock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.max_batch_tokens = 0
        self.max_batch_size = 0
        self.max_wait_ms = 0.0
        self.configure(max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
                       max_wait_ms=max_wait_ms)
        self._tenants: dict[str, _TenantQ] = {}
        self._stats: dict[str, TenantStats] = {}
        self._order = 0
        self._seq = 0
        self._vtime = 0.0
        self._queued = 0
        self._queued_tokens = 0
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._inflight: list[Ticket] = []
        self._last_end = -math.inf
        self._ms_per_token = self.PRIOR_MS_PER_TOKEN
        self._batches = 0
        self._runs = 0
        self._requests_run = 0
        self._tokens_run = 0
        self._last_size = 0
        self._last_tokens = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._grace_end = math.inf

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
        """Change batch limits live (a config reload); applies from the next batch."""
        def positive_int(name: str, v: Any) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidConfig(f"{name} must be an integer >= 1, got {v!r}")
            return v

        with self._lock:
            if max_batch_tokens is not None:
                self.max_batch_tokens = positive_int("max_batch_tokens", max_batch_tokens)
            if max_batch_size is not None:
                self.max_batch_size = positive_int("max_batch_size", max_batch_size)
            if max_wait_ms is not None:
                if not (isinstance(max_wait_ms, (int, float)) and math.isfinite(max_wait_ms)
                        and max_wait_ms >= 0):
                    raise InvalidConfig(
                        f"max_wait_ms must be a finite number >= 0, got {max_wait_ms!r}")
                self.max_wait_ms = float(max_wait_ms)
            if isolate_tenants is not None:
                self.isolate_tenants = bool(isolate_tenants)
            if latency_sizing is not None:
                self.latency_sizing = bool(latency_sizing)
            self._cv.notify_all()

    def set_tenant(self, tenant: str, quota: TenantQuota | None = None) -> None:
        """Add a tenant or change its quota live (a smaller max_queue only refuses new requests;
        a removed tenant still draining is taken back)."""
        quota = quota if quota is not None else TenantQuota()
        if not isinstance(quota, TenantQuota):
            raise TypeError(f"quota must be a TenantQuota, got {type(quota).__name__}")
        with self._lock:
            tq = self._tenants.get(tenant)
            if tq is None:
                self._order += 1
                self._tenants[tenant] = _TenantQ(tenant, quota, self._order, self._vtime)
            else:
                tq.quota = quota
                tq.removed = False
            self._stats.setdefault(tenant, TenantStats())
            self._cv.notify_all()

    def remove_tenant(self, tenant: str) -> None:
        """Refuse the tenant's new submissions (TenantNotFound); what is already queued or running
        still runs. Its counters stay in ``stats``."""
        with self._lock:
            tq = self._tenants.get(tenant)
            if tq is None or tq.removed:
                raise TenantNotFound(f"tenant {tenant!r} not found")
            tq.removed = True
            if tq.depth == 0:
                del self._tenants[tenant]

    def tenants(self) -> list[str]:
        with self._lock:
            return [n for n, tq in self._tenants.items() if not tq.removed]

    def queue_depth(self, tenant: str) -> int:
        """Requests of the tenant waiting (not running); 0 for a tenant the scheduler lacks."""
        with self._lock:
            tq = self._tenants.get(tenant)
            return tq.depth if tq is not None else 0

    @property
    def stats(self) -> SchedulerStats:
        with self._lock:
            tenants = {}
            for name, st in self._stats.items():
                tq = self._tenants.get(name)
                tenants[name] = replace(st, queued=tq.depth if tq is not None else 0)
            return SchedulerStats(
                tenants=tenants, batches=self._batches, runs=self._runs,
                requests_run=self._requests_run, tokens_run=self._tokens_run,
                last_batch_size=self._last_size, last_batch_tokens=self._last_tokens,
                ms_per_token=self._ms_per_token, queued=self._queued,
                queued_tokens=self._queued_tokens)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ---- submission ------------------------------------------------------------------------
    def submit(self, request: Request, *, tokens: int, deadline: float | None = None,
               priority: int = 0) -> Ticket:
        """Queue one request; never blocks. ``tokens`` is its length (for the batch token
        budget), ``deadline`` an absolute ``clock()`` time, ``priority`` orders requests within
        the tenant (higher first). Raises Overloaded (queue full), TenantNotFound, InvalidRequest
        (longer than the tenant's max_seq_len) or Unavailable (stopped)."""
        return self.submit_many([request], tokens=[tokens], deadline=deadline, priority=priority)[0]

    def submit_many(self, requests: Sequence[Request], *, tokens: Sequence[int],
                    deadline: float | None = None, priority: int = 0) -> list[Ticket]:
        """Queue several requests all-or-nothing (a batch RPC): if any tenant's queue cannot take
        all of its requests, Overloaded is raised and nothing is queued."""
        requests = list(requests)
        tokens = [_count(n, f"request {i}: tokens") for i, n in enumerate(tokens)]
        if len(tokens) != len(requests):
            raise InvalidRequest(f"tokens has {len(tokens)} entries for {len(requests)} requests")
        if any(n < 0 for n in tokens):
            raise InvalidRequest(f"tokens must be >= 0, got {min(tokens)}")
        priority = _count(priority, "priority")
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise InvalidRequest(f"deadline must be a clock() time in seconds, got {deadline!r}")
        expired: list[Ticket] = []
        with self._lock:
            if self._stopping:
                raise Unavailable("the scheduler is shutting down; not accepting requests")
            want: dict[str, int] = {}
            for i, r in enumerate(requests):
                tq = self._tenants.get(r.tenant)
                if tq is None or tq.removed:
                    raise TenantNotFound(f"tenant {r.tenant!r} not found")
                limit = tq.quota.max_seq_len
                if limit is not None and tokens[i] > limit:
                    raise InvalidRequest(
                        f"request {i}: length {tokens[i]} exceeds tenant {r.tenant!r}'s "
                        f"max_seq_len {limit}")
                want[r.tenant] = want.get(r.tenant, 0) + 1
            for name, n in want.items():
                tq = self._tenants[name]
                if tq.depth + n > tq.quota.max_queue:
                    for nm, k in want.items():
                        self._stats[nm].rejected += k
                    what = "a request" if len(requests) == 1 else f"{n} requests"
                    raise Overloaded(
                        f"tenant {name!r} queue is full ({tq.depth} queued, max_queue="
                        f"{tq.quota.max_queue}); cannot take {what}, retry later")
            now = self._clock()
            tickets = []
            for r, n in zip(requests, tokens):
                tq = self._tenants[r.tenant]
                self._seq += 1
                t = Ticket(self, tq, r, n, priority, deadline, self._seq, now)
                tickets.append(t)
                self._stats[r.tenant].submitted += 1
                if deadline is not None and deadline <= now:
                    t._state = _DONE
                    self._stats[r.tenant].expired += 1
                    expired.append(t)
                    continue
                if tq.depth == 0:  # (re)activated: no credit for the idle time
                    tq.tag = max(tq.tag, self._vtime)
                tq.push(t)
                self._queued += 1
                self._queued_tokens += n
                if deadline is not None:
                    heapq.heappush(self._deadlines, (deadline, t.seq, t))
            if len(tickets) > len(expired):
                self._cv.notify_all()
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
            self._cv.notify_all()
            thread = self._thread
            grace_end = self._grace_end
        own = thread is threading.current_thread()
        if thread is not None and not own:
            # The loop drains back to back and exits when the queue is empty or the grace is
            # over, so past the grace it can only be stuck inside run_batch.
            thread.join(max(0.0, grace_end - self._clock()))
        # Whatever is left (never started, or run_batch stuck past the grace): fail it.
        with self._lock:
            left = self._take_all_queued_locked() + [t for t in self._inflight if t._state != _DONE]
        err = Unavailable("the scheduler shut down before the request finished")
        for t in left:
            self._complete(t, None, _clone(err))
        if thread is not None and not own and thread.is_alive():
            thread.join(0.1)
            if thread.is_alive():
                log.warning("scheduler thread still inside run_batch after the %.1f s grace; "
                            "its requests were failed with UNAVAILABLE", grace_s)

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- ticket hooks ----------------------------------------------------------------------
    def _cancel(self, t: Ticket) -> bool:
        with self._lock:
            if t._state != _QUEUED:
                return False
            self._dequeue_locked(t)
            self._stats[t.tenant].cancelled += 1
        self._complete(t, None, Cancelled(f"request of tenant {t.tenant!r} was cancelled"),
                       count=False)
        return True

    def _expire_one(self, t: Ticket) -> None:
        with self._lock:
            if t._state != _QUEUED:
                return
            self._dequeue_locked(t)
            self._stats[t.tenant].expired += 1
            now = self._clock()
        self._complete(t, None, self._deadline_error(t, now), count=False)

    def _deadline_error(self, t: Ticket, now: float) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"request of tenant {t.tenant!r}: deadline passed after "
            f"{(now - t.enqueued_at) * 1e3:.0f} ms in the queue, before it could run")

    # ---- internals (lock held) -------------------------------------------------------------
    def _dequeue_locked(self, t: Ticket) -> None:
        """A queued ticket leaves the queue without running (cancel, expiry, shutdown)."""
        t._state = _DONE
        self._queued -= 1
        self._queued_tokens -= t.tokens
        tq = t._tq
        tq.left(t)
        if tq.removed and tq.depth == 0 and self._tenants.get(tq.name) is tq:
            del self._tenants[tq.name]
        if len(self._deadlines) > 2 * self._queued + 64:
            self._deadlines = [e for e in self._deadlines if e[2]._state == _QUEUED]
            heapq.heapify(self._deadlines)

    def _take_all_queued_locked(self) -> list[Ticket]:
        out = []
        for tq in list(self._tenants.values()):
            for t in tq.queued():
                self._dequeue_locked(t)
                out.append(t)
        return out

    def _expire_due_locked(self, now: float) -> list[tuple[Ticket, BaseException]]:
        out = []
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, _, t = heapq.heappop(dl)
            if t._state == _QUEUED:
                self._dequeue_locked(t)
                self._stats[t.tenant].expired += 1
                out.append((t, self._deadline_error(t, now)))
        return out

    def _estimate_locked(self, n: int, tokens: int) -> float:
        if self._estimate_fn is not None:
            try:
                return float(self._estimate_fn(n, tokens))
            except Exception:
                log.exception("estimate_ms(%d, %d) failed; using the learned estimate", n, tokens)
        return self._ms_per_token * tokens

    def _decide_locked(self, now: float) -> tuple[bool, float | None]:
        """(run a batch now?, else when to look again). Implements the module doc's triggers."""
        next_deadline = self._deadlines[0][0] if self._deadlines else None
        if self._queued == 0:
            return False, next_deadline
        if self._stopping:
            return True, None
        if self._queued_tokens >= self.max_batch_tokens or self._queued >= self.max_batch_size:
            return True, None  # full
        est_s = self._estimate_locked(min(self._queued, self.max_batch_size),
                                      min(self._queued_tokens, self.max_batch_tokens)) / 1000.0
        wake = math.inf
        oldest_all = math.inf
        for tq in self._tenants.values():
            if tq.depth == 0:
                continue
            o = tq.oldest()
            if o is None:
                continue
            oldest_all = min(oldest_all, o.enqueued_at)
            guard_at = o.enqueued_at + tq.quota.latency_target_ms / 2000.0 - est_s
            if now >= guard_at:
                return True, None  # starvation guard
            wake = min(wake, guard_at)
        if oldest_all <= self._last_end:
            return True, None  # hungry: it waited while the engine was busy
        lazy_at = oldest_all + self.max_wait_ms / 1000.0
        if now >= lazy_at:
            return True, None  # lazy timeout
        wake = min(wake, lazy_at)
        if next_deadline is not None:
            wake = min(wake, next_deadline)
        return False, wake

    def _form_locked(self, now: float) -> tuple[list[Ticket], list[tuple[Ticket, BaseException]]]:
        """Weighted fair batch formation (start-time fair queueing in tokens)."""
        batch: list[Ticket] = []
        dropped: list[tuple[Ticket, BaseException]] = []
        budget, size = self.max_batch_tokens, self.max_batch_size
        heap = [(tq.tag, tq.order, tq) for tq in self._tenants.values() if tq.depth > 0]
        heapq.heapify(heap)
        tokens = 0
        # Latency sizing: the smallest slack (time left to its tenant's latency target) of the
        # members that still meet their target in the batch as formed so far.
        sizing = self.latency_sizing and not self._stopping
        feasible_slack = math.inf
        slacks: list[float] = []  # min-heap of the members' slacks that still meet their target
        while heap and len(batch) < size:
            _, _, tq = heapq.heappop(heap)
            t = tq.head()
            while t is not None and t.deadline is not None and t.deadline <= now:
                heapq.heappop(tq.heap)
                self._dequeue_locked(t)
                self._stats[t.tenant].expired += 1
                dropped.append((t, self._deadline_error(t, now)))
                t = tq.head()
            if t is None:
                continue
            if batch and tokens + t.tokens > budget:
                continue  # this tenant sits out this batch; it keeps the smallest tag
            grown = None
            if sizing and batch:
                grown = self._estimate_locked(len(batch) + 1, tokens + t.tokens) / 1000.0
                if grown > feasible_slack:
                    break  # t would make a member miss a target it can still meet: stop here
            heapq.heappop(tq.heap)
            t._state = _RUNNING
            t.started_at = now
            self._queued -= 1
            self._queued_tokens -= t.tokens
            tq.left(t)
            batch.append(t)
            tokens += t.tokens
            if sizing:  # est only grows with the batch, so the feasible set only shrinks
                est = grown if grown is not None else (
                    self._estimate_locked(len(batch), tokens) / 1000.0)
                heapq.heappush(slacks, t.enqueued_at + tq.quota.latency_target_ms / 1000.0 - now)
                while slacks and slacks[0] < est:
                    heapq.heappop(slacks)
                feasible_slack = slacks[0] if slacks else math.inf
            self._vtime = max(self._vtime, tq.tag)
            tq.tag += max(t.tokens, 1) / tq.quota.weight
            if self.isolate_tenants:  # the rest of this batch comes from this tenant only
                heap = [(tq.tag, tq.order, tq)] if tq.depth > 0 else []
            elif tq.depth > 0:
                heapq.heappush(heap, (tq.tag, tq.order, tq))
        for tq in [tq for tq in self._tenants.values() if tq.removed and tq.depth == 0]:
            del self._tenants[tq.name]
        return batch, dropped

    # ---- the loop --------------------------------------------------------------------------
    def _next(self) -> tuple[list[Ticket], list[tuple[Ticket, BaseException]], bool]:
        """Block until there is something to do: (batch to run, tickets to fail, exit?)."""
        with self._cv:
            while True:
                now = self._clock()
                dropped = self._expire_due_locked(now)
                if self._stopping and (self._queued == 0 or now >= self._grace_end):
                    err = Unavailable("the scheduler shut down before the request could run")
                    dropped += [(t, _clone(err)) for t in self._take_all_queued_locked()]
                    return [], dropped, True
                if dropped:
                    return [], dropped, False
                run, wake = self._decide_locked(now)
                if run:
                    batch, dropped = self._form_locked(now)
                    self._inflight = batch
                    return batch, dropped, False
                timeout = None if wake is None else min(1.0, max(0.0, wake - now))
                self._cv.wait(timeout)

    def _loop(self) -> None:
        while True:
            batch: list[Ticket] = []
            try:
                batch, dropped, exit_ = self._next()
                for t, err in dropped:
                    self._complete(t, None, err, count=False)
                if batch:
                    self._execute(batch)
                if exit_:
                    return
            except BaseException as e:  # the loop must never die
                log.exception("scheduler loop error; continuing")
                err = InternalError(f"scheduler error: {type(e).__name__}: {e}")
                for t in batch:
                    if t._state != _DONE:
                        self._complete(t, None, _clone(err))
                time.sleep(0.01)
            finally:
                with self._lock:
                    self._inflight = []

    def _execute(self, batch: list[Ticket]) -> None:
        """Run one batch (bisecting per-request errors) and deliver every ticket."""
        n = len(batch)
        tokens = sum(t.tokens for t in batch)
        with self._lock:
            self._batches += 1
            self._requests_run += n
            self._tokens_run += tokens
            self._last_size, self._last_tokens = n, tokens
            for t in batch:
                self._stats[t.tenant].tokens_run += t.tokens
        extra_left = 4 * math.ceil(math.log2(n)) if n > 1 else 0
        stack = [batch]
        try:
            while stack:
                part = stack.pop()
                out = self._call(part)
                if not isinstance(out, BaseException):
                    for t, r in zip(part, out):
                        self._complete(t, r, None)
                    continue
                if isinstance(out, _PER_REQUEST_ERRORS) and len(part) > 1 and extra_left >= 2:
                    extra_left -= 2
                    mid = len(part) // 2
                    stack.append(part[mid:])
                    stack.append(part[:mid])  # left half runs first
                    continue
                err = _wrap(out, part)
                for t in part:
                    self._complete(t, None, _clone(err))
        finally:
            with self._lock:
                self._last_end = self._clock()

    def _call(self, part: list[Ticket]) -> list[Result] | BaseException:
        """One run_batch call; its results, or the exception it raised."""
        requests = [t.request for t in part]
        start = time.perf_counter()
        try:
            results = self._run_batch(requests)
        except BaseException as e:
            with self._lock:
                self._runs += 1
            if not isinstance(e, ItifError):
                log.warning("run_batch failed for %d requests: %s: %s", len(part),
                            type(e).__name__, e)
            return e
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        with self._lock:
            self._runs += 1
            tokens = sum(t.tokens for t in part)
            if tokens > 0:
                a = self.EWMA_ALPHA
                self._ms_per_token = (1 - a) * self._ms_per_token + a * (elapsed_ms / tokens)
        try:
            results = list(results)
        except Exception as e:
            return InternalError(f"run_batch returned {type(results).__name__}, not a list: {e}")
        if len(results) != len(part):
            return InternalError(
                f"run_batch returned {len(results)} results for {len(part)} requests")
        return results

    def _complete(self, t: Ticket, result: Result | None, error: BaseException | None,
                  count: bool = True) -> bool:
        """Finish a ticket once (first writer wins); callbacks run outside the lock.
        ``count``: bump completed/failed (the other outcomes were counted by the caller)."""
        now = self._clock()
        with self._lock:
            if t._event.is_set() or t._callbacks is None:
                return False
            if count:
                st = self._stats.setdefault(t.tenant, TenantStats())
                if error is None:
                    st.completed += 1
                else:
                    st.failed += 1
            t._state = _DONE
            t._result = result
            t._error = error
            t.finished_at = now
            callbacks, t._callbacks = t._callbacks, None
        t._event.set()
        for fn in callbacks:
            _call_back(fn, t)
        return True


def _count(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise InvalidRequest(f"{what} must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise InvalidRequest(f"{what} must be an integer, got {v!r}") from None


def _wrap(exc: BaseException, part: list[Ticket]) -> ItifError:
    """The typed error every ticket of a failed (sub-)batch gets."""
    if isinstance(exc, ItifError):
        if len(part) == 1 and isinstance(exc, InvalidRequest) and exc.args:
            msg = _REQUEST_PREFIX.sub("", str(exc.args[0]))  # "request 0:" means nothing to it
            try:
                new = type(exc)(msg)
                new.__cause__ = exc.__cause__
                return new
            except Exception:
                return exc
        return exc
    tokens = sum(t.tokens for t in part)
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        err: ItifError = OutOfMemory(
            f"out of memory running a batch of {len(part)} requests ({tokens} tokens): {exc}")
    else:
        err = InternalError(f"batch of {len(part)} requests failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _clone(err: BaseException) -> BaseException:
    """A per-ticket copy, so concurrent ``raise`` in many waiters do not share a traceback."""
    try:
        c = copy.copy(err)
        c.__cause__ = err.__cause__
        c.__traceback__ = None
        return c
    except Exception:
        return err
