"""What one unary Infer call costs a Python gRPC server before itif does anything: a bare server
of itif's own service (the same protobufs, a handler that returns a fixed 2-logit reply) under
an open-loop load, and the server process's CPU time per request.

    python bench/grpc_floor.py [--server aio sync] [--rates 700 1400] [--seconds 4]
        [--out OUT.json]

``aio``: ``grpc.aio`` on one asyncio thread, as ``itif serve`` runs; ``sync``: ``grpc.server``
with a 16-thread pool. Either way the calls are handled in one interpreter, so this CPU time is
mostly time holding the GIL: the floor under the daemon's front end, which its forward thread
competes with (docs/gpu.md, "A third session"). The load generator runs in this process, on the
same machine. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from itif.bench.daemon_probe import process_cpu_seconds  # noqa: E402
from itif.bench.serving import free_ports  # noqa: E402
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc  # noqa: E402

SERVER = r"""
import asyncio, sys
from concurrent import futures
import grpc
import numpy as np
sys.path.insert(0, sys.argv[3])
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc

REPLY = itif_pb2.InferResponse(
    outputs=[itif_pb2.Tensor(name="logits", shape=[2], data=np.zeros(2, "<f4").tobytes())],
    weights_sha256="0" * 64)

class Aio(itif_pb2_grpc.ItifServicer):
    async def Infer(self, request, context):
        return REPLY

class Sync(itif_pb2_grpc.ItifServicer):
    def Infer(self, request, context):
        return REPLY

async def aio(addr):
    server = grpc.aio.server()
    itif_pb2_grpc.add_ItifServicer_to_server(Aio(), server)
    server.add_insecure_port(addr)
    await server.start()
    await server.wait_for_termination()

if sys.argv[1] == "aio":
    asyncio.run(aio(sys.argv[2]))
else:
    server = grpc.server(futures.ThreadPoolExecutor(16))
    itif_pb2_grpc.add_ItifServicer_to_server(Sync(), server)
    server.add_insecure_port(sys.argv[2])
    server.start()
    server.wait_for_termination()
"""


def measure(kind: str, rates: list[float], seconds: float, seed: int = 0) -> list[dict]:
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, kind, addr, str(ROOT)])
    rows = []
    try:
        channel = grpc.insecure_channel(addr)
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = itif_pb2_grpc.ItifStub(channel)
        rng = np.random.default_rng(seed)
        msgs = [itif_pb2.InferRequest(tenant="t0", input=itif_pb2.InferInput(
            input_ids=itif_pb2.TokenIds(ids=rng.integers(0, 30000, int(n)).tolist())))
            for n in rng.integers(2, 101, 256)]
        meta = (("authorization", "Bearer x"),)
        stub.Infer(msgs[0], metadata=meta, timeout=30)  # connection and first-call costs
        for rate in rates:
            n = max(1, int(rate * seconds))
            cpu0, t0 = process_cpu_seconds(proc.pid), time.perf_counter()
            futs = []
            for i in range(n):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futs.append(stub.Infer.future(msgs[i % len(msgs)], metadata=meta, timeout=60))
            for f in futs:
                f.result()
            wall = time.perf_counter() - t0
            cpu = process_cpu_seconds(proc.pid) - cpu0
            rows.append(dict(server=kind, rate_rps=rate, requests=n,
                             achieved_rps=round(n / wall, 1),
                             server_cpu_cores=round(cpu / wall, 3),
                             server_cpu_ms_per_request=round(1e3 * cpu / n, 4)))
            print(json.dumps(rows[-1]), flush=True)
        channel.close()
    finally:
        proc.kill()
        proc.wait()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", nargs="+", choices=("aio", "sync"), default=["aio", "sync"])
    ap.add_argument("--rates", nargs="+", type=float, default=[700.0, 1400.0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if process_cpu_seconds(os.getpid()) is None:
        print("grpc_floor: needs Linux /proc to read the server's CPU time", file=sys.stderr)
        return 2
    rows = [r for kind in args.server for r in measure(kind, args.rates, args.seconds)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(cpu=os.cpu_count(), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
