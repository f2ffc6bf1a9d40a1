"""OpenAI-compatible embeddings: ``POST /v1/embeddings``, ``GET /v1/models[/{model}]``.

The model is the tenant (its token as the API key: ``Authorization: Bearer <token>``); a
tenant sees only its own model, and another tenant's answers like an unknown one (404).

An input's embedding is the tenant's ``pooled`` output, exactly what the gRPC APIs return
for it: the pooler (``tanh(dense(h_CLS))``) when the tenant's weights carry one, else the
[CLS] row of the last hidden state. (No mean pooling here: for a sentence-transformers model
that wants it, ask the KServe API for ``last_hidden_state`` and average the rows.)

``input`` is a string, a list of strings (tokenized with the backbone's ``tokenizer.json``,
special tokens included, as the itif API's ``text`` input), a list of token ids, or a list of
token-id lists (any text backbone). All inputs of a call are queued together (all-or-nothing).
``encoding_format`` is ``float`` (lists of numbers) or ``base64`` (little-endian float32, what the
``openai`` client asks for by default); ``dimensions``, when given, must be the hidden size.
``usage`` counts the tokens of all inputs. Errors answer OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with the same HTTP status as the KServe
routes.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from itif.errors import InvalidRequest, Unavailable
from itif.runtime.engine import Request as ItifRequest
from itif.server.http.common import (
    authorization,
    bounded_list,
    endpoint,
    field,
    json_object,
    json_type,
    read_body,
)
from itif.server.infer_calls import await_tickets, convert_inputs
from itif.server.json_procs import (
    ANSWER_NUMBERS,
    IN_THREAD,
    JsonProcs,
    TokenLists,
    json_bytes,
    load_embeddings,
)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
_INPUT_SHAPES = ("input must be a string, a list of strings, a list of token ids or a list of "
                 "token-id lists")


def error(status: int, code: str, message: str, param: str | None = None) -> Response:
    """OpenAI's error body (``param``: the request field it is about, when one is)."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if status == 404:
        code = "model_not_found"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code.lower()}}, status_code=status)


def is_int(v: Any) -> bool:
    """An int, but not a bool (JSON ``true`` passes ``isinstance(v, int)``)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _token_list(ids: list, where: str) -> np.ndarray:
    bounded_list(ids, where)
    if not ids:
        raise InvalidRequest(f"{where} is an empty token list")
    if not all(is_int(v) for v in ids):
        raise InvalidRequest(f"{where}: token ids must be integers")
    if min(ids) < 0 or max(ids) >= 2**63:
        raise InvalidRequest(f"{where}: token ids must be non-negative 64-bit integers")
    return np.asarray(ids, np.int64)


def _input_count(value: Any) -> int:
    """How many inputs an embeddings ``input`` holds, before any is checked: a list of texts or
    of token lists, one each; a text or a single token list, one."""
    if isinstance(value, TokenLists):
        return len(value.ends)
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return len(value)
    return 1


class OpenAIApi:
    def __init__(self, daemon, *, max_body: int, admission=None,
                 procs: JsonProcs = IN_THREAD) -> None:
        self.daemon = daemon
        self.procs = procs  # parses large bodies, writes large answers (itif.server.json_procs)
        self.max_body = max_body
        self.admission = admission  # itif.server.admission.Admission; None: calls not counted

    def _who(self, request: Request):
        if not self.daemon.ready:
            raise Unavailable("the daemon is starting or shutting down")
        return self.daemon.identify(authorization(request))

    def _inputs(self, value: Any) -> list[np.ndarray]:
        """Token ids per input, from any of the accepted ``input`` forms."""
        d = self.daemon
        if isinstance(value, TokenLists):  # load_embeddings checked them as _token_list does
            return value.arrays()
        if isinstance(value, str):
            return [np.asarray(d.tokenize(value), np.int64)]
        if not isinstance(value, list) or not value:
            raise InvalidRequest(_INPUT_SHAPES + ("" if isinstance(value, list)
                                                  else f", got {json_type(value)}"))
        bounded_list(value, "input")
        if all(isinstance(v, str) for v in value):
            return [np.asarray(d.tokenize(v), np.int64) for v in value]
        if all(is_int(v) for v in value):
            return [_token_list(value, "input")]
        if all(isinstance(v, list) for v in value):
            return [_token_list(v, f"input[{i}]") for i, v in enumerate(value)]
        raise InvalidRequest(_INPUT_SHAPES + " (not a mix)")

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "itif"}

    @endpoint("openai", "embeddings", error)
    async def embeddings(self, request: Request) -> Response:
        who = self._who(request)
        body = await json_object(await read_body(request, self.max_body), procs=self.procs,
                                 load=load_embeddings)
        model = field(body, "model", str, "the request")
        if "input" not in body:
            raise InvalidRequest("the request: 'input' is required")
        fmt = field(body, "encoding_format", str, "the request", "float")
        if fmt not in ("float", "base64"):
            raise InvalidRequest(f"encoding_format {fmt[:32]!r} is not supported (float, base64)")
        dims = field(body, "dimensions", (int, type(None)), "the request", None)
        field(body, "user", (str, type(None)), "the request", None)  # accepted, not used
        d = self.daemon
        d.get_tenant(who, model)  # 404 for unknown and invisible models alike
        spec = d.engine.spec
        if not spec.is_text:
            raise InvalidRequest(f"model {model!r} serves a {spec.family} backbone, which takes "
                                 "images: embeddings need text")
        if dims is not None and dims != spec.hidden:
            raise InvalidRequest(f"dimensions {dims} is not supported: model {model!r} embeds "
                                 f"into {spec.hidden} dimensions")
        value = body["input"]
        n = _input_count(value)

        def convert() -> list[ItifRequest]:
            return [ItifRequest("", input_ids=a, outputs=("pooled",)) for a in self._inputs(value)]

        reqs = await convert_inputs(d, who, model, n, convert)
        results = await await_tickets(d, who, model, reqs, None)
        data = []
        for i, r in enumerate(results):
            vec = np.ascontiguousarray(r.pooled, dtype="<f4")
            emb = base64.b64encode(vec.tobytes()).decode("ascii") if fmt == "base64" else vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = sum(len(r.input_ids) for r in reqs)
        answer = {"object": "list", "data": data, "model": model,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        numbers = 0 if fmt == "base64" else len(data) * spec.hidden
        body = (await self.procs.run(json_bytes, answer, False) if numbers > ANSWER_NUMBERS
                else json_bytes(answer, False))  # NaN refused, as Starlette's JSONResponse
        return Response(body, media_type="application/json")

    @endpoint("openai", "models", error)
    async def models(self, request: Request) -> Response:
        views = self.daemon.list_tenants(self._who(request))
        return JSONResponse({"object": "list", "data": [self._model(v.id) for v in views]})

    @endpoint("openai", "model", error)
    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        view = self.daemon.get_tenant(self._who(request), name)
        return JSONResponse(self._model(view.id))

    def routes(self) -> list[Route]:
        return [
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model}", self.model, methods=["GET"]),
        ]


__all__ = ["OpenAIApi"]
