"""``itif bench``: one real ``--quick --json`` run (as CI runs it) and the pieces it is made of.

The run is checked for behaviour, not speed: every required system is there (mps skipped with
its reason on the CPU), every number is positive, the ratios agree with the latencies, the
baselines answer like the fused engine (same weights), and the serving sweep ran both modes
through the daemon.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from itif.backbones.hf import to_canonical
from itif.backbones.spec import load_spec
from itif.batching.strategies import STRATEGIES
from itif.bench import roofline as rl
from itif.bench.tenants import tenant_weights, to_hf
from itif.bench.workloads import (
    ServeMix,
    offline_workloads,
    parse_mix,
    poisson_arrivals,
    sample_lengths,
    sample_tenants,
)
from itif.errors import InvalidConfig, InvalidRequest
from itif.runtime.engine import Engine, Request, Result

REQUIRED = ("model", "tenants", "requests_per_tenant", "seq_len", "system", "latency_ms")


@pytest.fixture(scope="module")
def quick_rows():
    proc = subprocess.run([sys.executable, "-m", "itif", "bench", "--quick", "--json",
                           "--back-to-back"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)  # stdout is the JSON list and nothing else
    assert isinstance(rows, list) and rows
    return rows


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the quick run -----------------------------------------------------------------------------
def test_quick_rows_have_the_schema(quick_rows):
    for r in quick_rows:
        for k in REQUIRED:
            assert k in r, (k, r)
        assert r["status"] in ("ok", "skipped", "error"), r
        if r["status"] == "ok":
            assert r["latency_ms"] > 0, r
            if r.get("throughput_rps") is not None:
                assert r["throughput_rps"] > 0, r
        else:
            assert r["latency_ms"] is None and r["reason"], r
    assert not [r for r in quick_rows if r["status"] == "error"], "a system failed"


def test_quick_run_has_every_system(quick_rows):
    offline = [r for r in quick_rows if r["suite"] in ("table", "scale", "batch")]
    ok = {r["system"] for r in offline if r["status"] == "ok"}
    assert {"seq", "multi_stream", "itif"} <= ok
    if _has_transformers():
        assert "hf" in ok
    else:
        assert all(r["status"] == "skipped" for r in offline if r["system"] == "hf")
    mps = [r for r in offline if r["system"] == "mps"]
    assert mps
    if not torch.cuda.is_available():
        assert all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in mps)
    assert {r["strategy"] for r in offline if r["system"] == "itif"} == set(STRATEGIES)
    assert {r["suite"] for r in offline} == {"table", "batch"}
    assert {r["model"] for r in offline} == {"bert-tiny", "albert-tiny", "vit-tiny"}


def test_quick_ratios_agree_with_latencies(quick_rows):
    offline = [r for r in quick_rows if r["suite"] in ("table", "batch") and r["status"] == "ok"]
    by = {}
    for r in offline:
        key = (r["suite"], r["model"], r["tenants"], r["requests_per_tenant"])
        by.setdefault(key, []).append(r)
    for rows in by.values():
        seq = next(r for r in rows if r["system"] == "seq")
        for r in rows:
            n = r["tenants"] * r["requests_per_tenant"]
            assert r["throughput_rps"] == pytest.approx(n / r["latency_ms"] * 1e3, rel=1e-3)
            assert r["speedup_vs_seq"] == pytest.approx(seq["latency_ms"] / r["latency_ms"],
                                                        rel=1e-3)
            assert r["latency_ms_min"] <= r["latency_ms"] <= r["latency_ms_max"]
            # --back-to-back: each system timed alone too, with its own ratios
            assert r["latency_ms_alone"] > 0 and r["host_probe_ms"] > 0
            assert r["speedup_vs_seq_alone"] == pytest.approx(
                seq["latency_ms_alone"] / r["latency_ms_alone"], rel=1e-3)
            if r["system"] == "itif":
                assert r["flops"] > 0 and r["weight_bytes"] > 0 and r["bound_ms"] > 0
                assert r["bound_by"] in ("compute", "memory")
                assert r["roofline_fraction"] == pytest.approx(r["bound_ms"] / r["latency_ms"],
                                                               rel=1e-2, abs=1e-4)
            # same weights, same inputs: every system answers like the fused engine
            assert r["max_abs_diff_vs_itif"] < 1e-3, r


def test_quick_rows_carry_the_diagnostics(quick_rows):
    offline = [r for r in quick_rows if r["suite"] in ("table", "batch")]
    ok = [r for r in offline if r["status"] == "ok"]
    for r in ok:
        if r["system"] == "mps":
            continue
        # what one run dispatches (CPU: a TorchDispatchMode; CUDA: kernels and launch calls)
        if torch.cuda.is_available():
            assert r["kernels_per_run"] > 0 and r["launch_calls_per_run"] > 0, r
        else:
            assert r["aten_ops_per_run"] >= r["matmul_ops_per_run"] > 0, r
        if _has_transformers():  # tiny presets: the float32 reference runs on the CPU too
            assert r["max_abs_diff_vs_hf_fp32"] < 1e-3, r
    for r in (r for r in ok if r["system"] == "itif"):
        assert r["weight_bound_ms"] > 0
        assert r["weight_bound_fraction"] == pytest.approx(r["weight_bound_ms"] / r["latency_ms"],
                                                           rel=1e-2, abs=1e-4)
    nographs = [r for r in offline if r["system"] == "itif_nographs"]
    assert nographs
    if not torch.cuda.is_available():
        assert all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in nographs)
        assert all(r["graphs"] is False for r in ok if r["system"] == "itif")
    assert not [r for r in offline if r["system"] == "hf_compiled"]  # not in --quick


def test_quick_serving_sweep(quick_rows):
    serve = [r for r in quick_rows if r["suite"] == "serve"]
    assert {r["system"] for r in serve} == {"itif", "per_tenant"}
    for r in serve:
        assert r["status"] == "ok", r
        assert r["completed"] > 0 and r["sent"] >= r["completed"]
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["latency_ms"] == r["p50_ms"]
        # the cores each side used while the point ran: the daemon served every call (its
        # forwards included), the load generator sent them
        assert 0 < r["daemon_cpu_cores"] <= os.cpu_count() + 0.5, r
        assert 0 < r["loadgen_cpu_cores"] <= os.cpu_count() + 0.5, r
        # the daemon's own counters over the point (its /metrics): every answered request was
        # a row of some batch; no CUDA graph series on the CPU
        assert r["batches"] >= 1 and r["mean_batch_size"] >= 1, r
        assert r["batches"] * (r["mean_batch_size"] + 0.005) >= r["completed"], r  # rounded
        assert r["row_compute_ms"] > 0, r
        assert "graph_replays" not in r or torch.cuda.is_available()
    rates = {s: sorted(r["rate_rps"] for r in serve if r["system"] == s)
             for s in ("itif", "per_tenant")}
    assert len(rates["itif"]) >= 2 and rates["itif"] == rates["per_tenant"]  # same loads
    sat = [r for r in quick_rows if r["suite"] == "serve_saturation"]
    assert {r["system"] for r in sat} == {"itif", "per_tenant"}
    at = {r["system"]: r for r in quick_rows if r["suite"] == "serve_at_fraction"}
    for r in sat:
        best = max(x["throughput_rps"] for x in serve if x["system"] == r["system"])
        assert r["throughput_rps"] == best > 0
        point = next(x for x in serve if x["system"] == r["system"]
                     and x["throughput_rps"] == best)
        assert r["daemon_cpu_cores"] == point["daemon_cpu_cores"]
        assert r["mean_batch_size"] == point["mean_batch_size"]
        # one more point at 70% of this mode's own saturation; its p99 is on the row
        assert r["at_fraction"] == 0.7
        assert r["at_fraction_rate_rps"] == pytest.approx(0.7 * best, abs=0.01)
        a = at[r["system"]]
        assert a["rate_rps"] == r["at_fraction_rate_rps"] and a["completed"] > 0
        assert r["p99_at_fraction_ms"] == a["p99_ms"] > 0


def test_serving_sweep_batch_limits_reach_every_daemon(tmp_path):
    """--serve-max-batch-size / --serve-max-batch-tokens go into each daemon's scheduler: with
    at most 2 requests a batch, no point's mean batch exceeds 2 (without the limit this burst
    forms batches of 100+), and the rows say so. --serve-ingress too: every daemon behind one
    ingress process, whose CPU the rows report beside the daemon's. --serve-gemm-loop adds a
    fused daemon with ITIF_GROUPED_GEMM=loop in its environment (the CPU runs the loop anyway)."""
    proc = subprocess.run(
        [sys.executable, "-m", "itif", "bench", "--suites", "serve", "--device", "cpu",
         "--serve-model", "bert-tiny", "--serve-tenants", "2", "--mixes", "uniform:2-20",
         "--serve-rates", "2000", "--serve-duration", "0.5", "--serve-strategies", "packed",
         "--serve-p99-at", "0", "--serve-max-batch-size", "2", "--serve-max-batch-tokens", "4096",
         "--serve-ingress", "1", "--serve-gemm-loop", "--json", "--no-plots",
         "--out", str(tmp_path / "serve.json")],  # not bench/results/ of the checkout
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in json.loads(proc.stdout) if r["suite"] == "serve"]
    assert {r["system"] for r in rows} == {"itif", "per_tenant", "itif_loop"}
    for r in rows:
        want = {"ITIF_GROUPED_GEMM": "loop"} if r["system"] == "itif_loop" else None
        assert r.get("daemon_env") == want, r
    for r in rows:
        assert r["status"] == "ok" and r["completed"] > 0, r
        assert r["max_batch_size"] == 2 and r["max_batch_tokens"] == 4096
        assert 1 <= r["mean_batch_size"] <= 2, r
        assert r["ingress_processes"] == 1 and r["ingress_cpu_cores"] > 0, r


def test_half_precision_sweep_uploads_half_precision_checkpoints(tmp_path):
    """A bfloat16 sweep writes its tenants' checkpoints in bfloat16 (half the bytes to write and
    upload; 64 bert-base tenants were 56 GB in float32) and the daemons serve them."""
    proc = subprocess.run(
        [sys.executable, "-m", "itif", "bench", "--suites", "serve", "--device", "cpu",
         "--dtype", "bfloat16", "--serve-model", "bert-tiny", "--serve-tenants", "2",
         "--mixes", "uniform:2-20", "--serve-rates", "100", "--serve-duration", "0.5",
         "--serve-strategies", "packed", "--serve-p99-at", "0", "--json", "--no-plots",
         "--out", str(tmp_path / "serve.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in json.loads(proc.stdout) if r["suite"] == "serve"]
    assert {r["system"] for r in rows} == {"itif", "per_tenant"}
    assert all(r["completed"] == r["sent"] > 0 and not r["errors"] for r in rows), rows
    spec = load_spec("bert-tiny")
    f32 = sum(t.numel() * 4 for t in to_hf(spec, tenant_weights(spec, 0)).values())
    (mb,) = re.findall(r"2 tenants' checkpoints written in [\d.]+ s \(([\d.]+) MB\)",
                       proc.stderr)
    assert float(mb) == pytest.approx(2 * f32 / 2 / 1e6, rel=0.15)  # float32 would be twice


def test_serve_daemon_environment_reaches_the_daemon(tmp_path, monkeypatch):
    """The daemon process is started with the mode's environment on top of this one's (read
    from the Popen call: a daemon that exits early leaves an empty /proc environ behind)."""
    from itif.bench import serving  # noqa: PLC0415

    seen = {}

    class Proc:
        def __init__(self, args, **kw):
            seen.update(args=args, env=kw["env"])

    monkeypatch.setattr(serving.subprocess, "Popen", Proc)
    d = serving.ServeDaemon(tmp_path, 1, "bert-tiny", "cpu", "float32", {"t0": "tok"},
                            "packed", False, 1.0, env=(("ITIF_GROUPED_GEMM", "loop"),))
    d.start()
    d._log.close()
    assert seen["args"][1:4] == ["-m", "itif", "serve"]
    assert seen["env"]["ITIF_GROUPED_GEMM"] == "loop"
    assert seen["env"]["PATH"] == os.environ["PATH"]  # on top of this process's


class _FakeGen:
    """A LoadGen stand-in: records what it was sent; answers ``capacity`` req/s at most."""

    def __init__(self, name: str, capacity: float, log: list) -> None:
        self.name, self.capacity, self.log = name, capacity, log

    def requests(self, mix, n, rng):
        return [("t0", object(), 10) for _ in range(n)]

    def send(self, arrivals, reqs, timeout_s, drain_s):
        offered = len(arrivals) / max(float(arrivals[-1]), 1e-9)
        self.log.append((self.name, id(reqs), len(reqs)))
        got = min(offered, self.capacity)
        return dict(sent=len(reqs), completed=len(reqs), offered_rps=offered,
                    throughput_rps=got, p50_ms=1.0, p99_ms=2.0)


def _serve_settings(**kw):
    from itif.bench.serving import ServeSettings  # noqa: PLC0415

    base = dict(model="bert-tiny", tenants=2, device="cpu", dtype="float32",
                mixes=(ServeMix("uniform:2-20"),), strategies=("packed",),
                fractions=(0.5, 1.0, 2.0), rates=None, duration_s=5.0, max_requests=10_000,
                timeout_s=1.0, max_wait_ms=1.0, calibrate_requests=8, extra_rates=0,
                p99_at=0.7)
    base.update(kw)
    return ServeSettings(**base)


def test_serve_sweep_takes_turns_on_the_same_requests_and_saves_as_it_goes():
    """The modes take turns rate by rate (alternating which goes first), every mode gets the
    very same arrivals and requests at a rate, and after every point the caller hears every
    row so far, saturation rows included and marked partial until the end."""
    from itif.bench.serving import Mode, _sweep_mix  # noqa: PLC0415

    log: list = []
    gens = [_FakeGen("fused", 400.0, log), _FakeGen("alone", 150.0, log)]
    modes = [Mode("itif", "packed"), Mode("per_tenant", "packed", isolate=True)]
    heard: list[list[dict]] = []
    cfg = _serve_settings()
    rows = _sweep_mix(cfg, load_spec("bert-tiny"), cfg.mixes[0], modes, gens,
                      np.random.default_rng(0), heard.append)
    points = log[3:]  # after two warm-ups and the calibration burst (on the first mode)
    assert [n for n, _, _ in points[:6]] == ["fused", "alone", "alone", "fused", "fused", "alone"]
    for k in range(0, 6, 2):  # one rate: both modes sent the same request list
        assert points[k][1] == points[k + 1][1] and points[k][2] == points[k + 1][2]
    serve = [r for r in rows if r["suite"] == "serve"]
    assert len(serve) == 6 and len(heard) == 6 + 2  # one report a point, p99 points included
    sat = {r["system"]: r for r in rows if r["suite"] == "serve_saturation"}
    assert sat["per_tenant"]["throughput_rps"] == pytest.approx(150.0, rel=0.2)
    assert not any(r.get("partial") for r in rows)
    # goodput: the per-tenant stand-in (150 req/s) fell behind at every rate (200 and up); the
    # fused one kept up to its 400 (p99 2 ms: within every target)
    assert set(sat["per_tenant"]["goodput_rps"].values()) == {0.0}
    assert set(sat["itif"]["goodput_rps"]) == {"100", "250", "500", "1000"}
    assert sat["itif"]["goodput_rps"]["100"] == pytest.approx(400.0, rel=0.15)
    first = heard[0]
    assert [r["suite"] for r in first] == ["serve", "serve_saturation"] and first[1]["partial"]
    assert len([r for r in heard[-1] if r["suite"] == "serve_at_fraction"]) == 2


def test_goodput_is_the_best_point_that_kept_up_within_the_target():
    from itif.bench.serving import goodput  # noqa: PLC0415

    pts = [dict(throughput_rps=100.0, p99_ms=50.0, saturated=False),
           dict(throughput_rps=190.0, p99_ms=240.0, saturated=False),
           dict(throughput_rps=260.0, p99_ms=90.0, saturated=True),  # fell behind: never counts
           dict(throughput_rps=280.0, p99_ms=900.0, saturated=False)]
    assert goodput(pts, 100) == 100.0
    assert goodput(pts, 250) == 190.0
    assert goodput(pts, 1000) == 280.0
    assert goodput(pts, 10) == 0.0


def test_serve_sweep_starts_no_point_past_its_deadline():
    from itif.bench.serving import Mode, _sweep_mix  # noqa: PLC0415

    log: list = []
    gens = [_FakeGen("fused", 400.0, log), _FakeGen("alone", 150.0, log)]
    modes = [Mode("itif", "packed"), Mode("per_tenant", "packed", isolate=True)]
    cfg = _serve_settings()
    rows = _sweep_mix(cfg, load_spec("bert-tiny"), cfg.mixes[0], modes, gens,
                      np.random.default_rng(0), deadline=time.monotonic() - 1)
    assert rows == [] and len(log) == 3  # warm-ups and calibration only


# ---- roofline --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,dtype,tflops,tbs", [
    ("NVIDIA H100 80GB HBM3", torch.float16, 989.4, 3.35),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5, 2.0),
    ("NVIDIA H100 NVL", torch.float16, 835.5, 3.9),
    ("NVIDIA H200", torch.float16, 989.4, 4.8),
    ("NVIDIA A100-SXM4-80GB", torch.float16, 312.0, 2.039),
    ("NVIDIA A100 80GB PCIe", torch.float16, 312.0, 1.935),
    ("NVIDIA A100-SXM4-40GB", torch.float16, 312.0, 1.555),
    ("NVIDIA RTX A5000", torch.float16, 111.1, 0.768),
])
def test_spec_sheet_peaks(name, dtype, tflops, tbs):
    p = rl.spec_sheet_peak(name, dtype)
    assert p.flops == pytest.approx(tflops * 1e12) and p.bandwidth == pytest.approx(tbs * 1e12)
    assert p.source.startswith("spec sheet")


def test_spec_sheet_fp32_and_unknown():
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        h100 = "NVIDIA H100 80GB HBM3"
        assert rl.spec_sheet_peak(h100, torch.float32).flops == pytest.approx(66.9e12)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert rl.spec_sheet_peak(h100, torch.float32).flops == pytest.approx(494.7e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert rl.spec_sheet_peak("Some Future GPU", torch.float16) is None


def test_measured_cpu_peak_is_labelled():
    p = rl.measure_peak(torch.device("cpu"), torch.float32, quick=True)
    assert p.flops > 0 and p.bandwidth > 0 and p.source.startswith("measured")


def test_roofline_bound_and_fraction():
    peak = rl.Peak("x", flops=1e12, bandwidth=1e11, source="test")
    r = rl.roofline(flops=2e9, weight_bytes=10**8, measured_ms=4.0, peak=peak)
    assert r["bound_ms"] == pytest.approx(2.0) and r["bound_by"] == "compute"  # 2 ms vs 1 ms
    assert r["roofline_fraction"] == pytest.approx(0.5)
    r = rl.roofline(flops=1e9, weight_bytes=5 * 10**8, measured_ms=10.0, peak=peak)
    assert r["bound_ms"] == pytest.approx(5.0) and r["bound_by"] == "memory"
    assert r["achieved_tflops"] == pytest.approx(0.1)


@pytest.mark.parametrize("preset", ["bert-tiny", "albert-tiny", "vit-tiny"])
def test_forward_flops_match_torch_flop_counter(preset):
    """Our count equals torch's FLOP counter on the Hugging Face model with eager attention."""
    pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    from itif.bench.tenants import hf_model

    spec = load_spec(preset)
    m = hf_model(spec, tenant_weights(spec, 0), torch.device("cpu"), torch.float32)
    if not hasattr(m, "set_attn_implementation"):
        pytest.skip("transformers without set_attn_implementation")
    m.set_attn_implementation("eager")
    with FlopCounterMode(display=False) as fc, torch.inference_mode():
        if spec.is_text:
            m(input_ids=torch.randint(0, spec.vocab_size, (1, 37)))
            n = 37
        else:
            m(pixel_values=torch.randn(1, spec.num_channels, spec.image_size, spec.image_size))
            n = spec.num_patches + 1
    assert rl.forward_flops(spec, [n]) == fc.get_total_flops()
    assert rl.forward_flops(spec, [n, n]) == 2 * fc.get_total_flops()


def test_batch_weight_bytes_counts_shared_weights_once():
    spec = load_spec("bert-tiny")
    full, head = Engine("bert-tiny"), Engine("bert-tiny")
    for i in range(3):
        full.add_tenant(f"t{i}", tenant_weights(spec, i, "full"))
        head.add_tenant(f"t{i}", tenant_weights(spec, i, "head"))
    names = ["t0", "t1", "t2"]
    one = rl.batch_weight_bytes(full, ["t0"], tokens=10)
    assert rl.batch_weight_bytes(full, names, tokens=10) == pytest.approx(3 * one, rel=0.01)
    shared = rl.batch_weight_bytes(head, names, tokens=10)
    assert one < shared < 1.2 * one  # one backbone, three heads and poolers


def test_copy_bandwidth_and_weight_bound():
    bw, src = rl.copy_bandwidth(torch.device("cpu"), 8 << 20, repeats=2)
    assert bw > 0 and src.startswith("measured: copy of")
    assert rl.copy_bandwidth(torch.device("cpu"), 8 << 20) == (bw, src)  # cached per process
    wb = rl.weight_bound(10**9, latency_ms=4.0, bandwidth=1e12)
    assert wb["weight_bound_ms"] == pytest.approx(1.0) and wb["weight_bound_fraction"] == 0.25


# ---- counters, compile settings, speedups ------------------------------------------------------
def test_dispatch_counts():
    from itif.bench.systems import dispatch_counts

    a, b = torch.randn(4, 8), torch.randn(8, 3)

    def f():
        y = torch.mm(a, b)
        y = torch.addmm(y, a, b)
        return (y + 1).relu()

    c = dispatch_counts(f)
    assert c["matmul_ops_per_run"] == 2 and c["aten_ops_per_run"] == 4, c


def test_launch_api_names():
    from itif.bench.systems import launch_api

    for n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
              "cudaGraphLaunch", "cudaLaunchKernel_v7000", "cudaLaunchCooperativeKernel"):
        assert launch_api(n), n
    for n in ("cudaMemcpyAsync", "cudaStreamSynchronize", "aten::mm", "cudaGraphInstantiate"):
        assert not launch_api(n), n


def test_compile_settings():
    from itif.bench.systems import compile_mode_for, compile_options

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_mode_for(cpu, "max-autotune") == "default"
    assert compile_mode_for(cuda, "reduce-overhead") == "reduce-overhead"
    assert compile_options("max-autotune", bound=False) is None
    opts = compile_options("max-autotune", bound=True)
    assert opts["max_autotune"] and opts["triton.cudagraphs"]
    assert opts.get("coordinate_descent_tuning") is False


def test_speedups_recompute_with_hf_compiled():
    from itif.bench.offline import speedups

    base = dict(suite="table", model="m", tenants=2, requests_per_tenant=1, seq_len=8,
                status="ok")
    rows = [dict(base, system=s, latency_ms=ms) for s, ms in
            (("seq", 8.0), ("hf", 6.0), ("hf_compiled", 4.0), ("itif", 2.0))]
    rows.append(dict(base, system="mps", status="skipped", latency_ms=None))
    for _ in range(2):  # idempotent: merged results run it again
        speedups(rows)
    it = rows[3]
    assert (it["speedup_vs_seq"], it["speedup_vs_hf"], it["speedup_vs_hf_compiled"]) == (
        4.0, 3.0, 2.0)
    assert "speedup_vs_seq" not in rows[4]


def test_speedups_of_back_to_back_timings():
    from itif.bench.offline import speedups

    base = dict(suite="table", model="m", tenants=2, requests_per_tenant=1, seq_len=8,
                status="ok")
    rows = [dict(base, system="seq", latency_ms=8.0, latency_ms_alone=6.0),
            dict(base, system="hf", latency_ms=6.0),  # timed interleaved only
            dict(base, system="itif", latency_ms=4.0, latency_ms_alone=2.0)]
    for _ in range(2):
        speedups(rows)
    it = rows[2]
    assert (it["speedup_vs_seq"], it["speedup_vs_seq_alone"]) == (2.0, 3.0)
    assert it["speedup_vs_hf"] == 1.5 and "speedup_vs_hf_alone" not in it
    assert "speedup_vs_seq_alone" not in rows[1]  # no alone timing of its own
    rows[0].pop("latency_ms_alone")
    speedups(rows)  # recomputed: a baseline without one leaves no stale ratio behind
    assert "speedup_vs_seq_alone" not in rows[2]


def test_back_to_back_runs_each_system_in_a_row():
    from itif.bench.systems import System, measure_alone

    calls = []

    class Stub(System):
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def run(self):
            calls.append(self.name)
            if self.fail and len([c for c in calls if c == self.name]) > 1:
                raise RuntimeError("out of memory")
            return 1.0 if self.name == "a" else 3.0  # ms, as an mps-style run reports them

    a, b, c = Stub("a"), Stub("b"), Stub("c", fail=True)
    heard = []
    got = measure_alone([a, b, c], repeats=3, warmup=1,
                        on_error=lambda s, msg: heard.append((s.name, msg)))
    assert calls == ["a"] * 4 + ["b"] * 4 + ["c"] * 2  # warm-up + repeats, one system at a time
    assert got[id(a)] == dict(latency_ms_alone=1.0) and got[id(b)] == dict(latency_ms_alone=3.0)
    assert got[id(c)] == dict(alone_error="RuntimeError: out of memory")
    assert heard == [("c", "RuntimeError: out of memory")]


def _bench_script(name: str):
    from tests.bench_scripts import load

    return load(name)


def test_profile_kernel_kinds():
    mod = _bench_script("profile_forward")
    # names as torch.profiler reported them on the H100 (2026-11-27)
    flash = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, "
             "false, false, cutlass::half_t, Flash_kerne")
    assert mod.kind_of(flash) == "attention"  # not a GEMM, though it names cutlass
    assert mod.kind_of("nvjet_sm90_hsh_72x64_64x12_4x2_h_bz_TNN") == "gemm"
    assert mod.kind_of("bias_residual_layernorm") == "itif_rawkernel"
    assert mod.kind_of("void at::native::vectorized_gather_kernel<16, long>") == "other"


def test_load_hf_weights_swaps_a_tenant_in():
    pytest.importorskip("transformers")
    from itif.bench.systems import hf_forward, hf_inputs
    from itif.bench.tenants import hf_model, load_hf_weights

    spec = load_spec("bert-tiny")
    cpu = torch.device("cpu")
    reqs = [Request("t", input_ids=np.arange(1, 9))]
    a = hf_model(spec, tenant_weights(spec, 0), cpu, torch.float32)
    want = hf_forward(hf_model(spec, tenant_weights(spec, 1), cpu, torch.float32),
                      hf_inputs(reqs, True), cpu)
    load_hf_weights(a, spec, tenant_weights(spec, 1))
    assert np.array_equal(hf_forward(a, hf_inputs(reqs, True), cpu), want)


def test_gpu_report_section_and_splice():
    from itif.bench import gpu_report

    page = "# GPU\n\nhand written\n\n" + gpu_report.render(None, None) + "\nmore\n"
    assert "No GPU results yet" in page
    doc = dict(meta=dict(device="NVIDIA H100", dtype="float16", device_type="cuda",
                         versions={}, copy_bandwidth=dict(source="measured: x")),
               rows=[dict(suite="table", model="bert-base", tenants=2, system=s,
                          strategy="packed" if s.startswith("itif") else None, status="ok",
                          latency_ms=ms, kernels_per_run=k, launch_calls_per_run=lc,
                          max_abs_diff_vs_hf_fp32=1e-3, speedup_vs_seq=2.0,
                          weight_bytes=2**20, weight_bound_ms=0.5, weight_bound_fraction=0.25)
                     for s, ms, k, lc in (("seq", 4.0, 400, 400), ("itif", 2.0, 200, 1),
                                          ("itif_nographs", 3.0, 200, 200))])
    new = gpu_report.splice(page, gpu_report.render(doc, "OUT/table.json"))
    assert new.startswith("# GPU\n\nhand written") and new.endswith("\nmore\n")
    assert "No GPU results yet" not in new and new.count(gpu_report.BEGIN) == 1
    assert "CUDA graphs on and off" in new and "| bert-base | 2 | 2 | 3 | 1.50× | 1 | 200 |" in new
    assert "200 / 1" in new and "400 / 400" in new
    assert "back to back" not in new  # no back-to-back timings, no column for them
    for r in doc["rows"]:
        r["speedup_vs_seq_alone"] = 2.5
    assert "| itif vs seq, back to back |" in gpu_report.render(doc, "OUT/table.json")


def test_gpu_report_profile_generate_and_extra_tables():
    from itif.bench import gpu_report

    prof = [dict(model="vit-base", tenants=32, infer_graphs_ms=9.5, graph_replay_gpu_ms=4.4,
                 infer_host_only_ms=4.1, weight_bound_fraction_gpu=0.42,
                 eager_kernel_us_by_kind=dict(gemm=dict(us=2885.2, launches=50)),
                 host_functions=[dict(function="~:0(<method 'cpu' of 'torch._C.TensorBase'>)",
                                      own_ms_per_run=4.5),
                                 dict(function="engine.py:415(_validate_pixels)",
                                      own_ms_per_run=2.51)]),
            dict(model="bert-base", tenants=4, error="RuntimeError: boom")]
    gen = dict(meta=dict(device="NVIDIA H100", dtype="float32", date="d",
                         settings=dict(preset="marian-decoding", tenants=8, beams=4)),
               rows=[dict(system="itif", tokens_per_s=3531.69, speedup_vs_hf=4.646,
                          sequences_equal_hf=32, sequences=32)])
    extra = dict(meta=dict(date="d2", device="NVIDIA H100", dtype="float16"),
                 rows=[dict(suite="table", model="vit-base", tenants=4, system=s, status="ok",
                            strategy="packed" if s == "itif" else None, latency_ms=ms,
                            **({"speedup_vs_seq": 2.73, "speedup_vs_hf_compiled": 2.6}
                               if s == "itif" else {}))
                       for s, ms in (("seq", 5.64), ("hf_compiled", 5.38), ("itif", 2.07))])
    out = gpu_report.render(None, None, profiles=[("R/profile-after.json", prof)],
                            generate=("R/generate.json", gen),
                            extra_tables=[("R/compiled.json", extra)])
    assert "No GPU results yet" not in out
    assert ("| profile-after | vit-base | 32 | 9.5 | 4.4 | 4.1 | 2885 (50) | – | – | – | 42% | "
            "`engine.py:415(_validate_pixels)` 2.51 ms |") in out  # the sync itself is skipped
    assert "| profile-after | bert-base | 4 | error: RuntimeError: boom |" in out
    assert "| itif | 3531.7 | 4.65× | 32/32 |" in out and "marian-decoding, 8 tenants" in out
    assert "| vit-base | 4 | 5.64 | 5.38 | 2.07 | 2.73× | 2.60× |" in out


def test_gpu_report_triton_sections():
    """triton_forward.py's rows (one table row per GEMM: seq and itif side by side) and
    bench_ops.py's triton_gemm rows (weight GB/s from the bytes and the time)."""
    from itif.bench import gpu_report

    def row(system, gemm, ms, alone, **kw):
        return dict(model="bert-base", tenants=4, dtype="float16", system=system, gemm=gemm,
                    latency_ms=ms, latency_ms_alone=alone, **kw)

    tri = dict(device="NVIDIA H100", torch="2.11", rows=[
        row("seq", "cublas", 4.8, 3.6), row("itif", "cublas", 1.6, 1.2, speedup_vs_seq=3.0,
                                            speedup_vs_best_seq=3.0),
        row("seq", "triton", 5.2, 4.0, max_abs_logit_diff_vs_cublas=2e-3),
        row("itif", "triton", 1.2, 1.0, speedup_vs_seq=4.333, speedup_vs_best_seq=4.0,
            max_abs_logit_diff_vs_cublas=1e-3)],
        errors=[dict(model="bert-base", tenants=32, error="OutOfResources: shared memory")])
    ops = dict(device="NVIDIA H100", dtype="float16", results=[
        dict(op="triton_gemm_ffn_in_T4", variant="bmm+bias_act", median_us=20.0,
             weight_bytes=18874368),
        dict(op="triton_gemm_ffn_in_T4", variant="triton_epilogue", median_us=10.0,
             weight_bytes=18874368, max_abs_err_vs_cublas=1e-3)])
    out = gpu_report.render(None, None, ops=ops, triton=("R/triton.json", tri))
    assert "No GPU results yet" not in out and "[`R/triton.json`]" in out
    assert "| bert-base | 4 | cublas | 4.8 (3.6) | 1.6 (1.2) | 3.00× | 3.00× | – |" in out
    assert "| bert-base | 4 | triton | 5.2 (4) | 1.2 (1) | 4.33× | 4.00× | 1.0e-03 |" in out
    assert "- error: bert-base T = 32: OutOfResources: shared memory" in out
    assert "| ffn_in_T4 | bmm+bias_act | 20.0 | 944 | – |" in out
    assert "| ffn_in_T4 | triton_epilogue | 10.0 | 1887 | 1.0e-03 |" in out


# ---- weights and workloads ---------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["bert-tiny", "albert-tiny", "vit-tiny"])
@pytest.mark.parametrize("fine_tune", ["full", "head", "last:1"])
def test_to_hf_is_the_inverse_of_the_importer(preset, fine_tune):
    spec = load_spec(preset)
    w = tenant_weights(spec, 3, fine_tune)
    schemes = ("hub", "v5") if spec.family == "vit" else ("hub",)
    for scheme in schemes:
        for prefix in (True, False):
            back = to_canonical(spec, to_hf(spec, w, scheme, prefix))
            assert back.num_labels == w.num_labels and back.has_pooler == w.has_pooler
            assert back.tensors.keys() == w.tensors.keys()
            for k, t in w.tensors.items():
                assert torch.equal(back.tensors[k], t), k


def test_fine_tune_modes_share_what_they_say():
    spec = load_spec("bert-tiny")
    a, b = (tenant_weights(spec, i, "last:1") for i in (0, 1))
    assert torch.equal(a.tensors["layers.0.qkv.weight"], b.tensors["layers.0.qkv.weight"])
    assert not torch.equal(a.tensors["layers.1.qkv.weight"], b.tensors["layers.1.qkv.weight"])
    assert not torch.equal(a.tensors["head.weight"], b.tensors["head.weight"])
    with pytest.raises(InvalidRequest):
        tenant_weights(spec, 0, "some")


def test_poisson_arrivals():
    rng = np.random.default_rng(0)
    t = poisson_arrivals(1000.0, 10.0, 100_000, rng)
    assert np.all(np.diff(t) >= 0) and t[-1] <= 10.0
    assert len(t) == pytest.approx(10_000, rel=0.05)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps
    assert len(poisson_arrivals(1000.0, 10.0, 50, rng)) == 50
    assert len(poisson_arrivals(0.001, 0.01, 10, rng)) == 1
    with pytest.raises(InvalidRequest):
        poisson_arrivals(0, 1, 1, rng)


def test_length_and_tenant_samplers():
    rng = np.random.default_rng(1)
    u = sample_lengths("uniform:2-100", 5000, 512, rng)
    assert u.min() >= 2 and u.max() <= 100 and abs(u.mean() - 51) < 2
    nrm = sample_lengths("normal:20:20", 5000, 512, rng)
    assert nrm.min() >= 1 and abs(nrm.mean() - 20) < 0.5 and abs(nrm.var() - 20) < 3
    assert sample_lengths("uniform:2-100", 100, 16, rng).max() <= 16  # clipped to the model
    z = sample_tenants(8, 20000, "zipf:1.2", rng)
    counts = np.bincount(z, minlength=8)
    assert counts[0] > counts[1] > counts[3] > counts[7]
    assert counts[0] / counts[1] == pytest.approx(2 ** 1.2, rel=0.1)
    flat = np.bincount(sample_tenants(4, 20000, None, rng), minlength=4)
    assert flat.min() > 0.9 * flat.max()


def test_parse_mix():
    assert parse_mix("uniform:2-100") == ServeMix("uniform:2-100")
    assert parse_mix("normal:20:20+zipf:1.2") == ServeMix("normal:20:20", "zipf:1.2")
    for bad in ("uniform:2", "normal:20:20+zipf", "zipf:1.2"):
        with pytest.raises(InvalidRequest):
            parse_mix(bad)


def test_offline_workloads():
    quick = offline_workloads(("table", "scale", "batch"), ("bert-tiny", "albert-tiny", "vit-tiny"),
                              quick=True)
    assert {(w.suite, w.model) for w in quick if w.suite == "batch"} == {("batch", "albert-tiny")}
    assert {w.tenants for w in quick if w.suite == "table"} == {2, 3, 4}
    assert all(w.requests_per_tenant == 1 and w.seq_len in (128, None)
               for w in quick if w.suite == "table")
    gpu = offline_workloads(("table", "scale", "batch"), ("bert-base", "albert-large", "vit-base"),
                            gpu=True)
    assert {w.tenants for w in gpu if w.suite == "scale"} == {8, 16, 32, 64}
    assert max(w.requests_per_tenant for w in gpu if w.suite == "batch") == 64
    assert all(w.seq_len == 64 for w in gpu if w.suite == "batch")
    mine = offline_workloads(("table", "scale"), ("bert-base",), tenants=(4, 16))
    assert [(w.suite, w.tenants) for w in mine] == [("table", 4), ("scale", 16)]


# ---- the per-tenant batching switch ------------------------------------------------------------
def _batches(isolate: bool) -> list[set[str]]:
    from itif.scheduler import Scheduler

    seen, gate = [], threading.Event()

    def run_batch(reqs):
        gate.wait(10)
        seen.append({r.tenant for r in reqs})
        return [Result(r.tenant) for r in reqs]

    s = Scheduler(run_batch, max_wait_ms=0, isolate_tenants=isolate)
    for t in ("a", "b", "c"):
        s.set_tenant(t)
    s.start()
    try:
        first = s.submit(Request("a", input_ids=[1]), tokens=1)  # holds the engine at the gate
        time.sleep(0.05)
        tickets = [s.submit(Request(t, input_ids=[1]), tokens=1) for t in "abcabc"]
        gate.set()
        for tk in [first, *tickets]:
            tk.result(timeout=10)
    finally:
        s.stop()
    return seen


def test_scheduler_isolate_tenants():
    assert all(len(b) == 1 for b in _batches(True))
    assert any(len(b) > 1 for b in _batches(False))


def test_config_isolate_tenants():
    from itif.config import parse_config

    base = ("server: {listen: '127.0.0.1:0', data_dir: d, admin_token_sha256: '%s'}\n"
            "backbone: {config: bert-tiny}\n" % ("0" * 64))
    assert parse_config(base, ".").scheduler.isolate_tenants is False
    cfg = parse_config(base + "scheduler: {isolate_tenants: true}\n", ".")
    assert cfg.scheduler.isolate_tenants is True
    with pytest.raises(InvalidConfig, match="scheduler.isolate_tenants"):
        parse_config(base + "scheduler: {isolate_tenants: 'yes'}\n", ".")



def test_measured_peak_keeps_each_matmul_within_its_budget(monkeypatch):
    """Where a dtype's matmuls are slow (bfloat16 emulated on a CPU without AVX512-BF16: six
    2048-sided ones took five minutes before a bench started), the peak's matmul shrinks to fit
    MM_BUDGET_S; at a fast rate it stays the full size. On a fake clock: a matmul advances it by
    its FLOPs at ``rate``, anything else timed by a microsecond."""
    clock, rate, sides = [0.0], [1e8], []

    def tick():
        clock[0] += 1e-6
        return clock[0]

    def mm(a, b):
        clock[0] += 2 * a.shape[0] ** 3 / rate[0]
        return a

    def randn(n, m, device):
        sides.append(n)
        return torch.zeros(1, 1).expand(n, m)

    monkeypatch.setattr(rl.time, "perf_counter", tick)
    monkeypatch.setattr(rl.torch, "mm", mm)
    monkeypatch.setattr(rl.torch, "randn", randn)
    p = rl.measure_peak(torch.device("cpu"), torch.float32)
    assert sides[-1] == 256 and "256x256" in p.source
    assert p.flops == pytest.approx(1e8, rel=1e-3)
    assert clock[0] < 5.0  # eight 256-sided matmuls; 2048-sided ones were 172 s each
    rate[0] = 1e11
    rl.measure_peak(torch.device("cpu"), torch.float32)
    assert sides[-1] == 2048  # (0.5 s * 1e11 / 2)^(1/3) = 2924: the target stands
    rate[0] = 1e9
    rl.measure_peak(torch.device("cpu"), torch.float32)
    assert sides[-1] == 512 and 2 * 512**3 / 1e9 <= rl.MM_BUDGET_S  # 630 rounds down to 512
