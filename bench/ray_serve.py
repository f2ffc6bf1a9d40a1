"""The Ray Serve fleet (itif.serve_ray) on this machine: throughput of 2 replicas against 1, and
what Serve's path adds to a request, in one run.

    python bench/ray_serve.py --out bench/results/ray-serve-2026-11-23.json

Tenants: ``--tenants`` random ``BertForSequenceClassification`` fine-tunes of ``--backbone``,
committed to the shared blob store by a plain daemon (the single writer) before the fleet starts.
Requests: KServe v2 JSON inference of ``--tokens`` token ids, tenants drawn uniformly.

1. In-process (no Ray), one request at a time (median of ``--latency-calls``): ``engine`` is
   ``Engine.infer`` of one request; ``http_app`` is the same request through the Starlette app a
   replica serves (auth, JSON, admission, itif's scheduler), called in-process on a daemon.
2. The fleet (Ray with ``--ray-cpus`` CPUs, no dashboard, the replicas' torch on
   ``--torch-threads`` threads), with 1 replica, then redeployed with 2: one request at a time
   over HTTP (proxy -> router -> replica; median), then ``--concurrency`` clients in one asyncio
   loop for ``--seconds`` (closed loop: requests per second, p50/p99 latency, errors).

``routing_overhead_ms`` = the fleet's sequential median - ``http_app``'s: what Serve's proxy,
the router deployment and the two actor calls add (plus the client's HTTP). The client runs on
the same cores as the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workspace(root: Path, backbone: str, n: int) -> tuple[Path, dict[str, str]]:
    """tenants.yaml with ``n`` tenants and their weights committed to its data_dir."""
    import torch
    import transformers as T

    import itif
    from itif.config import hash_token, load_config
    from itif.daemon import Daemon, Identity
    from itif.safetensors_io import save_safetensors, sha256_file

    spec = itif.load_spec(backbone)
    tokens = {f"b{i}": f"b{i}-token" for i in range(n)}
    lines = ["server:", "  listen: 127.0.0.1:0", f"  data_dir: {root / 'data'}",
             f"  admin_token_sha256: {hash_token('admin')}", "backbone:",
             f"  config: {backbone}", "  device: cpu", "  dtype: float32",
             "scheduler:", "  max_wait_ms: 2", "tenants:"]
    for t, tok in tokens.items():
        lines += [f"  - id: {t}", f"    token_sha256: {hash_token(tok)}", "    max_queue: 4096"]
    config = root / "tenants.yaml"
    config.write_text("\n".join(lines) + "\n")
    d = Daemon(load_config(config))
    d.start()
    try:
        for i, t in enumerate(tokens):
            torch.manual_seed(i)
            m = T.BertForSequenceClassification(T.BertConfig(**spec.hf_config(num_labels=3)))
            path = root / f"{t}.safetensors"
            save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, path)
            data = path.read_bytes()
            d.upload(Identity(None, admin=True), t, sha256_file(path), len(data), [data])
    finally:
        d.stop(0)
    return config, tokens


def _body(ids: list[int]) -> dict:
    return {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)],
                        "data": ids}]}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _in_process(config: Path, tokens: dict[str, str], args) -> dict:
    """Median ms of one request: Engine.infer, and the HTTP app on a daemon, in-process."""
    import itif
    from itif.config import load_config
    from itif.serve_ray import FleetDaemon, call_asgi
    from itif.server.http import build_app

    cfg = load_config(config)
    d = FleetDaemon(cfg)
    d.start()
    for t in tokens:
        d.hold(t)
    app = build_app(d, max_body=cfg.server.max_message_bytes)
    rng = random.Random(1)
    vocab = d.engine.spec.vocab_size
    names = list(tokens)

    for i in range(20):  # warm-up (first-call costs, allocator), not counted
        d.engine.infer([itif.Request(names[i % len(names)], input_ids=_ids(rng, args.tokens,
                                                                         vocab))])
    eng = []
    for _ in range(args.latency_calls):
        t, ids = rng.choice(names), _ids(rng, args.tokens, vocab)
        t0 = time.perf_counter()
        d.engine.infer([itif.Request(t, input_ids=ids)])
        eng.append(time.perf_counter() - t0)

    async def http_app() -> list[float]:
        out = []
        for i in range(20 + args.latency_calls):  # the first 20: warm-up, not counted
            t, ids = rng.choice(names), _ids(rng, args.tokens, vocab)
            headers = [(b"authorization", f"Bearer {tokens[t]}".encode()),
                       (b"content-type", b"application/json")]
            body = json.dumps(_body(ids)).encode()
            t0 = time.perf_counter()
            status, _, _ = await call_asgi(app, "POST", f"/v2/models/{t}/infer", b"", headers,
                                           body, ("127.0.0.1", 1))
            if i >= 20:
                out.append(time.perf_counter() - t0)
            assert status == 200, status
        return out

    app_s = asyncio.run(http_app())
    d.stop(0)
    return {
        "engine_ms": 1e3 * statistics.median(eng),
        "http_app_ms": 1e3 * statistics.median(app_s),
        "vocab": vocab,
    }


async def _closed_loop(url: str, tokens: dict[str, str], args, vocab: int) -> dict:
    import httpx

    names = list(tokens)
    lat: list[float] = []
    errors = 0
    end = time.perf_counter() + args.seconds

    async def client(i: int, c: httpx.AsyncClient) -> None:
        nonlocal errors
        rng = random.Random(100 + i)
        while time.perf_counter() < end:
            t = rng.choice(names)
            t0 = time.perf_counter()
            r = await c.post(f"/v2/models/{t}/infer", json=_body(_ids(rng, args.tokens, vocab)),
                             headers={"authorization": f"Bearer {tokens[t]}"})
            if r.status_code == 200:
                lat.append(time.perf_counter() - t0)
            else:
                errors += 1

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, c) for i in range(args.concurrency)))
        wall = time.perf_counter() - t0
    a = np.asarray(lat) * 1e3
    return {"requests": len(lat), "errors": errors, "seconds": wall,
            "requests_per_s": len(lat) / wall,
            "p50_ms": float(np.percentile(a, 50)) if len(a) else None,
            "p99_ms": float(np.percentile(a, 99)) if len(a) else None}


def _fleet(config: Path, tokens: dict[str, str], args, vocab: int) -> dict:
    import httpx
    import ray
    from ray import serve

    from itif.serve_ray import build

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             logging_level="warning")
    out = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in (1, 2):
            serve.run(build(config, num_replicas=n, torch_threads=args.torch_threads),
                      name="itif", route_prefix="/")
            rng = random.Random(n)
            seq = []
            with httpx.Client(base_url=url, timeout=120) as c:
                for t in tokens:  # place every tenant, one at a time
                    r = c.post(f"/v2/models/{t}/infer", json=_body([5, 6, 7]),
                               headers={"authorization": f"Bearer {tokens[t]}"})
                    assert r.status_code == 200, r.text
                    time.sleep(0.5)
                replicas = set()
                for i in range(20 + args.latency_calls):  # the first 20: warm-up
                    t = rng.choice(list(tokens))
                    t0 = time.perf_counter()
                    r = c.post(f"/v2/models/{t}/infer", json=_body(_ids(rng, args.tokens, vocab)),
                               headers={"authorization": f"Bearer {tokens[t]}"})
                    if i >= 20:
                        seq.append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
                    replicas.add(r.headers["itif-replica"])
            load = asyncio.run(_closed_loop(url, tokens, args, vocab))
            out[f"replicas_{n}"] = {"sequential_ms": 1e3 * statistics.median(seq),
                                    "replicas_answering": len(replicas), **load}
            print(f"{n} replica(s): {json.dumps(out[f'replicas_{n}'])}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--backbone", default="bert-tiny", help="preset or config.json (bert)")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16, help="token ids per request")
    p.add_argument("--seconds", type=float, default=20.0, help="closed-loop time per fleet size")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    p.add_argument("--latency-calls", type=int, default=200, help="sequential calls per median")
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        config, tokens = _workspace(Path(tmp), args.backbone, args.tenants)
        local = _in_process(config, tokens, args)
        fleet = _fleet(config, tokens, args, local["vocab"])
    one, two = fleet["replicas_1"], fleet["replicas_2"]
    result = {
        "bench": "ray-serve", "date": date.today().isoformat(),
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "device": f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        "backbone": args.backbone, "tenants": args.tenants, "tokens_per_request": args.tokens,
        "concurrency": args.concurrency, "seconds": args.seconds, "ray_cpus": args.ray_cpus,
        "torch_threads_per_replica": args.torch_threads,
        "in_process": {k: v for k, v in local.items() if k != "vocab"},
        "fleet": fleet,
        "throughput_2_vs_1": two["requests_per_s"] / one["requests_per_s"],
        "routing_overhead_ms": {f"replicas_{n}": fleet[f"replicas_{n}"]["sequential_ms"]
                                - local["http_app_ms"] for n in (1, 2)},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("in_process", "throughput_2_vs_1",
                                             "routing_overhead_ms")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
