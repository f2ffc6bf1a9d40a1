"""Prometheus series counted in bulk: numpy counts, and the column path's batches logged.

prometheus_client's Histogram takes one observation a call (a child lookup, a lock and a bucket
search in Python each), so a column batch of 20 rows (``itif.server.column_door``) cost some 65
calls on the engine's thread. Here:

- :class:`TenantHistogram` and :class:`TenantCounter` keep per-tenant counts in numpy arrays, a
  row a tenant (:class:`TenantRows`; :meth:`TenantRows.rows_of` maps a table of names that only
  grows, as the column queue's, to rows, cached), a column a bucket or an outcome;
  :class:`BatchHistogram` and :class:`BatchCounter` are the unlabelled kind. Each takes one
  observation (the ticket path) or a batch of them in a few numpy calls.
- :class:`ColumnSeries` holds every series the column path feeds. A column batch is one list
  append (:meth:`ColumnSeries.log`); the log is folded into the series by one pass of numpy per
  series at each scrape (and every ``FOLD_EVERY`` batches), before they are exported.

A scrape reads what prometheus_client's own Histogram and Counter write (``<name>_bucket{le}``,
``_count``, ``_sum``; ``<name>_total``).
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["BatchCounter", "BatchHistogram", "ColumnSeries", "TenantCounter",
           "TenantHistogram", "TenantRows"]


def _bounds(name: str, buckets: Sequence[float]) -> np.ndarray:
    bounds = [float(b) for b in buckets]
    if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
        raise ValueError(f"{name}: buckets must be strictly increasing, got {buckets}")
    if not bounds or bounds[-1] != math.inf:
        bounds.append(math.inf)
    return np.array(bounds)


def _buckets(bounds: np.ndarray, counts: np.ndarray) -> list[tuple[str, float]]:
    """(le, cumulative count) of each bucket, as a histogram family takes them."""
    return list(zip((floatToGoString(b) for b in bounds), np.cumsum(counts).tolist()))


class TenantRows:
    """Tenant name -> row of a numpy table; rows of removed tenants are not reused (a later
    tenant of the same name starts from zero, as a removed prometheus child does)."""

    def __init__(self, width: int) -> None:
        self._rows: dict[str, int] = {}
        self._width = width
        self.data = np.zeros((8, width), np.float64)
        self._high = 0  # rows handed out
        self._lock = threading.Lock()
        self._version = 0  # bumped by a removal: cached row maps go stale
        self._cache: tuple[int, int, int, np.ndarray] = (0, -1, -1, np.zeros(0, np.intp))

    def _row_locked(self, tenant: str) -> int:
        row = self._rows.get(tenant)
        if row is None:
            row, self._high = self._high, self._high + 1
            if row >= self.data.shape[0]:
                grown = np.zeros((2 * self.data.shape[0], self._width), self.data.dtype)
                grown[:self.data.shape[0]] = self.data
                self.data = grown
            self._rows[tenant] = row
        return row

    def rows_of(self, names: Sequence[str]) -> np.ndarray:
        """The row of each name of ``names``, a table that only grows (the column queue's):
        computed again only when it grew or a tenant was removed."""
        with self._lock:
            key = (id(names), len(names), self._version)
            if self._cache[:3] != key:
                self._cache = (*key, np.array([self._row_locked(n) for n in names], np.intp))
            return self._cache[3]

    def remove(self, tenant: str) -> None:
        with self._lock:
            row = self._rows.pop(tenant, None)
            if row is not None:
                self.data[row] = 0
                self._version += 1

    def items(self) -> list[tuple[str, np.ndarray]]:
        """(tenant, a copy of its row), for a scrape."""
        with self._lock:
            return [(t, self.data[r].copy()) for t, r in self._rows.items()]


class TenantHistogram(TenantRows):
    """A histogram labelled by tenant: a row a tenant of per-bucket counts (the last bucket is
    +Inf) and the sum in the last column."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.bounds = _bounds(name, buckets)
        super().__init__(self.bounds.size + 1)
        self.name, self.documentation = name, documentation

    def observe(self, tenant: str, value: float) -> None:
        """One observation (the ticket path's rows)."""
        b = int(np.searchsorted(self.bounds, value))  # the first bound >= value: le semantics
        with self._lock:
            row = self._row_locked(tenant)
            self.data[row, b] += 1
            self.data[row, -1] += value

    def observe_rows(self, rows: np.ndarray, values: np.ndarray | float) -> None:
        """One observation a row: ``rows`` the tenant rows (:meth:`rows_of`), ``values`` one
        each or one for all."""
        values = np.broadcast_to(np.asarray(values, np.float64), rows.shape)
        buckets = np.searchsorted(self.bounds, values)
        with self._lock:
            np.add.at(self.data, (rows, buckets), 1)
            np.add.at(self.data[:, -1], rows, values)

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=("tenant",))
        for tenant, row in self.items():
            fam.add_metric((tenant,), _buckets(self.bounds, row[:-1]), float(row[-1]))
        return fam


class TenantCounter(TenantRows):
    """A counter labelled by tenant and one more label of a fixed set of values (an outcome:
    ``code``), the last of them the catch-all: a row a tenant, a column a value."""

    def __init__(self, name: str, documentation: str, label: str, values: Sequence[str]) -> None:
        super().__init__(len(values))
        self.name, self.documentation, self.label = name, documentation, label
        self.values = tuple(values)
        self._column = {v: i for i, v in enumerate(self.values)}

    def column(self, value: str) -> int:
        """``value``'s column; one outside the set counts as the set's last value (a metric
        never fails the call it counts)."""
        return self._column.get(value, len(self.values) - 1)

    def inc(self, tenant: str, value: str, amount: float = 1.0) -> None:
        col = self.column(value)
        with self._lock:
            self.data[self._row_locked(tenant), col] += amount

    def inc_rows(self, rows: np.ndarray, value: str) -> None:
        """One each for ``rows`` (tenant rows, :meth:`rows_of`), at ``value``."""
        col = self.column(value)
        with self._lock:
            np.add.at(self.data[:, col], rows, 1)

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.documentation, labels=("tenant", self.label))
        for tenant, row in self.items():
            for value, count in zip(self.values, row.tolist()):
                if count:
                    fam.add_metric((tenant, value), count)
        return fam


class BatchHistogram:
    """An unlabelled histogram (a batch's size, tokens, padding) taking one value or many."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = _bounds(name, buckets)
        self._counts = np.zeros(self.bounds.size)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        self.observe_many(np.array((value,), np.float64))

    def observe_many(self, values: np.ndarray) -> None:
        counts = np.bincount(np.searchsorted(self.bounds, values), minlength=self.bounds.size)
        with self._lock:
            self._counts += counts
            self._sum += float(values.sum())

    def family(self) -> HistogramMetricFamily:
        with self._lock:
            counts, total = self._counts.copy(), self._sum
        return HistogramMetricFamily(self.name, self.documentation,
                                     buckets=_buckets(self.bounds, counts), sum_value=total)


class BatchCounter:
    """An unlabelled counter."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0.0
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, value=self.value)


class ColumnSeries(Collector):
    """The series a column batch feeds, and the log of batches not yet folded into them; the
    ticket path feeds the same series one observation at a time. Registered in the daemon's
    registry: a scrape folds the log, then exports every series."""

    #: A fold runs on the caller's thread (the engine's): ~5 us a batch logged, so a fold
    #: every 32 batches stalls a batch ~0.2 ms (every 256: 1-4 ms, a quiet tenant's p99 under
    #: a flood), for ~1 us a batch more than folding at the scrape alone
    FOLD_EVERY = 32

    def __init__(self, *, rows: TenantCounter, queue_seconds: TenantHistogram,
                 compute_seconds: TenantHistogram, batch_size: BatchHistogram,
                 batch_tokens: BatchHistogram, batch_padding: BatchHistogram,
                 column_rows: BatchCounter, column_forward_cpu: BatchCounter) -> None:
        self.rows, self.queue_seconds, self.compute_seconds = rows, queue_seconds, compute_seconds
        self.batch_size, self.batch_tokens, self.batch_padding = (batch_size, batch_tokens,
                                                                  batch_padding)
        self.column_rows, self.column_forward_cpu = column_rows, column_forward_cpu
        self._log: list[tuple] = []
        self._log_lock = threading.Lock()
        self._fold_lock = threading.Lock()

    def series(self) -> tuple:
        return (self.rows, self.queue_seconds, self.compute_seconds, self.batch_size,
                self.batch_tokens, self.batch_padding, self.column_rows, self.column_forward_cpu)

    def log(self, names: Sequence[str], tenant: np.ndarray, queued_s: np.ndarray,
            compute_s: float, tokens: int, forward_cpu_s: float, computed_rows: int) -> None:
        """A column batch, answered OK: ``tenant`` a table index a row (``names``: the table),
        ``queued_s`` each row's wait, ``compute_s`` the batch's time, ``tokens`` its real
        tokens, ``computed_rows`` the token rows its forward computed (0: unknown)."""
        with self._log_lock:
            self._log.append((names, tenant, queued_s, compute_s, tokens, forward_cpu_s,
                              computed_rows))
            full = len(self._log) >= self.FOLD_EVERY
        if full:
            self.fold()

    def fold(self) -> None:
        """The logged batches into the series: a loop over batches, a numpy call a series."""
        with self._fold_lock:
            with self._log_lock:
                log, self._log = self._log, []
            if not log:
                return
            sizes = np.array([e[1].size for e in log], np.int64)
            rows = np.concatenate([self.rows.rows_of(e[0])[e[1]] for e in log])
            self.rows.inc_rows(rows, "OK")
            rows = np.concatenate([self.queue_seconds.rows_of(e[0])[e[1]] for e in log])
            self.queue_seconds.observe_rows(rows, np.concatenate([e[2] for e in log]))
            rows = np.concatenate([self.compute_seconds.rows_of(e[0])[e[1]] for e in log])
            self.compute_seconds.observe_rows(rows, np.repeat([e[3] for e in log], sizes))
            tokens = np.array([e[4] for e in log], np.float64)
            computed = np.array([e[6] for e in log], np.float64)
            self.batch_size.observe_many(sizes.astype(np.float64))
            self.batch_tokens.observe_many(tokens)
            known = computed > 0
            self.batch_padding.observe_many((computed[known] - tokens[known]) / computed[known])
            self.column_rows.inc(float(sizes.sum()))
            self.column_forward_cpu.inc(float(sum(e[5] for e in log)))

    def collect(self):
        self.fold()
        for s in self.series():
            yield s.family()

    def describe(self):  # the names, without a fold (the registry checks duplicates)
        for s in self.series():
            labels = (("tenant",) if isinstance(s, TenantHistogram) else
                      ("tenant", s.label) if isinstance(s, TenantCounter) else ())
            kind = (HistogramMetricFamily if isinstance(s, (TenantHistogram, BatchHistogram))
                    else CounterMetricFamily)
            yield kind(s.name, s.documentation, labels=labels)

    def remove_tenant(self, tenant: str) -> None:
        """Drop ``tenant``'s series (the batches logged before count for it first)."""
        self.fold()
        for s in (self.rows, self.queue_seconds, self.compute_seconds):
            s.remove(tenant)
