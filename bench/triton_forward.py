"""itif's Triton GEMM (bias and activation in its epilogue) against cuBLAS, in the whole forward.

    python bench/triton_forward.py [--models bert-base albert-large vit-base] [--tenants 4 32]
        [--repeats 20] [--dtype float16] [--out OUT/triton.json]

For each model and T (T full fine-tunes, one 128-token request each; ViT one image each) it
builds one fused engine holding the T tenants and T one-tenant engines, then times its systems
interleaved round-robin (``itif.bench.systems.measure``) and each back to back
(``measure_alone``): ``seq`` and ``itif`` (CUDA graphs on, planner ``packed``) with the GEMMs
of ``itif.runtime.gemm`` (cuBLAS) and again with ``ITIF_TRITON_GEMM=1``
(``itif.runtime.triton_gemm``) once per ``--max-bm`` (the largest tile: ``gemm`` is ``triton``
for 128 rows, ``triton_bm64`` for 64). The switches are read when a batch is prepared, so each
system sets them around its own runs and each batch structure gets its own graph. Reported per
row: the median latency; for itif ``speedup_vs_seq`` (seq with the same GEMM) and
``speedup_vs_best_seq`` (the fastest seq row: a GEMM that suits one 128-row tenant less must
not flatter the ratio); for the Triton rows ``max_abs_logit_diff_vs_cublas`` (the same
requests, the same engine; ``_vs_default`` on the CPU).

On the GPU only: without CUDA it exits with status 2 and says so, unless ``--allow-cpu``
(the tests: tiny presets under Triton's interpreter, ``TRITON_INTERPRET=1``; the times mean
nothing there).
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
from itif.backbones.spec import load_spec  # noqa: E402
from itif.bench.systems import Fused, Seq, System, measure, measure_alone  # noqa: E402
from itif.bench.tenants import tenant_weights  # noqa: E402
from itif.bench.workloads import TABLE_SEQ, Workload, make_requests, tenant_names  # noqa: E402
from itif.runtime import triton_gemm  # noqa: E402


class Switched(System):
    """``inner`` with ``ITIF_TRITON_GEMM`` (and ``ITIF_TRITON_MAX_BM``) set around each of its
    loads and runs: ``max_bm`` 0 is the default GEMMs, else the Triton GEMM with tiles of at
    most that many rows."""

    def __init__(self, inner: System, max_bm: int, default: str) -> None:
        self.inner, self.max_bm = inner, max_bm
        self.name = inner.name
        self.gemm = (default if not max_bm else "triton" if max_bm == triton_gemm.MAX_BM
                     else f"triton_bm{max_bm}")

    def _env(self) -> None:
        if self.max_bm:
            os.environ[triton_gemm.ENV] = "1"
            os.environ[triton_gemm.MAX_BM_ENV] = str(self.max_bm)
        else:
            os.environ.pop(triton_gemm.ENV, None)
            os.environ.pop(triton_gemm.MAX_BM_ENV, None)

    def load(self, requests):  # measure's untimed warm-up run compiles and captures
        self._env()
        self.inner.load(requests)

    def run(self):
        self._env()
        return self.inner.run()

    def logits(self):
        return self.inner.logits()


def run_group(model: str, T: int, dtype: str, device: str, repeats: int,
              max_bms: tuple[int, ...] = (triton_gemm.MAX_BM,)) -> list[dict]:
    spec = load_spec(model)
    names = tenant_names(T)
    weights = [tenant_weights(spec, i) for i in range(T)]
    fused = itif.Engine(spec, device=device, dtype=dtype, cuda_graphs="on")
    per = {}
    for i, t in enumerate(names):
        fused.add_tenant(t, weights[i])
        per[t] = itif.Engine(spec, device=device, dtype=dtype, cuda_graphs="on")
        per[t].add_tenant(t, weights[i])
    del weights
    graphs = True if device == "cuda" else None
    default = "cublas" if device == "cuda" else "default"  # the CPU's: MKL and itif's own
    systems = [Switched(s, bm, default) for bm in (0, *max_bms)
               for s in (Seq(per), Fused(fused, "packed", graphs=graphs))]
    reqs = make_requests(spec, Workload("table", model, T, 1, TABLE_SEQ))
    for s in systems:
        s.load(reqs)
    times = measure(systems, repeats)
    alone = measure_alone(systems, repeats)
    rows = []
    lat = {(s.name, s.gemm): float(np.median(times[id(s)])) for s in systems}
    for s in systems:
        row = dict(model=model, tenants=T, dtype=dtype, system=s.name, gemm=s.gemm,
                   latency_ms=round(lat[(s.name, s.gemm)], 4), **alone[id(s)])
        if s.name == "itif":
            row["speedup_vs_seq"] = round(lat[("seq", s.gemm)] / lat[(s.name, s.gemm)], 3)
            # seq may be slower with one GEMM than the other: the bar is the faster seq
            best_seq = min(v for (n, _), v in lat.items() if n == "seq")
            row["speedup_vs_best_seq"] = round(best_seq / lat[(s.name, s.gemm)], 3)
        if s.max_bm:
            base = next(o for o in systems if o.name == s.name and o.gemm == default)
            row[f"max_abs_logit_diff_vs_{default}"] = float(np.abs(
                s.logits().astype(np.float64) - base.logits()).max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["bert-base"])
    ap.add_argument("--tenants", nargs="+", type=int, default=[4, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default=None, help="float16 on CUDA, float32 on the CPU")
    ap.add_argument("--max-bm", nargs="+", type=int, default=None, choices=(16, 32, 64, 128),
                    help="the Triton GEMM's largest tiles, a pair of systems each (128 64 on "
                    "CUDA, 128 on the CPU); 64: twice the tiles at T = 4, each weight tile "
                    "read twice")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run on the CPU under Triton's interpreter (tests; times mean nothing)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("triton_forward.py: needs CUDA (torch.cuda.is_available() is False); "
              "--allow-cpu runs the plumbing under Triton's interpreter", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    dtype = args.dtype or ("float16" if cuda else "float32")
    if not triton_gemm.runnable(torch.device(device), getattr(torch, dtype)):
        print(f"triton_forward.py: the Triton GEMM cannot run here ({device}, {dtype}; Triton "
              f"installed: {triton_gemm.available()})", file=sys.stderr)
        return 2
    rows, errors = [], []
    t0 = time.time()
    for model in args.models:
        for T in args.tenants:
            try:
                rows += run_group(model, T, dtype, device, args.repeats, tuple(
                    args.max_bm or ((128, 64) if cuda else (128,))))
            except Exception as e:  # noqa: BLE001 - one group's failure keeps the others
                errors.append(dict(model=model, tenants=T, error=f"{type(e).__name__}: {e}"))
                print(f"{model} T={T}: {type(e).__name__}: {e}", file=sys.stderr)
            if cuda:
                torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name() if cuda else "cpu",
               torch=torch.__version__, seconds=round(time.time() - t0, 1), rows=rows,
               errors=errors)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 1 if errors or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
