"""itif.tenant_series: per-tenant series counted in bulk export what prometheus_client's own
Histogram and Counter export for the same observations."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest

from itif.tenant_series import SeriesCollector, TenantCounter, TenantHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)
CODES = ("OK", "NOT_FOUND", "UNKNOWN")


def _lines(registry: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if line and not line.startswith("#"))


def _pair():
    disable_created_metrics()
    ref, mine = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", ("tenant",), buckets=BUCKETS, registry=ref)
    c = Counter("x_rows", "doc", ("tenant", "code"), registry=ref)
    th = TenantHistogram("x_seconds", "doc", BUCKETS)
    tc = TenantCounter("x_rows", "doc", "code", CODES)
    mine.register(SeriesCollector((th, tc)))
    return ref, mine, h, c, th, tc


def test_bulk_and_single_observations_export_as_prometheus_client_does():
    ref, mine, h, c, th, tc = _pair()
    th.FOLD_EVERY = tc.FOLD_EVERY = 2  # folds between batches and at the scrape
    rng = np.random.default_rng(0)
    names = [f"t{i}" for i in range(20)]  # more than the first allocation of rows
    for _ in range(5):  # batches: a table index a row, one value a row
        idx = rng.integers(0, len(names), 30)
        vals = rng.exponential(0.05, 30)
        vals[:3] = (0.01, 1.0, 5.0)  # on a bound (le: counted in it) and past the last
        for i, v in zip(idx.tolist(), vals.tolist()):
            h.labels(names[i]).observe(v)
            c.labels(names[i], "OK").inc()
        th.observe_rows(th.rows_of(names)[idx], vals)
        tc.inc_rows(tc.rows_of(names)[idx], "OK")
    th.observe("solo", 0.2)
    h.labels("solo").observe(0.2)
    tc.inc("solo", "NOT_FOUND")
    c.labels("solo", "NOT_FOUND").inc()
    th.observe_rows(th.rows_of(names)[np.array([4, 4])], 0.003)  # one value for all rows
    h.labels("t4").observe(0.003)
    h.labels("t4").observe(0.003)
    got, want = _lines(mine), _lines(ref)
    assert got == want
    assert any(line.startswith('x_seconds_bucket{le="+Inf",tenant="t4"}') for line in got)


def test_a_removed_tenant_drops_out_and_a_new_one_of_its_name_starts_at_zero():
    ref, mine, h, c, th, tc = _pair()
    names = ["a", "b"]
    th.observe_rows(th.rows_of(names)[np.array([0, 1, 1])], 0.5)
    tc.inc_rows(tc.rows_of(names)[np.array([0, 1, 1])], "OK")
    th.remove("b")
    tc.remove("b")
    assert not any('tenant="b"' in line for line in _lines(mine))
    th.observe_rows(th.rows_of(names)[np.array([1])], 0.05)  # the cached map is stale: redone
    tc.inc_rows(tc.rows_of(names)[np.array([1])], "OK")
    h.labels("a").observe(0.5)
    h.labels("b").observe(0.05)
    c.labels("a", "OK").inc()
    c.labels("b", "OK").inc()
    assert _lines(mine) == _lines(ref)


def test_an_outcome_outside_the_set_counts_as_the_catch_all():
    _, mine, _, _, _, tc = _pair()
    tc.inc("a", "NOT_A_CODE")
    assert 'x_rows_total{code="UNKNOWN",tenant="a"} 1.0' in _lines(mine)
