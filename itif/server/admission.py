"""Admission: what a call may hold of the server, decided before it costs anything.

One :class:`Admission` per server (``itif.server.app``). The auth interceptor identifies the
caller from its token and hands the method's handler to :meth:`Admission.wrap`, whose wrapper
does, in this order, for every call of the itif and KServe APIs:

1. **count the call in** (:meth:`Admission.enter`): the caller's calls in flight (its tenant's
   ``max_inflight``, by default twice its ``max_queue``) and all calls in flight
   (``server.max_inflight_calls``). One over answers RESOURCE_EXHAUSTED at once, before the
   request message is even parsed: refusing costs the server almost nothing, and the
   refusal is counted like any call (``itif_requests_total{code="RESOURCE_EXHAUSTED"}``). The
   call counts as in flight until gRPC reports it finished (its reply delivered, or the call
   cancelled), not when its handler returns;
   Then the **fair gate** (``server.max_active_calls``, off by default;
   :mod:`itif.server.fairgate`): past that many calls being worked on, a tenant over its fair
   share of them waits here, before anything else is spent on its call;
2. **parse** the request (a message that does not parse: INVALID_ARGUMENT);
3. the handler, which before queueing any work **reserves its reply**
   (:func:`reserve_reply`): the reply's size is known from the request (rows, tokens,
   outputs) and is checked against ``server.max_message_bytes`` (a reply gRPC could not send is
   refused before it is computed, naming the limit) and against
   ``server.max_pending_reply_bytes``, which bounds the bytes of replies a tenant, and a
   connection, may have computed or in computation but not yet read by the client. A client
   that stops reading holds at most that much; its further calls are refused until it reads;
   the bytes are released when gRPC finishes the call, read or cut off;
4. the reply is serialized by the handler (:func:`finish_reply`; large ones in a worker
   thread), checked against ``server.max_message_bytes`` once more, exactly, and handed to gRPC
   as bytes: the protobuf message is gone before gRPC starts sending.

What admission cannot reorder: gRPC hands the server the calls it has received in arrival
order, one per turn of the event loop, whatever their tenant. Under a flood, another tenant's
call waits behind the calls that arrived before it (the fair gate shortens that line by slowing
a closed-loop flood to its share) (each refused at about a millisecond of the
loop's time on a 2-core machine, most of it gRPC's own per-call work); admission makes each of
them cheap, it cannot skip them. ``server.max_pending_calls`` keeps gRPC from cancelling calls
(of every tenant, uncounted) past its default of 1,000 waiting.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextvars import ContextVar
from typing import Any, Callable

import grpc

from itif import daemon_tiers
from itif.clib import libc
from itif.errors import Busy, Overloaded
from itif.server.errors import retry_after_ms, retry_hint
from itif.server.fairgate import FairGate
from itif.server.handlers import wrap_handler
from itif.server.ingress import PEER_KEY

log = logging.getLogger("itif.server")

__all__ = ["Admission", "HeapTrimmer", "Slot", "estimate_reply_bytes", "finish_reply",
           "in_admitted_call", "reserve_reply"]

_MALFORMED = object()  # what a request message that does not parse becomes
_SLOT: ContextVar["Slot | None"] = ContextVar("itif_admission_slot", default=None)
#: Replies at least this large are serialized in a worker thread.
_THREAD_SERIALIZE_BYTES = 256 << 10
#: Per-tensor and per-message protobuf framing allowance of :func:`estimate_reply_bytes`.
_TENSOR_OVERHEAD, _MESSAGE_OVERHEAD = 48, 96


def caller_peer(context: Any) -> str:
    """The client connection a call came on: gRPC's peer, or for a call an ingress process
    relayed over the daemon's private unix socket, its caller's (``PEER_KEY``): without it
    every relayed call of every tenant would share one connection's reply budget."""
    peer = context.peer() or ""
    if peer.startswith("unix:"):
        for key, value in context.invocation_metadata() or ():
            if key == PEER_KEY:
                return f"ingress {value}"
    return peer


class Slot:
    """One admitted call: what it holds until gRPC reports it finished."""

    __slots__ = ("admission", "tenant", "peer", "reply_bytes", "released", "gated")

    def __init__(self, admission: Admission, tenant: str, peer: str) -> None:
        self.admission, self.tenant, self.peer = admission, tenant, peer
        self.reply_bytes = 0
        self.released = False
        self.gated = False  # passed the fair gate (Admission.gate): leaves it when finished

    def release(self, _context: Any = None) -> None:
        self.admission.leave(self)


class Admission:
    """Per-tenant and server-wide bounds on calls in flight and on reply bytes not yet read.
    The limits are read from ``daemon.config`` on every call, so a reload applies at once."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}  # tenant ("" = the admin) -> calls in flight
        self.total = 0
        self.reply_by_tenant: dict[str, int] = {}
        self.reply_by_peer: dict[str, int] = {}
        self._limits_of: Any = None
        self._limits: dict[str, int] = {}
        self._trim = HeapTrimmer()
        self.gate = FairGate(lambda: self.daemon.config.server.max_active_calls)

    # ---- calls ---------------------------------------------------------------------------
    def _tenant_limit(self, tenant: str) -> int | None:
        cfg = self.daemon.config
        if cfg is not self._limits_of:  # rebuilt once per config (a reload)
            self._limits = {t.id: (t.max_inflight if t.max_inflight is not None
                                   else 2 * t.max_queue) for t in cfg.tenants}
            self._limits_of = cfg
        return self._limits.get(tenant)

    def enter(self, tenant: str, peer: str) -> Slot:
        """Count one call of ``tenant`` ("" for the admin) in, or raise Overloaded."""
        server_limit = self.daemon.config.server.max_inflight_calls
        limit = self._tenant_limit(tenant) if tenant else None
        with self._lock:
            mine = self.calls.get(tenant, 0)
            if limit is not None and mine >= limit:
                raise Busy(
                    f"tenant {tenant!r} has {mine} calls in flight, its limit (tenants[]."
                    "max_inflight, default 2 x max_queue); retry after some are answered")
            if self.total >= server_limit:
                raise Busy(
                    f"the server has {self.total} calls in flight, its limit "
                    "(server.max_inflight_calls); retry later")
            self.calls[tenant] = mine + 1
            self.total += 1
        return Slot(self, tenant, peer)

    def leave(self, slot: Slot) -> None:
        """Count ``slot``'s call out (once; ``Slot.release`` when gRPC reports it finished): its
        call, its reply bytes and its place at the fair gate go back."""
        with self._lock:
            if slot.released:
                return
            slot.released = True
            gated, slot.gated = slot.gated, False
            self.total -= 1
            left = self.calls.get(slot.tenant, 1) - 1
            if left:
                self.calls[slot.tenant] = left
            else:
                self.calls.pop(slot.tenant, None)
            freed = slot.reply_bytes
            if freed:
                _sub(self.reply_by_tenant, slot.tenant, freed)
                _sub(self.reply_by_peer, slot.peer, freed)
                slot.reply_bytes = 0
        if gated:
            self.gate.leave(slot.tenant)
        if freed >= _THREAD_SERIALIZE_BYTES:
            self._trim.soon()

    def _mark_gated(self, slot: Slot) -> bool:
        with self._lock:
            if slot.released:
                return False
            slot.gated = True
            return True

    # ---- reply bytes ---------------------------------------------------------------------
    def reserve(self, slot: Slot, nbytes: int) -> None:
        """Hold ``nbytes`` more of reply for ``slot``'s call, or raise Overloaded. A call is
        always admitted when neither its tenant nor its connection holds anything (a reply as
        large as max_message_bytes can always be served, one at a time)."""
        budget = self.daemon.config.server.max_pending_reply_bytes
        with self._lock:
            for what, table, key in (("tenant", self.reply_by_tenant, slot.tenant),
                                     ("connection", self.reply_by_peer, slot.peer)):
                held = table.get(key, 0) - slot.reply_bytes
                if held > 0 and held + nbytes > budget:
                    raise Busy(
                        f"this {what} already has {held} bytes of replies computed or in "
                        f"computation and not yet read (server.max_pending_reply_bytes = "
                        f"{budget}); read the replies of earlier calls, then retry")
            self.reply_by_tenant[slot.tenant] = self.reply_by_tenant.get(slot.tenant, 0) + nbytes
            self.reply_by_peer[slot.peer] = self.reply_by_peer.get(slot.peer, 0) + nbytes
            slot.reply_bytes += nbytes

    # ---- the handler wrapper -------------------------------------------------------------
    def wrap(self, handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
        """``handler`` (of a caller already identified as ``tenant``, "" for the admin) with
        admission before its request is parsed, a malformed request answering
        INVALID_ARGUMENT, and replies that may come back as already-serialized bytes."""
        parse = handler.request_deserializer
        serialize = handler.response_serializer

        async def prepare(raw, context, streamed: bool):
            try:
                slot = self.enter(tenant, caller_peer(context))
            except Overloaded as e:
                metrics = getattr(self.daemon, "metrics", None)
                if metrics is not None and tenant:
                    metrics.note_tenant(tenant)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                    retry_hint(e, retry_after_ms(self.daemon)))
            context.add_done_callback(slot.release)  # when gRPC has finished the call
            await self.gate.enter(tenant)
            if not self._mark_gated(slot):  # finished (cancelled) while it waited
                self.gate.leave(tenant)
            _SLOT.set(slot)
            if streamed:
                return _parsed_stream(raw, parse, context)
            msg = _parse(parse, raw)
            if msg is _MALFORMED:
                await _refuse_malformed(context)
            return msg

        return wrap_handler(handler, prepare=prepare, request_deserializer=_raw,
                            response_serializer=_bytes_or(serialize))


# ---- replies --------------------------------------------------------------------------------
def estimate_reply_bytes(daemon: Any, tenant: str, requests: list, *, padded_rows: bool = False
                         ) -> int:
    """Bytes of the reply to ``requests`` of ``tenant`` (an upper bound for the itif API, the
    exact tensor bytes plus framing): per row and output, logits = labels, pooled = hidden,
    last_hidden_state = tokens x hidden floats. ``padded_rows``: last_hidden_state rows are
    padded to the longest (KServe)."""
    engine = daemon.engine
    try:
        info = daemon_tiers.tenant_info(daemon, tenant, read=False, sizes=False)
    except Exception:  # no weights: the submit refuses the call anyway
        return _MESSAGE_OVERHEAD
    labels = (info.num_labels or 0) if info is not None else 0  # None: stored, not seen yet
    hidden = engine.spec.hidden
    tokens = []
    for r in requests:
        try:
            tokens.append(engine.request_tokens(r))
        except Exception:  # invalid: the submit names what is wrong
            tokens.append(1)
    longest = max(tokens, default=0)
    total = _MESSAGE_OVERHEAD
    for r, n in zip(requests, tokens):
        outs = tuple(r.outputs) if r.outputs else (("logits",) if labels else ("pooled",))
        for o in outs:
            floats = {"logits": labels, "pooled": hidden,
                      "last_hidden_state": (longest if padded_rows else n) * hidden}.get(o, 0)
            total += 4 * floats + _TENSOR_OVERHEAD
        total += _MESSAGE_OVERHEAD
    return total


_INFER_HINT = ("send fewer inputs per call, or ask for logits or pooled instead of "
               "last_hidden_state")


def _too_large(nbytes: int, limit: int, exact: bool, hint: str = _INFER_HINT) -> Overloaded:
    about = "" if exact else "about "
    return Overloaded(
        f"the reply would be {about}{nbytes} bytes, over server.max_message_bytes ({limit}), so "
        f"it cannot be sent: {hint}")


def in_admitted_call() -> bool:
    """Whether the current task serves a gRPC call admitted by :meth:`Admission.wrap`."""
    return _SLOT.get() is not None


def reserve_reply(daemon: Any, nbytes: int, hint: str = _INFER_HINT) -> None:
    """In an admitted gRPC call, before any work is queued: refuse a reply that could not be
    sent (over ``server.max_message_bytes``), then hold its bytes against the tenant's and the
    connection's budget. Nothing outside such a call (the HTTP APIs have their own limits)."""
    slot = _SLOT.get()
    if slot is None:
        return
    limit = daemon.config.server.max_message_bytes
    if nbytes > limit:
        raise _too_large(nbytes, limit, exact=False, hint=hint)
    slot.admission.reserve(slot, nbytes)


async def finish_reply(daemon: Any, message: Any) -> Any:
    """The reply as gRPC will send it: serialized here (in a worker thread when large) and
    checked exactly against ``server.max_message_bytes`` (gRPC would fail it after the handler,
    unlogged as an error and counted as OK). Outside an admitted call the message itself."""
    limit = daemon.config.server.max_message_bytes
    size = message.ByteSize()
    if size > limit:
        raise _too_large(size, limit, exact=True)
    if _SLOT.get() is None:
        return message
    if size >= _THREAD_SERIALIZE_BYTES:
        return await asyncio.to_thread(message.SerializeToString)
    return message.SerializeToString()


# ---- helpers --------------------------------------------------------------------------------
def _sub(table: dict[str, int], key: str, n: int) -> None:
    left = table.get(key, 0) - n
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)


def _raw(data: bytes) -> bytes:
    return data


def _bytes_or(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    def out(message: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return serialize(message) if serialize is not None else message

    return out


def _parse(parse: Callable[[bytes], Any] | None, raw: bytes) -> Any:
    if parse is None:
        return raw
    try:
        return parse(raw)
    except Exception:  # noqa: BLE001 - DecodeError, bad UTF-8 in a string field, ...
        return _MALFORMED


async def _refuse_malformed(context) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        "the request message is not a valid protobuf of its type")


async def _parsed_stream(raw_messages, parse, context):
    async for raw in raw_messages:
        msg = _parse(parse, raw)
        if msg is _MALFORMED:
            await _refuse_malformed(context)
        yield msg


class HeapTrimmer:
    """Give freed heap back to the system (glibc ``malloc_trim``) shortly after large replies
    (or inflated request bodies: ``itif.server.http.common``) were released: their buffers are
    freed, but without a trim the process keeps them, and a client that once made the server
    hold many would leave it large for good."""

    def __init__(self) -> None:
        self._fn = getattr(libc(), "malloc_trim", None)
        self._pending = False
        self._lock = threading.Lock()

    def soon(self, delay_s: float = 0.5) -> None:
        if self._fn is None:
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        t = threading.Timer(delay_s, self._run)
        t.daemon = True
        t.start()

    def _run(self) -> None:
        with self._lock:
            self._pending = False
        try:
            self._fn(0)
        except Exception:  # noqa: BLE001 - an optimisation only
            log.debug("malloc_trim failed", exc_info=True)
