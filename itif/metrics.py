"""Prometheus metrics and per-tenant inference statistics.

One :class:`Metrics` object per daemon (``daemon.metrics``, set by ``itif.server.app``). It is fed
from three places and read by two:

- ``itif.server.call_metrics.MetricsInterceptor``, the first gRPC interceptor, sees the final
  status of every call on every service (itif.v1, KServe v2, health), refusals by the auth
  interceptor included: this is the ONE place where calls are counted by status code. The
  tenant label is the tenant the daemon authorised the call for (:meth:`Metrics.note_tenant`,
  which ``Daemon.identify`` and ``Daemon._visible`` call through ``daemon.metrics``, an
  ``itif.observer.DaemonObserver``): the target tenant once the caller may see it, else the
  calling tenant, else ``""`` (the admin, an unauthenticated caller, a probe). Names a caller
  may not see never become labels, so a client cannot grow the label set.
- ``Daemon.submit`` hands each accepted call's tickets to :meth:`Metrics.watch`: queue and compute
  time per row (histograms) and per-call counts and durations (KServe ModelStatistics).
- The scheduler runs batches through :meth:`Metrics.run_batch`: batch size, tokens, padding.

Gauges (queue depth, weight bytes, tenant state, config reloads, GPU) are computed at scrape time
by a collector that reads the daemon's state, so nothing has to keep them up to date. GPU
utilisation and memory come from NVML (``itif.platform.nvml``); without NVML they are not exported.

The HTTP endpoint (``server.metrics_listen``, any path, e.g. ``/metrics``) serves a private
registry, so nothing else in the process leaks into it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from itif import platform
from itif.daemon import Daemon, State
from itif.tenant_series import (
    BatchCounter,
    BatchHistogram,
    ColumnSeries,
    TenantCounter,
    TenantHistogram,
)

if TYPE_CHECKING:  # pragma: no cover
    from itif.requests import Request, Result
    from itif.runtime.engine import Engine
    from itif.scheduler import SchedulerTicket

log = logging.getLogger("itif.metrics")

__all__ = ["Metrics", "TenantCallStats", "call_tenant", "note_tenant",
           "METRIC_NAMES"]

#: Every metric itif exports (docs/ecosystem.md has the table).
METRIC_NAMES = (
    "itif_requests_total",
    "itif_request_duration_seconds",
    "itif_http_requests_total",
    "itif_http_request_duration_seconds",
    "itif_inference_rows_total",
    "itif_queue_seconds",
    "itif_compute_seconds",
    "itif_batch_size",
    "itif_batch_tokens",
    "itif_batch_padding_ratio",
    "itif_queue_depth",
    "itif_tenant_weight_bytes",
    "itif_tenant_exclusive_weight_bytes",
    "itif_tenant_state",
    "itif_weight_store_bytes",
    "itif_ready",
    "itif_config_reloads_total",
    "itif_gpu_utilization_ratio",
    "itif_gpu_memory_used_bytes",
    "itif_gpu_memory_total_bytes",
    "itif_kernel_fallback",
    "itif_generation_time_to_first_token_seconds",
    "itif_generation_inter_token_seconds",
    "itif_generated_tokens_total",
    "itif_tenant_tier",
    "itif_tenant_promotions_total",
    "itif_tenant_evictions_total",
    "itif_tier_bytes",
    "itif_tier_budget_bytes",
    "itif_tier_tenants",
    "itif_tier_promotions_total",
    "itif_tier_promotion_seconds",
    "itif_tier_evictions_total",
)

# ---- the tenant of the current call -----------------------------------------------------------
#: The tenant holder ``[tenant]`` of the current counted call (the gRPC counter in
#: ``itif.server.call_metrics`` and :func:`call_tenant` set it; :func:`note_tenant` fills it).
CALL_TENANT: ContextVar[list[str] | None] = ContextVar("itif_call_tenant", default=None)


def note_tenant(tenant: str | None) -> None:
    """Record the tenant the current gRPC call is for (no-op outside a counted call).

    The holder is a list shared by reference, so a note made inside ``asyncio.to_thread`` (which
    runs in a copy of the context) still reaches the call's counter."""
    holder = CALL_TENANT.get()
    if holder is not None and tenant:
        holder[0] = tenant


@contextlib.contextmanager
def call_tenant() -> Iterator[list[str]]:
    """Count a call that no gRPC interceptor sees (an HTTP request): inside, ``note_tenant``
    records into the holder it yields (``[""]`` until the daemon names a tenant)."""
    holder = [""]
    token = CALL_TENANT.set(holder)
    try:
        yield holder
    finally:
        CALL_TENANT.reset(token)


def status_code_name(code: Any) -> str | None:
    """The name of a gRPC status code (a ``grpc.StatusCode`` or the raw integer the aio context
    may report), None for none."""
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    for c in grpc.StatusCode:  # the aio context may report the raw integer
        if c.value[0] == code:
            return c.name
    return "UNKNOWN"


# ---- per-tenant call statistics (KServe ModelStatistics) --------------------------------------
@dataclass(frozen=True)
class TenantCallStats:
    """Counts and cumulative durations (ns) of one tenant's inference calls since start.

    A call is one Infer/InferBatch/ModelInfer that was accepted into the queue (all its rows);
    ``inferences`` counts rows of successful calls, ``executions`` the fused batches that ran at
    least one of the tenant's rows. A call's queue time is its slowest row's wait, its compute
    time its slowest row's compute, its duration submit to last row done."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    queue: int = 0
    queue_ns: int = 0
    compute: int = 0
    compute_ns: int = 0
    inferences: int = 0
    executions: int = 0
    last_inference_ms: int = 0  # wall clock, ms since the epoch; 0 = never


class _CallWatch:
    __slots__ = ("tenant", "tickets", "left")

    def __init__(self, tenant: str, tickets: Sequence[SchedulerTicket]) -> None:
        self.tenant = tenant
        self.tickets = list(tickets)
        self.left = len(self.tickets)


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
#: itif_inference_rows' outcomes: the gRPC status codes, UNKNOWN last (any other counts as it)
_CODES = [c.name for c in grpc.StatusCode if c.name != "UNKNOWN"] + ["UNKNOWN"]
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    def __init__(self, daemon: Daemon | None = None, *, nvml: Any = "auto") -> None:
        self.daemon = daemon
        disable_created_metrics()  # no *_created series: they double every scrape for nothing
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "itif_requests", "gRPC calls by tenant, method and final status code (both APIs, "
            "refusals by the auth interceptor included)", ("tenant", "method", "code"), registry=r)
        self.request_seconds = Histogram(
            "itif_request_duration_seconds", "gRPC call duration in the server, by method",
            ("method",), buckets=_LATENCY_BUCKETS, registry=r)
        # the HTTP APIs (``itif.server.http``), counted by ``observe_http``
        self.http_requests = Counter(
            "itif_http_requests", "HTTP requests by tenant, API (kserve, openai), method and "
            "HTTP status", ("tenant", "api", "method", "code"), registry=r)
        self.http_seconds = Histogram(
            "itif_http_request_duration_seconds", "HTTP request duration in the server",
            ("api", "method"), buckets=_LATENCY_BUCKETS, registry=r)
        self.columns = ColumnSeries(  # what a column batch feeds: one append, folded later
            column_rows=BatchCounter("itif_column_rows", "Rows the column path ran (ingress "
                                     "processes' Infer calls, itif.server.column_door)"),
            column_forward_cpu=BatchCounter(
                "itif_column_forward_cpu_seconds", "CPU of the column path's forwards (its "
                "thread's; the daemon's CPU beyond it is its per-call overhead)"),
            rows=TenantCounter(
                "itif_inference_rows", "Inference rows (one input of a call) that left the "
                "queue, by tenant and outcome", "code", _CODES),
            queue_seconds=TenantHistogram(
                "itif_queue_seconds", "Time a row waited in its tenant's queue",
                _LATENCY_BUCKETS),
            compute_seconds=TenantHistogram(
                "itif_compute_seconds", "Time from a row's batch start to its result",
                _LATENCY_BUCKETS),
            batch_size=BatchHistogram("itif_batch_size", "Requests per fused batch",
                                      _SIZE_BUCKETS),
            batch_tokens=BatchHistogram("itif_batch_tokens", "Real tokens per fused batch",
                                        _TOKEN_BUCKETS),
            batch_padding=BatchHistogram(
                "itif_batch_padding_ratio", "Padded rows / computed rows of a fused batch",
                _RATIO_BUCKETS))
        r.register(self.columns)
        # Generate (a decoder daemon), fed by ``itif.server.generate``; tokens/s per tenant is
        # rate(itif_generated_tokens_total)
        self.first_token_seconds = Histogram(
            "itif_generation_time_to_first_token_seconds", "Time from a Generate call's submit "
            "to its first tokens sent (beam search: to its result)", ("tenant",),
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_seconds = Histogram(
            "itif_generation_inter_token_seconds", "Time between consecutive token messages of "
            "a streaming Generate call (greedy search, sampling)", ("tenant",),
            buckets=_LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter(
            "itif_generated_tokens", "Tokens generated and sent, by tenant", ("tenant",),
            registry=r)
        # weight tiers (``itif.weights.tiers``): labels are tiers and outcomes, never tenants
        # (the per-tenant tier series come from the collector, one per configured tenant)
        self.promotions = Counter(
            "itif_tier_promotions", "Promotions of a tenant's weights to the device tier, by "
            "source tier (host, disk) and result (ok, failed)", ("source", "result"), registry=r)
        self.promotion_seconds = Histogram(
            "itif_tier_promotion_seconds", "Time to load a tenant's weights onto the device "
            "tier (evictions it needed included), by source tier", ("source",),
            buckets=_LATENCY_BUCKETS, registry=r)
        self.evictions = Counter(
            "itif_tier_evictions", "Tenants' weights leaving a tier, by where they went: host "
            "or disk from the device tier, disk from the host tier", ("to",), registry=r)
        self._lock = threading.Lock()
        self._children: dict[tuple, Any] = {}  # (metric id, labels) -> its child (_child)
        self._stats: dict[str, TenantCallStats] = {}
        self._nvml = platform.nvml() if nvml == "auto" else nvml
        self._gpus = platform.gpu_handles(self._nvml)
        self._server = None
        r.register(_StateCollector(self))
        # the process (CPU seconds, resident bytes) and Python's garbage collector
        # (collections by generation: itif.platform.tune_gc), as prometheus_client exports them
        ProcessCollector(registry=r)
        GCCollector(registry=r)

    @property
    def gpus(self) -> tuple[Any, list[tuple[int, Any]]]:
        """NVML (the module, or what was given) and (index, handle) of each GPU it lists: what
        the scrape reads utilization and memory from. ``(None, [])`` without NVML."""
        return self._nvml, self._gpus

    # ---- HTTP endpoint ---------------------------------------------------------------------
    def serve(self, listen: str) -> tuple[str, int]:
        """Serve the registry over HTTP on ``host:port`` (``[v6]:port``); returns (host, port)."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._server = server
        bound = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", listen.rpartition(":")[0], bound)
        return host, bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- feeds (``itif.observer.DaemonObserver`` and the interceptor) ------------------------
    def note_tenant(self, tenant: str | None) -> None:
        """The daemon authorised the current call for ``tenant`` (see :func:`note_tenant`)."""
        note_tenant(tenant)

    def tier_promoted(self, tenant: str, source: str, seconds: float, ok: bool) -> None:
        """``itif.weights.tiers.TierObserver``: a promotion finished or failed."""
        self.promotions.labels(source, "ok" if ok else "failed").inc()
        if ok:
            self.promotion_seconds.labels(source).observe(seconds)

    def tier_evicted(self, tenant: str, to: str) -> None:
        self.evictions.labels(to).inc()

    def _per_tenant(self) -> tuple:
        """The metrics labelled by tenant (first label)."""
        return (self.requests, self.http_requests, self.first_token_seconds,
                self.inter_token_seconds, self.generated_tokens)

    def forget_tenant(self, tenant: str) -> None:
        """Drop a removed tenant's series and call statistics (``itif.observer``), so a scrape
        and this object do not grow with tenants that came and went."""
        mine = {id(m) for m in self._per_tenant()}
        for key in list(self._children):  # one C-level copy: safe against a concurrent add
            if key[0] in mine and key[1][:1] == (tenant,):
                self._children.pop(key, None)
        with self._lock:
            self._stats.pop(tenant, None)
        self.columns.remove_tenant(tenant)
        for m in self._per_tenant():
            remove = getattr(m, "remove_by_labels", None)  # prometheus-client >= 0.24
            if remove is not None:
                remove({"tenant": tenant})

    def _child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once (``forget_tenant`` drops a tenant's)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_rpc(self, tenant: str, method: str, code: str, seconds: float) -> None:
        self._child(self.requests, tenant, method, code).inc()
        self._child(self.request_seconds, method).observe(seconds)

    def observe_rpcs(self, calls: dict[tuple[str, str, str], list[float]]) -> None:
        """Calls counted in bulk (an ingress process's): ``{(tenant, method, code): [s]}``."""
        for (tenant, method, code), seconds in calls.items():
            self._child(self.requests, tenant, method, code).inc(len(seconds))
            for s in seconds:
                self._child(self.request_seconds, method).observe(s)

    def observe_column_batch(self, names: Sequence[str], tenant: Any, queued_s: Any,
                             compute_s: float, tokens: int, forward_cpu_s: float,
                             computed_rows: int = 0) -> None:
        """A column batch (``itif.server.column_door``), counted as a ticket batch and its
        rows are: ``tenant`` a table index a row (``names``: the table), ``queued_s`` each
        row's wait, ``compute_s`` the batch's time, ``computed_rows`` the token rows its
        forward computed (``tokens`` and padding)."""
        self.columns.log(names, tenant, queued_s, compute_s, tokens, forward_cpu_s, computed_rows)

    def observe_http(self, tenant: str, api: str, method: str, status: int,
                     seconds: float) -> None:
        self.http_requests.labels(tenant, api, method, str(status)).inc()
        self.http_seconds.labels(api, method).observe(seconds)

    def observe_tokens(self, tenant: str, seconds: float, count: int, first: bool) -> None:
        """A Generate call sent ``count`` new tokens, ``seconds`` after its submit (``first``)
        or after its previous tokens."""
        (self.first_token_seconds if first else self.inter_token_seconds).labels(
            tenant).observe(seconds)
        self.generated_tokens.labels(tenant).inc(count)

    def observe_generation(self, tenant: str, unstreamed: int, first_s: float | None) -> None:
        """A Generate call ended with its result: ``unstreamed`` tokens arrive only with it
        (beam search), ``first_s`` seconds after submit when no token message came first."""
        if first_s is not None:
            self.first_token_seconds.labels(tenant).observe(first_s)
        if unstreamed > 0:
            self.generated_tokens.labels(tenant).inc(unstreamed)

    def watch(self, tenant: str, tickets: Sequence[SchedulerTicket]) -> None:
        """Account for one accepted call: its rows as they finish, the call when all have."""
        if not tickets:
            return
        call = _CallWatch(tenant, tickets)
        for t in call.tickets:
            t.add_done_callback(lambda tk, c=call: self._row_done(c, tk))

    def _row_done(self, call: _CallWatch, t: SchedulerTicket) -> None:
        err = t.exception(0)
        code = "OK" if err is None else getattr(err, "code", "INTERNAL")
        self.columns.rows.inc(call.tenant, code)
        self.columns.queue_seconds.observe(call.tenant, t.queued_ms / 1000.0)
        compute = t.compute_ms
        if compute is not None:
            self.columns.compute_seconds.observe(call.tenant, compute / 1000.0)
        with self._lock:
            call.left -= 1
            if call.left:
                return
            self._call_done(call)

    def _call_done(self, call: _CallWatch) -> None:
        """All rows done (under the lock)."""
        ts = call.tickets
        ok = all(t.exception(0) is None for t in ts)
        start = min(t.enqueued_at for t in ts)
        end = max((t.finished_at or t.enqueued_at) for t in ts)
        total_ns = int(max(0.0, end - start) * 1e9)
        queue_ns = int(max(t.queued_ms for t in ts) * 1e6)
        computes = [t.compute_ms for t in ts if t.compute_ms is not None]
        s = self._stats.get(call.tenant, TenantCallStats())
        if ok:
            new = dict(success=s.success + 1, success_ns=s.success_ns + total_ns,
                       inferences=s.inferences + len(ts),
                       last_inference_ms=int(time.time() * 1000))
        else:
            new = dict(fail=s.fail + 1, fail_ns=s.fail_ns + total_ns)
        if computes:
            new.update(compute=s.compute + 1, compute_ns=s.compute_ns + int(max(computes) * 1e6))
        self._stats[call.tenant] = replace(s, queue=s.queue + 1, queue_ns=s.queue_ns + queue_ns,
                                           **new)

    def run_batch(self, engine: Engine) -> Callable[[list[Request]], list[Result]]:
        """A ``run_batch`` for the scheduler: ``engine.infer`` plus batch metrics (the padding
        ratio from the batch's Layout, which ``infer`` hands to ``on_plan``)."""

        def run(requests: list[Request]) -> list[Result]:
            layouts: list = []
            results = engine.infer(requests, on_plan=layouts.append)
            try:
                self.observe_batch(requests, layouts[0] if layouts else None)
            except Exception:  # metrics never fail a batch
                log.exception("batch metrics failed")
            return results

        return run

    def observe_batch(self, requests: Sequence[Request], layout: Any) -> None:
        self.columns.batch_size.observe(len(requests))
        if layout is not None:
            rows, useful = int(layout.total_rows), int(layout.useful_tokens)
            self.columns.batch_tokens.observe(useful)
            self.columns.batch_padding.observe((rows - useful) / rows if rows else 0.0)
        with self._lock:
            for tenant in {r.tenant for r in requests}:
                s = self._stats.get(tenant, TenantCallStats())
                self._stats[tenant] = replace(s, executions=s.executions + 1)

    # ---- reads -----------------------------------------------------------------------------
    def tenant_stats(self, tenant: str) -> TenantCallStats:
        with self._lock:
            return self._stats.get(tenant, TenantCallStats())


class _StateCollector:
    """Gauges read from the daemon at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self):
        return []  # collected at scrape time only (the label sets follow the config)

    def collect(self):
        d = self.m.daemon
        if d is not None:
            yield from self._daemon(d)
        yield from self._gpu()
        yield from self._kernels()

    def _kernels(self):
        """``itif_kernel_fallback``: 1 for an op whose CUDA kernel is not used on a (device,
        dtype), so the torch reference runs it (self-test failure or a build failure at run
        time); 0 for an op whose kernel passed the start-up self-test. No series on a CPU-only
        daemon (the reference is the design there, not a fallback)."""
        from itif.ops import dispatch  # noqa: PLC0415 - process-wide kernel states

        states = dispatch.kernel_states()
        if not states:
            return
        g = GaugeMetricFamily("itif_kernel_fallback",
                              "1 when an op runs the torch reference instead of its CUDA kernel "
                              "(kernel self-test failed or the build failed), 0 when its kernel "
                              "passed the self-test", labels=["op", "device", "dtype"])
        for s in states:
            g.add_metric([s.op, s.device, s.dtype], 1.0 if s.fallback else 0.0)
        yield g

    def _daemon(self, d: Daemon):
        ready = GaugeMetricFamily("itif_ready", "1 when the daemon serves (backbone loaded)")
        ready.add_metric([], 1.0 if d.ready else 0.0)
        yield ready
        depth = GaugeMetricFamily("itif_queue_depth", "Requests queued per tenant",
                                  labels=["tenant"])
        wbytes = GaugeMetricFamily("itif_tenant_weight_bytes",
                                   "Bytes of weights a tenant reads (shared tensors included)",
                                   labels=["tenant"])
        xbytes = GaugeMetricFamily("itif_tenant_exclusive_weight_bytes",
                                   "Bytes of weights only this tenant holds", labels=["tenant"])
        state = GaugeMetricFamily("itif_tenant_state", "1 for the tenant's current state",
                                  labels=["tenant", "state"])
        for tenant in sorted(list(d.status)):
            try:
                v = d.tenant_view(tenant)
            except Exception:  # removed while we looked
                continue
            depth.add_metric([tenant], v.queue_depth)
            wbytes.add_metric([tenant], v.weight_bytes)
            xbytes.add_metric([tenant], v.exclusive_bytes)
            for s in State:
                state.add_metric([tenant, s.name], 1.0 if v.state is s else 0.0)
        yield from (depth, wbytes, xbytes, state)
        if getattr(d, "tiers", None) is not None:
            yield from self._tiers(d)
        if d.engine is not None:
            store = GaugeMetricFamily("itif_weight_store_bytes",
                                      "Bytes held by the weight store (shared tensors once)")
            store.add_metric([], d.engine.weight_bytes)
            yield store
            yield from self._graphs(d.engine)
        reloads = CounterMetricFamily("itif_config_reloads",
                                      "tenants.yaml reloads applied (ok) or refused (failed)",
                                      labels=["result"])
        reloads.add_metric(["ok"], d.reloads_ok)
        reloads.add_metric(["failed"], d.reloads_failed)
        yield reloads

    @staticmethod
    def _graphs(engine):
        """The engine's CUDA graph cache (``Engine.graph_stats``; no series on the CPU or for a
        decoder backend): forwards run while graphs are on, by path (a graph replayed, eager
        launches while a structure pays its rent), captures, graphs held."""
        stats = getattr(engine, "graph_stats", lambda: None)()
        if stats is None:
            return
        fw = CounterMetricFamily("itif_cuda_graph_forwards", "Forwards while CUDA graphs are on, "
                                 "by path: a captured graph replayed, or eager launches (a "
                                 "structure not captured yet, or never)", labels=["path"])
        fw.add_metric(["replay"], stats["replays"])
        fw.add_metric(["eager"], stats["eager"])
        cap = CounterMetricFamily("itif_cuda_graph_captures", "CUDA graphs captured")
        cap.add_metric([], stats["captures"])
        held = GaugeMetricFamily("itif_cuda_graphs", "CUDA graphs held for replay")
        held.add_metric([], stats["graphs"])
        yield from (fw, cap, held)

    def _tiers(self, d: Daemon):
        """Weight tiers: each configured tenant's tier and counts (as the other per-tenant
        series, one per configured tenant: bounded by tenants.yaml, never by callers), and
        bytes, budgets and tenants per tier."""
        tier = GaugeMetricFamily("itif_tenant_tier", "1 for the tier holding the tenant's "
                                 "weights (device, host, disk, none)", labels=["tenant", "tier"])
        prom = CounterMetricFamily("itif_tenant_promotions", "Promotions of the tenant's "
                                   "weights to the device tier", labels=["tenant"])
        evic = CounterMetricFamily("itif_tenant_evictions", "Evictions of the tenant's weights "
                                   "from the device tier", labels=["tenant"])
        for tenant in sorted(list(d.status)):
            v = d.tiers.view(tenant)
            if v is None:
                continue
            for name in ("device", "host", "disk", "none"):
                tier.add_metric([tenant, name], 1.0 if v.tier.value == name else 0.0)
            prom.add_metric([tenant], v.promotions)
            evic.add_metric([tenant], v.evictions)
        yield from (tier, prom, evic)
        tot = d.tiers.totals()
        nbytes = GaugeMetricFamily("itif_tier_bytes", "Bytes of weights held by a tier "
                                   "(shared tensors once)", labels=["tier"])
        budget = GaugeMetricFamily("itif_tier_budget_bytes", "A tier's budget in bytes",
                                   labels=["tier"])
        count = GaugeMetricFamily("itif_tier_tenants", "Tenants whose weights a tier holds",
                                  labels=["tier"])
        for name in ("device", "host"):
            nbytes.add_metric([name], tot[f"{name}_bytes"])
            budget.add_metric([name], tot[f"{name}_budget"])
        for name in ("device", "host", "disk", "none"):
            count.add_metric([name], tot[f"{name}_tenants"])
        yield from (nbytes, budget, count)

    def _gpu(self):
        nv, handles = self.m.gpus
        if nv is None or not handles:
            return
        util = GaugeMetricFamily("itif_gpu_utilization_ratio",
                                 "GPU busy fraction over NVML's last sample period", labels=["gpu"])
        used = GaugeMetricFamily("itif_gpu_memory_used_bytes", "GPU memory in use",
                                 labels=["gpu"])
        total = GaugeMetricFamily("itif_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        for i, h in handles:
            try:
                rates = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
            except Exception as e:  # a GPU that fell off the bus must not break the scrape
                log.debug("NVML read of GPU %d failed: %s", i, e)
                continue
            util.add_metric([str(i)], rates.gpu / 100.0)
            used.add_metric([str(i)], mem.used)
            total.add_metric([str(i)], mem.total)
        yield from (util, used, total)

