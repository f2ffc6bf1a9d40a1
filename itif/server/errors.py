"""The one place where domain errors become gRPC status codes.

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


def rpc(method):
    """Wrap an async servicer method: map exceptions to statuses, never leak a traceback."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except ItifError as e:
            code, msg = status_of(e)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - the boundary: everything becomes a status
            code, msg = status_of(e)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
        await context.abort(code, msg)

    return wrapper
