"""Ingress processes: the gRPC port served outside the daemon's interpreter.

Under load the daemon is bound by one GIL: gRPC's own per-call work (about 0.35 ms a unary call
on one core, `bench/grpc_floor.py`) runs on the interpreter the forward needs, and each of a
forward's Python calls into torch hands the GIL to the front end (docs/gpu.md, "A third
session"). With ``server.ingress_processes: N`` the daemon keeps its gRPC server (every
servicer, interceptor and limit as before) but on a private unix socket, and N processes of this
module serve ``server.listen`` instead (the port shared with SO_REUSEPORT, so the kernel spreads
connections over them):

- **Infer, InferBatch and ModelInfer** (:data:`HOT`) cross to the daemon as raw bytes over a
  second unix socket, one length-prefixed frame a call each way (:func:`pack`); the daemon runs
  the very interceptors and handler the gRPC server would (``itif.server.ingress_host``: auth,
  admission, metrics, the same status codes) and answers with the reply's bytes or a status
  (with its retry hint's trailing metadata).
  Neither side parses what it only passes on.
- **Every other method** (uploads, management, health, reflection, KServe's repository and
  metadata calls) is relayed to the daemon's gRPC server on its unix socket, as raw bytes, the
  caller's metadata and deadline passed on.

What differs from a daemon serving its port itself: a framed call cancelled
by its client is cancelled in the daemon too; an answered one holds its reply bytes and its
slot in admission until the ingress process says (a DONE frame) that its caller's call ended.
A daemon that loses an ingress process starts another (the port stays served by the others); an
ingress process that loses the daemon exits.

Run by the daemon (``itif.server.ingress_host.IngressPool``), never by hand:
``python -m itif.server.ingress --spec JSON``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import pickle
import queue
import resource
import signal
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from tritonclient.grpc import service_pb2 as kserve_pb2

from itif.server._proto.itif.v1 import itif_pb2
from itif.server.ingress_columns import ColumnClient

log = logging.getLogger("itif.server.ingress")

#: Methods served by a frame to the daemon; the rest are relayed over gRPC.
HOT = frozenset({"/itif.v1.Itif/Infer", "/itif.v1.Itif/InferBatch",
                 "/inference.GRPCInferenceService/ModelInfer"})
#: Second item of an ingress-to-daemon ``(id, DONE)`` frame: that call's caller is done with it
#: (its answer sent, or the call cancelled). ``(id,)`` cancels; six items are a call.
DONE = "done"
#: The id of a daemon-to-ingress frame that answers no call: a notice (the tenant snapshot)
NOTICE = 0
#: Metadata an ingress process adds to each call it relays to the daemon's gRPC server on the
#: private unix socket: its caller's own peer, so admission keeps one reply budget per client
#: connection (``itif.server.admission.caller_peer``). A caller's own value is never passed on.
PEER_KEY = "x-itif-ingress-peer"
#: Metadata gRPC sets itself, and PEER_KEY: never passed on as the caller sent it.
_TRANSPORT_KEYS = frozenset({"user-agent", "grpc-accept-encoding", "grpc-encoding", "te",
                             "content-type", "grpc-timeout", "grpc-message-type", PEER_KEY})
_LEN = struct.Struct(">I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


#: The largest frame body: what its 4-byte length can say.
MAX_FRAME = (1 << 32) - 1


class FrameTooLarge(ValueError):
    """An object whose pickle is longer than :data:`MAX_FRAME` bytes."""


def pack(obj: Any) -> bytes:
    """One frame: a 4-byte big-endian length, then the pickled object."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"{len(body)} bytes; a frame holds at most {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; IncompleteReadError at the end of the stream."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return pickle.loads(await reader.readexactly(n))


class FrameWriter:
    """Frames to one stream, sent together: every frame written during one turn of the event
    loop goes out in one write (one system call) at its end. A batch of rows that finishes
    together resumes its calls in one turn, and each used to send its answer alone."""

    __slots__ = ("_writer", "_pending")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: list[bytes] = []

    def write(self, obj: Any) -> None:
        """Queue ``obj``'s frame; :class:`FrameTooLarge` (nothing queued) when it cannot be."""
        frame = pack(obj)
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(frame)

    def _flush(self) -> None:
        frames, self._pending = self._pending, []
        try:
            self._writer.write(b"".join(frames))
        except (ConnectionError, RuntimeError):
            pass  # the other side is gone: its reader fails the calls waiting on it


def status_code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def method_kinds(files: tuple[FileDescriptor, ...] = (
        itif_pb2.DESCRIPTOR, kserve_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR,
        reflection_pb2.DESCRIPTOR)) -> dict[str, tuple[bool, bool]]:
    """``/service/Method`` -> (client streaming, server streaming) of every method the daemon's
    gRPC server offers."""
    return {f"/{svc.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
            for fd in files for svc in fd.services_by_name.values() for m in svc.methods}


def passed_metadata(context) -> tuple[tuple[str, Any], ...]:
    """The caller's metadata, less what gRPC sets itself."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not k.startswith(":") and k not in _TRANSPORT_KEYS)


class EngineLink:
    """The frame connection to the daemon: calls go out as frames, answers come back by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, FrameWriter(writer)
        self._waiting: dict[int, asyncio.Future] = {}
        self._next = 0
        #: called with the body of each notice the daemon sends (id 0: the column path's
        #: tenant snapshot, ``itif.server.column_door``)
        self.on_notice = None
        self.closed = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, path: str) -> "EngineLink":
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 26)
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while True:
                rid, code, details, body, trailers = await read_frame(self._reader)
                if rid == NOTICE:
                    if self.on_notice is not None:
                        self.on_notice(body)
                    continue
                fut = self._waiting.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result((code, details, body, trailers))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            err = e
        except Exception as e:  # noqa: BLE001 - a broken frame ends the link like a close
            log.exception("frame link to the daemon broke")
            err = e
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"the daemon closed the link: {err!r}"))
        self._waiting.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    async def call(self, method: str, metadata, timeout: float | None, peer: str,
                   body: bytes, context=None) -> tuple[int, str, bytes | None, tuple]:
        """One framed call; ``context`` (the caller's gRPC call): when it ends (its reply sent,
        or the call cancelled) a DONE frame tells the daemon, whose admission holds the reply's
        bytes and the call's slot until then."""
        if self.closed.done():
            raise ConnectionError("the daemon closed the link")
        self._next += 1
        rid = self._next
        self._writer.write((rid, method, metadata, timeout, peer, body))  # may raise: first
        if context is not None:
            context.add_done_callback(lambda _c, rid=rid: self._ended(rid))
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut  # its answer comes in a later turn of the loop
        try:
            return await fut
        except asyncio.CancelledError:  # the caller cancelled: so does the daemon's handler
            if not self.closed.done():
                self._writer.write((rid,))
            raise
        finally:
            self._waiting.pop(rid, None)


    def report(self, counts) -> None:
        """Tell the daemon about calls answered here (the column path's, counted in bulk)."""
        if not self.closed.done():
            self._writer.write((NOTICE, "report", counts))

    def _ended(self, rid: int) -> None:
        if not self.closed.done():
            self._writer.write((rid, DONE))


class Router(grpc.GenericRpcHandler):
    """Every method of the daemon's gRPC server: HOT ones by frame, the others relayed."""

    def __init__(self, link: EngineLink, channel: grpc.aio.Channel,
                 sync_channel: grpc.Channel, columns=None) -> None:
        self.link = link
        self.columns = columns  # itif.server.ingress_columns.ColumnClient, or None
        self.channel = channel
        self.sync_channel = sync_channel
        self.kinds = method_kinds()
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # made once a method

    def service(self, details):
        method = details.method
        h = self._handlers.get(method)
        if h is None and (method in HOT or method in self.kinds):
            h = self._handlers[method] = (
                grpc.unary_unary_rpc_method_handler(self._framed(method)) if method in HOT
                else _relay_handler(self.channel, self.sync_channel, method,
                                    *self.kinds[method]))
        return h  # None: UNIMPLEMENTED, as the daemon would answer

    def _framed(self, method: str):
        link = self.link

        async def call(request: bytes, context) -> bytes:
            cols = self.columns
            p = None if cols is None else cols.prepare(method, request,
                                                       context.invocation_metadata())
            if p is not None:
                reply, refused = await cols.counted(p, context)
                if refused is not None:
                    await context.abort(refused.code, refused.details, refused.trailers)
                return reply
            try:
                code, details, body, trailers = await link.call(
                    method, passed_metadata(context), context.time_remaining(),
                    context.peer() or "", request, context)
            except ConnectionError:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "the daemon is not reachable; retry")
            if code:
                await context.abort(status_code(code), details, trailers)
            return body

        return call


class _Outbox:
    """The caller's stream handed to a sync call's sender thread through a small queue (read
    no faster than the daemon takes it); ``close`` releases the thread whatever it waits on."""

    def __init__(self) -> None:
        self.box: queue.Queue = queue.Queue(maxsize=4)

    def messages(self):
        while (item := self.box.get()) is not _END:
            yield item

    async def put(self, item, call) -> bool:
        """False once ``call`` is over (the daemon ended it: its status says why)."""
        while not call.done():
            try:
                self.box.put_nowait(item)
                return True
            except queue.Full:
                await asyncio.sleep(0.002)
        return False

    async def feed(self, requests, call) -> None:
        async for message in requests:
            if not await self.put(message, call):
                return
        await self.put(_END, call)

    def close(self) -> None:
        while True:
            try:
                self.box.put_nowait(_END)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.box.get_nowait()


_END = object()


def _stream_unary_relay(channel: grpc.Channel, method: str):
    """A client-streaming relay through the *sync* API, in grpc's threads: when the daemon
    ends such a call early (a refused upload), an asyncio client's next write replaces the
    daemon's status with INTERNAL "Internal error from Core" (grpc/grpc#36066), while the sync
    client reports the daemon's own."""
    stub = channel.stream_unary(method)

    async def relay(requests, context):
        loop = asyncio.get_running_loop()
        out = _Outbox()
        call = stub.future(out.messages(), **_call_options(context))
        finished = loop.create_future()
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(
            lambda: finished.done() or finished.set_result(None)))
        feeder = asyncio.create_task(out.feed(requests, call))
        try:  # over when the daemon answers: after the caller's last message, or before it
            await finished  # (a refusal, an idle upload aborted) while the caller is silent
        finally:
            feeder.cancel()
            out.close()
            call.cancel()  # a no-op once it is over; the caller's cancellation otherwise
        try:
            return call.result()
        except grpc.RpcError as e:
            await _abort_as(context, e)

    return relay


def _stream_stream_relay(channel: grpc.Channel, method: str):
    """A bidirectional relay through the sync API (the same reason as
    :func:`_stream_unary_relay`); the daemon's answers come back through a thread that reads
    them as they arrive, so an interactive caller (reflection) gets each before it sends more."""
    stub = channel.stream_stream(method)

    async def relay(requests, context):
        loop = asyncio.get_running_loop()
        out = _Outbox()
        answers: asyncio.Queue = asyncio.Queue()
        call = stub(out.messages(), **_call_options(context))

        def read() -> None:
            try:
                for answer in call:
                    loop.call_soon_threadsafe(answers.put_nowait, (True, answer))
                loop.call_soon_threadsafe(answers.put_nowait, (False, None))
            except grpc.RpcError as e:
                loop.call_soon_threadsafe(answers.put_nowait, (False, e))

        threading.Thread(target=read, daemon=True, name="itif-ingress-relay").start()
        feeder = asyncio.create_task(out.feed(requests, call))
        try:
            while True:
                more, item = await answers.get()
                if more:
                    yield item
                elif item is None:
                    return
                else:
                    await _abort_as(context, item)
        finally:
            feeder.cancel()
            out.close()
            call.cancel()

    return relay


async def _abort_as(context, e: grpc.RpcError) -> None:
    """End the caller's call with the daemon's status and its retry hint."""
    trailing = getattr(e, "trailing_metadata", None)
    await context.abort(e.code(), e.details() or "",
                        retry_trailers(trailing() if trailing is not None else None))


#: the daemon's trailing metadata a relayed call passes on to its caller (the retry hint)
RETRY_KEYS = ("retry-after", "grpc-retry-pushback-ms")


def retry_trailers(metadata) -> tuple[tuple[str, str], ...]:
    """The retry hint among ``metadata`` (a status's trailing metadata; None: nothing)."""
    return tuple((k, v) for k, v in (metadata or ()) if k in RETRY_KEYS)


def _call_options(context) -> dict:
    return dict(metadata=(*passed_metadata(context), (PEER_KEY, context.peer() or "")),
                timeout=context.time_remaining())


def _relay_handler(channel: grpc.aio.Channel, sync_channel: grpc.Channel, method: str,
                   client_streaming: bool, server_streaming: bool) -> grpc.RpcMethodHandler:
    """A handler that makes the same call, raw bytes in and out, on the daemon's own server."""

    if not client_streaming and not server_streaming:
        stub = channel.unary_unary(method)

        async def uu(request, context):
            try:
                return await stub(request, **_call_options(context))
            except grpc.aio.AioRpcError as e:
                await _abort_as(context, e)

        return grpc.unary_unary_rpc_method_handler(uu)
    if client_streaming and not server_streaming:
        return grpc.stream_unary_rpc_method_handler(_stream_unary_relay(sync_channel, method))
    if client_streaming:
        return grpc.stream_stream_rpc_method_handler(_stream_stream_relay(sync_channel, method))
    stub = channel.unary_stream(method)

    async def us(request, context):
        try:
            async for item in stub(request, **_call_options(context)):
                yield item
        except grpc.aio.AioRpcError as e:
            await _abort_as(context, e)

    return grpc.unary_stream_rpc_method_handler(us)


#: gRPC server options that make ``grpc.max_concurrent_streams`` flow control, not a refusal.
#: By default gRPC's C core counts a stream against the limit until the server has freed it
#: (the Python call object), after the client has seen it end; the client, counting only open
#: streams, sends more, and the server resets them (REFUSED_STREAM, which clients report as
#: UNAVAILABLE): 226 of 400 calls on one warm connection with 16 streams and a 50 ms handler.
#: Counted as HTTP/2 counts them ("overload protection" off), the client holds its calls past
#: the limit until one ends: 400 of 400 OK, and 3,000 of 3,000 on a cold connection.
STREAM_LIMIT_OPTIONS = (("grpc.http.overload_protection", 0),)


def grpc_connection_cap() -> int:
    """A gRPC port's connection cap (``grpc.max_allowed_incoming_connections``): a quarter of
    the process's open-file limit (the HTTP port's cap is at most half of it:
    ``itif.server.http``), the rest for files and the process's own. The daemon's port and each
    ingress process's use it: 21,000 idle TCP connections took every descriptor of a 20,000
    limit, and with them the HTTP port and both health checks."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**31 - 1 if soft == resource.RLIM_INFINITY else max(64, soft // 4)


async def serve(spec: dict) -> int:
    """One ingress process: serve ``spec["listen"]`` until SIGTERM or until the daemon goes."""
    limit = spec["max_message_bytes"]
    sizes = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    link = await EngineLink.connect(spec["frames"])
    channel = grpc.aio.insecure_channel(spec["grpc"], options=sizes)
    sync_channel = grpc.insecure_channel(spec["grpc"], options=sizes)
    server = grpc.aio.server(options=[
        *sizes, ("grpc.so_reuseport", 1),
        ("grpc.server.max_pending_requests", spec["max_pending_calls"]),
        ("grpc.server.max_pending_requests_hard_limit", spec["max_pending_calls"]),
        ("grpc.max_concurrent_streams", spec["max_streams_per_connection"]),
        *STREAM_LIMIT_OPTIONS,
        ("grpc.max_allowed_incoming_connections", grpc_connection_cap()),
    ], maximum_concurrent_rpcs=None)
    columns = None
    if spec.get("columns"):
        columns = ColumnClient(spec["columns"], limit, link.report)
        link.on_notice = lambda snap: setattr(columns, "snapshot", snap)
    server.add_generic_rpc_handlers((Router(link, channel, sync_channel, columns),))
    tls = spec.get("tls")
    if tls:
        ca = tls.get("client_ca")
        creds = grpc.ssl_server_credentials(
            [(Path(tls["key"]).read_bytes(), Path(tls["cert"]).read_bytes())],
            root_certificates=Path(ca).read_bytes() if ca else None,
            require_client_auth=bool(ca))
        port = server.add_secure_port(spec["listen"], creds)
    else:
        port = server.add_insecure_port(spec["listen"])
    if port == 0:
        print(f"itif-ingress: cannot listen on {spec['listen']}", file=sys.stderr, flush=True)
        return 2
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"itif-ingress: serving {spec['listen']}", flush=True)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, link.closed], return_when=asyncio.FIRST_COMPLETED)
    gone = link.closed.done()
    await server.stop(0 if gone else spec.get("grace_s", 10.0))
    await channel.close()
    sync_channel.close()
    if columns is not None:
        columns.close()
    return 3 if gone else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m itif.server.ingress")
    p.add_argument("--spec", required=True, help="JSON: listen, frames, grpc, limits, tls")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(json.loads(args.spec)))


if __name__ == "__main__":
    sys.exit(main())
