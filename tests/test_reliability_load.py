"""Reliability, load held (promises 1-4 and 7 of shared/reference/reliability.md), against real
daemon subprocesses on loopback: bounded per-tenant queues, deadlines and cancellation, a noisy
neighbour at 10x its capacity, and a sustained mixed run with bounded memory whose Prometheus
counters equal what the clients saw.

The forward's cost is fixed with the ``slow:<ms>`` test hook (itif/faults.py), so that queueing
behaviour does not depend on how fast the CI machine is.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest

from itif.server._proto.itif.v1 import itif_pb2
from tests.daemon_harness import settled_metrics
from tests.reliability_util import (
    ADMIN,
    OK,
    ROOT,
    Daemon,
    code_of,
    error_of,
    free_port,
    make_tokens,
    metric,
    promise,
    scrape,
    sustain_seconds,
    upload_bytes,
    wait_until,
    weights_bytes,
)

C = grpc.StatusCode
IDS = [101, 203, 3, 137, 321, 102]


# ---- 1, 2: bounded queues, deadlines, cancellation ---------------------------------------------
Q_TOKENS = make_tokens(["a"])
FORWARD_S = 2.0  # every forward sleeps this long (slow hook)


@pytest.fixture(scope="module")
def qd(tmp_path_factory):
    port = free_port()
    d = Daemon(tmp_path_factory.mktemp("queue"), dict(Q_TOKENS),
                faults=f"slow:{FORWARD_S * 1e3:g}", tenant_extra={"a": {"max_queue": 4}},
                server_extra={"metrics_listen": f"127.0.0.1:{port}"})
    d.start()
    with d.client(Q_TOKENS["a"]) as c:
        upload_bytes(c, "a", weights_bytes(200))
    yield d
    d.stop()


class Blocker:
    """One call of tenant a that keeps the engine busy for FORWARD_S: started, then waited for
    until it has left the queue (it is running)."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.result: list = []
        self.thread = threading.Thread(target=self._call)

    def _call(self) -> None:
        with self.d.client(Q_TOKENS["a"]) as c:
            self.result.append(code_of(lambda: c.infer("a", IDS, timeout=60)))

    def __enter__(self) -> Blocker:
        self.started = time.monotonic()
        self.thread.start()
        time.sleep(0.3)  # the scheduler takes a lone request within max_wait_ms (1 ms)
        with self.d.client(ADMIN) as c:
            wait_until(lambda: c.get_tenant("a").queue_depth == 0, 5, what="blocker running")
        assert time.monotonic() - self.started < FORWARD_S * 0.6, "too slow to set up"
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(60)
        assert self.result == [OK]


def _concurrently(fns, timeout: float = 60.0) -> list[tuple[grpc.StatusCode, float]]:
    """Run the calls from one thread each, released together; (code, seconds) of each."""
    out: list = [None] * len(fns)
    gate = threading.Barrier(len(fns))

    def run(i):
        gate.wait()
        t0 = time.perf_counter()
        code = code_of(fns[i])
        out[i] = (code, time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


ROUNDS_1 = 3  # rounds of promise 1, all of them counted
REFUSAL_MS = 50.0  # the promise: a refusal answers within 50 ms


@promise(1)
def test_bounded_queue_answers_resource_exhausted_quickly(qd, rel):
    """max_queue=4, a 2 s forward, 20 calls: the running one plus 4 queued are OK, the other
    15 get RESOURCE_EXHAUSTED, counted in the metrics; no accepted call lost. Three rounds, every
    one counted: the median refusal (timed on the client) is within 50 ms, and no refusal waits
    anywhere near the running forward (each < FORWARD_S / 4), so a queue that made a caller wait
    for room fails every round."""
    rounds, refusals = [], []
    for _ in range(ROUNDS_1):
        before = settled_metrics(qd.metrics_port)
        with qd.client(Q_TOKENS["a"]) as c:
            c.health_status()  # channel connected before the clock starts
            with Blocker(qd):
                res = _concurrently([lambda: c.infer("a", IDS, timeout=60)] * 19)
        after = settled_metrics(qd.metrics_port)
        codes = Counter(code.name for code, _ in res)
        rejected = [s * 1e3 for code, s in res if code == C.RESOURCE_EXHAUSTED]
        refusals += rejected
        rounds.append({"codes": dict(codes), "median refusal ms":
                       round(float(np.median(rejected)), 1) if rejected else None,
                       "max refusal ms": round(max(rejected), 1) if rejected else None})
        rel.inputs += 20
        rel.saw(C.OK, codes["OK"] + 1)
        rel.saw(C.RESOURCE_EXHAUSTED, codes["RESOURCE_EXHAUSTED"])
        assert codes == {"OK": 4, "RESOURCE_EXHAUSTED": 15}, codes  # + the blocker: 5 OK
        delta = {code: metric(after, "itif_requests_total", tenant="a", method="Infer", code=code)
                 - metric(before, "itif_requests_total", tenant="a", method="Infer", code=code)
                 for code in ("OK", "RESOURCE_EXHAUSTED")}
        assert delta == {"OK": 5, "RESOURCE_EXHAUSTED": 15}, delta
    median = float(np.median(refusals))
    rel.notes["rounds"] = rounds
    rel.notes["refusal ms (median, p90, max) over all rounds"] = [
        round(median, 1), round(float(np.percentile(refusals, 90)), 1), round(max(refusals), 1)]
    assert median <= REFUSAL_MS, rounds
    assert max(refusals) < FORWARD_S * 1e3 / 4, rounds  # none waited for the forward


@promise(2)
def test_deadlines_and_cancellation_free_their_work(qd, rel):
    """A 1 ms deadline -> DEADLINE_EXCEEDED and the next call is OK. Queued calls whose
    deadline passes, and queued calls the client cancels, leave the queue at once: while the
    same forward is still running, 4 new calls fit into the queue of 4 and all succeed, and
    the expired and cancelled calls never run (counted by the compute-time histogram)."""
    with qd.client(Q_TOKENS["a"]) as c:
        code, msg = error_of(lambda: c.infer("a", IDS, timeout=0.001))
        assert code == C.DEADLINE_EXCEEDED, (code, msg)
        assert code_of(lambda: c.infer("a", IDS, timeout=60)) == OK
    rel.inputs += 2
    for how in ("deadline", "cancel"):
        before = scrape(qd.metrics_port)
        with qd.client(Q_TOKENS["a"]) as c, Blocker(qd) as b:
            if how == "deadline":
                doomed = _concurrently([lambda: c.infer("a", IDS, timeout=0.3)] * 4)
                assert [code for code, _ in doomed] == [C.DEADLINE_EXCEEDED] * 4, doomed
            else:
                futs = [c.stub.Infer.future(itif_pb2.InferRequest(
                    tenant="a", input=c.make_input(IDS)), metadata=c.metadata, timeout=60)
                    for _ in range(4)]
                with qd.client(ADMIN) as adm:
                    wait_until(lambda: adm.get_tenant("a").queue_depth == 4, 5,
                               what="4 calls queued")
                for f in futs:
                    f.cancel()
                assert all(code_of(f.result) == C.CANCELLED for f in futs)
            with qd.client(ADMIN) as adm:
                wait_until(lambda: adm.get_tenant("a").queue_depth == 0, 5,
                           what="the queue emptied by the " + how)
            assert time.monotonic() - b.started < FORWARD_S, "the forward ended too early"
            fresh = _concurrently([lambda: c.infer("a", IDS, timeout=60)] * 4)
        assert [code for code, _ in fresh] == [OK] * 4, (how, fresh)
        after = scrape(qd.metrics_port)
        ran = (metric(after, "itif_compute_seconds_count", tenant="a")
               - metric(before, "itif_compute_seconds_count", tenant="a"))
        assert ran == 5, (how, ran)  # the blocker and the 4 fresh calls; not the 4 freed ones
        rel.inputs += 9
        rel.faults += 4
        rel.notes[f"{how}: calls run"] = ran


# ---- 4: noisy neighbour ------------------------------------------------------------------------
N_TOKENS = make_tokens(["noisy", "quiet"])
N_FORWARD_MS, N_WAIT_MS = 40, 20


def _flood(d: Daemon, folder, rate: float, invalid: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", "from tests.reliability_util import flood_main; flood_main()",
         d.addr, N_TOKENS["noisy"], "noisy", str(rate), str(folder),
         *(["invalid"] if invalid else [])], cwd=ROOT, env=env)


def _flood_counts(folder) -> Counter:
    try:
        return Counter(json.loads((folder / "counts.json").read_text()))
    except (FileNotFoundError, ValueError):
        return Counter()


def _quiet_latencies(c, seconds: float, rate: float = 10.0) -> tuple[list[float], Counter]:
    """The quiet tenant: one call every 1/rate s (sequential), latency of each in ms."""
    lat, codes = [], Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        code = code_of(lambda: c.infer("quiet", IDS, timeout=30))
        lat.append((time.perf_counter() - t0) * 1e3)
        codes[code.name] += 1
        time.sleep(max(0.0, 1.0 / rate - (time.perf_counter() - t0)))
    return lat, codes


ROUNDS_4, WINDOW_4_S = 5, 3.0  # rounds of promise 4 (idle, load, noisy windows), all counted


def _window(c, folder, codes: Counter | None = None) -> tuple[list[float], Counter]:
    """Quiet's latencies for one window while the flood of ``folder`` runs (none: idle); the
    flood's counts over the window are added to ``codes``."""
    if folder is None:
        return _quiet_latencies(c, WINDOW_4_S)
    (folder / "on").touch()
    time.sleep(1.0)  # the flood is up to speed (and noisy's queue full) from here on
    c0 = _flood_counts(folder)
    out = _quiet_latencies(c, WINDOW_4_S)
    c1 = _flood_counts(folder)
    (folder / "on").unlink()
    time.sleep(0.5)
    if codes is not None:
        codes.update(c1 - c0)
    return out


@promise(4)
@pytest.mark.slow
def test_noisy_neighbour_at_10x_capacity_does_not_starve_a_quiet_one(tmp_path, rel):
    """Tenant noisy offers 10x what the daemon can serve it (its queue holds 1; open-loop calls
    from another process), tenant quiet sends 10 calls/s: every quiet call is OK, and noisy's
    use of the queue costs quiet at most 2x in p99. Forwards cost 40 ms (slow hook), the lazy
    batching window is 20 ms (max_wait_ms).

    Five rounds, every one counted, each of three windows on the same machine: idle; "load", the
    same flood at the same rate but every call invalid, so the daemon does all of a call's work
    up to the queue and refuses it there; and "noisy", the real flood. p99(noisy) / p99(load)
    isolates what the promise is about, the queue and the batches (the daemon's CPU spent on
    refusing 400 calls/s is the same in both); its median over the rounds must be <= 2 (a quiet
    tenant that waits behind noisy's work fails every round). p99(noisy) / p99(idle), which also
    counts the CPU that the flood's transport costs on this machine, is reported."""
    port = free_port()
    d = Daemon(tmp_path / "d", dict(N_TOKENS), faults=f"slow:{N_FORWARD_MS}",
               scheduler={"max_wait_ms": N_WAIT_MS}, tenant_extra={"noisy": {"max_queue": 1}},
               server_extra={"metrics_listen": f"127.0.0.1:{port}"})
    d.start()
    noisy_dir, load_dir = tmp_path / "flood", tmp_path / "load"
    noisy_dir.mkdir()
    load_dir.mkdir()
    # Capacity: at most 2 noisy calls per forward (1 running, 1 queued) -> ~2 / 45 ms.
    capacity = 2 / ((N_FORWARD_MS + 5) / 1e3)
    floods = [_flood(d, noisy_dir, rate=10 * capacity),
              _flood(d, load_dir, rate=10 * capacity, invalid=True)]
    rounds = []
    try:
        for tid, tok in N_TOKENS.items():
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(210))
        for f in (noisy_dir, load_dir):
            wait_until(lambda: (f / "counts.json").exists(), 60, what="flood process up")
        lat = {"idle": [], "load": [], "noisy": []}
        noisy_codes, load_codes = Counter(), Counter()
        with d.client(N_TOKENS["quiet"]) as c:
            _quiet_latencies(c, 1.0)  # warm-up
            for _ in range(ROUNDS_4):
                p99 = {}
                for kind, folder, codes in (("idle", None, None), ("load", load_dir, load_codes),
                                            ("noisy", noisy_dir, noisy_codes)):
                    got, quiet_codes = _window(c, folder, codes)
                    assert set(quiet_codes) == {"OK"}, (kind, quiet_codes)
                    lat[kind] += got
                    p99[kind] = float(np.percentile(got, 99))
                    rel.inputs += len(got)
                rounds.append({"p99 ms idle/load/noisy": [round(p99[k], 1) for k in p99],
                               "noisy/load": round(p99["noisy"] / p99["load"], 2),
                               "noisy/idle": round(p99["noisy"] / p99["idle"], 2)})
        offered, served = noisy_codes["sent"], noisy_codes["OK"]
        rel.inputs += offered + load_codes["sent"]
        ratio = float(np.median([r["noisy/load"] for r in rounds]))
        rel.notes["rounds"] = rounds
        rel.notes["quiet p50/p99 ms idle, load, noisy"] = {
            k: [round(float(np.percentile(v, 50)), 1), round(float(np.percentile(v, 99)), 1)]
            for k, v in lat.items()}
        rel.notes["p99 noisy/load, median of rounds"] = round(ratio, 2)
        rel.notes["p99 noisy/idle, median of rounds"] = round(
            float(np.median([r["noisy/idle"] for r in rounds])), 2)
        rel.notes["noisy offered/served"] = [offered, served]
        assert served > 0 and offered >= 10 * served, (offered, served)  # 10x its capacity
        # the invalid flood is refused as invalid; a few of its calls may meet the tenant's
        # in-flight limit first (max_queue 1 -> max_inflight 2) when the machine is slow (a CI
        # run: 2 of 7,346), which answers them RESOURCE_EXHAUSTED, as it should
        assert load_codes["sent"] and set(load_codes) <= {
            "sent", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, load_codes
        assert load_codes["INVALID_ARGUMENT"] >= 0.95 * load_codes["sent"], load_codes
        assert ratio <= 2.0, rounds
    finally:
        for f in floods:
            f.send_signal(signal.SIGTERM)
            f.wait(30)
        d.stop()


# ---- 3, 7: sustained mixed traffic, bounded memory, exact metrics -----------------------------
S_TENANTS = [f"s{i}" for i in range(8)]
S_TOKENS = make_tokens(S_TENANTS)


def s_queue(tenant: str) -> int:
    """max_queue of a tenant of the sustained run: 2 for the first two, 16 for the others."""
    return 2 if S_TENANTS.index(tenant) < 2 else 16


class Mix:
    """One client thread of the sustained run: a random mix of every kind of call, each checked
    against the codes it may get, and counted per (tenant label, method, code) as the metrics
    label them."""

    ALLOWED = {
        "infer": {"OK", "RESOURCE_EXHAUSTED"},
        "batch": {"OK", "RESOURCE_EXHAUSTED"},
        "bad input": {"INVALID_ARGUMENT"},
        "other tenant": {"NOT_FOUND"},
        "wrong token": {"UNAUTHENTICATED"},
        "get": {"OK"},
        "list": {"OK"},
        "upload": {"OK", "RESOURCE_EXHAUSTED"},  # one upload per tenant at a time
        "deadline": {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"},
        "cancel": {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"},
    }

    def __init__(self, d: Daemon, k: int, end: float) -> None:
        self.d, self.k, self.end = d, k, end
        self.tenant = S_TENANTS[k % len(S_TENANTS)]
        self.queue = s_queue(self.tenant)  # a call of more rows is INVALID_ARGUMENT, not load
        self.rng = random.Random(k)
        self.seen: Counter = Counter()  # (tenant label, method, code)
        self.kinds: Counter = Counter()  # (kind, code)
        self.bad: list = []

    def run(self) -> None:
        tok = S_TOKENS[self.tenant]
        with self.d.client(tok) as c, self.d.client("wrong") as w:
            while time.monotonic() < self.end:
                self.one(c, w)

    def one(self, c, w) -> None:
        rng, t = self.rng, self.tenant
        # Calls cut short by a deadline or a cancellation may end before the server saw them,
        # so only the last tenant makes them, and its counters are not compared exactly.
        weights = [40, 15, 8, 5, 5, 5, 3, 1] + ([30, 20] if t == S_TENANTS[-1] else [0, 0])
        kind = rng.choices(list(self.ALLOWED), weights=weights)[0]
        ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 64))]
        label, method = t, "Infer"
        if kind == "infer":
            code = code_of(lambda: c.infer(t, ids, timeout=30))
        elif kind == "batch":
            method = "InferBatch"
            inputs = [c.make_input(ids[: rng.randrange(1, len(ids) + 1)])
                      for _ in range(min(rng.randrange(1, 5), self.queue))]
            code = code_of(lambda: c.infer_batch(t, inputs, timeout=30))
        elif kind == "bad input":
            code = code_of(lambda: c.infer(t, ids + [5000], timeout=30))
        elif kind == "other tenant":
            other = S_TENANTS[(self.k + 1) % len(S_TENANTS)]
            code = code_of(lambda: c.infer(other, ids, timeout=30))
        elif kind == "wrong token":
            label = ""
            code = code_of(lambda: w.infer(t, ids, timeout=30))
        elif kind == "get":
            method = "GetTenant"
            code = code_of(lambda: c.get_tenant(t))
        elif kind == "list":
            method = "ListTenants"
            code = code_of(c.tenants)
        elif kind == "upload":
            method = "UploadWeights"
            code = code_of(lambda: upload_bytes(c, t, weights_bytes(220 + self.k % 8), timeout=60))
        elif kind == "deadline":
            code = code_of(lambda: c.infer(t, ids, timeout=rng.choice([0.002, 0.01, 0.05])))
        else:
            fut = c.stub.Infer.future(itif_pb2.InferRequest(tenant=t, input=c.make_input(ids)),
                                      metadata=c.metadata, timeout=30)
            time.sleep(rng.random() * 0.02)
            fut.cancel()
            code = code_of(fut.result)
        self.kinds[(kind, code.name)] += 1
        if code.name not in self.ALLOWED[kind]:
            self.bad.append((kind, code.name))
        if label != S_TENANTS[-1]:
            self.seen[(label, method, code.name)] += 1


def _rss_mib(d: Daemon) -> float:
    return d.rss_bytes() / 2**20


@promise(3, 7)
@pytest.mark.slow
def test_sustained_mixed_run_bounded_memory_and_exact_metrics(tmp_path, rel):
    """Mixed traffic over 8 tenants for ITIF_RELIABILITY_SUSTAIN_S seconds (60 s by default):
    inference (single and batched; two tenants with a queue of 2), bad inputs, other tenants'
    names, wrong tokens, tenant queries, re-uploads, short deadlines and cancellations (one
    tenant's). Valid calls end only OK or RESOURCE_EXHAUSTED (each kind only with its own
    codes); the daemon's resident memory after the warm-up third stays within 64 MiB; and the
    Prometheus counters (itif_requests_total by tenant, method, code) equal the clients' own
    counts for every series (the deadline/cancel tenant's aside: a call cut short on the
    client may never reach the server)."""
    seconds = sustain_seconds()
    port = free_port()
    extra = {t: {"max_queue": s_queue(t)} for t in S_TENANTS}
    d = Daemon(tmp_path, dict(S_TOKENS), tenant_extra=extra, faults="slow:5",
                server_extra={"metrics_listen": f"127.0.0.1:{port}"})
    d.start()
    try:
        for i, (tid, tok) in enumerate(S_TOKENS.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(220 + i))
        before = scrape(port)
        end = time.monotonic() + seconds
        mixes = [Mix(d, k, end) for k in range(12)]
        threads = [threading.Thread(target=m.run) for m in mixes]
        for t in threads:
            t.start()
        rss = []
        t0 = time.monotonic()
        while any(t.is_alive() for t in threads):
            rss.append((time.monotonic() - t0, _rss_mib(d)))
            time.sleep(1.0)
        for t in threads:
            t.join()
        time.sleep(0.5)  # the last calls' metrics
        after = scrape(port)
        seen = sum((m.seen for m in mixes), Counter())
        kinds = sum((m.kinds for m in mixes), Counter())
        bad = [b for m in mixes for b in m.bad]
        rel.inputs += sum(kinds.values())
        for (_, code), n in kinds.items():
            rel.codes[code] += n
        rel.notes["calls by kind and code"] = {f"{k} {c}": v for (k, c), v in sorted(kinds.items())}
        assert not bad, Counter(bad)

        warm = [m for t, m in rss if t >= seconds / 3]
        growth = max(warm) - warm[0]
        rel.notes["seconds"] = seconds
        rel.notes["daemon RSS MiB (start of run, after warm-up, max, end)"] = [
            round(rss[0][1]), round(warm[0]), round(max(m for _, m in rss)), round(rss[-1][1])]
        assert growth <= 64, rss

        mismatches = {}
        for (label, method, code), n in seen.items():
            got = (metric(after, "itif_requests_total", tenant=label, method=method, code=code)
                   - metric(before, "itif_requests_total", tenant=label, method=method,
                            code=code))
            if got != n:
                mismatches[f"{label or '-'} {method} {code}"] = (n, got)
        rel.notes["metric series compared"] = len(seen)
        assert not mismatches, mismatches
        with d.client(ADMIN) as c:
            assert c.health_status() == "SERVING"
    finally:
        d.stop()
