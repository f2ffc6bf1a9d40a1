"""Chat templates: a list of chat messages rendered into one prompt string, as Hugging Face's
``tokenizer.apply_chat_template(messages, tokenize=False)`` renders it, then tokenized as it
tokenizes it (no special tokens added again: the template wrote them).

The template is the tokenizer's own: ``chat_template`` in a checkpoint's
``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of which ``default`` is
taken, as ``apply_chat_template`` takes it without tools), else its ``chat_template.jinja`` file
(what transformers 5 writes with ``save_pretrained``). The template sees what Hugging Face
passes: ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None here), and the
named special tokens of the tokenizer's config (``bos_token``, ``eos_token``, ... as strings).

The environment is Hugging Face's, rebuilt here with jinja2's public API (chat templates are
code from whoever published the checkpoint, so they run sandboxed): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the loop controls
(``break``, ``continue``), a ``{% generation %}`` block that renders its body as is (Hugging
Face marks assistant spans with it), ``tojson`` without HTML escaping (``ensure_ascii`` false),
and the globals ``raise_exception`` (a template refusing its input), ``strftime_now``, a
``dict`` constructor and a ``namespace`` that refuses underscore-prefixed attributes.

Messages are checked before a template sees them (:func:`check_messages`): each an object with
a string ``role`` and a ``content`` that is a string, a list of text parts (joined with newlines,
as OpenAI-compatible servers hand them to string templates) or null (dropped, as Hugging Face
drops None values); ``name`` may be a string. Anything else is InvalidRequest naming the field
(``messages[2].content``); what a template refuses (``raise_exception``, an undefined name) is
InvalidRequest naming ``messages``. Plain functions; no server imports.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from itif.errors import InvalidRequest

__all__ = ["SPECIAL_TOKENS", "check_messages", "compile_template", "read_chat_config",
           "render", "template_ids"]

#: The named special tokens Hugging Face passes to a template (``special_tokens_map``).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_MESSAGE_KEYS = ("role", "content", "name")
#: At most this many messages, and this many characters in all, per conversation.
MAX_MESSAGES = 4096
MAX_CHARS = 1 << 22


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_chat_config(directory: str | Path | None) -> tuple[str | None, dict[str, str]]:
    """(the chat template, the named special tokens) of a tokenizer directory: its
    tokenizer_config.json's ``chat_template`` (``default`` of a list of named ones) else its
    chat_template.jinja; the tokens from special_tokens_map.json, then tokenizer_config.json
    (which wins, as transformers merges them). (None, {}) for no directory."""
    if directory is None:
        return None, {}
    root = Path(directory)
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = root / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                config.update(data)
    tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    return (template if isinstance(template, str) else None), tokens


# ---- the environment ----------------------------------------------------------------------------
def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """jinja2's own ``tojson`` escapes HTML characters (``<`` as ``\\u003c``); templates want
    the JSON as ``json.dumps`` writes it."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, and nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=64)
def compile_template(text: str) -> Any:
    """The compiled ``jinja2.Template`` of a chat template (cached by its text). A template
    that does not parse is InvalidRequest naming ``chat_template``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body, rendered as is."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja2's ``namespace``, refusing underscore-prefixed attributes (no way to reach
        the interpreter's internals through one)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            for key in dict(*rest, **kwargs):
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, key: str, value: Any) -> None:
            Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the attribute {key!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=Namespace)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InvalidRequest(f"chat_template: the tokenizer's chat template does not parse "
                             f"(line {e.lineno}): {e.message}") from None


# ---- messages -----------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequest(f"{where}: must be a string or an array of text parts, got "
                             f"{_kind(value)}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise InvalidRequest(f"{where}[{j}]: must be an object, got {_kind(part)}")
        if part.get("type") != "text":
            shown = str(part.get("type"))[:32]
            raise InvalidRequest(f"{where}[{j}].type: {shown!r} is not supported (text parts "
                                 "only)")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}[{j}].text: must be a string, got {_kind(text)}")
        texts.append(text)
    return "\n".join(texts)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The messages as the template sees them (module docstring), or InvalidRequest naming the
    field (``messages``, ``messages[i]``, ``messages[i].role``, ...)."""
    if not isinstance(messages, list):
        raise InvalidRequest(f"messages: must be an array of messages, got {_kind(messages)}")
    if not messages:
        raise InvalidRequest("messages: is empty: send at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages, over {MAX_MESSAGES}")
    out, chars = [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where}: must be an object with role and content, got "
                                 f"{_kind(m)}")
        for key in m:
            if key not in _MESSAGE_KEYS:
                raise InvalidRequest(f"{where}.{str(key)[:32]}: is not supported (a message "
                                     f"has {', '.join(_MESSAGE_KEYS)})")
        role = m.get("role")
        if role is None:
            raise InvalidRequest(f"{where}.role: is required")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{where}.role: must be a non-empty string, got {_kind(role)}")
        if "content" not in m:
            raise InvalidRequest(f"{where}.content: is required")
        msg = {"role": role}
        content = _content(m["content"], f"{where}.content")
        if content is not None:  # None dropped, as Hugging Face drops it
            msg["content"] = content
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"{where}.name: must be a string, got {_kind(name)}")
            msg["name"] = name
        chars += sum(len(v) for v in msg.values())
        if chars > MAX_CHARS:
            raise InvalidRequest(f"messages: over {MAX_CHARS} characters in all")
        out.append(msg)
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], *,
           special_tokens: Mapping[str, str] | None = None, add_generation_prompt: bool = True,
           **kwargs: Any) -> str:
    """The prompt ``template`` makes of ``messages`` (checked with :func:`check_messages`),
    as ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
    **kwargs)`` makes it with a tokenizer of those ``special_tokens``. What the template
    raises (``raise_exception``, an undefined name, a sandbox refusal) is InvalidRequest
    naming ``messages``."""
    import jinja2

    compiled = compile_template(template)
    values = {**dict(special_tokens or {}), **kwargs}
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=None,
                               documents=None, add_generation_prompt=add_generation_prompt,
                               **values)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequest(f"messages: the chat template refused them: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise InvalidRequest(f"messages: the chat template failed on them: {e}") from None


def template_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` (a rendered chat) as token ids of a ``tokenizers.Tokenizer``, with no special
    tokens added (the template wrote them), as ``apply_chat_template(tokenize=True)``."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)
