"""The CPU few-rows GEMM kernel (``itif.runtime.cpu_gemm``) against MKL, side by side.

    python bench/cpu_gemm.py [--threads 2] [--tenants 8] [--out bench/results/cpu-gemm.json]

Two measurements, each system's repeats interleaved:

* ``step``: one decode step of marian-decoding's decoder GEMMs (6 layers: qkv, attention out,
  cross q, cross out, FFN in, FFN out) for ``--tenants`` tenants x ``--rows`` rows, every tenant
  its own weights (a buffer [tenants, N, K] per kind, as the weight store holds them): MKL's
  ``bmm`` (what ``run_gemm`` runs without the kernel) vs the kernel;
* ``rows``: one [8 x rows, 512] x [512, 2048] product per row count 1-64 (where MAX_ROWS comes
  from).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from itif.runtime import cpu_gemm  # noqa: E402

KINDS = [(1536, 512), (512, 512), (512, 512), (512, 512), (2048, 512), (512, 2048)]


def _time(fns: dict, repeats: int) -> dict:
    for f in fns.values():
        f()
    t = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in t.items()}


def _systems(x: torch.Tensor, w: torch.Tensor, T: int, R: int):
    segs = ([i * R for i in range(T)], [(i + 1) * R for i in range(T)], list(range(T)))
    out = torch.empty(T * R, w.shape[1])

    def mkl():
        torch.bmm(x.view(T, R, -1), w.transpose(1, 2), out=out.view(T, R, -1))

    def kernel():
        cpu_gemm.seg_gemm(x, w, *segs, out)

    return mkl, kernel, out


def run(a) -> dict:
    torch.set_num_threads(a.threads)
    if not cpu_gemm.ensure():
        raise SystemExit(f"the kernel is not available: {cpu_gemm.state['why_not']}")
    T, R = a.tenants, a.rows
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(T, N, K, generator=g) for N, K in KINDS] for _ in range(6)]
    xs = {K: torch.randn(T * R, K, generator=g) for K in (512, 2048)}
    pairs = [_systems(xs[w.shape[2]], w, T, R) for layer in layers for w in layer]
    err = 0.0
    for mkl, kernel, out in pairs[:6]:
        mkl()
        ref = out.clone()
        kernel()
        err = max(err, float(((out - ref).abs().max() / ref.abs().max())))
    secs = _time(
        {"mkl": lambda: [p[0]() for p in pairs], "kernel": lambda: [p[1]() for p in pairs]},
        a.repeats,
    )
    flop = 2 * T * R * 6 * sum(N * K for N, K in KINDS)
    rows = [dict(measure="step", system=k, tenants=T, rows=R, ms=round(s * 1e3, 2),
                 gflops=round(flop / s / 1e9, 1)) for k, s in secs.items()]
    for r in (1, 4, 8, 12, 16, 24, 32, 48, 64):
        w = torch.randn(8, 2048, 512, generator=g)
        mkl, kernel, _ = _systems(torch.randn(8 * r, 512, generator=g), w, 8, r)
        s = _time({"mkl": mkl, "kernel": kernel}, a.repeats)
        rows += [dict(measure="rows", system=k, tenants=8, rows=r, ms=round(v * 1e3, 3),
                      gflops=round(2 * 8 * r * 2048 * 512 / v / 1e9, 1)) for k, v in s.items()]
    return dict(meta=dict(device=f"cpu-{platform.machine()}-{torch.get_num_threads()}threads",
                          cpu_capability=torch.backends.cpu.get_cpu_capability(),
                          cpu_count=os.cpu_count(), load_average=list(os.getloadavg()),
                          date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          command="python " + " ".join(sys.argv), torch=torch.__version__,
                          kernel_build_s=cpu_gemm.state["build_s"], max_relative_error=err),
                rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16, help="rows per tenant in the step")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    res = run(a)
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    for r in res["rows"]:
        print(f"{r['measure']:5s} rows {r['rows']:3d} {r['system']:7s} {r['ms']:8.2f} ms "
              f"{r['gflops']:6.1f} GF/s")
    print("max relative error vs MKL:", res["meta"]["max_relative_error"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
