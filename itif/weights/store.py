"""WeightStore: one contiguous buffer per parameter kind, a slot per distinct tensor.

Every canonical parameter kind (name and shape, see ``itif.backbones.spec``) owns one buffer
``[capacity, *shape]``: CuPy-owned on CUDA and exposed to torch zero-copy through DLPack, a torch
tensor on the CPU. A tenant is a map ``canonical name -> (kind, slot)``. Identical tensors
(same sha256 of their bytes in the store dtype) share one slot with a reference count, so
tenants that froze layers, or differ only in their head, hold those weights once and the engine
runs one GEMM for all of them.

Concurrency: readers (the forward) never wait for writers. A writer (add/remove tenant) works
under a lock and publishes an immutable ``StoreView`` with one assignment. Growth allocates a
doubled buffer, copies, and publishes it; readers of the previous view keep the old buffer alive
through their reference. A freed slot is not reused until every reader that might still read it
(those holding an older view) has finished, so a removed tenant's in-flight forward stays right.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

import torch

from itif.backbones.hf import CanonicalWeights
from itif.errors import Overloaded, TenantNotFound
from itif.platform import cupy_module

KindKey = tuple[str, tuple[int, ...]]  # (canonical name, shape)


@dataclass(frozen=True)
class TenantEntry:
    """One tenant's place in the store: which slot of which kind each parameter reads."""

    slots: Mapping[str, tuple[KindKey, int]]
    num_labels: int | None
    has_pooler: bool
    generation: int  # bumps on every (re)upload; lets callers tell weights apart


@dataclass(frozen=True)
class StoreView:
    """An immutable snapshot: buffers and slot tables as of one version."""

    version: int
    buffers: Mapping[KindKey, torch.Tensor]
    tenants: Mapping[str, TenantEntry]

    def param(self, tenant: str, name: str) -> tuple[torch.Tensor, int]:
        """(buffer [capacity, *shape], slot) of one tenant's parameter."""
        kind, slot = self.tenants[tenant].slots[name]
        return self.buffers[kind], slot


@dataclass
class _Kind:
    key: KindKey
    buf: torch.Tensor
    owner: object  # the CuPy array behind ``buf`` on CUDA (kept alive), else None
    refs: list[int] = field(default_factory=list)
    by_hash: dict[str, int] = field(default_factory=dict)
    hash_of: dict[int, str] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)

    @property
    def slot_bytes(self) -> int:
        return self.buf[0].numel() * self.buf.element_size()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, on the CPU)."""
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


class WeightStore:
    def __init__(
        self,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_bytes: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_bytes = max_bytes
        self._kinds: dict[KindKey, _Kind] = {}
        self._write = threading.Lock()
        self._readers = threading.Lock()
        self._active: Counter[int] = Counter()  # view version -> readers holding it
        self._pending: list[tuple[int, KindKey, int]] = []  # (freed at version, kind, slot)
        self._generation = 0
        self._view = StoreView(0, MappingProxyType({}), MappingProxyType({}))

    # ---- readers ---------------------------------------------------------------------------
    @property
    def view(self) -> StoreView:
        """The current snapshot, for callers that do not read buffers (metadata only)."""
        return self._view

    @contextmanager
    def read(self) -> Iterator[StoreView]:
        """Hold a snapshot while reading its buffers; slots it references stay untouched."""
        with self._readers:
            view = self._view
            self._active[view.version] += 1
        try:
            yield view
        finally:
            with self._readers:
                self._active[view.version] -= 1
                if not self._active[view.version]:
                    del self._active[view.version]

    # ---- accounting ------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes of the distinct tensors held (each shared tensor counted once)."""
        with self._write:
            return sum(k.slot_bytes * sum(1 for r in k.refs if r) for k in self._kinds.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated for buffers, free slots included."""
        with self._write:
            return sum(k.buf.numel() * k.buf.element_size() for k in self._kinds.values())

    def tenant_bytes(self, tenant: str) -> tuple[int, int]:
        """(bytes the tenant reads, bytes only it holds): the second is what removal frees."""
        with self._write:
            entry = self._view.tenants.get(tenant)
            if entry is None:
                raise TenantNotFound(f"tenant {tenant!r} not found")
            total = exclusive = 0
            for kind_key, slot in entry.slots.values():
                kind = self._kinds[kind_key]
                total += kind.slot_bytes
                if kind.refs[slot] == 1:
                    exclusive += kind.slot_bytes
            return total, exclusive

    def tenants(self) -> list[str]:
        return list(self._view.tenants)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._view.tenants

    # ---- writers ---------------------------------------------------------------------------
    def add(self, tenant: str, weights: CanonicalWeights) -> StoreView:
        """Add or replace a tenant. A replacement is atomic: readers see old or new weights."""
        digests = {n: tensor_digest(t.to(self.dtype)) for n, t in weights.tensors.items()}
        with self._write:
            self._reclaim()
            self._check_budget(weights, digests)
            slots: dict[str, tuple[KindKey, int]] = {}
            taken: list[tuple[KindKey, int]] = []
            try:
                for name, t in weights.tensors.items():
                    key = (name, tuple(t.shape))
                    slot = self._acquire(key, t, digests[name])
                    slots[name] = (key, slot)
                    taken.append((key, slot))
            except BaseException:
                for key, slot in taken:  # e.g. out of memory while growing: undo
                    self._release_now(key, slot)
                raise
            self._generation += 1
            old = self._view.tenants.get(tenant)
            entry = TenantEntry(
                MappingProxyType(slots), weights.num_labels, weights.has_pooler, self._generation
            )
            tenants = dict(self._view.tenants)
            tenants[tenant] = entry
            self._publish(tenants)
            if old is not None:
                self._release(old)
            return self._view

    def remove(self, tenant: str) -> None:
        """Drop a tenant; its unshared slots become free once no reader can still see them."""
        with self._write:
            old = self._view.tenants.get(tenant)
            if old is None:
                raise TenantNotFound(f"tenant {tenant!r} not found")
            tenants = dict(self._view.tenants)
            del tenants[tenant]
            self._publish(tenants)
            self._release(old)
            self._reclaim()

    def check_budget(self, weights: CanonicalWeights) -> None:
        """Raise Overloaded if adding ``weights`` now would exceed the memory budget."""
        if self.max_bytes is None:
            return
        digests = {n: tensor_digest(t.to(self.dtype)) for n, t in weights.tensors.items()}
        with self._write:
            self._check_budget(weights, digests)

    # ---- internals (called with self._write held) ----------------------------------------
    def _publish(self, tenants: dict[str, TenantEntry]) -> None:
        buffers = MappingProxyType({k: kind.buf for k, kind in self._kinds.items()})
        self._view = StoreView(self._view.version + 1, buffers, MappingProxyType(tenants))

    def _check_budget(self, weights: CanonicalWeights, digests: dict[str, str]) -> None:
        if self.max_bytes is None:
            return
        new = 0
        for name, t in weights.tensors.items():
            kind = self._kinds.get((name, tuple(t.shape)))
            if kind is None or digests[name] not in kind.by_hash:
                new += t.numel() * torch.empty((), dtype=self.dtype).element_size()
        held = sum(k.slot_bytes * sum(1 for r in k.refs if r) for k in self._kinds.values())
        if held + new > self.max_bytes:
            raise Overloaded(
                f"adding these weights needs {new} new bytes; the store holds {held} of its "
                f"{self.max_bytes}-byte budget"
            )

    def _acquire(self, key: KindKey, t: torch.Tensor, digest: str) -> int:
        kind = self._kinds.get(key)
        if kind is not None and digest in kind.by_hash:
            slot = kind.by_hash[digest]
            kind.refs[slot] += 1
            return slot
        if kind is None:
            kind = self._kinds[key] = self._new_kind(key, capacity=1)
        if not kind.free:
            self._grow(kind)
        slot = kind.free.pop()
        kind.buf[slot].copy_(t.to(self.dtype))
        kind.refs[slot] = 1
        kind.by_hash[digest] = slot
        kind.hash_of[slot] = digest
        return slot

    def _allocate(self, capacity: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, object]:
        numel = capacity
        for d in shape:
            numel *= d
        cupy = cupy_module() if self.device.type == "cuda" else None
        if cupy is not None:
            with cupy.cuda.Device(self.device.index or 0):
                raw = cupy.empty(numel * torch.empty((), dtype=self.dtype).element_size(), cupy.uint8)
            buf = torch.from_dlpack(raw).view(self.dtype).view(capacity, *shape)
            return buf, raw
        return torch.empty((capacity, *shape), dtype=self.dtype, device=self.device), None

    def _new_kind(self, key: KindKey, capacity: int) -> _Kind:
        buf, owner = self._allocate(capacity, key[1])
        return _Kind(key, buf, owner, refs=[0] * capacity, free=list(range(capacity - 1, -1, -1)))

    def _grow(self, kind: _Kind) -> None:
        old_cap = kind.buf.shape[0]
        new_cap = max(2 * old_cap, 1)
        buf, owner = self._allocate(new_cap, kind.key[1])
        buf[:old_cap].copy_(kind.buf)
        kind.buf, kind.owner = buf, owner
        kind.refs += [0] * (new_cap - old_cap)
        kind.free = list(range(new_cap - 1, old_cap - 1, -1)) + kind.free

    def _drop_ref(self, key: KindKey, slot: int) -> bool:
        kind = self._kinds[key]
        kind.refs[slot] -= 1
        if kind.refs[slot]:
            return False
        del kind.by_hash[kind.hash_of.pop(slot)]
        return True

    def _release(self, entry: TenantEntry) -> None:
        for key, slot in entry.slots.values():
            if self._drop_ref(key, slot):
                self._pending.append((self._view.version, key, slot))

    def _release_now(self, key: KindKey, slot: int) -> None:
        if self._drop_ref(key, slot):
            self._kinds[key].free.append(slot)

    def _reclaim(self) -> None:
        """Free pending slots that no active reader's view can reference any more."""
        with self._readers:
            oldest = min(self._active, default=None)
        keep = []
        for freed_at, key, slot in self._pending:
            # A view older than ``freed_at`` may still point at the slot.
            if oldest is None or oldest >= freed_at:
                self._kinds[key].free.append(slot)
            else:
                keep.append((freed_at, key, slot))
        self._pending = keep
