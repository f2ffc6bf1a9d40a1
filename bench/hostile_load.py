"""Hostile-client load against a real ``itif serve`` (issue 15, items 3-6): measure, don't guess.

    python bench/hostile_load.py                       # every part, figures as JSON on stdout
    python bench/hostile_load.py --parts quiet,burst   # some parts
    python bench/hostile_load.py --burst 10000 --json bench/results/hostile-cpu.json
    python bench/hostile_load.py --profile prof.out    # the daemon's event loop under cProfile

One daemon (bert-tiny, CPU, tenants ``quiet`` and ``noisy``, default settings unless
``--server KEY=VALUE`` / ``--tenant KEY=VALUE`` say otherwise). The parts:

``quiet``  the quiet tenant sends a 16-token Infer every 50 ms: p50/p99 idle, then while another
           process keeps ``--inflight`` (256) calls of tenant noisy in flight (closed loop),
           and how many calls each got through.
``burst``  another process fires ``--burst`` simultaneous Infer calls of tenant noisy (one
           channel) while quiet keeps calling every 50 ms: both tenants' answers by status
           code, and ``itif_requests_total`` against what the clients saw.
``slow``   an HTTP/2 client (a raw socket: preface, HEADERS, DATA, and then it never reads)
           sends ``--slow-calls`` InferBatch calls whose replies are about 2 MiB each: the
           daemon's RSS before, while the replies are unread, and after the client is gone.
``fair``   issue 61's flood: quiet's p99 alone, ``--burst`` noisy calls alone (OK calls a
           second), then both: quiet's p99 under the flood over alone, noisy's throughput
           with quiet over alone.
``big``    an InferBatch whose reply is larger than ``server.max_message_bytes``: the code, the
           message, the metric's code and whether the daemon logged a traceback.

The helpers run as subcommands in their own processes (``flood``, ``burst``), so the load
generator never shares a GIL with the process that measures; ``tests/test_overload.py`` uses
them too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IDS16 = list(range(1, 17))


# ---- load generators (subcommands, each in its own process) ----------------------------------
def _infer_raw(tenant: str, ids=IDS16) -> bytes:
    from itif.server._proto.itif.v1 import itif_pb2 as pb  # noqa: PLC0415

    return pb.InferRequest(tenant=tenant, input=pb.InferInput(
        input_ids=pb.TokenIds(ids=list(ids)))).SerializeToString()


def flood_main(addr: str, token: str, tenant: str, inflight: int, folder: str) -> None:
    """Keep ``inflight`` Infer calls of ``tenant`` in flight (closed loop: each worker sends its
    next call when the last one is answered) while ``folder/on`` exists; the cumulative counts
    by status code go to ``folder/counts.json`` twice a second. Runs until killed."""
    import grpc  # noqa: PLC0415

    raw = _infer_raw(tenant)
    folder_p = Path(folder)
    md = (("authorization", f"Bearer {token}"),)
    counts: Counter = Counter()

    async def main() -> None:
        channel = grpc.aio.insecure_channel(addr)
        call = channel.unary_unary("/itif.v1.Itif/Infer")

        async def worker() -> None:
            while True:
                if not (folder_p / "on").exists():
                    await asyncio.sleep(0.02)
                    continue
                try:
                    await call(raw, metadata=md, timeout=30)
                    counts["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    counts[e.code().name] += 1
                    if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await asyncio.sleep(0)  # a refusal: straight back (hostile client)

        tasks = [asyncio.create_task(worker()) for _ in range(inflight)]
        while True:
            await asyncio.sleep(0.5)
            tmp = folder_p / "counts.tmp"
            tmp.write_text(json.dumps(dict(counts)))
            os.replace(tmp, folder_p / "counts.json")
            if any(t.done() for t in tasks):
                for t in tasks:
                    if t.done():
                        t.result()

    asyncio.run(main())


def burst_main(addr: str, token: str, tenant: str, n: int, out: str) -> None:
    """Fire ``n`` Infer calls of ``tenant`` at once on one channel (each started without waiting
    for any answer), wait for every answer; write the counts by status code, the time to the
    last answer and the slowest refusal to ``out`` (JSON)."""
    import grpc  # noqa: PLC0415

    raw = _infer_raw(tenant)
    channel = grpc.insecure_channel(addr)
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.unary_unary("/itif.v1.Itif/Infer")
    md = (("authorization", f"Bearer {token}"),)
    counts: Counter = Counter()
    refusal_ms: list[float] = []
    lock = threading.Lock()
    done = threading.Event()
    t0 = time.perf_counter()

    details: dict[str, str] = {}

    def finished(fut, start=None) -> None:
        try:
            fut.result()
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
            details.setdefault(code, e.details() or "")
        except grpc.FutureCancelledError:
            code = "CANCELLED"
        with lock:
            counts[code] += 1
            if code == "RESOURCE_EXHAUSTED":
                refusal_ms.append((time.perf_counter() - start) * 1e3)
            if sum(counts.values()) == n:
                done.set()

    for _ in range(n):
        start = time.perf_counter()
        call.future(raw, metadata=md, timeout=60).add_done_callback(
            lambda f, s=start: finished(f, s))
    sent_s = time.perf_counter() - t0
    done.wait(120)
    refusal_ms.sort()
    Path(out).write_text(json.dumps({
        "codes": dict(counts), "details": details, "sent_s": round(sent_s, 2),
        "all_answered_s": round(time.perf_counter() - t0, 2),
        "refusal_ms_p50_p99_max": [round(refusal_ms[int(q * (len(refusal_ms) - 1))], 1)
                                   for q in (0.5, 0.99, 1.0)] if refusal_ms else None}))
    channel.close()


# ---- a slow reader: HTTP/2 by hand, so that it can stop reading -------------------------------
def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """Literal header fields without indexing, new names, no Huffman (RFC 7541 6.2.2)."""
    out = b""
    for name, value in headers:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return out


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


class SlowReader:
    """An HTTP/2 connection that sends gRPC calls and then never reads: what the server sends
    beyond the 64 KiB of HTTP/2's initial flow-control window stays with the server."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
        self.sock.settimeout(0.3)
        try:  # the server's SETTINGS (read once; nothing is read after this)
            self.sock.recv(4096)
        except socket.timeout:
            pass
        self.sock.sendall(_frame(4, 1, 0, b""))  # SETTINGS ACK
        self.host, self.port, self.next_stream = host, port, 1

    def call(self, path: str, message: bytes, token: str) -> None:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", f"{self.host}:{self.port}"),
                   ("content-type", "application/grpc"), ("te", "trailers"),
                   ("authorization", f"Bearer {token}")]
        sid, self.next_stream = self.next_stream, self.next_stream + 2
        body = b"\x00" + struct.pack(">I", len(message)) + message
        frames = [_frame(1, 0x4, sid, _hpack(headers))]
        for i in range(0, len(body), 16384):  # the default SETTINGS_MAX_FRAME_SIZE
            last = i + 16384 >= len(body)
            frames.append(_frame(0, 0x1 if last else 0, sid, body[i:i + 16384]))
        self.sock.sendall(b"".join(frames))

    def close(self) -> None:
        self.sock.close()


def big_batch_raw(tenant: str, inputs: int, seq: int = 128) -> bytes:
    """InferBatch of ``inputs`` rows of ``seq`` tokens asking for last_hidden_state: a reply of
    about inputs x seq x hidden x 4 bytes (bert-tiny, hidden 64: 32 KiB per 128-token row)."""
    from itif.server._proto.itif.v1 import itif_pb2 as pb  # noqa: PLC0415

    ids = [(7 * i) % 997 + 1 for i in range(seq)]
    return pb.InferBatchRequest(
        tenant=tenant, outputs=["last_hidden_state"],
        inputs=[pb.InferInput(input_ids=pb.TokenIds(ids=ids)) for _ in range(inputs)],
    ).SerializeToString()


# ---- the daemon --------------------------------------------------------------------------------
def start_daemon(root: Path, server: dict, tenants: dict, profile: str | None = None):
    from tests.reliability_util import Daemon, make_tokens, upload_bytes, weights_bytes  # noqa

    tokens = make_tokens(["quiet", "noisy"])
    d = Daemon(root, dict(tokens), server_extra=dict(server),
               tenant_extra={t: dict(tenants) for t in tokens},
               scheduler={"max_wait_ms": 2})
    if profile:  # python -m cProfile -o PROFILE -m itif serve: the event loop's thread
        d.root.mkdir(parents=True, exist_ok=True)
        d.write_config()
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        d._log = open(d.root / "daemon.log", "a")  # noqa: SIM115
        d.proc = subprocess.Popen(
            [sys.executable, "-m", "cProfile", "-o", profile, "-m", "itif", "serve",
             "--config", str(d.config)], stdout=d._log, stderr=subprocess.STDOUT, cwd=d.root,
            env=env)
        d.wait_serving(120)
    else:
        d.start()
    for i, (tid, tok) in enumerate(tokens.items()):
        with d.client(tok) as c:
            upload_bytes(c, tid, weights_bytes(300 + i))
    return d, tokens


def helper(cmd: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), cmd,
                             *map(str, args)], cwd=ROOT, env=env)


def quiet_calls(c, seconds: float, period: float = 0.05, stop=None):
    """Quiet's 16-token Infer every ``period`` s for ``seconds`` (or until ``stop`` is set):
    (latencies of the OK calls in ms, counts by code)."""
    import grpc  # noqa: PLC0415

    lat, codes = [], Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        t0 = time.perf_counter()
        try:
            c.infer("quiet", IDS16, timeout=10)
            codes["OK"] += 1
            lat.append((time.perf_counter() - t0) * 1e3)
        except grpc.RpcError as e:
            codes[e.code().name] += 1
        time.sleep(max(0.0, period - (time.perf_counter() - t0)))
    return lat, codes


def flood_rounds(d, quiet_token: str, noisy_token: str, folder: Path, rounds: int = 3,
                 seconds: float = 2.5) -> list[dict]:
    """Rounds of an idle window and a flood window (tenant noisy keeps 256 Infer calls in
    flight from a ``flood`` helper process) of quiet's calls every 50 ms, on daemon ``d``
    (``tests.daemon_harness.Daemon``). Each round: quiet's p99 idle and flooded, and the
    flood's codes in the flooded window. Raises AssertionError when a quiet call is not OK or
    the flood did not run."""
    from tests.reliability_util import wait_until  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    p = helper("flood", d.addr, noisy_token, "noisy", 256, folder)
    out = []
    try:
        with d.client(quiet_token) as c:
            quiet_calls(c, 0.5)
            wait_until(lambda: (folder / "counts.json").exists(), 60, what="flood process up")
            for _ in range(rounds):
                idle, idle_codes = quiet_calls(c, seconds)
                (folder / "on").touch()
                time.sleep(0.7)
                c0 = Counter(json.loads((folder / "counts.json").read_text()))
                loaded, loaded_codes = quiet_calls(c, seconds)
                c1 = Counter(json.loads((folder / "counts.json").read_text()))
                (folder / "on").unlink()
                time.sleep(0.5)
                assert set(idle_codes) == {"OK"} and set(loaded_codes) == {"OK"}, (
                    idle_codes, loaded_codes)
                flood = c1 - c0
                assert sum(flood.values()) > 10 * len(loaded), flood  # the flood did run
                out.append({"idle p99": pct(idle, 99), "flood p99": pct(loaded, 99),
                            "flood codes": dict(flood)})
    finally:
        p.kill()
        p.wait()
    return out


def flood_ratio(rounds: list[dict], rel=None, label: str = "rounds") -> float:
    """The median over ``rounds`` (:func:`flood_rounds`) of p99 flooded / p99 idle; with
    ``rel`` (the reliability record's tally), the rounds and the ratio go into its notes."""
    import numpy as np  # noqa: PLC0415

    ratio = float(np.median([r["flood p99"] / r["idle p99"] for r in rounds]))
    if rel is not None:
        rel.inputs += sum(sum(r["flood codes"].values()) for r in rounds)
        rel.notes[label] = rounds
        rel.notes["p99 flood/idle, median of rounds"] = round(ratio, 2)
    return ratio


def pct(values, q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))], 1)


def requests_total(d, method: str = "Infer") -> dict:
    from tests.reliability_util import scrape  # noqa: PLC0415

    out: dict = {}
    for (name, labels), v in scrape(d.metrics_port).items():
        lab = dict(labels)
        if name == "itif_requests_total" and lab.get("method") == method:
            out.setdefault(lab["tenant"], Counter())[lab["code"]] += int(v)
    return out


def server_side(d) -> dict:
    """The daemon's own cumulative figures behind quiet's latency, from its /metrics: the sums
    and counts of quiet's rows' queue and compute time, of the batch sizes, and the process's
    CPU time."""
    from tests.reliability_util import metric, scrape  # noqa: PLC0415

    s = scrape(d.metrics_port)
    out = {f"{h}_{x}": metric(s, f"itif_{h}_seconds_{x}", tenant="quiet")
           for h in ("queue", "compute") for x in ("sum", "count")}
    out.update(batch_sum=metric(s, "itif_batch_size_sum"),
               batch_count=metric(s, "itif_batch_size_count"),
               cpu_s=metric(s, "process_cpu_seconds_total"))
    return out


def breakdown(before: dict, after: dict, lat: list, seconds: float) -> dict:
    """Where quiet's time went in one window (means, ms): waiting in its queue, in its batch
    (start to result), and the rest (gRPC, the event loop, the client); the mean batch size
    (all tenants) and the daemon's CPU use (cores) over the window."""
    d = {k: after[k] - before[k] for k in after}
    n = max(1.0, d["queue_count"])
    queue, compute = 1e3 * d["queue_sum"] / n, 1e3 * d["compute_sum"] / n
    mean = sum(lat) / len(lat) if lat else float("nan")
    return {"mean ms": round(mean, 2), "queue ms": round(queue, 2),
            "compute ms": round(compute, 2), "rest ms": round(mean - queue - compute, 2),
            "mean batch size": round(d["batch_sum"] / max(1.0, d["batch_count"]), 1),
            "daemon CPU cores": round(d["cpu_s"] / seconds, 2)}


def part_quiet(d, tokens, args, out: dict) -> None:
    with d.client(tokens["quiet"]) as c:
        quiet_calls(c, 1.0)  # warm-up
        s0, t0 = server_side(d), time.monotonic()
        idle, idle_codes = quiet_calls(c, args.seconds)
        idle_where = breakdown(s0, server_side(d), idle, time.monotonic() - t0)
        folder = Path(tempfile.mkdtemp(prefix="flood"))
        p = helper("flood", d.addr, tokens["noisy"], "noisy", args.inflight, folder)
        try:
            (folder / "on").touch()
            deadline = time.monotonic() + 60
            while not (folder / "counts.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
            c0 = Counter(json.loads((folder / "counts.json").read_text()))
            s0, t0 = server_side(d), time.monotonic()
            loaded, loaded_codes = quiet_calls(c, args.seconds)
            loaded_where = breakdown(s0, server_side(d), loaded, time.monotonic() - t0)
            c1 = Counter(json.loads((folder / "counts.json").read_text()))
        finally:
            p.kill()
            p.wait()
    noisy = c1 - c0
    out["quiet"] = {
        "idle p50/p99 ms": [pct(idle, 50), pct(idle, 99)], "idle codes": dict(idle_codes),
        f"flood({args.inflight} in flight) p50/p99 ms": [pct(loaded, 50), pct(loaded, 99)],
        "flood quiet codes": dict(loaded_codes),
        "p99 flood/idle": round(pct(loaded, 99) / pct(idle, 99), 2),
        "noisy codes during the window": dict(noisy),
        "noisy OK calls/s": round(noisy["OK"] / args.seconds, 1),
        "where quiet's time went, idle": idle_where,
        "where quiet's time went, flood": loaded_where}


def part_burst(d, tokens, args, out: dict) -> None:
    before = requests_total(d)
    result = Path(tempfile.mkdtemp(prefix="burst")) / "burst.json"
    stop = threading.Event()
    quiet: dict = {}
    with d.client(tokens["quiet"]) as c:
        quiet_calls(c, 0.5)
        before = requests_total(d)

        def run_quiet() -> None:
            quiet["lat"], quiet["codes"] = quiet_calls(c, 300, stop=stop)

        th = threading.Thread(target=run_quiet)
        p = helper("burst", d.addr, tokens["noisy"], "noisy", args.burst, result)
        th.start()
        p.wait()
        stop.set()
        th.join()
    time.sleep(0.5)
    after = requests_total(d)
    got = json.loads(result.read_text())
    delta = {t: dict(after.get(t, Counter()) - before.get(t, Counter()))
             for t in ("noisy", "quiet")}
    out["burst"] = {"calls": args.burst, "noisy client codes": got["codes"],
                    "noisy all answered s": got["all_answered_s"],
                    "noisy refusal ms p50/p99/max": got["refusal_ms_p50_p99_max"],
                    "quiet client codes": dict(quiet["codes"]),
                    "quiet p50/p99 ms": [pct(quiet["lat"], 50), pct(quiet["lat"], 99)],
                    "itif_requests_total Infer delta": delta}


def part_fair(d, tokens, args, out: dict) -> None:
    """Issue 61's flood: quiet's p99 alone; noisy's ``--burst`` calls alone (its OK calls a
    second); then both at once. Bars: quiet's p99 under the flood at most 2x alone, noisy at
    least half its throughput alone."""
    def burst(tag: str) -> tuple[subprocess.Popen, Path]:
        result = Path(tempfile.mkdtemp(prefix=f"fair-{tag}")) / "burst.json"
        p = helper("burst", d.addr, tokens["noisy"], "noisy", args.burst, result)
        return p, result

    with d.client(tokens["quiet"]) as c:
        quiet_calls(c, 1.0)  # warm-up
        idle, idle_codes = quiet_calls(c, args.seconds)
        p, result = burst("alone")
        p.wait()
        alone = json.loads(result.read_text())
        stop, quiet = threading.Event(), {}

        def run_quiet() -> None:
            quiet["lat"], quiet["codes"] = quiet_calls(c, 300, stop=stop)

        th = threading.Thread(target=run_quiet)
        th.start()
        time.sleep(0.5)
        p, result = burst("both")
        p.wait()
        stop.set()
        th.join()
        both = json.loads(result.read_text())

    def ok_per_s(b: dict) -> float:
        return round(b["codes"].get("OK", 0) / max(b["all_answered_s"], 1e-9), 1)

    out["fair"] = {
        "calls": args.burst,
        "quiet alone p50/p99 ms": [pct(idle, 50), pct(idle, 99)],
        "quiet alone codes": dict(idle_codes),
        "quiet under the flood p50/p99 ms": [pct(quiet["lat"], 50), pct(quiet["lat"], 99)],
        "quiet under the flood codes": dict(quiet["codes"]),
        "quiet p99 flood/alone": round(pct(quiet["lat"], 99) / pct(idle, 99), 2),
        "noisy alone": alone, "noisy with quiet": both,
        "noisy OK/s alone": ok_per_s(alone), "noisy OK/s with quiet": ok_per_s(both),
        "noisy throughput with quiet/alone": round(ok_per_s(both) / max(ok_per_s(alone), 1e-9),
                                                   2)}


def part_slow(d, tokens, args, out: dict) -> None:
    mib = 1 << 20
    raw = big_batch_raw("noisy", 64)  # 64 x 128 x 64 x 4 B = 2 MiB of last_hidden_state
    with d.client(tokens["noisy"]) as c:  # one read reply first: the allocator's steady state
        c.channel.unary_unary("/itif.v1.Itif/InferBatch")(raw, metadata=c.metadata, timeout=60)
    base = d.rss_bytes() / mib
    before = requests_total(d, "InferBatch")
    r = SlowReader("127.0.0.1", d.port)
    t0 = time.monotonic()
    for _ in range(args.slow_calls):
        r.call("/itif.v1.Itif/InferBatch", raw, tokens["noisy"])
    peak, last, stable_since = base, 0.0, time.monotonic()
    while time.monotonic() - t0 < args.slow_wait:  # until RSS stops growing for 3 s
        rss = d.rss_bytes() / mib
        peak = max(peak, rss)
        if abs(rss - last) > 2:
            last, stable_since = rss, time.monotonic()
        elif time.monotonic() - stable_since > 3:
            break
        time.sleep(0.25)
    held = d.rss_bytes() / mib
    # a quiet call still answers while the slow reader holds its replies
    with d.client(tokens["quiet"]) as c:
        t1 = time.perf_counter()
        c.infer("quiet", IDS16, timeout=30)
        quiet_ms = (time.perf_counter() - t1) * 1e3
    r.close()
    time.sleep(3.0)
    after_close = d.rss_bytes() / mib
    time.sleep(0.5)
    codes = requests_total(d, "InferBatch").get("noisy", Counter()) - before.get(
        "noisy", Counter())
    out["slow"] = {"calls": args.slow_calls, "reply MiB each": 2.0,
                   "daemon RSS MiB before/held/peak/after close": [
                       round(base), round(held), round(peak), round(after_close)],
                   "quiet call while held ms": round(quiet_ms, 1),
                   "itif_requests_total InferBatch codes": dict(codes)}


def part_big(d, tokens, args, out: dict) -> None:
    import grpc  # noqa: PLC0415

    limit = d.server_extra.get("max_message_bytes")
    rows = 48  # 48 x 32 KiB = 1.5 MiB of reply, over a 1 MiB max_message_bytes
    raw = big_batch_raw("noisy", rows)
    before = requests_total(d, "InferBatch")
    log0 = len(d.logs())
    with d.client(tokens["noisy"]) as c:
        try:
            c.channel.unary_unary("/itif.v1.Itif/InferBatch")(raw, metadata=c.metadata,
                                                              timeout=60)
            code, msg = "OK", ""
        except grpc.RpcError as e:
            code, msg = e.code().name, e.details()
    time.sleep(0.5)
    after = requests_total(d, "InferBatch")
    out["big"] = {"max_message_bytes": limit, "rows": rows, "client code": code,
                  "message": msg,
                  "metric codes": dict(after.get("noisy", Counter()) - before.get(
                      "noisy", Counter())),
                  "traceback logged": "Traceback" in d.logs()[log0:]}


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "flood":
        flood_main(argv[1], argv[2], argv[3], int(argv[4]), argv[5])
        return 0
    if argv and argv[0] == "burst":
        burst_main(argv[1], argv[2], argv[3], int(argv[4]), argv[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="quiet,burst,slow,big")
    ap.add_argument("--seconds", type=float, default=10.0, help="each quiet window")
    ap.add_argument("--inflight", type=int, default=256)
    ap.add_argument("--burst", type=int, default=10_000)
    ap.add_argument("--slow-calls", type=int, default=150)
    ap.add_argument("--slow-wait", type=float, default=120.0)
    ap.add_argument("--server", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tenant", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--profile", help="run the daemon under cProfile, stats to this file")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    from tests.daemon_harness import free_port  # noqa: PLC0415

    server = {"metrics_listen": f"127.0.0.1:{free_port()}", "max_message_bytes": "64MiB"}
    server.update(kv.split("=", 1) for kv in args.server)
    tenants = dict(kv.split("=", 1) for kv in args.tenant)
    parts = args.parts.split(",")
    out: dict = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          "cpu_count": os.cpu_count(),
                          "command": " ".join(["python bench/hostile_load.py", *argv]),
                          "load_average_start": [round(x, 2) for x in os.getloadavg()]},
                 "settings": {"server": server, "tenant": tenants}}
    with tempfile.TemporaryDirectory() as tmp:
        d, tokens = start_daemon(Path(tmp) / "d", server, tenants, args.profile)
        try:
            for name in ("quiet", "burst", "fair", "slow"):
                if name in parts:
                    globals()[f"part_{name}"](d, tokens, args, out)
                    print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
        finally:
            d.stop(60)
        if "big" in parts:
            big_server = dict(server, max_message_bytes="1MiB")
            d, tokens = start_daemon(Path(tmp) / "big", big_server, tenants)
            try:
                part_big(d, tokens, args, out)
            finally:
                d.stop(60)
    out["meta"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
