"""What the daemon reports about tenants and callers: plain data (no torch, no protobuf).

``itif.daemon`` re-exports every name here; the servers and the daemon's helper modules
(``itif.daemon_tiers``) can import them from here without importing the daemon.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from itif.config import Config, Tenant
    from itif.daemon import Daemon
    from itif.weights.tier_state import TierView

__all__ = ["Identity", "State", "TenantStatus", "TenantView", "identity", "misplaced", "note",
           "noted"]


class State(Enum):
    NO_WEIGHTS = 0
    LOADING = 1
    READY = 2
    FAILED = 3


@dataclass(frozen=True)
class Identity:
    """Who is calling: a tenant (``tenant`` set) or the admin; ``token_sha256``: the digest of
    the token that said so (empty for in-process callers), checked again before an upload that
    outlived a token rotation commits."""

    tenant: str | None
    admin: bool = False
    token_sha256: str = field(default="", repr=False)

    def may_see(self, tenant: str) -> bool:
        return self.admin or self.tenant == tenant

    def still_accepted(self, config: Config) -> bool:
        """Whether ``config`` still accepts the token this caller came with (False once it was
        rotated or revoked, e.g. while an upload streamed); in-process callers (no digest) are
        always accepted."""
        if not self.token_sha256:
            return True
        if self.admin:
            return hmac.compare_digest(self.token_sha256, config.server.admin_token_sha256)
        t = config.tenant_by_token_sha256(self.token_sha256)
        return t is not None and t.id == self.tenant


@dataclass
class TenantStatus:
    state: State = State.NO_WEIGHTS
    sha256: str = ""
    error: str = ""


@dataclass(frozen=True)
class TenantView:
    """What GetTenant/ListTenants report."""

    id: str
    state: State
    sha256: str
    weight_bytes: int
    exclusive_bytes: int
    num_labels: int
    queue_depth: int
    error: str
    tier: str = ""  # weight tiers (``itif.weights.tiers``): device, host, disk or none
    host_bytes: int = 0  # bytes of its host-tier copy
    delta: dict | None = None  # a delta tenant: ``DeltaReport.as_dict()`` (error, bytes)
    compress: str = ""  # a delta tenant's tenants[].compress


def own_view(v: TenantView, tv: TierView | None) -> TenantView:
    """What a tenant is told of itself: nothing that moves with other tenants' weights or
    traffic. Its bytes are all its bytes (what sharing saves is the operator's to see), the
    same wherever its weights are (``tv``, its place in the tiers: as installed when they were
    last resident, so an eviction by another tenant's request does not show as 0), and its
    tier is not shown."""
    size = v.weight_bytes or (tv.weight_bytes if tv is not None and v.sha256 else 0)
    return replace(v, weight_bytes=size, exclusive_bytes=size, tier="", host_bytes=0)


# ---- what a stored file was committed for ----------------------------------------------------
def identity(t: Tenant | None) -> tuple[str | None, str]:
    """What a tenant's stored file was committed as: (its base, its compress)."""
    return (None, "none") if t is None else (t.base, t.compress)


def note(t: Tenant | None) -> dict:
    """The note stored beside a tenant's committed file (:func:`identity`)."""
    base, compress = identity(t)
    return {"base": base, "compress": compress}


def noted(d: Daemon, t: Tenant) -> tuple[str | None, str]:
    """What ``t``'s stored file was committed as, from its note; files from before notes: what
    the configuration says now."""
    n = d.blobs.note(t.id)
    return identity(t) if n is None else (n.get("base"), n.get("compress", "none"))


def misplaced(d: Daemon, tenant: str) -> str | None:
    """Why ``tenant``'s stored file may not serve it as configured now, or None."""
    t = d.config.tenant(tenant)
    was = d.stored_as.get(tenant)
    if was is None and t is not None and d.blobs.exists(tenant):
        # a file this run has not placed yet (its tenant came back after a restart): its note
        was = d.stored_as[tenant] = noted(d, t)
    if t is None or was is None or was == identity(t):
        return None
    return (f"its stored weights were uploaded as {_describe(was)}; it is now "
            f"{_describe(identity(t))}: upload its weights again")


def _describe(kind: tuple[str | None, str]) -> str:
    base, compress = kind
    if base is None:
        return "a full tenant"
    return f"a {compress} delta of {base!r}" if compress != "none" else f"a LoRA tenant of {base!r}"
