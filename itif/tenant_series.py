"""Per-tenant Prometheus series counted in bulk: one numpy row a tenant.

prometheus_client's labelled Histogram takes one observation a call, so a column batch of 20
rows (``itif.server.column_door``) cost 60 calls through its child lookup, lock and bucket search
on the engine's thread. The series here keep their counts in numpy arrays, a row a tenant (and a
column a bucket or an outcome), and take a whole batch as one list append, folded into the arrays
by one numpy pass at the next scrape (or every ``FOLD_EVERY`` batches), whatever its size:
:meth:`TenantHistogram.observe_rows` and :meth:`TenantCounter.inc_rows`, with the row of each
tenant from :meth:`TenantRows.rows_of` (cached for a table that only grows, as the column
queue's). The ticket path's one observation at a time goes through the same arrays.

They are exported by :class:`SeriesCollector`, registered once in the daemon's registry; the
text a scrape reads is what prometheus_client's own Histogram and Counter write
(``<name>_bucket{tenant,le}``, ``_count``, ``_sum``; ``<name>_total``).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterable, Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["SeriesCollector", "TenantCounter", "TenantHistogram", "TenantRows"]


class TenantRows:
    """Tenant name -> row of a numpy table; rows of removed tenants are not reused (a later
    tenant of the same name starts from zero, as a removed prometheus child does)."""

    FOLD_EVERY = 256

    def __init__(self, width: int) -> None:
        self._rows: dict[str, int] = {}
        self._width = width
        self.data = np.zeros((8, width), np.float64)
        self._high = 0  # rows handed out
        #: batches not yet folded into ``data``: a batch costs an append; a scrape (or every
        #: FOLD_EVERY batches) folds them with one numpy pass
        self._pending: list[tuple[np.ndarray, Any]] = []
        self._lock = threading.Lock()
        self._version = 0  # bumped by a removal: cached row maps go stale
        self._cache: tuple[int, int, int, np.ndarray] = (0, -1, -1, np.zeros(0, np.intp))

    def _row_locked(self, tenant: str) -> int:
        row = self._rows.get(tenant)
        if row is None:
            row = self._rows[tenant] = self._next_row()
        return row

    def _next_row(self) -> int:
        row, self._high = self._high, self._high + 1
        if row >= self.data.shape[0]:
            grown = np.zeros((2 * self.data.shape[0], self._width), self.data.dtype)
            grown[:self.data.shape[0]] = self.data
            self.data = grown
        return row

    def rows_of(self, names: Sequence[str]) -> np.ndarray:
        """The row of each name of ``names``, a table that only grows (the column queue's):
        computed again only when it grew or a tenant was removed."""
        with self._lock:
            key = (id(names), len(names), self._version)
            if self._cache[:3] != key:
                self._cache = (*key, np.array([self._row_locked(n) for n in names], np.intp))
            return self._cache[3]

    def _defer(self, rows: np.ndarray, what: Any) -> None:
        with self._lock:
            self._pending.append((rows, what))
            if len(self._pending) >= self.FOLD_EVERY:
                self._fold_locked()

    def _fold_locked(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._fold(pending)

    def _fold(self, pending: list[tuple[np.ndarray, Any]]) -> None:
        raise NotImplementedError

    def remove(self, tenant: str) -> None:
        with self._lock:
            self._fold_locked()  # the batches before the removal counted the old tenant
            row = self._rows.pop(tenant, None)
            if row is not None:
                self.data[row] = 0
                self._version += 1

    def items(self) -> list[tuple[str, np.ndarray]]:
        """(tenant, a copy of its row), for a scrape."""
        with self._lock:
            self._fold_locked()
            return [(t, self.data[r].copy()) for t, r in self._rows.items()]


class TenantHistogram(TenantRows):
    """A histogram labelled by tenant: a row a tenant of per-bucket counts (the last bucket is
    +Inf) and the sum in the last column."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be strictly increasing, got {buckets}")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        super().__init__(len(bounds) + 1)
        self.name, self.documentation = name, documentation
        self.bounds = np.array(bounds)

    def observe(self, tenant: str, value: float) -> None:
        """One observation (the ticket path's rows)."""
        b = int(np.searchsorted(self.bounds, value))  # the first bound >= value: le semantics
        with self._lock:
            row = self._row_locked(tenant)
            self.data[row, b] += 1
            self.data[row, -1] += value

    def observe_rows(self, rows: np.ndarray, values: np.ndarray | float) -> None:
        """One observation a row of a batch: ``rows`` the tenant rows (:meth:`rows_of`),
        ``values`` one each or one for all."""
        self._defer(rows, values)

    def _fold(self, pending: list[tuple[np.ndarray, Any]]) -> None:
        rows = np.concatenate([r for r, _ in pending])
        values = np.concatenate([np.broadcast_to(np.asarray(v, np.float64), r.shape)
                                 for r, v in pending])
        np.add.at(self.data, (rows, np.searchsorted(self.bounds, values)), 1)
        np.add.at(self.data[:, -1], rows, values)

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=("tenant",))
        les = [floatToGoString(b) for b in self.bounds]
        for tenant, row in self.items():
            cum = np.cumsum(row[:-1])
            fam.add_metric((tenant,), list(zip(les, cum.tolist())), float(row[-1]))
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
        self._defer(rows, self.column(value))

    def _fold(self, pending: list[tuple[np.ndarray, Any]]) -> None:
        rows = np.concatenate([r for r, _ in pending])
        cols = np.concatenate([np.full(r.size, c, np.intp) for r, c in pending])
        np.add.at(self.data, (rows, cols), 1)

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.documentation, labels=("tenant", self.label))
        for tenant, row in self.items():
            for value, count in zip(self.values, row.tolist()):
                if count:
                    fam.add_metric((tenant, value), count)
        return fam


class SeriesCollector(Collector):
    """Exports ``series`` (:class:`TenantHistogram`, :class:`TenantCounter`) at each scrape."""

    def __init__(self, series: Iterable[TenantRows]) -> None:
        self.series = tuple(series)

    def collect(self):
        for s in self.series:
            yield s.family()

    def describe(self):  # names known without a scrape (the registry checks duplicates)
        for s in self.series:
            yield (HistogramMetricFamily if isinstance(s, TenantHistogram)
                   else CounterMetricFamily)(s.name, s.documentation,
                                             labels=_labels(s))


def _labels(s: TenantRows) -> tuple[str, ...]:
    return ("tenant",) if isinstance(s, TenantHistogram) else ("tenant", s.label)
