"""Saturating burst through a real ``itif serve``: the serve sweep's daemon and load generator,
one burst of calls sent at once, answered calls per second and the daemon's CPU time.

    python bench/serve_burst.py --calls 4000 [--isolate] [--server max_active_calls=32]

16 tenants of ``--model`` (bert-tiny), the serve mix ``uniform:2-100+zipf:1.2``, fused batching
(``--isolate``: per-tenant-only). A quick check of what a server setting costs at saturation
(docs/reliability.md: the fair gate's price); the full sweep is ``itif bench --suites serve``.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from itif.backbones.spec import load_spec  # noqa: E402
from itif.bench.serving import LoadGen, ServeDaemon, free_ports  # noqa: E402
from itif.bench.tenants import tenant_weights, to_hf  # noqa: E402
from itif.bench.workloads import parse_mix  # noqa: E402
from itif.safetensors_io import save_safetensors  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--isolate", action="store_true", help="per-tenant-only batching")
    ap.add_argument("--server", action="append", default=[], metavar="KEY=VALUE",
                    help="one more server: setting (repeatable)")
    a = ap.parse_args(argv)
    spec = load_spec(a.model)
    names = [f"t{i}" for i in range(a.tenants)]
    tokens = {t: secrets.token_urlsafe(12) for t in names}
    extra = tuple(tuple(kv.split("=", 1)) for kv in a.server)
    with tempfile.TemporaryDirectory(prefix="itif-burst-") as tmp:
        tmp = Path(tmp)
        files = {}
        for i, t in enumerate(names):
            files[t] = tmp / f"{t}.safetensors"
            save_safetensors(to_hf(spec, tenant_weights(spec, i, "full")), files[t])
        d = ServeDaemon(tmp / "d", free_ports(1)[0], a.model, "cpu", "float32", tokens,
                        "packed", a.isolate, 5.0, server_extra=extra)
        d.start()
        try:
            d.wait_ready()
            d.upload(files)
            g = LoadGen(d.addr, tokens, spec)
            rng = np.random.default_rng(0)
            mix = parse_mix("uniform:2-100+zipf:1.2")
            warm = g.requests(mix, 300, rng)
            g.send(np.zeros(len(warm)), warm, 60, 60)
            reqs = g.requests(mix, a.calls, rng)
            c0, t0 = d.cpu_seconds(), time.perf_counter()
            res = g.send(np.zeros(a.calls), reqs, 120, 120)
            wall, cpu = time.perf_counter() - t0, d.cpu_seconds() - c0
            g.close()
        finally:
            d.stop()
    print(json.dumps(dict(model=a.model, tenants=a.tenants, calls=a.calls, isolate=a.isolate,
                          server=dict(extra), throughput_rps=res["throughput_rps"],
                          completed=res["completed"], errors=res["errors"],
                          wall_s=round(wall, 2), daemon_cpu_s=round(cpu, 2),
                          load_average=list(os.getloadavg()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
