"""What every HTTP route shares: the caller's token, the bounded body, JSON parsing, and the one
wrapper (:func:`endpoint`) that turns exceptions into an error answer and counts the request.

Errors map like the gRPC APIs' (``itif.server.errors``: an ``ItifError`` keeps its code and
message; anything else is logged and answers "internal error"); the HTTP status comes from
``itif.server.errors.HTTP_STATUS``, and a body over ``server.max_message_bytes`` is 413.

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
import time
import zlib
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from itif.errors import InvalidRequest, ItifError, Overloaded
from itif.metrics import call_tenant
from itif.server.errors import (DEFAULT_RETRY_AFTER_MS, http_retry_headers, http_status_of,
                                retry_after_ms)
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


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (after a gzip or deflate Content-Encoding is
    undone); more is refused without reading it all (a body that stalls is cut off by the
    connection guard, ``itif.server.http._GuardedH11``). A gzip body must be one whole member
    with nothing after it."""
    too_large = BodyTooLarge(f"the request body is over server.max_message_bytes ({limit} bytes)")
    length = request.headers.get("content-length")
    if length is not None:
        count = byte_count(length)
        if count is None:
            raise InvalidRequest(f"Content-Length {length[:32]!r} is not a byte count")
        if count > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedEncoding(f"Content-Encoding {encoding[:32]!r} is not supported "
                             "(identity, gzip, deflate)")
    inflate = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        # zlib lets the GIL go while it inflates; the loop does not wait for it
        out = await asyncio.to_thread(inflate.decompress, body, limit + 1)
    except zlib.error as e:
        raise InvalidRequest(f"the request body is not valid {encoding} data: {e}") from None
    if len(out) > limit or inflate.unconsumed_tail:
        raise too_large
    if not inflate.eof or inflate.unused_data:
        raise InvalidRequest(f"the request body is not one whole {encoding} stream ("
                             f"{'data after its end' if inflate.eof else 'it is cut short'})")
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


__all__ = ["CLIENT_GONE", "MAX_LIST", "OFFLOAD_BYTES", "BodyTooLarge", "bounded_list", "Render",
           "authorization", "byte_count", "endpoint", "field", "json_object", "json_type",
           "read_body"]
