"""Fair sharing of the calls the server works on at once, between tenants.

Admission (``itif.server.admission``) bounds how many calls a tenant may have *in flight*; this
gate decides how many of them the server *works on* at once. Every admitted call passes it
before its request is parsed. While fewer than ``limit`` calls are being worked on and nobody
waits, a call goes straight through. Past that, a call goes through only while its tenant has
fewer calls being worked on than its fair share (``limit`` divided by the tenants with calls
being worked on or waiting, at least one); the others wait, each tenant's in arrival order, and
when a call finishes the tenant with the fewest calls being worked on goes next.

Why: a tenant that keeps hundreds of calls in flight otherwise has all of them parsed, queued,
batched and answered by the one event loop, and another tenant's call waits behind that work.
Held at the gate, a call costs the server nothing (a parked future): the flooding tenant's
batches shrink to its share, and a closed-loop client sends its next call only when one is
answered, so the flood slows to what its share serves. A tenant alone is limited by nothing
but ``limit`` calls at a time (its excess queues here instead of in the scheduler).

``limit`` is ``server.max_active_calls`` (0 turns the gate off), read at every call: a reload
applies at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable


class FairGate:
    """Calls being worked on, by tenant; waiting calls per tenant. Loop thread only, except
    :meth:`leave`, which may come from any thread."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self.active: dict[str, int] = {}
        self.total = 0
        self.waiting: dict[str, deque] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _share(self, limit: int) -> int:
        tenants = len(self.active.keys() | self.waiting.keys())
        return max(1, limit // max(1, tenants))

    def _admit(self, tenant: str) -> None:
        self.active[tenant] = self.active.get(tenant, 0) + 1
        self.total += 1

    async def enter(self, tenant: str) -> None:
        """Return when ``tenant`` may work on one more call (call :meth:`leave` after)."""
        limit = self._limit()
        if limit <= 0 or (self.total < limit and not self.waiting):
            self._admit(tenant)
            return
        if tenant not in self.waiting and self.active.get(tenant, 0) < self._share(limit):
            self._admit(tenant)
            return
        self._loop = asyncio.get_running_loop()
        fut = self._loop.create_future()
        self.waiting.setdefault(tenant, deque()).append(fut)
        try:
            await fut  # _release_waiters counted it in before waking it
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._leave(tenant)  # woken and cancelled in the same turn: hand it on
            else:
                self._drop(tenant, fut)
            raise

    def _drop(self, tenant: str, fut: asyncio.Future) -> None:
        q = self.waiting.get(tenant)
        if q is not None:
            try:
                q.remove(fut)
            except ValueError:
                pass
            if not q:
                del self.waiting[tenant]

    def leave(self, tenant: str) -> None:
        """One call of ``tenant`` is finished (from gRPC's done callback, any thread)."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            self._leave(tenant)
        else:
            loop.call_soon_threadsafe(self._leave, tenant)

    def _leave(self, tenant: str) -> None:
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
        else:
            self.active.pop(tenant, None)
        self.total -= 1
        self._release_waiters()

    def _release_waiters(self) -> None:
        limit = self._limit()
        while self.waiting:
            share = self._share(limit) if limit > 0 else 1 << 30
            tenant = min(self.waiting, key=lambda t: self.active.get(t, 0))
            if self.total >= limit > 0 and self.active.get(tenant, 0) >= share:
                return
            q = self.waiting[tenant]
            fut = q.popleft()
            if not q:
                del self.waiting[tenant]
            if fut.cancelled():
                continue
            self._admit(tenant)
            fut.set_result(None)


__all__ = ["FairGate"]
