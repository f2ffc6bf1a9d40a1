"""The column path (issue 61): ingress processes' Infer calls as columns through shared memory.

Two levels. In-process: a started daemon (bert-tiny, no server) and its ``ColumnDoor``, whose
rings the test writes arrivals into and reads results from as two ingress processes would; the
answers are compared with ``Engine.infer`` of the same rows. End to end: a real daemon behind
ingress processes, whose answers are compared with Hugging Face's model, and whose log says how
many rows came by columns (calls that the path does not take come by frame, as before).
"""

from __future__ import annotations

import re
import threading
import time
import types

import grpc
import numpy as np
import pytest

import itif
from itif.backbones.spec import load_spec
from itif.bench.tenants import tenant_weights
from itif.config import hash_token, parse_config
from itif.daemon import Daemon as InProcessDaemon
from itif.daemon_state import State
from itif.hostpath.columns import STATUS, Arrivals, Results, status_code
from itif.server.column_door import ColumnDoor
from itif.server.ingress_columns import FRONTEND_SHIFT
from tests.daemon_harness import Daemon, save_hf_tenants
from tests.oracle import reference


# ---- in process: the door and its rings ---------------------------------------------------
@pytest.fixture
def door(tmp_path):
    cfg = parse_config(
        "server:\n  listen: 127.0.0.1:1\n  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token('admin')}\n"
        "backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n"
        "scheduler:\n  max_wait_ms: 1\n"
        "tenants:\n" + "".join(f"  - id: {t}\n    token_sha256: {hash_token(t)}\n"
                              "    max_queue: 8\n    max_seq_len: 40\n"
                              for t in ("a", "b")), tmp_path)
    engine = itif.Engine("bert-tiny")
    spec = load_spec("bert-tiny")
    for i, t in enumerate(("a", "b")):
        engine.add_tenant(t, tenant_weights(spec, i))
    d = InProcessDaemon(cfg, engine)
    d.start()
    for t in ("a", "b"):
        d.status[t].state, d.status[t].sha256 = State.READY, f"sha-{t}"
    door = ColumnDoor(2, result_slot_bytes=4096)
    assert door.bind(d)
    ends = ([r.producer() for r in door.arrivals], [r.consumer() for r in door.results])
    yield d, door, ends
    door.close()
    d.stop(0)


def _arrivals(rows, frontend=0, deadline=None):
    """rows: [(call, tenant index, ids)]."""
    offsets = np.cumsum([0] + [len(ids) for _, _, ids in rows])
    return Arrivals.build([(frontend << FRONTEND_SHIFT) | c for c, _, _ in rows],
                          [t for _, t, _ in rows], offsets,
                          np.concatenate([np.asarray(ids) for _, _, ids in rows]),
                          deadline=deadline)


def _collect(consumer, want_rows: int, timeout: float = 20.0) -> dict[int, list]:
    """call id -> [(status, values, message)] of every row, in arrival order."""
    got: dict[int, list] = {}
    end = time.monotonic() + timeout
    n = 0
    while n < want_rows and time.monotonic() < end:
        if not consumer.wait(0.2):
            continue
        views = consumer.ready()
        for v in views:
            res = Results.unpack(bytes(v))
            errs = res.errors()
            for i, cid in enumerate(res.call_id.tolist()):
                got.setdefault(cid, []).append(
                    (STATUS[res.status[i]], res.row(i).copy(), errs.get(i, "")))
                n += 1
        consumer.release(len(views))
    assert n == want_rows, f"{n} of {want_rows} rows came back: {got}"
    return got


def test_rows_of_two_front_ends_come_back_to_their_own_ring_equal_to_infer(door):
    d, door, (prod, cons) = door
    rng = np.random.default_rng(0)
    rows = [[(c, c % 2, rng.integers(0, 1000, rng.integers(2, 30))) for c in range(1, 6)],
            [(c, (c + 1) % 2, rng.integers(0, 1000, rng.integers(2, 30))) for c in range(1, 4)]]
    for fe in (0, 1):
        assert prod[fe].try_put(_arrivals(rows[fe], fe))
    for fe in (0, 1):
        got = _collect(cons[fe], len(rows[fe]))
        assert set(got) == {(fe << FRONTEND_SHIFT) | c for c, _, _ in rows[fe]}
        for c, t, ids in rows[fe]:
            ((status, values, _),) = got[(fe << FRONTEND_SHIFT) | c]
            want = d.engine.infer([itif.Request("ab"[t], input_ids=ids)])[0].logits
            assert status == "OK"
            np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-6)
    assert door.rows_in == 8 and door.rows_answered == 8 and door.batches >= 1


def test_a_call_of_several_rows_comes_back_in_order_even_split_over_slots(door):
    """Results larger than a slot (4 KiB here) go in parts; a call's rows keep their order."""
    d, door, (prod, cons) = door
    rows = [(7, 0, np.arange(1, 1 + n)) for n in (3, 9, 27, 5, 8, 2, 30, 4)]
    assert prod[0].try_put(_arrivals(rows))
    got = _collect(cons[0], len(rows))[7]
    assert [s for s, _, _ in got] == ["OK"] * len(rows)
    want = d.engine.infer([itif.Request("a", input_ids=ids) for _, _, ids in rows])
    for (_, values, _), w in zip(got, want):
        np.testing.assert_allclose(values, w.logits, rtol=1e-5, atol=1e-6)


def test_refusals_name_their_reason(door):
    _, door, (prod, cons) = door
    past = time.monotonic() - 1.0
    prod[0].try_put(_arrivals([(1, 9, [5, 6])]))  # no tenant 9
    prod[0].try_put(_arrivals([(2, 0, np.arange(1, 60))]))  # over a's max_seq_len 40
    prod[0].try_put(_arrivals([(3, 1, [5, 6])], deadline=[past]))
    # nine rows of one call, over a's max_queue 8: never fits, refused as the servicer
    # refuses it (a snapshot older than a reload of max_queue lets such a call through)
    prod[0].try_put(_arrivals([(4, 0, [1, 2])] * 9))
    got = _collect(cons[0], 12)
    assert got[1][0][0] == "NOT_FOUND"
    assert got[2][0][0] == "INVALID_ARGUMENT" and "max_seq_len" in got[2][0][2]
    assert got[3][0][0] == "DEADLINE_EXCEEDED"
    assert {s for s, _, _ in got[4]} == {"INVALID_ARGUMENT"}
    assert "over its max_queue (8)" in got[4][0][2], got[4][0][2]
    assert door.rows_refused == 12


def test_a_failing_tenant_fails_only_its_own_rows(door):
    """Tenant b's weights gone from the engine mid-flight: its rows NOT_FOUND, a's answered."""
    d, door, (prod, cons) = door
    d.engine.remove_tenant("b")
    prod[0].try_put(_arrivals([(1, 0, [3, 4, 5]), (2, 1, [3, 4, 5]), (3, 0, [7, 8])]))
    got = _collect(cons[0], 3)
    assert got[1][0][0] == "OK" and got[3][0][0] == "OK"
    assert got[2][0][0] == "NOT_FOUND" and "'b'" in got[2][0][2]


def test_a_tenant_without_ready_weights_is_answered_as_the_servicer_answers(door):
    """The snapshot still listed b as ready when its weights failed to load: its rows get
    FAILED_PRECONDITION naming the state, as a call by frame would, not NOT_FOUND."""
    d, door, (prod, cons) = door
    d.engine.remove_tenant("b")
    d.status["b"].state, d.status["b"].error = State.FAILED, "its base is missing"
    prod[0].try_put(_arrivals([(1, 0, [3, 4, 5]), (2, 1, [3, 4, 5])]))
    got = _collect(cons[0], 2)
    assert got[1][0][0] == "OK"
    assert got[2][0][0] == "FAILED_PRECONDITION", got[2]
    assert "FAILED" in got[2][0][2] and "its base is missing" in got[2][0][2]


def test_results_name_the_weights_each_tenant_used(door):
    """The weights table of a batch's results is the forward's own view of the store: the
    tag b's weights carry now, not the one a snapshot saw before they were replaced."""
    d, door, (prod, cons) = door
    spec = load_spec("bert-tiny")
    d.engine.add_tenant("b", tenant_weights(spec, 7), tag="b-v2")
    prod[0].try_put(_arrivals([(1, 0, [3, 4, 5]), (2, 1, [3, 4, 5])]))
    assert cons[0].wait(20.0)
    (view,) = cons[0].ready()[:1]
    res = Results.unpack(bytes(view))
    cons[0].release(1)
    index = {int(c) & ((1 << FRONTEND_SHIFT) - 1): i for i, c in enumerate(res.call_id)}
    assert len(res) == 2 and set(index) == {1, 2}
    assert res.weights() == {0: "", 1: "b-v2"}
    want = d.engine.infer([itif.Request("b", input_ids=[3, 4, 5])])[0].logits
    np.testing.assert_allclose(res.row(index[2]), want, rtol=1e-5, atol=1e-6)


def test_an_injected_out_of_memory_is_retryable_and_its_own(door):
    from itif import faults

    d, door, (prod, cons) = door
    faults.install(d.engine, {faults.ENV: "oom:b"})
    prod[0].try_put(_arrivals([(1, 0, [3, 4, 5]), (2, 1, [3, 4, 5])]))
    got = _collect(cons[0], 2)
    assert got[1][0][0] == "OK"
    assert got[2][0][0] == "RESOURCE_EXHAUSTED" and "memory" in got[2][0][2]


def test_invalid_rows_are_answered_by_the_ingress_process_as_the_daemon_answers(door):
    """A call whose rows break a limit (the backbone's positions, the vocabulary, the tenant's
    max_seq_len) is refused in the ingress process, INVALID_ARGUMENT with the very message
    ``Daemon.admit`` gives for it, so it never reaches the daemon; valid rows go by columns;
    another tenant's or a bad token's call still goes by frame (the servicer answers)."""
    from itif.daemon_state import Identity
    from itif.errors import InvalidRequest
    from itif.server._proto.itif.v1 import itif_pb2
    from itif.server.ingress_columns import INFER_BATCH, ColumnClient

    d, dr, _ = door
    max_len = d.engine.max_seq_len

    def body(rows):
        return itif_pb2.InferBatchRequest(tenant="a", inputs=[
            itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(ids=r)) for r in rows]
        ).SerializeToString()

    def admitted(rows):
        try:
            d.admit(Identity("a"), "a", [itif.Request("a", r) for r in rows])
        except InvalidRequest as e:
            return str(e)
        raise AssertionError(f"{rows} was admitted")

    # prepare() reads the snapshot, the slot size and the token digests: no rings needed
    client = ColumnClient.__new__(ColumnClient)
    client.snapshot, client._digests = dr.snapshot(), {}
    client.arrivals = types.SimpleNamespace(slot_bytes=1 << 20)
    meta = (("authorization", "Bearer a"),)
    for rows in ([[1, 2], [3, 10**6]], [[1] * 41], [[1, 2], list(range(max_len + 1))],
                 [[1, 2], []], [[-5, 2]]):
        p = client.prepare(INFER_BATCH, body(rows), meta)
        assert p is not None and p.refused is not None, rows
        assert p.refused.code is grpc.StatusCode.INVALID_ARGUMENT
        assert p.refused.details == admitted(rows), rows
    ok = client.prepare(INFER_BATCH, body([[1, 2], [3] * 40]), meta)
    assert ok is not None and ok.refused is None and len(ok.ids) == 2
    assert client.prepare(INFER_BATCH, body([[1, 10**6]]), (("authorization", "Bearer b"),)) is None


def test_the_snapshot_lists_ready_tenants_only(door):
    d, door, _ = door
    snap = door.snapshot()
    assert set(snap["tenants"]) == {"a", "b"}
    index, token_sha, sha, labels, limit, inflight, max_queue = snap["tenants"]["a"]
    assert (token_sha, sha, labels, limit, inflight, max_queue) == (
        hash_token("a"), "sha-a", 2, 40, 16, 8)
    assert door.queue.names[index] == "a"
    d.status["b"].state = State.LOADING
    assert set(door.snapshot()["tenants"]) == {"a"}
    assert status_code("NOT_FOUND") == STATUS.index("NOT_FOUND")


# ---- end to end: a daemon behind ingress processes ----------------------------------------
TOKENS = {"acme": "acme-tok", "beta": "beta-tok"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """tenant -> (model, file); beta has no classification head."""
    models, files = save_hf_tenants(tmp_path_factory.mktemp("column-weights"),
                                    {"acme": (3, 5), "beta": (None, 6)})
    return {t: (models[t], files[t]) for t in models}


def _column_rows(d: Daemon) -> int:
    found = re.findall(r"column path: (\d+) rows in", d.logs())
    assert found, d.logs()[-3000:]
    return int(found[-1])


def _wait_snapshot(c, tenant, ids):
    """Calls right after an upload may still go by frame until the next snapshot (0.2 s)."""
    time.sleep(0.6)
    c.infer(tenant, ids)


def test_infer_calls_go_by_columns_and_equal_hf(tmp_path, weights):
    d = Daemon(tmp_path, dict(TOKENS), server_extra={"ingress_processes": 2}).start()
    try:
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", weights["acme"][1])
        with d.client(TOKENS["beta"]) as c:
            c.upload("beta", weights["beta"][1])
            _wait_snapshot(c, "beta", [1, 2])
        rng = np.random.default_rng(1)
        calls = 0
        for t, out in (("acme", "logits"), ("beta", "pooled")):
            m = weights[t][0]
            for _ in range(6):
                with d.client(TOKENS[t]) as c:  # new connections: both ingress processes
                    ids = rng.integers(0, 1000, rng.integers(2, 50)).tolist()
                    got = c.infer(t, ids)
                    assert set(got) == {out}
                    np.testing.assert_allclose(got[out], reference(m, itif.Request(t, ids))[out],
                                               atol=1e-4)
                    batch = [rng.integers(0, 1000, n).tolist() for n in (3, 17, 40)]
                    res = c.infer_batch(t, [c.make_input(b, None, None, None) for b in batch])
                    for b, r in zip(batch, res):
                        np.testing.assert_allclose(
                            r[out], reference(m, itif.Request(t, b))[out], atol=1e-4)
                    calls += 1
        # calls the path does not take are answered by frame, exactly as before
        with d.client(TOKENS["acme"]) as c:
            ids = [5, 6, 7, 8]
            got = c.infer("acme", ids, token_type_ids=[0, 0, 1, 1])
            want = reference(
                weights["acme"][0], itif.Request("acme", ids, token_type_ids=[0, 0, 1, 1])
            )
            np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4)
            assert set(c.infer("acme", ids, outputs=["pooled"])) == {"pooled"}
            with pytest.raises(grpc.RpcError) as e:
                c.infer("acme", [5, 10**6])
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "vocabulary" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                c.infer("beta", [5, 6])  # beta's tenant: not acme's to see
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
        with d.client("wrong-token") as c, pytest.raises(grpc.RpcError) as e:
            c.infer("acme", [5, 6])
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        d.stop()
    # every Infer of ids without options came by columns (4 rows a round), none of the others
    assert _column_rows(d) == 1 + 4 * calls, d.logs()[-3000:]


def test_calls_over_the_tenants_in_flight_share_are_refused_with_a_retry_hint(tmp_path, weights):
    """max_inflight 2 and one ingress process: with each forward taking 300 ms, of 6 calls at
    once at most 2 are in flight; the rest are RESOURCE_EXHAUSTED with the retry hint, from
    the ingress process, and are counted in the daemon's metrics."""
    d = Daemon(tmp_path, dict(TOKENS), faults="slow:300",
               tenant_extra={"acme": {"max_inflight": 2}},
               server_extra={"ingress_processes": 1}).start()
    try:
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", weights["acme"][1])
            _wait_snapshot(c, "acme", [1, 2])
        codes, trailers = [], []

        def one():
            with d.client(TOKENS["acme"]) as c:
                try:
                    c.infer("acme", [3, 4, 5], timeout=20)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
                    trailers.append(dict(e.trailing_metadata() or ()))

        threads = [threading.Thread(target=one) for _ in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert codes.count("OK") >= 2 and codes.count("RESOURCE_EXHAUSTED") >= 1, codes
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert all(t.get("grpc-retry-pushback-ms") == "200" for t in trailers), trailers
    finally:
        d.stop()
    assert _column_rows(d) >= 3


def test_results_split_by_ingress_process_keep_each_rows_outputs_and_the_weights_table():
    """``ColumnDoor._send``'s split of a batch's results (no failed row) by the ingress process
    in each call id's top bits: one part a process, its rows in batch order, each row's outputs
    its own, the weights table on every part; equal to the gather a part it replaced."""
    from itif.server.column_door import _rows, _split_ok

    rng = np.random.default_rng(3)
    for n in (2, 5, 17):
        fe = rng.integers(0, 3, n).astype(np.int64)
        fe[:2] = (0, 2)  # two processes at least
        call_id = (fe << FRONTEND_SHIFT) | np.arange(n)
        lengths = rng.integers(0, 4, n)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        values = rng.standard_normal(int(offsets[-1])).astype(np.float32)
        res = Results.ok(call_id, offsets, values)
        res.w_tenant, res.w_tag = np.array([1, 4], np.int32), np.arange(128, dtype=np.uint8)
        parts = _split_ok(res, fe)
        assert [k for k, _ in parts] == sorted(set(fe.tolist()))
        for k, part in parts:
            want = _rows(res, np.flatnonzero(fe == k))
            assert np.array_equal(part.call_id, want.call_id)
            assert np.array_equal(part.offsets, want.offsets)
            assert np.array_equal(part.values, want.values)
            assert not part.status.any() and part.err_row.size == 0
            assert part.weights() == res.weights() == {1: bytes(range(64)).decode("ascii"),
                                                       4: bytes(range(64, 128)).decode("ascii")}
