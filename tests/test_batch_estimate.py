"""The scheduler's learned batch-time estimate (``itif.scheduler.estimate``): it recovers a
fixed + per-request + per-token cost from measured batches, follows a drift, never goes
negative, and the running scheduler uses it (a one-request batch is not predicted as free)."""

from __future__ import annotations

import time

import numpy as np

from itif.requests import Request, Result
from itif.scheduler import Scheduler, TenantQuota
from itif.scheduler.estimate import BatchTimeEstimate


def _feed(est: BatchTimeEstimate, fixed: float, per_req: float, per_tok: float, k: int,
          seed: int = 0, noise: float = 0.05) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(k):
        n = int(rng.integers(1, 48))
        tokens = int(n * rng.integers(2, 120))
        ms = (fixed + per_req * n + per_tok * tokens) * rng.uniform(1 - noise, 1 + noise)
        est.observe(n, tokens, ms)


def test_recovers_the_three_parts_within_10_percent_on_batches_of_every_size():
    est = BatchTimeEstimate()
    _feed(est, 6.0, 0.25, 0.015, 300)
    for n, tokens in ((1, 8), (8, 400), (40, 4000)):
        truth = 6.0 + 0.25 * n + 0.015 * tokens
        assert abs(est(n, tokens) - truth) <= 0.10 * truth, (n, tokens, est(n, tokens), truth)
    # the per-token rate alone (the estimate this replaced) is wrong by 4x on one request
    assert est(1, 8) > 5.0


def test_follows_a_drift_and_stays_non_negative():
    est = BatchTimeEstimate()
    _feed(est, 2.0, 0.1, 0.01, 200)
    _feed(est, 20.0, 0.1, 0.03, 300, seed=1)  # the machine got slower
    assert abs(est(10, 1000) - (20 + 1 + 30)) <= 0.1 * 51
    est.observe(1, 10, 0.0)  # a measurement that would pull a part below zero
    assert all(v >= 0 for v in est.parts.values())
    assert est(0, 0) >= 0


def test_scheduler_learns_the_fixed_cost_of_its_forward():
    def run(batch: list[Request]) -> list[Result]:
        time.sleep(0.020 + 0.0001 * sum(len(r.input_ids) for r in batch))
        return [Result(r.tenant) for r in batch]

    with Scheduler(run, max_wait_ms=0.0) as s:
        s.set_tenant("a")
        for k in range(12):
            reqs = [Request("a", input_ids=[1] * (10 + 30 * i)) for i in range(1 + k % 4)]
            for t in s.submit_many(reqs, tokens=[len(r.input_ids) for r in reqs]):
                t.result(5)
        parts = s.stats.batch_time
    one = parts["fixed_ms"] + parts["per_request_ms"] + 10 * parts["per_token_ms"]
    assert 15.0 <= one <= 40.0, parts  # ~21 ms; the per-token model said ~0.1 ms


def test_split_puts_short_members_first_only_when_it_costs_little():
    from itif.scheduler.estimate import split_for_latency  # noqa: PLC0415

    est = lambda n, tokens: 1.0 + 0.01 * tokens  # noqa: E731
    assert split_for_latency([10] * 9 + [2000], est) == 9  # 1 ms more, 20 ms less for nine
    assert split_for_latency([100] * 10, est) is None  # equal members: nothing to gain
    assert split_for_latency([10, 2000], lambda n, t: 50.0 + 0.01 * t) is None  # fixed cost
    assert split_for_latency([5], est) is None


def test_scheduler_runs_the_short_part_of_a_split_batch_first():
    seen: list[list[int]] = []

    def run(batch: list[Request]) -> list[Result]:
        seen.append([len(r.input_ids) for r in batch])
        time.sleep(0.0005 * sum(len(r.input_ids) for r in batch))
        return [Result(r.tenant) for r in batch]

    with Scheduler(run, max_wait_ms=0.0, latency_sizing=True,
                   estimate_ms=lambda n, tokens: 0.5 + 0.01 * tokens) as s:
        s.set_tenant("a", TenantQuota(latency_target_ms=10_000))
        reqs = [Request("a", input_ids=[1] * n) for n in (3000, 8, 9, 10, 11)]
        tickets = s.submit_many(reqs, tokens=[len(r.input_ids) for r in reqs])
        for t in tickets:
            t.result(10)
    assert seen == [[8, 9, 10, 11], [3000]], seen  # one batch formed, run in two parts
    assert max(t.finished_at for t in tickets[1:]) < tickets[0].finished_at
    assert s.stats.batches == 1 and s.stats.runs == 2


def test_the_non_negative_solve_is_the_best_of_every_subset_of_parts():
    """The one-solve fast path (the guessed free parts' solution meets the KKT conditions) and
    the subset search agree with a brute force over the 7 subsets, on problems of both kinds
    (the unconstrained solution non-negative or not) and for any guess."""
    from itertools import combinations

    from itif.scheduler.estimate import _nonneg_solve

    rng = np.random.default_rng(3)
    kinds = set()
    for _ in range(300):
        m = rng.normal(size=(5, 3))
        a = m.T @ m + 1e-3 * np.eye(3)
        b = rng.normal(size=3)
        best, best_f = np.zeros(3), 0.0
        for k in (1, 2, 3):
            for idx in map(list, combinations(range(3), k)):
                sub = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
                if (sub >= 0).all():
                    theta = np.zeros(3)
                    theta[idx] = sub
                    f = theta @ a @ theta - 2 * b @ theta
                    if f < best_f:
                        best, best_f = theta, f
        kinds.add(bool((np.linalg.solve(a, b) >= 0).all()))
        np.testing.assert_allclose(_nonneg_solve(a, b), best, atol=1e-9)
        for support in ((0,), (1, 2), (0, 2), (2,)):  # a guess of the free parts, right or not
            np.testing.assert_allclose(_nonneg_solve(a, b, support), best, atol=1e-9)
    assert kinds == {True, False}
