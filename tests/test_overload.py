"""Hostile load against a real ``itif serve`` (issue 15, items 3-6): a burst of simultaneous
calls, a noisy neighbour keeping 256 calls in flight, a client that never reads its replies,
and a reply larger than ``server.max_message_bytes``.

One daemon (bert-tiny, CPU) serves every test here: tenants ``quiet`` and ``noisy`` (defaults:
max_queue 64, so max_inflight 128) and ``reader`` (a deep queue, so that only the reply budget
limits it); ``max_message_bytes`` 1 MiB, ``max_pending_reply_bytes`` 8 MiB and
``max_streams_per_connection`` 16. The load generators run in their own processes
(``bench/hostile_load.py flood|burst``) or speak HTTP/2 by hand (``SlowReader``), the same ones
the figures of docs/reliability.md come from; the numbers here are smaller than the issue's
(a 3,000-call burst instead of 10,000, 120 unread replies of 0.75 MiB instead of 150 of 2 MiB):
the mechanisms are the same, and the suite stays short on a 2-core machine.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest

from bench.hostile_load import (
    SlowReader,
    big_batch_raw,
    flood_ratio,
    flood_rounds,
    helper,
    quiet_calls,
)
from itif.server._proto.itif.v1 import itif_pb2
from itif.server.ingress_columns import REPORT_S
from tests.reliability_util import (
    Daemon,
    free_port,
    make_tokens,
    metric,
    promise,
    rel,  # noqa: F401 - the fixture, used by name
    scrape,
    upload_bytes,
    wait_until,
    weights_bytes,
)

C = grpc.StatusCode
TOKENS = make_tokens(["quiet", "noisy", "reader"])
MIB = 1 << 20
ROW_BYTES = 128 * 64 * 4  # one 128-token row of bert-tiny's last_hidden_state
MAX_STREAMS = 16  # the daemon's max_streams_per_connection


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("overload"), dict(TOKENS),
                    tenant_extra={"reader": {"max_queue": 100_000}},
                    scheduler={"max_wait_ms": 2},
                    server_extra={"metrics_listen": f"127.0.0.1:{port}",
                                  "max_message_bytes": "1MiB",
                                  "max_pending_reply_bytes": "8MiB",
                                  "max_streams_per_connection": MAX_STREAMS})
    daemon.start()
    for i, (tid, tok) in enumerate(TOKENS.items()):
        with daemon.client(tok) as c:
            upload_bytes(c, tid, weights_bytes(400 + i))
    yield daemon
    daemon.stop()


def _infer_counts(d: Daemon, method: str = "Infer") -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for (name, labels), v in scrape(d.metrics_port).items():
        lab = dict(labels)
        if name == "itif_requests_total" and lab.get("method") == method:
            out.setdefault(lab["tenant"], Counter())[lab["code"]] += int(v)
    return out


def _rows_ok(d: Daemon, tenant: str) -> int:
    """Rows of ``tenant`` that left the queue and were computed (itif_inference_rows_total)."""
    return int(metric(scrape(d.metrics_port), "itif_inference_rows_total", tenant=tenant,
                      code="OK"))


def _call(c, method: str, raw: bytes, timeout: float = 60):
    return getattr(c.stub, method)(_PARSE[method](raw), metadata=c.metadata, timeout=timeout)


_PARSE = {"InferBatch": itif_pb2.InferBatchRequest.FromString}


# ---- 3: a burst -------------------------------------------------------------------------------
@promise(31)
def test_burst_is_answered_counted_and_confined_to_its_tenant(d, tmp_path, rel):
    """3,000 Infer calls of noisy started at once on one connection while quiet calls every
    50 ms. Before: gRPC itself CANCELLED the calls the event loop had not taken once 1,000
    waited (quiet's too), and those were missing from the metrics. Now: no call of either
    tenant is CANCELLED; noisy's calls are OK or RESOURCE_EXHAUSTED (admission, its queue), never
    UNAVAILABLE (issue 63: the calls over max_streams_per_connection wait in the client; before,
    gRPC reset some of them before they started); every quiet call is OK; and
    itif_requests_total has exactly the OK and RESOURCE_EXHAUSTED the clients saw."""
    out = tmp_path / "burst.json"
    with d.client(TOKENS["quiet"]) as c:
        quiet_calls(c, 0.3)
        time.sleep(3 * REPORT_S)  # an ingress process reports its calls' counts every REPORT_S
        before = _infer_counts(d)
        p = helper("burst", d.addr, TOKENS["noisy"], "noisy", 3000, out)
        stop = threading.Event()
        got: dict = {}
        th = threading.Thread(target=lambda: got.update(
            zip(("lat", "codes"), quiet_calls(c, 300, stop=stop))))
        th.start()
        p.wait(240)
        stop.set()
        th.join()
    burst = json.loads(out.read_text())
    noisy = Counter(burst["codes"])
    assert sum(noisy.values()) == 3000, burst
    assert "CANCELLED" not in noisy and "CANCELLED" not in got["codes"], (burst, got["codes"])
    assert set(noisy) <= {"OK", "RESOURCE_EXHAUSTED"}, burst
    assert set(got["codes"]) == {"OK"}, got["codes"]
    time.sleep(0.5)
    after = _infer_counts(d)
    delta = {t: after.get(t, Counter()) - before.get(t, Counter()) for t in ("noisy", "quiet")}
    assert delta["noisy"] == noisy, (delta, burst)
    assert delta["quiet"] == Counter(got["codes"]), (delta, got["codes"])
    rel.inputs += 3000 + len(got["lat"])
    rel.notes["burst of 3000 Infer (noisy), codes"] = dict(noisy)
    rel.notes["quiet during the burst: codes, p50/p99 ms"] = [
        dict(got["codes"]), round(float(np.percentile(got["lat"], 50)), 1),
        round(float(np.percentile(got["lat"], 99)), 1)]


# ---- 4: a noisy neighbour ---------------------------------------------------------------------
@promise(32)
def test_quiet_tenant_p99_under_a_256_call_flood(d, tmp_path, rel):
    """Quiet sends a 16-token Infer every 50 ms; noisy keeps 256 calls in flight from another
    process (closed loop). Three rounds of an idle window and a flood window (same machine,
    same minutes). Before: quiet's p99 grew ~45-70x (every noisy call that arrived first was
    taken by the one event loop before quiet's); now noisy's connection holds at most 16 calls
    in the server and the rest of its flood is refused by gRPC itself: quiet's calls are all OK
    and the median over the rounds of p99(flood)/p99(idle) is at most 12 (2.5 measured on a
    2-core machine whose other core runs the flood)."""
    rounds = flood_rounds(d, TOKENS["quiet"], TOKENS["noisy"], tmp_path / "flood")
    ratio = flood_ratio(rounds, rel, f"rounds ({MAX_STREAMS} streams per connection, gate off)")
    # 2.5x on a quiet machine, 3.0-7.3x in CI runs on a busy 2-core runner; 29.8x before the
    # fix. The bound catches that regression without measuring the runner's load.
    assert ratio <= 12.0, rounds


# ---- many calls at once on one connection ----------------------------------------------------
@promise(35)
def test_the_client_queues_calls_over_the_stream_limit_instead_of_failing(d, rel):
    """400 Infer calls at once on one ``itif.client.Client`` (one connection) against a server
    allowing 16 streams per connection. gRPC refuses the streams over the limit (RST_STREAM
    7, UNAVAILABLE; on a plain channel 130-260 of 400 failed so at the default 100 streams, and
    the README's ``itif demo`` with it): the client's retry policy
    (``itif.client.SERVICE_CONFIG``) sends them again, so every call answers OK."""
    futs = []
    with d.client(TOKENS["reader"]) as c:
        msg = itif_pb2.InferRequest(tenant="reader", input=itif_pb2.InferInput(
            input_ids=itif_pb2.TokenIds(ids=list(range(1, 17)))))
        for _ in range(2):
            futs = [c.stub.Infer.future(msg, metadata=c.metadata, timeout=60) for _ in range(400)]
            codes = Counter()
            for f in futs:
                try:
                    f.result()
                    codes["OK"] += 1
                except grpc.RpcError as e:
                    codes[e.code().name] += 1
            assert codes == Counter({"OK": 400}), codes
            rel.inputs += 400
            rel.saw(C.OK, codes["OK"])
    rel.notes[f"400 calls at once on one connection ({MAX_STREAMS} streams), twice: codes"] = (
        dict(codes))


# ---- 5: a slow reader -------------------------------------------------------------------------
UNREAD_CONNS = 8
# a connection's calls: under the stream limit, so gRPC refuses none of them
UNREAD_CALLS = MAX_STREAMS - 1


def _unread_round(d: Daemon, raw: bytes) -> tuple[Counter, float, float]:
    """``UNREAD_CONNS`` HTTP/2 connections send ``UNREAD_CALLS`` InferBatch calls each
    (``raw``: 0.75 MiB replies) and never read; then they close. (the calls' codes, RSS MiB
    while held, RSS MiB after).

    The daemon gives freed heap back (malloc_trim) 0.5 s after a large reply is released, so
    each RSS reading is taken after such a trim: otherwise it also holds the forwards' freed
    scratch memory or not, depending on how the trim fell against them (on a loaded machine
    the held reading was 40-72 MiB over the base instead of 7-12)."""
    before = _infer_counts(d, "InferBatch").get("reader", Counter())
    rows_before = _rows_ok(d, "reader")

    def codes() -> Counter:
        return _infer_counts(d, "InferBatch").get("reader", Counter()) - before

    calls = UNREAD_CALLS * UNREAD_CONNS
    readers = [SlowReader("127.0.0.1", d.port) for _ in range(UNREAD_CONNS)]
    try:
        for r in readers:
            for _ in range(UNREAD_CALLS):
                r.call("/itif.v1.Itif/InferBatch", raw, TOKENS["reader"])
        # the refusals are counted at once, the admitted calls only once gRPC finishes them:
        # every call refused or run (24 rows each), then another tenant's full-size reply,
        # read: its release starts the trim that the held reading waits for
        wait_until(lambda: codes()["RESOURCE_EXHAUSTED"]
                   + (_rows_ok(d, "reader") - rows_before) // 24 == calls, 60, step=0.2,
                   what="every unread call refused or run")
        with d.client(TOKENS["quiet"]) as c:
            assert len(_call(c, "InferBatch", big_batch_raw("quiet", 24)).results) == 24
        time.sleep(1.0)
        held = d.rss_bytes() / MIB
    finally:
        for r in readers:
            r.close()
    wait_until(lambda: sum(codes().values()) == calls, 30, step=0.2, what="every call finished")
    with d.client(TOKENS["reader"]) as c:  # the budget was given back: admitted, answered
        assert len(_call(c, "InferBatch", raw).results) == 24
    time.sleep(1.0)  # the trim after it
    return codes(), held, d.rss_bytes() / MIB


@promise(33)
def test_unread_replies_are_bounded_and_freed(d, rel):
    """Eight HTTP/2 connections send 15 InferBatch calls each (24 rows of last_hidden_state:
    0.75 MiB per reply, 90 MiB in all) and never read. Before: every call ran and its reply
    stayed in the daemon (RSS grew by several times the replies, stayed high after the client
    left, and all counted as OK). Now: the reader tenant's unread replies are bounded by
    max_pending_reply_bytes (8 MiB): the calls past it answer RESOURCE_EXHAUSTED before they run
    (counted), the daemon's RSS grows by less than 60 MiB, and once the connections close the
    budget is free again (a full-size call is admitted) and RSS is back within 48 MiB of where
    it was.

    The bars sit between what either side measured on this 2-core machine (2026-11-28): with
    the budget (five rounds), held -2 to +35 MiB over the base and after -13 to +26; with an
    unbounded budget (1 GiB, three rounds), held +95 to +100. The RSS readings wander by tens
    of MiB from round to round (glibc arenas, gRPC's buffers), so the test sends 90 MiB of
    replies rather than the 45 MiB it sent before: with 45, the bounded side once read 33 MiB
    against a 32 MiB bar in CI, and the unbounded side (54-71 MiB) left no room for a wider one.

    The base is taken after one such round already (the allocator's and gRPC's steady state
    for it: a first round left 0-30 MiB more behind than the base before it, from run to run);
    that freed heap goes back to the system at all is test_admission's
    test_a_large_reply_released_trims_the_heap."""
    raw = big_batch_raw("reader", 24)
    first, _, _ = _unread_round(d, raw)
    assert first["RESOURCE_EXHAUSTED"] >= 100, first
    base = d.rss_bytes() / MIB
    seen, held, after = _unread_round(d, raw)
    assert set(seen) == {"OK", "RESOURCE_EXHAUSTED"}, seen
    assert seen["OK"] <= 8 * MIB // (24 * ROW_BYTES) + 1, seen  # the budget, one over at most
    assert held - base < 60, (base, held)
    assert after - base < 48, (base, held, after)
    rel.inputs += 2 * UNREAD_CONNS * UNREAD_CALLS  # two rounds
    rel.notes[f"{UNREAD_CONNS * UNREAD_CALLS} unread 0.75 MiB replies, 8 MiB budget: codes"] = (
        dict(seen))
    rel.notes["RSS MiB before / held / after the disconnect"] = [
        round(base, 1), round(held, 1), round(after, 1)]


# ---- 6: a reply over max_message_bytes --------------------------------------------------------
@promise(34)
def test_reply_over_max_message_bytes_is_refused_before_it_runs(d, rel):
    """48 rows of last_hidden_state (1.5 MiB) through a 1 MiB max_message_bytes. Before: the
    client got gRPC's "Sent message larger than max", the metric said OK and the daemon logged
    a traceback per call. Now: RESOURCE_EXHAUSTED naming max_message_bytes and what to do,
    counted as such, no traceback, for the itif API and KServe's ModelInfer alike; 24 rows
    (0.75 MiB) still pass."""
    from tritonclient.grpc import service_pb2 as kpb  # noqa: PLC0415

    log0 = len(d.logs())
    before = _infer_counts(d, "InferBatch").get("noisy", Counter())
    with d.client(TOKENS["noisy"]) as c:
        with pytest.raises(grpc.RpcError) as e:
            _call(c, "InferBatch", big_batch_raw("noisy", 48))
        assert e.value.code() == C.RESOURCE_EXHAUSTED, e.value
        msg = e.value.details()
        assert "max_message_bytes (1048576)" in msg and "fewer inputs" in msg, msg
        assert _call(c, "InferBatch", big_batch_raw("noisy", 24))
        ids = np.tile(np.arange(1, 129, dtype=np.int64), (48, 1))
        req = kpb.ModelInferRequest(
            model_name="noisy",
            inputs=[kpb.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64",
                                                           shape=list(ids.shape))],
            outputs=[kpb.ModelInferRequest.InferRequestedOutputTensor(
                name="last_hidden_state")],
            raw_input_contents=[ids.tobytes()])
        infer = c.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                      request_serializer=kpb.ModelInferRequest.SerializeToString,
                                      response_deserializer=kpb.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            infer(req, metadata=c.metadata, timeout=60)
        assert e.value.code() == C.RESOURCE_EXHAUSTED, e.value
        assert "max_message_bytes" in e.value.details(), e.value.details()
    time.sleep(0.5)
    after = _infer_counts(d, "InferBatch").get("noisy", Counter())
    assert after - before == Counter({"OK": 1, "RESOURCE_EXHAUSTED": 1}), (before, after)
    samples = scrape(d.metrics_port)
    assert metric(samples, "itif_requests_total", tenant="noisy", method="ModelInfer",
                  code="RESOURCE_EXHAUSTED") >= 1
    assert "Traceback" not in d.logs()[log0:]
    rel.inputs += 3
    rel.saw(C.RESOURCE_EXHAUSTED, 2)
    rel.saw(C.OK)
    rel.notes["refusal message"] = msg[:200]

