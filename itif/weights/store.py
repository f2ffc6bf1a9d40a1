"""WeightStore: one contiguous buffer per parameter kind, a slot per distinct tensor.

Every canonical parameter kind (name and shape, see ``itif.backbones.spec``) owns one buffer
``[capacity, *shape]``: CuPy-owned on CUDA and exposed to torch zero-copy through DLPack, on the
CPU a torch tensor (over an anonymous mapping of its own from 1 MiB on). A tenant is a map
``canonical name -> (kind, slot)``. Identical tensors (the same bytes in the store dtype) share
one slot with a reference count, so tenants that froze layers, or differ only in their head,
hold those weights once and the engine runs one GEMM for all of them.

Finding a stored twin: each tensor gets a cheap *key* (:func:`tensor_key`, a hash of its dtype,
shape and an evenly spread sample of at most 8 KiB of its bytes: microseconds at any size). A
key that no live slot has means a new tensor. A key that one slot has is confirmed by comparing
the bytes (C ``memcmp`` on the CPU, one batched comparison on the GPU: memory speed, several
times faster than hashing them); only a key that several different slots share (tensors that
differ where the sample does not look) falls back to the sha256 of the whole tensor
(:func:`tensor_digest`, computed at most once per tensor and per slot). A slot is shared only
for bit-identical bytes, never on a key alone. The keys of an upload are computed once
(:class:`Digests`): ``check_budget`` returns them with the matches it confirmed, and ``add``
reuses both, passed back explicitly or remembered for the same weights object (the daemon
checks the budget, commits the file, then adds).

Concurrency: readers (the forward, ``read()``) never wait for writers. Writers (add/remove
tenant) run one at a time under ``_writer``; their slow work (matching, growing buffers,
copying tensors into free slots) happens under that lock only. Growth allocates a larger buffer
and copies the slots in use into it while readers keep reading the published one; nothing can
change those slots meanwhile, as only the writer writes. Bookkeeping that accounting calls read
(reference counts, buffers, the view) changes in short sections under ``_state``, and the new
``StoreView`` is published there with one assignment; readers of the previous view keep the old
buffer alive through their reference. A freed slot is not reused until every reader that might
still read it (those holding an older view) has finished, so a removed tenant's in-flight
forward stays right.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import sys
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np
import torch

from itif.backbones.hf import CanonicalWeights
from itif.clib import libc
from itif.errors import Overloaded, TenantNotFound, shown
from itif.platform import cupy_module

_MAPPED_BYTES = 1 << 20  # CPU buffers from this size on get a mapping of their own
KindKey = tuple[str, tuple[int, ...]]  # (canonical name, shape)

_KEY_WHOLE = 1 << 13  # tensors up to this many bytes are keyed by all of their bytes
_KEY_BLOCK, _KEY_BLOCKS = 64, 128  # else by at most 128 64-byte blocks spread evenly, the last
_CMP_CHUNK = 1 << 20  # bytes compared per step (bounded temporaries, early exit)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TenantEntry:
    """One tenant's place in the store: which slot of which kind each parameter reads."""

    slots: Mapping[str, tuple[KindKey, int]]
    num_labels: int | None
    has_pooler: bool
    generation: int  # bumps on every (re)upload; lets callers tell weights apart
    tag: str = ""  # the caller's name for these weights (the daemon's: their file's sha256)


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
    slot_bytes: int
    refs: list[int] = field(default_factory=list)
    fill: list[int] = field(default_factory=list)  # per slot: serial of its last write
    by_key: dict[str, list[int]] = field(default_factory=dict)  # tensor_key -> live slots
    key_of: dict[int, str] = field(default_factory=dict)
    sha_of: dict[int, str] = field(default_factory=dict)  # full digests, computed on demand
    free: list[int] = field(default_factory=list)
    live: int = 0  # slots with a reference
    pairs: dict[int, tuple[KindKey, int]] = field(default_factory=dict)  # slot -> its tuple

    def pair(self, slot: int) -> tuple[KindKey, int]:  # one object for every entry reading it
        return self.pairs.setdefault(slot, (self.key, slot))


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` (itself when it already is one)."""
    return t.detach().to("cpu", dtype).contiguous()


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_key(t: torch.Tensor) -> str:
    """Cheap content key: equal tensors (dtype, shape, bytes) always get equal keys; different
    ones almost always different keys, but a match must still be confirmed on the bytes."""
    return _key(t.detach().cpu().contiguous())


def _key(t: torch.Tensor) -> str:
    raw = _bytes(t)
    n = raw.size
    h = hashlib.sha256(f"{t.dtype}{t.shape}{n}".encode())
    if n <= _KEY_WHOLE:
        h.update(raw)
    else:
        blocks = n // _KEY_BLOCK
        grid = raw[: blocks * _KEY_BLOCK].reshape(blocks, _KEY_BLOCK)
        h.update(grid[:: -(-blocks // _KEY_BLOCKS)].copy())
        h.update(raw[n - _KEY_BLOCK:])  # the last bytes, whatever the stride skipped
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, on the CPU)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous tensors of one dtype; on the CPU a plain memcpy through
    numpy, which skips torch's intra-op thread pool (waking it costs milliseconds on a busy
    machine, for copies that take microseconds)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        return np.copyto(_bytes(dst), _bytes(src))
    dst.copy_(src)


def _libc_memcmp():
    """C ``memcmp``: memory speed, stops at the first difference, runs without the GIL."""
    fn = getattr(libc(), "memcmp", None)
    if fn is None:  # no C library in this process
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn


_memcmp = _libc_memcmp()


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality of two flat uint8 arrays, a chunk at a time (where C ``memcmp``,
    which ``WeightStore._same`` prefers, is not at hand)."""
    if a.size != b.size:
        return False
    n = a.size
    width = 8 if n % 8 == 0 else 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    wide = np.dtype(f"u{width}")
    a, b = a.view(wide), b.view(wide)
    step = _CMP_CHUNK // width
    for i in range(0, a.size, step):
        if not (a[i:i + step] == b[i:i + step]).all():
            return False
    return True


class Digests:
    """The content keys of one set of weights for one store dtype, computed once per upload.

    ``WeightStore.check_budget`` returns one; ``WeightStore.add`` takes it back (or finds it by
    the weights object), so an upload's tensors are keyed and compared against the store once.
    Valid for exactly those weights while their tensors are not modified: a tensor replaced in
    the dict or changed in place by a torch operation makes them stale, and the store keys the
    weights afresh.
    """

    __slots__ = ("_weights", "_stamp", "dtype", "keys", "shas", "matches")

    def __init__(self, weights: CanonicalWeights, dtype: torch.dtype,
                 host: Mapping[str, torch.Tensor]) -> None:
        self._weights = weakref.ref(weights)
        self._stamp = _stamp(weights)
        self.dtype = dtype
        self.keys = {n: _key(t) for n, t in host.items()}
        self.shas: dict[str, str] = {}  # name -> sha256, of those sha() hashed so far
        # name -> (kind, slot, fill serial): a live slot found bit-identical to the tensor
        self.matches: dict[str, tuple[KindKey, int, int]] = {}

    def belongs_to(self, weights: CanonicalWeights, dtype: torch.dtype) -> bool:
        if self._weights() is not weights or self.dtype != dtype:
            return False
        now = weights.tensors
        return len(now) == len(self._stamp) and all(
            now.get(n) is t and t._version == v for n, t, v in self._stamp)

    def sha(self, name: str, t: torch.Tensor) -> str:
        if name not in self.shas:
            self.shas[name] = tensor_digest(t)
        return self.shas[name]


def _stamp(weights: CanonicalWeights) -> tuple:
    """Which tensor objects the weights hold, at which in-place version."""
    return tuple((n, t, t._version) for n, t in weights.tensors.items())


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
        self._elem = torch.empty((), dtype=dtype).element_size()
        self._kinds: dict[KindKey, _Kind] = {}
        self._writer = threading.Lock()  # one writer at a time, held through its slow work
        self._state = threading.Lock()  # short: bookkeeping that accounting reads, publishing
        self._readers = threading.Lock()
        self._active: Counter[int] = Counter()  # view version -> readers holding it
        self._pending: list[tuple[int, KindKey, int]] = []  # (freed at version, kind, slot)
        self._generation = 0
        self._serial = 0
        self._prepared: dict[int, Digests] = {}  # id(weights) -> what check_budget computed
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

    # ---- accounting (never waits for a writer's slow work) ---------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes of the distinct tensors held (each shared tensor counted once)."""
        with self._state:
            return self._held()

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated for buffers, free slots included."""
        with self._state:
            return sum(k.slot_bytes * k.buf.shape[0] for k in self._kinds.values())

    def tenant_bytes(self, tenant: str) -> tuple[int, int]:
        """(bytes the tenant reads, bytes only it holds): the second is what removal frees."""
        with self._state:
            entry = self._view.tenants.get(tenant)
            if entry is None:
                raise TenantNotFound(f"tenant {shown(tenant)} not found")
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
    def digests(self, weights: CanonicalWeights) -> Digests:
        """Key ``weights`` for this store (cheap); pass the result to ``check_budget``/``add``."""
        return Digests(weights, self.dtype, self._host(weights))

    def add(self, tenant: str, weights: CanonicalWeights, digests: Digests | None = None,
            base: str | None = None, tag: str = "") -> StoreView:
        """Add or replace a tenant. A replacement is atomic: readers see old or new weights
        (and ``tag``, kept in the tenant's entry, names which).

        ``digests``: what ``check_budget`` (or ``digests``) returned for these same weights;
        without it, keys ``check_budget`` computed for this weights object are reused.
        ``base``: a stored tenant whose every tensor this one also reads, in the same slots
        (nothing copied or hashed); ``weights`` then holds only what it adds or replaces (a
        LoRA tenant's adapters and heads). It keeps the base's tensors of this moment, whatever
        later happens to the base."""
        host = self._host(weights)
        d = self._digests_for(weights, digests, host, pop=True)
        with self._writer:
            self._reclaim()
            inherited: dict[str, tuple[KindKey, int]] = {}
            if base is not None:
                entry = self._view.tenants.get(base)
                if entry is None:
                    raise TenantNotFound(f"base tenant {shown(base)} not found")
                inherited = {n: ks for n, ks in entry.slots.items() if n not in weights.tensors}
            hits, new = self._match(d, host)
            self._check_budget(new, host)
            self._reserve(Counter((n, tuple(host[n].shape)) for n in new))
            slots: dict[str, tuple[KindKey, int]] = {}
            taken: list[tuple[_Kind, int]] = []
            try:
                for name in new:  # into free slots: no published view references them
                    key = (name, tuple(host[name].shape))
                    kind = self._kinds[key]
                    slot = kind.free.pop()
                    taken.append((kind, slot))
                    _copy(kind.buf[slot], host[name])
                    slots[name] = (key, slot)
                self._sync()
            except BaseException:
                for kind, slot in taken:
                    kind.free.append(slot)
                raise
            with self._state:
                for name, (key, slot) in (*hits.items(), *inherited.items()):
                    self._kinds[key].refs[slot] += 1
                    slots[name] = self._kinds[key].pair(slot)
                for name in new:
                    key, slot = slots[name]
                    self._index(self._kinds[key], slot, d.keys[name], d.shas.get(name))
                    slots[name] = self._kinds[key].pair(slot)
                self._generation += 1
                old = self._view.tenants.get(tenant)
                # shared pair tuples and interned names: a tenant's entry costs its dict only
                ordered = {sys.intern(n): slots[n] for n in (*inherited, *weights.tensors)}
                entry = TenantEntry(MappingProxyType(ordered), weights.num_labels,
                                    weights.has_pooler, self._generation, tag)
                tenants = self._view.tenants.copy()  # the dict behind the proxy: O(n) but fast
                tenants[tenant] = entry
                self._publish(tenants)
                if old is not None:
                    self._release(old)
                return self._view

    def remove(self, tenant: str) -> None:
        """Drop a tenant; its unshared slots become free once no reader can still see them."""
        with self._writer:
            with self._state:
                old = self._view.tenants.get(tenant)
                if old is None:
                    raise TenantNotFound(f"tenant {shown(tenant)} not found")
                tenants = self._view.tenants.copy()  # the dict behind the proxy: O(n) but fast
                del tenants[tenant]
                self._publish(tenants)
                self._release(old)
            self._reclaim()

    def check_budget(self, weights: CanonicalWeights, digests: Digests | None = None,
                     owner: str | None = None) -> Digests:
        """Raise Overloaded if adding ``weights`` now would exceed the memory budget. Returns
        the weights' keys (and the stored twins it confirmed) for ``add`` to reuse.

        ``owner``: the tenant the weights are for. Then only tensors the owner itself holds now
        are credited as already stored; a tensor held only by other tenants is charged in full,
        so whether the check passes never tells the owner what other tenants uploaded."""
        host = self._host(weights)
        d = self._digests_for(weights, digests, host, pop=False)
        if self.max_bytes is not None:
            with self._writer:
                self._reclaim()
                hits, new = self._match(d, host)
                if owner is not None:
                    entry = self._view.tenants.get(owner)
                    own = set(entry.slots.values()) if entry is not None else set()
                    new = new + [n for n, ks in hits.items() if ks not in own]
                self._check_budget(new, host)
        self._remember(weights, d)
        return d

    # ---- internals -------------------------------------------------------------------------
    def _host(self, weights: CanonicalWeights) -> dict[str, torch.Tensor]:
        return {n: _host(t, self.dtype) for n, t in weights.tensors.items()}

    def _digests_for(self, weights, digests, host, pop: bool) -> Digests:
        """The given digests, else those ``check_budget`` remembered for this weights object,
        else fresh ones; any that no longer fit the weights (see ``Digests``) are not used."""
        if digests is None:
            take = self._prepared.pop if pop else self._prepared.get
            digests = take(id(weights), None)
        if digests is not None and digests.belongs_to(weights, self.dtype):
            return digests
        return Digests(weights, self.dtype, host)

    def _remember(self, weights: CanonicalWeights, d: Digests) -> None:
        """Keep ``check_budget``'s keys for the ``add`` of the same weights object; dropped by
        that ``add`` or when the weights are collected. Plain dict operations (atomic under the
        GIL), no lock: the finalizer may run inside any section, locks held."""
        key = id(weights)
        self._prepared[key] = d
        prepared = self._prepared

        def forget() -> None:
            if prepared.get(key) is d:
                prepared.pop(key, None)

        weakref.finalize(weights, forget)

    def _held(self) -> int:
        return sum(k.slot_bytes * k.live for k in self._kinds.values())

    def _publish(self, tenants: dict[str, TenantEntry]) -> None:
        """(``_state`` held) Make a new snapshot current: one assignment readers pick up."""
        buffers = MappingProxyType({k: kind.buf for k, kind in self._kinds.items()})
        self._view = StoreView(self._view.version + 1, buffers, MappingProxyType(tenants))

    def _match(self, d: Digests, host: Mapping[str, torch.Tensor]) -> tuple[dict, list[str]]:
        """(``_writer`` held) Split tensors into stored twins {name: (kind, slot)} and new
        names. Live slots cannot change while the writer lock is held."""
        hits: dict[str, tuple[KindKey, int]] = {}
        new: list[str] = []
        check: list[tuple[str, KindKey, _Kind, int]] = []  # one candidate: compare the bytes
        for name, t in host.items():
            key = (name, tuple(t.shape))
            kind = self._kinds.get(key)
            cands = kind.by_key.get(d.keys[name]) if kind is not None else None
            known = d.matches.get(name)
            if (known is not None and kind is not None and known[0] == key
                    and kind.refs[known[1]] and kind.fill[known[1]] == known[2]):
                hits[name] = (key, known[1])  # confirmed earlier, not freed nor rewritten since
            elif not cands:
                new.append(name)
            elif len(cands) == 1:
                check.append((name, key, kind, cands[0]))
            else:  # several different tensors share this key: tell them apart by sha256
                slot = self._by_sha(kind, cands, d.sha(name, t))
                if slot is None:
                    new.append(name)
                else:
                    hits[name] = (key, slot)
        for (name, key, kind, slot), same in zip(check, self._same_all(check, host)):
            if same:
                hits[name] = (key, slot)
            else:
                new.append(name)
        for name, (key, slot) in hits.items():
            d.matches[name] = (key, slot, self._kinds[key].fill[slot])
        return hits, new

    @staticmethod
    def _by_sha(kind: _Kind, cands: list[int], sha: str) -> int | None:
        for slot in cands:
            if slot not in kind.sha_of:
                kind.sha_of[slot] = tensor_digest(kind.buf[slot])
            if kind.sha_of[slot] == sha:
                return slot
        return None

    def _same_all(self, check, host: Mapping[str, torch.Tensor]) -> list[bool]:
        """Whether each ``(name, key, kind, slot)`` slot holds exactly the bytes of
        ``host[name]``. On CUDA the tensors go up and are compared together: one sync."""
        if self.device.type != "cuda":
            return [self._same(kind, slot, host[name]) for name, _, kind, slot in check]
        differs = []
        for name, _, kind, slot in check:
            stored = kind.buf[slot]
            as_int = _INT_OF_SIZE[stored.element_size()]  # bit-for-bit, not float equality
            up = host[name].to(self.device, non_blocking=True).view(as_int)
            differs.append(torch.ne(stored.view(as_int), up).any())
        return [not x for x in torch.stack(differs).tolist()] if differs else []

    @staticmethod
    def _same(kind: _Kind, slot: int, t: torch.Tensor) -> bool:
        """Whether a live CPU slot holds exactly the bytes of ``t`` (contiguous, host, store
        dtype)."""
        if _memcmp is not None:  # straight on the pointers: no per-call tensor objects
            return _memcmp(kind.buf.data_ptr() + slot * kind.slot_bytes, t.data_ptr(),
                           kind.slot_bytes) == 0
        return _same_bytes(_bytes(kind.buf[slot]), _bytes(t))

    def _index(self, kind: _Kind, slot: int, key: str, sha: str | None) -> None:
        """(``_state`` held) A freshly written slot goes live with one reference."""
        self._serial += 1
        kind.refs[slot] = 1
        kind.fill[slot] = self._serial
        kind.live += 1
        kind.key_of[slot] = key
        kind.by_key.setdefault(key, []).append(slot)
        if sha is not None:
            kind.sha_of[slot] = sha

    def _check_budget(self, new: list[str], host: Mapping[str, torch.Tensor]) -> None:
        # a tenant reads the message: not what the store holds (every tenant's weights together)
        if self.max_bytes is None:
            return
        need = sum(host[n].numel() * self._elem for n in new)
        with self._state:
            held = self._held()
        if held + need > self.max_bytes:
            raise Overloaded(f"adding these weights needs {need} new bytes, more than the "
                             f"store's {self.max_bytes}-byte budget has free")

    def _allocate(self, capacity: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, object]:
        numel = capacity
        for d in shape:
            numel *= d
        cupy = cupy_module() if self.device.type == "cuda" else None
        if cupy is not None:
            with cupy.cuda.Device(self.device.index or 0):
                raw = cupy.empty(numel * self._elem, cupy.uint8)
            buf = torch.from_dlpack(raw).view(self.dtype).view(capacity, *shape)
            return buf, raw
        if self.device.type == "cpu" and numel * self._elem >= _MAPPED_BYTES:
            raw = mmap.mmap(-1, numel * self._elem)  # freed with its last reader; heap: RSS 1.9x
            return torch.frombuffer(raw, dtype=self.dtype).view(capacity, *shape), raw
        return torch.empty((capacity, *shape), dtype=self.dtype, device=self.device), None

    def _reserve(self, need: Counter) -> None:
        """(``_writer`` held) Make ``need[kind]`` free slots available in every kind.

        The new buffer is allocated and filled outside ``_state``: readers and accounting go on
        with the published buffer, and the slots copied cannot change meanwhile (only the
        writer writes slots). The swap is a few assignments; readers see the new buffer with the
        next published view. On failure (out of memory) nothing visible has changed."""
        for key, n in need.items():
            kind = self._kinds.get(key)
            if kind is None:
                buf, owner = self._allocate(max(n, 1), key[1])
                cap = buf.shape[0]
                kind = _Kind(key, buf, owner, buf[0].numel() * self._elem, refs=[0] * cap,
                             fill=[0] * cap, free=list(range(cap - 1, -1, -1)))
                with self._state:
                    self._kinds[key] = kind
                continue
            short = n - len(kind.free)
            if short <= 0:
                continue
            old_cap = kind.buf.shape[0]
            new_cap = max(2 * old_cap, old_cap + short)
            buf, owner = self._allocate(new_cap, key[1])
            _copy(buf[:old_cap], kind.buf)
            self._sync()
            with self._state:
                kind.buf, kind.owner = buf, owner
                kind.refs.extend([0] * (new_cap - old_cap))
                kind.fill.extend([0] * (new_cap - old_cap))
                kind.free = list(range(new_cap - 1, old_cap - 1, -1)) + kind.free

    def _sync(self) -> None:
        """Finish device copies before a view that reads them is published (readers may run
        on other streams)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _release(self, entry: TenantEntry) -> None:
        """(``_state`` held) Drop a replaced or removed tenant's references; a slot left with
        none leaves the index and waits in ``_pending`` for its readers to finish."""
        for key, slot in entry.slots.values():
            kind = self._kinds[key]
            kind.refs[slot] -= 1
            if kind.refs[slot]:
                continue
            kind.live -= 1
            kind.pairs.pop(slot, None)
            k = kind.key_of.pop(slot)
            kind.by_key[k].remove(slot)
            if not kind.by_key[k]:
                del kind.by_key[k]
            kind.sha_of.pop(slot, None)
            self._pending.append((self._view.version, key, slot))

    def _reclaim(self) -> None:
        """(``_writer`` held) Free pending slots that no active reader's view can reference."""
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
