"""The difference between two configs, for a live reload.

:func:`diff_configs` tells a live reload which tenants were added, removed or changed and refuses
(with ``InvalidConfig`` naming the key) changes that only a restart can apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from itif.config.schema import BackboneConfig, Config, Tenant, TLSConfig
from itif.errors import InvalidConfig

__all__ = ["ConfigDiff", "diff_configs"]


# server keys that are baked into listeners / the gRPC server at start-up.
_RESTART_SERVER_KEYS = ("listen", "data_dir", "metrics_listen", "http_listen", "max_message_bytes",
                        "tls", "max_pending_calls", "max_streams_per_connection",
                        "ingress_processes", "http_max_connections", "http_header_timeout_s",
                        "http_json_processes", "http_max_connections_per_client")
_LIVE_SERVER_KEYS = ("admin_token_sha256", "max_upload_bytes", "grace_s", "upload_idle_s",
                     "max_inflight_calls", "max_active_calls", "max_pending_reply_bytes",
                     "max_new_tokens")

# tenant keys fixed for the tenant's life (what its stored weights are depends on them)
_FIXED_TENANT_KEYS = ("base", "compress")


@dataclass(frozen=True)
class ConfigDiff:
    """What a live reload must apply. ``changed`` holds the *new* Tenant of each changed id."""

    added: tuple[Tenant, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[Tenant, ...] = ()
    scheduler_changed: bool = False
    #: Live-applicable server keys that changed (``_LIVE_SERVER_KEYS``).
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
    (``server.listen``, ``server.data_dir``, ``server.metrics_listen``, ``server.http_listen``,
    ``server.max_message_bytes``, ``server.tls``, ``server.max_pending_calls``,
    ``server.max_streams_per_connection``, ``server.ingress_processes``,
    ``server.http_max_connections``, ``server.http_header_timeout_s``,
    ``server.http_json_processes``, ``server.http_max_connections_per_client``, any
    ``backbone.*``).
    Tenant, scheduler and the other server keys are live-applicable.
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
    for key in _FIXED_TENANT_KEYS:
        rebased = [f"tenants[{i}].{key}: {t.id!r} changed from "
                   f"{_show(getattr(old_by_id[t.id], key))} to {_show(getattr(t, key))}"
                   for i, t in enumerate(new.tenants)
                   if t.id in old_by_id and getattr(old_by_id[t.id], key) != getattr(t, key)]
        if rebased:
            raise InvalidConfig(f"{'; '.join(rebased)}; a tenant's {key} is fixed for its life: "
                                "remove the tenant and add it again (not applied)")
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

