"""The scheduler's value types and the future of one request (:class:`SchedulerTicket`)."""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from itif.config.fields import check
from itif.config.schema import Tenant
from itif.errors import Busy, Cancelled, InvalidRequest, ItifError
from itif.requests import Request, Result

if TYPE_CHECKING:  # pragma: no cover
    from itif.scheduler.fairqueue import TenantQueue
    from itif.scheduler.loop import Scheduler

log = logging.getLogger("itif.scheduler")

__all__ = [
    "InternalError",
    "OutOfMemory",
    "SchedulerStats",
    "TenantQuota",
    "TenantStats",
    "SchedulerTicket",
]


class InternalError(ItifError):
    """An unexpected failure while running a batch (a bug, not the caller's fault)."""

    code = "INTERNAL"


class OutOfMemory(Busy):
    """The device ran out of memory running the request's batch; the request may be retried."""

    code = "RESOURCE_EXHAUSTED"


# SchedulerTicket states
QUEUED, RUNNING, DONE = 0, 1, 2


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's share of the scheduler: the scheduling fields of ``config.Tenant``, with its
    defaults and limits (one definition, in ``itif.config.schema``)."""

    max_queue: int = Tenant.max_queue
    weight: float = Tenant.weight
    latency_target_ms: float = Tenant.latency_target_ms
    max_seq_len: int | None = Tenant.max_seq_len

    def __post_init__(self) -> None:
        for name in ("max_queue", "weight", "latency_target_ms", "max_seq_len"):
            check(Tenant, name, getattr(self, name))

    def refuse_call(self, tenant: str, n: int) -> None:
        """InvalidRequest for a call of ``n`` requests of ``tenant``, more than it can ever
        queue (not "retry later")."""
        if n > self.max_queue:
            raise InvalidRequest(
                f"{n} requests of tenant {tenant!r} in one call are over its max_queue "
                f"({self.max_queue}): send at most {self.max_queue} per call")

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
    #: The learned batch-time model (``itif.scheduler.estimate``): fixed_ms, per_request_ms,
    #: per_token_ms, fitted on successful runs.
    batch_time: dict = field(default_factory=dict)
    queued: int = 0
    queued_tokens: int = 0


class SchedulerTicket:
    """The future of one request submitted to the scheduler (the generation loop's request is
    ``itif.generation.gen_tickets.GenTicket``).

    ``result()`` returns the :class:`Result` or raises the request's typed error. If the request's
    deadline passes while it is still queued, a waiter in ``result()`` fails it right away (even
    while the engine is busy with another batch); once running it finishes normally.
    """

    __slots__ = (
        "request", "tenant", "tokens", "priority", "deadline", "seq",
        "enqueued_at", "started_at", "finished_at",
        "_sched", "_tq", "_state", "_result", "_error", "_event", "_callbacks",
    )

    def __init__(self, sched: Scheduler, tq: TenantQueue | None, request: Request, tokens: int,
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
        self._state = QUEUED
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[SchedulerTicket], Any]] | None = []

    # -- future API ------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def cancelled(self) -> bool:
        return self._event.is_set() and isinstance(self._error, Cancelled)

    def cancel(self) -> bool:
        """Withdraw the request if it is still queued (then it never runs): True. False once it
        is running or done."""
        return self._sched.cancel(self)

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
            if self.deadline is not None and self._state == QUEUED:
                left = self.deadline - self._sched.now()
                if left <= 0:
                    self._sched.expire(self)
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

    def add_done_callback(self, fn: Callable[[SchedulerTicket], Any]) -> None:
        """Call ``fn(ticket)`` when done (at once, on this thread, if it already is). Callbacks run
        on the thread that finishes the ticket (usually the scheduler's) and must be quick;
        exceptions are logged."""
        with self._sched.lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        call_back(fn, self)

    # -- the scheduler's side (called with its lock held, but for wake) ---------------------------
    @property
    def state(self) -> int:
        """QUEUED, RUNNING or DONE (under the scheduler's lock, which guards it)."""
        return self._state

    @property
    def queue(self) -> TenantQueue | None:
        """The tenant queue the ticket was submitted to."""
        return self._tq

    def mark(self, state: int) -> None:
        """Move to ``state``: RUNNING when batch formation takes it, DONE when it leaves the
        queue without running (its outcome comes through :meth:`settle`)."""
        self._state = state

    @property
    def settled(self) -> bool:
        """The outcome is set (the first writer wins; later ones are dropped)."""
        return self._event.is_set() or self._callbacks is None

    def settle(self, result: Result | None, error: BaseException | None,
               now: float) -> list[Callable[[SchedulerTicket], Any]]:
        """Set the outcome once (the caller checked :attr:`settled`, under the lock) and hand
        back the callbacks, which :meth:`wake` runs outside the lock."""
        self._state = DONE
        self._result = result
        self._error = error
        self.finished_at = now
        callbacks, self._callbacks = self._callbacks or [], None
        return callbacks

    def wake(self, callbacks: list[Callable[[SchedulerTicket], Any]]) -> None:
        """Release the waiters in ``result()`` and run the callbacks :meth:`settle` returned."""
        self._event.set()
        for fn in callbacks:
            call_back(fn, self)

    # -- timings (metrics) -----------------------------------------------------------------------
    @property
    def queued_ms(self) -> float:
        """Time spent queued: submit to batch start (or to the end, if it never ran)."""
        end = self.started_at if self.started_at is not None else self.finished_at
        if end is None:
            end = self._sched.now()
        return max(0.0, (end - self.enqueued_at) * 1000.0)

    @property
    def compute_ms(self) -> float | None:
        """Batch start to result (including any bisection re-runs); None if it never ran."""
        if self.started_at is None:
            return None
        end = self.finished_at if self.finished_at is not None else self._sched.now()
        return max(0.0, (end - self.started_at) * 1000.0)

    def __repr__(self) -> str:
        state = {QUEUED: "queued", RUNNING: "running", DONE: "done"}[self._state]
        return f"<SchedulerTicket {self.tenant!r} #{self.seq} {state}>"


def call_back(fn: Callable[[SchedulerTicket], Any], ticket: SchedulerTicket) -> None:
    try:
        fn(ticket)
    except Exception:
        log.exception("done callback of a request of tenant %r failed", ticket.tenant)


def clone(err: BaseException) -> BaseException:
    """A per-ticket copy, so concurrent ``raise`` in many waiters do not share a traceback."""
    try:
        c = copy.copy(err)
        c.__cause__ = err.__cause__
        c.__traceback__ = None
        return c
    except Exception:
        return err
