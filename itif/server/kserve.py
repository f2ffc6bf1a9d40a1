"""KServe v2 / Triton gRPC protocol (``inference.GRPCInferenceService``) on the daemon's port.

Every tenant is a "model" named by its tenant id, with one version, ``"1"``. This module only
translates: protobuf (the classes tritonclient ships) <-> domain objects, then daemon calls; errors
go through the same ``rpc`` decorator as the itif API, so the status codes are the same.

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
import hashlib
import json
import logging
import math
import struct

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

import itif
from itif.daemon import Daemon, Identity, State, TenantView
from itif.errors import (
    DeadlineExceeded,
    InvalidRequest,
    InvalidWeights,
    NoWeights,
    TenantNotFound,
    Unavailable,
)
from itif.metrics import TenantCallStats
from itif.runtime.engine import OUTPUTS, Request
from itif.server.errors import rpc
from itif.server.service import AuthInterceptor, await_tickets, reject_malformed

log = logging.getLogger("itif.server.kserve")

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
#: Methods that answer without a token (liveness and readiness probes).
PROBES = frozenset({f"/{SERVICE}/ServerLive", f"/{SERVICE}/ServerReady"})
VERSION = "1"
PLATFORM = "itif"
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "binary_tensor_data",
              "parameters")
TEXT = "TEXT"
_TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", TEXT)
_NUMERIC = {  # datatype -> (numpy dtype, typed contents field)
    "INT64": ("<i8", "int64_contents"),
    "INT32": ("<i4", "int_contents"),
    "FP32": ("<f4", "fp32_contents"),
}
_STATE = {State.READY: "READY", State.LOADING: "LOADING", State.NO_WEIGHTS: "UNAVAILABLE",
          State.FAILED: "UNAVAILABLE"}
PADDING_NOTE = ("last_hidden_state rows are zero-padded to the longest row of the call; a row's "
                "own length is its attention_mask sum (or its token count)")


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


# ---- tensors ------------------------------------------------------------------------------------
def _numel(name: str, shape) -> int:
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"input {name!r}: shape {list(shape)} has a negative dimension")
    return math.prod(shape)


def _bytes_elements(name: str, raw: bytes) -> list[bytes]:
    """Split BYTES raw contents: each element is a 4-byte little-endian length, then the bytes."""
    out, i, n = [], 0, len(raw)
    view = memoryview(raw)
    while i < n:
        if i + 4 > n:
            raise InvalidRequest(f"input {name!r}: BYTES data ends inside a 4-byte length prefix")
        (k,) = struct.unpack_from("<I", raw, i)
        i += 4
        if k > n - i:
            raise InvalidRequest(
                f"input {name!r}: a BYTES element of {k} bytes runs past the end of the data")
        out.append(bytes(view[i : i + k]))
        i += k
    return out


def _decode(t, raw: bytes | None) -> np.ndarray:
    """One input tensor as a numpy array (BYTES: an object array of ``bytes``)."""
    shape = tuple(int(d) for d in t.shape)
    numel = _numel(t.name, shape)
    if t.datatype == "BYTES":
        items = _bytes_elements(t.name, raw) if raw is not None else list(t.contents.bytes_contents)
        if len(items) != numel:
            raise InvalidRequest(
                f"input {t.name!r}: {len(items)} BYTES elements; shape {list(shape)} needs {numel}")
        arr = np.empty(numel, dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    if t.datatype not in _NUMERIC:
        raise InvalidRequest(
            f"input {t.name!r}: datatype {t.datatype!r} is not supported here "
            f"(INT64, INT32, FP32, BYTES)")
    dtype, field = _NUMERIC[t.datatype]
    if raw is not None:
        size = np.dtype(dtype).itemsize
        if len(raw) != numel * size:
            raise InvalidRequest(
                f"input {t.name!r}: {len(raw)} bytes of raw data; shape {list(shape)} of "
                f"{t.datatype} needs {numel * size}")
        return np.frombuffer(raw, dtype).reshape(shape)
    values = getattr(t.contents, field)
    if len(values) != numel:
        raise InvalidRequest(
            f"input {t.name!r}: {len(values)} values in contents.{field}; shape {list(shape)} "
            f"needs {numel}")
    return np.asarray(values, dtype).reshape(shape)


def _output(name: str, a: np.ndarray):
    a = np.ascontiguousarray(a, dtype="<f4")
    return (pb.ModelInferResponse.InferOutputTensor(name=name, datatype="FP32", shape=a.shape),
            a.tobytes())


def _ints(name: str, a: np.ndarray, ids_shape: tuple[int, ...]) -> np.ndarray:
    if a.dtype.kind not in "iu":
        raise InvalidRequest(f"input {name!r} must be INT64 or INT32, got a float tensor")
    if a.shape != ids_shape:
        raise InvalidRequest(
            f"input {name!r} has shape {list(a.shape)}; it must match input_ids {list(ids_shape)}")
    return a.astype(np.int64, copy=False)


def _mask_lengths(mask: np.ndarray) -> np.ndarray:
    """Row lengths from an attention mask that is, in every row, ones followed by zeros."""
    ones = mask != 0
    lengths = ones.sum(axis=1)
    expected = np.arange(mask.shape[1])[None, :] < lengths[:, None]
    wrong = (ones != expected).any(axis=1) | ~np.isin(mask, (0, 1)).all(axis=1)
    if wrong.any():
        raise InvalidRequest(
            f"attention_mask row {int(np.flatnonzero(wrong)[0])} is not a run of ones followed "
            "by zeros: itif takes unpadded rows, so a mask may only mark right padding")
    if (lengths == 0).any():
        raise InvalidRequest(
            f"attention_mask row {int(np.flatnonzero(lengths == 0)[0])} has no tokens")
    return lengths


# ---- the servicer -----------------------------------------------------------------------------
class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, daemon: Daemon, health=None) -> None:
        self.daemon = daemon
        self.health = health  # HealthService: its shutting_down turns ServerReady false

    # -- helpers -------------------------------------------------------------------------------
    def _who(self, context) -> Identity:
        if not self.daemon.ready:
            raise Unavailable("the daemon is starting or shutting down")
        return self.daemon.identify(_authorization(context.invocation_metadata()))

    def _model(self, who: Identity, name: str, version: str = "") -> TenantView:
        view = self.daemon.get_tenant(who, name)  # unknown and invisible answer alike
        if version not in ("", VERSION):
            raise TenantNotFound(f"model {name!r} has no version {version!r} (only {VERSION!r})")
        return view

    def _loaded(self, who: Identity, name: str, version: str = ""):
        view = self._model(who, name, version)
        if view.state is not State.READY:
            why = f": {view.error}" if view.error else ""
            raise NoWeights(f"model {name!r} is not loaded ({view.state.name}){why}; load it with "
                            "load_model(name, files={'file:model.safetensors': ...})")
        return view, self.daemon.engine.tenant_info(name)

    def _signature(self, view: TenantView, info):
        """(inputs, outputs): (name, datatype, dims without the batch dimension, optional)."""
        spec = self.daemon.engine.spec
        if spec.is_text:
            tok = self.daemon.engine.tokenizer is not None
            inputs = [("input_ids", "INT64", [-1], tok), ("attention_mask", "INT64", [-1], True),
                      ("token_type_ids", "INT64", [-1], True)]
            if tok:
                inputs.append((TEXT, "BYTES", [1], True))
            seq = -1
        else:
            inputs = [("pixel_values", "FP32",
                       [spec.num_channels, spec.image_size, spec.image_size], False)]
            seq = spec.num_patches + 1
        outputs = []
        if info.num_labels:
            outputs.append(("logits", "FP32", [info.num_labels]))
        if info.has_pooler:
            outputs.append(("pooled", "FP32", [spec.hidden]))
        outputs.append(("last_hidden_state", "FP32", [seq, spec.hidden]))
        return inputs, outputs

    def _max_batch(self, name: str) -> int:
        d = self.daemon
        try:
            queue = d.config.tenant(name).max_queue
        except Exception:  # removed concurrently
            queue = 1
        return max(1, min(d.config.scheduler.max_batch_size, queue or 1))

    # -- server --------------------------------------------------------------------------------
    @rpc
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request, context):
        down = self.health is not None and self.health.shutting_down
        return pb.ServerReadyResponse(ready=self.daemon.ready and not down)

    @rpc
    async def ServerMetadata(self, request, context):
        self.daemon.identify(_authorization(context.invocation_metadata()))
        return pb.ServerMetadataResponse(name="itif", version=itif.__version__,
                                         extensions=list(EXTENSIONS))

    # -- models --------------------------------------------------------------------------------
    @rpc
    async def ModelReady(self, request, context):
        who = self._who(context)
        try:
            view = self._model(who, request.name, request.version)
        except TenantNotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.daemon.ready and view.state is State.READY)

    @rpc
    async def ModelMetadata(self, request, context):
        who = self._who(context)
        view, info = self._loaded(who, request.name, request.version)
        inputs, outputs = self._signature(view, info)
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name, versions=[VERSION], platform=PLATFORM,
            inputs=[T(name=n, datatype=dt, shape=[-1, *dims]) for n, dt, dims, _ in inputs],
            outputs=[T(name=n, datatype=dt, shape=[-1, *dims]) for n, dt, dims in outputs])

    @rpc
    async def ModelConfig(self, request, context):
        who = self._who(context)
        view, info = self._loaded(who, request.name, request.version)
        inputs, outputs = self._signature(view, info)
        types = {"INT64": mc.TYPE_INT64, "FP32": mc.TYPE_FP32, "BYTES": mc.TYPE_STRING}
        d = self.daemon
        params = {
            "backbone": d.engine.spec.name,
            "weights_sha256": view.sha256,
            "last_hidden_state": PADDING_NOTE,
            "attention_mask": "optional; every row must be ones then zeros (right padding)",
        }
        config = mc.ModelConfig(
            name=request.name, platform=PLATFORM, backend=PLATFORM,
            max_batch_size=self._max_batch(request.name),
            version_policy=mc.ModelVersionPolicy(
                latest=mc.ModelVersionPolicy.Latest(num_versions=1)),
            input=[mc.ModelInput(name=n, data_type=types[dt], dims=dims, optional=opt)
                   for n, dt, dims, opt in inputs],
            output=[mc.ModelOutput(name=n, data_type=types[dt], dims=dims)
                    for n, dt, dims in outputs],
            dynamic_batching=mc.ModelDynamicBatching(
                max_queue_delay_microseconds=int(d.config.scheduler.max_wait_ms * 1000)),
            parameters={k: mc.ModelParameter(string_value=v) for k, v in params.items()},
        )
        return pb.ModelConfigResponse(config=config)

    @rpc
    async def ModelStatistics(self, request, context):
        who = self._who(context)
        d = self.daemon
        if request.name:
            names = [self._model(who, request.name, request.version).id]
        else:
            names = [v.id for v in d.list_tenants(who)]
        metrics = d.metrics
        out = []
        for name in names:
            s = metrics.tenant_stats(name) if metrics is not None else TenantCallStats()
            D = pb.StatisticDuration
            # Triton counts compute_input, compute_infer and compute_output once per executed
            # call, and perf_analyzer aborts unless the three counts are equal. itif measures
            # one compute span (batch start to result, which includes copying the rows in and
            # the outputs out), so compute_infer carries it and the other two have the same
            # count with 0 ns: no time is reported twice.
            out.append(pb.ModelStatistics(
                name=name, version=VERSION, last_inference=s.last_inference_ms,
                inference_count=s.inferences, execution_count=s.executions,
                inference_stats=pb.InferStatistics(
                    success=D(count=s.success, ns=s.success_ns),
                    fail=D(count=s.fail, ns=s.fail_ns),
                    queue=D(count=s.queue, ns=s.queue_ns),
                    compute_input=D(count=s.compute, ns=0),
                    compute_infer=D(count=s.compute, ns=s.compute_ns),
                    compute_output=D(count=s.compute, ns=0)),
            ))
        return pb.ModelStatisticsResponse(model_stats=out)

    # -- repository ----------------------------------------------------------------------------
    @rpc
    async def RepositoryIndex(self, request, context):
        who = self._who(context)
        models = []
        for v in self.daemon.list_tenants(who):
            if request.ready and v.state is not State.READY:
                continue
            reason = v.error or ("no weights loaded" if v.state is State.NO_WEIGHTS else "")
            models.append(pb.RepositoryIndexResponse.ModelIndex(
                name=v.id, version=VERSION, state=_STATE[v.state], reason=reason))
        return pb.RepositoryIndexResponse(models=models)

    @rpc
    async def RepositoryModelLoad(self, request, context):
        who = self._who(context)
        name, d = request.model_name, self.daemon
        files = {}
        for key, p in request.parameters.items():
            if key == "config":
                if p.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidRequest("parameter 'config' must be a JSON string")
                try:
                    json.loads(p.string_param or "{}")
                except ValueError as e:
                    raise InvalidRequest(f"parameter 'config' is not JSON: {e}") from None
                continue  # the backbone fixes the model's configuration; nothing to apply
            if key.startswith("file:"):
                if p.WhichOneof("parameter_choice") != "bytes_param":
                    raise InvalidRequest(f"parameter {key!r} must carry bytes")
                files[key] = p.bytes_param
        if not files:
            view = self._model(who, name)
            if view.state is not State.READY:
                raise NoWeights(f"model {name!r} has no weights ({view.state.name}); send them "
                                "with files={'file:model.safetensors': <bytes>}")
            return pb.RepositoryModelLoadResponse()  # already loaded: nothing to do
        self._model(who, name)  # unknown and invisible models answer NOT_FOUND first
        if len(files) != 1 or not next(iter(files)).endswith(".safetensors"):
            raise InvalidWeights(
                f"send exactly one 'file:<name>.safetensors' parameter (got {sorted(files)})")
        (data,) = files.values()
        digest = hashlib.sha256(data).hexdigest()

        def upload() -> None:  # the UploadWeights path, in one worker thread
            up = d.begin_upload(who, name, digest, len(data))
            try:
                up.write(data)
                d.finish_upload(name, up)
            finally:
                up.abort()  # no-op after a commit; removes the temp file on any failure

        await asyncio.to_thread(upload)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request, context):
        who = self._who(context)
        await asyncio.to_thread(self.daemon.delete_weights, who, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- inference -----------------------------------------------------------------------------
    def _requests(self, request, view: TenantView) -> tuple[list[Request], tuple[str, ...]]:
        d = self.daemon
        spec = d.engine.spec
        raw = list(request.raw_input_contents)
        if raw and len(raw) != len(request.inputs):
            raise InvalidRequest(
                f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
                "(raw contents must be used for every input or for none)")
        tensors: dict[str, np.ndarray] = {}
        for i, t in enumerate(request.inputs):
            allowed = _TEXT_INPUTS if spec.is_text else ("pixel_values",)
            if t.name not in allowed:
                raise InvalidRequest(f"unknown input {t.name!r}; model {request.model_name!r} "
                                     f"takes {list(allowed)}")
            if t.name in tensors:
                raise InvalidRequest(f"input {t.name!r} is given twice")
            tensors[t.name] = _decode(t, raw[i] if raw else None)

        outs = []
        for o in request.outputs:
            if o.name not in OUTPUTS:
                raise InvalidRequest(f"unknown output {o.name!r}; choose from {list(OUTPUTS)}")
            if "classification" in o.parameters:
                raise InvalidRequest(f"output {o.name!r}: the classification extension is not "
                                     "supported; ask for logits")
            if o.name not in outs:
                outs.append(o.name)
        if not outs:
            outs = ["logits" if view.num_labels else "pooled"]
        outs = tuple(outs)

        if not spec.is_text:
            if "pixel_values" not in tensors:
                raise InvalidRequest("input 'pixel_values' FP32 [batch, C, H, W] is required")
            pix = tensors["pixel_values"]
            if pix.dtype != np.float32 or pix.ndim != 4 or pix.shape[0] < 1:
                raise InvalidRequest(f"input 'pixel_values' must be FP32 [batch, C, H, W], got "
                                     f"{pix.dtype} {list(pix.shape)}")
            return [Request("", pixel_values=pix[i], outputs=outs) for i in range(len(pix))], outs

        if TEXT in tensors:
            extra = sorted(set(tensors) - {TEXT})
            if extra:
                raise InvalidRequest(f"input 'TEXT' cannot be combined with {extra}")
            texts = tensors[TEXT]
            if texts.dtype != object or texts.ndim not in (1, 2) or texts.size < 1 or (
                    texts.ndim == 2 and texts.shape[1] != 1):
                raise InvalidRequest(f"input 'TEXT' must be BYTES [batch] or [batch, 1], got "
                                     f"{list(texts.shape)}")
            reqs = []
            for i, b in enumerate(texts.reshape(-1)):
                try:
                    s = b.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequest(f"input 'TEXT' element {i} is not UTF-8") from None
                reqs.append(Request("", input_ids=d.tokenize(s), outputs=outs))
            return reqs, outs

        if "input_ids" not in tensors:
            raise InvalidRequest("input 'input_ids' INT64 [batch, seq] is required"
                                 + (" (or 'TEXT')" if d.engine.tokenizer is not None else ""))
        ids = tensors["input_ids"]
        if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise InvalidRequest(f"input 'input_ids' must be INT64 [batch, seq] with batch, seq "
                                 f">= 1, got {ids.dtype} {list(ids.shape)}")
        ids = ids.astype(np.int64, copy=False)
        lengths = np.full(ids.shape[0], ids.shape[1])
        if "attention_mask" in tensors:
            lengths = _mask_lengths(_ints("attention_mask", tensors["attention_mask"], ids.shape))
        types = None
        if "token_type_ids" in tensors:
            types = _ints("token_type_ids", tensors["token_type_ids"], ids.shape)
        return [Request("", input_ids=ids[i, :n],
                        token_type_ids=None if types is None else types[i, :n], outputs=outs)
                for i, n in enumerate(lengths.tolist())], outs

    @staticmethod
    def _deadline(request, context) -> float | None:
        remaining = context.time_remaining()
        p = request.parameters.get("timeout")
        if p is not None:
            us = p.int64_param or p.uint64_param
            if us > 0:
                remaining = us / 1e6 if remaining is None else min(remaining, us / 1e6)
        return remaining

    @rpc
    async def ModelInfer(self, request, context):
        who = self._who(context)
        name = request.model_name
        view = self._model(who, name, request.model_version)
        for key in ("sequence_id", "sequence_start", "sequence_end"):
            p = request.parameters.get(key)
            if p is not None and p.WhichOneof("parameter_choice") and (
                    p.int64_param or p.uint64_param or p.bool_param or p.string_param):
                raise InvalidRequest(f"parameter {key!r}: itif models are not sequence models")
        reqs, outs = self._requests(request, view)
        remaining = self._deadline(request, context)
        results = await await_tickets(self.daemon, who, name, reqs, remaining)

        tensors, raws = [], []
        for o in outs:
            if o == "last_hidden_state":
                rows = [r.last_hidden_state for r in results]
                longest = max(len(r) for r in rows)
                a = np.zeros((len(rows), longest, rows[0].shape[-1]), np.float32)
                for i, r in enumerate(rows):
                    a[i, : len(r)] = r
            else:
                a = np.stack([getattr(r, o) for r in results])
            t, b = _output(o, a)
            tensors.append(t)
            raws.append(b)
        return pb.ModelInferResponse(model_name=name, model_version=VERSION, id=request.id,
                                     outputs=tensors, raw_output_contents=raws)

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
