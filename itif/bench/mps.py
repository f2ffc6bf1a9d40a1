"""The ``mps`` baseline: one process per tenant, all under NVIDIA MPS.

Each worker process (spawned, so no CUDA state is inherited) builds an :class:`~itif.Engine`
holding only its tenant, with the same weights as every other system (:func:`tenant_weights` is
deterministic). A run releases all workers at once through a barrier; each times its own forward
with ``CLOCK_MONOTONIC`` (one clock for all processes) and the run's latency is the last end
minus the first start.

MPS runs under a private control daemon (``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``
in a temp folder, given only to the workers), started with ``nvidia-cuda-mps-control -d`` and
stopped with ``quit``: nothing outside the benchmark is touched and the GPU's settings are left
as they are. Without CUDA or without ``nvidia-cuda-mps-control`` the rows are reported as
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import time
from pathlib import Path

import torch

from itif.bench.systems import System, by_tenant

CLOCK = time.CLOCK_MONOTONIC
READY_TIMEOUT_S = 600.0  # building a large engine in every process at once takes a while
RUN_TIMEOUT_S = 600.0


def unavailable(device: torch.device) -> str | None:
    """Why MPS cannot run here, or None."""
    if device.type != "cuda":
        return "MPS needs a CUDA device; this run is on the CPU"
    if shutil.which("nvidia-cuda-mps-control") is None:
        return "nvidia-cuda-mps-control is not on PATH"
    return None


@contextlib.contextmanager
def mps_server(root: Path):
    """A private MPS control daemon; yields the environment its clients need."""
    exe = shutil.which("nvidia-cuda-mps-control")
    env_extra = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
                 "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for d in env_extra.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **env_extra)
    r = subprocess.run([exe, "-d"], env=env, capture_output=True, timeout=60)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).decode(errors="replace").strip()
        raise RuntimeError(f"nvidia-cuda-mps-control -d failed ({r.returncode}): {msg[:300]}")
    try:
        yield env_extra
    finally:
        subprocess.run([exe], input=b"quit\n", env=env, capture_output=True, timeout=60)


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(index: int, tenant: str, preset: str, device: str, dtype: str, fine_tune: str,
            threads: int | None, cmd_q, res_q, barrier) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        from itif.backbones.spec import load_spec  # noqa: PLC0415
        from itif.bench.tenants import tenant_weights  # noqa: PLC0415
        from itif.runtime.engine import Engine  # noqa: PLC0415

        engine = Engine(preset, device=device, dtype=dtype, cuda_graphs="on")  # as offline._build
        engine.add_tenant(tenant, tenant_weights(load_spec(preset), index, fine_tune))
        res_q.put(("ready", index, None))
        reqs: list = []
        while True:
            cmd, arg = cmd_q.get()
            if cmd == "stop":
                return
            if cmd == "load":
                reqs = arg
                engine.infer(reqs)  # warm-up
                res_q.put(("loaded", index, None))
            elif cmd == "run":
                barrier.wait(RUN_TIMEOUT_S)
                t0 = time.clock_gettime(CLOCK)
                out = engine.infer(reqs)
                t1 = time.clock_gettime(CLOCK)
                res_q.put(("time", index, (t0, t1, [r.logits for r in out])))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        with contextlib.suppress(Exception):
            res_q.put(("error", index, f"{type(e).__name__}: {e}"))


class ProcessPerTenant(System):
    """One process per tenant (under MPS when ``env_extra`` names an MPS pipe directory)."""

    name = "mps"
    countable = False  # the forwards run in other processes: op_counts cannot observe them

    def __init__(self, preset: str, device: torch.device, dtype: str, tenants: list[str],
                 fine_tune: str, env_extra: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        n = len(tenants)
        self.tenants = tenants
        self._res = ctx.Queue()
        self._cmd = [ctx.Queue() for _ in tenants]
        self._barrier = ctx.Barrier(n + 1)
        self._groups: dict[str, list[int]] = {}
        self._logits = None
        self._n = 0
        threads = max(1, (os.cpu_count() or 1) // n) if device.type == "cpu" else None
        self._procs = []
        with _environ(env_extra or {}):
            for i, t in enumerate(tenants):
                p = ctx.Process(target=_worker, name=f"bench-{t}", daemon=True,
                                args=(i, t, preset, str(device), dtype, fine_tune, threads,
                                      self._cmd[i], self._res, self._barrier))
                p.start()
                self._procs.append(p)
        try:
            self._expect("ready", READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _expect(self, kind: str, timeout: float) -> list:
        got: list = [None] * len(self.tenants)
        end = time.monotonic() + timeout
        left = len(self.tenants)
        while left:
            try:
                k, i, payload = self._res.get(timeout=max(0.1, min(5.0, end - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"tenant processes died: {', '.join(dead)}") from None
                if time.monotonic() > end:
                    raise TimeoutError(
                        f"tenant processes not {kind} after {timeout:.0f} s") from None
                continue
            if k == "error":
                raise RuntimeError(f"tenant process {self.tenants[i]}: {payload}")
            if k != kind:
                raise RuntimeError(
                    f"tenant process {self.tenants[i]} sent {k!r}, expected {kind!r}")
            got[i] = payload
            left -= 1
        return got

    def load(self, requests):
        self._groups = by_tenant(requests)
        self._n = len(requests)
        for i, t in enumerate(self.tenants):
            self._cmd[i].put(("load", [requests[j] for j in self._groups.get(t, [])]))
        self._expect("loaded", RUN_TIMEOUT_S)

    def run(self) -> float:
        for q in self._cmd:
            q.put(("run", None))
        self._barrier.wait(RUN_TIMEOUT_S)
        got = self._expect("time", RUN_TIMEOUT_S)
        start = min(g[0] for g in got)
        end = max(g[1] for g in got)
        out = [None] * self._n
        for t, (_, _, logits) in zip(self.tenants, got):
            for j, row in zip(self._groups.get(t, []), logits):
                out[j] = row
        self._logits = out
        return (end - start) * 1e3

    def logits(self):
        import numpy as np  # noqa: PLC0415

        if self._logits is None or any(x is None for x in self._logits):
            return None
        return np.stack(self._logits)

    def close(self) -> None:
        for q in self._cmd:
            with contextlib.suppress(Exception):
                q.put(("stop", None))
        with contextlib.suppress(Exception):
            self._barrier.abort()
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
