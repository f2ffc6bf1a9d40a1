"""Timings for the whole-batch cost model ``calibration.batch_cost``, no model itself (the other
two are ``batching.layer_cost``, per layer, and ``scheduler.estimate``, learned online).

The clock the model uses and best-of-n measurements of a callable, of a Layout run through an
engine, and of one prepared forward. CPU timings: nothing here synchronises a device."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from itif.batching.layout import Layout

__all__ = ["clock", "measure_forward", "measure_layout", "measure_ms", "prepare_for"]


def clock():
    """``(now, name)``: the clock timings use. With one torch thread on the CPU every op runs
    on the calling thread, so its CPU time (``time.thread_time``) is the batch's time without
    the time slices other processes took from it (equal to wall time on an idle machine, and
    steady on a shared one); otherwise wall time."""
    if torch.get_num_threads() == 1:
        return time.thread_time, "thread_cpu"
    return time.perf_counter, "wall"


def measure_ms(fn, repeats: int = 7, min_sample_s: float = 0.002, budget_s: float = 0.3) -> float:
    """Best-of-``repeats`` wall time of ``fn()`` in ms (CPU; tiny calls repeated inside one
    sample). The minimum, not the median: on a shared 2-core CPU a parallel op whose second
    thread is descheduled waits out a whole 4-8 ms time slice, and that happened in most samples
    of some points (medians of exactly 8.0 / 16.0 / 24.0 ms for 0.05 ms attention calls)."""
    now = clock()[0]
    fn()
    est = float("inf")
    for _ in range(2):
        t0 = now()
        fn()
        est = min(est, now() - t0)
    inner = int(min(200, max(1, min_sample_s / max(est, 1e-9))))
    samples = []
    deadline = now() + budget_s
    while len(samples) < repeats:
        t0 = now()
        for _ in range(inner):
            fn()
        samples.append((now() - t0) / inner)
        if now() > deadline and len(samples) >= 3:
            break
    return min(samples) * 1e3


def prepare_for(engine, requests, layout: Layout):
    """The PreparedBatch ``engine`` would run for ``layout`` (host only; nothing runs)."""
    from itif.runtime.batch import prepare  # noqa: PLC0415

    view = engine.store.view
    tenants = engine.batch_tenants(view, [r.tenant for r in requests])
    ids = np.concatenate([np.asarray(r.input_ids, np.int64) for r in requests])
    return prepare(engine.spec, layout, tenants, view, engine.slot_tables(view, tenants),
                   engine.device, engine.dtype, ids=ids)


def measure_layout(engine, requests, layout: Layout, repeats: int = 7,
                   stats: dict | None = None, warmup: bool = True) -> float:
    """Best-of-``repeats`` ms of running ``layout`` through ``engine`` (``infer`` with planning
    replaced by the given layout: prepare, forward, download, results) on :func:`clock`. The
    minimum, for the reason given at :func:`measure_ms`; ``stats`` (if given) receives the median
    and the best wall time too."""
    now = clock()[0]
    if warmup:
        engine.infer(requests, layout=layout)
    times, walls = [], []
    for _ in range(repeats):
        w0, t0 = time.perf_counter(), now()
        engine.infer(requests, layout=layout)
        times.append(now() - t0)
        walls.append(time.perf_counter() - w0)
    if stats is not None:
        stats["median_ms"] = statistics.median(times) * 1e3
        stats["wall_ms"] = min(walls) * 1e3
    return min(times) * 1e3


def measure_forward(engine, batch, repeats: int = 5) -> float:
    """Best-of-``repeats`` ms of ``forward.run`` of a prepared batch (upload, forward and the
    output's copy to the host; no host work around it), on :func:`clock`."""
    from itif.runtime import forward  # noqa: PLC0415

    now = clock()[0]

    def once():
        ints, floats = batch.upload(engine.device)
        forward.run(engine.spec, batch, ints, floats).cpu()

    once()
    times = []
    for _ in range(repeats):
        t0 = now()
        once()
        times.append(now() - t0)
    return min(times) * 1e3
