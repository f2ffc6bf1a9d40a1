"""The parts of ``itif.weights.tiers`` that hold state but make no decisions: the tier names, a
tenant's record, its public view, the host tier's interned tensors, and what the manager needs of
the scheduler and tells its observer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from itif.weights.store import tensor_key

__all__ = ["HostPool", "Scheduling", "TenantState", "Tier", "TierObserver", "TierView"]


class Tier(Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    NONE = "none"  # registered without weights


class TierObserver(Protocol):
    def tier_promoted(self, tenant: str, source: str, seconds: float, ok: bool) -> None:
        """A promotion from ``source`` (host or disk) finished (``ok``) or failed."""

    def tier_evicted(self, tenant: str, to: str) -> None:
        """A resident tenant was evicted to ``to`` (host or disk)."""


class Scheduling(Protocol):  # what the manager needs of ``itif.scheduler.Scheduler``
    def park(self, tenant: str, parked: bool = True) -> None: ...

    def fail_parked(self, tenant: str, error: BaseException) -> int: ...


@dataclass(frozen=True)
class TierView:
    """A tenant's place in the tiers (``itif tenants``, health, metrics)."""

    tier: Tier
    pinned: bool
    loading: bool
    busy: int
    host_bytes: int  # bytes its host-tier copy holds (shared tensors included)
    promotions: int
    evictions: int
    failures: int
    last_promotion_ms: float
    error: str
    #: the store bytes its weights read when they were last installed on the device, shared
    #: tensors included; kept while they are evicted (0: not installed since this run
    #: registered it or since its weights changed)
    weight_bytes: int = 0


class TenantState:
    __slots__ = ("tier", "pinned", "busy", "loading", "base", "own", "signed", "num_labels",
                 "has_pooler", "host", "host_keys", "host_bytes", "weight_bytes", "promotions",
                 "evictions", "failures", "last_ms", "error")

    def __init__(self, tier: Tier, pinned: bool, base: str | None) -> None:
        self.tier, self.pinned, self.base = tier, pinned, base
        self.busy = 0
        self.loading = False
        self.own: tuple[str, ...] = ()  # names of its own tensors (not inherited from a base)
        self.signed = False  # num_labels / has_pooler known (from weights seen this run)
        self.num_labels: int | None = None
        self.has_pooler = False
        self.host: dict[str, torch.Tensor] | None = None  # host tier: interned tensors
        self.host_keys: dict[str, str] = {}  # their content keys (``tensor_key``), kept
        self.host_bytes = 0
        self.weight_bytes = 0  # its store bytes when last installed (``TierView.weight_bytes``)
        self.promotions = self.evictions = self.failures = 0
        self.last_ms = 0.0
        self.error = ""


class HostPool:
    """Host-tier tensors, each distinct tensor held once with a reference count (keyed by
    ``tensor_key``, confirmed bit for bit)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.by_key: dict[tuple, list[list]] = {}  # (name, shape, key) -> [[tensor, refs]]
        self.bytes = 0

    def intern(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, str]:
        """(the pool's copy of ``t``, its content key): the key is kept by the caller, so
        neither ``release`` nor the promotion back (``Digests``) hashes the tensor again."""
        t = t.detach()
        digest = tensor_key(t)
        key = (name, tuple(t.shape), digest)
        for cell in self.by_key.get(key, ()):
            if cell[0].dtype == t.dtype and torch.equal(cell[0], t.to("cpu")):
                cell[1] += 1
                return cell[0], digest
        if self.pin:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)
        else:  # one allocation and copy (empty + copy_ costs two dispatches)
            host = t.clone(memory_format=torch.contiguous_format)
        self.by_key.setdefault(key, []).append([host, 1])
        self.bytes += host.numel() * host.element_size()
        return host, digest

    def release(self, name: str, t: torch.Tensor, digest: str | None = None) -> None:
        key = (name, tuple(t.shape), digest if digest is not None else tensor_key(t))
        cells = self.by_key.get(key, [])
        for i, cell in enumerate(cells):
            if cell[0] is t:
                cell[1] -= 1
                if not cell[1]:
                    del cells[i]
                    self.bytes -= t.numel() * t.element_size()
                    if not cells:
                        del self.by_key[key]
                return
