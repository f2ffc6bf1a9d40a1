"""KServe v2 / Open Inference Protocol over HTTP/REST (what ``tritonclient.http`` speaks).

The same protocol as the gRPC servicer (``itif.server.kserve``), through the same
protocol-neutral core (``itif.server.kserve_core``): every tenant is a model with version
``"1"``, the same tensors and outputs, the same auth (``Authorization: Bearer <token>``; the
health probes need none) and the same answers, with the gRPC status mapped to its HTTP status
and the error body ``{"error": "<message>"}``.

Inference takes JSON tensors (``data`` flat or nested, row-major; BYTES as strings) and the
binary tensor extension: with an ``Inference-Header-Content-Length: N`` header the first N bytes
of the body are the JSON and the rest holds the inputs that carry
``"parameters": {"binary_data_size": n}``, in order (BYTES with their 4-byte length prefixes).
An output comes back as binary data when it asks for it (``"parameters": {"binary_data": true}``)
or, for outputs that do not say, when the request sets ``binary_data_output``; the answer then
carries ``Inference-Header-Content-Length`` too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from itif.errors import InvalidRequest, Unavailable
from itif.server.http.common import (
    authorization,
    byte_count,
    endpoint,
    field,
    json_object,
    read_body,
)
from itif.server.json_procs import ANSWER_NUMBERS, IN_THREAD, JsonProcs, json_bytes, load_infer
from itif.server.kserve_core import (
    BOOL,
    OUTPUT_PARAMS,
    REQUEST_PARAMS,
    UINT64,
    VERSION,
    KServeCore,
    check_params,
)
from itif.server.tensors import decode_raw

HEADER_LENGTH = "inference-header-content-length"


def error(status: int, code: str, message: str) -> Response:
    """KServe's error body."""
    return JSONResponse({"error": message}, status_code=status)


def _ok(body: Any = None) -> Response:
    return Response(status_code=200) if body is None else JSONResponse(body)


def _name_version(request: Request) -> tuple[str, str]:
    p = request.path_params
    return p["name"], p.get("version", "")


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(the JSON, the binary data) of an inference request body."""
    if header_length is None:
        return body, b""
    n = byte_count(header_length)
    if n is None or n > len(body):
        raise InvalidRequest(f"Inference-Header-Content-Length {header_length[:32]!r} is not a "
                             f"byte count within the body ({len(body)} bytes)")
    return body[:n], body[n:]


def _tensors(core: KServeCore, model: str, req: dict, binary: bytes) -> dict:
    inputs = field(req, "inputs", list, "the inference request")
    tensors: dict = {}
    offset = 0
    for i, t in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequest(f"{where} must be an object")
        name = field(t, "name", str, where)
        core.check_input(model, name, tensors)
        where = f"input {name!r}"
        datatype = field(t, "datatype", str, where)
        shape = field(t, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidRequest(f"{where}: shape must be a list of integers, got {shape!r:.100}")
        params = field(t, "parameters", dict, where, {})
        check_params(params, _INPUT_PARAMS, where)
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in t:
                raise InvalidRequest(f"{where}: give either 'data' or binary_data_size, not both")
            if offset + size > len(binary):
                raise InvalidRequest(f"{where}: binary_data_size {size} runs past the binary data "
                                     f"({len(binary) - offset} bytes left)")
            tensors[name] = decode_raw(name, datatype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in t:
            # a Decoded: json_procs.load_infer decoded it with the body (it decodes every input
            # that passes the checks above)
            tensors[name] = t["data"].tensor()
        else:
            raise InvalidRequest(f"{where} has neither 'data' nor a binary_data_size parameter")
    if offset != len(binary):
        raise InvalidRequest(f"{len(binary) - offset} bytes of binary data follow the inputs "
                             "that no input's binary_data_size claims")
    return tensors


#: The parameters REST reads besides the protocol-neutral ones (``kserve_core``): of the call,
#: ``binary_data_output``; of an output, ``binary_data`` (the binary tensor data extension).
_REQUEST_PARAMS = {**REQUEST_PARAMS, "binary_data_output": BOOL}
_OUTPUT_PARAMS = {**OUTPUT_PARAMS, "binary_data": BOOL}
_INPUT_PARAMS = {"binary_data_size": UINT64}


def _outputs(req: dict) -> tuple[list[str], set[str], dict[str, bool]]:
    """(names, those asking for classification, binary_data per output that says)."""
    names, classification, binary = [], set(), {}
    for i, o in enumerate(field(req, "outputs", list, "the inference request", [])):
        if not isinstance(o, dict):
            raise InvalidRequest(f"outputs[{i}] must be an object")
        name = field(o, "name", str, f"outputs[{i}]")
        params = field(o, "parameters", dict, f"output {name!r}", {})
        check_params(params, _OUTPUT_PARAMS, f"output {name!r}")
        if params.get("classification"):
            classification.add(name)
        if "binary_data" in params:
            binary[name] = params["binary_data"]
        names.append(name)
    return names, classification, binary


async def _answer(procs: JsonProcs, answer: dict, out: list, binary: dict[str, bool]) -> Response:
    """The inference answer: JSON, or JSON then the binary outputs in order (more than
    :data:`ANSWER_NUMBERS` JSON numbers written by ``procs``)."""
    tensors, blobs, numbers = [], [], 0
    for o, a in out:
        t: dict[str, Any] = {"name": o, "datatype": "FP32", "shape": list(a.shape)}
        if binary[o]:
            blob = a.tobytes()
            t["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            t["data"] = a  # json_bytes writes it as a flat list
            numbers += a.size
        tensors.append(t)
    obj = {**answer, "outputs": tensors}
    head = await procs.run(json_bytes, obj) if numbers > ANSWER_NUMBERS else json_bytes(obj)
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(b"".join([head, *blobs]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


class KServeRest:
    """The routes of the KServe v2 REST API; the handlers share one ``KServeCore``."""

    def __init__(self, daemon, health=None, *, max_body: int, admission=None,
                 procs: JsonProcs = IN_THREAD) -> None:
        self.daemon = daemon
        self.procs = procs  # parses large bodies, writes large answers (itif.server.json_procs)
        self.core = KServeCore(daemon, health)
        self.max_body = max_body
        self.admission = admission  # itif.server.admission.Admission; None: calls not counted

    def _who(self, request: Request):
        return self.core.who(authorization(request))

    async def _body(self, request: Request, empty_ok: bool = True) -> dict:
        return await json_object(await read_body(request, self.max_body), empty_ok=empty_ok,
                                 procs=self.procs)

    # -- health and server ---------------------------------------------------------------------
    @endpoint("kserve", "ServerLive", error, admit=False)
    async def live(self, request: Request) -> Response:
        return _ok()

    @endpoint("kserve", "ServerReady", error, admit=False)
    async def ready(self, request: Request) -> Response:
        if not self.core.server_ready():
            raise Unavailable("the daemon is starting or shutting down")
        return _ok()

    @endpoint("kserve", "ServerMetadata", error)
    async def server_metadata(self, request: Request) -> Response:
        return _ok(self.core.server_metadata(authorization(request)))

    # -- models --------------------------------------------------------------------------------
    @endpoint("kserve", "ModelReady", error)
    async def model_ready(self, request: Request) -> Response:
        name, version = _name_version(request)
        if not self.core.model_ready(self._who(request), name, version):
            # an unknown or invisible model answers like one that is not loaded (as on gRPC)
            return error(400, "FAILED_PRECONDITION", f"model {name[:64]!r} is not ready")
        return _ok()

    @endpoint("kserve", "ModelMetadata", error)
    async def model_metadata(self, request: Request) -> Response:
        return _ok(await asyncio.to_thread(self.core.model_metadata, self._who(request),
                                           *_name_version(request)))

    @endpoint("kserve", "ModelConfig", error)
    async def model_config(self, request: Request) -> Response:
        return _ok(await asyncio.to_thread(self.core.model_config, self._who(request),
                                           *_name_version(request)))

    @endpoint("kserve", "ModelStatistics", error)
    async def statistics(self, request: Request) -> Response:
        name, version = request.path_params.get("name", ""), request.path_params.get("version", "")
        return _ok(self.core.statistics(self._who(request), name, version))

    # -- repository ----------------------------------------------------------------------------
    @endpoint("kserve", "RepositoryIndex", error)
    async def repository_index(self, request: Request) -> Response:
        who = self._who(request)
        ready = field(await self._body(request), "ready", bool, "the request body", False)
        return _ok(self.core.repository_index(who, ready))

    @endpoint("kserve", "RepositoryModelLoad", error)
    async def load(self, request: Request) -> Response:
        who = self._who(request)
        body = await self._body(request)
        params = field(body, "parameters", dict, "the request body", {})
        config = field(params, "config", str, "parameters", None)
        files = {}
        for key, value in params.items():
            if key.startswith("file:"):
                if not isinstance(value, str):
                    raise InvalidRequest(f"parameter {key!r} must be a base64 string")
                try:
                    files[key] = base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError):
                    raise InvalidRequest(f"parameter {key!r} is not valid base64") from None
        await self.core.load(who, request.path_params["name"], files, config)
        return _ok()

    @endpoint("kserve", "RepositoryModelUnload", error)
    async def unload(self, request: Request) -> Response:
        who = self._who(request)
        await self._body(request)  # {"parameters": {"unload_dependents": ...}}: nothing to do
        await self.core.unload(who, request.path_params["name"])
        return _ok()

    # -- inference -----------------------------------------------------------------------------
    @endpoint("kserve", "ModelInfer", error)
    async def infer(self, request: Request) -> Response:
        who = self._who(request)
        name, version = _name_version(request)
        self.core.model(who, name, version)  # 404 before any tensor check, as on gRPC
        head, binary = _split(await read_body(request, self.max_body),
                              request.headers.get(HEADER_LENGTH))
        # over OFFLOAD_BYTES parsed, and each input's data decoded, off the loop (procs)
        req = await json_object(head, "the inference request", procs=self.procs, load=load_infer)
        params = field(req, "parameters", dict, "the inference request", {})
        check_params(params, _REQUEST_PARAMS, "the inference request")
        tensors = _tensors(self.core, name, req, binary)
        outputs, classification, binary_by_output = _outputs(req)
        binary_default = params.get("binary_data_output", False)
        out = await self.core.infer(who, name, version, tensors, outputs, classification, params)

        answer: dict[str, Any] = {"model_name": name, "model_version": VERSION}
        if isinstance(req.get("id"), str) and req["id"]:
            answer["id"] = req["id"]
        binary = {o: binary_by_output.get(o, binary_default) for o, _ in out}
        return await _answer(self.procs, answer, out, binary)

    # -- routes --------------------------------------------------------------------------------
    def routes(self) -> list[Route]:
        m = "/v2/models/{name}"
        mv = "/v2/models/{name}/versions/{version}"
        out = [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/models/stats", self.statistics, methods=["GET"]),
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{name}/load", self.load, methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", self.unload, methods=["POST"]),
        ]
        for base in (m, mv):
            out += [
                Route(base, self.model_metadata, methods=["GET"]),
                Route(base + "/ready", self.model_ready, methods=["GET"]),
                Route(base + "/config", self.model_config, methods=["GET"]),
                Route(base + "/stats", self.statistics, methods=["GET"]),
                Route(base + "/infer", self.infer, methods=["POST"]),
            ]
        return out


__all__ = ["KServeRest", "error"]
