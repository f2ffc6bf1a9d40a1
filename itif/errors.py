"""Typed domain errors.

Domain code raises these; exactly one place (``itif.server.errors``) maps them to gRPC status
codes, and the CLI prints them as ``error: <CODE>: <message>``. Messages name the offending value.
"""

from __future__ import annotations

MAX_SHOWN = 80  # characters of a client-chosen name quoted back (a 63-character id fits)
MAX_MESSAGE = 1024  # characters of an error message sent to a client


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: a client-chosen name
    (a tenant id, a model name) is never echoed whole, however long it is."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def clip(message: str, limit: int = MAX_MESSAGE) -> str:
    """An error message cut to ``limit`` characters (status details travel in the trailers,
    whose size the client limits: a longer message would fail the call differently)."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters)"


class ItifError(Exception):
    """Base of every error itif raises on purpose. ``code`` is the gRPC status code name."""

    code = "INTERNAL"


class InvalidRequest(ItifError, ValueError):
    """Malformed inference input: bad shape, token id outside the vocabulary, too long."""

    code = "INVALID_ARGUMENT"


class InvalidWeights(ItifError, ValueError):
    """Weights that do not fit the backbone, are not safetensors, or hold non-finite values."""

    code = "INVALID_ARGUMENT"


class InvalidConfig(ItifError, ValueError):
    """A tenants.yaml (or config.json) that fails validation; the message quotes the key path."""

    code = "INVALID_ARGUMENT"


class TenantNotFound(ItifError, KeyError):
    """Unknown tenant, or a tenant the caller may not see (both answer the same)."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "tenant not found"


class NoWeights(ItifError):
    """The tenant exists but has no valid weights loaded (never uploaded, or its file failed)."""

    code = "FAILED_PRECONDITION"


class Overloaded(ItifError):
    """Queue full, message or upload too large, memory budget exceeded."""

    code = "RESOURCE_EXHAUSTED"


class Busy(Overloaded):
    """A transient overload: a limit that frees itself as calls finish (a tenant's calls in
    flight or queued, replies not yet read, an upload already running, the device out of memory
    for one batch). The same call may succeed later, so the answer carries a retry hint (gRPC
    ``retry-after`` and ``grpc-retry-pushback-ms`` trailers, HTTP 429 with ``Retry-After``:
    ``itif.server.errors.retry_hint``). Plain :class:`Overloaded` is a refusal that retrying
    does not cure (a message over its limit, a tenant over the memory budget)."""


class Unauthenticated(ItifError):
    """Missing or wrong bearer token."""

    code = "UNAUTHENTICATED"


class PermissionDenied(ItifError):
    """Authenticated, but the credential does not allow this operation (e.g. admin RPCs)."""

    code = "PERMISSION_DENIED"


class Unavailable(ItifError):
    """Only while starting or shutting down."""

    code = "UNAVAILABLE"


class Unimplemented(ItifError):
    """The call exists but this daemon does not serve it (Generate on an encoder backbone,
    Infer on a decoder backbone)."""

    code = "UNIMPLEMENTED"


class DeadlineExceeded(ItifError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ItifError):
    code = "CANCELLED"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the host or the device ran out of memory: ``MemoryError``, torch's
    ``OutOfMemoryError`` ("CUDA out of memory"), CuPy's ``OutOfMemoryError`` and
    ``cudaErrorMemoryAllocation`` ("out of memory"), torch's CPU allocator ("can't allocate
    memory"). The one test every layer uses (the
    scheduler's ``OutOfMemory``, the server's RESOURCE_EXHAUSTED)."""
    if isinstance(exc, MemoryError):
        return True
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text  # torch's CPU allocator
