"""What the daemon adds to generation: the same greedy requests through the itif.v1 Generate
stream (in-process daemon, real servicer, auth and admission, one gRPC client thread per call)
and through ``GenEngine.generate`` of the daemon's own engine.

    python bench/generate_daemon.py --tenants 4 --requests 4 --new-tokens 32

Prints one JSON object: tokens/s both ways, and through the daemon the time to first token and
the gap between token messages (p50, p90, in ms). Random-initialised GPT-2 tenants on a tiny
backbone (hidden 32, 2 layers, vocabulary 96): the figures are the serving path's overhead,
not a model's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
import transformers

from itif.client import Client
from itif.config import hash_token, parse_config
from itif.daemon import Daemon, Identity
from itif.generation.api import GenerateRequest
from itif.generation.spec import PRESETS
from itif.safetensors_io import save_safetensors
from itif.server._proto.itif.v1 import itif_pb2_grpc
from itif.server.admission import Admission
from itif.server.service import AuthInterceptor, ItifService


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="per tenant, all at once")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    a = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="itif-gen-bench-"))
    cfg = PRESETS["gpt2-tiny"].hf_config()
    cfg.update(n_positions=512, eos_token_id=2, bos_token_id=1)
    (root / "bb").mkdir()
    (root / "bb" / "config.json").write_text(json.dumps(cfg))
    tenants = {f"t{i}": f"token-{i}" for i in range(a.tenants)}
    yaml = (
        "server:\n  listen: 127.0.0.1:0\n  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token('admin')}\nbackbone:\n  config: {root / 'bb'}\n"
        "  device: cpu\n  dtype: float32\ntenants:\n"
        + "".join(
            f"  - id: {t}\n    token_sha256: {hash_token(tok)}\n" for t, tok in tenants.items()
        )
    )
    d = Daemon(parse_config(yaml, root))
    d.start()
    for i, t in enumerate(tenants):
        torch.manual_seed(i)
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))
        path = root / f"{t}.safetensors"
        save_safetensors({k: v.detach().clone().contiguous() for k, v in m.state_dict().items()},
                         path)
        data = path.read_bytes()
        d.upload(Identity(None, admin=True), t, hashlib.sha256(data).hexdigest(), len(data), [data])
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start():
        srv = grpc.aio.server(interceptors=[AuthInterceptor(d, Admission(d))])
        itif_pb2_grpc.add_ItifServicer_to_server(ItifService(d), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        return srv, port

    srv, port = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    reqs = [(t, [(7 * i + 3 * j) % 90 + 3 for j in range(a.prompt)])
            for i, t in enumerate(t for t in tenants for _ in range(a.requests))]
    # no end token: every request makes exactly --new-tokens tokens
    kw = dict(max_new_tokens=a.new_tokens, eos_token_id=95)
    ttft, gaps, made = [], [], []
    lock = threading.Lock()

    def call(tenant: str, ids: list[int]) -> None:
        with Client(f"127.0.0.1:{port}", tenants[tenant]) as c:
            t0 = last = time.perf_counter()
            first, mine, n = None, [], 0
            for msg in c.generate_stream(tenant, ids, timeout=600, **kw):
                now = time.perf_counter()
                if msg.WhichOneof("event") == "tokens":
                    if first is None:
                        first = now - t0
                    else:
                        mine.append(now - last)
                    last = now
                else:
                    n = sum(len(s.ids) for s in msg.result.sequences)
            with lock:
                ttft.append(first)
                gaps.extend(mine)
                made.append(n)

    d.generator.generate([GenerateRequest(t, ids, max_new_tokens=2) for t, ids in reqs])  # warm
    t0 = time.perf_counter()
    threads = [threading.Thread(target=call, args=r) for r in reqs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    daemon_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    direct = d.generator.generate([GenerateRequest(t, ids, **kw) for t, ids in reqs])
    engine_s = time.perf_counter() - t0
    asyncio.run_coroutine_threadsafe(srv.stop(None), loop).result(60)
    d.stop(0)
    engine_tokens = sum(len(s) for g in direct for s in g.sequences)
    print(json.dumps({
        "tenants": a.tenants, "requests": len(reqs), "new_tokens": a.new_tokens,
        "prompt": a.prompt, "torch_threads": torch.get_num_threads(),
        "daemon_tokens_per_s": round(sum(made) / daemon_s, 1),
        "engine_tokens_per_s": round(engine_tokens / engine_s, 1),
        "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p90": _pct(ttft, 0.9),
        "inter_token_ms_p50": _pct(gaps, 0.5), "inter_token_ms_p90": _pct(gaps, 0.9),
        "inter_token_ms_mean": round(1000 * statistics.fmean(gaps), 3) if gaps else None,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
