"""The daemon's tenant table: each configured tenant's state, who may see it, and the locks
that serialise what changes its weights or its existence, with the order they are taken in.

``Daemon`` holds one (``Daemon.tenants``) and every path that asks "is this tenant there, may
this caller see it, is it serving" asks it here, so that the answer is the same on every path
(gRPC, KServe, the HTTP APIs, the config applier, the tiers) and is computed once per call.
Plain data and locks: no torch, no engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import ExitStack

from itif.daemon_state import Identity, State, TenantStatus
from itif.errors import NoWeights, TenantNotFound, shown

__all__ = ["TenantTable"]


class TenantTable:
    """Tenant id -> :class:`TenantStatus` (``status``: the configured tenants, no others), and
    one lock per tenant id (kept after a tenant leaves the config: it may come back, and a
    waiter on the old lock must exclude whoever brings it back)."""

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self.status: dict[str, TenantStatus] = {t: TenantStatus() for t in tenants}
        self._locks: dict[str, threading.Lock] = {}

    def __contains__(self, tenant: object) -> bool:
        return tenant in self.status

    # ---- visibility --------------------------------------------------------------------------
    def check_visible(self, who: Identity, tenant: str) -> None:
        """Refuse a tenant ``who`` may not see. Unknown tenants and other tenants' names get the
        same answer (NotFound), so a caller learns nothing about who else is served."""
        if tenant not in self.status or not who.may_see(tenant):
            raise TenantNotFound(f"tenant {shown(tenant)} not found")

    def check_ready(self, tenant: str) -> TenantStatus:
        """The status of a tenant that serves now: NotFound once a config reload removed it
        (after a visibility check passed), NoWeights (naming its state and why) when it has no
        ready weights."""
        st = self.status.get(tenant)
        if st is None:  # removed by a config reload a moment ago
            raise TenantNotFound(f"tenant {shown(tenant)} not found")
        if st.state is not State.READY:
            why = f": {st.error}" if st.error else ""
            raise NoWeights(f"tenant {tenant!r} has no ready weights ({st.state.name}){why}")
        return st

    def sha256(self, tenant: str | None, default: str = "") -> str:
        """The sha256 of the weights ``tenant`` serves now (``default`` for no tenant, or one a
        config reload removed: its accepted calls still finish and are answered)."""
        st = self.status.get(tenant) if tenant is not None else None
        return st.sha256 if st is not None else default

    # ---- locks -------------------------------------------------------------------------------
    def lock(self, tenant: str) -> threading.Lock:
        """Serialises what changes one tenant's weights or existence: an upload's commit and
        swap, a delete, its removal from (or return to) the config. Each runs whole under it,
        so an acknowledged outcome is the durable one: the file on disk, the weights served and
        the state reported always agree."""
        lock = self._locks.get(tenant)
        if lock is None:
            lock = self._locks.setdefault(tenant, threading.Lock())
        return lock

    def lock_with_base(self, held: ExitStack, tenant: str, base: str | None) -> None:
        """Hold ``base``'s lock (so it is neither deleted nor replaced meanwhile), then
        ``tenant``'s, until ``held`` closes. The order, everywhere: a base's lock, then its
        tenant's, then the tiers' io (``itif.weights.tiers``)."""
        if base is not None:
            held.enter_context(self.lock(base))
        held.enter_context(self.lock(tenant))
