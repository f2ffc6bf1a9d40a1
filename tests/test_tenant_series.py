"""itif.tenant_series: series counted in bulk (and the column path's logged batches) export
what prometheus_client's own Histogram and Counter export for the same observations."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest

from itif.tenant_series import (
    BatchCounter,
    BatchHistogram,
    ColumnSeries,
    TenantCounter,
    TenantHistogram,
)

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
    mine.register(_Collector(th, tc))
    return ref, mine, h, c, th, tc


class _Collector:
    def __init__(self, *series):
        self.series = series

    def collect(self):
        return [s.family() for s in self.series]


def test_bulk_and_single_observations_export_as_prometheus_client_does():
    ref, mine, h, c, th, tc = _pair()
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


def test_logged_column_batches_export_as_prometheus_client_does_when_observed_one_by_one():
    """ColumnSeries.log, folded every 3 batches and at the scrape, against the same
    observations made row by row on prometheus_client's series (as the ticket path does)."""
    disable_created_metrics()
    ref, mine = CollectorRegistry(), CollectorRegistry()
    h = {k: Histogram(f"c_{k}", "doc", ("tenant",), buckets=BUCKETS, registry=ref)
         for k in ("queue", "compute")}
    rows = Counter("c_rows", "doc", ("tenant", "code"), registry=ref)
    size = Histogram("c_size", "doc", buckets=(1, 4, 16), registry=ref)
    toks = Histogram("c_tokens", "doc", buckets=(16, 256), registry=ref)
    pad = Histogram("c_pad", "doc", buckets=(0.0, 0.5, 1.0), registry=ref)
    n_rows, cpu = Counter("c_col_rows", "doc", registry=ref), Counter("c_cpu", "doc", registry=ref)
    cs = ColumnSeries(
        rows=TenantCounter("c_rows", "doc", "code", CODES),
        queue_seconds=TenantHistogram("c_queue", "doc", BUCKETS),
        compute_seconds=TenantHistogram("c_compute", "doc", BUCKETS),
        batch_size=BatchHistogram("c_size", "doc", (1, 4, 16)),
        batch_tokens=BatchHistogram("c_tokens", "doc", (16, 256)),
        batch_padding=BatchHistogram("c_pad", "doc", (0.0, 0.5, 1.0)),
        column_rows=BatchCounter("c_col_rows", "doc"),
        column_forward_cpu=BatchCounter("c_cpu", "doc"))
    cs.FOLD_EVERY = 3
    mine.register(cs)
    rng = np.random.default_rng(1)
    names = ["a", "b", "c"]
    for k in range(8):
        if k == 4:
            names.append("d")  # the table grew: its row map is computed again
        n = int(rng.integers(1, 20))
        tenant = rng.integers(0, len(names), n)
        queued = rng.exponential(0.02, n)
        compute, tokens, computed = float(rng.exponential(0.01)), 30 * n, 40 * n * (k % 2)
        cs.log(names, tenant, queued, compute, tokens, 0.125 * k, computed)  # exact sums
        for t, q in zip(tenant.tolist(), queued.tolist()):
            rows.labels(names[t], "OK").inc()
            h["queue"].labels(names[t]).observe(q)
            h["compute"].labels(names[t]).observe(compute)
        size.observe(n)
        toks.observe(tokens)
        if computed:
            pad.observe((computed - tokens) / computed)
        n_rows.inc(n)
        cpu.inc(0.125 * k)
    cs.rows.inc("a", "NOT_FOUND")  # the ticket path's, one at a time, into the same series
    rows.labels("a", "NOT_FOUND").inc()
    cs.batch_size.observe(2)
    size.observe(2)
    got, want = _lines(mine), _lines(ref)
    assert got == want
    cs.remove_tenant("b")
    assert not any('tenant="b"' in line for line in _lines(mine))


def test_the_daemons_row_outcomes_are_the_grpc_codes_with_unknown_as_the_catch_all():
    import grpc

    from itif.metrics import Metrics

    rows = Metrics(None, nvml=None).columns.rows
    assert set(rows.values) == {c.name for c in grpc.StatusCode}
    assert rows.values[rows.column("NOT_A_CODE")] == "UNKNOWN"
    assert rows.values[rows.column("RESOURCE_EXHAUSTED")] == "RESOURCE_EXHAUSTED"
