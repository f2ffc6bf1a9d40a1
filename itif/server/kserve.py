"""KServe v2 / Triton gRPC protocol (``inference.GRPCInferenceService``) on the daemon's port.

Every tenant is a "model" named by its tenant id, with one version, ``"1"``. This module only
translates protobuf (the classes tritonclient ships) to and from the protocol-neutral
``itif.server.kserve_core`` (which the REST routes share); errors go through the same ``rpc``
decorator as the itif API, so the status codes are the same.

Auth is the itif API's: ``authorization: Bearer <token>`` metadata. ServerLive and ServerReady
answer without a token (probes); everything else needs one. A tenant sees only its own model:
another tenant's model answers exactly like an unknown one (ModelReady: ``ready=false``; the rest:
NOT_FOUND). RepositoryModelLoad uploads weights (the tenant's token or the admin's), through the
very path UploadWeights takes (size cap, sha256, safetensors validation, memory budget, durable
commit, then swap); RepositoryModelUnload deletes them (admin only, DeleteWeights semantics).

Tensors (the batch dimension first; every row is one request of the tenant, all rows queued
together, all-or-nothing):

- ``input_ids`` INT64 (or INT32) ``[batch, seq]``, optional ``attention_mask`` (each row a prefix
  of ones: the row is cut to its mask length) and ``token_type_ids``, same shape;
- ``TEXT`` BYTES ``[batch]`` or ``[batch, 1]`` when the backbone ships tokenizer.json;
- ``pixel_values`` FP32 ``[batch, C, H, W]`` for ViT.

Outputs (FP32) by name, default ``logits`` for a tenant with a head, else ``pooled``:
``logits [batch, labels]``, ``pooled [batch, hidden]``, ``last_hidden_state [batch, L, hidden]``
with rows zero-padded to the longest row of the call (a row's own length is its mask length).
Inputs may come as ``raw_input_contents`` (what tritonclient sends) or typed ``contents``; outputs
always go back as ``raw_output_contents``.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from itif.daemon import Daemon, Identity
from itif.errors import InvalidRequest
from itif.server.admission import finish_reply
from itif.server.errors import rpc
from itif.server.infer_calls import convert_inputs
from itif.server.kserve_core import (
    BOOL,
    OUTPUT_PARAMS,
    REQUEST_PARAMS,
    SEQUENCE_ID,
    UINT64,
    VERSION,
    KServeCore,
    check_params,
)
from itif.server.service import AuthInterceptor, reject_malformed
from itif.server.tensors import decode_raw, decode_typed

log = logging.getLogger("itif.server.kserve")

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
#: Methods that answer without a token (liveness and readiness probes).
PROBES = frozenset({f"/{SERVICE}/ServerLive", f"/{SERVICE}/ServerReady"})
#: datatype -> its typed contents field
_CONTENTS = {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents",
             "BYTES": "bytes_contents"}


def _authorization(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class ProbeAuthInterceptor(AuthInterceptor):
    """itif's auth interceptor, except that the KServe probes (ServerLive, ServerReady) pass
    without a token, like grpc.health.v1."""

    async def intercept_service(self, continuation, details):
        if details.method in PROBES:
            return reject_malformed(await continuation(details))
        return await super().intercept_service(continuation, details)


def _decode(t, raw: bytes | None):
    """One input tensor as a numpy array (BYTES: an object array of ``bytes``)."""
    if raw is not None:
        return decode_raw(t.name, t.datatype, t.shape, raw)
    field = _CONTENTS.get(t.datatype)
    if field is None:
        return decode_raw(t.name, t.datatype, t.shape, b"")  # names the unsupported datatype
    return decode_typed(t.name, t.datatype, t.shape, getattr(t.contents, field),
                        f"contents.{field}")


#: The InferParameter fields that may carry each type of ``kserve_core``'s parameters.
_CHOICES = {UINT64: ("int64_param", "uint64_param"), BOOL: ("bool_param",),
            SEQUENCE_ID: ("int64_param", "uint64_param", "string_param")}


def _params(parameters, kinds: dict[str, str], where: str) -> dict:
    """A parameters map's values (None where unset); one of ``kinds`` carried by a field its
    type does not take (a ``timeout`` as ``string_param``) is refused, naming the fields that
    take it, and so is a value out of its range (a negative ``int64_param`` timeout)."""
    out = {}
    for key, p in parameters.items():
        which = p.WhichOneof("parameter_choice")
        kind = kinds.get(key)
        if kind is not None and which not in _CHOICES[kind]:
            raise InvalidRequest(
                f"{where}: parameter {key!r} must be {kind} ({' or '.join(_CHOICES[kind])}), "
                f"got {which or 'no value'}")
        out[key] = getattr(p, which) if which else None
    check_params(out, kinds, where)
    return out


def _parse(d: dict, message):
    return json_format.ParseDict(d, message)


# ---- the servicer -----------------------------------------------------------------------------
class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, daemon: Daemon, health=None) -> None:
        self.daemon = daemon
        self.core = KServeCore(daemon, health)

    def _who(self, context) -> Identity:
        return self.core.who(_authorization(context.invocation_metadata()))

    # -- server --------------------------------------------------------------------------------
    @rpc
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.server_ready())

    @rpc
    async def ServerMetadata(self, request, context):
        meta = self.core.server_metadata(_authorization(context.invocation_metadata()))
        return _parse(meta, pb.ServerMetadataResponse())

    # -- models --------------------------------------------------------------------------------
    @rpc
    async def ModelReady(self, request, context):
        ready = self.core.model_ready(self._who(context), request.name, request.version)
        return pb.ModelReadyResponse(ready=ready)

    @rpc
    async def ModelMetadata(self, request, context):
        meta = await asyncio.to_thread(self.core.model_metadata, self._who(context), request.name,
                                       request.version)  # may read a cold tenant's file once
        return _parse(meta, pb.ModelMetadataResponse())

    @rpc
    async def ModelConfig(self, request, context):
        config = await asyncio.to_thread(self.core.model_config, self._who(context), request.name,
                                         request.version)
        return pb.ModelConfigResponse(config=_parse(config, mc.ModelConfig()))

    @rpc
    async def ModelStatistics(self, request, context):
        stats = self.core.statistics(self._who(context), request.name, request.version)
        return _parse(stats, pb.ModelStatisticsResponse())

    # -- repository ----------------------------------------------------------------------------
    @rpc
    async def RepositoryIndex(self, request, context):
        models = self.core.repository_index(self._who(context), request.ready)
        return _parse({"models": models}, pb.RepositoryIndexResponse())

    @rpc
    async def RepositoryModelLoad(self, request, context):
        who = self._who(context)
        files, config = {}, None
        for key, p in request.parameters.items():
            if key == "config":
                if p.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidRequest("parameter 'config' must be a JSON string")
                config = p.string_param
            elif key.startswith("file:"):
                if p.WhichOneof("parameter_choice") != "bytes_param":
                    raise InvalidRequest(f"parameter {key!r} must carry bytes")
                files[key] = p.bytes_param
        await self.core.load(who, request.model_name, files, config)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request, context):
        await self.core.unload(self._who(context), request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- inference -----------------------------------------------------------------------------
    @rpc
    async def ModelInfer(self, request, context):
        who = self._who(context)
        name = request.model_name
        self.core.model(who, name, request.model_version)  # NOT_FOUND before any tensor check
        raw = list(request.raw_input_contents)
        if raw and len(raw) != len(request.inputs):
            raise InvalidRequest(
                f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
                "(raw contents must be used for every input or for none)")

        def decode() -> dict:
            tensors: dict = {}
            for i, t in enumerate(request.inputs):
                self.core.check_input(name, t.name, tensors)
                tensors[t.name] = _decode(t, raw[i] if raw else None)
            return tensors

        params = _params(request.parameters, REQUEST_PARAMS, "the inference request")
        outputs = [o.name for o in request.outputs]
        classification = {o.name for o in request.outputs
                          if _params(o.parameters, OUTPUT_PARAMS,
                                     f"output {o.name!r}").get("classification")}
        rows = max((t.shape[0] for t in request.inputs if len(t.shape)), default=0)
        tensors = await convert_inputs(self.daemon, who, name, rows, decode)
        out = await self.core.infer(who, name, request.model_version, tensors, outputs,
                                    classification, params, context.time_remaining())
        reply = pb.ModelInferResponse(
            model_name=name, model_version=VERSION, id=request.id,
            outputs=[pb.ModelInferResponse.InferOutputTensor(name=n, datatype="FP32",
                                                             shape=a.shape) for n, a in out],
            raw_output_contents=[a.tobytes() for _, a in out])
        del out
        return await finish_reply(self.daemon, reply)  # over max_message_bytes: refused here

    # -- not offered (answers UNIMPLEMENTED; shared-memory status answers "none registered") ----
    async def ModelStreamInfer(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "ModelStreamInfer is not offered; use ModelInfer")
        yield pb.ModelStreamInferResponse()  # pragma: no cover - makes this a generator

    @rpc
    async def SystemSharedMemoryStatus(self, request, context):
        self._who(context)
        return pb.SystemSharedMemoryStatusResponse()

    @rpc
    async def CudaSharedMemoryStatus(self, request, context):
        self._who(context)
        return pb.CudaSharedMemoryStatusResponse()

    @rpc
    async def SystemSharedMemoryUnregister(self, request, context):
        self._who(context)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc
    async def CudaSharedMemoryUnregister(self, request, context):
        self._who(context)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def _unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "not offered by itif (shared memory, tracing, log settings)")

    SystemSharedMemoryRegister = _unimplemented
    CudaSharedMemoryRegister = _unimplemented
    TraceSetting = _unimplemented
    LogSettings = _unimplemented


def add_to_server(daemon: Daemon, server, health=None) -> KServeService:
    service = KServeService(daemon, health)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    return service


__all__ = ["KServeService", "ProbeAuthInterceptor", "PROBES", "SERVICE", "add_to_server"]
