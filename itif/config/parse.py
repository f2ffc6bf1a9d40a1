"""Parse and validate ``tenants.yaml`` into the typed config (``itif.config.schema``).

Validation is strict: unknown keys, wrong types, out-of-range values and inconsistent
combinations are all rejected with :class:`InvalidConfig`, whose message quotes the key path
(``tenants[2].max_queue: must be >= 1, got 0``). All problems found in one file are reported
together, one per line. Each key's converter and limits come from its schema field.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from itif.config.fields import Bad, describe, join, port_of
from itif.config.schema import (
    BackboneConfig,
    Config,
    SchedulerConfig,
    ServerConfig,
    Tenant,
    TLSConfig,
)
from itif.errors import InvalidConfig

__all__ = ["decode", "load_config", "parse_config"]

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
            errs.add(path, f"must be a mapping, got {describe(value)}")
            self.ok = False
            return
        self.data = value
        for key in value:
            if key in allowed:
                continue
            self.ok = False
            if not isinstance(key, str):
                errs.add(join(path, repr(key)), f"keys must be strings, got {describe(key)}")
                continue
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            errs.add(join(path, key), f"unknown key ({hint}allowed: {', '.join(allowed)})")

    def get(self, key: str, conv: Callable[..., Any], default: Any = _REQUIRED, **kw: Any) -> Any:
        p = join(self.path, key)
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
        except Bad as e:
            self.errs.add(e.path, e.msg)
            self.ok = False
            return _BAD

    def settings(self, cls: type, base_dir: Path | None = None, *, optional: bool = False,
                 skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every setting of ``cls`` (its converter, limits and default from the field), in field
        order. ``optional``: a missing key is ``None`` even where the field has no default."""
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            meta = f.metadata
            limits = dict(meta["limits"])
            if meta["base_dir"]:
                limits["base_dir"] = base_dir
            default = f.default
            if default is dataclasses.MISSING:
                default = None if optional else _REQUIRED
            kw[f.name] = self.get(f.name, meta["conv"], default, **limits)
        return kw


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _parse_tls(errs: _Errors, value: Any, path: str, base_dir: Path) -> TLSConfig | None | object:
    sec = _Section(errs, value, path, _names(TLSConfig))
    kw = sec.settings(TLSConfig, base_dir, optional=True)
    cert, key, client_ca = kw["cert"], kw["key"], kw["client_ca"]
    if not sec.ok:
        return _BAD
    if cert is None and key is None:
        if client_ca is not None:
            errs.add(
                join(path, "cert"),
                f"required (with {join(path, 'key')}) when {join(path, 'client_ca')} is set "
                f"({str(client_ca)!r})",
            )
        else:
            errs.add(path, "must set cert and key (or remove the section)")
        return _BAD
    if cert is not None and key is None:
        errs.add(join(path, "key"), f"required when {join(path, 'cert')} is set ({str(cert)!r})")
        return _BAD
    if key is not None and cert is None:
        errs.add(join(path, "cert"), f"required when {join(path, 'key')} is set ({str(key)!r})")
        return _BAD
    return TLSConfig(cert=cert, key=key, client_ca=client_ca)


def _parse_server(errs: _Errors, value: Any, base_dir: Path) -> ServerConfig | object:
    sec = _Section(errs, value, "server", _names(ServerConfig))
    kw = sec.settings(ServerConfig, base_dir, skip=("tls",))
    tls = None
    if sec.data.get("tls") is not None:
        tls = _parse_tls(errs, sec.data["tls"], "server.tls", base_dir)
        if tls is _BAD:
            sec.ok = False
    if not sec.ok:
        return _BAD
    listen, metrics = kw["listen"], kw["metrics_listen"]
    if metrics is not None and metrics == listen and port_of(listen) != 0:
        errs.add(
            "server.metrics_listen",
            f"{metrics!r} is the same address as server.listen {listen!r}",
        )
        return _BAD
    return ServerConfig(tls=tls, **kw)


def _parse_backbone(errs: _Errors, value: Any, base_dir: Path) -> BackboneConfig | object:
    sec = _Section(errs, value, "backbone", _names(BackboneConfig))
    kw = sec.settings(BackboneConfig, base_dir)
    if not sec.ok:
        return _BAD
    return BackboneConfig(**kw)


def _parse_scheduler(errs: _Errors, value: Any) -> SchedulerConfig | object:
    sec = _Section(errs, value, "scheduler", _names(SchedulerConfig))
    kw = sec.settings(SchedulerConfig)
    if not sec.ok:
        return _BAD
    return SchedulerConfig(**kw)


def _parse_tenant(errs: _Errors, value: Any, path: str) -> Tenant | object:
    if value is None:
        errs.add(path, "must be a mapping with at least id and token_sha256, got null")
        return _BAD
    sec = _Section(errs, value, path, _names(Tenant))
    kw = sec.settings(Tenant)
    if not sec.ok:
        return _BAD
    return Tenant(**kw)


def _parse_tenants(errs: _Errors, value: Any) -> tuple[Tenant, ...] | object:
    if value is None:
        return ()
    if not isinstance(value, list):
        errs.add("tenants", f"must be a list of tenants, got {describe(value)}")
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
    bases = {t.id: t for _, t in tenants}
    for i, t in tenants:
        if t.is_delta and t.base is None:
            errs.add(f"tenants[{i}].compress", f"{t.compress!r} needs base: the full tenant "
                                               "its delta is taken against")
            ok = False
        if t.max_error is not None and not t.is_delta:
            errs.add(f"tenants[{i}].max_error", "only applies to a delta tenant (compress: "
                                                "int8 or sign)")
            ok = False
        if t.base is None:
            continue
        if t.base == t.id or t.base not in bases:
            errs.add(f"tenants[{i}].base", f"{t.base!r} must be the id of another tenant")
            ok = False
        elif bases[t.base].base is not None:
            other = bases[t.base]
            kind = "delta" if other.is_delta else "LoRA"
            errs.add(f"tenants[{i}].base", f"{t.base!r} is itself a {kind} tenant (base "
                                           f"{other.base!r}); a base must be a full tenant")
            ok = False
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
    tiers = cfg.backbone.device_weight_bytes is not None
    if cfg.backbone.host_weight_bytes and not tiers:
        errs.add("backbone.host_weight_bytes", "only applies with backbone.device_weight_bytes "
                                               "(weight tiers), which is not set")
    for i, t in enumerate(cfg.tenants):
        if t.pinned and not tiers:
            errs.add(f"tenants[{i}].pinned", "only applies with backbone.device_weight_bytes "
                                             "(weight tiers), which is not set: every tenant "
                                             "is resident")
        if t.token_sha256 == admin:
            errs.add(
                f"tenants[{i}].token_sha256",
                f"equals server.admin_token_sha256 (tenant {t.id!r}); "
                "tenant and admin tokens must differ",
            )
        if t.is_delta and cfg.backbone.is_decoder:  # LoRA tenants of a decoder: served
            errs.add(f"tenants[{i}].compress", "delta tenants are served on encoder backbones "
                                               f"only; backbone.config {cfg.backbone.config!r} "
                                               "is a decoder")
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
            f"got {describe(data)}"
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


def decode(data: bytes, source: str) -> str:
    """A config file's bytes as text (UTF-8, a leading BOM dropped); InvalidConfig if not."""
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
    return parse_config(decode(data, str(path)), p.absolute().parent, source=str(path))
