"""The order in which waiting generation requests join the running batch: fair across tenants
by generated-token budget.

The KV cache is the scarce resource of generation: a request holds blocks until it finishes,
up to its whole reservation (decoder-only requests take them as their rows grow, and one
preempted for lack of them resumes ahead of this queue: ``itif.generation.engine``). When
requests wait for blocks, which one joins next decides who
gets the cache. First come first served lets one tenant that queues a hundred requests hold the
cache against everyone else for as long as its queue lasts. ``FairWaiting`` orders the waiting
requests by start-time fair queueing over their *token budgets* instead:

* a request's cost is what it reserves, in generated tokens: ``rows x max_new_tokens`` (beams
  and returned sequences included), plus its prompt or source tokens, which its prefill or
  encoder computes;
* each tenant has a weight (``tenants[].weight`` in tenants.yaml; 1 by default); a request's
  start tag is ``max(V, the finish tag of the tenant's previous request)`` and its finish tag is
  ``start + cost / weight``; the engine admits the waiting request with the smallest start tag
  (ties: arrival order) and advances the virtual time ``V`` to that tag.

So a tenant's share of admissions under contention follows its weight, whatever its queue
length; a tenant that was idle starts at the current virtual time (no credit is banked while
idle), and within a tenant requests keep their arrival order. The request chosen waits for
blocks if it does not fit (a smaller request behind it does not pass it: a large request is
never starved). Deadlines are the caller's: a call whose deadline passes is cancelled, which
takes its request out of the queue at once and gives its tenant back the share it had charged:
the tenant's later requests move up as if it had never come (a tenant whose calls time out
while queued does not fall behind everyone for the retries).

Selection is a heap over the tenants' head requests: O(log tenants) per admission, never a scan
of every tenant or request.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Generic, Hashable, Iterator, TypeVar

T = TypeVar("T", bound=Hashable)

__all__ = ["FairWaiting"]


class FairWaiting(Generic[T]):
    """Waiting items of many tenants, taken in start-time fair order of their costs."""

    def __init__(self) -> None:
        # per tenant: (start tag, seq, item, charge = cost / weight, virtual time at arrival)
        self._queues: dict[str, deque[tuple[float, int, T, float, float]]] = {}
        self._heap: list[tuple[float, int, str]] = []  # (head start tag, seq, tenant), lazy
        self._last_finish: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._tenant_of: dict[T, str] = {}
        self._v = 0.0
        self._seq = itertools.count()

    # ---- weights -------------------------------------------------------------------------------
    def set_weights(self, weights: dict[str, float]) -> None:
        """Every tenant's weight (missing: 1.0); applies to requests queued from now on."""
        bad = {t: w for t, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"weights must be > 0: {bad}")
        self._weights = dict(weights)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    # ---- the queue -----------------------------------------------------------------------------
    def append(self, item: T, tenant: str, cost: float) -> None:
        """Queue ``item`` of ``tenant`` costing ``cost`` (> 0) tokens."""
        start = max(self._v, self._last_finish.get(tenant, 0.0))
        charge = max(float(cost), 1.0) / self.weight(tenant)
        self._last_finish[tenant] = start + charge
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = deque()
        seq = next(self._seq)
        q.append((start, seq, item, charge, self._v))
        if len(q) == 1:
            heapq.heappush(self._heap, (start, seq, tenant))
        self._tenant_of[item] = tenant

    def _head(self) -> tuple[str, tuple[float, int, T]] | None:
        while self._heap:
            start, seq, tenant = self._heap[0]
            q = self._queues.get(tenant)
            if q and q[0][1] == seq:
                return tenant, q[0]
            heapq.heappop(self._heap)  # stale: that head left (taken or removed)
        return None

    def peek(self) -> T | None:
        """The item that joins next (None: nothing waits)."""
        h = self._head()
        return None if h is None else h[1][2]

    def pop(self) -> T:
        """Take the next item (IndexError when empty) and advance the virtual time to its tag."""
        h = self._head()
        if h is None:
            raise IndexError("pop from an empty FairWaiting")
        tenant, (start, _, item, _, _) = h
        heapq.heappop(self._heap)
        q = self._queues[tenant]
        q.popleft()
        self._v = max(self._v, start)
        del self._tenant_of[item]
        self._after_head_change(tenant, q)
        return item

    def remove(self, item: T) -> None:
        """Take ``item`` out wherever it waits (ValueError when it does not)."""
        tenant = self._tenant_of.pop(item, None)
        if tenant is None:
            raise ValueError("item is not waiting")
        q = self._queues[tenant]
        was_head = q[0][2] is item
        i = next(i for i, entry in enumerate(q) if entry[2] is item)
        finish = q[i][0]  # the tags after it start again from its start: its charge given back
        del q[i]
        for j in range(i, len(q)):
            _, seq, later, charge, arrived = q[j]
            q[j] = (max(arrived, finish), seq, later, charge, arrived)
            finish = q[j][0] + charge
        self._last_finish[tenant] = finish
        if was_head:
            self._after_head_change(tenant, q)

    def _after_head_change(self, tenant: str, q: deque) -> None:
        if q:
            start, seq = q[0][:2]
            heapq.heappush(self._heap, (start, seq, tenant))
        else:
            del self._queues[tenant]
            if not self._queues:  # everyone served: restart the clock (tags stay small)
                self._v = 0.0
                self._last_finish.clear()
                self._heap.clear()

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __bool__(self) -> bool:
        return bool(self._tenant_of)

    def __iter__(self) -> Iterator[T]:
        """Every waiting item (no particular order)."""
        for q in self._queues.values():
            for entry in q:
                yield entry[2]
