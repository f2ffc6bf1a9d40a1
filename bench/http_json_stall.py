"""What one tenant's large HTTP JSON requests cost another tenant's gRPC calls: a daemon with
``server.http_json_processes`` 0 (JSON parsed and written in a thread of the daemon: ``json``
holds the GIL) and N (in worker processes, ``itif.server.json_procs``), side by side.

    python bench/http_json_stall.py [--processes 0 2] [--seconds 6] [--senders 2]
        [--loop-gap-mib 0] [--out OUT.json]

The backbone is a ViT of 224x224 images with a tiny encoder (hidden 64, 2 layers), so the forward
is cheap and the request is realistic: tenant ``img`` posts one image as KServe JSON numbers (3
MB) from ``--senders`` threads, back to back, and asks for ``last_hidden_state`` as JSON (197 x
64 numbers); tenant ``probe`` sends one small gRPC Infer (the same image, raw float32) every
20 ms. Reported per daemon: the probe's latency alone, under the JSON load and under the same
load with the image as binary data (the floor: no JSON numbers), p50, p99 and max; the requests
answered per second, and the daemon's CPU seconds (its own and its children's) per request. The
ratios compare each daemon's JSON load with the first's. With ``--loop-gap-mib N``, also one
body of N MiB of token ids, parsed by a worker process and by a thread, with the event loop's
longest stall meanwhile: a KServe request and an OpenAI embeddings one. Needs no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from itif.backbones.spec import load_spec  # noqa: E402
from itif.bench.meta import _cpu_model  # noqa: E402
from itif.bench.serving import ServeDaemon, free_ports, write_checkpoints  # noqa: E402
from itif.client import Client  # noqa: E402
from itif.server.json_procs import JsonProcs, load_embeddings, load_infer  # noqa: E402

VIT = {"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "intermediate_size": 128, "image_size": 224, "patch_size": 16, "num_channels": 3}
PROBE_EVERY_S = 0.02


def _pct(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"n": int(a.size), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2)}


def _probe(d: ServeDaemon, image: np.ndarray, stop: threading.Event) -> list[float]:
    """Latencies (ms) of one gRPC Infer every PROBE_EVERY_S until ``stop``."""
    out = []
    with Client(d.addr, d.tokens["probe"]) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.infer("probe", pixel_values=image[0])
            out.append((time.perf_counter() - t) * 1e3)
            stop.wait(max(0.0, PROBE_EVERY_S - (time.perf_counter() - t)))
    return out


def _send(url: str, headers: dict, body: bytes, stop: threading.Event, done: list) -> None:
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            r = c.post(url, content=body, headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"request answered {r.status_code}: {r.text[:200]}")
            done.append(time.perf_counter())


def _phase(d: ServeDaemon, image: np.ndarray, seconds: float, senders: int, body: bytes | None,
           url: str, headers: dict | None = None) -> dict:
    stop, done = threading.Event(), []
    probes: list[list[float]] = [[]]
    probe = threading.Thread(target=lambda: probes.__setitem__(0, _probe(d, image, stop)))
    headers = {"authorization": f"Bearer {d.tokens['img']}", **(headers or {})}
    threads = [threading.Thread(target=_send, args=(url, headers, body, stop, done))
               for _ in range(senders if body is not None else 0)]
    cpu0, kids0 = d.cpu_seconds() or 0.0, d.children_cpu_seconds() or 0.0
    start = time.perf_counter()
    for t in [probe, *threads]:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in [probe, *threads]:
        t.join()
    wall = time.perf_counter() - start
    cpu, kids = (d.cpu_seconds() or 0.0) - cpu0, (d.children_cpu_seconds() or 0.0) - kids0
    row = {"probe": _pct(probes[0]), "seconds": round(wall, 2)}
    if body is not None:
        row.update(requests=len(done), per_s=round(len(done) / wall, 2),
                   daemon_cpu_s_per_request=round(cpu / max(len(done), 1), 4),
                   workers_cpu_s_per_request=round(kids / max(len(done), 1), 4))
    return row


async def _largest_gap(procs: JsonProcs, load, body: bytes) -> tuple[float, float]:
    """(seconds ``procs`` took to parse ``body`` with ``load``, the longest the event loop went
    without running a 2 ms timer meanwhile)."""
    gaps, done = [0.0], asyncio.Event()

    async def tick():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    start = time.perf_counter()
    await procs.run(load, body, "the request body")
    took = time.perf_counter() - start
    done.set()
    await ticker
    return took, max(gaps)


def loop_gaps(mib: float) -> list[dict]:
    """One body of about ``mib`` MiB of token ids parsed by one worker process and by a thread,
    as the routes parse them, with the event loop's longest stall: a KServe request and an
    OpenAI embeddings request (each comes back with its ids in one array)."""
    ids = np.random.default_rng(0).integers(1000, 30000, int(mib * 2**20 / 6.5) // 100 * 100)
    bodies = {
        "kserve": (load_infer, json.dumps({"inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [ids.size // 100, 100],
             "data": ids.tolist()}]}).encode()),
        "openai": (load_embeddings, json.dumps({"model": "m",
                                          "input": ids.reshape(-1, 100).tolist()}).encode())}

    async def measure():
        rows, worker = [], JsonProcs(1)
        try:
            await worker.run(int)  # started
            for kind, (load, body) in bodies.items():
                for procs in (worker, JsonProcs(0)):
                    took, gap = await _largest_gap(procs, load, body)
                    rows.append({"body": kind, "mib": round(len(body) / 2**20, 1),
                                 "http_json_processes": procs.processes,
                                 "parse_s": round(took, 3), "largest_loop_gap_ms":
                                 round(gap * 1e3, 1)})
        finally:
            worker.close()
        return rows

    return asyncio.run(measure())


def run(processes: list[int], seconds: float, senders: int) -> dict:
    rng = np.random.default_rng(0)
    image = rng.random((1, 3, 224, 224), np.float32)
    tensor = {"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 224, 224]}
    body = json.dumps({"inputs": [{**tensor, "data": image.ravel().tolist()}],
                       "outputs": [{"name": "last_hidden_state"}]}).encode()
    # the same request with the image as binary data (the floor: no JSON numbers to parse)
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": image.nbytes}}],
                       "outputs": [{"name": "last_hidden_state"}]}).encode()
    binary = head + image.tobytes()
    rows = []
    with tempfile.TemporaryDirectory(prefix="itif-bench-json-") as tmp:
        tmp = Path(tmp)
        (tmp / "vit").mkdir()
        (tmp / "vit" / "config.json").write_text(json.dumps(VIT))
        spec = load_spec(tmp / "vit")
        tokens = {"img": "img-token-0123", "probe": "probe-token-0123"}
        files = write_checkpoints(spec, list(tokens), tmp)
        for n in processes:
            grpc_port, http_port = free_ports(2)
            d = ServeDaemon(tmp / f"d{n}", grpc_port, str(tmp / "vit"), "cpu", "float32", tokens,
                            "packed", False, 2.0,
                            server_extra=(("http_listen", f"127.0.0.1:{http_port}"),
                                          ("http_json_processes", n),
                                          # the daemon's child processes: its JSON workers only
                                          ("ingress_processes", 0)))
            d.start()
            try:
                d.wait_ready()
                d.upload(files)
                url = f"http://127.0.0.1:{http_port}/v2/models/img/infer"
                _phase(d, image, 1.0, senders, body, url)  # warm: workers, kernels, graphs
                alone = _phase(d, image, seconds, senders, None, url)
                loaded = _phase(d, image, seconds, senders, body, url)
                floor = _phase(d, image, seconds, senders, binary, url,
                               {"inference-header-content-length": str(len(head))})
            finally:
                d.stop()
            rows.append({"http_json_processes": n, "alone": alone, "loaded": loaded,
                         "loaded_binary": floor})
            logging.info("http_json_processes %d: %s", n, rows[-1])
    first = rows[0]["loaded"]
    for r in rows:
        lo = r["loaded"]
        r["vs_first"] = {
            "probe_p99": round(first["probe"]["p99_ms"] / lo["probe"]["p99_ms"], 2),
            "probe_max": round(first["probe"]["max_ms"] / lo["probe"]["max_ms"], 2),
            "per_s": round(lo["per_s"] / first["per_s"], 2)}
    return {"bench": "http_json_stall", "body_bytes": len(body), "senders": senders,
            "probe_every_ms": PROBE_EVERY_S * 1e3, "backbone": VIT, "rows": rows,
            "meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
                     "cpu": _cpu_model(), "cpu_count": os.cpu_count()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, nargs="+", default=[0, 2])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--loop-gap-mib", type=float, default=0.0,
                   help="also parse one body of this many MiB in a worker and in a thread and "
                        "record the event loop's longest stall (0: not)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run(args.processes, args.seconds, args.senders)
    if args.loop_gap_mib:
        result["loop_gaps"] = loop_gaps(args.loop_gap_mib)
        for r in result["loop_gaps"]:
            print(f"{r['body']} body of {r['mib']} MiB, http_json_processes "
                  f"{r['http_json_processes']}: parsed in {r['parse_s']} s, the event loop "
                  f"stalled {r['largest_loop_gap_ms']} ms at most")
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for r in result["rows"]:
        lo, al, fl = r["loaded"], r["alone"], r["loaded_binary"]
        print(f"http_json_processes {r['http_json_processes']}: probe p99 alone "
              f"{al['probe']['p99_ms']} ms, under JSON load {lo['probe']['p99_ms']} ms (max "
              f"{lo['probe']['max_ms']}), under binary load {fl['probe']['p99_ms']} ms; "
              f"JSON {lo['per_s']} req/s (binary {fl['per_s']}); daemon CPU a JSON request "
              f"{lo['daemon_cpu_s_per_request'] * 1e3:.1f} ms (+ workers "
              f"{lo['workers_cpu_s_per_request'] * 1e3:.1f}; binary "
              f"{fl['daemon_cpu_s_per_request'] * 1e3:.1f}); vs the first: {r['vs_first']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
