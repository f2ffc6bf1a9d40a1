"""What the daemon reports about tenants and callers: plain data (no torch, no protobuf).

``itif.daemon`` re-exports every name here; the servers and the daemon's helper modules
(``itif.daemon_tiers``) can import them from here without importing the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Identity", "State", "TenantStatus", "TenantView"]


class State(Enum):
    NO_WEIGHTS = 0
    LOADING = 1
    READY = 2
    FAILED = 3


@dataclass(frozen=True)
class Identity:
    """Who is calling: a tenant (``tenant`` set) or the admin."""

    tenant: str | None
    admin: bool = False

    def may_see(self, tenant: str) -> bool:
        return self.admin or self.tenant == tenant


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
