"""The HTTP APIs on ``server.http_listen``: KServe v2 REST (``kserve_rest``), OpenAI-compatible
embeddings (``openai``) and completions of decoder tenants (``completions``), one Starlette app
served by uvicorn on the daemon's own event loop.

``itif.server.app`` starts it beside the gRPC server (the port opens before the backbone loads;
until then the routes answer 503, as gRPC answers UNAVAILABLE) and stops it after the daemon has
drained. Its calls are counted by the gRPC server's admission (``itif.server.http.common``: over
a limit, 429). The daemon's loop keeps SIGTERM/SIGINT: uvicorn installs no signal handler here. With
``server.tls`` the port speaks HTTPS with the same certificate (and, with ``client_ca``, asks
clients for theirs).

Connections are bounded (:class:`_GuardedH11`, :class:`_Conns`), so that a client holding idle
sockets can neither take the daemon's file descriptors nor starve the other clients (a review
held 1,100 idle connections and another tenant's calls were answered 503; 2,000 connections
opened and closed at once made the health endpoint answer 503 for 0.3 s):

- at most ``server.http_max_connections`` are counted at once, all clients together, and at
  most ``server.http_max_connections_per_client`` from one peer address;
- at a cap, a new connection closes the oldest IDLE one within that cap (no request in
  progress: nothing sent yet, part of a request line and headers, or kept alive between
  requests) instead of being refused: an idle connection costs its owner a reconnect, a refused
  one a failed call. Only when every connection within the cap is busy with a request is the
  newcomer answered 429 with ``Retry-After: 1`` and closed (overload, as every door answers it:
  docs/reliability.md, "Which status means what"; the refusals and the closed idle ones are
  counted and logged). Checking each idle candidate's
  socket first (a peek), one whose peer has already gone (its end of file not yet read by the
  loop: the storm's) is dropped for free, and one with a request waiting unread (a probe
  accepted in the same burst) is passed over, not evicted;
- a closing connection is not counted: uvicorn keeps a connection in its set until
  ``connection_lost``, after a close has flushed, while here it leaves the count when it starts
  closing;
- the per-address cap first: a peer at its cap evicts its own oldest idle connection, never
  another client's; clients behind one proxy or NAT share an address, so raise it there;
- idle connections time out: one that has not sent its whole request line and headers within
  ``server.http_header_timeout_s`` after it opened (or after the first byte of a kept-alive
  connection's next request) is closed, and one kept alive after a response by uvicorn's
  keep-alive timeout (5 s); a request body that sends nothing for ``http_header_timeout_s``
  is answered 408 and closed (its call held an admission slot).

Health answers do not depend on idle connections: a probe's new connection evicts one (it
fails only when every connection is busy with a request, which admission bounds).

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
import time
from collections import OrderedDict
from itertools import islice

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
from itif.server.http.chat import ChatApi
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
    completions = CompletionsApi(daemon, **kw)
    routes = (KServeRest(daemon, health, **kw).routes() + OpenAIApi(daemon, **kw).routes()
              + completions.routes() + ChatApi(completions).routes())
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def _closing_answer(status: str, text: str, headers: str = "") -> bytes:
    """A whole plain-text HTTP answer, written straight to a connection that closes after it
    (below the ASGI app: no request was parsed); ``headers``: more header lines, each ending
    in CRLF."""
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n{headers}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


#: the most bytes a request line and its headers may take, their blank line included (h11's
#: default, and gRPC's default metadata limit): more is answered :data:`_TOO_LARGE`
MAX_HEADER_BYTES = 16 * 1024
_HEADERS_END = re.compile(rb"\n\r?\n")  # the blank line h11 looks for
_BUSY = _closing_answer("429 Too Many Requests", "too many connections", "retry-after: 1\r\n")
_BODY_STALLED = _closing_answer("408 Request Timeout", "the request body stalled")
_TOO_LARGE = _closing_answer("431 Request Header Fields Too Large",
                             f"the request line and headers are over {MAX_HEADER_BYTES} bytes")


def _peer_sent(transport) -> bool | None:
    """What the peer of ``transport`` has sent that the loop has not read yet, by a peek at its
    socket: True (bytes wait), False (nothing), None (its end of file or a reset: it has gone)."""
    ts = transport.get_extra_info("socket")
    if ts is None:
        return False
    sock = socket.socket(ts.family, ts.type, ts.proto, fileno=ts.fileno())  # a view: detached
    try:
        return True if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else None
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return None
    finally:
        sock.detach()


class _Conns:
    """The counted connections of one HTTP port: how many in all and per peer address, and the
    idle ones oldest first (all together, and per address), for :class:`_GuardedH11`.

    Idle: no request in progress (``_GuardedH11._busy`` false), ordered by when it became idle
    (opened, or its last answer sent): part of a request line coming in keeps its place, so a
    client cannot stay young by trickling bytes.
    """

    #: idle candidates a newcomer looks at, oldest first, before it gives up and is refused:
    #: those skipped have a request waiting unread (a burst); bounds the work of one accept
    scan = 64
    #: seconds between two log lines of the refusals and evictions
    log_every_s = 10.0

    def __init__(self, cap: int, per_client: int) -> None:
        self.cap, self.per_client = cap, min(per_client, cap)
        self.count = 0
        self.per_peer: dict[str, int] = {}
        self.idle: OrderedDict[_GuardedH11, None] = OrderedDict()
        self.peer_idle: dict[str, OrderedDict[_GuardedH11, None]] = {}
        #: newcomers refused (every connection within the cap busy), idle connections closed
        #: to make room, connections of gone peers dropped at a cap
        self.refused = self.evicted = self.gone = 0
        self._logged: dict[str, int] = {}  # kind -> its count at its last log line
        self._logged_at: dict[str, float] = {}
        self._due: dict[str, asyncio.TimerHandle] = {}

    def admit(self, conn: _GuardedH11) -> bool:
        """Count ``conn`` (new), making room at a cap; False: refused, not counted."""
        peer = conn.peer
        if self.per_peer.get(peer, 0) >= self.per_client and not self._free(
                self.peer_idle.get(peer, ())):
            return self._refuse()
        if self.count >= self.cap and not self._free(self.idle):
            return self._refuse()
        conn.counted = True
        self.count += 1
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        self.set_idle(conn)
        return True

    def set_idle(self, conn: _GuardedH11) -> None:
        """``conn`` has no request in progress (its place kept if it was idle already)."""
        if conn.counted and conn not in self.idle:
            self.idle[conn] = None
            self.peer_idle.setdefault(conn.peer, OrderedDict())[conn] = None

    def set_busy(self, conn: _GuardedH11) -> None:
        self.idle.pop(conn, None)
        mine = self.peer_idle.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.peer_idle[conn.peer]

    def drop(self, conn: _GuardedH11) -> None:
        """``conn`` closes: it counts no more (idempotent)."""
        if not conn.counted:
            return
        conn.counted = False
        self.set_busy(conn)
        self.count -= 1
        left = self.per_peer[conn.peer] - 1
        if left:
            self.per_peer[conn.peer] = left
        else:
            del self.per_peer[conn.peer]

    def _free(self, idle) -> bool:
        """Close the oldest idle connection of ``idle`` that has no request waiting unread (or
        drop one whose peer has gone); False: none within :attr:`scan`."""
        for conn in list(islice(idle, self.scan)):
            sent = None if conn.transport.is_closing() else _peer_sent(conn.transport)
            if sent:
                continue  # a request came with the burst: it is not idle
            self.drop(conn)
            if sent is None:
                self.gone += 1
            else:
                self.evicted += 1
                self._note("evicted")
            conn.transport.abort()
            return True
        return False

    def _refuse(self) -> bool:
        self.refused += 1
        self._note("refused")
        return False

    def _note(self, kind: str) -> None:
        """Log the refusals, and apart the evictions: the first at once, then at most one line
        per :attr:`log_every_s` with how many came since (a line left due is written then)."""
        if kind in self._due:
            return
        wait = self._logged_at.get(kind, -self.log_every_s) + self.log_every_s - time.monotonic()
        if wait <= 0:
            self._write(kind)
        else:
            self._due[kind] = asyncio.get_running_loop().call_later(wait, self._write, kind)

    def _write(self, kind: str) -> None:
        self._due.pop(kind, None)
        total = getattr(self, kind)
        n = total - self._logged.get(kind, 0)
        self._logged[kind], self._logged_at[kind] = total, time.monotonic()
        if kind == "refused":
            log.warning("HTTP: %d new connections refused 429, every one within the cap busy "
                        "with a request (caps: %d connections, %d per client address)",
                        n, self.cap, self.per_client)
        else:
            log.warning("HTTP: %d idle connections closed to make room for new ones (caps: %d "
                        "connections, %d per client address)", n, self.cap, self.per_client)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with bounded connections (:class:`_Conns`: the caps, eviction of
    the oldest idle) and a request-header timeout.

    A new connection is counted by :meth:`_Conns.admit`; refused (every connection within its
    cap busy), it gets :data:`_BUSY` and is closed at once. It leaves the count as soon as it
    starts closing (its own timeouts, uvicorn's keep-alive timeout or close after an answer, an
    eviction), not when uvicorn's ``connection_lost`` comes. A connection whose peer has not
    finished a request's line and headers (h11's ``their_state`` still IDLE)
    ``header_timeout_s`` after it opened, or after the first byte of a kept-alive connection's
    next request, is closed; uvicorn's keep-alive timer closes one that sends nothing after a
    response. Subclassed by :class:`HttpServer` with the limits and its :class:`_Conns` set.
    """

    max_connections: int = 1000
    max_connections_per_client: int = 256
    header_timeout_s: float = 10.0
    #: after a 431, how long the connection waits for the client to stop sending before it
    #: closes (each chunk that comes restarts the wait; header_timeout_s bounds the whole)
    linger_s: float = 0.5
    conns: _Conns  # one per port (HttpServer's subclass)

    peer: str = ""
    counted: bool = False
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _linger_until: float = 0.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
        if not self.conns.admit(self):
            self.connections.discard(self)  # nothing for uvicorn's shutdown to wait for
            transport.write(_BUSY)
            transport.abort()  # the fd now: close() would wait for a TLS peer's close_notify
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and those
            # socket.create_server makes (and accepts) have proto 0: an answer's second write
            # waited for the client's delayed ACK, 40 ms a call on a kept-alive connection
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_header_timer()

    @property
    def _busy(self) -> bool:
        """A request in progress: its line and headers came and its answer is not all sent."""
        return self.cycle is not None and not self.cycle.response_complete

    def _track(self) -> None:
        """Tell :attr:`conns` what this connection is now: closing, busy, or idle."""
        if self.transport.is_closing():
            self.conns.drop(self)
        elif self._busy:
            self.conns.set_busy(self)
        else:
            self.conns.set_idle(self)

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
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (a pipelined next request starts in it)
        self._track()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._track()

    def eof_received(self) -> None:
        self.conns.drop(self)  # returns None: the transport closes
        return super().eof_received()

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
        self.conns.drop(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.drop(self)
        self._cancel_header_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _refuse_too_large(self) -> None:
        """431, then linger (:attr:`linger_s`) while the client finishes sending: closing a
        socket with unread data resets it, and the client would lose the answer. Counted while
        it lingers, as an idle connection (the oldest are evicted first)."""
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
            self.conns.drop(self)
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
        cap = _max_connections(s.http_max_connections)
        self.conns = _Conns(cap, s.http_max_connections_per_client)
        protocol = type("_GuardedH11", (_GuardedH11,), {
            "max_connections": cap, "max_connections_per_client": self.conns.per_client,
            "header_timeout_s": s.http_header_timeout_s, "conns": self.conns})
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
