"""The peer workload's itif forwards (issue 65), a change against its baseline, interleaved.

    python bench/cpu_peer_forward.py [--repeats 7] [--dtypes float32 bfloat16]
        [--off attention] [--out OUT.json]

The workload of ``itif bench --suites peer`` (``itif.bench.cpu_peer``: 256 requests of 2-100
tokens, the BERT of ``PEER_SPEC``), one tenant and 8 tenants, one engine each per dtype. Every
repeat runs each (workload, dtype) twice in a row, once as is and once with the kernels named
by ``--off`` suspended in this thread (``attention``: ``itif.runtime.cpu_attention``, the
length groups run instead; ``linear``: ``itif.runtime.cpu_linear``; ``seglinear``: its
one-region kernel, a call per segment and a concatenation instead), the order alternating, so
load on a shared machine hits both alike. Prints median and best ms a forward (``Engine.infer``)
and req/s, and the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from itif.bench.cpu_peer import PEER_SPEC, peer_requests  # noqa: E402
from itif.bench.tenants import tenant_weights  # noqa: E402
from itif.bench.workloads import tenant_names  # noqa: E402
from itif.runtime import cpu_attention, cpu_linear  # noqa: E402
from itif.runtime.engine import Engine, Request  # noqa: E402

SWITCHES = {"attention": cpu_attention.suspended, "linear": cpu_linear.suspended,
            "seglinear": cpu_linear.seg_suspended}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--off", nargs="+", default=["attention"], choices=sorted(SWITCHES))
    ap.add_argument("--out")
    a = ap.parse_args()
    spec, T = PEER_SPEC, a.tenants
    names = tenant_names(T)
    weights = {t: tenant_weights(spec, i, "full") for i, t in enumerate(names)}
    one = peer_requests(256, 1, "uniform:2-100", 0)
    many = [Request(names[i % T], input_ids=r.input_ids) for i, r in enumerate(one)]
    runs = {}
    for dt in a.dtypes:
        e1 = Engine(spec, device="cpu", dtype=dt)
        e1.add_tenant(names[0], weights[names[0]])
        eT = Engine(spec, device="cpu", dtype=dt)
        for t in names:
            eT.add_tenant(t, weights[t])
        runs[(dt, 1)] = (e1, one)
        runs[(dt, T)] = (eT, many)

    def baseline():
        stack = contextlib.ExitStack()
        for k in a.off:
            stack.enter_context(SWITCHES[k]())
        return stack

    ms: dict = {(k, w): [] for k in runs for w in ("baseline", "change")}
    load0 = os.getloadavg()
    for rep in range(a.repeats + 1):  # the first round warms up, untimed
        for k, (eng, reqs) in runs.items():
            order = ("baseline", "change") if rep % 2 else ("change", "baseline")
            for which in order:
                with baseline() if which == "baseline" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    eng.infer(reqs)
                    dt_ms = (time.perf_counter() - t0) * 1e3
                if rep:
                    ms[(k, which)].append(dt_ms)
    rows = []
    for (k, which), v in ms.items():
        dt, n = k
        med = float(np.median(v))
        rows.append(dict(dtype=dt, tenants=n, which=which, median_ms=round(med, 1),
                         best_ms=round(min(v), 1), req_per_s=round(256e3 / med, 1)))
        print(f"{dt:9s} {n} tenant(s) {which:8s} median {med:7.1f} ms  best {min(v):7.1f} ms  "
              f"{256e3 / med:6.1f} req/s")
    info = dict(off=a.off, repeats=a.repeats, load_before=load0, load_after=os.getloadavg(),
                threads=torch.get_num_threads(), rows=rows)
    print("load average before", load0, "after", info["load_after"])
    if a.out:
        Path(a.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
