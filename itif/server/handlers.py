"""One way to wrap a gRPC method handler, whichever of the four kinds it is.

The server's interceptors (the metrics' call counter, the malformed-request guard) each change
what every method does around its behaviour; :func:`wrap_handler` gives them a handler of the
same kind (unary-unary, unary-stream, stream-unary, stream-stream) whose behaviour runs the
original one inside their hooks.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Awaitable, Callable, ContextManager

import grpc

__all__ = ["wrap_handler"]

#: ``prepare(request, context, streamed)``: what the behaviour receives instead of the request
#: (``streamed``: it is the request iterator of a client-streaming method).
Prepare = Callable[[Any, Any, bool], Awaitable[Any]]
#: ``guard(context)``: a context manager held for the whole call, from before ``prepare`` to the
#: last response; its ``__exit__`` sees the exception the call ends with (a dropped stream's
#: ``GeneratorExit`` included).
Guard = Callable[[Any], ContextManager[Any]]
#: ``context_of(held, context)``: the context the original behaviour receives, given what the
#: guard's ``__enter__`` returned (a wrapper of the call's own context).
ContextOf = Callable[[Any, Any], Any]


def _no_guard(context: Any) -> ContextManager[Any]:
    return contextlib.nullcontext()


def wrap_handler(handler: grpc.RpcMethodHandler, *, guard: Guard | None = None,
                 prepare: Prepare | None = None,
                 request_deserializer: Callable[[bytes], Any] | None = None,
                 response_serializer: Callable[[Any], bytes] | None = None,
                 context_of: ContextOf | None = None,
                 ) -> grpc.RpcMethodHandler:
    """``handler``'s kind and serializers (``request_deserializer`` and ``response_serializer``
    replace its own when given), with a behaviour that runs the original inside ``guard``
    after ``prepare``, given ``context_of``'s context when that is given. The original may be
    sync or async; a streaming one may yield, async-yield, or write through ``context.write``."""
    guard = guard or _no_guard
    kw = dict(request_deserializer=request_deserializer or handler.request_deserializer,
              response_serializer=response_serializer or handler.response_serializer)
    unary_kind = bool(handler.unary_unary or handler.stream_unary)
    streamed = bool(handler.stream_unary or handler.stream_stream)  # the client streams
    inner = (handler.unary_unary or handler.stream_unary or handler.unary_stream
             or handler.stream_stream)

    async def begin(held, request, context):
        """Both kinds' start, inside ``guard``: the context and request the original gets."""
        if context_of is not None:
            context = context_of(held, context)
        if prepare is not None:
            request = await prepare(request, context, streamed)
        return request, context

    if unary_kind:
        async def unary(request, context):
            with guard(context) as held:
                request, context = await begin(held, request, context)
                out = inner(request, context)
                return (await out) if inspect.isawaitable(out) else out

        make = (grpc.stream_unary_rpc_method_handler if streamed
                else grpc.unary_unary_rpc_method_handler)
        return make(unary, **kw)

    async def streaming(request, context):
        with guard(context) as held:
            request, context = await begin(held, request, context)
            out = inner(request, context)
            if inspect.isasyncgen(out):
                async for item in out:
                    yield item
            elif inspect.isawaitable(out):
                await out  # writes through context.write
            elif out is not None:
                for item in out:
                    yield item

    make = (grpc.stream_stream_rpc_method_handler if streamed
            else grpc.unary_stream_rpc_method_handler)
    return make(streaming, **kw)
