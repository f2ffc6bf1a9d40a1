"""The columnar host path's engine side (issue #61, item 2): the batch formats, the ring across
processes, the column queue against the scheduler's fair queue, and ``Engine.infer_columns``
against ``Engine.infer`` (CPU, bert-tiny)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import itif
from itif.errors import InvalidRequest, TenantNotFound
from itif.hostpath.colqueue import ColumnQueue
from itif.hostpath.columns import STATUS, Arrivals, Results
from itif.hostpath.ring import Ring, RingFull
from itif.requests import Request
from itif.scheduler import TenantQuota
from itif.scheduler.fairqueue import FairQueue
from itif.scheduler.tickets import SchedulerTicket

REPO = Path(__file__).resolve().parents[1]
OK, INVALID, NOT_FOUND, EXHAUSTED, EXPIRED = (STATUS.index(c) for c in (
    "OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"))


def arrivals(tenant, lengths, call_id=None, deadline=None, priority=None, seed=0,
             vocab=1000) -> Arrivals:
    lengths = np.asarray(lengths, np.int64)
    off = np.concatenate(([0], np.cumsum(lengths)))
    ids = np.random.default_rng(seed).integers(0, vocab, int(off[-1]))
    n = len(lengths)
    return Arrivals.build(np.arange(n) if call_id is None else call_id, tenant, off, ids,
                          deadline, priority)


# ---- the formats ------------------------------------------------------------------------------
def test_arrivals_round_trip_through_bytes_and_into_a_larger_buffer():
    a = arrivals([0, 2, 1, 2], [3, 1, 7, 2], call_id=[10, 11, 11, 12],
                 deadline=[1.5, np.inf, 2.0, 3.0], priority=[1, 0, -3, 127])
    a.table_version = 9
    b = Arrivals.unpack(a.to_bytes())
    buf = bytearray(16 + a.nbytes())
    assert a.pack_into(buf, 16) == a.nbytes()
    c = Arrivals.unpack(memoryview(buf)[16:])
    for got in (b, c):
        assert got.table_version == 9
        for col in ("call_id", "tenant", "offsets", "ids", "deadline", "priority"):
            x, y = getattr(a, col), getattr(got, col)
            assert x.dtype == y.dtype and np.array_equal(x, y), col
    empty = Arrivals.unpack(arrivals([], []).to_bytes())
    assert len(empty) == 0 and empty.offsets.tolist() == [0]
    both = Arrivals.concat([a, arrivals([1], [4], call_id=[99], seed=1)])
    assert both.offsets.tolist() == [0, 3, 4, 11, 13, 17]
    assert np.array_equal(both.ids[:13], a.ids) and both.call_id[-1] == 99


def test_arrivals_build_refuses_inconsistent_columns():
    with pytest.raises(InvalidRequest, match="offsets"):
        Arrivals.build([0, 1], [0, 0], [0, 3], [1, 2, 3])
    with pytest.raises(InvalidRequest, match="never decrease"):
        Arrivals.build([0, 1], [0, 0], [0, 3, 2], [1, 2, 3])
    with pytest.raises(InvalidRequest, match="ids"):
        Arrivals.build([0], [0], [0, 3], [1.0, 2.0, 3.0])
    with pytest.raises(InvalidRequest, match="magic"):
        Arrivals.unpack(Results.build([1], [0], [0, 1], [1.0]).to_bytes())


def test_results_round_trip_with_messages_only_for_failures():
    r = Results.build([7, 8, 9], [OK, INVALID, OK], [0, 2, 2, 5],
                      np.arange(5, dtype=np.float32) / 3, {1: "request 0: bad id — ü"})
    got = Results.unpack(r.to_bytes())
    assert got.call_id.tolist() == [7, 8, 9] and got.status.tolist() == [OK, INVALID, OK]
    assert np.array_equal(got.values, r.values) and got.row(2).tolist() == r.values[2:].tolist()
    assert got.errors() == {1: "request 0: bad id — ü"}
    ok = Results.unpack(Results.build([1], [OK], [0, 1], [2.0]).to_bytes())
    assert ok.errors() == {} and ok.err_text.size == 0 and ok.weights() == {}


def test_results_carry_the_weights_table_of_their_tenants():
    """Each tenant's weights tag (a sha256 in hex, or any shorter tag) crosses with the rows,
    beside failures' messages."""
    sha = "ab" * 32
    r = Results.build([7, 8], [OK, INVALID], [0, 2, 2], [1.0, 2.0], {1: "no"}).with_weights(
        {"a": 3, "b": 11}, {"a": sha, "b": "v2"})
    got = Results.unpack(r.to_bytes())
    assert got.weights() == {3: sha, 11: "v2"} and got.errors() == {1: "no"}
    assert got.values.tolist() == [1.0, 2.0] and got.status.tolist() == [OK, INVALID]


# ---- the ring ---------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from itif.hostpath.columns import Arrivals
    from itif.hostpath.ring import Producer
    handle, n = json.loads(sys.argv[1]), int(sys.argv[2])
    p = Producer.attach(handle)
    for i in range(n):
        a = Arrivals.build([i], [i % 3], [0, 1 + i % 5], np.arange(1 + i % 5) + i)
        if not p.try_put(a):  # full: back pressure; wait for a free slot
            p.put(a, timeout=30)
    print(json.dumps({"refused": p.refused}))
""")


def test_ring_across_processes_with_back_pressure_and_no_lost_batch():
    n = 120
    with Ring(slots=2, slot_bytes=256) as ring:
        handle = ring.handle("producer")
        consumer = ring.consumer()
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(handle), str(n)],
                                 pass_fds=handle["fds"], stdout=subprocess.PIPE, cwd=REPO)
        ring.close_end("producer")  # the child holds them now: its exit reads as end of file
        got = []
        try:
            while consumer.wait(timeout=30):
                time.sleep(0.001)  # a slow consumer: the child finds the ring full
                while (slot := consumer.peek()) is not None:
                    a = Arrivals.unpack(slot)
                    got.append((int(a.call_id[0]), a.ids.tolist()))
                    del a, slot
                    consumer.release()
            out, _ = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0
        assert [c for c, _ in got] == list(range(n)), "a batch was lost or reordered"
        assert all(ids == list(range(c, c + 1 + c % 5)) for c, ids in got)
        assert json.loads(out)["refused"] > 0, "the producer never saw the ring full"
        assert consumer.peer_closed
        assert consumer.wakeups <= n  # at most one wake-up a batch


def test_ring_full_refuses_and_times_out_and_frees_on_release():
    with Ring(slots=2, slot_bytes=128) as ring:
        p, c = ring.producer(), ring.consumer()
        assert p.try_put(b"a" * 10) and p.try_put(b"b" * 20)
        assert not p.try_put(b"c") and p.refused == 1
        t0 = time.monotonic()
        with pytest.raises(RingFull):
            p.put(b"c", timeout=0.05)
        assert time.monotonic() - t0 < 2
        assert c.get(timeout=1) == b"a" * 10
        assert p.try_put(b"c")
        assert [c.get(0), c.get(0), c.get(0)] == [b"b" * 20, b"c", None]
        with pytest.raises(ValueError, match="does not fit"):
            p.try_put(b"x" * 129)


# ---- the column queue -------------------------------------------------------------------------
def _fair_queue(quotas: dict[str, TenantQuota]) -> FairQueue:
    fq = FairQueue()
    for name, q in quotas.items():
        fq.set_tenant(name, q)
    return fq


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_queue_forms_the_schedulers_batches(seed):
    """Random pushes (weights, lengths, priorities, tenants going idle and back) and takes: the
    same rows in the same order as the scheduler's FairQueue, batch after batch. Weights are
    powers of two so both sums of tags are exact."""
    rng = np.random.default_rng(seed)
    names = [f"t{i}" for i in range(5)]
    quotas = {n: TenantQuota(max_queue=10_000, weight=w)
              for n, w in zip(names, (1.0, 2.0, 0.5, 4.0, 1.0))}
    fq = _fair_queue(quotas)
    cq = ColumnQueue(max_len=128, vocab=1000)
    for n in names:
        cq.add_tenant(n, quotas[n])
    seq = 0
    lengths_of: dict[int, int] = {}
    ids_of: dict[int, list[int]] = {}
    for _ in range(40):
        k = int(rng.integers(0, 12))
        tenant = rng.choice(5, k, p=[0.5, 0.2, 0.1, 0.1, 0.1])
        lengths = rng.integers(1, 60, k)
        prio = rng.integers(-1, 2, k)
        a = arrivals(tenant, lengths, call_id=np.arange(seq, seq + k), priority=prio,
                     seed=int(rng.integers(1 << 30)))
        assert (cq.push(a, now=0.0) == OK).all()
        for i in range(k):
            seq += 1
            lengths_of[seq - 1] = int(lengths[i])
            ids_of[seq - 1] = a.ids[a.offsets[i]:a.offsets[i + 1]].tolist()
            t = SchedulerTicket(None, fq.tenants[names[tenant[i]]], Request(names[tenant[i]]),
                                int(lengths[i]), int(prio[i]), None, seq - 1, 0.0)
            fq.push(t)
        for _ in range(int(rng.integers(0, 3))):
            budget, rows = int(rng.integers(20, 200)), int(rng.integers(1, 12))
            want, _ = fq.form(0.0, max_tokens=budget, max_size=rows, isolate=False,
                              estimate=None, error=lambda t, now: RuntimeError())
            got = cq.take(budget, rows, now=0.0)
            assert got.call_id.tolist() == [t.seq for t in want]
            assert [names[i] for i in got.tenant] == [t.tenant for t in want]
            assert all(got.ids[got.offsets[j]:got.offsets[j + 1]].tolist() == ids_of[c]
                       for j, c in enumerate(got.call_id.tolist()))
            assert cq.vtime == fq.vtime
    assert cq.queued == fq.queued


@pytest.mark.parametrize("sizes", [(10, 10), (16, 4)])
def test_weighted_shares_in_tokens(sizes):
    """Weights 3:1, both backlogged: served tokens ~3:1 whatever the row sizes (as
    test_scheduler asserts of the Scheduler)."""
    cq = ColumnQueue()
    cq.add_tenant("a", TenantQuota(max_queue=1000, weight=3.0))
    cq.add_tenant("b", TenantQuota(max_queue=1000, weight=1.0))
    cq.push(arrivals([0] * 300 + [1] * 300, [sizes[0]] * 300 + [sizes[1]] * 300), now=0.0)
    tok = np.zeros(2)
    for _ in range(10):
        b = cq.take(80, 100, now=0.0)
        np.add.at(tok, b.tenant, np.diff(b.offsets))
    assert tok[1] > 0 and 0.7 * 3 <= tok[0] / tok[1] <= 1.3 * 3, tok
    assert cq.tokens_run.tolist() == tok.tolist()


def test_quiet_tenant_gets_into_the_next_batch_despite_a_flood():
    cq = ColumnQueue()
    cq.add_tenant("a", TenantQuota(max_queue=64))
    cq.add_tenant("b", TenantQuota(max_queue=64))
    cq.push(arrivals([0] * 64, [10] * 64), now=0.0)
    call = 1000
    for _ in range(8):
        assert len(cq.take(10_000, 4, now=0.0)) == 4
        room = 64 - int(cq.depth[0])
        st = cq.push(arrivals([0] * (room + 3), [10] * (room + 3),
                              call_id=np.arange(call, call + room + 3)), now=0.0)
        assert (st[:room] == OK).all() and (st[room:] == EXHAUSTED).all()  # a keeps it full
        call += room + 3
        cq.push(arrivals([1], [10], call_id=[call]), now=0.0)
        assert call in cq.take(10_000, 4, now=0.0).call_id.tolist()
        call += 1


@pytest.mark.parametrize("quiet_len", [16, 32])
def test_a_tenant_back_from_idle_runs_without_the_floods_tail(quiet_len):
    """Issue 61: a tenant back from idle joins a flood. Its batch ends where its own rows'
    service ends (the flood's rows that start before its finish tag ride along, the rest wait
    for the next batch, in order), in the column queue and in the scheduler's fair queue."""
    quotas = {"noisy": TenantQuota(max_queue=1000), "quiet": TenantQuota(max_queue=1000)}
    fq = _fair_queue(quotas)
    cq = ColumnQueue()
    for n, q in quotas.items():
        cq.add_tenant(n, q)
    tickets = []

    def push(tenant: int, lengths: list[int]) -> None:
        name = ("noisy", "quiet")[tenant]
        seq = len(tickets)
        cq.push(arrivals([tenant] * len(lengths), lengths,
                         call_id=np.arange(seq, seq + len(lengths))), now=0.0)
        for n in lengths:
            t = SchedulerTicket(None, fq.tenants[name], Request(name), n, 0, None, len(tickets),
                                0.0)
            tickets.append(t)
            fq.push(t)

    def take(rows: int) -> list[tuple[str, int]]:
        want, _ = fq.form(0.0, max_tokens=8192, max_size=rows, isolate=False,
                          estimate=None, error=lambda t, now: RuntimeError())
        got = cq.take(8192, rows, now=0.0)
        assert got.call_id.tolist() == [t.seq for t in want]
        return [(t.tenant, t.seq) for t in want]

    push(0, [16] * 64)
    assert len(take(8)) == 8  # the flood alone: noisy's tag 128, the virtual time 112
    push(1, [quiet_len])
    ride = [("noisy", 8)] if quiet_len == 32 else []  # noisy's row 8 starts at 128 < 144
    assert take(256) == [("quiet", 64), *ride]
    assert cq.vtime == fq.vtime and cq.queued == fq.queued == 56 - len(ride)
    assert fq.tenants["noisy"].oldest().seq == 8 + len(ride)
    assert take(256) == [("noisy", i) for i in range(8 + len(ride), 64)]  # then the flood


def test_deadlines_expire_at_push_and_at_batch_formation():
    cq = ColumnQueue()
    cq.add_tenant("a")
    st = cq.push(arrivals([0, 0, 0], [2, 2, 2], deadline=[5.0, 1.0, np.inf]), now=2.0)
    assert st.tolist() == [OK, EXPIRED, OK]
    b = cq.take(100, 10, now=6.0)
    assert b.call_id.tolist() == [2] and b.expired_call_id.tolist() == [0]
    assert (cq.submitted[0], cq.expired[0], cq.taken[0], cq.queued) == (3, 2, 1, 0)


def test_withdrawn_calls_leave_the_queue_and_free_their_room():
    """A cancelled call's rows leave (every row of it, none of another call's), its tenant's
    room is free again at once, and a batch never holds them; withdraw() drops everything."""
    cq = ColumnQueue()
    cq.add_tenant("a", TenantQuota(max_queue=4))
    cq.add_tenant("b")
    st = cq.push(arrivals([0, 0, 0, 1, 0], [2, 3, 2, 4, 1], call_id=[7, 7, 8, 9, 10]), now=0.0)
    assert st.tolist() == [OK] * 5
    assert cq.push(arrivals([0], [2], call_id=[11]), now=0.0).tolist() == [EXHAUSTED]
    assert sorted(cq.withdraw(np.array([7, 42])).tolist()) == [7, 7]
    assert (cq.queued, cq.depth.tolist()) == (3, [2, 1])
    assert cq.push(arrivals([0, 0], [2, 2], call_id=[12, 12]), now=0.0).tolist() == [OK, OK]
    b = cq.take(100, 10, now=0.0)
    assert sorted(b.call_id.tolist()) == [8, 9, 10, 12, 12]
    cq.push(arrivals([0, 1], [2, 2], call_id=[13, 14]), now=0.0)
    assert sorted(cq.withdraw().tolist()) == [13, 14] and cq.queued == 0
    assert cq.take(100, 10, now=0.0).call_id.size == 0


def test_next_deadline_bounds_the_rows_that_expire():
    cq = ColumnQueue()
    cq.add_tenant("a")
    assert cq.next_deadline == np.inf
    cq.push(arrivals([0, 0], [2, 2], call_id=[1, 2], deadline=[5.0, 9.0]), now=0.0)
    assert cq.next_deadline == 5.0
    assert cq.expire(4.0)[0].size == 0
    assert cq.expire(6.0)[0].tolist() == [1] and cq.next_deadline == 9.0


def test_limits_refuse_rows_with_their_status():
    cq = ColumnQueue(max_len=16, vocab=100)
    cq.add_tenant("a", TenantQuota(max_queue=3, max_seq_len=8))
    cq.add_tenant("gone")
    cq.remove_tenant("gone")
    a = arrivals([0, 5, 1, 0, 0], [9, 2, 2, 0, 3], vocab=100)
    assert cq.push(a).tolist() == [INVALID, NOT_FOUND, NOT_FOUND, INVALID, OK]
    off = [0, 2, 4]
    bad_id = Arrivals.build([0, 1], [0, 0], off, [1, 2, 100, 3])
    assert cq.push(bad_id).tolist() == [OK, INVALID]
    # room for 1 more: call 7's two rows are refused together, and call 8 after it (a later
    # call never overtakes a refused one); alone, call 8 fits
    st = cq.push(arrivals([0, 0, 0], [1, 1, 1], call_id=[7, 7, 8], vocab=100))
    assert st.tolist() == [EXHAUSTED, EXHAUSTED, EXHAUSTED]
    assert cq.push(arrivals([0], [1], call_id=[8], vocab=100)).tolist() == [OK]
    assert (cq.depth[0], cq.rejected[0]) == (3, 3)
    cq2 = ColumnQueue()
    cq2.add_tenant("a", TenantQuota(max_queue=2))
    st = cq2.push(arrivals([0, 0, 0], [1, 1, 1], call_id=[1, 1, 2]))
    assert st.tolist() == [OK, OK, EXHAUSTED]


def test_parked_tenant_waits_and_comes_back():
    cq = ColumnQueue()
    cq.add_tenant("a")
    cq.add_tenant("b")
    cq.push(arrivals([0, 1], [2, 2]), now=0.0)
    cq.park("a")
    assert cq.take(100, 10, now=0.0).tenant.tolist() == [1]
    assert len(cq.take(100, 10, now=0.0)) == 0
    cq.park("a", False)
    assert cq.take(100, 10, now=0.0).tenant.tolist() == [0]


def test_triggers_on_the_columns():
    cq = ColumnQueue()
    cq.add_tenant("a", TenantQuota(latency_target_ms=100))
    def est(n, tokens):
        return 10.0

    kw = {"max_tokens": 1000, "max_rows": 4, "max_wait_ms": 5.0, "last_end": -1.0,
          "estimate_ms": est}
    assert cq.due(0.0, **kw) == (False, None)
    cq.push(arrivals([0], [3]), now=1.0)
    run, wake = cq.due(1.001, **kw)
    assert not run and wake == pytest.approx(1.005)  # lazy timeout
    assert cq.due(1.006, **kw)[0]
    assert cq.due(1.001, **{**kw, "last_end": 1.5})[0]  # hungry
    kw2 = {**kw, "max_wait_ms": 1000.0}
    assert not cq.due(1.03, **kw2)[0] and cq.due(1.041, **kw2)[0]  # guard: 1 + 0.05 - 0.01
    cq.push(arrivals([0] * 3, [3] * 3), now=1.0)
    assert cq.due(1.0, **kw2)[0]  # full


def test_rows_read_at_the_first_look_after_a_batch_run_at_once():
    """The engine's loop reads the arrival rings only between batches, so rows that came while a
    batch ran are pushed after it ended: they run at once (hungry), where they used to wait out
    max_wait_ms after every batch of a flood. Rows that come to an idle engine still wait."""
    cq = ColumnQueue()
    cq.add_tenant("a")
    kw = {"max_tokens": 1000, "max_rows": 64, "max_wait_ms": 5.0,
          "estimate_ms": lambda n, tokens: 1.0}
    assert cq.due(0.5, last_end=0.0, **kw) == (False, None)  # an idle look
    cq.push(arrivals([0], [3]), now=1.0)  # to an idle engine: the lazy timeout
    assert cq.due(1.0, last_end=0.0, **kw) == (False, pytest.approx(1.005))
    assert len(cq.take(1000, 64, now=1.005)) == 1
    # that batch ran 1.005 to 1.010; two rows came meanwhile, read at the first look after it
    cq.push(arrivals([0, 0], [3, 3], call_id=[1, 2]), now=1.0101)
    assert cq.due(1.0101, last_end=1.010, **kw) == (True, None)
    assert len(cq.take(1000, 64, now=1.0101)) == 2
    # no batch since the last look: a row that comes now waits for company as before
    assert cq.due(1.02, last_end=1.015, **kw) == (False, None)
    cq.push(arrivals([0], [3], call_id=[3]), now=1.021)
    assert cq.due(1.021, last_end=1.015, **kw) == (False, pytest.approx(1.026))


def test_compaction_keeps_every_rows_ids():
    cq = ColumnQueue()
    cq.add_tenant("a", TenantQuota(max_queue=100_000))
    rng = np.random.default_rng(5)
    expect: dict[int, list[int]] = {}
    call = 0
    for _ in range(60):
        k = int(rng.integers(50, 300))
        a = arrivals([0] * k, rng.integers(1, 300, k), call_id=np.arange(call, call + k),
                     seed=call)
        for i in range(k):
            expect[call + i] = a.ids[a.offsets[i]:a.offsets[i + 1]].tolist()
        call += k
        cq.push(a, now=0.0)
        b = cq.take(10**9, int(rng.integers(1, 400)), now=0.0)
        for j, c in enumerate(b.call_id.tolist()):
            assert b.ids[b.offsets[j]:b.offsets[j + 1]].tolist() == expect.pop(c)
    assert cq.queued == len(expect)


# ---- Engine.infer_columns ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(hf_factory):
    eng = itif.Engine("bert-tiny")
    for i, labels in enumerate((2, 5, None, 3)):
        eng.add_tenant(f"c{i}", hf_factory("bert-tiny", labels, seed=40 + i).state_dict())
    return eng


def _rows(engine, n, seed):
    rng = np.random.default_rng(seed)
    names = [f"c{i}" for i in rng.integers(0, 4, n)]
    lengths = rng.integers(1, engine.max_seq_len + 1, n)
    lengths[:2] = (1, engine.max_seq_len)
    off = np.concatenate(([0], np.cumsum(lengths)))
    ids = rng.integers(0, engine.spec.vocab_size, int(off[-1])).astype(np.int32)
    return names, ids, off


@pytest.mark.parametrize("output", [None, "pooled", "last_hidden_state", "logits", "heads"])
def test_infer_columns_equals_infer_bit_for_bit(engine, output):
    """Every output; None: each tenant's default (a mix of logits and pooled rows), "heads":
    the default of tenants that all have heads (2, 5 and 3 labels)."""
    names, ids, off = _rows(engine, 23, seed=3)
    if output in ("logits", "heads"):
        names = [t if t != "c2" else "c1" for t in names]  # c2 has no head
        output = None if output == "heads" else output
    reqs = [Request(t, input_ids=ids[off[i]:off[i + 1]],
                    outputs=None if output is None else (output,)) for i, t in enumerate(names)]
    want = engine.infer(reqs)
    table = ["zz", "c0", "c1", "c2", "c3"]  # a table with a tenant this batch lacks
    idx = np.array([table.index(t) for t in names], np.int32)
    for got in (engine.infer_columns(names, ids, off, output=output),
                engine.infer_columns(idx, ids, off, table=table, output=output)):
        assert got.weights == {t: "" for t in set(names)}
        for i, r in enumerate(want):
            field = output or ("logits" if r.logits is not None else "pooled")
            exp = getattr(r, field).reshape(-1)
            row = got.values[got.offsets[i]:got.offsets[i + 1]]
            assert row.dtype == np.float32 and row.tobytes() == exp.tobytes(), (i, field)
            assert got.logits[i] == (field == "logits")


def _same_error(engine, reqs, names, ids, off, **kw):
    with pytest.raises(Exception) as want:
        engine.infer(reqs)
    with pytest.raises(type(want.value)) as got:
        engine.infer_columns(names, ids, off, **kw)
    assert str(got.value) == str(want.value)
    return got.value


def test_infer_columns_raises_what_infer_raises(engine):
    names, ids, off = _rows(engine, 6, seed=4)

    def reqs(names=names, ids=ids, off=off, outputs=None):
        return [Request(t, input_ids=ids[off[i]:off[i + 1]], outputs=outputs)
                for i, t in enumerate(names)]

    bad = list(names)
    bad[3] = "nobody"
    assert isinstance(_same_error(engine, reqs(names=bad), bad, ids, off), TenantNotFound)
    headless = ["c0", "c1", "c2", "c3", "c0", "c1"]
    e = _same_error(engine, reqs(names=headless, outputs=("logits",)), headless, ids, off,
                    output="logits")
    assert "request 2" in str(e) and "no classification head" in str(e)
    _same_error(engine, reqs(outputs=("nope",)), names, ids, off, output="nope")
    v = ids.copy()
    v[off[4] + 0] = engine.spec.vocab_size
    e = _same_error(engine, reqs(ids=v), names, v, off)
    assert "request 4" in str(e)
    empty = off.copy()
    empty[3] = empty[2]  # row 2 empty: its ids go to row 3
    assert "request 2" in str(_same_error(engine, reqs(off=empty), names, ids, empty))
    long = np.concatenate(([0], np.cumsum([2, engine.max_seq_len + 1])))
    long_ids = np.zeros(long[-1], np.int32)
    _same_error(engine, reqs(names=["c0", "c1"], ids=long_ids, off=long), ["c0", "c1"],
                long_ids, long)
    with pytest.raises(InvalidRequest, match="offsets"):
        engine.infer_columns(names, ids, off[:-1])
    with pytest.raises(InvalidRequest, match="index 9"):
        engine.infer_columns(np.array([9] * 6), ids, off, table=["c0"])
