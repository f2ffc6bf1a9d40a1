"""What every HTTP route shares: the caller's token, the bounded body, JSON parsing, and the one
wrapper (:func:`endpoint`) that turns exceptions into an error answer and counts the request.

Errors map like the gRPC APIs' (``itif.server.errors``: an ``ItifError`` keeps its code and
message; anything else is logged and answers "internal error"); the HTTP status comes from
``itif.server.errors.HTTP_STATUS``, and a body over ``server.max_message_bytes`` is 413. So is a
gzip or deflate body that inflates past it, refused while it is inflated, before it is held
(:func:`read_body`); the inflated bodies held at once, all calls together, are bounded by the
same number (past it: 429 with ``Retry-After``).

Admission (``itif.server.admission``) counts HTTP calls exactly as it counts gRPC calls, in the
same counters when the daemon serves both (``itif.server.app`` hands both servers one
:class:`~itif.server.admission.Admission`): every route but the two health probes identifies its
caller from the token and counts the call in against the tenant's ``max_inflight`` and
``server.max_inflight_calls`` before its body is read. One over is refused at once with **429**
(gRPC's RESOURCE_EXHAUSTED, as ``HTTP_STATUS`` maps it; 503 stays the answer of a daemon that is
starting or draining, gRPC's UNAVAILABLE) and the API's error body. The call holds its place until
its answer has been handed to the connection, so a client that does not read its answers holds at
most ``max_inflight`` of them. A request without a valid token is not counted: the route answers
it 401 as before.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from itif.errors import Busy, InvalidRequest, ItifError, Overloaded
from itif.metrics import call_tenant
from itif.server.admission import HeapTrimmer  # the one heap trimmer (its docstring says why)
from itif.server.errors import (
    DEFAULT_RETRY_AFTER_MS,
    http_retry_headers,
    http_status_of,
    retry_after_ms,
)
from itif.server.json_procs import IN_THREAD, MAX_LIST, OFFLOAD_BYTES, JsonProcs, json_load

log = logging.getLogger("itif.server.http")

#: ``render(status, code, message)``: an API's error answer (KServe's ``{"error": ...}``,
#: OpenAI's ``{"error": {"message": ...}}``).
Render = Callable[[int, str, str], Response]


class BodyTooLarge(Overloaded):
    """A request body over ``server.max_message_bytes`` (HTTP 413)."""

    http_status = 413


class UnsupportedEncoding(InvalidRequest):
    """A Content-Encoding other than identity, gzip and deflate (HTTP 415)."""

    http_status = 415


def authorization(request: Request) -> str | None:
    return request.headers.get("authorization")


def byte_count(text: str) -> int | None:
    """A header's byte count (ASCII digits, spaces around them allowed); None if it is not one.
    (``str.isdigit`` also takes other scripts' digits, which ``int`` refuses.)"""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


#: The output piece a compressed body is first inflated in (counted, then dropped): small
#: enough that a bomb costs the server no more than one piece at a time per body, and below
#: glibc's mmap threshold, so the same heap block serves every piece.
INFLATE_PIECE = 64 << 10
#: Threads that count compressed bodies' bytes as they arrive (:meth:`_Inflated.count`).
COUNT_THREADS = 4
#: A body that held at least this many inflated bytes asks for a heap trim once released (as
#: ``itif.server.admission`` does after replies of this size).
_TRIM_BYTES = 256 << 10
_HELD = "itif.inflated"  # the ASGI scope's key: the inflated bytes a request holds


class _Inflated:
    """The inflated bytes of compressed request bodies the process holds at once, all calls
    together (one HTTP door per process: the daemon's, or a Ray Serve router's), bounded by
    ``server.max_message_bytes``, the bound of one body: one body is always taken when none is
    held, so a refusal is never for good.

    Past it a body is refused at once (429, ``Retry-After``) rather than made to wait: a waiting
    call holds its connection, its admission slot and its compressed bytes meanwhile, and a
    client that sends many would fill a queue instead; a refusal costs the server nothing and
    the client knows when to come back.

    The inflating runs in threads of its own (zlib lets the GIL go meanwhile, so the event loop
    does not wait for it): :data:`COUNT_THREADS` count bodies as they arrive, and one thread
    inflates the bodies taken, whole (:meth:`whole`). One, because of glibc: a CPU engine keeps
    freed heap memory (``itif.platform.tune_host_malloc``: no trimming of the heap's top, no
    mmapped blocks), and a thread started before it did so has an arena of its own, whose top
    ``malloc_trim`` never gives back (measured: a 48 MiB body inflated in such a thread stayed
    resident). A body inflated whole always comes from that one thread's arena, whichever it
    is, so what it keeps is at most what was held at once, this budget, and never grows with
    the bodies sent. Releasing a large body asks for a heap trim (the admission's mechanism,
    ``itif.server.admission.HeapTrimmer``), which gives back whatever came from the main heap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self._trim = HeapTrimmer()
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def _run(self, pool: str, threads: int, fn: Callable[..., Any], *args: Any
             ) -> Awaitable[Any]:
        with self._lock:
            if pool not in self._pools:  # started at the first compressed body
                self._pools[pool] = ThreadPoolExecutor(
                    threads, thread_name_prefix=f"itif-inflate-{pool}")
        return asyncio.get_running_loop().run_in_executor(self._pools[pool], fn, *args)

    def count(self, inflate: Any, data: bytes, room: int) -> Awaitable[tuple[int, bool]]:
        """:func:`_count` in a counting thread."""
        return self._run("count", COUNT_THREADS, _count, inflate, data, room)

    def whole(self, data: bytes, wbits: int, size: int) -> Awaitable[bytes]:
        """``data`` inflated at once into ``size`` bytes (its size, counted): zlib allocates
        the result once (an inflate object grows its output in blocks and joins them, twice
        the size for a moment)."""
        return self._run("whole", 1, zlib.decompress, data, wbits, max(1, size))

    def take(self, nbytes: int, budget: int) -> None:
        with self._lock:
            held = self.held
            if held and held + nbytes > budget:
                raise Busy(
                    f"the request body inflates to {nbytes} bytes, and the server already "
                    f"holds {held} bytes of inflated request bodies: together over "
                    f"server.max_message_bytes ({budget}); retry later, or send it "
                    "uncompressed")
            self.held = held + nbytes

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
        if nbytes >= _TRIM_BYTES:
            self._trim.soon()


INFLATED = _Inflated()


def release_body(request: Request) -> None:
    """Give back what :func:`read_body` took of :data:`INFLATED` for ``request`` (once its
    body is no longer held: :func:`endpoint` does it when the handler has returned)."""
    nbytes = request.scope.pop(_HELD, 0)
    if nbytes:
        INFLATED.give(nbytes)


def _count(inflate: Any, data: bytes, room: int, pieces: int | None = None
           ) -> tuple[int, bool]:
    """Inflate ``data`` (a body's next compressed chunk) in :data:`INFLATE_PIECE` pieces that
    are counted and dropped, at most ``pieces`` of them (None: all); stop once more than
    ``room`` bytes came. (The bytes it inflated, whether it is done with ``data``: False when
    it stopped for ``pieces``, the rest of ``data`` left in ``inflate.unconsumed_tail``.)"""
    n = 0
    while not inflate.eof:
        if pieces is not None:
            if pieces == 0:
                return n, False
            pieces -= 1
        out = inflate.decompress(data, INFLATE_PIECE)
        n += len(out)
        data = inflate.unconsumed_tail
        if n > room or (not data and len(out) < INFLATE_PIECE):
            break  # (a full piece may leave output inside zlib: asked for again)
    return n, True


def _not_whole(encoding: str, after_end: bool) -> InvalidRequest:
    return InvalidRequest(f"the request body is not one whole {encoding} stream ("
                          f"{'data after its end' if after_end else 'it is cut short'})")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (after a gzip or deflate Content-Encoding is
    undone); more is refused (413) without reading it all (a body that stalls is cut off by
    the connection guard, ``itif.server.http._GuardedH11``). A gzip body must be one whole
    member with nothing after it.

    A compressed body is inflated twice, so that one that inflates past ``limit`` never costs
    its inflated size: first as its chunks arrive, in pieces that are only counted (413 the
    moment the count passes ``limit``), then, once whole and within the limit, at once into a
    buffer of exactly its size, when :data:`INFLATED` can take it (else 429). Both in
    :data:`INFLATED`'s threads, but for a body's first piece and a body of one piece, inflated
    on the event loop (about as long as a thread's hand-over). The caller gives those bytes
    back with :func:`release_body` once it no longer holds the body."""
    too_large = BodyTooLarge(f"the request body is over server.max_message_bytes ({limit} bytes)")
    length = request.headers.get("content-length")
    if length is not None:
        count = byte_count(length)
        if count is None:
            raise InvalidRequest(f"Content-Length {length[:32]!r} is not a byte count")
        if count > limit:
            raise too_large
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity", "gzip", "deflate"):
        raise UnsupportedEncoding(f"Content-Encoding {encoding[:32]!r} is not supported "
                                  "(identity, gzip, deflate)")
    wbits = {"gzip": 31, "deflate": 15}.get(encoding)
    inflate = None if wbits is None else zlib.decompressobj(wbits=wbits)
    chunks, size, inflated = [], 0, 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if inflate is None or not chunk:
                continue
            if inflate.eof:
                raise _not_whole(encoding, after_end=True)
            done = False
            if not inflated:  # its first piece on the loop: a small body needs no thread
                inflated, done = _count(inflate, chunk, limit, pieces=1)
                chunk = inflate.unconsumed_tail
            if not done:
                inflated += (await INFLATED.count(inflate, chunk, limit - inflated))[0]
            if inflated > limit:
                raise too_large
            if inflate.unused_data:
                raise _not_whole(encoding, after_end=True)
    except zlib.error as e:
        raise InvalidRequest(f"the request body is not valid {encoding} data: {e}") from None
    body = b"".join(chunks)
    del chunks
    if inflate is None:
        return body
    if not inflate.eof:
        raise _not_whole(encoding, after_end=False)
    INFLATED.take(inflated, limit)
    request.scope[_HELD] = request.scope.get(_HELD, 0) + inflated
    if inflated <= INFLATE_PIECE:  # as cheap as a thread's hand-over
        out = zlib.decompress(body, wbits, max(1, inflated))
    else:
        out = await INFLATED.whole(body, wbits, inflated)
    if len(out) != inflated:  # the same bytes inflated the same way: cannot happen
        raise RuntimeError(f"{encoding} body inflated to {len(out)} bytes, then {inflated}")
    return out


def bounded_list(value: list, where: str) -> list:
    if len(value) > MAX_LIST:
        raise InvalidRequest(f"{where}: {len(value)} elements, over the {MAX_LIST} any model "
                             "or queue takes")
    return value


async def json_object(data: bytes, what: str = "the request body", empty_ok: bool = False,
                      procs: JsonProcs = IN_THREAD, load: Callable[[bytes, str], Any] = json_load
                      ) -> dict:
    """The JSON object ``data`` holds, parsed by ``load``: on the event loop, or, over
    :data:`OFFLOAD_BYTES`, by ``procs`` (``itif.server.json_procs``: a worker process, or a
    thread where it has none)."""
    if empty_ok and not data.strip():
        return {}
    if len(data) > OFFLOAD_BYTES:
        obj = await procs.run(load, data, what)
    else:
        obj = load(data, what)
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def field(obj: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...):
    """``obj[key]`` of the JSON type ``kind`` (a missing key: ``default``, or refused)."""
    if key not in obj:
        if default is ...:
            raise InvalidRequest(f"{where}: {key!r} is required")
        return default
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(_JSON_NAMES.get(k, k.__name__) for k in kinds)
        raise InvalidRequest(f"{where}: {key!r} must be {names}, got {json_type(value)}")
    return value


def json_type(value: Any) -> str:
    """What a JSON value is, in JSON's words ("an object", "a string", ...)."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object", type(None): "null"}


def _admit(api_object: Any, request: Request):
    """Count the call in (``itif.server.admission``), or raise Overloaded. None when nothing is
    counted: no admission, or no valid token (the route answers that itself)."""
    admission = getattr(api_object, "admission", None)
    if admission is None:
        return None
    try:
        who = api_object.daemon.identify(authorization(request))
    except ItifError:
        return None
    client = request.client
    peer = f"http:{client.host}:{client.port}" if client is not None else "http:"
    return admission.enter(who.tenant or "", peer)


class _Held:
    """An answer that releases its admission slot once it has been sent (or its sending
    failed): the ASGI callable Starlette awaits, in front of the response itself."""

    def __init__(self, response: Response, slot: Any) -> None:
        self.response, self.slot = response, slot
        self.status_code = response.status_code

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.slot.release()


def endpoint(api: str, method: str, render: Render, *, admit: bool = True):
    """Wrap a route's handler: every exception becomes ``render``'s error answer (never a
    traceback to the client), and the request is counted in ``itif_http_requests_total`` by
    tenant (the one the daemon authorised it for, as on gRPC), ``api``, ``method`` and status.
    With ``admit`` (all routes but the health probes) the call is first counted in by the
    API object's ``admission`` (None: not counted); over a limit it answers 429. Its slot is
    released whatever happens before its answer is handed over (then: once it is sent). A
    client that goes away while its body is read is counted 499 (nobody to answer)."""

    def wrap(handler: Callable[..., Awaitable[Response]]):
        @functools.wraps(handler)
        async def wrapper(self, request: Request) -> Response:
            start = time.perf_counter()
            slot = None
            try:
                with call_tenant() as holder:
                    try:
                        if admit:
                            slot = _admit(self, request)
                        response = await handler(self, request)
                    except ClientDisconnect:
                        response = Response(status_code=CLIENT_GONE)
                    except Exception as e:  # noqa: BLE001 - the boundary: all is an answer
                        response = _error_answer(render, api, method, e,
                                                 retry_after_ms(self.daemon))
                metrics = getattr(self.daemon, "metrics", None)
                if metrics is not None and hasattr(metrics, "observe_http"):
                    metrics.observe_http(holder[0], api, method, response.status_code,
                                         time.perf_counter() - start)
                if slot is None:
                    return response
                held, slot = _Held(response, slot), None  # released once it is sent
                return held
            finally:  # cancelled (the client went away), or the answer failed: freed now
                release_body(request)  # the handler no longer holds its body
                if slot is not None:
                    slot.release()

        return wrapper

    return wrap


#: The status a call whose client went away mid-request is counted with (nginx's 499).
CLIENT_GONE = 499


def _error_answer(render: Render, api: str, method: str, e: Exception,
                  hint_ms: int = DEFAULT_RETRY_AFTER_MS) -> Response:
    """``render``'s answer to ``e``; a transient overload's (429) carries ``Retry-After``."""
    status, code, msg = http_status_of(e)
    status = getattr(e, "http_status", status)
    if code == "INTERNAL":
        log.error("%s %s failed", api, method, exc_info=e)
    # what a client sent may come back in the message; a lone surrogate cannot be UTF-8
    msg = msg.encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        response = render(status, code, msg)
        response.headers.update(http_retry_headers(e, hint_ms))
        return response
    except Exception:  # noqa: BLE001 - an answer is owed whatever the renderer does
        log.exception("%s %s: rendering the error answer failed", api, method)
        return Response(b"internal error", status_code=500, media_type="text/plain")


__all__ = ["CLIENT_GONE", "INFLATED", "MAX_LIST", "OFFLOAD_BYTES", "BodyTooLarge", "bounded_list",
           "Render", "authorization", "byte_count", "endpoint", "field", "json_object",
           "json_type", "read_body", "release_body"]
