"""The daemon's side of the ingress processes (``itif.server.ingress``, which says why).

- :class:`Recorder` stands in for the gRPC server while the servicers register, keeping their
  method handlers (and registering them on the real server too);
- :class:`FrameServer` answers the ingress processes' frames on a unix socket: each call runs
  through the gRPC server's own interceptors and the servicer's handler, with :class:`_Context`
  standing in for gRPC's (metadata, deadline, peer, abort, done callbacks), so a call that comes
  in by frame is authenticated, admitted, counted and answered exactly as one on the port;
- :class:`IngressPool` starts the processes, starts another when one dies, and stops them first
  on shutdown (they finish their calls, which the daemon is still there to answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections import namedtuple

import grpc

from itif.server.ingress import HOT, NOTICE, FrameTooLarge, FrameWriter, read_frame

log = logging.getLogger("itif.server.ingress")

_Details = namedtuple("_Details", ["method", "invocation_metadata"])


class Recorder:
    """Passes registrations on to ``server`` and keeps the generic handlers."""

    def __init__(self, server) -> None:
        self.server = server
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic.extend(handlers)
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service, handlers) -> None:
        self.server.add_registered_method_handlers(service, handlers)


class _Abort(grpc.aio.AbortError):
    pass


class _Context:
    """The parts of ``grpc.aio.ServicerContext`` itif's interceptors and handlers use."""

    __slots__ = ("_metadata", "_deadline", "_peer", "_code", "_details", "_done", "trailers")

    def __init__(self, metadata, timeout: float | None, peer: str) -> None:
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._peer = peer
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailers: tuple = ()
        self._done: list = []

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._peer

    def add_done_callback(self, callback) -> None:
        self._done.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        self._code, self._details = code, details
        self.trailers = tuple(trailing_metadata or ())  # the retry hint goes back with it
        raise _Abort()

    def set_code(self, code) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self):
        return self._code

    def details(self) -> str:
        return self._details

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def finish(self) -> None:
        for cb in self._done:
            try:
                cb(self)
            except Exception:  # noqa: BLE001 - one callback's failure must not stop the rest
                log.exception("a done callback of a framed call failed")


class FrameServer:
    """Answers HOT calls sent as frames by the ingress processes, on a unix socket."""

    def __init__(self, interceptors, generic) -> None:
        self.generic = list(generic)
        self._server: asyncio.AbstractServer | None = None
        self._links: set[FrameWriter] = set()  # every ingress process's connection
        self._notice = None  # the last notice published (a new connection gets it first)
        #: called with each report an ingress process sends (its column calls' counts:
        #: ``itif.metrics.Metrics.observe_rpcs``)
        self.on_report = None
        chain = self._servicer
        for icpt in reversed(list(interceptors)):  # the first interceptor outermost, as gRPC
            chain = (lambda i, nxt: lambda d: i.intercept_service(nxt, d))(icpt, chain)
        self._chain = chain

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path, limit=1 << 26)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def publish(self, notice) -> None:
        """Send ``notice`` (picklable: the column path's tenant snapshot) to every ingress
        process now, and to each that connects later."""
        self._notice = notice
        for out in self._links:
            out.write((NOTICE, 0, "", notice, ()))

    async def _servicer(self, details) -> grpc.RpcMethodHandler | None:
        for g in self.generic:
            h = g.service(details)
            if h is not None:
                return h
        return None

    async def handler(self, method: str, metadata) -> grpc.RpcMethodHandler | None:
        """The handler the gRPC server would run for ``method``: its interceptors, in order,
        around the servicer's."""
        return await self._chain(_Details(method, metadata))

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        running: dict[int, asyncio.Task] = {}  # this connection's calls by id
        answered = _Answered()
        out = FrameWriter(writer)
        self._links.add(out)
        if self._notice is not None:
            out.write((NOTICE, 0, "", self._notice, ()))
        try:
            while True:
                frame = await read_frame(reader)
                if len(frame) == 1:  # (id,): the caller cancelled that call
                    task = running.get(frame[0])
                    if task is not None:
                        task.cancel()
                    continue
                if len(frame) == 3:  # (0, REPORT, counts): calls it answered itself
                    if self.on_report is not None:
                        self.on_report(frame[2])
                    continue
                if len(frame) == 2:  # (id, DONE): the caller's call ended, its answer read
                    answered.finish(frame[0])
                    continue
                rid = frame[0]
                task = asyncio.create_task(self._call(out, answered, *frame))
                running[rid] = task  # also the task's one strong reference while it runs
                task.add_done_callback(lambda _, rid=rid: running.pop(rid, None))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the ingress process went away: so did its callers
        finally:
            self._links.discard(out)
            for task in running.values():
                task.cancel()
            answered.close()
            writer.close()

    async def _call(self, out: FrameWriter, answered: _Answered, rid: int, method: str,
                    metadata, timeout, peer: str, body: bytes) -> None:
        """One framed call, as gRPC would run it; cancelled (by a cancel frame) as gRPC
        cancels a handler whose caller went away: no answer, done callbacks still run. An
        answered call's done callbacks (admission's reply bytes and in-flight slot) run when
        the ingress process says its caller's call ended, as gRPC runs them once the reply is
        sent: not while the caller has not read it."""
        context = _Context(metadata, timeout, peer)
        held = False
        try:
            try:
                if method not in HOT:
                    raise ValueError(f"{method} does not come by frame")
                h = await self.handler(method, metadata)
                if h is None or h.unary_unary is None:
                    await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                        f"{method} is not offered")
                request = h.request_deserializer(body) if h.request_deserializer else body
                reply = await h.unary_unary(request, context)
                raw = h.response_serializer(reply) if h.response_serializer else reply
                answer = (rid, 0, "", raw, ())
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                answer = (rid, code.value[0], context.details(), None, context.trailers)
            except Exception:  # noqa: BLE001 - what gRPC answers for an escaping exception
                log.exception("framed %s failed", method)
                answer = (rid, grpc.StatusCode.UNKNOWN.value[0], "internal error", None, ())
            _send(out, answer, method)
            held = answered.hold(rid, context)
        finally:
            if not held:
                context.finish()


class _Answered:
    """One frame connection's answered calls whose caller's call has not ended yet."""

    def __init__(self) -> None:
        self._calls: dict[int, _Context] = {}
        self._closed = False

    def hold(self, rid: int, context: _Context) -> bool:
        """Keep ``context`` until its DONE frame; False (the caller finishes it) once the
        connection is gone."""
        if self._closed:
            return False
        self._calls[rid] = context
        return True

    def finish(self, rid: int) -> None:
        context = self._calls.pop(rid, None)
        if context is not None:
            context.finish()

    def close(self) -> None:
        """The connection ended: its callers' calls ended with it."""
        self._closed = True
        calls, self._calls = self._calls, {}
        for context in calls.values():
            context.finish()


def _send(out: FrameWriter, answer: tuple, method: str) -> None:
    """Queue ``answer`` (sent at the end of this turn of the loop, with the others); an answer
    that cannot go as a frame goes as a status, so its caller is not left to its deadline."""
    try:
        out.write(answer)
        return
    except FrameTooLarge as e:
        code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, f"the answer is too large: {e}"
    except Exception:  # noqa: BLE001 - a status still goes back to the caller
        log.exception("framed %s: its answer could not be sent", method)
        code, details = grpc.StatusCode.UNKNOWN, "internal error"
    out.write((answer[0], code.value[0], details, None, ()))


class IngressPool:
    """The ingress processes: started after the daemon's gRPC server, restarted when one dies,
    stopped before the daemon drains."""

    RESTART_DELAY_S = 1.0

    def __init__(self, count: int, spec: dict, columns=None) -> None:
        self.count = count
        self.spec = spec
        self.columns = columns  # itif.server.column_door.ColumnDoor: one ring pair a process
        self.procs: list[subprocess.Popen | None] = [None] * count
        self._stopping = False
        self._watch: asyncio.Task | None = None

    def _spawn(self, i: int) -> subprocess.Popen:
        """Process ``i``; a restarted one takes over the rings of the one it replaces (the
        daemon drops results for calls it no longer knows)."""
        spec, fds = self.spec, ()
        if self.columns is not None:
            spec, fds = dict(spec, columns=self.columns.spec(i)), self.columns.fds(i)
        return subprocess.Popen(
            [sys.executable, "-m", "itif.server.ingress", "--spec", json.dumps(spec)],
            env=dict(os.environ, PYTHONUNBUFFERED="1"), pass_fds=fds)

    async def start(self) -> None:
        self.procs = [self._spawn(i) for i in range(self.count)]
        self._watch = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.RESTART_DELAY_S)
            for i, p in enumerate(self.procs):
                if self._stopping:
                    return
                if p is not None and p.poll() is not None:
                    log.warning("ingress process %d (pid %d) exited with %s; starting another",
                                i, p.pid, p.returncode)
                    self.procs[i] = self._spawn(i)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every process (each finishes its calls within ``grace_s``), then wait."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s + 5.0
        for p in self.procs:
            if p is None:
                continue
            while p.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.poll() is None:
                p.kill()
                p.wait()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]


__all__ = ["FrameServer", "IngressPool", "Recorder"]
