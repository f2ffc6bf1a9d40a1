"""The daemon's side of the weight tiers (``itif.weights.tiers``): building the manager from
the config, restoring registrations on start, queueing requests of tenants that are not
resident, and uploads and deletes that make room. ``itif.daemon`` calls these functions only
when ``backbone.device_weight_bytes`` is set (``daemon.tiers`` is not None).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable

import numpy as np

from itif.daemon_state import State, misplaced
from itif.errors import InvalidRequest, InvalidWeights, ItifError, NoWeights, TenantNotFound
from itif.requests import OUTPUTS
from itif.weights import delta
from itif.weights.tiers import TierManager

if TYPE_CHECKING:  # pragma: no cover
    from itif.daemon import Daemon

log = logging.getLogger("itif.daemon")

__all__ = ["build", "device_budget", "generating", "preload", "queue", "register", "restore",
           "room_for", "tenant_info"]


def device_budget(backbone) -> int | None:
    """The weight store's budget: ``device_weight_bytes`` and ``max_weight_bytes``, the smaller
    of those set."""
    given = [b for b in (backbone.device_weight_bytes, backbone.max_weight_bytes) if b]
    return min(given) if given else None


def build(d: Daemon) -> TierManager | None:
    if d.config.backbone.device_weight_bytes is None:
        return None

    def load(tenant: str):
        base = d.base_of(tenant)
        if base is not None and base not in d.engine.store:
            d.tiers.promote(base)  # a LoRA tenant is added on its base's slots
        d.blobs.verify(tenant)
        return d.load_weights(tenant, d.blobs.path_for(tenant))[0]

    def failed(tenant: str, exc: BaseException) -> None:
        st = d.status.get(tenant)
        if st is not None and isinstance(exc, InvalidWeights):  # the stored file is bad
            st.state, st.error = State.FAILED, f"stored weights refused: {exc}"
        elif st is not None and isinstance(exc, NoWeights):  # its base has none: not transient
            st.state, st.error = State.FAILED, str(exc)

    if d.generator is not None:  # the GenEngine's store is made without a budget: the tiers'
        d.engine.store.max_bytes = device_budget(d.config.backbone)
    tiers = TierManager(d.engine, d.scheduler, host_bytes=d.config.backbone.host_weight_bytes,
                        load=load, on_failed=failed, busy=lambda: d.scheduler.in_batch,
                        tag_of=lambda t: d.status[t].sha256 if t in d.status else "")
    tiers.observer = d.metrics
    return tiers


def register(d: Daemon, tenant: str) -> None:
    """A configured tenant joins the tiers: on disk when it has a stored file (READY: servable,
    loaded on its first request; the file is verified then), else without weights."""
    conf = d.config.tenant(tenant)
    stored = d.blobs.exists(tenant)
    base = conf.base if conf else None
    # the tiers know a LoRA tenant's base (it rides on the base's slots: promoted with it, and
    # the base stays while it is resident); a delta tenant's W_hat is whole: its base is read
    # while it is decompressed, not kept beside it
    d.tiers.register(tenant, stored=stored, pinned=bool(conf and conf.pinned),
                     base=None if conf is None or conf.is_delta else base)
    st = d.status[tenant]
    why = misplaced(d, tenant) if stored else None
    if why is None and stored and base is not None and not d.blobs.exists(base):
        why = f"its base {base!r} has no weights"  # as _rederive leaves it
    if why is None and stored and conf is not None and conf.is_delta:
        why = _delta_on_disk(d, tenant, base)
    if why is None and stored and st.state is not State.READY:
        try:
            sha = d.blobs.stored_sha256(tenant) or ""
        except ItifError as e:  # a corrupt sidecar: this tenant alone FAILED
            why = f"stored weights refused: {e}"
            log.error("tenant %s: %s", tenant, why)
        else:
            st.state, st.sha256, st.error = State.READY, sha, ""
    if why is not None:
        st.state, st.error = State.FAILED, why
        d.scheduler.fail_parked(tenant, NoWeights(f"tenant {tenant!r}: {why}"))
        return
    if stored and d.scheduler.queue_depth(tenant):  # requests parked meanwhile
        d.tiers.ensure(tenant)


def _delta_on_disk(d: Daemon, tenant: str, base: str) -> str | None:
    """A stored delta tenant, from its blob's header: FAILED now (the reason) when it was
    taken against other base weights than the base has, as a load would find; else its
    report and head are known before it is first loaded (GetTenant, KServe metadata)."""
    try:
        report, meta = delta.stored_report(d.blobs.path_for(tenant))
        delta.check_base(meta, base, d.tenants.sha256(base))
        labels, has_pooler = delta.head_of(meta)
    except ItifError as e:  # as the load would refuse it (Daemon.load_stored)
        return f"stored weights refused: {e}"
    d.delta_reports[tenant] = report
    d.tiers.learn(tenant, labels, has_pooler)
    return None


def restore(d: Daemon) -> None:
    """Start-up: register every configured tenant (no file is read), then load the pinned
    ones (bases first) so they are resident before the daemon reports ready."""
    for t in sorted(d.config.tenants, key=lambda t: t.base is not None):
        register(d, t.id)
    for t in sorted(d.config.tenants, key=lambda t: t.base is not None):
        if t.pinned and d.blobs.exists(t.id):
            try:
                d.tiers.promote(t.id)
            except ItifError as e:  # the loader already failed only this tenant
                log.error("pinned tenant %s not loaded: %s", t.id, e)


def check(d: Daemon, tenant: str, requests) -> None:
    """Validate requests of a tenant: as ``Engine.check`` when it is resident; else what can be
    checked without its weights (ids, lengths, types, output names): whether it has a head
    for ``logits`` is checked when its batch runs (a per-request error, isolated there)."""
    eng = d.engine
    if tenant in eng.store:
        try:
            eng.check(requests)
            return
        except TenantNotFound:  # evicted a moment ago: check it as a tenant not resident
            pass
    n = len(requests)
    for i, r in enumerate(requests):
        for o in r.outputs or ():
            if o not in OUTPUTS:
                raise InvalidRequest(f"request {i}: unknown output {o!r}; choose from {OUTPUTS}")
    idx, wants = np.zeros(n, np.int32), [()] * n
    if eng.spec.is_text:
        eng.validate_text(requests, idx, wants)
    else:
        eng.validate_pixels(requests, idx, wants)


def queue(d: Daemon, tenant: str, n: int, submit: Callable[[], list]) -> list:
    """Queue ``n`` requests of ``tenant`` through ``submit()`` (the scheduler's submit_many):
    the tenant is marked busy first (never evicted while it has requests), each ticket frees
    its share when done, and a tenant not resident starts loading (its requests wait parked)."""
    tiers = d.tiers
    tiers.acquire(tenant, n)
    try:
        tickets = submit()
    except BaseException:
        tiers.release(tenant, n)
        raise
    for t in tickets:
        t.add_done_callback(lambda _t: tiers.release(tenant))
    if not tiers.ensure(tenant):
        st = d.status.get(tenant)
        if st is None or st.state is not State.READY:  # deleted or FAILED as it was queued:
            why = f" ({st.error})" if st is not None and st.error else ""  # nothing will load
            d.scheduler.fail_parked(tenant, NoWeights(  # it; before, it waited for ever
                f"tenant {tenant!r} has no ready weights{why}"))
    return tickets


def generating(d: Daemon, tenant: str, request, on_event: Callable):
    """Generate with tiers (``Daemon.submit_generate``, just before the GenEngine queues
    ``request``): ``tenant`` is held busy (never evicted) until its generation ends, and
    loaded now when it is on the host tier or disk (on the calling thread: the GenEngine
    refuses a tenant its store does not hold); ``request`` is then checked by the GenEngine.
    Returns ``on_event`` wrapped to let the tenant go at its "done" or "error" event. A tenant
    that cannot be loaded: NoWeights (FAILED_PRECONDITION) with the reason. Without tiers:
    ``on_event`` as it is."""
    tiers = d.tiers
    if tiers is None:
        return on_event
    tiers.acquire(tenant)
    try:
        if tenant not in d.engine.store:
            tiers.promote(tenant)  # its base first, for a LoRA tenant
        if tenant not in d.engine.store:
            st = d.status.get(tenant)
            why = f": {st.error}" if st is not None and st.error else ""
            raise NoWeights(f"tenant {tenant!r}: its weights could not be loaded{why}")
        d.generator.check(request)
    except BaseException:
        tiers.release(tenant)
        raise
    done = [False]

    def event(ev) -> None:
        if ev.kind in ("done", "error") and not done[0]:
            done[0] = True
            tiers.release(tenant)
        on_event(ev)

    return event


def preload(d: Daemon, tenant: str) -> None:
    """Load ``tenant`` now if the tiers hold it on the host or disk: what an async caller runs
    on a worker thread before it submits a Generate, so that :func:`generating`, on the event
    loop's thread, finds it resident (unless it is evicted again meanwhile: then it loads it
    there). Failures are left for the submission to report."""
    tiers = d.tiers
    if tiers is None or tenant in d.engine.store:
        return
    try:
        tiers.acquire(tenant)
    except TenantNotFound:  # not registered: the submission answers
        return
    try:
        tiers.promote(tenant)
    finally:
        tiers.release(tenant)


def room_for(d: Daemon, tenant: str, weights, base: str | None = None,
             owner: str | None = None):
    """Upload path: admission by bytes, then (a context manager) the store held for this
    upload with room made for ``weights`` by evicting idle tenants (never ``base``, a LoRA
    tenant's, whose slots it is added on). Without tiers: the plain budget check. Yields the
    store's digests of the weights. ``owner``: as ``WeightStore.check_budget``'s (a tenant's
    own upload; None for the operator's)."""
    if d.tiers is None:
        return nullcontext(None)
    d.tiers.admit(tenant, weights, base)
    return _Room(d.tiers, tenant, weights, base, owner)


class _Room:
    def __init__(self, tiers: TierManager, tenant: str, weights, base: str | None,
                 owner: str | None) -> None:
        self.tiers, self.tenant, self.weights, self.base = tiers, tenant, weights, base
        self.owner = owner
        self._io = tiers.io()

    def __enter__(self):
        self._io.__enter__()
        try:
            return self.tiers.make_room(self.weights, keep=(self.tenant, self.base),
                                        owner=self.owner)
        except BaseException:
            self._io.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        self._io.__exit__(*exc)


def tenant_info(d: Daemon, tenant: str, read: bool = True, sizes: bool = True):
    """``Engine.tenant_info`` of ``tenant`` wherever its weights are: the engine's when it is
    resident; else its head and pooler as the tiers saw them, with 0 bytes on the device (KServe
    metadata, default outputs and reply reservations do not depend on residency). A stored
    tenant not seen since the daemon started has its file read (verified and validated, not
    installed) once when ``read``, else None is returned; a tenant without weights raises the
    engine's TenantNotFound. ``sizes=False``: the byte counts are left 0 (per-call callers)."""
    engine = d.engine
    if d.tiers is None or tenant in engine.store:
        return engine.tenant_info(tenant, sizes)
    from itif.runtime.engine import TenantInfo  # noqa: PLC0415 - encoder daemons only

    sig = d.tiers.signature(tenant)
    if sig is None and d.blobs.exists(tenant):
        if not read:
            return None
        d.blobs.verify(tenant)
        weights = d.load_weights(tenant, d.blobs.path_for(tenant))[0]
        d.tiers.learn(tenant, weights.num_labels, weights.has_pooler)
        sig = d.tiers.signature(tenant)
    if sig is None:
        return engine.tenant_info(tenant)  # no weights anywhere: the engine's own error
    return TenantInfo(tenant, sig[0], sig[1], 0, 0)
