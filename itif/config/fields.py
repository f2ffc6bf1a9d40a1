"""Field converters: one per kind of setting, each with its limits given by the field.

Every converter takes ``(value, path, **limits)`` and returns the typed value or raises
:class:`Bad` naming the key path. :func:`setting` attaches a converter and its limits to a
dataclass field (``itif.config.schema``), so a setting's limits are written once, beside it;
the parser (``itif.config.parse``) and :func:`check` (live objects such as the scheduler's
``TenantQuota``) both read them from there.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Literal, NoReturn, get_args

from itif.errors import InvalidConfig

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Backbone names accepted as ``backbone.config`` instead of a path (plus any other name in
#: ``itif.backbones.spec.PRESETS``, see :func:`backbone_presets`).
BACKBONE_PRESETS: tuple[str, ...] = (
    "bert-base",
    "bert-large",
    "albert-base",
    "albert-large",
    "vit-base",
    "bert-tiny",
    "albert-tiny",
    "vit-tiny",
)

Device = Literal["cpu", "cuda", "auto"]
DType = Literal["float32", "float16", "bfloat16", "auto"]
DEVICES: tuple[str, ...] = get_args(Device)
DTYPES: tuple[str, ...] = get_args(DType)

TENANT_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?$")
_STRATEGY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "tib": TiB,
    "tb": 1000**4,
}

MAX_SEQ_LEN_LIMIT = 1 << 20
#: Upper bound of ``server.max_new_tokens``.
MAX_NEW_TOKENS_LIMIT = 1 << 16
# gRPC message limits are int32.
GRPC_MAX_MESSAGE = (1 << 31) - 1


@functools.lru_cache(maxsize=1)
def backbone_presets() -> frozenset[str]:
    """Preset names: :data:`BACKBONE_PRESETS` plus those the backbone registry defines."""
    names = set(BACKBONE_PRESETS)
    try:
        from itif.backbones.spec import PRESETS  # noqa: PLC0415 - torch-free, but not needed early
    except ImportError:
        pass
    else:
        names.update(PRESETS)
    return frozenset(names | generation_presets())


#: The decoder presets of ``itif.generation.spec.PRESETS`` (named here: that module loads
#: torch, the config does not; tests/test_generate_daemon.py checks the two agree).
GENERATION_PRESETS: tuple[str, ...] = ("gpt2-tiny", "bart-tiny", "marian-tiny", "llama-tiny",
                                       "marian-decoding")
#: Hugging Face ``model_type`` values of the decoders itif generates with (llama, qwen2 and
#: mistral: the llama family, ``itif.generation.spec.LLAMA_TYPES``).
DECODER_MODEL_TYPES: tuple[str, ...] = ("gpt2", "bart", "marian", "llama", "qwen2", "mistral")


def generation_presets() -> frozenset[str]:
    """Decoder preset names (:data:`GENERATION_PRESETS`)."""
    return frozenset(GENERATION_PRESETS)


#: ``family`` values of ``itif.generation.spec.DecoderSpec`` (the llama family is one).
DECODER_FAMILIES: tuple[str, ...] = ("gpt2", "bart", "marian", "llama")


def decoder_refusal(backbone: Any) -> str | None:
    """Why the encoder ``itif.Engine`` cannot take ``backbone`` when it is a decoder (a spec whose
    ``family`` is a decoder's, a decoder preset, or a config.json / checkpoint directory of a
    decoder ``model_type``): the message names the class that serves it. None when it is not a
    decoder (the encoder's own error then stands)."""
    family = getattr(backbone, "family", None)
    if family is not None:
        if family not in DECODER_FAMILIES:
            return None
        what = f"the {family} decoder {getattr(backbone, 'name', '')!r}"
    elif str(backbone) in generation_presets():
        what = f"the decoder preset {str(backbone)!r}"
    else:
        path = Path(str(backbone))
        try:
            data = json.loads((path / "config.json" if path.is_dir() else path).read_text())
            mt = data.get("model_type")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            return None
        if mt not in DECODER_MODEL_TYPES:
            return None
        what = f"model_type {mt!r}"
    return (f"{what} is a generative decoder: itif.Engine serves encoders (bert, albert, vit); "
            "serve decoders with itif.GenEngine (itif.generation.engine.GenEngine) and "
            "itif.GenerateRequest")


def is_decoder_backbone(source: str) -> bool:
    """Whether ``backbone.config`` (a preset name or a resolved path) names a decoder: a
    generation preset, or a Hugging Face config (a ``config.json`` or a directory holding one)
    whose ``model_type`` is one of :data:`DECODER_MODEL_TYPES`. Unreadable: not a decoder (the
    encoder engine then reports what is wrong with it)."""
    if source in generation_presets():
        return True
    if source in backbone_presets():
        return False
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("model_type") in DECODER_MODEL_TYPES


# --------------------------------------------------------------------------------------------
# A setting: a dataclass field that carries its converter and limits
# --------------------------------------------------------------------------------------------


def setting(conv: Callable[..., Any], default: Any = dataclasses.MISSING, *,
            base_dir: bool = False, **limits: Any) -> Any:
    """A dataclass field whose values ``conv(value, path, **limits)`` accepts. ``base_dir``:
    the converter also takes the directory relative paths resolve against."""
    return dataclasses.field(
        default=default, metadata={"conv": conv, "limits": limits, "base_dir": base_dir})


def check(cls: type, name: str, value: Any) -> Any:
    """``value`` checked against the limits of setting ``name`` of ``cls`` (a schema dataclass);
    :class:`InvalidConfig` (``"name: must be >= 1, got 0"``) when it is out of them. ``None``
    passes for a setting whose default is ``None``."""
    f = _field(cls, name)
    if value is None and f.default is None:
        return None
    try:
        return f.metadata["conv"](value, name, **f.metadata["limits"])
    except Bad as e:
        raise InvalidConfig(f"{e.path}: {e.msg}") from None


@functools.lru_cache(maxsize=None)
def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


# --------------------------------------------------------------------------------------------
# Converters. Each raises Bad(path, msg); sections collect them into one error.
# --------------------------------------------------------------------------------------------


class Bad(Exception):
    def __init__(self, path: str, msg: str) -> None:
        super().__init__(f"{path}: {msg}")
        self.path = path
        self.msg = msg


def fail(path: str, msg: str) -> NoReturn:
    raise Bad(path, msg)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def describe(value: Any) -> str:
    if value is None:
        return "null"
    kind = {
        bool: "bool",
        int: "int",
        float: "float",
        str: "string",
        list: "list",
        dict: "mapping",
    }.get(type(value), type(value).__name__)
    if isinstance(value, (list, dict)):
        return kind
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def string(value: Any, path: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        hint = " (quote it in YAML)" if isinstance(value, (bool, int, float)) else ""
        fail(path, f"must be a string, got {describe(value)}{hint}")
    if not allow_empty and not value.strip():
        fail(path, "must not be empty")
    if "\x00" in value:
        fail(path, "must not contain NUL characters")
    return value


def integer(value: Any, path: str, *, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(path, f"must be an integer, got {describe(value)}")
    if value < lo:
        fail(path, f"must be >= {lo}, got {value}")
    if value > hi:
        fail(path, f"must be <= {hi}, got {value}")
    return value


def count_or_auto(value: Any, path: str, *, lo: int, hi: int) -> int | str:
    """An integer within the limits, or ``"auto"`` (the owner derives it, e.g. from the
    cores)."""
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        fail(path, f"must be an integer or 'auto', got {describe(value)}")
    return integer(value, path, lo=lo, hi=hi)


def number(value: Any, path: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(path, f"must be a number, got {describe(value)}")
    v = float(value)
    if not math.isfinite(v):
        fail(path, f"must be finite, got {value}")
    if lo_open and v <= lo:
        fail(path, f"must be > {lo:g}, got {value}")
    if not lo_open and v < lo:
        fail(path, f"must be >= {lo:g}, got {value}")
    if v > hi:
        fail(path, f"must be <= {hi:g}, got {value}")
    return v


def size(value: Any, path: str, *, lo: int, hi: int) -> int:
    """Byte count: an integer, or a string like ``"64MiB"`` / ``"4 GiB"`` / ``"512k"``."""
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            fail(path, f"must be a byte count like 67108864 or '64MiB', got {value!r}")
        n = int(m.group(1)) * _SIZE_UNITS[unit]
    elif isinstance(value, bool) or not isinstance(value, int):
        fail(path, f"must be a byte count like 67108864 or '64MiB', got {describe(value)}")
    else:
        n = value
    if n < lo:
        fail(path, f"must be >= {lo} bytes, got {value!r}")
    if n > hi:
        fail(path, f"must be <= {hi} bytes, got {value!r}")
    return n


def choice(value: Any, path: str, *, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        fail(path, f"must be one of {options}, got {describe(value)}")
    return value


def flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        fail(path, f"must be true or false, got {describe(value)}")
    return value


def sha256(value: Any, path: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        fail(
            path,
            f"must be 64 lowercase hex characters, got {describe(value)} (quote it in YAML)",
        )
    s = string(value, path)
    if not _SHA256_RE.fullmatch(s):
        hint = ""
        if _SHA256_RE.fullmatch(s.strip().lower()):
            hint = " (use lowercase, no surrounding spaces)"
        elif len(s) != 64:
            hint = f" ({len(s)} characters; expected the sha256 of the token, not the token)"
        shown = s if len(s) <= 20 else s[:8] + "..." + s[-4:]
        fail(
            path,
            f"must be 64 lowercase hex characters (sha256 of the token), got {shown!r}{hint}",
        )
    return s


def tenant_id(value: Any, path: str) -> str:
    s = string(value, path)
    if not TENANT_ID_RE.fullmatch(s):
        fail(
            path,
            f"must match {TENANT_ID_RE.pattern} (lowercase letters, digits, '_' and '-', "
            f"at most 63 characters, starting with a letter or digit), got {s!r}",
        )
    return s


def hostport(value: Any, path: str) -> str:
    """``host:port``; IPv6 hosts bracketed (``[::]:50051``); port 0 picks a free port."""
    s = string(value, path)
    example = "expected host:port, e.g. 127.0.0.1:50051 or [::]:50051"
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or s[end + 1 : end + 2] != ":":
            fail(path, f"{example}, got {s!r}")
        host, port_s = s[1:end], s[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            fail(path, f"{host!r} inside [] is not an IPv6 address, got {s!r}")
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep or not host:
            fail(path, f"{example}, got {s!r}")
        if ":" in host:
            fail(path, f"IPv6 addresses must be bracketed, e.g. [::]:50051, got {s!r}")
        if not _HOSTNAME_RE.fullmatch(host):
            fail(path, f"{host!r} is not a valid host name or address, got {s!r}")
    if not port_s.isdigit() or not port_s.isascii():
        fail(path, f"port must be a number, got {s!r}")
    port = int(port_s)
    if port > 65535:
        fail(path, f"port must be <= 65535, got {s!r}")
    return s


def port_of(hostport: str) -> int:
    return int(hostport.rsplit(":", 1)[1])


def fs_path(value: Any, path: str, *, base_dir: Path) -> Path:
    s = string(value, path)
    p = Path(os.path.expanduser(s))
    if not p.is_absolute():
        p = base_dir / p
    return Path(os.path.normpath(p))


def backbone_source(value: Any, path: str, *, base_dir: Path) -> str:
    s = string(value, path)
    presets = sorted(backbone_presets())
    if s in presets:
        return s
    resolved = fs_path(s, path, base_dir=base_dir)
    if not resolved.exists() and "/" not in s and os.sep not in s:
        close = difflib.get_close_matches(s, presets, n=1)
        if close:
            fail(
                path,
                f"{s!r} is neither a preset nor an existing path; did you mean {close[0]!r}? "
                f"(presets: {', '.join(presets)})",
            )
    return str(resolved)


def strategy(value: Any, path: str) -> str:
    from itif.batching.strategies import STRATEGIES  # noqa: PLC0415 - at parse time only

    s = string(value, path)
    if not _STRATEGY_RE.fullmatch(s) or (s != "auto" and s not in STRATEGIES):
        fail(path, f"must be 'auto' or one of {sorted(STRATEGIES)}, got {s!r}")
    return s
