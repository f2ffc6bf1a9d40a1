"""bench/hostpath_cost.py: the engine side of the column path replayed from a schedule."""

from __future__ import annotations

import argparse

import numpy as np

from tests.bench_scripts import load


def _module():
    return load("hostpath_cost")


def test_a_step_that_finds_its_rows_already_taken_is_skipped_and_every_row_runs():
    """The schedule pushes the front ends' ring batches in send order and the replay reads them
    ring by ring, so the run-ahead tail rule can split batches differently and a step can find
    nothing queued (a 3 s run at 1,000 req/s did, at its 115th step, and the bench stopped on an
    assertion). Such a step is skipped, rows left after the last step run, every request is
    answered once (the bench asserts it reads back every batch's call ids)."""
    hc = _module()
    import itif

    engine = itif.Engine("bert-tiny")
    names = ["t0", "t1"]
    for i, t in enumerate(names):
        engine.add_tenant(t, hc.tenant_weights(engine.spec, i))
    args = argparse.Namespace(rate=400.0, seconds=0.1, tenants=2, frontends=2, flush_ms=1.0)
    sent = hc.frames(args, engine.spec, np.random.default_rng(0))
    n_req = sum(len(a) for _, _, a in sent)
    quota = hc.TenantQuota(max_queue=100_000)
    steps = hc.schedule(engine, names, sent, quota)
    assert steps and n_req > 0
    for replay in ([s for step in steps for s in (step, step)],  # the second finds none
                   [steps[-1]]):  # every ring batch at once: batches left after the step
        rings = {"in": [hc.Ring(slots=len(sent) + 1, slot_bytes=64 << 10) for _ in range(2)],
                 "out": hc.Ring(slots=4, slot_bytes=4 << 20)}
        try:
            cpu = hc.engine_side(engine, names, sent, replay, quota, rings)
        finally:
            for r in [*rings["in"], rings["out"]]:
                r.close()
        assert cpu["rows"] == n_req
        assert cpu["batches"] >= 1
        assert cpu["infer_columns"] > 0 and cpu["read_push"] > 0
