"""OpenAI-compatible text completions: ``POST /v1/completions`` for a decoder daemon's tenants.

The model is the tenant and its token the API key, as for ``/v1/embeddings`` (another tenant's
model answers like an unknown one: 404). The request becomes one itif
:class:`~itif.generation.api.GenerateRequest`, submitted and streamed exactly as the gRPC
``Generate`` call's (``itif.server.generate.GenerationStream``): the same admission, validation
(``check_request``: a bad parameter is 400 naming it), GenEngine, metrics, and freeing of the
request's sequences and KV cache blocks when the client goes away before the end.

**Parameters** (OpenAI's name -> itif's):

- ``prompt``: a string (tokenized with the tenant's tokenizer, as Generate's ``text``), a list of
  token ids, or a list holding one of those. Several prompts in one call: 400 naming ``prompt``
  (send one call per prompt).
- ``max_tokens`` -> ``max_new_tokens`` (absent: 16, OpenAI's default; at most
  ``server.max_new_tokens``).
- ``temperature``: 0 or absent is **greedy search** (or beam search with ``num_beams``);
  above 0 is **sampling** (``do_sample``) at that temperature. The itif extension ``do_sample``
  (true or false) overrides that choice; ``temperature`` must then fit it (check_request).
- ``top_p`` -> ``top_p``, ``seed`` -> ``seed`` (both sampling only, as in Generate: with greedy
  search they are refused naming the field), ``n`` -> ``num_return_sequences`` (sampling, or at
  most ``num_beams`` with beam search; greedy search returns one).
- itif extensions (the ``openai`` client sends them with ``extra_body=``): ``num_beams``,
  ``length_penalty``, ``early_stopping`` (true, false or "never"), ``no_repeat_ngram_size``,
  ``top_k`` (absent: off, as OpenAI samples; the itif API's Generate takes generate()'s 50),
  ``do_sample``, ``eos_token_id``. Beam search is ``num_beams`` > 1: OpenAI's
  ``best_of`` means something else (sample several, keep the likeliest) and is refused unless it
  is absent or equals ``n``.
- Accepted when they ask for nothing: ``echo`` false, ``logprobs`` null, ``suffix`` null or "",
  ``stop`` null or [], ``presence_penalty`` / ``frequency_penalty`` 0, ``logit_bias`` {} or
  null, and ``user``. Anything else of theirs: 400 naming the field (not supported); an unknown
  field: 400 naming it.

**Reply**: OpenAI's completion object (``id``, ``object: "text_completion"``, ``created``,
``model``, ``choices[{index, text, finish_reason, logprobs: null}]``, ``usage``), one choice
per returned sequence, best first for beam search. ``finish_reason`` is ``"stop"`` (an end
token) or ``"length"`` (``max_tokens`` reached). ``text`` is the sequence decoded with the
tenant's tokenizer, special tokens skipped. Each choice also carries the itif extensions
``token_ids`` (the generated ids) and, for beam search, ``score`` (the beam score Generate
returns). A tenant without a tokenizer takes token-id prompts only (a string prompt: 400) and
answers ``text: ""``: read ``token_ids``. ``usage``: the prompt's tokens, the generated tokens of
all choices, their sum.

**Streaming** (``stream: true``): ``text/event-stream``, one ``data: {chunk}`` event per token
message of the GenEngine (greedy search and sampling: as tokens are decided; beam search: the
final beams at the end), each chunk a completion object with one choice (``index`` the
sequence; its new ``text`` and ``token_ids``; ``finish_reason`` null), then per sequence a last
chunk with what is left of its text and its ``finish_reason``, then ``data: [DONE]``. With
``stream_options: {"include_usage": true}`` a chunk with no choices and the ``usage`` comes
before ``[DONE]``. The texts of a choice's chunks add up to the non-streamed ``text``. An error
after the stream has started (the engine failed) is one ``data: {"error": {...}}`` event, and
the stream ends without ``[DONE]``. A client that disconnects mid-stream (or, without
streaming, before its answer) cancels the request: the GenEngine frees its sequences and cache
blocks at its next step.

An encoder daemon answers 400 (completions need a decoder backbone; use /v1/embeddings).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from itif.errors import InvalidRequest, Unavailable
from itif.generation.api import GenerateRequest
from itif.requests import utf8_text
from itif.server.errors import http_status_of
from itif.server.generate import GenerationStream, load_evicted
from itif.server.http.common import (
    authorization,
    bounded_list,
    endpoint,
    json_object,
    json_type,
    read_body,
)
from itif.server.http.openai import error as openai_error
from itif.server.http.openai import is_int
from itif.server.json_procs import IN_THREAD, JsonProcs

__all__ = ["CompletionsApi", "EventStream", "error", "until_done_or_gone"]

#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16
#: itif's field names in ``check_request``'s messages -> the request's (OpenAI) names.
_RENAMED = {"input_ids": "prompt", "text": "prompt", "max_new_tokens": "max_tokens",
            "num_return_sequences": "n"}
_GREEDY_HINT = (" (temperature 0 or absent is greedy search; temperature > 0, or the extension "
                "do_sample true, samples)")
_FINISH = {"eos": "stop", "length": "length"}
_NUMBER, _INT, _BOOL, _STR = (int, float), (int,), (bool,), (str,)
#: Every field a request may carry: OpenAI's and itif's extensions, with their JSON types.
_FIELDS: dict[str, tuple[type, ...]] = {
    "model": _STR, "prompt": (str, list), "max_tokens": _INT, "temperature": _NUMBER,
    "top_p": _NUMBER, "n": _INT, "seed": _INT, "stream": _BOOL, "stream_options": (dict,),
    "echo": _BOOL, "logprobs": _INT, "suffix": _STR, "stop": (str, list), "best_of": _INT,
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "logit_bias": (dict,),
    "user": _STR,
    # itif extensions
    "num_beams": _INT, "length_penalty": _NUMBER, "early_stopping": (bool, str),
    "no_repeat_ngram_size": _INT, "top_k": _INT, "do_sample": _BOOL, "eos_token_id": _INT,
}
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a message "<field>: ..." names a field
_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
          list: "an array", dict: "an object"}
_SHAPES = ("must be a string, a list of token ids, or a list holding one string or one "
           "token-id list")


def error(status: int, code: str, message: str) -> Response:
    """OpenAI's error body; ``param`` is the field a 400's message names (``"<field>: ..."``)."""
    head = message.split(":", 1)[0]
    return openai_error(status, code, message,
                        head if status == 400 and _PARAM.fullmatch(head) else None)


def _get(body: dict, key: str) -> Any:
    """``body[key]`` of its JSON type (absent or null: None)."""
    value = body.get(key)
    if value is None:
        return None
    kinds = _FIELDS[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "a number" if float in kinds else " or ".join(_NAMES[k] for k in kinds)
        raise InvalidRequest(f"{key}: must be {names}, got {json_type(value)}")
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        raise InvalidRequest(f"{key}: must be a 64-bit integer (as Generate's), got {value}")
    return value


def _renamed(e: InvalidRequest) -> InvalidRequest:
    """check_request's message with the request's field names (and how greedy is chosen)."""
    msg = str(e)
    head, sep, rest = msg.partition(":")
    if sep and head in _RENAMED:
        msg = f"{_RENAMED[head]}:{rest}"
    if msg.endswith("but do_sample is false"):
        msg += _GREEDY_HINT
    return InvalidRequest(msg)


def _refuse_unsupported(body: dict) -> None:
    """OpenAI's parameters itif does not serve: accepted only when they ask for nothing."""
    for key, neutral in (("echo", False), ("logprobs", None), ("suffix", ""), ("stop", None),
                         ("presence_penalty", 0), ("frequency_penalty", 0),
                         ("logit_bias", None)):
        value = _get(body, key)
        if value is None or value == neutral or (key in ("stop", "logit_bias") and not value):
            continue
        why = {"stop": "stop sequences are not supported (the itif extension eos_token_id "
                       "ends a sequence at one token id)",
               "echo": "echoing the prompt is not supported",
               "logprobs": "log probabilities are not returned"}.get(key, "is not supported")
        raise InvalidRequest(f"{key}: {why}")


class CompletionsApi:
    def __init__(self, daemon, *, max_body: int, admission=None,
                 procs: JsonProcs = IN_THREAD) -> None:
        self.daemon = daemon
        self.procs = procs  # parses large bodies (itif.server.json_procs)
        self.max_body = max_body
        self.admission = admission  # itif.server.admission.Admission; None: calls not counted

    # ---- the request ----------------------------------------------------------------------
    def _prompt(self, model: str, prompt: Any) -> list[int]:
        """The prompt's token ids (a string tokenized with the tenant's tokenizer)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            tok = self.daemon.engine.tokenizer_of(model)
            if tok is None:
                raise InvalidRequest(f"prompt: model {model!r} ships no tokenizer: send the "
                                     "prompt as a list of token ids")
            limit = self.daemon.generator.spec.max_position
            return list(tok.encode(utf8_text(prompt, "prompt", limit)).ids)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("prompt: is empty" if isinstance(prompt, list) else
                                 f"prompt: {_SHAPES}, got {json_type(prompt)}")
        bounded_list(prompt, "prompt")
        if all(is_int(v) for v in prompt):
            return list(prompt)
        if all(isinstance(v, (str, list)) for v in prompt):
            raise InvalidRequest(f"prompt: {len(prompt)} prompts in one call are not supported; "
                                 "send one call per prompt")
        raise InvalidRequest(f"prompt: {_SHAPES}")

    @staticmethod
    def generate_request(model: str, ids: list[int], body: dict) -> GenerateRequest:
        """The GenerateRequest of a completion's body (its prompt given as ``ids``); an unknown
        or unsupported parameter is an InvalidRequest naming it."""
        unknown = [k for k in body if k not in _FIELDS]
        if unknown:
            raise InvalidRequest(f"{unknown[0][:64]}: unknown parameter")
        _refuse_unsupported(body)
        n, best_of = _get(body, "n"), _get(body, "best_of")
        if best_of is not None and best_of != (1 if n is None else n):
            raise InvalidRequest("best_of: is not supported (it samples best_of sequences and "
                                 "keeps the likeliest); for beam search send the itif "
                                 "extension num_beams")
        max_tokens = _get(body, "max_tokens")
        kw: dict[str, Any] = {"max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None
                              else max_tokens}
        temperature = _get(body, "temperature")
        if temperature is not None and not temperature >= 0:  # NaN too
            raise InvalidRequest(f"temperature: must be 0 (greedy search) or more (sampling), "
                                 f"got {temperature!r}")
        do_sample = _get(body, "do_sample")
        if do_sample is None:
            do_sample = temperature is not None and temperature > 0
        kw["do_sample"] = do_sample
        if temperature is not None and (do_sample or temperature != 0):
            kw["temperature"] = float(temperature)
        if n is not None:
            kw["num_return_sequences"] = n
        for key in ("top_p", "seed", "num_beams", "length_penalty", "no_repeat_ngram_size",
                    "top_k", "eos_token_id"):
            value = _get(body, key)
            if value is not None:
                kw[key] = float(value) if key in ("top_p", "length_penalty") else value
        early = _get(body, "early_stopping")
        if early is not None:
            if early not in (True, False, "never"):
                raise InvalidRequest(f"early_stopping: must be true, false or \"never\", got "
                                     f"{str(early)[:32]!r}")
            kw["early_stopping"] = early
        return GenerateRequest(model, ids, **kw)

    async def start(self, who: Any, model: str, req: GenerateRequest) -> GenerationStream:
        """Submit ``req``. A tenant the weight tiers evicted is loaded first on a worker
        thread, so that the event loop (every other call's) does not wait for its weights."""
        d = self.daemon
        await load_evicted(d, who, model)
        try:
            return GenerationStream(d, who, model, req)
        except InvalidRequest as e:
            raise _renamed(e) from None

    # ---- the reply ------------------------------------------------------------------------
    @staticmethod
    def _choice(index: int, text: str, ids: list[int], finish: str | None,
                score: float | None = None) -> dict:
        out = {"index": index, "text": text, "finish_reason": finish, "logprobs": None,
               "token_ids": ids}
        if score is not None:
            out["score"] = score
        return out

    def choices(self, g: Any, words: Any, sent: dict[int, tuple[str, int]] | None = None
                ) -> list[dict]:
        """One choice per sequence of ``g``; with ``sent`` (sequence -> text and ids already
        streamed) only what is left of each."""
        reasons = list(getattr(g, "finish_reasons", None) or [])
        out = []
        for i, seq in enumerate(g.sequences):
            ids = [int(t) for t in seq]
            text = words.decode(ids)
            if sent is not None:
                done_text, done_ids = sent.get(i, ("", 0))
                text = text[len(done_text):] if text.startswith(done_text) else ""
                ids = ids[done_ids:]
            reason = reasons[i] if i < len(reasons) else ""
            score = None if g.scores is None else float(g.scores[i])
            out.append(self._choice(i, text, ids, _FINISH.get(reason, reason or "stop"), score))
        return out

    @staticmethod
    def usage(prompt: int, g: Any) -> dict:
        """The ``usage`` object of a reply: ``prompt`` tokens in, the sequences' tokens out."""
        made = sum(len(s) for s in g.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    async def events(self, call: GenerationStream, head: dict, prompt: int,
                     include_usage: bool, shape: Callable[[dict], dict] | None = None
                     ) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed completion; ``shape``: each chunk's choice as
        another API sends it (``itif.server.http.chat``: a chat ``delta``)."""
        sent: dict[int, tuple[str, int]] = {}
        shape = shape or (lambda choice: choice)
        try:
            async for kind, value in call.events():
                if kind == "tokens":
                    for seq, ids, text in value:
                        done_text, done_ids = sent.get(seq, ("", 0))
                        sent[seq] = (done_text + text, done_ids + len(ids))
                        choice = shape(self._choice(seq, text, ids, None))
                        yield _sse({**head, "choices": [choice]})
                    continue
                for choice in self.choices(value, call.words, sent):
                    yield _sse({**head, "choices": [shape(choice)]})
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": self.usage(prompt, value)})
                yield b"data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent: the error is an event
            status, code, msg = http_status_of(e)
            body = json.loads(error(status, code, msg).body)
            yield _sse(body)

    async def open_call(self, request: Request, path: str) -> tuple[Any, dict, str]:
        """(the caller, the JSON body, its model) of a call to ``path``: the daemon ready, the
        token known, the model visible to it (404 otherwise) and served by a decoder."""
        d = self.daemon
        if not d.ready:
            raise Unavailable("the daemon is starting or shutting down")
        who = d.identify(authorization(request))
        body = await json_object(await read_body(request, self.max_body), procs=self.procs)
        if body.get("model") is None:
            raise InvalidRequest("model: is required")
        model = _get(body, "model")
        d.tenants.check_visible(who, model)  # 404 for unknown and invisible models alike
        if d.generator is None:
            raise InvalidRequest(
                f"model: {model!r} is served by an encoder backbone "
                f"({d.config.backbone.config}): {path} needs a decoder backbone "
                "(GPT-2, BART, Marian, Llama); use /v1/embeddings")
        return who, body, model

    @staticmethod
    def streaming(body: dict) -> tuple[bool, bool]:
        """(``stream``, ``stream_options.include_usage``) of a request."""
        stream = bool(_get(body, "stream"))
        options = _get(body, "stream_options") or {}
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool) or set(options) - {"include_usage"}:
            raise InvalidRequest("stream_options: only include_usage (a boolean) is supported")
        return stream, include_usage

    def capped(self, req: GenerateRequest, body: dict) -> GenerateRequest:
        """Without ``max_tokens`` its default, never over the server's limit."""
        if body.get("max_tokens") is not None:
            return req
        cap = self.daemon.config.server.max_new_tokens
        return replace(req, max_new_tokens=min(req.max_new_tokens, cap))

    @endpoint("openai", "completions", error)
    async def completions(self, request: Request) -> Response:
        who, body, model = await self.open_call(request, "/v1/completions")
        if "prompt" not in body:
            raise InvalidRequest("prompt: is required")
        stream, include_usage = self.streaming(body)
        try:
            ids = self._prompt(model, _get(body, "prompt"))
            req = self.capped(self.generate_request(model, ids, body), body)
        except InvalidRequest as e:
            raise _renamed(e) from None
        call = await self.start(who, model, req)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model}
        if stream:
            return EventStream(self.events(call, head, len(ids), include_usage), call)
        g = await until_done_or_gone(call, request)
        if g is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        return JSONResponse({**head, "choices": self.choices(g, call.words),
                             "usage": self.usage(len(ids), g)})

    def routes(self) -> list[Route]:
        """``/v1/completions``; ``/v1/chat/completions`` is ``itif.server.http.chat.ChatApi``'s,
        built on this object (the app composes both)."""
        return [Route("/v1/completions", self.completions, methods=["POST"])]


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """Starlette's streaming response of server-sent events; the generation is cancelled once
    the response ends, whatever ended it (Starlette cancels the stream when the client
    disconnects; this also covers a stream never started)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], call: GenerationStream) -> None:
        super().__init__(content, headers={"cache-control": "no-cache"})
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.close()


async def until_done_or_gone(call: GenerationStream, request: Request) -> Any:
    """The finished Generation, or None when the client disconnects first (the generation is
    then cancelled)."""

    async def finished() -> Any:
        async for kind, value in call.events():
            if kind == "done":
                return value
        raise Unavailable("the generation ended without a result")

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, watch = asyncio.ensure_future(finished()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            return result.result()
        return None
    finally:
        for task in (result, watch):
            task.cancel()
        call.close()
