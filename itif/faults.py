"""Test-only fault injection for the reliability suite (``tests/test_reliability_*.py``).

Nothing in ``tenants.yaml`` reaches this module: the hooks are read from the environment variable
``ITIF_FAULT_INJECT`` when the daemon starts (never at import), and the daemon logs a warning
naming every active hook. Unset (production), :func:`install` does nothing at all.

``ITIF_FAULT_INJECT`` is a comma-separated list of hooks:

``oom:<tenant>``
    every forward whose batch holds a request of ``<tenant>`` raises the error CUDA raises when
    the device runs out of memory (``torch.OutOfMemoryError: CUDA out of memory...``), before any
    work is done: the out-of-memory path on a CPU-only machine. On a decoder daemon: every
    prompt or decode forward of the GenEngine holding a row of ``<tenant>``.
``slow:<ms>``
    every forward sleeps ``<ms>`` milliseconds first (the GIL is released): a device whose
    forward costs a fixed time, for queue-full, deadline and noisy-neighbour tests.
``commit_pause:<ms>``
    every weight swap-in (``engine.add_tenant``) sleeps ``<ms>`` milliseconds first: an upload's
    file is already committed and its weights not yet served, the window in which a racing
    delete or config removal must wait (acknowledged = durable tests).
``kill_at:<point>``
    the daemon SIGKILLs itself the first time a weight commit reaches ``<point>`` (the steps of
    ``itif.weights.blobstore``'s commit protocol): ``commit_pending`` (intent record durable,
    data file not yet renamed: the old pair must survive), ``commit_renamed`` (data file renamed,
    sidecar not yet: start-up must roll forward to the new pair), ``commit_done`` (pair
    committed, weights not yet swapped in: the new pair serves after a restart).
``start_delay:<ms>``
    the daemon sleeps ``<ms>`` milliseconds while starting (after the port opened, before it
    reports ready), so the window in which health answers NOT_SERVING can be observed.
``stop_delay:<ms>``
    the daemon's shutdown (``Daemon.stop``, which the server runs off its event loop after
    SIGTERM) sleeps ``<ms>`` milliseconds first: the window before the scheduler refuses work,
    in which a new call must already be refused (UNAVAILABLE) as health says.

An unknown or malformed hook stops the daemon from starting (a typo must not silently test
nothing).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("itif.faults")

ENV = "ITIF_FAULT_INJECT"

__all__ = ["ENV", "KILL_POINTS", "Faults", "install", "parse"]

KILL_POINTS = ("commit_pending", "commit_renamed", "commit_done")


@dataclass(frozen=True)
class Faults:
    oom_tenants: frozenset[str] = frozenset()
    slow_ms: float = 0.0
    start_delay_ms: float = 0.0
    commit_pause_ms: float = 0.0
    kill_at: str = ""
    stop_delay_ms: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.oom_tenants or self.slow_ms or self.start_delay_ms
                    or self.commit_pause_ms or self.kill_at or self.stop_delay_ms)


def parse(spec: str) -> Faults:
    """``"oom:acme,slow:50"`` -> :class:`Faults`; ValueError naming the bad hook."""
    oom: set[str] = set()
    ms_of = {"slow": 0.0, "start_delay": 0.0, "commit_pause": 0.0, "stop_delay": 0.0}
    kill_at = ""
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, sep, arg = item.partition(":")
        if not sep or not arg:
            raise ValueError(f"{ENV}: hook {item!r} needs an argument (kind:arg)")
        if kind == "oom":
            oom.add(arg)
        elif kind == "kill_at":
            if arg not in KILL_POINTS:
                raise ValueError(f"{ENV}: {item!r}: known points {', '.join(KILL_POINTS)}")
            kill_at = arg
        elif kind in ms_of:
            try:
                ms = float(arg)
            except ValueError:
                raise ValueError(f"{ENV}: {item!r}: {arg!r} is not a number of ms") from None
            if not 0 <= ms <= 600_000:
                raise ValueError(f"{ENV}: {item!r}: ms must lie in [0, 600000]")
            ms_of[kind] = ms
        else:
            raise ValueError(f"{ENV}: unknown hook {kind!r} (known: oom, kill_at, "
                             f"{', '.join(ms_of)})")
    return Faults(frozenset(oom), ms_of["slow"], ms_of["start_delay"], ms_of["commit_pause"],
                  kill_at, ms_of["stop_delay"])


def install(engine: Any, environ: Mapping[str, str] = os.environ, daemon: Any = None) -> Faults:
    """Apply the hooks named in ``environ[ENV]`` to a starting daemon's engine (before its
    scheduler is built) and, for ``stop_delay``, to the daemon. Returns what was installed;
    with the variable unset, nothing."""
    faults = parse(environ.get(ENV, ""))
    if not faults.active:
        return faults
    log.warning("TEST FAULT INJECTION ACTIVE (%s=%r): never use this in production",
                ENV, environ[ENV])
    if faults.start_delay_ms:
        time.sleep(faults.start_delay_ms / 1000.0)
    gen = getattr(engine, "gen", None)  # a decoder daemon's GenEngine (itif.decoder_backend)
    if gen is not None and faults.oom_tenants:
        gen.before_forward = _gen_oom(faults.oom_tenants)
    if faults.oom_tenants or faults.slow_ms:
        engine.infer = _faulty(engine.infer, faults)  # instance attribute: this engine only
        if hasattr(engine, "infer_columns"):  # the column path's batches (issue 61)
            engine.infer_columns = _faulty_columns(engine.infer_columns, faults)
    if faults.commit_pause_ms:
        engine.add_tenant = _paused(engine.add_tenant, faults.commit_pause_ms / 1000.0)
    if faults.stop_delay_ms and daemon is not None:
        daemon.stop = _paused(daemon.stop, faults.stop_delay_ms / 1000.0)  # this daemon only
    if faults.kill_at:
        from itif.weights import blobstore

        blobstore.fault_point = _killer(faults.kill_at)
    return faults


def _killer(point: str) -> Callable[[str], None]:
    def reached(name: str) -> None:
        if name == point:
            log.warning("kill_at: commit reached %s, SIGKILL now", name)
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    return reached


def _paused(add_tenant: Callable, seconds: float) -> Callable:
    def add(*args, **kwargs):
        time.sleep(seconds)
        return add_tenant(*args, **kwargs)

    return add


def _oom(tenants: set[str] | frozenset[str]) -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by "
                                  f"{ENV} for tenant(s) {sorted(tenants)})")


def _gen_oom(oom_tenants: frozenset[str]) -> Callable[[set[str]], None]:
    def check(tenants: set[str]) -> None:
        if tenants & oom_tenants:
            raise _oom(tenants & oom_tenants)

    return check


def _faulty(infer: Callable, faults: Faults) -> Callable:
    def run(requests, *args, **kwargs):
        if faults.slow_ms:
            time.sleep(faults.slow_ms / 1000.0)
        if faults.oom_tenants and any(r.tenant in faults.oom_tenants for r in requests):
            raise _oom(faults.oom_tenants & {r.tenant for r in requests})
        return infer(requests, *args, **kwargs)

    return run


def _faulty_columns(infer_columns: Callable, faults: Faults) -> Callable:
    def run(tenant, ids, offsets, *args, table=None, **kwargs):
        if faults.slow_ms:
            time.sleep(faults.slow_ms / 1000.0)
        if faults.oom_tenants:
            names = {table[int(i)] for i in set(tenant)} if table is not None else set(tenant)
            if names & faults.oom_tenants:
                raise _oom(faults.oom_tenants & names)
        return infer_columns(tenant, ids, offsets, *args, table=table, **kwargs)

    return run
