"""OpenAI-compatible chat completions: ``POST /v1/chat/completions`` for a decoder daemon's
tenants (full, LoRA), beside ``/v1/completions`` (``itif.server.http.completions``), whose
parameters, admission, generation, streaming and cancellation it shares.

The ``messages`` are rendered into one prompt with the tenant's chat template
(``itif.generation.chat_template``: the backbone checkpoint directory's tokenizer_config.json
``chat_template`` or chat_template.jinja, in Hugging Face's sandboxed jinja2 environment, with
its named special tokens and ``add_generation_prompt`` true), exactly the text
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` makes,
then tokenized with the tenant's tokenizer without adding special tokens (the template wrote
them), as ``apply_chat_template`` tokenizes. The prompt's ids are generated as
``/v1/completions`` generates a token-id prompt.

**Parameters**: ``model``, ``messages`` (each ``{role, content}``: content a string, a list of
text parts, or null; ``name`` allowed; anything else is 400 naming the field, e.g.
``messages[1].content``), and those of ``/v1/completions`` (``max_tokens``, its newer name
``max_completion_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``, ``stream``,
``stream_options``, ``stop``, the penalties, ``logit_bias``, ``user``, and the itif extensions
``num_beams``, ``top_k``, ...), checked the same way. ``logprobs`` false and ``top_logprobs``
null, ``tools`` / ``functions`` / ``response_format`` null or empty, ``tool_choice`` null or
"none" are accepted (they ask for nothing); otherwise 400 naming them. The itif extension
``add_generation_prompt`` (default true) renders without the assistant header when false.
No chat template: 400 naming ``chat_template``; a template that refuses the messages
(``raise_exception``): 400 naming ``messages``.

**Reply**: ``object: "chat.completion"``, ``choices[{index, message: {role: "assistant",
content}, finish_reason, logprobs: null}]`` (``content``: the new tokens decoded, special tokens
skipped; the extension ``token_ids`` beside it), ``usage``. **Streaming**: server-sent
``chat.completion.chunk`` events, each choice's first with ``delta.role`` "assistant", its
text in ``delta.content``, its last with the ``finish_reason``; then ``data: [DONE]`` (with
``stream_options.include_usage``, a usage chunk before it), as ``/v1/completions`` streams.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from itif.errors import InvalidRequest
from itif.generation import chat_template
from itif.server.http.common import endpoint, json_type
from itif.server.http.completions import CompletionsApi, EventStream, until_done_or_gone
from itif.server.http.openai import error as openai_error

__all__ = ["ChatApi"]

#: Chat fields that ask for nothing when they hold these (anything else: 400 naming them).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None,), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True, False),
}
_WHY = {"logprobs": "log probabilities are not returned",
        "top_logprobs": "log probabilities are not returned",
        "response_format": "is not supported (only {\"type\": \"text\"})"}
_WHY.update(dict.fromkeys(("tools", "functions", "tool_choice", "function_call",
                           "parallel_tool_calls"), "tool calls are not supported"))
#: Completions fields a chat request does not take (the messages are its prompt).
_NOT_CHAT = ("prompt", "echo", "suffix", "best_of")


#: A message "<field>: ..." names a field, ``messages[1].content`` too.
_PARAM = re.compile(r"[A-Za-z_]\w*(\[\d+\]|\.[A-Za-z_]\w*)*")


def error(status: int, code: str, message: str) -> Response:
    """OpenAI's error body; ``param`` is the field a 400's message names."""
    head = message.split(":", 1)[0]
    return openai_error(status, code, message,
                        head if status == 400 and _PARAM.fullmatch(head) else None)


def _renamed(msg: str, tokens_field: str) -> str:
    """A completions message in the chat request's words: its prompt is ``messages``."""
    head, sep, rest = msg.partition(":")
    if sep and head == "prompt":
        return f"messages:{rest}"
    if sep and head == "max_tokens":
        return f"{tokens_field}:{rest}"
    return msg


class ChatApi:
    def __init__(self, completions: CompletionsApi) -> None:
        self.completions = completions
        self.daemon = completions.daemon
        self.admission = completions.admission  # counted as every HTTP call (endpoint)

    def _body(self, body: dict) -> tuple[dict, str]:
        """The request as ``/v1/completions`` checks it (``messages`` and the chat-only
        fields taken out), and the name its token limit was sent under."""
        rest = {k: v for k, v in body.items() if k not in _NEUTRAL and k not in (
            "messages", "max_completion_tokens", "add_generation_prompt")}
        for key in _NOT_CHAT:
            if key in body:
                raise InvalidRequest(f"{key}: unknown parameter (a chat completion's prompt "
                                     "is its messages)")
        for key, neutral in _NEUTRAL.items():
            value = body.get(key)
            if value is None or any(value == n and type(value) is type(n) for n in neutral):
                continue
            raise InvalidRequest(f"{key}: {_WHY.get(key, 'is not supported')}")
        field = "max_tokens"
        newer = body.get("max_completion_tokens")
        if newer is not None:
            if body.get("max_tokens") is not None and body["max_tokens"] != newer:
                raise InvalidRequest("max_completion_tokens: differs from max_tokens; send one")
            rest["max_tokens"], field = newer, "max_completion_tokens"
        return rest, field

    def _prompt(self, model: str, body: dict) -> list[int]:
        """The rendered messages' token ids."""
        messages = chat_template.check_messages(body["messages"])
        template, specials = self.daemon.engine.chat_template_of(model)
        if template is None:
            raise InvalidRequest(
                f"chat_template: model {model!r} has no chat template (the backbone's "
                "tokenizer_config.json has no chat_template and there is no "
                "chat_template.jinja): use /v1/completions with a prompt")
        tok = self.daemon.engine.tokenizer_of(model)
        if tok is None:
            raise InvalidRequest(f"messages: model {model!r} ships no tokenizer: use "
                                 "/v1/completions with a prompt of token ids")
        prompt = body.get("add_generation_prompt", True)
        if not isinstance(prompt, bool):
            raise InvalidRequest(f"add_generation_prompt: must be a boolean, got "
                                 f"{json_type(prompt)}")
        text = chat_template.render(template, messages, special_tokens=specials,
                                    add_generation_prompt=prompt)
        return chat_template.template_ids(tok, text)

    @staticmethod
    def _message(choice: dict) -> dict:
        out = {"index": choice["index"], "message": {"role": "assistant",
                                                     "content": choice["text"]},
               "finish_reason": choice["finish_reason"], "logprobs": None,
               "token_ids": choice["token_ids"]}
        if "score" in choice:
            out["score"] = choice["score"]
        return out

    @staticmethod
    def _delta():
        """A completions chunk's choice as a chat chunk's ``delta`` (the role in a choice's
        first)."""
        started: set[int] = set()

        def shape(choice: dict) -> dict:
            delta: dict[str, Any] = {}
            if choice["index"] not in started:
                started.add(choice["index"])
                delta["role"] = "assistant"
            if choice["text"] or "role" in delta:
                delta["content"] = choice["text"]
            out = {"index": choice["index"], "delta": delta,
                   "finish_reason": choice["finish_reason"], "logprobs": None,
                   "token_ids": choice["token_ids"]}
            if "score" in choice:
                out["score"] = choice["score"]
            return out

        return shape

    @endpoint("openai", "chat_completions", error)
    async def chat(self, request: Request) -> Response:
        api = self.completions
        who, body, model = await api.open_call(request, "/v1/chat/completions")
        if "messages" not in body:
            raise InvalidRequest("messages: is required")
        rest, field = self._body(body)
        stream, include_usage = api.streaming(rest)
        try:
            ids = self._prompt(model, body)
            req = api.capped(api.generate_request(model, ids, rest), rest)
            call = await api.start(who, model, req)
        except InvalidRequest as e:
            raise InvalidRequest(_renamed(str(e), field)) from None
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": model}
        if stream:
            chunks = api.events(call, {**head, "object": "chat.completion.chunk"}, len(ids),
                                 include_usage, self._delta())
            return EventStream(chunks, call)
        g = await until_done_or_gone(call, request)
        if g is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        choices = [self._message(c) for c in api.choices(g, call.words)]
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": api.usage(len(ids), g)})

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat, methods=["POST"])]
