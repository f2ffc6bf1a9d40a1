"""The CPU attention op with and without rounding the key length up to whole blocks.

For each sequence length L that ``cpu_attention_len`` rounds up and each shape, times
``itif.ops.reference.attention`` over one masked group of ``n`` sequences (the rule's groups)
as it is and with the rounding turned off (keys at L), the two taking turns, best of 7
samples (``measure_ms``: thread CPU time at one thread, else wall); prints the ratio
(rounded / as-is, < 1: rounding wins) and writes JSON. ``--forward`` adds whole forwards: an
engine's ``infer`` over one packed batch of short requests, both ways.

    python bench/cpu_attention.py --threads 1 --forward --out bench/results/cpu-attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from unittest import mock

import torch

from itif.calibration.batch_timing import measure_ms
from itif.ops import reference
from itif.ops.reference import AttnGroup


def measure(n: int, L: int, heads: int, d: int) -> dict:
    H = heads * d
    qkv = torch.randn(n * L, 3 * H)
    out = torch.empty(n * L, H)
    mask = torch.ones(n, 1, 1, L, dtype=torch.bool)  # every sequence but the first one row short
    mask[1:, ..., -1] = False
    group = AttnGroup(n=n, L=L, start=0, key_mask=mask)

    def run():
        reference.attention(qkv, [group], heads, out)

    times: dict[str, list[float]] = {"rounded": [], "as_is": []}
    for _ in range(2):
        times["rounded"].append(measure_ms(run))
        with mock.patch.object(reference, "cpu_attention_len", lambda L: L):
            times["as_is"].append(measure_ms(run))
    a, b = min(times["rounded"]), min(times["as_is"])
    return dict(n=n, L=L, heads=heads, d=d, masked=True, keys=reference.cpu_attention_len(L),
                rounded_ms=round(a, 4), as_is_ms=round(b, 4), ratio=round(a / b, 3))


def forward(backbone: str, tenants: int, requests: int, lo: int, hi: int, seed: int = 0) -> dict:
    """Best-of-7 ms of ``infer`` over one packed batch (``requests`` of ``lo``-``hi`` tokens over
    ``tenants`` random tenants), rounding on and off in turns (three turns each)."""
    import numpy as np

    import itif
    from itif.backbones.random import random_weights
    from itif.batching.layout import layout_packed
    from itif.calibration.batch_timing import measure_layout

    eng = itif.Engine(backbone)
    for i in range(tenants):
        eng.add_tenant(f"t{i}", random_weights(eng.spec, num_labels=2, seed=i))
    rng = np.random.default_rng(seed)
    tenant = np.sort(rng.integers(0, tenants, requests)).astype(np.int32)
    length = rng.integers(lo, hi + 1, requests).astype(np.int32)
    reqs = [itif.Request(f"t{t}", rng.integers(0, 1000, int(n))) for t, n in zip(tenant, length)]
    layout = layout_packed(tenant, length)
    times: dict[str, list[float]] = {"rounded": [], "as_is": []}
    for _ in range(3):
        times["rounded"].append(measure_layout(eng, reqs, layout))
        with mock.patch.object(reference, "cpu_attention_len", lambda L: L):
            times["as_is"].append(measure_layout(eng, reqs, layout))
    a, b = min(times["rounded"]), min(times["as_is"])
    return dict(backbone=backbone, tenants=tenants, requests=requests, lengths=f"{lo}-{hi}",
                rounded_ms=round(a, 3), as_is_ms=round(b, 3), ratio=round(a / b, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", default="4-64")
    ap.add_argument("--shapes", default="32x12x32,32x12x64,32x2x64",
                    help="n x heads x head width, comma separated")
    ap.add_argument("--forward", action="store_true",
                    help="also whole forwards (bert-tiny and bert-small, 128 requests of "
                         "4-20 tokens)")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lo, hi = map(int, a.lengths.split("-"))
    rows = []
    for shape in a.shapes.split(","):
        n, heads, d = map(int, shape.split("x"))
        line = []
        for L in range(lo, hi + 1):
            if reference.cpu_attention_len(L) == L:
                continue
            r = measure(n, L, heads, d)
            rows.append(r)
            line.append(f"{L}:{r['ratio']:.2f}")
        print(f"{shape} masked: " + " ".join(line), flush=True)
    ratios = sorted(r["ratio"] for r in rows)
    summary = dict(groups=len(rows), median_ratio=ratios[len(ratios) // 2],
                   worst_ratio=ratios[-1], best_ratio=ratios[0])
    print(summary)
    forwards = []
    if a.forward:
        for backbone in ("bert-tiny", "bert-small"):
            forwards.append(forward(backbone, 8, 128, 4, 20))
            print(forwards[-1], flush=True)
    if a.out:
        doc = dict(command="python bench/cpu_attention.py " + " ".join(
            f"--{k} {v}" for k, v in vars(a).items()
            if v is not None and not isinstance(v, bool) and k != "out")
            + (" --forward" if a.forward else ""),
            date=time.strftime("%Y-%m-%d"), torch=torch.__version__, threads=a.threads,
            cpu=platform.processor() or platform.machine(), summary=summary, forwards=forwards,
            rows=rows)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
