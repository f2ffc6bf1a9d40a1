"""Per-tenant queues and weighted fair batch formation (start-time fair queueing in tokens).

Every tenant has a virtual tag; a batch repeatedly takes the head request of the tenant with the
smallest tag and advances that tag by ``tokens / weight``. A tenant whose queue was empty
restarts at the system virtual time (the tag of the last request taken), so idling banks no
credit. A batch of several tenants ends with no run-ahead tail: its last requests, if all of one
tenant, starting at or after the finish tag of every other tenant's requests in it and more
tokens than the rest of the batch, go back to wait for the next batch (``itif.hostpath.colqueue``
says why). See ``itif.scheduler`` for the whole policy. Nothing here locks: the scheduler calls
every method with its lock held.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

from itif.errors import TenantNotFound, shown
from itif.scheduler.tickets import DONE, QUEUED, RUNNING, SchedulerTicket, TenantQuota, TenantStats

__all__ = ["FairQueue", "TenantQueue"]

#: ``error(ticket, now)``: the error of a ticket whose deadline passed while it was queued.
DeadlineError = Callable[[SchedulerTicket, float], BaseException]


class TenantQueue:
    """A tenant's queue: a heap by (-priority, seq) to take from, a FIFO deque to find the oldest.
    Entries that left out of order (cancelled, expired, taken by priority) are dropped lazily and
    both containers are compacted when they hold more than twice the live entries."""

    __slots__ = ("name", "quota", "order", "heap", "fifo", "depth", "tokens", "tag", "removed",
                 "parked")

    def __init__(self, name: str, quota: TenantQuota, order: int, tag: float) -> None:
        self.name = name
        self.quota = quota
        self.order = order
        self.heap: list[tuple[int, int, SchedulerTicket]] = []
        self.fifo: deque[SchedulerTicket] = deque()
        self.depth = 0
        self.tokens = 0
        self.tag = tag
        self.removed = False
        #: Its weights are not resident (``itif.weights.tiers``): requests wait here, out of
        #: batch formation, until the tenant is unparked.
        self.parked = False

    def push(self, t: SchedulerTicket) -> None:
        heapq.heappush(self.heap, (-t.priority, t.seq, t))
        self.fifo.append(t)
        self.depth += 1
        self.tokens += t.tokens

    def head(self) -> SchedulerTicket | None:
        heap = self.heap
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def oldest(self) -> SchedulerTicket | None:
        fifo = self.fifo
        while fifo and fifo[0].state != QUEUED:
            fifo.popleft()
        return fifo[0] if fifo else None

    def left(self, t: SchedulerTicket) -> None:
        """``t`` (queued until now) left the queue; the caller already changed its state."""
        self.depth -= 1
        self.tokens -= t.tokens
        if len(self.heap) > 2 * self.depth + 32:
            self.heap = [e for e in self.heap if e[2].state == QUEUED]
            heapq.heapify(self.heap)
        if len(self.fifo) > 2 * self.depth + 32:
            self.fifo = deque(x for x in self.fifo if x.state == QUEUED)

    def queued(self) -> list[SchedulerTicket]:
        return [e[2] for e in self.heap if e[2].state == QUEUED]


class FairQueue:
    """Every tenant's queue, the deadlines of queued requests, the per-tenant counters."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantQueue] = {}
        #: The tenants with queued requests: what batch formation and the triggers look at, so
        #: their cost follows the busy tenants, not every registered one.
        self.active: dict[str, TenantQueue] = {}
        #: Parked tenants (``TenantQueue.parked``) with queued requests, and their counts: the
        #: triggers and batch formation see ``queued - parked_n`` runnable requests only.
        self.parked: dict[str, TenantQueue] = {}
        self.parked_n = 0
        self.parked_tokens = 0
        self.stats: dict[str, TenantStats] = {}
        self.vtime = 0.0
        self.queued = 0
        self.queued_tokens = 0
        self.deadlines: list[tuple[float, int, SchedulerTicket]] = []
        self._order = 0

    # ---- tenants ---------------------------------------------------------------------------
    def set_tenant(self, tenant: str, quota: TenantQuota) -> None:
        tq = self.tenants.get(tenant)
        if tq is None:
            self._order += 1
            self.tenants[tenant] = TenantQueue(tenant, quota, self._order, self.vtime)
        else:
            tq.quota = quota
            tq.removed = False
        self.stats.setdefault(tenant, TenantStats())

    def remove_tenant(self, tenant: str) -> None:
        tq = self.tenants.get(tenant)
        if tq is None or tq.removed:
            raise TenantNotFound(f"tenant {shown(tenant)} not found")
        tq.removed = True
        if tq.depth == 0:
            del self.tenants[tenant]

    def live(self, tenant: str) -> TenantQueue | None:
        """The tenant's queue if it takes new requests (configured, not removed)."""
        tq = self.tenants.get(tenant)
        return None if tq is None or tq.removed else tq

    # ---- in and out ------------------------------------------------------------------------
    def push(self, t: SchedulerTicket) -> None:
        tq = t.queue
        if tq.parked:
            self.parked[tq.name] = tq
            self.parked_n += 1
            self.parked_tokens += t.tokens
        elif tq.depth == 0:  # (re)activated: no credit for the idle time
            tq.tag = max(tq.tag, self.vtime)
            self.active[tq.name] = tq
        tq.push(t)
        self.queued += 1
        self.queued_tokens += t.tokens
        if t.deadline is not None:
            heapq.heappush(self.deadlines, (t.deadline, t.seq, t))

    def dequeue(self, t: SchedulerTicket) -> None:
        """A queued ticket leaves the queue without running (cancel, expiry, shutdown)."""
        t.mark(DONE)
        self.queued -= 1
        self.queued_tokens -= t.tokens
        self._left(t.queue, t)
        self._compact_deadlines()

    def _compact_deadlines(self) -> None:
        """Drop the deadlines of tickets no longer queued once they outnumber the queued ones:
        a ticket that left the queue (ran, was cancelled or expired) would otherwise stay in
        the heap, with its request, its result and its caller's callbacks, until its deadline
        passed (a client's 30 s deadline at 1,000 calls/s: 30,000 finished calls kept alive).
        Amortised O(1) per ticket."""
        if len(self.deadlines) > 2 * self.queued + 64:
            self.deadlines = [e for e in self.deadlines if e[2].state == QUEUED]
            heapq.heapify(self.deadlines)

    def _left(self, tq: TenantQueue, t: SchedulerTicket) -> None:
        """``t`` left ``tq`` (taken or dropped): an emptied queue leaves ``active`` (or
        ``parked``), and a removed tenant's emptied queue goes."""
        tq.left(t)
        if tq.parked:
            self.parked_n -= 1
            self.parked_tokens -= t.tokens
        if tq.depth == 0:
            if self.active.get(tq.name) is tq:
                del self.active[tq.name]
            if self.parked.get(tq.name) is tq:
                del self.parked[tq.name]
            if tq.removed and self.tenants.get(tq.name) is tq:
                del self.tenants[tq.name]

    def park(self, tenant: str, parked: bool) -> TenantQueue | None:
        """Park (``parked``) or unpark a tenant's queue: O(1), whatever it holds. An unparked
        queue with requests rejoins batch formation at the system virtual time."""
        tq = self.tenants.get(tenant)
        if tq is None or tq.parked == parked:
            return tq
        tq.parked = parked
        if tq.depth == 0:
            return tq
        if parked:
            self.active.pop(tenant, None)
            self.parked[tenant] = tq
            self.parked_n += tq.depth
            self.parked_tokens += tq.tokens
        else:
            self.parked.pop(tenant, None)
            self.parked_n -= tq.depth
            self.parked_tokens -= tq.tokens
            tq.tag = max(tq.tag, self.vtime)
            self.active[tenant] = tq
        return tq

    @property
    def runnable(self) -> int:
        """Queued requests that batch formation may take (not parked)."""
        return self.queued - self.parked_n

    def take_all(self) -> list[SchedulerTicket]:
        out = []
        for tq in [*self.active.values(), *self.parked.values()]:
            for t in tq.queued():
                self.dequeue(t)
                out.append(t)
        return out

    def expire_due(self, now: float, error: DeadlineError
                   ) -> list[tuple[SchedulerTicket, BaseException]]:
        out = []
        dl = self.deadlines
        while dl and dl[0][0] <= now:
            _, _, t = heapq.heappop(dl)
            if t.state == QUEUED:
                self.dequeue(t)
                self.stats[t.tenant].expired += 1
                out.append((t, error(t, now)))
        return out

    # ---- batch formation -------------------------------------------------------------------
    def form(self, now: float, *, max_tokens: int, max_size: int, isolate: bool,
             estimate: Callable[[int, int], float] | None, error: DeadlineError,
             ) -> tuple[list[SchedulerTicket], list[tuple[SchedulerTicket, BaseException]]]:
        """Weighted fair batch formation. ``estimate(n, tokens)`` (ms) given: latency sizing
        (see "How big a batch" in ``itif.scheduler``); ``isolate``: one tenant per batch."""
        batch: list[SchedulerTicket] = []
        dropped: list[tuple[SchedulerTicket, BaseException]] = []
        budget, size = max_tokens, max_size
        heap = [(tq.tag, tq.order, tq) for tq in self.active.values()]
        heapq.heapify(heap)
        tokens = 0
        # Latency sizing: the smallest slack (time left to its tenant's latency target) of the
        # members that still meet their target in the batch as formed so far.
        sizing = estimate is not None
        vtime0 = self.vtime
        starts: list[float] = []  # each member's start tag
        feasible_slack = math.inf
        slacks: list[float] = []  # min-heap of the members' slacks that still meet their target
        while heap and len(batch) < size:
            _, _, tq = heapq.heappop(heap)
            t = tq.head()
            while t is not None and t.deadline is not None and t.deadline <= now:
                heapq.heappop(tq.heap)
                self.dequeue(t)
                self.stats[t.tenant].expired += 1
                dropped.append((t, error(t, now)))
                t = tq.head()
            if t is None:
                continue
            if batch and tokens + t.tokens > budget:
                continue  # this tenant sits out this batch; it keeps the smallest tag
            grown = None
            if sizing and batch:
                grown = estimate(len(batch) + 1, tokens + t.tokens) / 1000.0
                if grown > feasible_slack:
                    break  # t would make a member miss a target it can still meet: stop here
            heapq.heappop(tq.heap)
            t.mark(RUNNING)
            t.started_at = now
            self.queued -= 1
            self.queued_tokens -= t.tokens
            self._left(tq, t)
            batch.append(t)
            tokens += t.tokens
            if sizing:  # est only grows with the batch, so the feasible set only shrinks
                est = grown if grown is not None else estimate(len(batch), tokens) / 1000.0
                heapq.heappush(slacks, t.enqueued_at + tq.quota.latency_target_ms / 1000.0 - now)
                while slacks and slacks[0] < est:
                    heapq.heappop(slacks)
                feasible_slack = slacks[0] if slacks else math.inf
            self.vtime = max(self.vtime, tq.tag)
            starts.append(tq.tag)
            tq.tag += max(t.tokens, 1) / tq.quota.weight
            if isolate:  # the rest of this batch comes from this tenant only
                heap = [(tq.tag, tq.order, tq)] if tq.depth > 0 else []
            elif tq.depth > 0:
                heapq.heappush(heap, (tq.tag, tq.order, tq))
        if batch:
            self._trim_tail(batch, starts, vtime0)
            self._compact_deadlines()
        return batch, dropped

    def _trim_tail(self, batch: list[SchedulerTicket], starts: list[float], vtime0: float) -> None:
        """Put the batch's run-ahead tail (the module docstring) back in its queue, as if
        never taken."""
        last = batch[-1].queue
        finish = max((s + max(t.tokens, 1) / t.queue.quota.weight
                      for t, s in zip(batch, starts) if t.queue is not last), default=None)
        if finish is None:
            return  # one tenant's batch
        k = len(batch)
        while batch[k - 1].queue is last and starts[k - 1] >= finish:
            k -= 1
        if 2 * sum(t.tokens for t in batch[:k]) >= sum(t.tokens for t in batch):
            return  # a short tail: it runs with the rest
        back, batch[k:] = batch[k:], []
        last.tag = starts[k]  # its tag before it took them
        for t in back:
            t.mark(QUEUED)
            t.started_at = None
            heapq.heappush(last.heap, (-t.priority, t.seq, t))
            last.depth += 1
            last.tokens += t.tokens
            self.queued += 1
            self.queued_tokens += t.tokens
        # taking them may have dropped them from the FIFO (its compaction keeps queued ones)
        last.fifo = deque(sorted((e[2] for e in last.heap if e[2].state == QUEUED),
                                 key=lambda x: x.seq))
        self.active[last.name] = last
        if last.removed:
            self.tenants.setdefault(last.name, last)
        self.vtime = max(vtime0, max(starts[:k]))
