"""The one place where domain errors become gRPC status codes (and, for the HTTP APIs, HTTP
statuses: :data:`HTTP_STATUS`).

Every servicer method is wrapped by ``rpc``: an ``ItifError`` aborts with its own code and
message; anything else is INTERNAL, logged with its traceback, and the client sees no internals.
Out-of-memory is RESOURCE_EXHAUSTED (the batch failed, the daemon did not).
"""

from __future__ import annotations

import functools
import logging

import grpc

from itif.errors import ItifError, clip, is_out_of_memory

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


def rpc(method):
    """Wrap an async servicer method: map exceptions to statuses, never leak a traceback."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - the boundary: everything becomes a status
            code, msg = _status(e, method.__name__)
        await context.abort(code, msg)

    return wrapper


def rpc_stream(method):
    """``rpc`` for a server-streaming method (an async generator)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
            return
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - the boundary: everything becomes a status
            code, msg = _status(e, method.__name__)
        await context.abort(code, msg)

    return wrapper
