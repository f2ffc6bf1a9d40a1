"""When a batch runs: the triggers of ``itif.scheduler`` (full, hungry, lazy timeout,
starvation guard, stopping), as one function of the queue's state."""

from __future__ import annotations

import math
from typing import Callable

from itif.scheduler.fairqueue import FairQueue

__all__ = ["decide", "fire"]


def decide(q: FairQueue, now: float, *, stopping: bool, max_batch_tokens: int,
           max_batch_size: int, max_wait_ms: float, last_end: float,
           estimate: Callable[[int, int], float]) -> tuple[bool, float | None]:
    """(run a batch now?, else when to look again). ``last_end``: when the engine last became
    idle; ``estimate(n, tokens)``: a batch's predicted run time in ms."""
    next_deadline = q.deadlines[0][0] if q.deadlines else None
    queued, queued_tokens = q.runnable, q.queued_tokens - q.parked_tokens  # parked ones wait
    if queued == 0:
        return False, next_deadline
    guard = oldest_all = math.inf
    for tq in q.active.values():  # the tenants with queued requests only
        o = tq.oldest()
        if o is None:
            continue
        oldest_all = min(oldest_all, o.enqueued_at)
        guard = min(guard, o.enqueued_at + tq.quota.latency_target_ms / 2000.0)
    return fire(now, queued=queued, tokens=queued_tokens, oldest=oldest_all, guard=guard,
                next_deadline=next_deadline, stopping=stopping,
                max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
                max_wait_ms=max_wait_ms, last_end=last_end, estimate=estimate)


def fire(now: float, *, queued: int, tokens: int, oldest: float, guard: float,
         next_deadline: float | None, stopping: bool, max_batch_tokens: int,
         max_batch_size: int, max_wait_ms: float, last_end: float,
         estimate: Callable[[int, int], float]) -> tuple[bool, float | None]:
    """:func:`decide` from a queue's totals (``queued`` > 0 rows of ``tokens``), which the
    column queue (``itif.hostpath.colqueue``) keeps as numbers: ``oldest`` arrival, and
    ``guard``, the earliest over its tenants of their oldest arrival plus half their latency
    target (the starvation guard fires an estimated batch time before it)."""
    if stopping:
        return True, None
    if tokens >= max_batch_tokens or queued >= max_batch_size:
        return True, None  # full
    est_s = estimate(min(queued, max_batch_size), min(tokens, max_batch_tokens)) / 1000.0
    guard_at = guard - est_s
    if now >= guard_at:
        return True, None  # starvation guard
    if oldest <= last_end:
        return True, None  # hungry: it waited while the engine was busy
    lazy_at = oldest + max_wait_ms / 1000.0
    if now >= lazy_at:
        return True, None  # lazy timeout
    wake = min(guard_at, lazy_at)
    if next_deadline is not None:
        wake = min(wake, next_deadline)
    return False, wake
