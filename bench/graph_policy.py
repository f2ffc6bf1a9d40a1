"""When to capture CUDA graphs, and which attention to let torch pick, measured: one engine, the
same kinds of batch sequences under each ``cuda_graphs`` setting and each attention choice,
side by side in one run.

    python bench/graph_policy.py [--model bert-base] [--tenants 16] [--batches 100]
        [--repeats 30] [--rounds 2] [--attention itif groups] [--dtype float16]
        [--out OUT/graph_policy.json]

Settings: ``cuda_graphs`` ``off`` (always eager), ``on`` (every structure captured on first
sight: the engine's behaviour before the rent rule) and ``auto`` (captured once its eager
forwards have paid for a capture); attention ``itif`` (the default: a batch of several length
groups in one variable-length flash call a layer, ``itif.ops.cuda.attention``; torch's SDPA
without cuDNN per group otherwise, ``itif.platform.attention_backends``), ``groups`` (every
length group its own SDPA call, as before the variable-length call:
``launch_policy(attention="sdpa")``) and ``cudnn`` (the groups with ``ITIF_CUDNN_SDPA=1``:
torch's own order, cuDNN first on an H100). Each (attention, setting) runs in interleaved rounds,
the
graph cache emptied before each, over two sequences:

- ``serving``: ``--batches`` batches as a serving load forms them: 1-64 requests each (a
  geometric size, mean ~8), lengths uniform in 2-100, tenants Zipf(1.2) over ``--tenants``.
  Drawn afresh for every run (seeded by round, attention and setting), so every run meets
  shapes it has not seen, as a daemon does: a per-shape cost (a graph capture, a cuDNN plan)
  is paid in each run instead of by whichever ran first.
- ``repeating``: one batch of ``--tenants`` requests (64 tokens each) run ``--repeats`` times,
  the workload a graph is for.

For each: seconds, ms per batch and per request (the best round is the one of fewest ms per
request: fresh sequences differ in size), and the cache's captures / replays / eager forwards in
that round; ratios of ``auto`` against ``off`` and ``on``, and of the two attention choices.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import itif  # noqa: E402
from itif import platform  # noqa: E402
from itif.backbones.spec import load_spec  # noqa: E402
from itif.bench.tenants import tenant_weights  # noqa: E402
from itif.ops.launch import launch_policy  # noqa: E402

SETTINGS = ("off", "on", "auto")
ATTENTION = ("itif", "cudnn", "groups")


def serving_batches(spec, tenants: int, n: int, rng) -> list[list[itif.Request]]:
    p = 1.0 / np.arange(1, tenants + 1) ** 1.2
    p /= p.sum()
    out = []
    for _ in range(n):
        size = int(min(64, rng.geometric(1 / 8)))
        ts = rng.choice(tenants, size=size, p=p)
        out.append([itif.Request(f"t{t}", input_ids=rng.integers(0, spec.vocab_size,
                                                                  int(rng.integers(2, 101))))
                    for t in ts])
    return out


def run_sequence(eng, batches, setting: str, attention: str) -> dict:
    os.environ["ITIF_CUDNN_SDPA"] = "1" if attention == "cudnn" else "0"
    platform.cudnn_attention_allowed.cache_clear()
    eng.cuda_graphs = setting
    if eng._graphs is not None:
        eng._graphs.clear()  # every setting starts with no graphs and no counts
    before = eng.graph_stats()
    torch.cuda.synchronize()
    with launch_policy(attention="auto" if attention == "itif" else "sdpa"):
        t0 = time.perf_counter()
        for b in batches:
            eng.infer(b)  # returns host arrays: each call ends synchronised
        s = time.perf_counter() - t0
    after = eng.graph_stats()
    counts = {k: after[k] - before[k] for k in ("captures", "replays", "eager")}
    n = sum(len(b) for b in batches)
    return dict(seconds=round(s, 4), ms_per_batch=round(1e3 * s / len(batches), 3),
                ms_per_request=round(1e3 * s / n, 4), requests=n, **counts,
                ratio_after=after["ratio"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attention", nargs="+", choices=ATTENTION, default=["itif", "groups"])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_policy: needs CUDA (CUDA graphs are off on the CPU)", file=sys.stderr)
        return 2
    spec = load_spec(args.model)
    eng = itif.Engine(spec, device="cuda", dtype=args.dtype)
    for i in range(args.tenants):
        eng.add_tenant(f"t{i}", tenant_weights(spec, i))
    rng = np.random.default_rng(args.seed)
    repeating = [[itif.Request(f"t{i}", input_ids=rng.integers(0, spec.vocab_size, 64))
                  for i in range(args.tenants)]] * args.repeats
    eng.cuda_graphs = "off"
    for b in serving_batches(spec, args.tenants, 3, rng):  # kernel builds, allocator, cuBLAS
        eng.infer(b)
    runs = [(a, s) for a in args.attention for s in SETTINGS]
    rounds: dict = {"serving": {}, "repeating": {}}
    for r in range(args.rounds):
        k = r % len(runs)
        for i, (att, s) in enumerate(runs[k:] + runs[:k]):  # rotating start: drift hits all
            fresh = np.random.default_rng([args.seed, r, ATTENTION.index(att), SETTINGS.index(s)])
            for name, batches in (("serving", serving_batches(spec, args.tenants, args.batches,
                                                               fresh)),
                                  ("repeating", repeating)):
                res = run_sequence(eng, batches, s, att)
                rounds[name].setdefault(f"{att}/{s}", []).append(res)
                print(f"round {r} {name:9s} {att:5s} {s:4s} {res}", flush=True)
    summary: dict = {}
    for name, by in rounds.items():
        best = {k: min(v, key=lambda x: x["ms_per_request"]) for k, v in by.items()}
        summary[name] = dict(best=best)
        for att in args.attention:
            b = {s: best[f"{att}/{s}"] for s in SETTINGS}
            summary[name][f"{att}: auto vs off"] = round(b["off"]["ms_per_request"]
                                                         / b["auto"]["ms_per_request"], 3)
            summary[name][f"{att}: auto vs on"] = round(b["on"]["ms_per_request"]
                                                        / b["auto"]["ms_per_request"], 3)
            print(f"{name} {att}: " + ", ".join(f"{s} {b[s]['ms_per_batch']} ms/batch"
                                                 for s in SETTINGS))
        if "itif" in args.attention:
            for other in args.attention:
                if other != "itif":
                    summary[name][f"itif vs {other} attention, auto"] = round(
                        best[f"{other}/auto"]["ms_per_request"]
                        / best["itif/auto"]["ms_per_request"], 3)
        print(name, {k: v for k, v in summary[name].items() if k != "best"})
    doc = dict(model=args.model, tenants=args.tenants, dtype=args.dtype, batches=args.batches,
               repeats=args.repeats, rounds_run=args.rounds, attention=args.attention,
               device=torch.cuda.get_device_name(), torch=torch.__version__,
               cudnn=torch.backends.cudnn.version(), summary=summary, rounds=rounds)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
