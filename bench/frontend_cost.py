"""What one Infer call costs the daemon's event-loop thread: the per-call Python (auth,
admission, validation, queueing, metrics, the reply) that, under load, holds the daemon's one
interpreter while its forwards wait (docs/gpu.md, "A fourth session": saturation is about one
over this cost).

    python bench/frontend_cost.py [--rate 500] [--seconds 5] [--repeats 3] [--ingress 2]
        [--tenants 16] [--out OUT.json]

With ingress processes, Infer calls of token ids reach the daemon by the column path
(``itif.server.column_door``): then ``engine_extra_us_per_request`` is issue 61's figure, the
daemon process's CPU a request (every thread) minus what its forwards took
(``Engine.infer_columns``' CPU on the scheduler thread, from the daemon's
``itif_column_forward_cpu_seconds``), with torch held to ``--torch-threads`` (1: the forward's
CPU is all on that thread, so none of it is counted as overhead).

Starts a real ``itif serve`` on the CPU (bert-tiny, random tenants), sends Poisson arrivals of
the serving mix (lengths 2-100, zipf 1.2 popularity) at a rate below saturation, and reads the
CPU time of each daemon thread from ``/proc`` before and after. ``main_thread_us_per_request``
is the event-loop thread's (with ``--ingress N``, N other processes serve gRPC and this thread
runs the calls' own Python; with 0 it runs gRPC too); ``other_threads_us_per_request`` is every
other thread's, the scheduler and torch's compute among them; ``threads_us_per_request`` splits
the whole by thread name (``itif-scheduler``, ``itif-columns``...: ``itif.threadnames``). Run
it from two checkouts to compare code: ``PYTHONPATH=<checkout> python
<checkout>/bench/frontend_cost.py``. Linux only (``/proc``); needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from itif.backbones.spec import load_spec  # noqa: E402
from itif.bench.daemon_probe import (  # noqa: E402
    batch_figures,
    thread_cpu_by_name,
    thread_cpu_seconds,
)
from itif.bench.serving import LoadGen, ServeDaemon, free_ports, write_checkpoints  # noqa: E402
from itif.bench.workloads import parse_mix, poisson_arrivals  # noqa: E402

MIX = "uniform:2-100+zipf:1.2"


def measure(args) -> dict:
    spec = load_spec("bert-tiny")
    names = [f"t{i}" for i in range(args.tenants)]
    tokens = {t: secrets.token_urlsafe(12) for t in names}
    rows = []
    with tempfile.TemporaryDirectory(prefix="itif-frontend-") as tmp:
        tmp = Path(tmp)
        files = write_checkpoints(spec, names, tmp)
        grpc_port, metrics_port = free_ports(2)
        # always said: the daemon's default is ``auto`` (one ingress process on a small
        # machine), so --ingress 0 must ask for the in-process path in so many words
        extra = (("ingress_processes", args.ingress),)
        threads = str(args.torch_threads)
        daemon = ServeDaemon(tmp / "daemon", grpc_port, "bert-tiny", "cpu", "float32", tokens,
                             "packed", False, 5.0, metrics_port=metrics_port, server_extra=extra,
                             env=(("OMP_NUM_THREADS", threads), ("MKL_NUM_THREADS", threads)))
        daemon.start()
        try:
            daemon.wait_ready()
            daemon.upload(files)
            gen = LoadGen(daemon.addr, tokens, spec)
            try:
                rng = np.random.default_rng(args.seed)
                mix = parse_mix(MIX)
                warm = gen.requests(mix, 200, rng)
                gen.send(np.zeros(len(warm)), warm, 30.0, 30.0)
                pid = daemon.proc.pid
                for rep in range(args.repeats):
                    arrivals = poisson_arrivals(args.rate, args.seconds, 10**6, rng)
                    reqs = gen.requests(mix, len(arrivals), rng)
                    fig0 = daemon.figures()
                    before = thread_cpu_seconds(pid)
                    res = gen.send(arrivals, reqs, 30.0, 30.0)
                    after = thread_cpu_seconds(pid)
                    fig1 = daemon.figures()
                    n = max(res["completed"], 1)
                    main = after.get(pid, 0.0) - before.get(pid, 0.0)
                    other = sum(after[t] - before.get(t, 0.0) for t in after if t != pid)
                    col = {}
                    if fig0 and fig1:
                        rows_c = fig1["column_rows"] - fig0["column_rows"]
                        fwd = fig1["column_forward_cpu_s"] - fig0["column_forward_cpu_s"]
                        batches = batch_figures(fig0, fig1)  # per-batch costs: per-row / size
                        col = dict(column_rows=int(rows_c), batches=batches.get("batches"),
                                   mean_batch_size=batches.get("mean_batch_size"),
                                   forward_us_per_request=round(fwd / n * 1e6, 1),
                                   engine_extra_us_per_request=round(
                                       (main + other - fwd) / n * 1e6, 1))
                    by_name = {k: round(v / n * 1e6, 1) for k, v in sorted(
                        thread_cpu_by_name(pid, before, after).items()) if v > 0}
                    rows.append(dict(repeat=rep, rate_rps=args.rate, sent=len(reqs),
                                     completed=res["completed"], errors=res["errors"],
                                     throughput_rps=res["throughput_rps"], p99_ms=res["p99_ms"],
                                     main_thread_us_per_request=round(main / n * 1e6, 1),
                                     other_threads_us_per_request=round(other / n * 1e6, 1),
                                     threads_us_per_request=by_name,
                                     **col))
                    print(f"rate {args.rate:g}: {res['throughput_rps']:.0f} req/s, main thread "
                          f"{rows[-1]['main_thread_us_per_request']:.0f} us a request, other "
                          f"threads {rows[-1]['other_threads_us_per_request']:.0f}"
                          + (f"; {col['column_rows']} rows by columns, forward "
                             f"{col['forward_us_per_request']:.0f} us a request, the rest "
                             f"{col['engine_extra_us_per_request']:.0f}" if col else ""),
                          flush=True)
            finally:
                gen.close()
        finally:
            daemon.stop()
    per = [r["main_thread_us_per_request"] for r in rows]
    extra = [r["engine_extra_us_per_request"] for r in rows if "engine_extra_us_per_request" in r]
    return dict(meta=dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), argv=sys.argv[1:],
                          itif=str(ROOT), cpu_count=os.cpu_count(), mix=MIX,
                          model="bert-tiny", tenants=args.tenants, ingress=args.ingress,
                          torch_threads=args.torch_threads,
                          load_average=list(os.getloadavg())),
                rows=rows, median_main_thread_us_per_request=float(np.median(per)),
                median_engine_extra_us_per_request=float(np.median(extra)) if extra else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=500.0, help="req/s (below saturation)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of arrivals a repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ingress", type=int, default=2, help="server.ingress_processes")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="the daemon's torch threads (OMP_NUM_THREADS)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.repeats < 1 or args.tenants < 1:
        ap.error("--rate, --seconds, --repeats and --tenants must be positive")
    doc = measure(args)
    print(f"median: {doc['median_main_thread_us_per_request']:.0f} us of the event-loop thread "
          "a request")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
