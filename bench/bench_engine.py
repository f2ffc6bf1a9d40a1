"""Fused engine vs the same engine tenant by tenant vs Hugging Face per tenant, same inputs.

    python bench/bench_engine.py --models bert-tiny bert-base --tenants 4 --requests 8

Every system runs the same tenants' weights on the same requests. Latency is the wall time to
answer the whole mixed batch (median of --repeats after a warm-up):

- ``itif``: one fused forward for all tenants (one row per strategy: ``itif:<strategy>``);
- ``itif_seq``: the same engine called once per tenant (the thesis' SEQ on our own kernels);
- ``hf``: one Hugging Face model per tenant, each tenant's requests as one padded batch
  (eager, attention mask), tenants one after another: what users run today.

Writes a JSON list of rows to --out (with device, versions, date) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itif  # noqa: E402
from itif.batching.report import sample_lengths  # noqa: E402
from itif.platform import device_name  # noqa: E402
from tests.oracle import make_hf_model  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def bench_model(preset: str, n_tenants: int, per_tenant: int, workload: str, repeats: int,
                strategies: list[str]) -> list[dict]:
    rng = np.random.default_rng(0)
    engine = itif.Engine(preset)
    spec = engine.spec
    models = {}
    for i in range(n_tenants):
        models[f"t{i}"] = make_hf_model(preset, 2, seed=i)
        engine.add_tenant(f"t{i}", models[f"t{i}"].state_dict())
    n = n_tenants * per_tenant
    if spec.is_text:
        lens = sample_lengths(workload, n, spec.max_position, rng)
        reqs = [itif.Request(f"t{i % n_tenants}", rng.integers(0, spec.vocab_size, L))
                for i, L in enumerate(lens)]
    else:
        px = rng.standard_normal((n, spec.num_channels, spec.image_size, spec.image_size))
        reqs = [itif.Request(f"t{i % n_tenants}", pixel_values=px[i].astype(np.float32))
                for i in range(n)]
    by_tenant = {t: [r for r in reqs if r.tenant == t] for t in models}

    def hf_inputs(rs):
        if not spec.is_text:
            return dict(pixel_values=torch.as_tensor(np.stack([r.pixel_values for r in rs])))
        L = max(len(r.input_ids) for r in rs)
        ids = torch.zeros(len(rs), L, dtype=torch.long)
        mask = torch.zeros(len(rs), L, dtype=torch.long)
        for j, r in enumerate(rs):
            ids[j, : len(r.input_ids)] = torch.as_tensor(r.input_ids)
            mask[j, : len(r.input_ids)] = 1
        return dict(input_ids=ids, attention_mask=mask)

    hf_in = {t: hf_inputs(rs) for t, rs in by_tenant.items()}

    @torch.inference_mode()
    def hf():
        for t, m in models.items():
            m(**hf_in[t])

    seq_len = int(np.mean([engine.request_tokens(r) for r in reqs]))
    base = dict(model=preset, tenants=n_tenants, requests_per_tenant=per_tenant, seq_len=seq_len,
                workload=workload if spec.is_text else "image")
    rows = []
    for s in strategies:
        ms = _median_ms(lambda: engine.infer(reqs, strategy=s), repeats)
        rows.append(dict(base, system=f"itif:{s}", latency_ms=round(ms, 3)))
    default = engine.strategy
    ms = _median_ms(lambda: [engine.infer(rs, strategy=default) for rs in by_tenant.values()], repeats)
    rows.append(dict(base, system="itif_seq", latency_ms=round(ms, 3)))
    rows.append(dict(base, system="hf", latency_ms=round(_median_ms(hf, repeats), 3)))
    fused = rows[strategies.index(default)]["latency_ms"] if default in strategies else rows[0]["latency_ms"]
    for r in rows:
        r["throughput_rps"] = round(n / r["latency_ms"] * 1e3, 2)
        r["speedup_vs_hf"] = round(rows[-1]["latency_ms"] / r["latency_ms"], 3)
        r["fused_speedup"] = round(r["latency_ms"] / fused, 3)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert-tiny", "bert-base"])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--requests", type=int, default=8, help="requests per tenant")
    p.add_argument("--workload", default="uniform:2-100")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--strategies", nargs="+", default=["packed", "itif_two_stage", "pad_to_max"])
    p.add_argument("--out", default="bench/results/engine_cpu.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for m in args.models:
        rows += bench_model(m, args.tenants, args.requests, args.workload, args.repeats,
                            args.strategies)
    meta = dict(device=device_name(torch.device("cpu")), torch=torch.__version__,
                itif=itif.__version__, python=platform.python_version(),
                date=datetime.date.today().isoformat(), command=" ".join(sys.argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"{'model':12s} {'system':22s} {'latency ms':>11s} {'req/s':>8s} {'vs hf':>6s} {'/fused':>7s}")
    for r in rows:
        print(f"{r['model']:12s} {r['system']:22s} {r['latency_ms']:11.1f} {r['throughput_rps']:8.1f}"
              f" {r['speedup_vs_hf']:6.2f} {r['fused_speedup']:7.2f}")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
