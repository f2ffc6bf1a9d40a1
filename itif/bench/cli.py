"""``itif bench``: the fused engine against one-instance-per-tenant baselines, and a serving sweep.

    itif bench --quick --json                 # CI smoke run: tiny presets, < 2 minutes on a CPU
    itif bench                                # full run: writes bench/results/<name>.json + PNGs
    itif bench --models albert-large --tenants 2 4 8 --suites table batch

This module only parses and orchestrates; importing it is cheap (``itif --help`` stays fast).
"""

from __future__ import annotations

import argparse

SUITE_HELP = ("table: the thesis' Table 5.2 (2-5 tenants, one request each, seq 128 / 224x224); "
              "scale: more tenants (8-64); batch: requests per tenant up to 64 at seq 64 "
              "(Fig. 5.2-5.4); serve: Poisson load through the real daemon; tenants: 100-10,000 "
              "head-only / LoRA / full tenants of one small backbone in one Engine, and LoRA "
              "uploads through a daemon (add time, memory, serving, correctness; not in the "
              "default suites); peer: issue 65's small BERT classifier on the CPU against vLLM's "
              "CPU build and Hugging Face, one model and T fine-tunes, interleaved (not in the "
              "default suites; vLLM rows skipped where vllm is not importable); decoder: issue "
              "62's small random Llama with LoRA adapters and full fine-tunes, generating, "
              "itif against HF + PEFT and vLLM's CPU build (not in the default suites)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="tiny presets, 2-4 tenants, few repeats, a short serving sweep (CI)")
    p.add_argument("--json", action="store_true",
                   help="print the rows as one JSON list on stdout (progress goes to stderr)")
    p.add_argument("--models", nargs="+", help="backbone presets (default: bert-base albert-large "
                   "vit-base; --quick: the -tiny ones)")
    p.add_argument("--tenants", nargs="+", type=int, help="tenant counts for table/scale/batch")
    p.add_argument("--requests", nargs="+", type=int, help="requests per tenant for batch")
    p.add_argument("--seq-len", type=int, help="tokens per text request for table/scale/batch "
                   "(default: 128 for table and scale, 64 for batch; capped by the backbone)")
    p.add_argument("--suites", nargs="+",
                   choices=("table", "scale", "batch", "serve", "tenants", "peer", "decoder"),
                   help=SUITE_HELP)
    p.add_argument("--systems", nargs="+",
                   choices=("seq", "multi_stream", "mps", "hf", "hf_compiled", "itif",
                            "itif_nographs"),
                   help="offline systems (default: all; --quick: all but hf_compiled). itif has "
                   "CUDA graphs on, itif_nographs off (CUDA only)")
    p.add_argument("--strategies", nargs="+", help="planner strategies of the itif rows "
                   "(default: all)")
    p.add_argument("--repeats", type=int, help="timed runs per system (after a warm-up)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto")
    p.add_argument("--fine-tune", default="full",
                   help="what tenants own: full (all weights; the thesis), head, or last:K")
    p.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("baselines and diagnostics")
    c.add_argument("--compile-mode", default="max-autotune",
                   help="torch.compile mode of hf_compiled (max-autotune, reduce-overhead, "
                   "default, ...); the CPU always uses default")
    c.add_argument("--compile-bound", action="store_true",
                   help="bound max-autotune's compile time: GEMM autotuning only (no "
                   "coordinate-descent tuning, ATEN+TRITON GEMM backends)")
    c.add_argument("--mps-max-tenants", type=int,
                   help="run mps only up to this many tenants (one process each); more: skipped")
    c.add_argument("--hf-reference", choices=("auto", "on", "off"), default="auto",
                   help="max_abs_diff_vs_hf_fp32 on every row: Hugging Face in float32 "
                   "(auto: on CUDA; on the CPU for small presets only)")
    c.add_argument("--back-to-back", action="store_true",
                   help="also time each system's repeats in a row after the interleaved runs: "
                   "latency_ms_alone and speedup_vs_<baseline>_alone on every row")
    c.add_argument("--no-counts", action="store_true",
                   help="skip kernels_per_run / launch_calls_per_run (CUDA) and "
                   "aten_ops_per_run / matmul_ops_per_run (CPU)")
    g = p.add_argument_group("serving sweep")
    g.add_argument("--serve-model", help="text backbone (default: bert-base; --quick bert-tiny)")
    g.add_argument("--serve-tenants", type=int, help="tenants (default 8; --quick 4)")
    g.add_argument("--mixes", nargs="+", help="length mix[+popularity], e.g. uniform:2-100 "
                   "normal:20:20 uniform:2-100+zipf:1.2 (the default)")
    g.add_argument("--serve-rates", nargs="+", type=float,
                   help="absolute rates in req/s (default: fractions of a calibrated capacity)")
    g.add_argument("--serve-duration", type=float, help="seconds of arrivals per rate")
    g.add_argument("--serve-strategies", nargs="+", help="fused daemons' strategies")
    g.add_argument("--serve-max-batch-tokens", type=int,
                   help="every daemon's scheduler.max_batch_tokens (default: the daemon's)")
    g.add_argument("--serve-max-batch-size", type=int,
                   help="every daemon's scheduler.max_batch_size (default: the daemon's)")
    g.add_argument("--serve-latency-sizing", action="store_true",
                   help="one more fused daemon with scheduler.latency_sizing on (itif_sized)")
    g.add_argument("--serve-gemm-loop", action="store_true",
                   help="one more fused daemon with ITIF_GROUPED_GEMM=loop (itif_loop): each "
                        "ragged product one torch.mm a tenant, not one grouped cuBLAS call "
                        "(the CUDA default)")
    g.add_argument("--serve-ingress", type=int, default=0,
                   help="every daemon's server.ingress_processes (gRPC served by that many "
                        "processes besides the daemon's; default 0)")
    g.add_argument("--serve-budget", type=float,
                   help="seconds for the whole sweep: no new point starts after them, so a "
                        "caller's timeout finds the rows written (default: no limit)")
    g.add_argument("--serve-p99-at", type=float, default=0.7,
                   help="after each mode's sweep, one more point at this fraction of its own "
                   "saturation throughput (its p99 goes on the saturation row); 0: none")
    t = p.add_argument_group("tenant scale (--suites tenants)")
    t.add_argument("--scale-model", help="small text backbone (default bert-tiny)")
    t.add_argument("--scale-counts", nargs="+", type=int,
                   help="tenant counts, ascending (default 100 1000 10000; --quick 100 1000)")
    t.add_argument("--scale-kinds", nargs="+", choices=("head", "lora", "full", "daemon"),
                   help="tenant kinds (default all: head-only, LoRA r=8, full in one Engine; "
                   "daemon: LoRA r=8 uploaded through an in-process daemon)")
    t.add_argument("--scale-full-max", type=int, default=1000,
                   help="register full tenants up to this count (host memory; default 1000)")
    t.add_argument("--scale-requests", type=int,
                   help="requests per serving point (default 2000; --quick 300)")
    q = p.add_argument_group("CPU peer (--suites peer; itif/bench/cpu_peer.py)")
    q.add_argument("--peer-tenants", type=int, default=8,
                   help="fine-tunes of the second workload: one itif engine, T vLLM engines, "
                   "T HF models (default 8)")
    q.add_argument("--peer-requests", type=int, default=256, help="requests (default 256)")
    q.add_argument("--peer-lengths", default="uniform:2-100",
                   help="request lengths, uniform:LO-HI or normal:MEAN:VAR (default uniform:2-100)")
    q.add_argument("--peer-bf16", action="store_true",
                   help="also itif in bfloat16 (itif_bf16 rows; --dtype stays the others')")
    q.add_argument("--peer-no-vllm", action="store_true",
                   help="skip the vLLM rows even where vllm is importable")
    d = p.add_argument_group("decoder (--suites decoder; itif/bench/decoder_peer.py)")
    d.add_argument("--dec-adapters", type=int,
                   help="PEFT LoRA adapters on the base (default 8; --quick 2)")
    d.add_argument("--dec-full", type=int, help="full fine-tunes (default 2; --quick 1)")
    d.add_argument("--dec-prompts", type=int,
                   help="prompts of 16-64 tokens, prompt i to tenant i mod tenants "
                   "(default 64; --quick 6)")
    d.add_argument("--dec-new-tokens", type=int,
                   help="new tokens of every prompt, exactly (default 32; --quick 4)")
    d.add_argument("--dec-no-vllm", action="store_true",
                   help="skip the vLLM rows even where vllm is importable")
    d.add_argument("--dec-shape", choices=("tiny", "llama3-8b-l2"), default="tiny",
                   help="model shape: tiny (hidden 128, the CPU suite) or llama3-8b-l2 "
                   "(Llama-3-8B layers, 2 of them; with --device cuda --dtype bfloat16)")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="result JSON (default for full runs: bench/results/<name>.json; "
                   "--quick writes nothing unless given)")
    o.add_argument("--name", help="result name (default: <device>-<date>)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def check_out(out: str) -> None:
    """``--out`` before anything runs (not after the first group): not a directory, and the
    nearest directory above it that exists is writable (missing ones are made)."""
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from itif.errors import InvalidRequest  # noqa: PLC0415

    path = Path(out)
    if path.is_dir():
        raise InvalidRequest(f"--out {out}: is a directory (give the result's .json file)")
    tmp = path.with_name(path.name + ".tmp")  # written first, then renamed onto --out
    if tmp.is_dir():
        raise InvalidRequest(f"--out {out}: {tmp} is a directory")
    for where in (path, tmp):
        if where.exists() and not os.access(where, os.W_OK):
            raise InvalidRequest(f"--out {out}: {where} is not writable")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidRequest(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidRequest(f"--out {out}: directory {parent} is not writable")


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_out(args.out)
    import dataclasses  # noqa: PLC0415
    import json  # noqa: PLC0415
    import logging  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from itif.batching.strategies import DEFAULT_STRATEGY, STRATEGIES  # noqa: PLC0415
    from itif.bench import offline  # noqa: PLC0415
    from itif.bench import workloads as wl  # noqa: PLC0415
    from itif.bench.meta import collect_meta, result_name  # noqa: PLC0415
    from itif.bench.roofline import (  # noqa: PLC0415
        COPY_BYTES_CPU_QUICK,  # noqa: PLC0415
        copy_bandwidth,
        device_peak,
    )
    from itif.bench.tenants import parse_fine_tune  # noqa: PLC0415
    from itif.errors import InvalidRequest  # noqa: PLC0415
    from itif.platform import resolve_device, resolve_dtype, tune_host_malloc  # noqa: PLC0415

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("bench: %(message)s"))
    blog = logging.getLogger("itif.bench")
    blog.addHandler(handler)
    blog.setLevel(logging.INFO)
    blog.propagate = False

    t_start = time.monotonic()
    quick = args.quick
    device = resolve_device(args.device)
    tune_host_malloc(device)  # before any baseline: every system runs under one allocator
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    gpu = device.type == "cuda"
    parse_fine_tune(args.fine_tune)
    models = tuple(args.models or (wl.QUICK_MODELS if quick else wl.FULL_MODELS))
    suites = tuple(args.suites or wl.SUITES)
    systems = tuple(args.systems or (offline.QUICK_SYSTEMS if quick else offline.SYSTEMS))
    if "peer" in suites:  # its flags are checked before anything is measured or built
        if device.type != "cpu":
            raise InvalidRequest("--suites peer is a CPU suite: run it with --device cpu")
        if "+" in args.peer_lengths:
            raise InvalidRequest(f"--peer-lengths {args.peer_lengths}: lengths only "
                                 "(uniform:LO-HI or normal:MEAN:VAR), no popularity")
        try:
            wl.parse_mix(args.peer_lengths)
        except InvalidRequest as e:
            raise InvalidRequest(f"--peer-lengths: {e}") from None
        if args.peer_tenants < 1 or args.peer_requests < 1:
            raise InvalidRequest("--peer-tenants and --peer-requests take counts >= 1")
    dec_cfg = None
    if "decoder" in suites:  # checked before anything is measured or built
        from itif.bench import decoder_peer  # noqa: PLC0415

        dec_cfg = decoder_peer.settings_from_args(args, quick, str(device), dtype_name)
        dec_cfg.check()
    strategies = list(args.strategies or STRATEGIES)
    for s in strategies:
        if s not in STRATEGIES:
            raise InvalidRequest(f"unknown strategy {s!r}; choose from {sorted(STRATEGIES)}")
    if DEFAULT_STRATEGY in strategies:  # the default first: it is the reference of the checks
        strategies.remove(DEFAULT_STRATEGY)
        strategies.insert(0, DEFAULT_STRATEGY)
    repeats = args.repeats or (3 if quick else (10 if gpu else 5))
    if repeats < 1:
        raise InvalidRequest("--repeats must be >= 1")
    if any(t < 1 for t in args.tenants or ()) or any(r < 1 for r in args.requests or ()):
        raise InvalidRequest("--tenants and --requests take counts >= 1")
    if args.mps_max_tenants is not None and args.mps_max_tenants < 1:
        raise InvalidRequest("--mps-max-tenants must be >= 1")

    peak = device_peak(device, dtype, quick)
    blog.info("device %s, %s; peak %s", device, dtype_name, peak.source)
    groups: dict[tuple[str, int], list] = {}
    if args.seq_len is not None and args.seq_len < 1:
        raise InvalidRequest("--seq-len takes a token count >= 1")
    for w in wl.offline_workloads(suites, models, args.tenants, args.requests, quick, gpu,
                                  seq_len=args.seq_len):
        groups.setdefault((w.model, w.tenants), []).append(w)
    bandwidth = None
    if groups and any(s.startswith("itif") for s in systems):
        bandwidth, bw_source = copy_bandwidth(device,
                                              COPY_BYTES_CPU_QUICK if quick and not gpu else None)
        blog.info("copy bandwidth %s", bw_source)
    opt = offline.OfflineSettings(device=str(device), dtype=dtype_name, systems=systems,
                                  strategies=tuple(strategies), repeats=repeats,
                                  warmup=1, fine_tune=args.fine_tune, seed=args.seed,
                                  compile_mode=args.compile_mode,
                                  compile_bound=args.compile_bound,
                                  mps_max_tenants=args.mps_max_tenants,
                                  hf_reference=args.hf_reference, counts=not args.no_counts,
                                  bandwidth=bandwidth, alone=args.back_to_back)
    settings = dict(quick=quick, suites=suites, models=models, systems=systems,
                    strategies=strategies, repeats=repeats, fine_tune=args.fine_tune,
                    compile_mode=args.compile_mode, compile_bound=args.compile_bound,
                    mps_max_tenants=args.mps_max_tenants, hf_reference=args.hf_reference,
                    back_to_back=args.back_to_back)
    out = Path(args.out) if args.out else None
    if out is None and not quick:
        name = args.name or (f"{device.type}-tenants-{_today()[:10]}" if suites == ("tenants",)
                             else f"cpu-peer-vllm-{_today()[:10]}" if suites == ("peer",)
                             else f"cpu-decoder-{_today()[:10]}" if suites == ("decoder",)
                             else result_name(device, _today()))
        out = Path("bench/results") / f"{name}.json"
    rows: list[dict] = []

    def write(partial: bool, more: list[dict] | None = None) -> dict:
        meta = collect_meta(device, dtype, peak, args, dict(
            settings, wall_s=round(time.monotonic() - t_start, 1)))
        if bandwidth is not None:
            meta["copy_bandwidth"] = dict(bytes_per_s=bandwidth, source=bw_source)
        if partial:
            meta["partial"] = True
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(dict(meta=meta, rows=rows + (more or [])), indent=1)
                           + "\n")
            tmp.replace(out)  # a run killed mid-way leaves the last complete group's rows
        return meta

    for (model, n), ws in groups.items():
        t0 = time.monotonic()
        try:
            rows += offline.run_group(model, n, ws, opt, peak)
        except Exception as e:  # noqa: BLE001 - one group's failure is reported, not fatal
            blog.warning("%s x%d tenants failed: %s: %s", model, n, type(e).__name__, e)
            rows += [dict(suite=w.suite, model=model, tenants=n,
                          requests_per_tenant=w.requests_per_tenant, seq_len=w.seq_len,
                          system=s, strategy=None, status="error",
                          reason=f"{type(e).__name__}: {e}", latency_ms=None)
                     for w in ws for s in systems]
        blog.info("%s x%d tenants: %d workloads in %.1f s", model, n, len(ws),
                  time.monotonic() - t0)
        write(partial=True)

    if "serve" in suites:
        rows += _serve(args, quick, models, strategies, device, dtype_name, blog,
                       lambda part: write(partial=True, more=part))

    if "peer" in suites:
        from itif.bench import cpu_peer  # noqa: PLC0415

        peer_cfg = cpu_peer.PeerSettings(
            tenants=args.peer_tenants, requests=args.peer_requests, lengths=args.peer_lengths,
            repeats=repeats, seed=args.seed, dtype=dtype_name, bf16=args.peer_bf16,
            vllm=not args.peer_no_vllm, strategy=args.strategies[0] if args.strategies else None)
        settings["peer"] = dataclasses.asdict(peer_cfg)
        settings["peer"]["cpu_bf16"] = cpu_peer.cpu_bf16()
        # vLLM's CPU thread binding comes from its environment (VLLM_CPU_OMP_THREADS_BIND,
        # VLLM_CPU_NUM_OF_RESERVED_CPU): what this run had is part of what it measured
        settings["peer"]["vllm_env"] = cpu_peer.vllm_env()
        rows += cpu_peer.run_suite(peer_cfg)

    if dec_cfg is not None:
        from itif.bench import cpu_peer, decoder_peer  # noqa: PLC0415

        settings["decoder"] = dict(decoder_peer.settings_dict(dec_cfg),
                                   vllm_env=cpu_peer.vllm_env())
        rows += decoder_peer.run_suite(dec_cfg)

    if "tenants" in suites:
        from itif.bench import tenant_scale  # noqa: PLC0415

        scale_cfg = tenant_scale.settings_from_args(args, quick, device.type, dtype_name)
        settings["tenant_scale"] = tenant_scale.asdict(scale_cfg)
        rows += tenant_scale.run_suite(scale_cfg)
    meta = write(partial=False)
    if out is not None:
        if not args.no_plots:
            try:
                from itif.bench.plots import make_plots  # noqa: PLC0415

                meta["plots"] = [str(p) for p in make_plots(rows, meta, out.with_suffix(""))]
                out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
            except ImportError as e:
                blog.warning("no plots (%s): pip install matplotlib", e)
        blog.info("wrote %s", out)
    if args.json:
        print(json.dumps(rows))
    else:
        mine = ("tenants", "peer", "decoder")  # suites that print their own tables
        other = [r for r in rows if r.get("suite") not in mine]
        if other or not set(mine) & set(suites):
            _print_table(other)
        if "peer" in suites:
            cpu_peer.print_rows(rows)
        if dec_cfg is not None:
            decoder_peer.print_rows(rows)
        if "tenants" in suites:
            tenant_scale.print_rows(rows)
    blog.info("done in %.1f s", time.monotonic() - t_start)
    return 0


def _serve(args, quick, models, strategies, device, dtype_name, blog, save) -> list[dict]:
    """The serving sweep's rows; ``save(rows)`` keeps a partial result after every point."""
    import time  # noqa: PLC0415

    from itif.backbones.spec import load_spec  # noqa: PLC0415
    from itif.bench import serving  # noqa: PLC0415
    from itif.bench import workloads as wl  # noqa: PLC0415
    from itif.platform import device_name  # noqa: PLC0415

    model = args.serve_model
    if model is None:
        text = [m for m in models if load_spec(m).is_text]
        default = "bert-tiny" if quick else "bert-base"
        model = default if args.models is None or not text else text[0]
    mixes = tuple(wl.parse_mix(m) for m in args.mixes) if args.mixes else (
        wl.DEFAULT_MIXES[:1] if quick else wl.DEFAULT_MIXES)
    serve_strats = tuple(args.serve_strategies or ([strategies[0]] if quick else
                                                   [strategies[0]] + [s for s in strategies[1:]
                                                                      if s == "itif_two_stage"]))
    tenants = args.serve_tenants or (4 if quick else 8)
    cfg = serving.ServeSettings(
        model=model, tenants=tenants, device=str(device.type), dtype=dtype_name, mixes=mixes,
        strategies=serve_strats,
        fractions=(0.5, 1.0, 1.5) if quick else (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
        rates=tuple(args.serve_rates) if args.serve_rates else None,
        duration_s=args.serve_duration or (1.0 if quick else 10.0),
        max_requests=600 if quick else 20000, timeout_s=20.0 if quick else 60.0,
        max_wait_ms=2.0 if quick else 5.0, calibrate_requests=16 * tenants,
        extra_rates=1 if quick else 4,
        p99_at=args.serve_p99_at or None,
        latency_sizing_mode=args.serve_latency_sizing,
        gemm_loop_mode=args.serve_gemm_loop,
        max_batch_tokens=args.serve_max_batch_tokens, max_batch_size=args.serve_max_batch_size,
        ingress_processes=args.serve_ingress, fine_tune=args.fine_tune, seed=args.seed)
    name = device_name(device)

    def named(rows: list[dict]) -> list[dict]:
        for r in rows:
            r.update(device=name, dtype=dtype_name)
        return rows

    deadline = (time.monotonic() + args.serve_budget) if args.serve_budget else None
    try:
        return named(serving.serve_sweep(cfg, lambda part: save(named(part)), deadline))
    except Exception as e:  # noqa: BLE001 - report the sweep as failed, keep the offline rows
        blog.warning("serving sweep failed: %s: %s", type(e).__name__, e)
        return [dict(suite="serve", model=model, tenants=tenants, requests_per_tenant=None,
                     seq_len=None, system=s, strategy=None, status="error",
                     reason=f"{type(e).__name__}: {e}", latency_ms=None)
                for s in ("itif", "per_tenant")]


def _today() -> str:
    import datetime  # noqa: PLC0415

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _print_table(rows: list[dict]) -> None:
    hdr = (f"{'suite':16s} {'model':12s} {'T':>3s} {'R':>6s} {'len':>4s} {'system':13s} "
           f"{'strategy':15s} {'ms':>10s} {'req/s':>9s} {'vs seq':>7s}  note")
    print(hdr)
    for r in rows:
        ms = r.get("latency_ms")
        note = r.get("reason") or (f"rate {r['rate_rps']}, p99 {r.get('p99_ms')} ms"
                                   if "rate_rps" in r else "")
        rpt = "" if r.get("requests_per_tenant") is None else r["requests_per_tenant"]
        sl = "" if r.get("seq_len") is None else r["seq_len"]
        if r.get("suite") == "serve_at_fraction":
            note = f"{r.get('fraction_of_saturation')} of saturation, p99 {r.get('p99_ms')} ms"
        print(f"{r['suite']:16s} {r['model']:12s} {r['tenants']:3d} {rpt:>6} {sl:>4} "
              f"{r['system']:13s} {r.get('strategy') or '':15s} "
              f"{'-' if ms is None else f'{ms:.2f}':>10s} "
              f"{r.get('throughput_rps') or '':>9} {r.get('speedup_vs_seq') or '':>7}  {note}")
