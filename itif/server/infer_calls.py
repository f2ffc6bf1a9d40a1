"""What every server's Infer shares, whatever its wire format (the itif gRPC API, KServe over
gRPC and REST, OpenAI embeddings): a large call's inputs converted off the event loop, then
the call handed to the daemon's front door (:meth:`itif.daemon.Daemon.admit`) with its reply
reservation, and its tickets awaited without holding a thread.

The servers import this module, not each other: none of them runs the daemon's own steps
(visibility, validation, queueing), and no HTTP route loads the gRPC servicer module.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from itif.daemon import Daemon, Identity
from itif.errors import DeadlineExceeded
from itif.runtime.engine import Request, Result
from itif.scheduler.tickets import TenantQuota
from itif.server.admission import estimate_reply_bytes, in_admitted_call, reserve_reply

__all__ = ["LARGE_CALL", "await_tickets", "convert_inputs"]

T = TypeVar("T")

#: A call of more inputs than this is sized up before its inputs are converted, and converted
#: in a thread: one Request per input is Python work, about 8 µs an input (a 2M-input InferBatch
#: held the event loop, so every other tenant's calls, for 16 s).
LARGE_CALL = 1024


async def convert_inputs(daemon: Daemon, who: Identity, tenant: str, n: int,
                         convert: Callable[[], T]) -> T:
    """``convert()``: a call's ``n`` inputs made into Requests. Up to :data:`LARGE_CALL` inputs,
    on the event loop. A larger call is refused first if the caller may not see ``tenant``
    (NotFound) or the tenant could never queue ``n`` requests (InvalidRequest, as the scheduler
    would refuse it after the conversion), then converted in a thread, so that other calls'
    handlers run meanwhile."""
    if n <= LARGE_CALL:
        return convert()
    daemon.get_tenant(who, tenant)  # NotFound for unknown and invisible tenants alike
    conf = daemon.config.tenant(tenant)
    if conf is not None:
        TenantQuota.from_tenant(conf).refuse_call(tenant, n)
    return await asyncio.to_thread(convert)


async def await_tickets(daemon: Daemon, who: Identity, tenant: str, requests: list[Request],
                        remaining: float | None, priority: int = 0, *,
                        padded_rows: bool = True) -> list[Result]:
    """Queue every request at once (all-or-nothing) and await them all without holding a thread.

    ``remaining`` is the call's gRPC time left (None: no deadline); it becomes the scheduler's
    absolute deadline on its own clock (time.monotonic). Any failure fails the call and withdraws
    the requests still queued, so a cancelled or expired call frees its work.

    The daemon checks and queues the call (:meth:`Daemon.admit`: visibility once, then the
    weights and the requests). In an admitted gRPC call it then reserves the reply, before any
    work is queued (``itif.server.admission``): one that could not be sent, or that the caller
    has no room for, is refused (``padded_rows``: last_hidden_state rows are padded to the
    longest, as KServe sends them).
    """
    reserve = None
    if in_admitted_call():
        def reserve(checked: list[Request]) -> None:
            reserve_reply(daemon, estimate_reply_bytes(daemon, tenant, checked,
                                                       padded_rows=padded_rows))
    loop = asyncio.get_running_loop()
    settler = _Settler.of(loop)
    deadline = None if remaining is None else time.monotonic() + remaining
    tickets = daemon.admit(who, tenant, requests, deadline=deadline, priority=priority,
                           reserve=reserve)
    futures = []
    for t in tickets:
        fut = loop.create_future()
        t.add_done_callback(lambda tk, f=fut: settler.push(f, tk))
        futures.append(fut)
    try:
        if len(futures) == 1:  # most calls: no gathering future around the one result
            return [await asyncio.wait_for(futures[0], remaining)]
        return await asyncio.wait_for(asyncio.gather(*futures), remaining)
    except asyncio.TimeoutError:
        raise DeadlineExceeded("deadline exceeded before the result was ready") from None
    finally:
        for t in tickets:
            t.cancel()
        for f in futures:  # settle every future so none logs "exception never retrieved"
            if not f.done():
                f.cancel()
            elif not f.cancelled():
                f.exception()


class _Settler:
    """Hands finished tickets to their awaiting futures on the event loop's thread, one wake-up
    of the loop for every ticket that finished meanwhile: a batch of 150 rows finishing on the
    scheduler's thread costs one ``call_soon_threadsafe`` (a write to the loop's self-pipe and
    one callback run) rather than 150."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Settler] = (
        weakref.WeakKeyDictionary())

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # weak: the table's entry goes with its loop
        self.pending: list[tuple[asyncio.Future, object]] = []
        self.lock = threading.Lock()
        self.scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Settler:
        s = cls._by_loop.get(loop)
        if s is None:
            s = cls._by_loop[loop] = cls(loop)
        return s

    def push(self, fut: asyncio.Future, ticket) -> None:
        with self.lock:
            self.pending.append((fut, ticket))
            if self.scheduled:
                return
            self.scheduled = True
        loop = self.loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self.drain)
                return
        except RuntimeError:  # the loop is closed
            pass
        with self.lock:  # the loop is gone or closed: nobody awaits these futures any more
            self.pending.clear()
            self.scheduled = False

    def drain(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
            self.scheduled = False
        for fut, ticket in items:
            _settle(fut, ticket)


def _settle(fut: asyncio.Future, ticket) -> None:
    if fut.done():
        return
    try:
        fut.set_result(ticket.result(0))
    except BaseException as e:  # the ticket's typed error travels to the awaiting handler
        fut.set_exception(e)
