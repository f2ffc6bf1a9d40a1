"""The one place where domain errors become gRPC status codes (and, for the HTTP APIs, HTTP
statuses: :data:`HTTP_STATUS`).

Every servicer method is wrapped by ``rpc``: an ``ItifError`` aborts with its own code and
message; anything else is INTERNAL, logged with its traceback, and the client sees no internals.
Out-of-memory is RESOURCE_EXHAUSTED (the batch failed, the daemon did not).

RESOURCE_EXHAUSTED always says whether to retry (:func:`retry_hint`). A transient overload
(:class:`~itif.errors.Busy`, out of memory in a batch) trails ``retry-after`` (whole seconds,
as HTTP's header) and ``grpc-retry-pushback-ms`` (what gRPC's own retry policy obeys, when the
client lists RESOURCE_EXHAUSTED as retryable), both from ``server.retry_after_ms``; the HTTP
APIs answer 429 with ``Retry-After``. Any other RESOURCE_EXHAUSTED (a message over its limit, a
tenant over the memory budget) trails ``grpc-retry-pushback-ms: -1``: gRPC's word for "do not
retry". UNAVAILABLE is kept for a daemon that is starting, stopping, or has lost its engine.
"""

from __future__ import annotations

import functools
import logging
import math

import grpc

from itif.errors import Busy, ItifError, clip, is_out_of_memory

log = logging.getLogger("itif.server")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ItifError):
        return getattr(grpc.StatusCode, exc.code), clip(str(exc))
    if is_out_of_memory(exc):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory while running this batch"
    return grpc.StatusCode.INTERNAL, "internal error (details in the server log)"


#: gRPC status code name -> the HTTP status the REST and OpenAI APIs answer with (the usual
#: gRPC-to-HTTP table, as grpc-gateway has it); a body over ``server.max_message_bytes`` is 413.
HTTP_STATUS = {
    "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401, "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 400,
    "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501, "INTERNAL": 500,
    "UNAVAILABLE": 503, "DATA_LOSS": 500,
}


#: the retry hint when no daemon configuration is at hand (``server.retry_after_ms``'s default)
DEFAULT_RETRY_AFTER_MS = 200


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is an overload that frees itself (retry later)."""
    return isinstance(exc, Busy) or (not isinstance(exc, ItifError) and is_out_of_memory(exc))


def retry_after_ms(daemon) -> int:
    """The daemon's ``server.retry_after_ms`` (the default without one)."""
    try:
        return int(daemon.config.server.retry_after_ms)
    except AttributeError:
        return DEFAULT_RETRY_AFTER_MS


def retry_seconds(ms: int) -> int:
    """HTTP's ``Retry-After`` (whole seconds, at least 1) for a hint of ``ms``."""
    return max(1, math.ceil(ms / 1000))


def retry_hint(exc: BaseException, ms: int = DEFAULT_RETRY_AFTER_MS
               ) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of ``exc``'s status: for RESOURCE_EXHAUSTED, when to retry (or
    not to: ``grpc-retry-pushback-ms: -1``); nothing for other codes."""
    if transient(exc):
        return (("retry-after", str(retry_seconds(ms))), ("grpc-retry-pushback-ms", str(ms)))
    if status_of(exc)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return (("grpc-retry-pushback-ms", "-1"),)
    return ()


def http_retry_headers(exc: BaseException, ms: int = DEFAULT_RETRY_AFTER_MS) -> dict[str, str]:
    """``Retry-After`` for a transient overload's HTTP answer (429), else nothing."""
    return {"Retry-After": str(retry_seconds(ms))} if transient(exc) else {}


def http_status_of(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, gRPC code name, message) of an exception, through :func:`status_of`."""
    code, msg = status_of(exc)
    return HTTP_STATUS[code.name], code.name, msg


def _status(e: Exception, name: str) -> tuple[grpc.StatusCode, str]:
    """The status an exception escaping servicer method ``name`` becomes (INTERNAL is logged)."""
    code, msg = status_of(e)
    if code is grpc.StatusCode.INTERNAL and not isinstance(e, ItifError):
        log.exception("%s failed", name)
    return code, msg


async def abort_with(context, exc: BaseException, name: str, daemon=None) -> None:
    """End the call with ``exc``'s status and its retry hint (``daemon``: whose
    ``server.retry_after_ms``)."""
    code, msg = _status(exc, name)
    await context.abort(code, msg, retry_hint(exc, retry_after_ms(daemon)))


class _Boundary:
    """Held around a servicer method's behaviour (the unary and the streaming wrapper alike):
    keeps the exception that escapes ``method`` (an ``AbortError`` passes: it already is a
    status) for :meth:`abort`, which the wrapper awaits after the ``with``, where no exception
    is being handled (so the status is not chained to it)."""

    def __init__(self, method) -> None:
        self.name = method.__name__
        self.error: Exception | None = None

    def __enter__(self) -> _Boundary:
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
            self.error = exc  # the boundary: everything becomes a status
            return True
        return False

    async def abort(self, servicer, context) -> None:
        await abort_with(context, self.error, self.name, getattr(servicer, "daemon", None))


def rpc(method):
    """Wrap an async servicer method: map exceptions to statuses, never leak a traceback."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        with _Boundary(method) as boundary:
            return await method(self, request, context)
        await boundary.abort(self, context)

    return wrapper


def rpc_stream(method):
    """``rpc`` for a server-streaming method (an async generator)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        with _Boundary(method) as boundary:
            async for item in method(self, request, context):
                yield item
            return
        await boundary.abort(self, context)

    return wrapper
