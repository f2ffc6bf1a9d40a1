"""Weight tiers: device, host and disk, with promotion on demand and LRU eviction.

Every registered tenant is servable; only some are *resident* (in the engine's WeightStore, the
tier the forward reads). The tiers, fastest first:

``device``
    the WeightStore, bounded by ``backbone.device_weight_bytes`` (its ``max_bytes``; tensors
    shared between tenants counted once, by the store).
``host``
    validated weights kept in host memory (pinned on CUDA, so the copy up can run
    asynchronously; plain on the CPU), bounded by ``backbone.host_weight_bytes``. Tensors
    identical across host-tier tenants are held, and counted, once.
``disk``
    the durable blob store (``itif.weights.blobstore``): every uploaded tenant is there.

A request for a tenant that is not resident *promotes* it (host -> device, or disk -> host ->
device) on one loader thread. Its requests wait in the scheduler, parked (``Scheduler.park``),
while other tenants' batches keep running; when the weights are in, the tenant is unparked and
its requests join the next batch. A promotion that needs room evicts a resident tenant that is
neither pinned nor busy (has requests queued or running), by segmented LRU: the least recently
used of those promoted and not used since (probation), then of those used again while resident
(protected, at most 3/4 of the resident tenants), so one-off requests over many cold tenants do
not push out the hot ones. Its weights move to the host tier when its budget allows (evicting
the host tier's least recently used) and are dropped otherwise (they stay on disk).

The loader keeps out of the forward's way, since on a CPU-only host both need the cores and
the GIL (one-tenant batches took a median 2.6 ms alone and 5.6 ms beside a stream of whole
promotions in the 64-tenant test, 3.2 ms with these steps): a promotion is done in steps
(key, demote a few tensors at a time, copy in) and before each step it waits for a gap
between batches (``busy``: the scheduler's ``in_batch``), at most ``gap_wait_s``; and it works
at most ``loader_share`` of its time (it sleeps in proportion after each promotion; the
waits for gaps do not count). A promotion from the host tier hashes no tensor: the content
keys computed when the tenant was demoted are kept and given to the store. A promotion that
fails (a corrupt blob, an error while copying) fails that tenant's waiting requests with
UNAVAILABLE and the reason; nothing else is affected.

Invariant (kept under ``_lock``): a tenant's scheduler queue is parked exactly when it is not
resident. Eviction parks a tenant and checks it is idle in one step under ``_lock``, and
``acquire`` (every accepted request) marks it busy under the same lock, so no batch ever holds
a tenant whose weights are leaving. Costs: ``acquire``/``release`` are O(1) per request;
choosing a victim walks the LRU order from its cold end past pinned and busy tenants only.

On the CPU the device and host tiers are both host memory: the mechanism (budgets, parking,
eviction, the loader thread) is the same, the copy speeds are not (see ``docs/operator.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from itif import threadnames
from itif.backbones.hf import CanonicalWeights
from itif.errors import ItifError, Overloaded, TenantNotFound, Unavailable, shown
from itif.weights.store import Digests
from itif.weights.tier_state import HostPool, Scheduling, TenantState, Tier, TierObserver, TierView

log = logging.getLogger("itif.tiers")

__all__ = ["Tier", "TierManager", "TierObserver", "TierView"]

_CHUNK = 8  # tensors a demotion copies between two waits for a gap between batches


class TierManager:
    """Residency of every registered tenant (module docstring). ``load(tenant)`` reads a
    tenant's stored weights from disk (verified and validated: the daemon's); ``on_failed``
    hears of a promotion that failed (the daemon marks a corrupt blob's tenant FAILED)."""

    def __init__(self, engine, scheduler: Scheduling, *, host_bytes: int | None,
                 load: Callable[[str], CanonicalWeights],
                 on_failed: Callable[[str, BaseException], None] | None = None,
                 wait_s: float = 30.0, loader_share: float = 0.5,
                 busy: Callable[[], bool] | None = None, gap_wait_s: float = 0.003,
                 tag_of: Callable[[str], str] = lambda tenant: "") -> None:
        self.engine = engine
        self.tag_of = tag_of  # a promoted tenant's weights tag (Engine.add_tenant's ``tag``)
        self.store = engine.store
        self.scheduler = scheduler
        self.host_budget = host_bytes or 0
        self.load = load
        self.on_failed = on_failed
        self.wait_s = wait_s  # how long a promotion waits for a busy tenant to become evictable
        self.observer: TierObserver | None = None
        #: At most this fraction of the loader thread's time is spent promoting: after each
        #: promotion it sleeps in proportion, so promotions cannot take the CPU (and the GIL)
        #: from the forward of resident tenants (1: no pause).
        self.loader_share = loader_share
        #: Whether a batch is running now (the scheduler's ``in_batch``); given, each step of
        #: a promotion waits (up to ``gap_wait_s``) for a gap between batches, so a batch
        #: overlaps at most a step of the loader's work (its Python holds the GIL and a core),
        #: not a whole promotion. Waiting is cut short whenever the engine is idle.
        self.busy = busy
        self.gap_wait_s = gap_wait_s
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._io = threading.RLock()  # held by whatever adds to or removes from the store
        self._t: dict[str, TenantState] = {}
        # resident tenants in two LRU segments (coldest first): probation (promoted, not used
        # since) and protected (used again while resident); victims come from probation first
        self._prob: OrderedDict[str, None] = OrderedDict()
        self._prot: OrderedDict[str, None] = OrderedDict()
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self._children: dict[str, int] = {}  # base -> its resident LoRA tenants
        self._pool = HostPool(pin=engine.device.type == "cuda")
        self._pool_lock = threading.Lock()  # after _lock when both are taken
        self._queue: deque[str] = deque()
        self._waited = 0.0  # (the loader) seconds this promotion waited for gaps
        self._stop = False
        self._thread = threading.Thread(target=self._loader, name="itif-tier-loader", daemon=True)
        self._thread.start()

    @property
    def device_budget(self) -> int | None:
        return self.store.max_bytes

    # ---- registration ----------------------------------------------------------------------
    def register(self, tenant: str, *, stored: bool, pinned: bool = False,
                 base: str | None = None) -> None:
        """A configured tenant: on disk (``stored``) or without weights. Not resident: its
        queue is parked until a request promotes it."""
        with self._lock:
            st = self._t.get(tenant)
            if st is None:
                st = self._t[tenant] = TenantState(Tier.DISK if stored else Tier.NONE, pinned, base)
            else:  # registered again (forgotten first: its file changed, or it came back)
                st.pinned, st.base = pinned, base
                if not stored:
                    self._drop_host(tenant, st)
                    st.tier = Tier.NONE
                elif st.tier is Tier.NONE:  # else ensure() would never promote it
                    st.tier = Tier.DISK
            if st.tier is not Tier.DEVICE:
                self.scheduler.park(tenant, True)

    def signature(self, tenant: str) -> tuple[int | None, bool] | None:
        """(num_labels, has_pooler) of ``tenant``'s weights when this run has seen them (they
        were resident once, or ``learn`` was told), else None; whatever tier holds them now."""
        with self._lock:
            st = self._t.get(tenant)
            return (st.num_labels, st.has_pooler) if st is not None and st.signed else None

    def learn(self, tenant: str, num_labels: int | None, has_pooler: bool) -> None:
        """Record ``tenant``'s signature, read from its stored weights without installing them."""
        with self._lock:
            st = self._t.get(tenant)
            if st is not None and not st.signed:
                st.num_labels, st.has_pooler, st.signed = num_labels, has_pooler, True

    def set_pinned(self, tenant: str, pinned: bool) -> None:
        with self._lock:
            st = self._t.get(tenant)
            if st is not None:
                st.pinned = pinned
        if pinned:
            self.ensure(tenant)

    def forget(self, tenant: str, fail: BaseException | None = None) -> int:
        """Its weights were deleted, replaced on disk, or it left the config: parked, and out
        of every tier (removed from the store). ``fail``: it will not be served (deleted,
        FAILED): the requests waiting for it fail with this error now instead of staying parked
        (kept: it is registered again, and they wait for its new weights). Returns the store
        bytes that freed."""
        with self._io:
            with self._lock:
                st = self._t.get(tenant)
                if st is not None:
                    self._drop_host(tenant, st)
                    if self._unlist(tenant):
                        self._unchild(st)
                    st.tier, st.error, st.loading = Tier.NONE, "", False
                    st.weight_bytes = 0  # its weights changed or left: not known until resident
                    self.scheduler.park(tenant, True)
            if fail is not None:
                self.scheduler.fail_parked(tenant, fail)
            if tenant not in self.store:
                return 0
            freed = self.engine.tenant_info(tenant).exclusive_bytes
            self.engine.remove_tenant(tenant)
            return freed

    def unregister(self, tenant: str) -> None:
        """It left the config (its queue drained): out of every tier and forgotten."""
        self.forget(tenant)
        with self._lock:
            self._t.pop(tenant, None)

    @contextmanager
    def holding(self, tenant: str) -> Iterator[None]:
        """``tenant`` is busy (never evicted) while held: a base whose weights a LoRA or
        delta tenant's load reads."""
        self.acquire(tenant)
        try:
            yield
        finally:
            self.release(tenant)

    @contextmanager
    def io(self) -> Iterator[None]:
        """Hold while changing the store outside the manager (an upload's swap, a delete)."""
        with self._io:
            yield

    # ---- the request path ------------------------------------------------------------------
    def acquire(self, tenant: str, n: int = 1) -> None:
        """``n`` requests of ``tenant`` are being accepted: it is busy (never evicted) until as
        many ``release`` calls; most recently used. Call ``ensure`` once they are queued."""
        with self._lock:
            st = self._t.get(tenant)
            if st is None:
                raise TenantNotFound(f"tenant {shown(tenant)} not found")
            st.busy += n
            self._used(tenant)

    def release(self, tenant: str, n: int = 1) -> None:
        with self._lock:
            st = self._t.get(tenant)
            if st is None:
                return
            st.busy = max(0, st.busy - n)
            if not st.busy:
                self._cv.notify_all()

    def ensure(self, tenant: str) -> bool:
        """Start promoting ``tenant`` unless it is resident or already loading; True when it
        is resident now."""
        with self._lock:
            st = self._t.get(tenant)
            if st is None or st.tier is Tier.NONE:
                return False
            if st.tier is Tier.DEVICE:
                return True
            if not st.loading:
                st.loading = True
                self._queue.append(tenant)
                self._cv.notify_all()
            return False

    # ---- installing weights that arrive from outside (upload, restore) -------------------
    def admit(self, tenant: str, weights: CanonicalWeights, base: str | None = None) -> None:
        """Admission by bytes: weights that could never be resident beside the pinned tenants
        (and ``base``, a LoRA tenant's, which is resident with it) are refused (Overloaded),
        whatever is resident now."""
        budget = self.device_budget
        if budget is None:
            return
        need = _nbytes(weights, self.store.dtype)
        with self._lock:
            pinned = [t for t in (*self._prob, *self._prot) if t != tenant and self._t[t].pinned]
        held = sum(self.engine.tenant_info(t).exclusive_bytes for t in pinned
                   if t in self.store)
        if base is not None and base not in pinned and base in self.store:
            need += self.engine.tenant_info(base).bytes
        if need + held > budget:
            with_base = f" with its base {base!r}" if base is not None else ""
            raise Overloaded(
                f"tenant {tenant!r}'s weights{with_base} need {need} bytes; with the tenants "
                f"pinned to the device tier's {budget} bytes, they could never be resident "
                "(raise backbone.device_weight_bytes or unpin tenants)")

    def make_room(self, weights: CanonicalWeights, keep: tuple = (),
                  digests: Digests | None = None, owner: str | None = None):
        """(``io()`` held) Evict until ``weights`` fit the device budget; returns the store's
        digests of them (``digests``: known ones, not computed again). Overloaded if they
        cannot fit within ``wait_s``. ``owner``: a tenant's own upload
        (``WeightStore.check_budget``: only its own tensors are credited as stored)."""
        end = time.monotonic() + self.wait_s
        while True:
            try:
                return self.store.check_budget(weights, digests, owner=owner)
            except Overloaded:
                if not self._evict_one(keep, end):
                    raise

    def installed(self, tenant: str, weights: CanonicalWeights, base: str | None) -> None:
        """(``io()`` held) ``weights`` were just added to the store for ``tenant``."""
        with self._lock:
            st = self._t.setdefault(tenant, TenantState(Tier.DEVICE, False, base))
            self._drop_host(tenant, st)
            self._resident(tenant, st, weights)

    # ---- promotion -------------------------------------------------------------------------
    def promote(self, tenant: str) -> None:
        """Load ``tenant`` now on this thread (start-up of pinned tenants; the loader)."""
        with self._lock:
            st = self._t.get(tenant)
            if st is None:
                raise TenantNotFound(f"tenant {shown(tenant)} not found")
            st.loading = True
        self._promote(tenant)

    def _promote(self, tenant: str) -> None:
        start = time.perf_counter()
        source = "?"
        try:
            with self._io:
                with self._lock:
                    st = self._t.get(tenant)
                    if st is None or st.tier in (Tier.DEVICE, Tier.NONE):
                        if st is not None:
                            st.loading = False
                        return
                    source, base = st.tier.value, st.base
                    host, keys = st.host, st.host_keys  # kept if it leaves the host tier
                if base is not None and base not in self.store:
                    self.promote(base)  # a LoRA tenant is added on its base's slots
                digests = None
                self._gap()
                if host is not None:
                    weights, digests = self._host_weights(st, host, keys)
                else:
                    weights = self.load(tenant)
                self.admit(tenant, weights, base)
                digests = self.make_room(weights, keep=(tenant, base), digests=digests)
                del digests  # check_budget remembered them: add_tenant reuses the keys
                self._gap()
                self.engine.add_tenant(tenant, weights, base=base, tag=self.tag_of(tenant))
                with self._lock:
                    self._drop_host(tenant, st)
                    self._resident(tenant, st, weights)
                    st.promotions += 1
                    st.last_ms = (time.perf_counter() - start) * 1e3
                    st.error = ""
        except BaseException as e:  # noqa: BLE001 - the loader thread must not die
            self._failed(tenant, source, e, start)
            return
        log.info("tenant %s promoted from %s in %.1f ms", tenant, source, st.last_ms)
        self._observe("tier_promoted", tenant, source, st.last_ms / 1e3, True)

    def _failed(self, tenant: str, source: str, e: BaseException, start: float) -> None:
        why = str(e) if isinstance(e, ItifError) else f"{type(e).__name__}: {e}"
        with self._lock:
            st = self._t.get(tenant)
            if st is not None:
                st.loading = False
                st.failures += 1
                st.error = why
        log.error("tenant %s: promotion from %s failed: %s", tenant, source, why)
        err = Unavailable(f"tenant {tenant!r}: its weights could not be loaded ({why})")
        self.scheduler.fail_parked(tenant, err)
        self._observe("tier_promoted", tenant, source, time.perf_counter() - start, False)
        if self.on_failed is not None:
            try:
                self.on_failed(tenant, e)
            except Exception:  # noqa: BLE001
                log.exception("on_failed(%s) raised", tenant)

    def _loader(self) -> None:
        threadnames.adopt()
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                tenant = self._queue.popleft()
            start = time.perf_counter()
            self._waited = 0.0
            self._promote(tenant)
            if 0 < self.loader_share < 1:  # leave the forward its share of the CPU
                work = time.perf_counter() - start - self._waited  # not the gaps waited for
                time.sleep(max(0.0, work) * (1 / self.loader_share - 1))

    def _gap(self) -> None:
        """(the loader) Wait for a gap between batches, at most ``gap_wait_s``."""
        busy = self.busy
        if busy is None or threading.current_thread() is not self._thread:
            return
        if not busy():
            return
        start = time.monotonic()
        end = start + self.gap_wait_s
        while busy() and not self._stop and time.monotonic() < end:
            time.sleep(0.0005)
        self._waited += time.monotonic() - start

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(5.0)

    # ---- eviction --------------------------------------------------------------------------
    def _evict_one(self, keep: tuple, end: float) -> bool:
        """(``io()`` held) Evict the least recently used idle unpinned resident tenant, waiting
        up to ``end`` for one to become idle. False: nothing can be evicted."""
        with self._lock:
            while True:
                victim, waiting = self._victim(keep)
                if victim is not None:
                    st = self._t[victim]
                    self.scheduler.park(victim, True)  # idle and parked in one step
                    self._unlist(victim)
                    # no longer resident from this moment: a request that arrives while its
                    # weights are copied out must start a promotion (``ensure``; it runs
                    # once this eviction is done), not find it DEVICE and wait parked
                    # until some later request of the tenant promotes it
                    st.tier = Tier.DISK
                    break
                now = time.monotonic()
                left = end - now
                if not waiting or left <= 0 or self._stop:
                    return False
                self._cv.wait(min(left, 0.5))
                if threading.current_thread() is self._thread:  # waited, not worked: the
                    self._waited += time.monotonic() - now  # loader's throttle leaves it out
        self._gap()
        to = self._demote(victim, st)
        self._gap()
        self.engine.remove_tenant(victim)
        with self._lock:
            st.tier = to
            st.evictions += 1
            self._unchild(st)
        log.info("tenant %s evicted to %s", victim, to.value)
        self._observe("tier_evicted", victim, to.value)
        return True

    def _victim(self, keep: tuple) -> tuple[str | None, bool]:
        """(``_lock`` held) (coldest evictable resident tenant, whether a busy one may become
        evictable later)."""
        waiting = False
        for t in (*self._prob, *self._prot):
            st = self._t.get(t)
            if st is None or t in keep or st.pinned:
                continue
            if st.busy or self._is_base(t):
                waiting = waiting or bool(st.busy)
                continue
            return t, True
        return None, waiting

    def _is_base(self, tenant: str) -> bool:
        """A base of a resident LoRA tenant stays: a LoRA tenant is added on its base's slots,
        so its promotion needs the base resident (bases are never evicted under them)."""
        return self._children.get(tenant, 0) > 0

    def _demote(self, tenant: str, st: TenantState) -> Tier:
        """Copy a leaving tenant's own tensors to the host tier when they fit (evicting the
        host tier's coldest); else it falls back to disk."""
        if self.host_budget <= 0:
            return Tier.DISK
        with self.store.read() as view:
            entry = view.tenants.get(tenant)
            if entry is None:
                return Tier.DISK
            own = {n: view.param(tenant, n) for n in st.own}
            need = sum(buf[slot].numel() * buf.element_size() for buf, slot in own.values())
            dropped = []
            with self._lock:  # room first (host-tier tenants out, coldest first)
                while self._pool.bytes + need > self.host_budget and self._host_lru:
                    cold = next(iter(self._host_lru))
                    cst = self._t[cold]
                    self._drop_host(cold, cst)
                    cst.tier = Tier.DISK
                    dropped.append(cold)
                fits = self._pool.bytes + need <= self.host_budget
            for cold in dropped:
                self._observe("tier_evicted", cold, Tier.DISK.value)
            if not fits:
                return Tier.DISK
            interned = {}
            for i, (n, (buf, slot)) in enumerate(own.items()):
                if i and not i % _CHUNK:
                    self._gap()  # a few tensors at a time, in the gaps between batches
                with self._pool_lock:  # the copies, without blocking the request path
                    interned[n] = self._pool.intern(n, buf[slot])
        host = {n: t for n, (t, _) in interned.items()}
        with self._lock:
            st.host, st.host_bytes = host, need
            st.host_keys = {n: k for n, (_, k) in interned.items()}
            self._host_lru[tenant] = None
        return Tier.HOST

    # ---- bookkeeping (``_lock`` held) ------------------------------------------------------
    def _used(self, tenant: str) -> None:
        """A resident tenant was used: most recent of the protected segment (a probation one
        moves up; past 3/4 of the resident tenants, the coldest protected one moves down)."""
        if tenant in self._prot:
            self._prot.move_to_end(tenant)
        elif self._prob.pop(tenant, 0) is None:
            self._prot[tenant] = None
            if len(self._prot) > max(1, 3 * (len(self._prot) + len(self._prob)) // 4):
                cold = next(iter(self._prot))
                del self._prot[cold]
                self._prob[cold] = None

    def _unlist(self, tenant: str) -> bool:
        """Out of the resident segments; whether it was in one."""
        return self._prob.pop(tenant, 0) is None or self._prot.pop(tenant, 0) is None

    def _unchild(self, st: TenantState) -> None:
        if st.base is not None and self._children.get(st.base):
            self._children[st.base] -= 1

    def _resident(self, tenant: str, st: TenantState, weights: CanonicalWeights) -> None:
        if st.base is not None and tenant not in self._prob and tenant not in self._prot:
            self._children[st.base] = self._children.get(st.base, 0) + 1
        st.tier, st.loading = Tier.DEVICE, False
        st.own = tuple(weights.tensors)
        st.weight_bytes = self.store.tenant_bytes(tenant)[0]  # kept when it is evicted
        st.num_labels, st.has_pooler, st.signed = weights.num_labels, weights.has_pooler, True
        if tenant not in self._prot:
            self._prob[tenant] = None
            self._prob.move_to_end(tenant)
        self.scheduler.park(tenant, False)

    def _drop_host(self, tenant: str, st: TenantState) -> None:
        if st.host is not None:
            keys = st.host_keys
            with self._pool_lock:
                for n, t in st.host.items():
                    self._pool.release(n, t, keys.get(n))
        st.host, st.host_bytes, st.host_keys = None, 0, {}
        self._host_lru.pop(tenant, None)

    def _host_weights(self, st: TenantState, host: dict[str, torch.Tensor],
                      keys: dict[str, str]) -> tuple[CanonicalWeights, Digests | None]:
        """A host-tier tenant's weights and their store keys, from the keys interning kept
        (the store keys a float tensor of its dtype by the same ``tensor_key``): promoting
        from the host tier hashes nothing."""
        weights = CanonicalWeights(dict(host), st.num_labels, st.has_pooler)
        if set(keys) != set(weights.tensors) or any(
                t.dtype != self.store.dtype or t.device.type != "cpu"
                for t in weights.tensors.values()):
            return weights, None  # the store keys them itself
        digests = Digests(weights, self.store.dtype, {})
        digests.keys = dict(keys)
        return weights, digests

    def _observe(self, what: str, *args) -> None:
        obs = self.observer
        if obs is None:
            return
        try:
            getattr(obs, what)(*args)
        except Exception:  # noqa: BLE001 - metrics never break loading
            log.exception("tier observer %s failed", what)

    # ---- reads -----------------------------------------------------------------------------
    def view(self, tenant: str) -> TierView | None:
        with self._lock:
            st = self._t.get(tenant)
            if st is None:
                return None
            return TierView(st.tier, st.pinned, st.loading, st.busy, st.host_bytes,
                            st.promotions, st.evictions, st.failures, st.last_ms, st.error,
                            st.weight_bytes)

    def totals(self) -> dict[str, int]:
        """Bytes and tenants per tier, and the budgets (metrics, health)."""
        with self._lock:
            counts = {tier: 0 for tier in Tier}
            for st in self._t.values():
                counts[st.tier] += 1
            host = self._pool.bytes
        return {"device_bytes": self.store.weight_bytes, "host_bytes": host,
                "device_budget": self.device_budget or 0, "host_budget": self.host_budget,
                **{f"{tier.value}_tenants": n for tier, n in counts.items()}}


def _nbytes(weights: CanonicalWeights, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * size for t in weights.tensors.values())
