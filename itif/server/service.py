"""gRPC servicers: translate protobuf <-> domain objects and make one daemon call. Nothing else.

Authentication happens twice, on purpose: ``AuthInterceptor`` refuses a call without a valid
bearer token before any handler runs (streams included, so a refused upload writes nothing),
and each handler resolves the caller's identity for authorisation.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from itif.daemon import Daemon, Identity, State, TenantView
from itif.errors import DeadlineExceeded, InvalidRequest, ItifError, Unavailable
from itif.requests import numel
from itif.runtime.engine import OUTPUTS, Request, Result
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc
from itif.server.admission import Admission, finish_reply
from itif.server.errors import rpc, rpc_stream, status_of
from itif.server.generate import generate_call
from itif.server.handlers import wrap_handler
from itif.server.infer_calls import await_tickets, convert_inputs

log = logging.getLogger("itif.server")
SERVICE = itif_pb2.DESCRIPTOR.services_by_name["Itif"].full_name  # "itif.v1.Itif"
_PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _authorization(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls to the itif service without a valid token, before the handler runs."""

    def __init__(self, daemon: Daemon, admission: Admission | None = None) -> None:
        self.daemon = daemon
        self.admission = admission if admission is not None else Admission(daemon)
        self._wrapped: dict[tuple[str, str], grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        if details.method.startswith(_PUBLIC_PREFIXES):
            return reject_malformed(handler)
        try:
            who = self.daemon.identify(_authorization(details.invocation_metadata))
        except ItifError as e:
            code, msg = status_of(e)
        else:
            # counted in (or refused) before its request is even parsed: itif.server.admission;
            # one wrapper per method and caller, made once (this runs for every call)
            key = (details.method, who.tenant or "")
            wrapped = self._wrapped.get(key)
            if wrapped is None:
                if len(self._wrapped) >= 4096:  # tenants come and go with reloads
                    self._wrapped.clear()
                wrapped = self._wrapped[key] = self.admission.wrap(handler, key[1])
            return wrapped

        async def refuse(request_or_iterator, context):
            await context.abort(code, msg)

        if handler.request_streaming and not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


_MALFORMED = object()  # what a request message that does not parse deserializes to


def reject_malformed(handler):
    """The same handler, but a request message that does not parse answers INVALID_ARGUMENT
    (left to gRPC it would be UNKNOWN, with the parser's exception text in the details)."""
    parse = None if handler is None else handler.request_deserializer
    if parse is None:
        return handler

    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except Exception:  # noqa: BLE001 - DecodeError, bad UTF-8 in a string field, ...
            return _MALFORMED

    async def refuse(context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "the request message is not a valid protobuf of its type")

    async def messages(request_iterator, context):
        async for msg in request_iterator:
            if msg is _MALFORMED:
                await refuse(context)
            yield msg

    async def prepare(request, context, streamed: bool):
        if streamed:
            return messages(request, context)
        if request is _MALFORMED:
            await refuse(context)
        return request

    return wrap_handler(handler, prepare=prepare, request_deserializer=deserialize)


# ---- protobuf <-> domain ------------------------------------------------------------------
def _tensor(name: str, a: np.ndarray) -> itif_pb2.Tensor:
    a = np.ascontiguousarray(a, dtype="<f4")
    return itif_pb2.Tensor(name=name, shape=a.shape, data=a.tobytes())


def _request(daemon: Daemon, inp: itif_pb2.InferInput, outputs, index: int = 0,
             tenant: str = "") -> Request:
    kind = inp.WhichOneof("input")
    outs = tuple(outputs) or None
    for o in outs or ():
        if o not in OUTPUTS:
            raise InvalidRequest(f"unknown output {o!r}; choose from {OUTPUTS}")
    if kind == "input_ids":
        types = list(inp.input_ids.token_type_ids) or None
        return Request(tenant, input_ids=np.asarray(inp.input_ids.ids, np.int64),
                       token_type_ids=types, outputs=outs)
    if kind == "text":
        return Request(tenant, input_ids=daemon.tokenize(inp.text), outputs=outs)
    if kind == "pixel_values":
        t = inp.pixel_values
        n = numel(f"{index}: pixel_values", t.shape)
        if n * 4 != len(t.data):
            raise InvalidRequest(
                f"input {index}: pixel_values data has {len(t.data)} bytes; shape "
                f"{list(t.shape)} needs {n * 4}")
        return Request(tenant, pixel_values=np.frombuffer(t.data, "<f4").reshape(tuple(t.shape)),
                       outputs=outs)
    raise InvalidRequest(f"input {index}: set one of input_ids, text or pixel_values")


def _response(res: Result, sha: str) -> itif_pb2.InferResponse:
    """``res`` as sent. ``weights_sha256``: the weights that produced it (``Result.weights``,
    read with the forward's own snapshot of the store), else ``sha``."""
    return itif_pb2.InferResponse(outputs=[_tensor(k, v) for k, v in res.as_dict().items()],
                                  weights_sha256=res.weights or sha)


def _tenant_info(v: TenantView) -> itif_pb2.TenantInfo:
    d = v.delta or {}
    return itif_pb2.TenantInfo(
        id=v.id, state=v.state.value, sha256=v.sha256, weight_bytes=v.weight_bytes,
        exclusive_bytes=v.exclusive_bytes, num_labels=v.num_labels, queue_depth=v.queue_depth,
        error=v.error, tier=v.tier, host_bytes=v.host_bytes, compress=v.compress,
        delta_max_abs_error=d.get("max_abs_error"), stored_bytes=d.get("stored_bytes", 0))


class ItifService(itif_pb2_grpc.ItifServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _who(self, context) -> Identity:
        if not self.daemon.ready:
            raise Unavailable("the daemon is starting or shutting down")
        return self.daemon.identify(_authorization(context.invocation_metadata()))

    @rpc
    async def UploadWeights(self, request_iterator, context):
        who = self._who(context)
        d = self.daemon
        messages = _idle_limited(request_iterator, d.config.server.upload_idle_s)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidRequest("the first UploadWeights message must carry the header")
        h = first.header
        up = d.begin_upload(who, h.tenant, h.sha256, h.total_size)
        commit = None
        try:
            try:
                async for msg in messages:
                    if msg.WhichOneof("payload") != "chunk":
                        raise InvalidRequest("only chunks may follow the UploadWeights header")
                    up.write(msg.chunk)
            except BaseException:  # a bad or broken stream, or the client went away
                up.abort()  # removes the temp file and frees the tenant's upload lock
                raise
            # From here the commit owns the upload (Upload.commit aborts it on its own
            # failures) and runs to its end even if this call is cancelled: aborting under a
            # running commit would free the tenant's upload lock, and delete the file, while
            # the commit still uses them.
            commit = asyncio.ensure_future(asyncio.to_thread(d.finish_upload, h.tenant, up, who))
            commit.add_done_callback(_retrieve)
            view = await asyncio.shield(commit)
        except BaseException as e:  # one line per upload not stored (successes log theirs)
            if isinstance(e, asyncio.CancelledError) and commit is not None:
                raise  # the commit runs on and logs what it did
            why = (f"{e.code}: {e}" if isinstance(e, ItifError) else
                   "the client went away" if isinstance(e, asyncio.CancelledError) else
                   f"{type(e).__name__}: {e}")
            log.warning("tenant %r: upload of %d bytes not stored: %s", h.tenant,
                        h.total_size, why[:300])
            raise
        shared = view.weight_bytes - view.exclusive_bytes
        return itif_pb2.UploadWeightsResponse(
            tenant=h.tenant, sha256=view.sha256, bytes=h.total_size,
            weight_bytes=view.weight_bytes, shared_bytes=shared)

    def _sha(self, tenant: str, default: str = "") -> str:
        """The tenant's current weights sha256; ``default`` once the tenant was removed by a
        config reload (its accepted calls still finish and are answered)."""
        return self.daemon.tenants.sha256(tenant, default)

    async def _run(self, context, who, tenant, requests, priority):
        return await await_tickets(self.daemon, who, tenant, requests, context.time_remaining(),
                                   priority, padded_rows=False)

    @rpc
    async def Infer(self, request, context):
        who = self._who(context)
        req = _request(self.daemon, request.input, request.outputs, tenant=request.tenant)
        sha = self._sha(request.tenant)
        (res,) = await self._run(context, who, request.tenant, [req], request.priority)
        return await finish_reply(self.daemon, _response(res, self._sha(request.tenant, sha)))

    @rpc
    async def InferBatch(self, request, context):
        who = self._who(context)
        if not request.inputs:
            raise InvalidRequest("InferBatch needs at least one input")
        reqs = await convert_inputs(
            self.daemon, who, request.tenant, len(request.inputs),
            lambda: [_request(self.daemon, inp, request.outputs, i, request.tenant)
                     for i, inp in enumerate(request.inputs)])
        sha = self._sha(request.tenant)
        results = await self._run(context, who, request.tenant, reqs, request.priority)
        sha = self._sha(request.tenant, sha)
        reply = itif_pb2.InferBatchResponse(results=[_response(r, sha) for r in results])
        del results
        return await finish_reply(self.daemon, reply)

    @rpc
    async def GetTenant(self, request, context):
        return _tenant_info(self.daemon.get_tenant(self._who(context), request.tenant))

    @rpc
    async def ListTenants(self, request, context):
        views = self.daemon.list_tenants(self._who(context))
        return itif_pb2.ListTenantsResponse(tenants=[_tenant_info(v) for v in views])

    @rpc_stream
    async def Generate(self, request, context):
        """Server-streaming: ``itif.server.generate``."""
        who = self._who(context)
        async for reply in generate_call(self.daemon, who, request, context):
            yield reply

    @rpc
    async def DeleteWeights(self, request, context):
        who = self._who(context)
        deleted, freed = await asyncio.to_thread(self.daemon.delete_weights, who, request.tenant)
        return itif_pb2.DeleteWeightsResponse(tenant=request.tenant, deleted=deleted,
                                              freed_bytes=freed)


async def _idle_limited(messages, idle_s: float):
    """The messages of a client stream; DeadlineExceeded when the client sends no bytes for
    ``idle_s`` seconds (an idle upload must not hold its tenant's upload slot forever; empty
    chunks do not count as sending)."""
    it = aiter(messages)
    loop = asyncio.get_running_loop()
    end = loop.time() + idle_s
    while True:
        try:
            msg = await asyncio.wait_for(anext(it), max(0.0, end - loop.time()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the upload sent nothing for {idle_s:g} s (server.upload_idle_s); it was "
                "aborted and nothing of it was stored") from None
        if msg.WhichOneof("payload") != "chunk" or msg.chunk:
            end = loop.time() + idle_s
        yield msg


def _retrieve(fut: asyncio.Future) -> None:
    """Mark the outcome of a commit whose caller may be gone as seen (no asyncio warning)."""
    if not fut.cancelled():
        fut.exception()


def kernel_health_name(k) -> str:
    """The health List entry of a degraded kernel (``itif.ops.dispatch.KernelState``)."""
    return f"itif.kernel/{k.op}/{k.device}/{k.dtype}"


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: "" and "itif.v1.Itif" answer for the daemon without a token (probes);
    a tenant id as service name answers for that tenant, to its own token or the admin only
    (others get NOT_FOUND, as for an unknown tenant)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.shutting_down = False

    def _status(self, service: str, metadata) -> int:
        S = health_pb2.HealthCheckResponse
        if service in ("", SERVICE):
            return S.SERVING if self.daemon.ready and not self.shutting_down else S.NOT_SERVING
        who = self.daemon.identify(_authorization(metadata))
        view = self.daemon.get_tenant(who, service)  # NotFound: unknown and invisible alike
        ok = self.daemon.ready and view.state is State.READY
        return S.SERVING if ok else S.NOT_SERVING

    @rpc
    async def Check(self, request, context):
        status = self._status(request.service, context.invocation_metadata())
        return health_pb2.HealthCheckResponse(status=status)

    @rpc
    async def List(self, request, context):
        """The daemon's own entries ("" and itif.v1.Itif), plus one NOT_SERVING entry
        ``itif.kernel/<op>/<device>/<dtype>`` per degraded kernel: an op whose CUDA kernel
        failed the start-up self-test or its build, which the torch reference serves instead
        (the daemon itself keeps serving). Tenants are never listed here, as this method needs
        no token. (Left to the generated base class, every call would log a
        NotImplementedError traceback.)"""
        status = self._status("", ())
        S = health_pb2.HealthCheckResponse
        statuses = {name: S(status=status) for name in ("", SERVICE)}
        for k in self.daemon.degraded_kernels():
            statuses[kernel_health_name(k)] = S(status=S.NOT_SERVING)
        return health_pb2.HealthListResponse(statuses=statuses)

    async def Watch(self, request, context):
        last = None
        while True:
            try:
                status = self._status(request.service, context.invocation_metadata())
            except ItifError as e:
                code, msg = status_of(e)
                await context.abort(code, msg)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(0.5)
