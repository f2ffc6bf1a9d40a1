"""``itif bench --suites tenants``: thousands of tenants of one small backbone in one Engine.

Per tenant kind (issue 14, item 6), one child process each (a clean resident-set baseline):

- ``head``: head-only fine-tunes (``itif.bench.tenants`` ``head`` mode: the backbone shared by
  content, a pooler and 2-label head of their own; the first one brings the backbone);
- ``lora``: PEFT LoRA adapters of rank ``r`` on ``query`` and ``value`` (PEFT's default targets
  for BERT) on one full ``base`` tenant, added as ``(adapter_config, tensors)``;
- ``full``: full fine-tunes (every tensor their own), up to ``full_max`` (host memory).

The tenants are added one after another up to each count of ``counts`` (ascending, one Engine
per kind), and at each count the suite records:

- **registration**: wall time of each ``Engine.add_tenant`` (weights built before the clock
  starts; LoRA adds include reading and validating the adapter): the first add, the median,
  the median of the last 100 adds, the last add at that count, p99;
- **memory**: the store's accounting (``weight_bytes``: the base once plus every tenant's own
  bytes; ``own_bytes_per_tenant`` from ``tenant_info().exclusive_bytes``) and the process's
  resident set: ``rss_ratio`` = (RSS after registration - RSS before the first add, the
  imports and the empty Engine excluded) / ``weight_bytes``. No forward runs before the last
  reading: serving leaves freed activations in the C heap (about 120 MB after 2000 requests
  over 3000 tenants, most of it returned by ``malloc_trim``), which is not tenant memory;
- **correctness**: ``sample`` tenants spread over the range, in one mixed batch, against
  Hugging Face (``head``/``full``: ``BertForSequenceClassification`` with that tenant's
  weights) or PEFT (``lora``: ``get_peft_model`` on the base model, the tenant's adapter set
  with ``set_peft_model_state_dict``): ``max_abs_diff`` of the logits;
- **serving** through ``Scheduler`` + ``Engine.infer`` in this process (uniform and zipf
  popularity over all registered tenants): a burst of ``requests`` (capacity: answered / span),
  then Poisson arrivals of as many requests at ``load_fraction`` of that capacity (p50/p99 from
  each request's scheduled arrival to its answer).

And ``daemon`` (:func:`run_daemon`): LoRA tenants uploaded through an in-process ``Daemon``
(a tenants.yaml of ``max(counts)`` LoRA tenants; each upload takes the RPC's path: durable
blob write, validation, a probe forward, the add): upload time and memory at each count.

Cold first responses (``itif.bench.tenant_cold.run_cold``, run by the ``daemon`` kind after its
uploads): an
in-process ``Daemon`` with weight tiers (``backbone.device_weight_bytes`` for the pinned base
and ``cold_device`` tenants, ``host_weight_bytes`` for ``cold_host``), ``cold_tenants`` LoRA r=8
tenants on that base (and ``cold_full`` full fine-tunes, in a second daemon) registered on
disk (their blobs committed to the store, then a start: the restart path), then one request at
a time to a tenant on disk, on host and resident (in rotation, ``cold_samples`` each): the time
from submit to answer of each, p50/p99 per source tier, the resident ones as the warm baseline
of the same run and the cold/warm ratios; each cold tenant's second request (resident by then)
too. Every answer is checked against PEFT / Hugging Face, and each cold request against the
tiers' promotion count of its tenant and ``itif_tier_promotions_total{source}`` in the daemon's
``/metrics`` registry. These rows have ``status`` ``"cold"`` (not ``"ok"``: they carry no add
or memory figures, so the add/memory plot and table skip them; :func:`print_rows` prints them).
"""

from __future__ import annotations

import gc
import logging
import statistics
import threading
import time
from dataclasses import asdict

import numpy as np
import torch

from itif.backbones.spec import load_spec
from itif.bench.tenant_kinds import (  # re-exported: the suite's names stay here
    COLD_SOURCES,
    SUITE_KINDS,
    Kind,
    ScaleSettings,
    log,
    lora_adapter,
    rss_bytes,
    tenant_name,
)
from itif.bench.tenant_kinds import pct as _pct
from itif.bench.tenants import tenant_weights
from itif.bench.workloads import poisson_arrivals, sample_lengths, sample_tenants


def sample_indices(count: int, sample: int) -> list[int]:
    """``sample`` tenant indices spread evenly over ``0 .. count-1`` (first and last included)."""
    return sorted({int(x) for x in np.linspace(0, count - 1, min(sample, count))})


def check_sample(engine, kind: Kind, count: int, sample: int, rng: np.random.Generator,
                 reference=None) -> dict:
    """One mixed batch of ``sample`` tenants (two requests each) against the reference:
    ``max_abs_diff`` of the logits, and the indices checked."""
    from itif.requests import Request  # noqa: PLC0415

    ref = reference or kind.reference()
    idx = sample_indices(count, sample)
    reqs = []
    for i in idx:
        for _ in range(2):
            n = int(rng.integers(2, min(64, kind.spec.max_position) + 1))
            reqs.append((i, rng.integers(0, kind.spec.vocab_size, n)))
    results = engine.infer([Request(tenant_name(kind.kind, i), input_ids=ids, outputs=("logits",))
                            for i, ids in reqs])
    worst = 0.0
    for (i, ids), res in zip(reqs, results):
        want = ref(i, torch.as_tensor(ids, dtype=torch.long)[None])
        worst = max(worst, float(np.abs(res.logits - want).max()))
    return dict(sample=idx, max_abs_diff=worst)


# ---- serving ------------------------------------------------------------------------------

def serve_point(engine, names: list[str], cfg: ScaleSettings, skew: str | None,
                rng: np.random.Generator) -> dict:
    """A burst, then Poisson arrivals at ``load_fraction`` of the burst's throughput, through
    one ``Scheduler`` over ``engine.infer`` with every name registered."""
    from itif.requests import Request  # noqa: PLC0415
    from itif.scheduler import Scheduler  # noqa: PLC0415
    from itif.scheduler.tickets import TenantQuota  # noqa: PLC0415

    spec = engine.spec
    sched = Scheduler(engine.infer, max_wait_ms=cfg.max_wait_ms)
    quota = TenantQuota(max_queue=1_000_000)
    for t in names:
        sched.set_tenant(t, quota)
    clock = time.perf_counter

    def build(n):
        who = sample_tenants(len(names), n, skew, rng)
        lens = sample_lengths(cfg.lengths, n, spec.max_position, rng)
        return [Request(names[w], input_ids=rng.integers(0, spec.vocab_size, int(L)),
                        outputs=("logits",)) for w, L in zip(who, lens)], who

    def send(reqs, arrivals):
        n = len(reqs)
        done = np.full(n, np.nan)
        left = [n]
        finished = threading.Event()
        lock = threading.Lock()

        def cb(i):
            def f(ticket):
                now = clock()
                with lock:
                    done[i] = now if ticket.exception(0) is None else np.nan
                    left[0] -= 1
                    if not left[0]:
                        finished.set()
            return f

        start = clock() + 0.005
        for i, r in enumerate(reqs):
            delay = start + arrivals[i] - clock()
            if delay > 0:
                time.sleep(delay)
            sched.submit(r, tokens=len(r.input_ids)).add_done_callback(cb(i))
        finished.wait(600)
        ok = ~np.isnan(done)
        lat = (done - (start + arrivals))[ok] * 1e3
        span = float(np.nanmax(done) - start) if ok.any() else float("nan")
        return dict(sent=n, completed=int(ok.sum()),
                    throughput_rps=round(float(ok.sum()) / span, 1) if ok.any() else 0.0,
                    p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99))

    sched.start()
    try:
        warm, _ = build(min(64, cfg.requests))
        send(warm, np.zeros(len(warm)))
        reqs, who = build(cfg.requests)
        burst = send(reqs, np.zeros(len(reqs)))
        rate = max(1.0, cfg.load_fraction * burst["throughput_rps"])
        arrivals = poisson_arrivals(rate, 1e9, cfg.requests, rng)
        reqs, _ = build(len(arrivals))
        st0 = sched.stats
        paced = send(reqs, arrivals)
        st = sched.stats
    finally:
        sched.stop()
    return dict(skew=skew or "uniform", distinct_tenants=int(len(set(who.tolist()))),
                capacity_rps=burst["throughput_rps"], burst_p50_ms=burst["p50_ms"],
                burst_p99_ms=burst["p99_ms"], rate_rps=round(rate, 1), **{
                    k: paced[k] for k in ("sent", "completed", "throughput_rps", "p50_ms",
                                          "p99_ms")},
                mean_batch=round((st.requests_run - st0.requests_run)
                                 / max(1, st.batches - st0.batches), 2))


# ---- one kind -----------------------------------------------------------------------------
def add_stats(times_s: list[float]) -> dict:
    """Add-time figures (ms) of adds ``0 .. len-1``."""
    ms = np.asarray(times_s) * 1e3
    return dict(first_add_ms=round(float(ms[0]), 3), median_add_ms=round(float(np.median(ms)), 3),
                last100_median_add_ms=round(float(np.median(ms[-100:])), 3),
                last_add_ms=round(float(ms[-1]), 3), p99_add_ms=_pct(ms, 99),
                max_add_ms=round(float(ms.max()), 3))


def store_bytes(engine, kind: Kind, count: int) -> dict:
    """The store's accounting: every distinct tensor once (``weight_bytes``), the tenants' own
    bytes (``exclusive_bytes``: what removing one frees) and the base (the rest)."""
    own = [engine.tenant_info(tenant_name(kind.kind, i)).exclusive_bytes for i in range(count)]
    total = engine.weight_bytes
    return dict(weight_bytes=total, own_bytes_sum=int(sum(own)),
                base_bytes=int(total - sum(own)),
                own_bytes_per_tenant=int(statistics.median(own)))


def run_kind(kind_name: str, cfg: ScaleSettings, serve: bool = True,
             check: bool = True) -> list[dict]:
    """Rows of one kind: one per count (see the module docstring). Two passes, each over the
    counts in ascending order: registration (add times, bytes, RSS; nothing runs a forward
    before the last RSS reading, so the heap holds no freed forward temporaries), then the
    sample check on that Engine; serving on a second Engine registered again up to each count
    (its scheduler holds exactly the tenants registered)."""
    from itif.runtime.engine import Engine  # noqa: PLC0415

    torch.manual_seed(cfg.seed)
    spec = load_spec(cfg.model)
    kind = Kind(kind_name, spec, cfg.lora_rank)
    rng = np.random.default_rng(cfg.seed)
    reference = kind.reference() if check else None  # imports (transformers, peft) before
    counts = sorted(cfg.counts)
    base = dict(suite="tenants", model=cfg.model, kind=kind_name, device=cfg.device,
                dtype=cfg.dtype, lora_rank=cfg.lora_rank if kind_name == "lora" else None)
    rows = []
    for count in counts:
        if kind_name == "full" and count > cfg.full_max:
            rows.append(dict(base, tenants=count, status="skipped",
                             reason=f"full tenants are registered up to {cfg.full_max} "
                             "(--scale-full-max; host memory)"))
    counts = [c for c in counts if kind_name != "full" or c <= cfg.full_max]
    engine = Engine(spec, device=cfg.device, dtype=cfg.dtype)
    gc.collect()
    rss0 = rss_bytes()
    kind.prepare(engine)
    times: list[float] = []
    done = []
    for count in counts:
        t0 = time.monotonic()
        for i in range(len(times), count):
            times.append(kind.add(engine, i))
        reg_s = time.monotonic() - t0
        gc.collect()
        rss = rss_bytes()
        row = dict(base, tenants=count, status="ok", **add_stats(times),
                   registration_s=round(reg_s, 2), **store_bytes(engine, kind, count),
                   rss_bytes=rss, rss_before_bytes=rss0)
        row["rss_ratio"] = round((rss - rss0) / row["weight_bytes"], 3)
        row["reserved_bytes"] = engine.store.reserved_bytes
        done.append(row)
    if check:
        for row in done:
            row.update(check_sample(engine, kind, row["tenants"], cfg.sample, rng, reference))
    del engine
    gc.collect()
    if serve and counts:
        engine = Engine(spec, device=cfg.device, dtype=cfg.dtype)
        kind.prepare(engine)
        n = 0
        for row in done:
            for i in range(n, row["tenants"]):
                kind.add(engine, i)
            n = row["tenants"]
            names = [tenant_name(kind_name, i) for i in range(n)]
            row["serving"] = [serve_point(engine, names, cfg, s, rng) for s in cfg.skews]
    for row in done:
        log.info("tenants %s x%d: add median %.2f ms, last100 %.2f ms, last %.2f ms, p99 %.2f "
                 "ms; %.1f MB stored, rss ratio %.2f%s%s", kind_name, row["tenants"],
                 row["median_add_ms"], row["last100_median_add_ms"], row["last_add_ms"],
                 row["p99_add_ms"], row["weight_bytes"] / 1e6, row["rss_ratio"],
                 f", max abs diff {row['max_abs_diff']:.2e}" if check else "",
                 "".join(f"; {s['skew']} {s['throughput_rps']} req/s p50 {s['p50_ms']} p99 "
                         f"{s['p99_ms']} ms" for s in row.get("serving", ())))
    return sorted(rows + done, key=lambda r: r["tenants"])


def run_daemon(cfg: ScaleSettings) -> list[dict]:
    """LoRA r=8 tenants registered through an in-process ``Daemon``: a tenants.yaml of
    ``max(counts)`` LoRA tenants on one full ``base`` (parsed once, timed), then an upload
    (``Daemon.upload``: the upload RPC's path: blob write, validation, probe forward, add) per
    tenant up to each count. Rows as ``run_kind``'s (``kind`` ``daemon_lora``; add figures are
    whole uploads), without serving; the sample check runs on the daemon's engine."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from itif.backbones.lora_tenants import CONFIG_KEY  # noqa: PLC0415
    from itif.bench.serving import free_ports  # noqa: PLC0415
    from itif.bench.tenants import to_hf  # noqa: PLC0415
    from itif.config import hash_token, parse_config  # noqa: PLC0415
    from itif.daemon import Daemon, Identity  # noqa: PLC0415
    from itif.safetensors_io import save_safetensors  # noqa: PLC0415

    spec = load_spec(cfg.model)
    kind = Kind("lora", spec, cfg.lora_rank, base="base", base_mode="full")
    reference = kind.reference()
    rng = np.random.default_rng(cfg.seed)
    counts = sorted(cfg.counts)
    n_max = counts[-1]
    admin = Identity(None, admin=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="itif-bench-tenants-") as tmp:
        tmp = Path(tmp)
        lines = ["server:", f"  listen: 127.0.0.1:{free_ports(1)[0]}", "  data_dir: ./data",
                 f"  admin_token_sha256: {hash_token('admin')}", "backbone:",
                 f"  config: {cfg.model}", f"  device: {cfg.device}", f"  dtype: {cfg.dtype}",
                 "tenants:", f"  - id: base\n    token_sha256: {hash_token('base')}"]
        lines += [f"  - id: {tenant_name('lora', i)}\n    token_sha256: {hash_token(f't{i}')}"
                  "\n    base: base" for i in range(n_max)]
        t0 = time.perf_counter()
        config = parse_config("\n".join(lines) + "\n", tmp)
        parse_s = time.perf_counter() - t0
        d = Daemon(config)
        d.start()

        def upload(name: str, tensors: dict, metadata=None) -> float:
            path = tmp / "upload.safetensors"
            save_safetensors(tensors, path, metadata=metadata)
            data = path.read_bytes()
            t0 = time.perf_counter()
            d.upload(admin, name, hashlib.sha256(data).hexdigest(), len(data), [data])
            return time.perf_counter() - t0

        try:
            upload("base", to_hf(spec, tenant_weights(spec, 0, "full")))
            gc.collect()
            rss0 = rss_bytes()
            times: list[float] = []
            for count in counts:
                for i in range(len(times), count):
                    config_i, tensors = lora_adapter(spec, i, cfg.lora_rank)
                    meta = {CONFIG_KEY: json.dumps(config_i, sort_keys=True)}
                    times.append(upload(tenant_name("lora", i), tensors, meta))
                gc.collect()
                rss = rss_bytes()
                engine = d.engine
                row = dict(suite="tenants", model=cfg.model, kind="daemon_lora",
                           device=cfg.device, dtype=cfg.dtype, lora_rank=cfg.lora_rank,
                           tenants=count, configured_tenants=n_max + 1, status="ok",
                           config_parse_s=round(parse_s, 2), **add_stats(times),
                           **store_bytes(engine, kind, count), rss_bytes=rss,
                           rss_before_bytes=rss0)
                row["rss_ratio"] = round((rss - rss0) / row["weight_bytes"], 3)
                row.update(check_sample(engine, kind, count, cfg.sample, rng, reference))
                rows.append(row)
                log.info("tenants daemon_lora x%d: upload median %.2f ms, last100 %.2f ms, p99 "
                         "%.2f ms; rss ratio %.2f, max abs diff %.2e", count,
                         row["median_add_ms"], row["last100_median_add_ms"], row["p99_add_ms"],
                         row["rss_ratio"], row["max_abs_diff"])
        finally:
            d.stop()
    return rows


def _child(kind_name: str, cfg_dict: dict) -> list[dict]:
    """One kind in a spawned process (``run_suite``)."""
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("bench: %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    cfg = ScaleSettings(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in cfg_dict.items()})
    return _run(kind_name, cfg)


def _run(kind_name: str, cfg: ScaleSettings) -> list[dict]:
    if kind_name == "daemon":  # uploads, then cold first responses (daemons with tiers)
        rows = run_daemon(cfg)
        gc.collect()
        from itif.bench.tenant_cold import run_colds  # noqa: PLC0415 - imports this module

        return rows + run_colds(cfg)
    return run_kind(kind_name, cfg)


def run_suite(cfg: ScaleSettings, isolate: bool = True) -> list[dict]:
    """Every kind of ``cfg``, each in a fresh child process (``isolate``) so its resident-set
    baseline holds no other kind's memory; a kind that fails gives one error row."""
    import multiprocessing as mp  # noqa: PLC0415

    rows: list[dict] = []
    for k in cfg.kinds:
        try:
            if isolate:
                with mp.get_context("spawn").Pool(1) as pool:
                    rows += pool.apply(_child, (k, asdict(cfg)))
            else:
                rows += _run(k, cfg)
        except Exception as e:  # noqa: BLE001 - one kind's failure is reported, not fatal
            log.warning("tenants %s failed: %s: %s", k, type(e).__name__, e)
            rows.append(dict(suite="tenants", model=cfg.model, kind=k, tenants=None,
                             status="error", reason=f"{type(e).__name__}: {e}"))
    return rows


def settings_from_args(args, quick: bool, device: str, dtype: str) -> ScaleSettings:
    counts = tuple(args.scale_counts or ((100, 1000) if quick else (100, 1000, 10000)))
    if any(c < 1 for c in counts):
        raise ValueError("--scale-counts takes counts >= 1")
    return ScaleSettings(model=args.scale_model or "bert-tiny", counts=counts,
                         kinds=tuple(args.scale_kinds or SUITE_KINDS),
                         full_max=args.scale_full_max,
                         requests=args.scale_requests or (300 if quick else 2000),
                         seed=args.seed, device=device, dtype=dtype)


def print_rows(rows: list[dict]) -> None:
    """The suite's rows as a table on stdout."""
    if any(r.get("suite") == "tenants" and r.get("status") != "cold" for r in rows):
        print(f"{'kind':11s} {'tenants':>7s} {'first':>7s} {'median':>7s} {'last100':>7s} "
              f"{'last':>7s} {'p99':>7s} {'own B':>7s} {'MB held':>8s} {'rss x':>6s} "
              f"{'max diff':>9s}  serving (uniform / zipf): req/s, p50/p99 ms")
    cold = []
    for r in rows:
        if r.get("suite") != "tenants":
            continue
        if r.get("status") == "cold":
            cold.append(r)
            continue
        if r.get("status") != "ok":
            print(f"{r['kind']:11s} {r.get('tenants') or '':>7} {r['status']}: "
                  f"{r.get('reason')}")
            continue
        serve = "; ".join(f"{s['throughput_rps']}, {s['p50_ms']}/{s['p99_ms']}"
                          for s in r.get("serving", ()))
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
        print(f"{r['kind']:11s} {r['tenants']:7d} {r['first_add_ms']:7.2f} "
              f"{r['median_add_ms']:7.2f} {r['last100_median_add_ms']:7.2f} "
              f"{r['last_add_ms']:7.2f} {r['p99_add_ms']:7.2f} "
              f"{r['own_bytes_per_tenant']:7d} {r['weight_bytes'] / 1e6:8.1f} "
              f"{r['rss_ratio']:6.2f} {diff:>9s}  {serve}")
    if cold:
        print("\ncold kind   tenants  first response p50/p99 ms from disk | host | resident"
              "  (p50 ratio to resident: disk, host)  promotions counted  max diff")
        for r in cold:
            f = r["first_response"]
            cells = " | ".join(f"{f[s]['p50_ms']}/{f[s]['p99_ms']}" for s in COLD_SOURCES)
            print(f"{r['kind']:11s} {r['tenants']:7d}  {cells}  ({r['ratio_p50']['disk']}, "
                  f"{r['ratio_p50']['host']})  {r['promotions_counted']}/{r['cold_requests']}  "
                  f"{r['max_abs_diff']:.1e}")
