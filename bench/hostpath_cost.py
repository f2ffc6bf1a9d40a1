"""What the columnar host path costs the engine process a request, beyond the forward.

    python bench/hostpath_cost.py [--rate 1000] [--seconds 4] [--repeats 5] [--tenants 16]
        [--frontends 2] [--flush-ms 1] [--out OUT.json]

Issue #61's target: on this CPU, bert-tiny x16, the serving mix (lengths 2-100, zipf 1.2) at
1,000 req/s, the engine process's CPU a request, minus what ``Engine.infer`` alone costs for
the same batches, is at most 30 us. The engine side here is what the engine process would run
(``itif.hostpath``): read the front ends' ring slots (``Arrivals.unpack_many``: the slots one
wake-up finds, copied into one batch; release), ``ColumnQueue.push``, ``ColumnQueue.due`` (once
a batch: the decision that runs it) and ``take``, ``Engine.infer_columns``, ``Results`` built
and packed into the result ring's slot. The front ends' side (packing arrivals, reading
results) runs untimed: it is another process's CPU. A wake-up's own cost (the pipe's poll and
read) is measured apart (``wakeup_us``).

How: the arrivals (Poisson at ``--rate``, the serving mix, ``--frontends`` front ends each
sending one ring batch a ``--flush-ms`` window) are first scheduled in virtual time: the engine
takes a batch when ``due`` says so (the scheduler's triggers, 5 ms lazy wait, 8192 tokens, 256
rows) and is then busy for as long as its forward took in CPU time (what it would take on a
core of its own; on a shared machine the wall clock would overstate it and grow the batches).
That fixes every batch; the batches therefore depend on the forward's speed (at 1,000 req/s
this CPU sits near the point where a slower forward tips it into batches of tens of rows,
which hide a per-batch cost), so ``--save-schedule`` keeps a run's schedule and ``--schedule``
replays it: the same batches for the engine side of another commit. Then, per repeat, the engine
side replays that schedule (measured
with ``time.process_time``, the process's CPU in every thread, torch held to one thread),
and ``Engine.infer`` runs each batch as a ``Request`` list (built untimed) right beside its
``infer_columns``, the order alternating from batch to batch, so that the drift of a shared
machine's load cancels.
``extra_us_per_request`` is (engine side - infer) / requests (``extra_us_per_batch`` the same
a batch: the engine side's cost is mostly per batch), and the parts are reported too.
Linux or macOS; needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

import itif
from itif.bench.tenants import tenant_weights
from itif.bench.workloads import parse_mix, poisson_arrivals
from itif.calibration.plan_report import sample_lengths, sample_tenants
from itif.hostpath import ring as ring_mod
from itif.hostpath.colqueue import ColumnQueue
from itif.hostpath.columns import Arrivals, Results
from itif.hostpath.ring import Ring
from itif.platform import tune_gc
from itif.requests import Request
from itif.scheduler import TenantQuota
from itif.scheduler.estimate import BatchTimeEstimate

MIX = "uniform:2-100+zipf:1.2"
MAX_TOKENS, MAX_ROWS, MAX_WAIT_MS = 8192, 256, 5.0  # SchedulerConfig's defaults


def frames(args, spec, rng) -> list[tuple[float, int, Arrivals]]:
    """(send time, front end, arrivals) of every ring batch, in send order."""
    mix = parse_mix(MIX)
    at = poisson_arrivals(args.rate, args.seconds, 10**7, rng)
    n = at.size
    tenant = sample_tenants(args.tenants, n, mix.skew, rng)
    lengths = sample_lengths(mix.lengths, n, spec.max_position, rng).astype(np.int64)
    off = np.concatenate(([0], np.cumsum(lengths)))
    ids = rng.integers(0, spec.vocab_size, int(off[-1])).astype(np.int32)
    fe = np.arange(n) % args.frontends
    window = np.floor(at / (args.flush_ms / 1000.0)).astype(np.int64)
    out = []
    for w in np.unique(window):
        for f in range(args.frontends):
            rows = np.flatnonzero((window == w) & (fe == f))
            if not rows.size:
                continue
            lo, hi = off[rows], off[rows + 1]
            sub = np.concatenate(([0], np.cumsum(hi - lo)))
            a = Arrivals.build(rows, tenant[rows], sub,
                               np.concatenate([ids[x:y] for x, y in zip(lo, hi)]),
                               deadline=np.full(rows.size, 1e9))
            out.append(((w + 1) * args.flush_ms / 1000.0, f, a))
    return out


def schedule(engine, names, sent, quota) -> list[tuple[int, float]]:
    """The engine loop in virtual time: [(frames published before this step, now)] of every
    step that takes a batch; its busy time is the measured forward."""
    q = ColumnQueue(max_len=engine.max_seq_len, vocab=engine.spec.vocab_size)
    for t in names:
        q.add_tenant(t, quota)
    est = BatchTimeEstimate()
    steps, now, i, last_end = [], 0.0, 0, -1.0
    while i < len(sent) or q.queued:
        while i < len(sent) and sent[i][0] <= now:
            q.push(sent[i][2], now)
            i += 1
        run, wake = q.due(now, max_tokens=MAX_TOKENS, max_rows=MAX_ROWS,
                          max_wait_ms=MAX_WAIT_MS, last_end=last_end, estimate_ms=est)
        if not run:
            nxt = sent[i][0] if i < len(sent) else np.inf
            now = min(nxt, wake if wake is not None else np.inf)
            continue
        b = q.take(MAX_TOKENS, MAX_ROWS, now)
        t0 = time.process_time()
        engine.infer_columns(b.tenant, b.ids, b.offsets, table=names)
        busy = time.process_time() - t0  # the CPU it took: as if the engine had its own core
        est.observe(len(b), int(b.offsets[-1]), busy * 1000.0)
        steps.append((i, now))
        now += busy
        last_end = now
    return steps


def engine_side(engine, names, sent, steps, quota, rings) -> dict:
    """Replay ``steps`` as the engine process would run them, and ``Engine.infer`` on each
    batch right beside its ``infer_columns`` (the order alternating from batch to batch, so
    that the machine's drift cancels): CPU seconds of each part."""
    q = ColumnQueue(max_len=engine.max_seq_len, vocab=engine.spec.vocab_size)
    for t in names:
        q.add_tenant(t, quota)
    producers = [r.producer() for r in rings["in"]]
    consumers = [r.consumer() for r in rings["in"]]
    out_p, out_c = rings["out"].producer(), rings["out"].consumer()
    cpu = {"read_push": 0.0, "due": 0.0, "take": 0.0, "infer_columns": 0.0, "results": 0.0,
           "infer": 0.0}
    est = BatchTimeEstimate()
    i = k = batches = rows_run = 0
    clock = time.process_time
    steps = list(steps)
    while k < len(steps):
        upto, now = steps[k]
        k += 1
        while i < upto:  # the front ends (untimed: their processes' CPU)
            producers[sent[i][1]].put(sent[i][2], timeout=5)
            i += 1
        c0 = clock()
        slots = [c.ready() for c in consumers]  # every batch published since the last step
        views = [v for vs in slots for v in vs]
        if views:  # one batch of them all, copied: the slots are free right after
            a = Arrivals.unpack_many(views)
            del views
            for c, vs in zip(consumers, slots):
                c.release(len(vs))
            status = q.push(a, now)
            del a
        del slots
        c1 = clock()
        run, _ = q.due(now, max_tokens=MAX_TOKENS, max_rows=MAX_ROWS, max_wait_ms=MAX_WAIT_MS,
                       last_end=now, estimate_ms=est)
        c1b = clock()
        if not run:  # nothing queued: the schedule's rows of this step went in an earlier batch
            # (it pushed the front ends' ring batches in send order, this reads them ring by
            # ring, so the run-ahead tail rule may split a few batches differently)
            cpu["read_push"] += c1 - c0
            cpu["due"] += c1b - c1
            continue
        b = q.take(MAX_TOKENS, MAX_ROWS, now)
        c2 = clock()
        batches += 1
        rows_run += len(b)
        if k == len(steps) and q.queued:  # rows left after the last step: run them too
            steps.append((upto, now))
        reqs = [Request(names[t], input_ids=b.ids[b.offsets[j]:b.offsets[j + 1]])
                for j, t in enumerate(b.tenant)]
        if k % 2:
            c5 = clock()
            engine.infer(reqs)
            infer = clock() - c5
        c2b = clock()
        out = engine.infer_columns(b.tenant, b.ids, b.offsets, table=names)
        c3 = clock()
        if not out_p.try_put(Results.ok(b.call_id, out.offsets, out.values)):
            raise RuntimeError("the result ring is full")
        c4 = clock()
        if not k % 2:
            c5 = clock()
            engine.infer(reqs)
            infer = clock() - c5
        cpu["read_push"] += c1 - c0
        cpu["due"] += c1b - c1
        cpu["take"] += c2 - c1b
        cpu["infer_columns"] += c3 - c2b
        cpu["results"] += c4 - c3
        cpu["infer"] += infer
        assert upto == 0 or (status == 0).all()
        got = Results.unpack(out_c.peek())  # the front end's side, untimed
        assert np.array_equal(got.call_id, b.call_id)
        del got
        out_c.release()
    assert not q.queued
    cpu["batches"], cpu["rows"] = batches, rows_run
    return cpu


def wakeup_cost(n: int = 2000) -> float:
    """CPU seconds of one wake-up, both ends in this process: the producer's byte, the
    consumer's poll of the pipe and its drain, the release."""
    with Ring(slots=4, slot_bytes=256) as ring:
        p, c = ring.producer(), ring.consumer()
        fd = ring.handle("consumer")["fds"][0]
        c0 = time.process_time()
        for _ in range(n):
            p.try_put(b"x")
            ring_mod._wait_readable(fd, 1.0)  # what Consumer.wait does when it sleeps
            ring_mod._drain(fd)
            c.release()
        return (time.process_time() - c0) / n


def measure(args) -> dict:
    torch.set_num_threads(1)
    engine = itif.Engine("bert-tiny")
    spec = engine.spec
    names = [f"t{i}" for i in range(args.tenants)]
    for i, t in enumerate(names):
        engine.add_tenant(t, tenant_weights(spec, i))
    rng = np.random.default_rng(args.seed)
    quota = TenantQuota(max_queue=100_000)
    sent = frames(args, spec, rng)
    n_req = sum(len(a) for _, _, a in sent)
    steps = schedule(engine, names, sent, quota)  # also warms the engine up
    if args.save_schedule:
        args.save_schedule.write_text(json.dumps({"argv": sys.argv[1:], "steps": steps}) + "\n")
    if args.schedule:  # a saved schedule of the same arrivals: the same batches, whatever
        saved = json.loads(args.schedule.read_text())["steps"]  # the forward's speed today
        if saved[-1][0] > len(sent):
            raise SystemExit(f"{args.schedule}: steps past the {len(sent)} ring batches of "
                             "these arguments")
        steps = [(int(i), float(now)) for i, now in saved]
    tune_gc()  # the collector's settings of ``itif serve``, once startup is done
    # each ring as the daemon's would be, a few slots reused over and over (so hot in the
    # caches), but enough for every batch a front end sends between two steps
    most = max(b[0] - a[0] for a, b in zip([(0, 0.0), *steps], steps))
    rings = {"in": [Ring(slots=max(16, most + 1), slot_bytes=64 << 10)
                    for _ in range(args.frontends)],
             "out": Ring(slots=4, slot_bytes=4 << 20)}
    rows = []
    try:
        for rep in range(args.repeats):
            cpu = engine_side(engine, names, sent, steps, quota, rings)
            infer_s = cpu.pop("infer")
            batches = cpu.pop("batches")
            assert cpu.pop("rows") == n_req
            side = sum(cpu.values())
            row = {"repeat": rep, "requests": n_req, "batches": batches,
                   "engine_side_us_per_request": round(side / n_req * 1e6, 1),
                   "infer_us_per_request": round(infer_s / n_req * 1e6, 1),
                   "extra_us_per_request": round((side - infer_s) / n_req * 1e6, 1),
                   "extra_us_per_batch": round((side - infer_s) / batches * 1e6, 1),
                   **{f"{k}_us_per_request": round(v / n_req * 1e6, 1) for k, v in cpu.items()}}
            rows.append(row)
            print(f"repeat {rep}: {n_req} requests in {batches} batches; engine side "
                  f"{row['engine_side_us_per_request']} us a request, Engine.infer "
                  f"{row['infer_us_per_request']}, extra {row['extra_us_per_request']} "
                  f"(read+push {row['read_push_us_per_request']}, due "
                  f"{row['due_us_per_request']}, take "
                  f"{row['take_us_per_request']}, infer_columns "
                  f"{row['infer_columns_us_per_request']}, results "
                  f"{row['results_us_per_request']})", flush=True)
    finally:
        for r in [*rings["in"], rings["out"]]:
            r.close()
    wake = wakeup_cost()
    extra = [r["extra_us_per_request"] for r in rows]
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
            "itif": str(ROOT), "cpu_count": os.cpu_count(), "mix": MIX, "model": "bert-tiny",
            "tenants": args.tenants, "rate": args.rate, "frontends": args.frontends,
            "flush_ms": args.flush_ms, "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "schedule": str(args.schedule) if args.schedule else "formed by this run"}
    mean_rows = round(n_req / rows[0]["batches"], 2) if rows else None
    return {"meta": meta, "rows": rows, "mean_batch_rows": mean_rows,
            "ring_batches": len(sent), "wakeup_us": round(wake * 1e6, 2),
            "median_extra_us_per_request": float(np.median(extra)),
            "median_extra_us_per_batch": float(np.median([r["extra_us_per_batch"]
                                                          for r in rows]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="req/s")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds of arrivals")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--frontends", type=int, default=2, help="front-end processes (rings)")
    ap.add_argument("--flush-ms", type=float, default=1.0,
                    help="a front end sends one ring batch of its arrivals a window this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule", type=Path,
                    help="replay the batches of a schedule saved by --save-schedule (same "
                         "arrival arguments) instead of the one this run forms")
    ap.add_argument("--save-schedule", type=Path, help="save the schedule this run forms")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if min(args.rate, args.seconds, args.repeats, args.tenants, args.frontends,
           args.flush_ms) <= 0:
        ap.error("every number must be positive")
    doc = measure(args)
    print(f"median: {doc['median_extra_us_per_request']:.1f} us a request on the engine side "
          f"beyond Engine.infer (target <= 30); {doc['mean_batch_rows']} rows a batch, "
          f"a wake-up {doc['wakeup_us']} us")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
