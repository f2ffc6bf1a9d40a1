"""The counting interceptor: every gRPC call counted by (tenant, method, final status code) in
``itif.metrics.Metrics``. Put it FIRST in the server's interceptors (``itif.server.app``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from itif.metrics import CALL_TENANT, Metrics, status_code_name
from itif.server.handlers import wrap_handler


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Count every call by (tenant, method, final status code). Put it FIRST in the server's
    interceptors, so it also wraps the handlers other interceptors substitute (auth refusals)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        # the wrapper of each handler the chain returns, made once: the auth interceptor
        # returns one handler per (method, caller), kept; a refusal's is new each call
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, str, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rpartition("/")[2] or details.method
        hit = self._wrapped.get(id(handler))
        if hit is not None and hit[0] is handler and hit[1] == method:
            return hit[2]
        wrapped = wrap_handler(handler, guard=lambda ctx: _Counted(self.metrics, method, ctx),
                               context_of=_AbortCounts)
        if len(self._wrapped) >= 4096:
            self._wrapped.clear()
        self._wrapped[id(handler)] = (handler, method, wrapped)
        return wrapped


def _ended(context: Any) -> str | None:
    """DEADLINE_EXCEEDED when the call's deadline has passed, CANCELLED when the client
    cancelled it: what the client was told, whatever the handler raised after (a call whose
    deadline passed while it was queued was counted UNKNOWN: its abort raised)."""
    try:
        left = context.time_remaining()
        if left is not None and left <= 0:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED" if context.cancelled() else None
    except Exception:  # noqa: BLE001 - a context that cannot say: the caller's default
        return None


class _Counted:
    """Held for one call: the call's tenant holder is current inside it (``note_tenant``); on
    the way out the call is counted with its final status code. A call ended by
    ``context.abort`` is counted just before gRPC sends that status (``_AbortCounts``), so a
    client holding its answer finds the call already in /metrics."""

    __slots__ = ("metrics", "method", "context", "holder", "start", "token", "done")

    def __init__(self, metrics: Metrics, method: str, context: Any) -> None:
        self.metrics, self.method, self.context = metrics, method, context

    def __enter__(self) -> "_Counted":
        self.holder, self.start, self.done = [""], time.perf_counter(), False
        self.token = CALL_TENANT.set(self.holder)
        return self

    def count(self, code: str) -> None:
        """Count the call, once, with ``code``."""
        if not self.done:
            self.done = True
            self.metrics.observe_rpc(self.holder[0], self.method, code,
                                     time.perf_counter() - self.start)

    def __exit__(self, typ, exc, tb) -> bool:
        if typ is None or issubclass(typ, grpc.aio.AbortError):
            code = None  # the status the handler set, or OK
        elif issubclass(typ, (asyncio.CancelledError, GeneratorExit)):
            code = _ended(self.context) or "CANCELLED"
        else:  # what gRPC answers for an exception that escapes, unless gRPC had ended the
            code = _ended(self.context) or "UNKNOWN"  # call (then abort itself raises)
        try:
            CALL_TENANT.reset(self.token)
        except ValueError:  # finalised in another context (a dropped stream)
            pass
        self.count(code or status_code_name(self.context.code()) or "OK")
        return False


class _AbortCounts:
    """The context the handlers below the counter receive: the call's own, except that
    ``abort`` counts the call before it has gRPC send the status (gRPC's ``abort`` sends and
    only then raises: counted on the way out, the count trailed the client's answer)."""

    __slots__ = ("_context", "_counted")

    def __init__(self, counted: _Counted, context: Any) -> None:
        self._context, self._counted = context, counted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code, details: str = "", *args: Any, **kwargs: Any) -> None:
        self._counted.count(_ended(self._context) or status_code_name(code) or "UNKNOWN")
        await self._context.abort(code, details, *args, **kwargs)
