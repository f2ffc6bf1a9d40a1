"""Typed, validated ``tenants.yaml``.

The operator's file has four top-level sections::

    server:     listen, data_dir, admin_token_sha256, metrics_listen, max_message_bytes,
                max_upload_bytes, grace_s, tls {cert, key, client_ca}
    backbone:   config (checkpoint dir / config.json / preset name), device, dtype, max_seq_len,
                max_weight_bytes
    scheduler:  max_batch_tokens, max_batch_size, max_wait_ms, strategy, isolate_tenants,
                latency_sizing
    tenants:    - {id, token_sha256, max_queue, weight, max_seq_len, latency_target_ms}

Everything is parsed into frozen dataclasses. Validation is strict: unknown keys, wrong types,
out-of-range values and inconsistent combinations are all rejected with :class:`InvalidConfig`,
whose message quotes the key path (``tenants[2].max_queue: must be >= 1, got 0``). All problems
found in one file are reported together, one per line.

Relative paths (``server.data_dir``, ``server.tls.*``, a non-preset ``backbone.config``) are
resolved against the directory holding the YAML file, never against the working directory.
Nothing here reads environment variables.

:func:`diff_configs` tells a live reload which tenants were added, removed or changed and refuses
(with ``InvalidConfig`` naming the key) changes that only a restart can apply.
:class:`ConfigWatcher` polls the file and calls back with each new valid config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import ipaddress
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

import yaml

from itif.errors import InvalidConfig

__all__ = [
    "BACKBONE_PRESETS",
    "BackboneConfig",
    "Config",
    "ConfigDiff",
    "ConfigWatcher",
    "DEVICES",
    "DTYPES",
    "ServerConfig",
    "SchedulerConfig",
    "TLSConfig",
    "Tenant",
    "backbone_presets",
    "diff_configs",
    "hash_token",
    "load_config",
    "parse_config",
]

log = logging.getLogger(__name__)

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
# gRPC message limits are int32.
_GRPC_MAX_MESSAGE = (1 << 31) - 1


# --------------------------------------------------------------------------------------------
# Typed config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS. ``client_ca`` set means mutual TLS: clients must present a cert it signed."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


@dataclass(frozen=True)
class ServerConfig:
    listen: str
    data_dir: Path
    admin_token_sha256: str
    metrics_listen: str | None = None
    max_message_bytes: int = 64 * MiB
    max_upload_bytes: int = 4 * GiB
    grace_s: float = 10.0
    tls: TLSConfig | None = None


@dataclass(frozen=True)
class BackboneConfig:
    """``config`` is a preset name (see :data:`BACKBONE_PRESETS`) or an absolute path."""

    config: str
    device: Device = "auto"
    dtype: DType = "auto"
    max_seq_len: int | None = None
    #: Budget of the weight store in bytes (all tenants, shared tensors once); an upload that
    #: would exceed it is refused with RESOURCE_EXHAUSTED. None: no budget.
    max_weight_bytes: int | None = None

    @property
    def is_preset(self) -> bool:
        return self.config in backbone_presets()


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 8192
    max_batch_size: int = 256
    max_wait_ms: float = 5.0
    strategy: str = "auto"
    #: Never mix tenants in one batch (each tenant batched alone, as separate models are in
    #: Triton): the per-tenant baseline of ``itif bench``, not a production setting.
    isolate_tenants: bool = False
    #: Stop growing a batch when the next request would make a member that can still meet its
    #: tenant's latency target miss it (``itif.scheduler``); off (the default): grow to the
    #: batch limits.
    latency_sizing: bool = False


@dataclass(frozen=True)
class Tenant:
    id: str
    token_sha256: str
    max_queue: int = 64
    weight: float = 1.0
    max_seq_len: int | None = None
    latency_target_ms: float = 100.0


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    backbone: BackboneConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    tenants: tuple[Tenant, ...] = ()

    @property
    def tenant_ids(self) -> tuple[str, ...]:
        return tuple(t.id for t in self.tenants)

    def tenant(self, tenant_id: str) -> Tenant | None:
        """The tenant with this id, or ``None``."""
        for t in self.tenants:
            if t.id == tenant_id:
                return t
        return None


@functools.lru_cache(maxsize=1)
def backbone_presets() -> frozenset[str]:
    """Preset names: :data:`BACKBONE_PRESETS` plus those the backbone registry defines."""
    names = set(BACKBONE_PRESETS)
    try:
        from itif.backbones.spec import PRESETS
    except ImportError:
        pass
    else:
        names.update(PRESETS)
    return frozenset(names)


def hash_token(token: str) -> str:
    """Lowercase hex sha256 of the UTF-8 token: the value to put in ``*token_sha256``."""
    if not isinstance(token, str):
        raise TypeError(f"token must be str, got {type(token).__name__}")
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Field converters. Each raises _Bad(path, msg); sections collect them into one error.
# --------------------------------------------------------------------------------------------


class _Bad(Exception):
    def __init__(self, path: str, msg: str) -> None:
        super().__init__(f"{path}: {msg}")
        self.path = path
        self.msg = msg


def _fail(path: str, msg: str) -> NoReturn:
    raise _Bad(path, msg)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
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


def _str(value: Any, path: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        hint = " (quote it in YAML)" if isinstance(value, (bool, int, float)) else ""
        _fail(path, f"must be a string, got {_describe(value)}{hint}")
    if not allow_empty and not value.strip():
        _fail(path, "must not be empty")
    if "\x00" in value:
        _fail(path, "must not contain NUL characters")
    return value


def _int(value: Any, path: str, *, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"must be an integer, got {_describe(value)}")
    if value < lo:
        _fail(path, f"must be >= {lo}, got {value}")
    if value > hi:
        _fail(path, f"must be <= {hi}, got {value}")
    return value


def _float(value: Any, path: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, f"must be a number, got {_describe(value)}")
    v = float(value)
    if not math.isfinite(v):
        _fail(path, f"must be finite, got {value}")
    if lo_open and v <= lo:
        _fail(path, f"must be > {lo:g}, got {value}")
    if not lo_open and v < lo:
        _fail(path, f"must be >= {lo:g}, got {value}")
    if v > hi:
        _fail(path, f"must be <= {hi:g}, got {value}")
    return v


def _size(value: Any, path: str, *, lo: int, hi: int) -> int:
    """Byte count: an integer, or a string like ``"64MiB"`` / ``"4 GiB"`` / ``"512k"``."""
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            _fail(path, f"must be a byte count like 67108864 or '64MiB', got {value!r}")
        n = int(m.group(1)) * _SIZE_UNITS[unit]
    elif isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"must be a byte count like 67108864 or '64MiB', got {_describe(value)}")
    else:
        n = value
    if n < lo:
        _fail(path, f"must be >= {lo} bytes, got {value!r}")
    if n > hi:
        _fail(path, f"must be <= {hi} bytes, got {value!r}")
    return n


def _choice(value: Any, path: str, *, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        _fail(path, f"must be one of {options}, got {_describe(value)}")
    return value


def _sha256(value: Any, path: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _fail(
            path,
            f"must be 64 lowercase hex characters, got {_describe(value)} (quote it in YAML)",
        )
    s = _str(value, path)
    if not _SHA256_RE.match(s):
        hint = ""
        if _SHA256_RE.match(s.strip().lower()):
            hint = " (use lowercase, no surrounding spaces)"
        elif len(s) != 64:
            hint = f" ({len(s)} characters; expected the sha256 of the token, not the token)"
        shown = s if len(s) <= 20 else s[:8] + "..." + s[-4:]
        _fail(
            path,
            f"must be 64 lowercase hex characters (sha256 of the token), got {shown!r}{hint}",
        )
    return s


def _tenant_id(value: Any, path: str) -> str:
    s = _str(value, path)
    if not TENANT_ID_RE.match(s):
        _fail(
            path,
            f"must match {TENANT_ID_RE.pattern} (lowercase letters, digits, '_' and '-', "
            f"at most 63 characters, starting with a letter or digit), got {s!r}",
        )
    return s


def _hostport(value: Any, path: str) -> str:
    """``host:port``; IPv6 hosts bracketed (``[::]:50051``); port 0 picks a free port."""
    s = _str(value, path)
    example = "expected host:port, e.g. 127.0.0.1:50051 or [::]:50051"
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or s[end + 1 : end + 2] != ":":
            _fail(path, f"{example}, got {s!r}")
        host, port_s = s[1:end], s[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            _fail(path, f"{host!r} inside [] is not an IPv6 address, got {s!r}")
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep or not host:
            _fail(path, f"{example}, got {s!r}")
        if ":" in host:
            _fail(path, f"IPv6 addresses must be bracketed, e.g. [::]:50051, got {s!r}")
        if not _HOSTNAME_RE.match(host):
            _fail(path, f"{host!r} is not a valid host name or address, got {s!r}")
    if not port_s.isdigit() or not port_s.isascii():
        _fail(path, f"port must be a number, got {s!r}")
    port = int(port_s)
    if port > 65535:
        _fail(path, f"port must be <= 65535, got {s!r}")
    return s


def _port_of(hostport: str) -> int:
    return int(hostport.rsplit(":", 1)[1])


def _path(value: Any, path: str, *, base_dir: Path) -> Path:
    s = _str(value, path)
    p = Path(os.path.expanduser(s))
    if not p.is_absolute():
        p = base_dir / p
    return Path(os.path.normpath(p))


def _backbone_source(value: Any, path: str, *, base_dir: Path) -> str:
    s = _str(value, path)
    presets = sorted(backbone_presets())
    if s in presets:
        return s
    resolved = _path(s, path, base_dir=base_dir)
    if not resolved.exists() and "/" not in s and os.sep not in s:
        close = difflib.get_close_matches(s, presets, n=1)
        if close:
            _fail(
                path,
                f"{s!r} is neither a preset nor an existing path; did you mean {close[0]!r}? "
                f"(presets: {', '.join(presets)})",
            )
    return str(resolved)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

_REQUIRED = object()
_BAD = object()


class _Errors:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, msg: str) -> None:
        self.items.append(f"{path}: {msg}" if path else msg)

    def __bool__(self) -> bool:
        return bool(self.items)


class _Section:
    """A mapping at ``path`` whose keys must all be in ``allowed``."""

    def __init__(self, errs: _Errors, value: Any, path: str, allowed: tuple[str, ...]) -> None:
        self.errs = errs
        self.path = path
        self.ok = True
        self.data: Mapping[Any, Any] = {}
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            errs.add(path, f"must be a mapping, got {_describe(value)}")
            self.ok = False
            return
        self.data = value
        for key in value:
            if key in allowed:
                continue
            self.ok = False
            if not isinstance(key, str):
                errs.add(_join(path, repr(key)), f"keys must be strings, got {_describe(key)}")
                continue
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            errs.add(_join(path, key), f"unknown key ({hint}allowed: {', '.join(allowed)})")

    def get(self, key: str, conv: Callable[..., Any], default: Any = _REQUIRED, **kw: Any) -> Any:
        p = _join(self.path, key)
        if key not in self.data:
            if default is _REQUIRED:
                self.errs.add(p, "required key is missing")
                self.ok = False
                return _BAD
            return default
        value = self.data[key]
        if value is None and default is None:
            return None  # optional, explicitly unset
        try:
            return conv(value, p, **kw)
        except _Bad as e:
            self.errs.add(e.path, e.msg)
            self.ok = False
            return _BAD


def _parse_tls(errs: _Errors, value: Any, path: str, base_dir: Path) -> TLSConfig | None | object:
    sec = _Section(errs, value, path, ("cert", "key", "client_ca"))
    cert = sec.get("cert", _path, None, base_dir=base_dir)
    key = sec.get("key", _path, None, base_dir=base_dir)
    client_ca = sec.get("client_ca", _path, None, base_dir=base_dir)
    if not sec.ok:
        return _BAD
    if cert is None and key is None:
        if client_ca is not None:
            errs.add(
                _join(path, "cert"),
                f"required (with {_join(path, 'key')}) when {_join(path, 'client_ca')} is set "
                f"({str(client_ca)!r})",
            )
        else:
            errs.add(path, "must set cert and key (or remove the section)")
        return _BAD
    if cert is not None and key is None:
        errs.add(_join(path, "key"), f"required when {_join(path, 'cert')} is set ({str(cert)!r})")
        return _BAD
    if key is not None and cert is None:
        errs.add(_join(path, "cert"), f"required when {_join(path, 'key')} is set ({str(key)!r})")
        return _BAD
    return TLSConfig(cert=cert, key=key, client_ca=client_ca)


def _parse_server(errs: _Errors, value: Any, base_dir: Path) -> ServerConfig | object:
    names = tuple(f.name for f in dataclasses.fields(ServerConfig))
    sec = _Section(errs, value, "server", names)
    d = ServerConfig
    kw = dict(
        listen=sec.get("listen", _hostport),
        data_dir=sec.get("data_dir", _path, base_dir=base_dir),
        admin_token_sha256=sec.get("admin_token_sha256", _sha256),
        metrics_listen=sec.get("metrics_listen", _hostport, None),
        max_message_bytes=sec.get(
            "max_message_bytes", _size, d.max_message_bytes, lo=KiB, hi=_GRPC_MAX_MESSAGE
        ),
        max_upload_bytes=sec.get("max_upload_bytes", _size, d.max_upload_bytes, lo=1, hi=TiB),
        grace_s=sec.get("grace_s", _float, d.grace_s, lo=0.0, hi=3600.0),
    )
    tls = None
    if sec.data.get("tls") is not None:
        tls = _parse_tls(errs, sec.data["tls"], "server.tls", base_dir)
        if tls is _BAD:
            sec.ok = False
    if not sec.ok:
        return _BAD
    listen, metrics = kw["listen"], kw["metrics_listen"]
    if metrics is not None and metrics == listen and _port_of(listen) != 0:
        errs.add(
            "server.metrics_listen",
            f"{metrics!r} is the same address as server.listen {listen!r}",
        )
        return _BAD
    return ServerConfig(tls=tls, **kw)


def _parse_backbone(errs: _Errors, value: Any, base_dir: Path) -> BackboneConfig | object:
    names = tuple(f.name for f in dataclasses.fields(BackboneConfig))
    sec = _Section(errs, value, "backbone", names)
    cfg = sec.get("config", _backbone_source, base_dir=base_dir)
    device = sec.get("device", _choice, "auto", choices=DEVICES)
    dtype = sec.get("dtype", _choice, "auto", choices=DTYPES)
    max_seq_len = sec.get("max_seq_len", _int, None, lo=1, hi=MAX_SEQ_LEN_LIMIT)
    max_weight_bytes = sec.get("max_weight_bytes", _size, None, lo=1, hi=64 * TiB)
    if not sec.ok:
        return _BAD
    return BackboneConfig(config=cfg, device=device, dtype=dtype, max_seq_len=max_seq_len,
                          max_weight_bytes=max_weight_bytes)


def _parse_scheduler(errs: _Errors, value: Any) -> SchedulerConfig | object:
    names = tuple(f.name for f in dataclasses.fields(SchedulerConfig))
    sec = _Section(errs, value, "scheduler", names)
    d = SchedulerConfig
    kw = dict(
        max_batch_tokens=sec.get("max_batch_tokens", _int, d.max_batch_tokens, lo=1, hi=1 << 24),
        max_batch_size=sec.get("max_batch_size", _int, d.max_batch_size, lo=1, hi=1 << 16),
        max_wait_ms=sec.get("max_wait_ms", _float, d.max_wait_ms, lo=0.0, hi=60_000.0),
        strategy=sec.get("strategy", _strategy, d.strategy),
        isolate_tenants=sec.get("isolate_tenants", _flag, d.isolate_tenants),
        latency_sizing=sec.get("latency_sizing", _flag, d.latency_sizing),
    )
    if not sec.ok:
        return _BAD
    return SchedulerConfig(**kw)


def _flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"must be true or false, got {_describe(value)}")
    return value


def _strategy(value: Any, path: str) -> str:
    from itif.batching.strategies import STRATEGIES  # noqa: PLC0415 - at parse time only

    s = _str(value, path)
    if not _STRATEGY_RE.match(s) or (s != "auto" and s not in STRATEGIES):
        _fail(path, f"must be 'auto' or one of {sorted(STRATEGIES)}, got {s!r}")
    return s


def _parse_tenant(errs: _Errors, value: Any, path: str) -> Tenant | object:
    names = tuple(f.name for f in dataclasses.fields(Tenant))
    if value is None:
        errs.add(path, "must be a mapping with at least id and token_sha256, got null")
        return _BAD
    sec = _Section(errs, value, path, names)
    d = Tenant
    kw = dict(
        id=sec.get("id", _tenant_id),
        token_sha256=sec.get("token_sha256", _sha256),
        max_queue=sec.get("max_queue", _int, d.max_queue, lo=1, hi=1_000_000),
        weight=sec.get("weight", _float, d.weight, lo=0.0, hi=1e6, lo_open=True),
        max_seq_len=sec.get("max_seq_len", _int, None, lo=1, hi=MAX_SEQ_LEN_LIMIT),
        latency_target_ms=sec.get(
            "latency_target_ms", _float, d.latency_target_ms, lo=0.0, hi=3_600_000.0, lo_open=True
        ),
    )
    if not sec.ok:
        return _BAD
    return Tenant(**kw)


def _parse_tenants(errs: _Errors, value: Any) -> tuple[Tenant, ...] | object:
    if value is None:
        return ()
    if not isinstance(value, list):
        errs.add("tenants", f"must be a list of tenants, got {_describe(value)}")
        return _BAD
    tenants: list[tuple[int, Tenant]] = []
    ok = True
    for i, item in enumerate(value):
        t = _parse_tenant(errs, item, f"tenants[{i}]")
        if t is _BAD:
            ok = False
        else:
            tenants.append((i, t))  # type: ignore[arg-type]
    # Duplicates are checked among the tenants that parsed, so they are reported even when
    # another entry is broken.
    by_id: dict[str, int] = {}
    by_hash: dict[str, tuple[int, str]] = {}
    for i, t in tenants:
        if t.id in by_id:
            errs.add(
                f"tenants[{i}].id",
                f"duplicate tenant id {t.id!r} (also tenants[{by_id[t.id]}].id)",
            )
            ok = False
        else:
            by_id[t.id] = i
        if t.token_sha256 in by_hash:
            j, other = by_hash[t.token_sha256]
            errs.add(
                f"tenants[{i}].token_sha256",
                f"same token hash as tenants[{j}].token_sha256 (tenant {other!r}); "
                "every tenant needs its own token",
            )
            ok = False
        else:
            by_hash[t.token_sha256] = (i, t.id)
    if not ok:
        return _BAD
    return tuple(t for _, t in tenants)


def _cross_checks(errs: _Errors, cfg: Config) -> None:
    bb_len = cfg.backbone.max_seq_len
    budget = cfg.scheduler.max_batch_tokens
    if bb_len is not None and budget < bb_len:
        errs.add(
            "scheduler.max_batch_tokens",
            f"{budget} is less than backbone.max_seq_len {bb_len}; "
            "a full-length sequence could never be scheduled",
        )
    admin = cfg.server.admin_token_sha256
    for i, t in enumerate(cfg.tenants):
        if t.token_sha256 == admin:
            errs.add(
                f"tenants[{i}].token_sha256",
                f"equals server.admin_token_sha256 (tenant {t.id!r}); "
                "tenant and admin tokens must differ",
            )
        if t.max_seq_len is not None:
            if bb_len is not None and t.max_seq_len > bb_len:
                errs.add(
                    f"tenants[{i}].max_seq_len",
                    f"{t.max_seq_len} exceeds backbone.max_seq_len {bb_len}",
                )
            if t.max_seq_len > budget:
                errs.add(
                    f"tenants[{i}].max_seq_len",
                    f"{t.max_seq_len} exceeds scheduler.max_batch_tokens {budget}",
                )


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys in a mapping instead of keeping the last one."""


def _construct_mapping_strict(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # unhashable key; SafeLoader reports it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r} (first defined on line {first + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_strict
)


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    detail = f"{problem} ({context})" if context and "duplicate key" not in problem else problem
    return f"invalid YAML{where}: {detail}"


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------

_TOP_KEYS = ("server", "backbone", "scheduler", "tenants")


def parse_config(text: str, base_dir: Path | str, *, source: str | None = None) -> Config:
    """Parse and validate YAML text. Relative paths resolve against ``base_dir``.

    ``source`` (a file name) prefixes the error message when given.
    """
    prefix = f"{source}: " if source else ""
    if not isinstance(text, str):
        raise InvalidConfig(f"{prefix}config text must be str, got {type(text).__name__}")
    base = Path(os.path.abspath(os.path.expanduser(str(base_dir))))
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        raise InvalidConfig(prefix + _yaml_error(e)) from None
    if data is None:
        raise InvalidConfig(
            f"{prefix}config is empty (expected sections: server, backbone, tenants)"
        )
    if not isinstance(data, Mapping):
        raise InvalidConfig(
            f"{prefix}config must be a mapping with sections {', '.join(_TOP_KEYS)}, "
            f"got {_describe(data)}"
        )

    errs = _Errors()
    top = _Section(errs, data, "", _TOP_KEYS)
    for key in ("server", "backbone"):
        if key not in data:
            errs.add(key, "required section is missing")
    server = _parse_server(errs, data.get("server"), base) if "server" in data else _BAD
    backbone = _parse_backbone(errs, data.get("backbone"), base) if "backbone" in data else _BAD
    scheduler = _parse_scheduler(errs, data.get("scheduler"))
    tenants = _parse_tenants(errs, data.get("tenants"))
    if top.ok and not errs:
        cfg = Config(
            server=server,  # type: ignore[arg-type]
            backbone=backbone,  # type: ignore[arg-type]
            scheduler=scheduler,  # type: ignore[arg-type]
            tenants=tenants,  # type: ignore[arg-type]
        )
        _cross_checks(errs, cfg)
        if not errs:
            return cfg
    if len(errs.items) == 1:
        raise InvalidConfig(prefix + errs.items[0])
    raise InvalidConfig(f"{prefix}{len(errs.items)} problems:\n  " + "\n  ".join(errs.items))


def _decode(data: bytes, source: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidConfig(f"{source}: not valid UTF-8 at byte {e.start}") from None
    return text[1:] if text.startswith("\ufeff") else text


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, parse and validate a tenants.yaml. Every failure is :class:`InvalidConfig`."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InvalidConfig(f"{path}: cannot read config: {e.strerror or e}") from None
    return parse_config(_decode(data, str(path)), p.absolute().parent, source=str(path))


# --------------------------------------------------------------------------------------------
# Diff for live reload
# --------------------------------------------------------------------------------------------

# server keys that are baked into listeners / the gRPC server at start-up.
_RESTART_SERVER_KEYS = ("listen", "data_dir", "metrics_listen", "max_message_bytes", "tls")
_LIVE_SERVER_KEYS = ("admin_token_sha256", "max_upload_bytes", "grace_s")


@dataclass(frozen=True)
class ConfigDiff:
    """What a live reload must apply. ``changed`` holds the *new* Tenant of each changed id."""

    added: tuple[Tenant, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[Tenant, ...] = ()
    scheduler_changed: bool = False
    #: Live-applicable server keys that changed (admin_token_sha256, max_upload_bytes, grace_s).
    server_changed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.added
            or self.removed
            or self.changed
            or self.scheduler_changed
            or self.server_changed
        )


def _show(value: Any) -> str:
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, TLSConfig):
        fields = dataclasses.asdict(value).items()
        return repr({k: (str(v) if v is not None else None) for k, v in fields})
    return repr(value)


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    """Tenant-level difference between two configs.

    Raises :class:`InvalidConfig` naming every key whose change needs a restart
    (``server.listen``, ``server.data_dir``, ``server.metrics_listen``,
    ``server.max_message_bytes``, ``server.tls``, any ``backbone.*``). Tenant, scheduler and the
    other server keys are live-applicable.
    """
    problems: list[str] = []
    for name in _RESTART_SERVER_KEYS:
        a, b = getattr(old.server, name), getattr(new.server, name)
        if a != b:
            problems.append(f"server.{name}: changed from {_show(a)} to {_show(b)}")
    for f in dataclasses.fields(BackboneConfig):
        a, b = getattr(old.backbone, f.name), getattr(new.backbone, f.name)
        if a != b:
            problems.append(f"backbone.{f.name}: changed from {_show(a)} to {_show(b)}")
    if problems:
        msg = "; ".join(problems)
        raise InvalidConfig(f"{msg}; this change needs a restart and was not applied")

    old_by_id = {t.id: t for t in old.tenants}
    new_ids = {t.id for t in new.tenants}
    added = tuple(t for t in new.tenants if t.id not in old_by_id)
    removed = tuple(t.id for t in old.tenants if t.id not in new_ids)
    changed = tuple(t for t in new.tenants if t.id in old_by_id and old_by_id[t.id] != t)
    server_changed = tuple(
        k for k in _LIVE_SERVER_KEYS if getattr(old.server, k) != getattr(new.server, k)
    )
    return ConfigDiff(
        added=added,
        removed=removed,
        changed=changed,
        scheduler_changed=old.scheduler != new.scheduler,
        server_changed=server_changed,
    )


# --------------------------------------------------------------------------------------------
# Watcher
# --------------------------------------------------------------------------------------------

_MISSING = "<missing>"


class ConfigWatcher:
    """Polls a tenants.yaml and reports each new valid config.

    Every ``poll_s`` a daemon thread stats the path (following links), its ``realpath`` and the
    link itself; when any of that changed (or at least every ``max(1 s, 10*poll_s)``, for
    file systems with coarse mtimes) it reads the content and hashes it. That catches in-place
    rewrites, editors' write-temp-then-rename and Kubernetes' atomic ``..data`` symlink swap.

    New content is acted on only once it has been unchanged for ``debounce_s`` (so half-written
    files are never parsed), and only once per content change: it is parsed and validated in full
    (relative paths resolve against the directory of ``path`` as given, not of its realpath);
    then ``on_change(config)`` is called. If validation fails, or ``on_change`` raises (e.g. it
    ran :func:`diff_configs` and the change needs a restart), ``on_error(exc)`` is called and
    :attr:`last_good` keeps the previous config. A missing file is reported the same way.

    :meth:`start` reads the current file synchronously as the baseline: without ``initial`` it
    only sets :attr:`last_good` (or :attr:`last_error`, and calls ``on_error``); with ``initial``
    (the config the caller already loaded) it calls ``on_change`` if the file no longer matches
    it. Callbacks run on the watcher thread (the baseline ones on the caller's); exceptions from
    ``on_error`` are logged, never propagated.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[Config], None],
        on_error: Callable[[Exception], None],
        poll_s: float = 0.5,
        debounce_s: float = 0.2,
        *,
        initial: Config | None = None,
    ) -> None:
        if not (poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        if not (debounce_s >= 0 and math.isfinite(debounce_s)):
            raise ValueError(f"debounce_s must be >= 0, got {debounce_s}")
        self._path = Path(path).absolute()
        self._source = str(path)
        self._on_change = on_change
        self._on_error = on_error
        self._poll_s = float(poll_s)
        self._debounce_s = float(debounce_s)
        self._rescan_s = max(1.0, 10 * self._poll_s)
        self._initial = initial
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_good: Config | None = initial
        self._last_error: Exception | None = None
        self._seen: str | None = None  # digest of the content last acted on
        self._pending: tuple[str, float] | None = None  # (digest, first seen, monotonic)
        self._sig: tuple[Any, ...] | None = None
        self._last_read = 0.0

    # -- public ------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_good(self) -> Config | None:
        with self._lock:
            return self._last_good

    @property
    def last_error(self) -> Exception | None:
        """The error of the latest attempt; ``None`` once a later content applied cleanly."""
        with self._lock:
            return self._last_error

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def start(self) -> ConfigWatcher:
        if self._thread is not None:
            raise RuntimeError("ConfigWatcher already started")
        self._stop_event.clear()
        self._sig = self._signature()
        self._last_read = time.monotonic()
        digest, data = self._read()
        self._seen = digest
        self._apply(data, baseline=True)
        self._thread = threading.Thread(target=self._run, name="itif-config-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop polling and join the thread (a callback in progress finishes first)."""
        self._stop_event.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    def __enter__(self) -> ConfigWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop_event.wait(self._poll_s):
            try:
                self._poll_once()
            except Exception:  # never let the watcher die
                log.exception("config watcher: unexpected error while polling %s", self._source)

    def _poll_once(self) -> None:
        """One polling step; only the watcher thread calls this."""
        now = time.monotonic()
        sig = self._signature()
        if sig == self._sig and self._pending is None and now - self._last_read < self._rescan_s:
            return
        self._sig = sig
        self._last_read = now
        digest, data = self._read()
        if self._pending is None or self._pending[0] != digest:
            if digest == self._seen:
                self._pending = None  # changed back before it settled
                return
            self._pending = (digest, now)
        if now - self._pending[1] < self._debounce_s:
            return
        self._pending = None
        self._seen = digest
        if self._stop_event.is_set():
            return
        self._apply(data, baseline=False)

    @staticmethod
    def _stat(p: str | Path, follow: bool = True) -> tuple[Any, ...]:
        try:
            s = os.stat(p) if follow else os.lstat(p)
        except OSError as e:
            return ("error", e.errno)
        return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)

    def _signature(self) -> tuple[Any, ...]:
        real = os.path.realpath(self._path)
        return (
            self._stat(self._path),
            self._stat(self._path, follow=False),
            real,
            self._stat(real),
        )

    def _read(self) -> tuple[str, bytes | Exception | None]:
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return _MISSING, None
        except OSError as e:
            return f"<error {e.errno}>", e
        return hashlib.sha256(data).hexdigest(), data

    def _apply(self, data: bytes | Exception | None, *, baseline: bool) -> None:
        try:
            if data is None:
                raise InvalidConfig(f"{self._source}: config file not found")
            if isinstance(data, Exception):
                raise InvalidConfig(f"{self._source}: cannot read config: {data}")
            cfg = parse_config(_decode(data, self._source), self._path.parent, source=self._source)
        except Exception as e:
            self._report(e)
            return
        if baseline and (self._initial is None or cfg == self._initial):
            with self._lock:
                self._last_good = cfg
                self._last_error = None
            return
        try:
            self._on_change(cfg)
        except Exception as e:
            self._report(e)
            return
        with self._lock:
            self._last_good = cfg
            self._last_error = None

    def _report(self, exc: Exception) -> None:
        with self._lock:
            self._last_error = exc
        log.warning("config reload rejected: %s", exc)
        try:
            self._on_error(exc)
        except Exception:
            log.exception("config watcher: on_error callback failed")
