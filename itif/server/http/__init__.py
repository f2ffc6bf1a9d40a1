"""The HTTP APIs on ``server.http_listen``: KServe v2 REST (``kserve_rest``), OpenAI-compatible
embeddings (``openai``) and completions of decoder tenants (``completions``), one Starlette app
served by uvicorn on the daemon's own event loop.

``itif.server.app`` starts it beside the gRPC server (the port opens before the backbone loads;
until then the routes answer 503, as gRPC answers UNAVAILABLE) and stops it after the daemon has
drained. Its calls are counted by the gRPC server's admission (``itif.server.http.common``: over
a limit, 429). The daemon's loop keeps SIGTERM/SIGINT: uvicorn installs no signal handler here. With
``server.tls`` the port speaks HTTPS with the same certificate (and, with ``client_ca``, asks
clients for theirs).

Connections are bounded (:class:`_GuardedH11`): past ``server.http_max_connections`` a new one is
answered 503 and closed, and one that has not sent its request line and headers within
``server.http_header_timeout_s`` is closed, so idle or half-sent connections cannot take the
daemon's file descriptors (uvicorn's own keep-alive timeout starts only after a response); a
request body that sends nothing for as long is answered 408 and closed (its call held an
admission slot).
A request line and headers over :data:`MAX_HEADER_BYTES` are answered 431, and the rest of what
the client sends is read and dropped for a moment before the close, so that the client reads the
answer instead of a connection reset (uvicorn answered 400 and closed with it unread).

Needs the ``http`` extra (starlette, uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import socket
import ssl

try:
    import h11
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as e:  # the daemon says what to install rather than a bare traceback
    raise ImportError(f"server.http_listen needs the http extra (pip install 'itif[http]'): "
                      f"{e}") from e

from itif.config import Config
from itif.server.admission import Admission
from itif.server.http.completions import CompletionsApi
from itif.server.http.kserve_rest import KServeRest
from itif.server.http.openai import OpenAIApi
from itif.server.json_procs import IN_THREAD, JsonProcs

log = logging.getLogger("itif.server.http")


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) answer with KServe's JSON error body."""
    return JSONResponse({"error": f"{request.method} {request.url.path[:200]}: {exc.detail}"},
                        status_code=exc.status_code, headers=exc.headers)


def build_app(daemon, health=None, *, max_body: int, admission=None,
              procs: JsonProcs = IN_THREAD) -> Starlette:
    """The Starlette app of the APIs on ``daemon``. ``admission``: the
    :class:`~itif.server.admission.Admission` that counts the calls (the gRPC server's, so both
    protocols share the limits); None: a new one of this app's own. ``procs``: what parses
    large JSON bodies and writes large JSON answers (``itif.server.json_procs``)."""
    if admission is None:
        admission = Admission(daemon)
    kw = dict(max_body=max_body, admission=admission, procs=procs)
    routes = (KServeRest(daemon, health, **kw).routes() + OpenAIApi(daemon, **kw).routes()
              + CompletionsApi(daemon, **kw).routes())
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def _closing_answer(status: str, text: str) -> bytes:
    """A whole plain-text HTTP answer, written straight to a connection that closes after it
    (below the ASGI app: no request was parsed)."""
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


#: the most bytes a request line and its headers may take, their blank line included (h11's
#: default, and gRPC's default metadata limit): more is answered :data:`_TOO_LARGE`
MAX_HEADER_BYTES = 16 * 1024
_HEADERS_END = re.compile(rb"\n\r?\n")  # the blank line h11 looks for
_BUSY = _closing_answer("503 Service Unavailable", "too many connections")
_BODY_STALLED = _closing_answer("408 Request Timeout", "the request body stalled")
_TOO_LARGE = _closing_answer("431 Request Header Fields Too Large",
                             f"the request line and headers are over {MAX_HEADER_BYTES} bytes")


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a request-header timeout.

    A connection past ``max_connections`` (uvicorn's set of open connections counts it) gets
    :data:`_BUSY` and is closed at once. A connection whose peer has not finished a request's
    line and headers (h11's ``their_state`` still IDLE) ``header_timeout_s`` after it opened,
    or after the first byte of a kept-alive connection's next request, is closed; uvicorn's
    keep-alive timer closes one that sends nothing after a response. Subclassed by
    :class:`HttpServer` with the two limits set.
    """

    max_connections: int = 1000
    header_timeout_s: float = 10.0
    #: after a 431, how long the connection waits for the client to stop sending before it
    #: closes (each chunk that comes restarts the wait; header_timeout_s bounds the whole)
    linger_s: float = 0.5

    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _linger_until: float = 0.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.connections.discard(self)  # not counted against the next ones while it closes
            transport.write(_BUSY)
            transport.abort()  # the fd now: close() would wait for a TLS peer's close_notify
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:  # answered 431: what still comes is dropped
            self._linger.cancel()
            self._linger = self.loop.call_at(
                min(self.loop.time() + self.linger_s, self._linger_until), self.transport.close)
            return
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            head = self.conn.trailing_data[0] + data[:MAX_HEADER_BYTES + 1]  # held: <= the max
            if (len(head) > MAX_HEADER_BYTES
                    and not _HEADERS_END.search(head, 0, MAX_HEADER_BYTES)):
                self._refuse_too_large()
                return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # the first bytes of a kept-alive connection's next
            self._arm_header_timer()           # request (already armed: kept as it is)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request line and headers came
            self._cancel_header_timer()
        self._watch_body()  # (data_received comes here too, through uvicorn's own)

    def _watch_body(self) -> None:
        """While a request's body is still coming, it may not go ``header_timeout_s`` without
        a byte: its call holds an admission slot meanwhile (restarted by every chunk)."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.header_timeout_s, self._body_timeout)

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self.transport.write(_BODY_STALLED)  # the route sees the client gone (499)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _refuse_too_large(self) -> None:
        """431, then linger (:attr:`linger_s`) while the client finishes sending: closing a
        socket with unread data resets it, and the client would lose the answer."""
        self._cancel_header_timer()
        self.transport.write(_TOO_LARGE)
        self._linger_until = self.loop.time() + self.header_timeout_s
        self._linger = self.loop.call_later(self.linger_s, self.transport.close)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.abort()


def _max_connections(wanted: int) -> int:
    """``wanted``, or half the soft open-file limit where that is smaller (logged)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted <= soft // 2:
        return wanted
    cap = max(1, soft // 2)
    log.warning("server.http_max_connections %d lowered to %d: half the open-file limit "
                "(ulimit -n %d)", wanted, cap, soft)
    return cap


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the daemon's loop owns SIGTERM and SIGINT
        yield


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, int(port)), family=family)
    except OSError as e:
        raise OSError(f"cannot listen on {listen} (server.http_listen): {e}") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """uvicorn serving :func:`build_app` on a socket bound at construction."""

    def __init__(self, daemon, cfg: Config, health=None, admission=None) -> None:
        s = cfg.server
        self.listen = s.http_listen
        self.sock = _bind(self.listen)
        tls = {}
        if s.tls is not None:
            tls = dict(ssl_certfile=str(s.tls.cert), ssl_keyfile=str(s.tls.key))
            if s.tls.client_ca is not None:
                tls.update(ssl_ca_certs=str(s.tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.procs = JsonProcs(s.http_json_processes)
        app = build_app(daemon, health, max_body=s.max_message_bytes, admission=admission,
                        procs=self.procs)
        protocol = type("_GuardedH11", (_GuardedH11,), {
            "max_connections": _max_connections(s.http_max_connections),
            "header_timeout_s": s.http_header_timeout_s})
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                http=protocol, ws="none", server_header=False,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                timeout_graceful_shutdown=s.grace_s, **tls)
        self.tls = bool(tls)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    async def start(self) -> None:
        self.procs.start()
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.listen} stopped at start")
            await asyncio.sleep(0.01)
        log.info("HTTP on %s%s", self.listen, " (TLS)" if self.tls else "")

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let requests in flight finish for up to ``grace_s``, close."""
        if self.task is None:
            return
        self.server.config.timeout_graceful_shutdown = max(0.0, grace_s)
        self.server.should_exit = True
        try:
            await self.task
        finally:
            self.sock.close()
            self.procs.close()


__all__ = ["HttpServer", "build_app"]
