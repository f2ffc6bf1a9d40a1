"""The fair gate (``server.max_active_calls``, ``itif.server.fairgate``): calls the server works
on at once, shared between tenants. The policy is checked here directly on the gate; the
flood it is for is measured against a real daemon by ``bench/hostile_load.py`` (figures in
docs/reliability.md), and ``test_gated_daemon_answers_every_call_and_leaks_no_place`` runs the
gate inside a real ``itif serve``."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from itif.server.fairgate import FairGate
from tests.reliability_util import (
    Daemon,
    make_tokens,
    promise,
    rel,  # noqa: F401 - the fixture, used by name
    upload_bytes,
    weights_bytes,
)


def _run(coro):
    return asyncio.run(coro)


async def _passes(gate: FairGate, tenant: str) -> bool:
    """Whether ``tenant`` gets through now (without waiting for anyone to leave)."""
    task = asyncio.ensure_future(gate.enter(tenant))
    await asyncio.sleep(0)
    if task.done():
        task.result()
        return True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return False


def test_off_lets_everything_through():
    async def main():
        gate = FairGate(lambda: 0)
        for _ in range(100):
            assert await _passes(gate, "noisy")
        assert gate.total == 100 and not gate.waiting
    _run(main())


def test_a_tenant_under_its_share_is_never_held_behind_a_flood():
    async def main():
        gate = FairGate(lambda: 4)
        admitted = [await _passes(gate, "noisy") for _ in range(6)]
        assert admitted == [True] * 4 + [False] * 2  # the limit, then noisy waits
        assert not gate.waiting  # a waiter that gave up is gone
        waiter = asyncio.ensure_future(gate.enter("noisy"))
        await asyncio.sleep(0)
        assert not waiter.done() and len(gate.waiting["noisy"]) == 1
        # quiet's share is 4 // 2 tenants = 2: it passes at once, although 4 are worked on and
        # a noisy call waits
        assert await _passes(gate, "quiet")
        assert await _passes(gate, "quiet")
        assert not await _passes(gate, "quiet")  # over its share it waits too
        assert gate.active == {"noisy": 4, "quiet": 2}
        gate.leave("quiet")  # total 5 >= 4 and noisy is over its share: noisy still waits
        await asyncio.sleep(0)
        assert not waiter.done()
        for _ in range(3):
            gate.leave("noisy")
        await asyncio.sleep(0)  # total fell under the limit: the waiting noisy call goes
        assert waiter.done() and gate.active == {"noisy": 2, "quiet": 1}
    _run(main())


def test_waiters_go_in_arrival_order_the_least_served_tenant_first():
    async def main():
        gate = FairGate(lambda: 2)
        assert await _passes(gate, "a") and await _passes(gate, "a")
        order: list[str] = []

        async def call(tenant: str, tag: str):
            await gate.enter(tenant)
            order.append(tag)

        tasks = [asyncio.ensure_future(call(t, tag)) for t, tag in
                 (("a", "a1"), ("a", "a2"), ("b", "b1"), ("b", "b2"))]
        await asyncio.sleep(0)
        # b1 passed at once (b's share is 2 // 2 = 1, and b had none); b2 is over b's share
        assert order == ["b1"]
        gate.leave("a")  # a 1 + b 1 = the limit, each at its share: nobody goes
        await asyncio.sleep(0)
        assert order == ["b1"]
        gate.leave("b")  # b has fewer worked on than a: b2 goes before a1, which came first
        await asyncio.sleep(0)
        assert order == ["b1", "b2"]
        gate.leave("a")
        await asyncio.sleep(0)
        gate.leave("a")
        await asyncio.sleep(0)
        assert order == ["b1", "b2", "a1", "a2"]  # within a tenant, arrival order
        await asyncio.gather(*tasks)
    _run(main())


def test_a_cancelled_waiter_leaks_no_place():
    async def main():
        gate = FairGate(lambda: 1)
        assert await _passes(gate, "a")
        gone = asyncio.ensure_future(gate.enter("a"))
        kept = asyncio.ensure_future(gate.enter("a"))
        await asyncio.sleep(0)
        gone.cancel()  # its client left while it waited
        await asyncio.sleep(0)
        assert gone.cancelled() and len(gate.waiting["a"]) == 1
        gate.leave("a")
        await asyncio.sleep(0)
        assert kept.done() and gate.total == 1
        # woken and cancelled in the same turn: its place goes on to the next waiter
        late = asyncio.ensure_future(gate.enter("a"))
        nxt = asyncio.ensure_future(gate.enter("a"))
        await asyncio.sleep(0)
        gate.leave("a")  # wakes `late`
        late.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert late.cancelled() and nxt.done() and gate.total == 1 and not gate.waiting
    _run(main())


def test_leave_from_another_thread_wakes_the_loop():
    """gRPC's done callbacks may come from its own threads."""
    async def main():
        gate = FairGate(lambda: 1)
        assert await _passes(gate, "a")
        waiter = asyncio.ensure_future(gate.enter("a"))
        await asyncio.sleep(0)
        t = threading.Thread(target=gate.leave, args=("a",))
        t.start()
        t.join()
        await asyncio.wait_for(waiter, 5)
        assert gate.total == 1
    _run(main())


def test_the_limit_is_read_live():
    async def main():
        limit = [1]
        gate = FairGate(lambda: limit[0])
        assert await _passes(gate, "a")
        assert not await _passes(gate, "a")
        limit[0] = 3
        assert await _passes(gate, "a") and await _passes(gate, "a")
        assert not await _passes(gate, "a")
        limit[0] = 0
        assert await _passes(gate, "a")
    _run(main())


TOKENS = make_tokens(["quiet", "noisy"])


def test_gated_daemon_answers_every_call_and_leaks_no_place(tmp_path):
    """A real ``itif serve`` with ``max_active_calls: 2``: 60 concurrent calls of noisy and 10
    of quiet (most of them wait at the gate) all answer OK with the same outputs as one call
    alone; a second round passes too, so no call kept its place (with a leak, the second round
    would wait at the gate forever)."""
    d = Daemon(tmp_path, dict(TOKENS), scheduler={"max_wait_ms": 2},
               server_extra={"max_active_calls": 2})
    d.start()
    try:
        for i, (tid, tok) in enumerate(TOKENS.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(500 + i))
        ids = list(range(1, 17))
        with d.client(TOKENS["quiet"]) as q, d.client(TOKENS["noisy"]) as n:
            alone = {"quiet": q.infer("quiet", ids, timeout=30),
                     "noisy": n.infer("noisy", ids, timeout=30)}
            for _ in range(2):
                with ThreadPoolExecutor(32) as pool:
                    futs = ([("noisy", pool.submit(n.infer, "noisy", ids, timeout=60))
                             for _ in range(60)]
                            + [("quiet", pool.submit(q.infer, "quiet", ids, timeout=60))
                               for _ in range(10)])
                    for tenant, f in futs:
                        out = f.result()
                        for k, v in alone[tenant].items():
                            np.testing.assert_allclose(out[k], v, rtol=1e-5, atol=1e-6)
    finally:
        d.stop()


@promise(32)
def test_a_gated_daemon_keeps_the_quiet_tenant_fast_under_a_flood(tmp_path, rel):
    """Issue 15 item 4 with the gate on (``max_active_calls: 4``, every other setting at its
    default, 100 streams per connection): noisy keeps 256 calls in flight from another process
    (closed loop) while quiet calls every 50 ms. Quiet: every call OK, and the median over three
    rounds of p99(flood)/p99(idle) at most 10 (measured 2.0-2.4 on a quiet 2-core machine, 6.0
    right after test_overload's floods; 16-30 with the gate off, as the default leaves it)."""
    from bench.hostile_load import flood_ratio, flood_rounds  # noqa: PLC0415

    d = Daemon(tmp_path / "d", dict(TOKENS), scheduler={"max_wait_ms": 2},
               server_extra={"max_active_calls": 4})
    d.start()
    try:
        for i, (tid, tok) in enumerate(TOKENS.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(600 + i))
        rounds = flood_rounds(d, TOKENS["quiet"], TOKENS["noisy"], tmp_path / "flood")
    finally:
        d.stop()
    assert all(r["flood codes"].get("OK", 0) >= 100 for r in rounds), rounds  # served, gated
    ratio = flood_ratio(rounds, rel, "rounds (default settings, max_active_calls 4)")
    assert ratio <= 10.0, rounds
