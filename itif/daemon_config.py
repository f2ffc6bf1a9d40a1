"""The daemon's live configuration: a validated tenants.yaml edit applied (tenants added,
removed, re-quota'd; scheduler and server settings that apply live), and the removed tenants
retired once their accepted calls have finished. ``Daemon.apply_config`` calls :func:`apply`.

A tenant's stored weights are served only as the kind of tenant they were committed for: a
LoRA adapter uploaded for one base is not served on another, nor a full tenant's file as a
delta tenant's (its ``base`` and ``compress``, noted beside the file at each commit:
``BlobStore.set_note``; ``itif.daemon_state.misplaced``), whether the tenant came back by a live
edit or the config changed across a restart. Otherwise it is FAILED, its file kept, until its
weights are uploaded again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from itif import daemon_tiers
from itif.batching.strategies import DEFAULT_STRATEGY
from itif.config import Config, ConfigDiff, Tenant, diff_configs
from itif.daemon_state import TenantStatus
from itif.scheduler import TenantQuota

if TYPE_CHECKING:  # pragma: no cover
    from itif.daemon import Daemon

log = logging.getLogger("itif.daemon")

__all__ = ["apply", "retire"]


def apply(d: Daemon, new: Config) -> ConfigDiff:
    """Apply a validated tenants.yaml edit: add, remove, re-quota. Raises (and changes nothing)
    when the edit needs a restart."""
    with d.config_lock:
        diff = diff_configs(d.config, new)
        for t in diff.added:
            d.status[t.id] = TenantStatus()
            d.scheduler.set_tenant(t.id, TenantQuota.from_tenant(t))
        for t in diff.changed:
            d.scheduler.set_tenant(t.id, TenantQuota.from_tenant(t))
            if d.tiers is not None:
                d.tiers.set_pinned(t.id, t.pinned)
        if diff.scheduler_changed:
            sch = new.scheduler
            d.scheduler.configure(max_batch_tokens=sch.max_batch_tokens,
                                  max_batch_size=sch.max_batch_size, max_wait_ms=sch.max_wait_ms,
                                  isolate_tenants=sch.isolate_tenants,
                                  latency_sizing=sch.latency_sizing)
            d.engine.strategy = DEFAULT_STRATEGY if sch.strategy == "auto" else sch.strategy
        d.blobs.max_upload_bytes = new.server.max_upload_bytes  # checked per upload
        if d.generator is not None:  # submit_generate checks the live value first
            d.generator.max_new_tokens_limit = new.server.max_new_tokens
            d.generator.set_tenant_weights({t.id: t.weight for t in new.tenants})
        d.config = new  # grace_s and admin_token_sha256 are read from here when used
        for tid in diff.removed:
            d.scheduler.remove_tenant(tid)
            with d.tenants.lock(tid):  # after an upload's commit, or it sees it gone
                d.status.pop(tid, None)
        if diff.removed:  # one thread for all of them, however many
            threading.Thread(target=retire, args=(d, list(diff.removed)), daemon=True,
                             name="retire").start()
        for t in sorted(diff.added, key=lambda t: t.base is not None):  # bases first
            with d.tenants.lock(t.id):
                _come_back(d, t)
        d.reloads_ok += 1
        settings = [f"server.{k}" for k in diff.server_changed] + (
            ["scheduler"] if diff.scheduler_changed else [])
        log.info("config applied: tenants +%s -%s ~%s; settings changed: %s",
                 [t.id for t in diff.added], list(diff.removed), [t.id for t in diff.changed],
                 ", ".join(settings) or "none")
        return diff


def _come_back(d: Daemon, t: Tenant) -> None:
    """An added tenant: weights kept on disk from an earlier life come back, as what they were
    committed for (under the tenant's lock)."""
    if not d.blobs.exists(t.id):
        if d.tiers is not None:
            daemon_tiers.register(d, t.id)
        return
    d.load_stored(t.id)  # refused there if its file was committed for another kind


def retire(d: Daemon, tenants: list[str], timeout_s: float = 60.0) -> None:
    """Drop removed tenants' weights, each once its accepted calls have finished: the queued
    ones and those in a batch that is running (a batch leaves the queue before the engine takes
    its weight snapshot, so an empty queue alone is not enough)."""
    end = time.monotonic() + timeout_s
    left = list(tenants)
    while left:
        busy = [] if time.monotonic() >= end else [t for t in left if d.outstanding(t)]
        waiting = set(busy)
        for tenant in left:
            if tenant in waiting:
                continue
            with d.tenants.lock(tenant):
                if tenant in d.status:  # back in the config meanwhile: its own again
                    continue
                if d.tiers is not None:
                    d.tiers.unregister(tenant)
                if tenant in d.engine.store:
                    d.engine.remove_tenant(tenant)  # in-flight forwards hold their own snapshot
                if d.metrics is not None:
                    d.metrics.forget_tenant(tenant)
        left = busy
        if left:
            time.sleep(0.05)
