"""Serving sweep through the real daemon over gRPC: open-loop Poisson arrivals at rising rates.

Each mode is one ``itif serve`` subprocess on 127.0.0.1 (started exactly as an operator would,
tenants uploaded over gRPC as Hugging Face-named safetensors):

- ``itif``: the scheduler mixes every tenant's queued requests into one fused batch;
- ``itif_sized`` (``--serve-latency-sizing``): the fused daemon with ``scheduler.latency_sizing:
  true`` (batches stop growing before a member would miss its latency target);
- ``itif_loop`` (``--serve-gemm-loop``): the fused daemon with ``ITIF_GROUPED_GEMM=loop`` in
  its environment (a ragged batch's products as one ``torch.mm`` a tenant, not one grouped
  cuBLAS call each as by default on CUDA: ``itif.runtime.cublas_grouped``; the CPU runs the
  loop either way);
- ``per_tenant``: the same daemon with ``scheduler.isolate_tenants: true``: a batch never mixes
  tenants, so each tenant is batched alone, as a separate model in Triton would be. Batches of
  different tenants then run one after another on the one engine (time-shared, as model
  instances sharing one device are under load).

Rates are fractions of a capacity calibrated on the ``itif`` daemon (a burst of requests sent at
once); every mode gets the same absolute rates, and at each rate the same arrivals and requests.
The daemons run side by side, idle but for the one under load, and the modes take turns rate by
rate: on one H100, the same per-tenant daemon saturated at 1164.6 and then 958.4 req/s in two
sweeps minutes apart; taking turns, such drift moves every mode alike. Each point sends Poisson
arrivals for a bounded time and count, one channel, ``Infer.future`` per request; latency runs
from each request's *scheduled* arrival (so a lagging sender cannot hide queueing) to its answer.
Throughput is the answered requests over the time from the first arrival to the last answer
(past saturation the queue drains after the window, so this converges to the service capacity).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import grpc
import numpy as np
import torch

from itif.backbones.spec import BackboneSpec, load_spec
from itif.bench.daemon_probe import batch_figures, child_pids, daemon_figures, process_cpu_seconds
from itif.bench.tenants import tenant_weights, to_hf
from itif.bench.workloads import ServeMix, poisson_arrivals, sample_lengths, sample_tenants
from itif.client import Client
from itif.config import hash_token
from itif.config.schema import SchedulerConfig
from itif.safetensors_io import save_safetensors

log = logging.getLogger("itif.bench")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ServeDaemon:
    """One ``itif serve`` subprocess with the benchmark's tenants."""

    root: Path
    port: int
    model: str
    device: str
    dtype: str
    tokens: dict[str, str]  # tenant -> bearer token
    strategy: str
    isolate: bool
    max_wait_ms: float
    latency_sizing: bool = False
    proc: subprocess.Popen | None = None
    server_extra: tuple[
        tuple[str, object], ...
    ] = ()  # more ``server:`` keys (bench/serve_burst.py)
    metrics_port: int | None = None  # /metrics on 127.0.0.1 (figures())
    env: tuple[tuple[str, str], ...] = ()  # more environment variables of the daemon
    max_batch_tokens: int | None = None  # scheduler limits; None: the daemon's defaults
    max_batch_size: int | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.admin = secrets.token_urlsafe(16)
        lines = ["server:", f"  listen: {self.addr}", "  data_dir: ./data",
                 f"  admin_token_sha256: {hash_token(self.admin)}",
                 # an open-loop sweep past saturation holds thousands of calls on one channel:
                 # the sweep measures the queue, so the daemon's overload guards stay out of it
                 "  max_inflight_calls: 1000000", "  max_streams_per_connection: 1000000",
                 *(f"  {k}: {v}" for k, v in self.server_extra),
                 *([f"  metrics_listen: 127.0.0.1:{self.metrics_port}"]
                   if self.metrics_port is not None else []),
                 "backbone:",
                 f"  config: {self.model}", f"  device: {self.device}", f"  dtype: {self.dtype}",
                 "scheduler:", f"  max_wait_ms: {self.max_wait_ms}",
                 f"  strategy: {self.strategy}",
                 f"  isolate_tenants: {'true' if self.isolate else 'false'}",
                 f"  latency_sizing: {'true' if self.latency_sizing else 'false'}",
                 *([f"  max_batch_tokens: {self.max_batch_tokens}"]
                   if self.max_batch_tokens is not None else []),
                 *([f"  max_batch_size: {self.max_batch_size}"]
                   if self.max_batch_size is not None else []),
                 "tenants:"]
        for t, tok in self.tokens.items():
            lines += [f"  - id: {t}", f"    token_sha256: {hash_token(tok)}",
                      "    max_queue: 1000000"]
        cfg = self.root / "tenants.yaml"
        cfg.write_text("\n".join(lines) + "\n")
        self._log = open(self.root / "daemon.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(self.env))
        self.proc = subprocess.Popen([sys.executable, "-m", "itif", "serve", "--config", str(cfg)],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root,
                                     env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        with Client(self.addr, self.admin) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"daemon exited {self.proc.returncode}: {self.logs()[-2000:]}")
                try:
                    if c.health_status() == "SERVING":
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(
                        f"daemon not SERVING after {timeout:.0f} s: {self.logs()[-2000:]}")
                time.sleep(0.1)

    def cpu_seconds(self) -> float | None:
        """The daemon process's CPU time so far, all threads (Linux ``/proc``; else None)."""
        return process_cpu_seconds(self.proc.pid) if self.proc is not None else None

    def children_cpu_seconds(self) -> float | None:
        """The CPU time so far of the daemon's child processes (its ingress processes,
        ``--serve-ingress``); None without any."""
        if self.proc is None:
            return None
        times = [process_cpu_seconds(c) for c in child_pids(self.proc.pid)]
        times = [t for t in times if t is not None]
        return sum(times) if times else None

    def figures(self) -> dict[str, float] | None:
        """The daemon's cumulative batch and CUDA graph counters from its /metrics (None without
        a metrics port, or when the scrape fails): batches and the rows in them, the rows'
        compute seconds (each row counts its batch's forward), forwards by graph path, captures."""
        if self.metrics_port is None:
            return None
        return daemon_figures(self.metrics_port)

    def upload(self, files: dict[str, Path]) -> None:
        for t, path in files.items():
            with Client(self.addr, self.tokens[t]) as c:
                c.upload(t, path, timeout=600)

    def logs(self) -> str:
        try:
            return (self.root / "daemon.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self._log.close()


class LoadGen:
    """Open-loop sender over one channel to one daemon. With ``daemon_cpu`` (the daemon's
    :meth:`ServeDaemon.cpu_seconds`), :meth:`send` also says how many cores the daemon and this
    process used while it ran: a daemon at about one core is bound by its one Python
    interpreter (gRPC, admission, the scheduler's Python), not by the device; a load generator
    at about one core is itself the bound."""

    def __init__(self, addr: str, tokens: dict[str, str], spec: BackboneSpec,
                 daemon_cpu: Callable[[], float | None] | None = None,
                 daemon_figures: Callable[[], dict | None] | None = None,
                 children_cpu: Callable[[], float | None] | None = None) -> None:
        from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc  # noqa: PLC0415

        self.daemon_cpu = daemon_cpu
        self.children_cpu = children_cpu
        self.daemon_figures = daemon_figures
        self._pb = itif_pb2
        opts = [("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(addr, options=opts)
        self.stub = itif_pb2_grpc.ItifStub(self.channel)
        self.names = list(tokens)
        self.metadata = {t: (("authorization", f"Bearer {tok}"),) for t, tok in tokens.items()}
        self.spec = spec

    def close(self) -> None:
        self.channel.close()

    def requests(self, mix: ServeMix, n: int, rng: np.random.Generator):
        """n (tenant, message, length) of the mix, built before the clock starts."""
        tenant = sample_tenants(len(self.names), n, mix.skew, rng)
        lengths = sample_lengths(mix.lengths, n, self.spec.max_position, rng)
        pb = self._pb
        out = []
        for t, L in zip(tenant, lengths):
            ids = rng.integers(0, self.spec.vocab_size, int(L)).tolist()
            msg = pb.InferRequest(tenant=self.names[t],
                                  input=pb.InferInput(input_ids=pb.TokenIds(ids=ids)))
            out.append((self.names[t], msg, int(L)))
        return out

    def send(self, arrivals: np.ndarray, reqs, timeout_s: float, drain_s: float) -> dict:
        """Send ``reqs[i]`` at ``arrivals[i]`` seconds from now; wait for the answers."""
        n = len(arrivals)
        done = np.full(n, np.nan)
        ok = np.zeros(n, bool)
        errors: dict[str, int] = {}
        lock = threading.Lock()
        left = [n]
        all_done = threading.Event()
        clock = time.perf_counter

        def callback(i):
            def cb(fut):
                now = clock()
                code = None
                if fut.cancelled():
                    code = "CANCELLED"
                elif fut.exception() is not None:
                    c = fut.exception().code() if hasattr(fut.exception(), "code") else None
                    code = c.name if c is not None else type(fut.exception()).__name__
                with lock:
                    done[i] = now
                    ok[i] = code is None
                    if code is not None:
                        errors[code] = errors.get(code, 0) + 1
                    left[0] -= 1
                    if left[0] == 0:
                        all_done.set()
            return cb

        futs = []
        lag = np.zeros(n)
        fig0 = self.daemon_figures() if self.daemon_figures is not None else None
        cpu0 = self._cpu()
        start = clock() + 0.02
        infer = self.stub.Infer.future
        for i in range(n):
            target = start + arrivals[i]
            delay = target - clock()
            if delay > 0:
                time.sleep(delay)
            else:
                lag[i] = -delay
            tenant, msg, _ = reqs[i]
            f = infer(msg, metadata=self.metadata[tenant], timeout=timeout_s)
            f.add_done_callback(callback(i))
            futs.append(f)
        all_done.wait(drain_s)
        cpu1 = self._cpu()
        fig1 = self.daemon_figures() if self.daemon_figures is not None else None
        for f in futs:
            f.cancel()
        all_done.wait(5.0)
        with lock:
            lat = (done - (start + arrivals))[ok] * 1e3
            last = np.nanmax(done[ok]) if ok.any() else np.nan
        span = (last - start) if ok.any() else np.nan
        window = float(arrivals[-1]) if n > 1 else 0.0
        return dict(sent=n, completed=int(ok.sum()), errors=errors,
                    offered_rps=round(n / window, 3) if window > 0 else None,
                    throughput_rps=(round(float(ok.sum() / span), 3)
                                    if ok.any() and span > 0 else 0.0),
                    p50_ms=_pct(lat, 50), p90_ms=_pct(lat, 90), p99_ms=_pct(lat, 99),
                    mean_ms=round(float(lat.mean()), 3) if lat.size else None,
                    send_lag_p99_ms=round(float(np.percentile(lag, 99) * 1e3), 3),
                    **_cores(cpu0, cpu1), **batch_figures(fig0, fig1))

    def _cpu(self) -> tuple[float, float, float | None, float | None]:
        """(wall clock, this process's CPU time, the daemon's CPU time or None, its ingress
        processes' or None)."""
        daemon = self.daemon_cpu() if self.daemon_cpu is not None else None
        children = self.children_cpu() if self.children_cpu is not None else None
        return time.perf_counter(), time.process_time(), daemon, children


def _cores(before: tuple, after: tuple) -> dict:
    """Cores used between two :meth:`LoadGen._cpu` readings: the load generator's, and the
    daemon's when it was read."""
    wall = after[0] - before[0]
    if wall <= 0:
        return {}
    out = {"loadgen_cpu_cores": round((after[1] - before[1]) / wall, 3)}
    if before[2] is not None and after[2] is not None:
        out["daemon_cpu_cores"] = round((after[2] - before[2]) / wall, 3)
    if before[3] is not None and after[3] is not None and after[3] >= before[3]:
        out["ingress_cpu_cores"] = round((after[3] - before[3]) / wall, 3)
    return out


SATURATED = 0.9  # a point is saturated when it answers less than this share of the offered rate
#: p99 targets (ms) of the goodput figures: the most a mode answered at a point that kept up
#: with its arrivals and had its p99 within the target (several targets, none picked after the
#: fact)
SLO_MS = (100, 250, 500, 1000)


def _pct(x: np.ndarray, q: float):
    return round(float(np.percentile(x, q)), 3) if x.size else None


@dataclass(frozen=True)
class ServeSettings:
    model: str
    tenants: int
    device: str
    dtype: str
    mixes: tuple[ServeMix, ...]
    strategies: tuple[str, ...]  # fused daemons, one per strategy
    fractions: tuple[float, ...]  # rates as fractions of the calibrated capacity
    rates: tuple[float, ...] | None  # absolute rates (req/s) instead of fractions
    duration_s: float
    max_requests: int
    timeout_s: float
    max_wait_ms: float
    calibrate_requests: int
    extra_rates: int = 3  # rates added (x1.5 each) while the fused daemon is not saturated
    p99_at: float | None = None  # one more point per mode at this fraction of its saturation
    fine_tune: str = "full"
    seed: int = 0
    latency_sizing_mode: bool = False  # one more fused daemon with scheduler.latency_sizing on
    gemm_loop_mode: bool = False  # one more fused daemon with ITIF_GROUPED_GEMM=loop
    max_batch_tokens: int | None = None  # every daemon's scheduler limits (None: its defaults)
    max_batch_size: int | None = None
    ingress_processes: int = 0  # every daemon's server.ingress_processes


class Mode(NamedTuple):
    """One daemon of the sweep: its system name, planner strategy and settings."""

    system: str
    strategy: str
    isolate: bool = False  # scheduler.isolate_tenants (per-tenant batching)
    sizing: bool = False  # scheduler.latency_sizing
    env: tuple[tuple[str, str], ...] = ()  # more environment variables of the daemon


def write_checkpoints(spec: BackboneSpec, names: list[str], root: Path, fine_tune: str = "full",
                      dtype: str = "float32") -> dict[str, Path]:
    """A Hugging Face-named safetensors file of random weights for each tenant of ``names``
    (``tenant_weights``: tenant i's seed is i), in ``root``. In the daemons' half precision
    when they serve in it: the values they hold are the same (each rounds float32 alike), the
    files and uploads half the size."""
    t0 = time.monotonic()
    half = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    files = {}
    for i, t in enumerate(names):
        files[t] = root / f"{t}.safetensors"
        hf = to_hf(spec, tenant_weights(spec, i, fine_tune))
        if half is not None:
            hf = {k: v.to(half) for k, v in hf.items()}
        save_safetensors(hf, files[t])
    # the setup of many large tenants takes minutes (64 bert-base: 28 GB of checkpoints,
    # uploaded to every daemon): say where the time goes, so a timeout shows it
    log.info("serve: %d tenants' checkpoints written in %.1f s (%.1f MB)", len(names),
             time.monotonic() - t0, sum(f.stat().st_size for f in files.values()) / 1e6)
    return files


def serve_sweep(cfg: ServeSettings, progress: Callable[[list[dict]], None] | None = None,
                deadline: float | None = None) -> list[dict]:
    """Rows of the sweep: one per (mode, mix, rate), plus one saturation row per (mode, mix).

    ``progress(rows)`` hears every row so far after each point (to save a partial result: a
    sweep cut short by its caller's timeout keeps what it measured); no point starts after
    ``deadline`` (``time.monotonic()``), so a sweep given a budget ends with its rows."""
    spec = load_spec(cfg.model)
    if not spec.is_text:
        raise ValueError(f"the serving sweep takes a text backbone; {cfg.model!r} is {spec.family}")
    names = [f"t{i}" for i in range(cfg.tenants)]
    tokens = {t: secrets.token_urlsafe(12) for t in names}
    modes = ([Mode("itif", s) for s in cfg.strategies]
             + [Mode("per_tenant", cfg.strategies[0], isolate=True)])
    if cfg.latency_sizing_mode:
        modes.append(Mode("itif_sized", cfg.strategies[0], sizing=True))
    if cfg.gemm_loop_mode:
        modes.append(Mode("itif_loop", cfg.strategies[0], env=(("ITIF_GROUPED_GEMM", "loop"),)))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="itif-bench-serve-") as tmp:
        tmp = Path(tmp)
        files = write_checkpoints(spec, names, tmp, cfg.fine_tune, cfg.dtype)
        ports = free_ports(2 * len(modes))  # gRPC, then /metrics
        daemons = [ServeDaemon(tmp / f"d{k}", ports[k], cfg.model, cfg.device, cfg.dtype, tokens,
                               strategy, isolate, cfg.max_wait_ms, sizing,
                               metrics_port=ports[len(modes) + k],
                               max_batch_tokens=cfg.max_batch_tokens,
                               max_batch_size=cfg.max_batch_size,
                               server_extra=((("ingress_processes", cfg.ingress_processes),)
                                             if cfg.ingress_processes else ()), env=env)
                   for k, (_, strategy, isolate, sizing, env) in enumerate(modes)]
        try:
            for d in daemons:  # start together: the slow part (imports) overlaps
                d.start()
            for k, d in enumerate(daemons):
                d.wait_ready()
                t0 = time.monotonic()
                d.upload(files)
                log.info("serve: daemon %d of %d (%s) ready, tenants uploaded in %.1f s", k + 1,
                         len(daemons), modes[k].system, time.monotonic() - t0)
            rng = np.random.default_rng(cfg.seed)
            gens = [LoadGen(d.addr, tokens, spec, d.cpu_seconds, d.figures,
                            d.children_cpu_seconds if cfg.ingress_processes else None)
                    for d in daemons]
            try:
                for mix in cfg.mixes:
                    done = list(rows)
                    step = None if progress is None else (lambda rs: progress(done + rs))
                    rows += _sweep_mix(cfg, spec, mix, modes, gens, rng, step, deadline)
            finally:
                for g in gens:
                    g.close()
        finally:
            for d in daemons:
                d.stop()
    return rows


def _point(cfg, g, base, system, strategy, rate, arrivals, reqs, **extra) -> dict:
    """One point: ``reqs`` sent to one daemon at ``arrivals``, as a row."""
    res = g.send(arrivals, reqs, cfg.timeout_s,
                 drain_s=max(5.0, 2 * cfg.duration_s) + cfg.timeout_s / 4)
    row = dict(base, system=system, strategy=strategy, rate_rps=rate,
               requests_per_tenant=round(len(reqs) / cfg.tenants, 2),
               seq_len=int(round(np.mean([r[2] for r in reqs]))),
               latency_ms=res["p50_ms"], **extra, **res)
    if base["suite"] == "serve":
        offered = res["offered_rps"] or rate
        row["saturated"] = bool(res["throughput_rps"] < SATURATED * offered)
    return row


def goodput(points: list[dict], slo_ms: float) -> float:
    """The most req/s a mode answered at a point of the sweep that kept up with its arrivals
    (not ``saturated``) with a p99 within ``slo_ms``; 0.0 when no point did. The sweep's rates
    are steps of 25-50%, so this is a lower bound on the true figure, within a step."""
    ok = [r["throughput_rps"] for r in points if not r.get("saturated")
          and r.get("p99_ms") is not None and r["p99_ms"] <= slo_ms]
    return max(ok, default=0.0)


def _saturation(base, system, strategy, points) -> dict:
    """The saturation row of one mode: its best-answering point, and its goodput at each p99
    target of :data:`SLO_MS`."""
    best = max(points, key=lambda r: r["throughput_rps"])
    return dict(base, suite="serve_saturation", system=system, strategy=strategy,
                goodput_rps={str(t): goodput(points, t) for t in SLO_MS},
                requests_per_tenant=best["requests_per_tenant"], seq_len=best["seq_len"],
                rate_rps=best["rate_rps"], throughput_rps=best["throughput_rps"],
                latency_ms=best["p50_ms"], p50_ms=best["p50_ms"], p99_ms=best["p99_ms"],
                **{k: best[k] for k in ("daemon_cpu_cores", "ingress_cpu_cores",
                                        "loadgen_cpu_cores",
                                        "mean_batch_size", "row_compute_ms", "graph_replays",
                                        "graph_eager", "graph_captures")
                   if k in best})


def _sweep_mix(cfg, spec, mix, modes, gens, rng, progress=None, deadline=None) -> list[dict]:
    """Every mode at every rate, the modes interleaved rate by rate and each rate's arrivals and
    requests the same for every mode (a paired comparison: a machine that drifts during the
    sweep moves every mode alike). ``progress(rows)`` hears the rows after every point, with the
    saturation rows so far marked ``partial``; past ``deadline`` (time.monotonic()) no new point
    starts."""
    n_cal = cfg.calibrate_requests
    for g in gens:  # warm-up: first batches, cost-model profiling of the DP planners
        reqs = g.requests(mix, max(8, n_cal // 4), rng)
        g.send(np.zeros(len(reqs)), reqs, cfg.timeout_s, cfg.timeout_s)
    if cfg.rates:
        rates = list(cfg.rates)
        capacity = None
    else:
        reqs = gens[0].requests(mix, n_cal, rng)
        cal = gens[0].send(np.zeros(len(reqs)), reqs, cfg.timeout_s, cfg.timeout_s)
        capacity = max(cal["throughput_rps"], 1.0)
        rates = [round(f * capacity, 2) for f in cfg.fractions]
        log.info("serve %s: calibrated capacity %.1f req/s -> rates %s", mix.name, capacity, rates)
    base = dict(suite="serve", model=cfg.model, tenants=cfg.tenants, workload=mix.lengths,
                skew=mix.skew, mix=mix.name, fine_tune=cfg.fine_tune, device=cfg.device,
                status="ok", calibrated_rps=capacity, ingress_processes=cfg.ingress_processes,
                max_batch_tokens=cfg.max_batch_tokens or SchedulerConfig.max_batch_tokens,
                max_batch_size=cfg.max_batch_size or SchedulerConfig.max_batch_size)
    points: list[list[dict]] = [[] for _ in modes]
    extra: list[dict] = []  # the points at a fraction of each mode's saturation

    def rows(final: bool) -> list[dict]:
        out = [r for ps in points for r in ps]
        for k, (system, strategy, *_) in enumerate(modes):
            if points[k]:
                sat = _saturation(base, system, strategy, points[k])
                at = [r for r in extra if r["system"] == system and r["strategy"] == strategy]
                if at:
                    sat.update(at_fraction=cfg.p99_at, at_fraction_rate_rps=at[0]["rate_rps"],
                               p50_at_fraction_ms=at[0]["p50_ms"],
                               p99_at_fraction_ms=at[0]["p99_ms"])
                if not final:
                    sat["partial"] = True
                out.append(sat)
        return out + extra

    def late() -> bool:
        if deadline is not None and time.monotonic() > deadline:
            log.warning("serve %s: out of time; no more points", mix.name)
            return True
        return False

    i = 0
    while i < len(rates) and not late():
        rate = rates[i]
        arrivals = poisson_arrivals(rate, cfg.duration_s, cfg.max_requests, rng)
        reqs = gens[0].requests(mix, len(arrivals), rng)
        order = range(len(modes)) if i % 2 == 0 else reversed(range(len(modes)))
        for k in order:
            m = modes[k]
            row = _point(cfg, gens[k], base, m.system, m.strategy, rate, arrivals, reqs,
                         **({"daemon_env": dict(m.env)} if m.env else {}))
            points[k].append(row)
            log.info("serve %s %s/%s rate %.1f: %.1f req/s p50 %s p99 %s ms", mix.name, m.system,
                     m.strategy, rate, row["throughput_rps"], row["p50_ms"], row["p99_ms"])
            if progress is not None:
                progress(rows(final=False))
        i += 1
        # Past the planned rates, keep rising while the first (fused) mode is not saturated
        # (the calibration burst can underestimate the capacity).
        if (not cfg.rates and i == len(rates) and not points[0][-1]["saturated"]
                and len(rates) < len(cfg.fractions) + cfg.extra_rates):
            rates.append(round(rate * 1.5, 2))
    if cfg.p99_at:
        for k, (system, strategy, *_) in enumerate(modes):
            best = max((r["throughput_rps"] for r in points[k]), default=0.0)
            if best <= 0 or late():
                continue
            # p99 below saturation: Poisson arrivals at a fraction of this mode's own capacity
            rate = round(cfg.p99_at * best, 2)
            arrivals = poisson_arrivals(rate, cfg.duration_s, cfg.max_requests, rng)
            reqs = gens[k].requests(mix, len(arrivals), rng)
            extra.append(_point(cfg, gens[k], dict(base, suite="serve_at_fraction"), system,
                                strategy, rate, arrivals, reqs,
                                fraction_of_saturation=cfg.p99_at))
            log.info("serve %s %s/%s at %.0f%% of saturation (%.1f req/s): p99 %s ms", mix.name,
                     system, strategy, 100 * cfg.p99_at, rate, extra[-1]["p99_ms"])
            if progress is not None:
                progress(rows(final=False))
    return rows(final=True)
