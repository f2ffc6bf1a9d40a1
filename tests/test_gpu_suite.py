"""``bench/gpu_suite.sh``: its dry run on the CPU (the GPU run's steps with tiny presets), and on
CUDA (the suite's first step runs these), the counters and switches the GPU rows rely on.

The dry run is checked for what the GPU run must not get wrong: it exits 0, writes rows for every
system (hf_compiled included), marks every GPU-only part skipped with a reason in suite.log, and
leaves at most 8 files of at most 16 MiB in one flat folder (what the GPU tool brings back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from itif.bench import suite
from itif.bench.systems import cuda_counts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_suite.sh"
TINY = ("bert-tiny", "albert-tiny", "vit-tiny")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("gpu-suite") / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run"], capture_output=True,
                          text=True, timeout=400, env=env, cwd=ROOT)
    return proc, out, time.monotonic() - t0


def _rows(out: Path) -> list[dict]:
    return json.loads((out / "table.json").read_text())["rows"]


def test_dry_run_exits_0(dry_run):
    proc, out, took = dry_run
    log = (out / "suite.log").read_text() if (out / "suite.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log}"
    assert "every step ok" in log
    assert took < 300, f"the dry run took {took:.0f} s"


def test_dry_run_has_rows_for_every_system(dry_run):
    _, out, _ = dry_run
    rows = _rows(out)
    for r in rows:
        assert r["status"] in ("ok", "skipped"), r  # no errors
        if r["status"] != "ok":
            assert r["reason"] and r["latency_ms"] is None, r
    systems = {r["system"] for r in rows}
    assert systems == set(suite.SUITE_SYSTEMS)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["system"] for r in ok} == {"seq", "multi_stream", "hf", "hf_compiled", "itif"}
    for m in TINY:
        for t in (1, 2):
            got = {r["system"] for r in ok if r["model"] == m and r["tenants"] == t}
            assert got == {"seq", "multi_stream", "hf", "hf_compiled", "itif"}, (m, t, got)
    for r in ok:
        assert r["latency_ms"] > 0
        assert r["aten_ops_per_run"] > 0 and 0 < r["matmul_ops_per_run"] <= r["aten_ops_per_run"]
        assert r["max_abs_diff_vs_hf_fp32"] < 1e-4, r  # float32 on the CPU
        if r["system"] != "hf_compiled":  # compiled in its own process: no fused logits there
            assert r["max_abs_diff_vs_itif"] < 1e-4, r
        for b in ("seq", "hf", "hf_compiled"):
            assert r[f"speedup_vs_{b}"] > 0, (b, r)
    for r in (r for r in ok if r["system"] == "hf_compiled"):
        assert r["compile_mode"] == "default" and r["compile_mode_requested"] == "max-autotune"
        assert r["count_method"].startswith("torch.profiler")
    for r in (r for r in ok if r["system"] == "itif"):
        assert r["graphs"] is False  # the CPU engine has no CUDA graphs
        assert r["weight_bound_ms"] > 0
        assert r["weight_bound_fraction"] == pytest.approx(
            r["weight_bound_ms"] / r["latency_ms"], rel=1e-2, abs=1e-4)
    meta = json.loads((out / "table.json").read_text())["meta"]
    assert meta["copy_bandwidth"]["bytes_per_s"] > 0


def test_dry_run_log_marks_gpu_parts_skipped(dry_run):
    _, out, _ = dry_run
    log = (out / "suite.log").read_text()
    assert "DRY RUN on the CPU" in log
    for step in ("tests", "ops", "table"):
        assert f"step {step}: ok" in log, step
    assert "step serve: not selected" in log
    skipped = [ln[ln.index("SKIPPED"):] for ln in log.splitlines() if "SKIPPED " in ln]
    for part in ("GPU run", "tests/gpu-marked", "ops/rotation_ops", "ops/attention",
                 "itif_nographs", "mps", "kernels_per_run", "hf_compiled mode max-autotune"):
        line = next((ln for ln in skipped if ln.startswith(f"SKIPPED {part}")), None)
        assert line is not None, (part, skipped)
        reason = line.split(":", 1)[1].strip()
        assert len(reason) > 5, line
    assert "ERROR" not in log


def test_dry_run_files_fit_the_gpu_tool(dry_run):
    _, out, _ = dry_run
    files = list(out.iterdir())
    assert all(f.is_file() for f in files), files
    assert len(files) <= 8 and all(f.stat().st_size < 16 << 20 for f in files)
    assert {"suite.log", "tests.log", "ops.json", "table.json", "plots.tar.gz"} <= \
        {f.name for f in files}
    with tarfile.open(out / "plots.tar.gz") as tar:
        names = tar.getnames()
    assert names and all(n.endswith(".png") and "/" not in n for n in names)
    ops = json.loads((out / "ops.json").read_text())
    assert ops["reduced_cpu_pass"] and not ops["errors"]
    assert {s["section"] for s in ops["skipped"]} == {"rotation_ops", "attention", "triton_gemm"}
    why = next(s["reason"] for s in ops["skipped"] if s["section"] == "triton_gemm")
    assert why.startswith("needs CUDA")  # interpreted Triton times nothing worth having
    gemm = [r for r in ops["results"] if r["op"].startswith("gemm_") and "median_us" in r]
    assert {r["variant"] for r in gemm} >= {"loop", "mm", "bmm"}
    assert all(r["max_abs_err_vs_loop"] < 1e-4 for r in gemm)


def test_bench_ops_sections_run_with_emulated_kernels(tmp_path):
    """Every section of bench_ops.py (the GPU's Table 5.3) runs end to end on the CPU with the
    torch references standing in for the CUDA wrappers: the script has no typo the GPU would
    find first."""
    out = tmp_path / "ops.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ops.py"), "--cpu",
                           "--emulate-kernels", "--repeats", "1", "--inner", "1", "--warmup", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(out.read_text())
    assert ops["emulated_kernels"] and not ops["errors"] and not ops["skipped"], ops["errors"]
    t53 = {r["op"] for r in ops["table_5_3"]}
    assert {"bias_act_gelu", "bias_residual", "bias_residual_layernorm", "embed_text"} <= t53
    assert {r["op"] for r in ops["results"]} >= {"attention_view", "attention_gather_masked"}
    # itif's Triton GEMM (interpreted here: conftest sets TRITON_INTERPRET=1) beside cuBLAS's
    # plan for each product of a layer, the same answer within float32 rounding
    tri = [r for r in ops["results"] if r["op"].startswith("triton_gemm_")]
    assert {r["op"] for r in tri} == {f"triton_gemm_{k}_T2"
                                      for k in ("qkv", "attn_out", "ffn_in", "ffn_out")}
    assert {r["variant"] for r in tri} == {"bmm", "bmm+bias_act", "triton", "triton_epilogue"}
    assert all(r["max_abs_err_vs_cublas"] < 1e-4 for r in tri if "max_abs_err_vs_cublas" in r)


# ---- the table step's bookkeeping (no subprocess) ---------------------------------------------
def test_merge_fills_what_a_part_never_wrote(tmp_path):
    part = tmp_path / "p.json"
    rows = [dict(suite="table", model="m", tenants=1, requests_per_tenant=1, seq_len=8,
                 system=s, strategy="packed" if s == "itif" else None, status="ok",
                 latency_ms=ms, fine_tune="full") for s, ms in (("seq", 4.0), ("itif", 2.0),
                                                                 ("hf_compiled", 1.0))]
    part.write_text(json.dumps(dict(meta=dict(device="x", settings=dict(wall_s=3)), rows=rows)))
    extra = suite._missing_rows(rows, ["m"], [1, 8], ["seq", "itif"], ["packed"], "timed out",
                                "skipped")
    assert {(r["tenants"], r["system"], r["strategy"]) for r in extra} == {
        (8, "seq", None), (8, "itif", "packed")}
    assert all(r["suite"] == "scale" and r["reason"] == "timed out" for r in extra)
    doc = suite.merge_parts([(part, extra), (tmp_path / "absent.json", [])],
                            tmp_path / "table.json", dict(suite_parts=2))
    it = next(r for r in doc["rows"] if r["system"] == "itif" and r["status"] == "ok")
    assert it["speedup_vs_seq"] == pytest.approx(2.0)
    assert it["speedup_vs_hf_compiled"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "table.json").read_text())["meta"]["suite_parts"] == 2


def test_summaries(tmp_path, capsys):
    log = tmp_path / "tests.log"
    log.write_text("sss\nFAILED tests/x.py::t - boom\n1 failed, 3 passed, 2 skipped in 1.0s\n")
    suite.summary_tests(log, cuda=True)
    got = capsys.readouterr().out
    assert "SUMMARY 1 failed, 3 passed, 2 skipped" in got and "ERROR FAILED tests/x.py::t" in got
    suite.summary_tests(log, cuda=False)
    assert "SKIPPED tests/gpu-marked (2 tests)" in capsys.readouterr().out


# ---- on CUDA (the suite's tests step) -----------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
def test_cuda_counts_kernels_and_launches():
    x = torch.ones(1 << 16, device="cuda")

    def three():
        x.add_(1.0)
        x.mul_(2.0)
        x.sub_(1.0)

    three()
    c = cuda_counts(three)
    assert c["kernels_per_run"] == 3, c
    assert c["launch_calls_per_run"] == 3, c

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        three()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        three()
    g.replay()
    c = cuda_counts(g.replay)
    assert c["launch_calls_per_run"] == 1, c
    assert any("GraphLaunch" in k for k in c["launch_calls_by_api"]), c
    assert c["kernels_per_run"] in (1, 3), c  # graph nodes traced one by one (or as one)


@pytest.mark.gpu
@requires_cuda
def test_fused_graphs_switch_on_cuda():
    from itif.backbones.spec import load_spec
    from itif.bench.systems import Fused, op_counts
    from itif.bench.tenants import tenant_weights
    from itif.bench.workloads import Workload, make_requests
    from itif.runtime.engine import Engine

    spec = load_spec("bert-tiny")
    engine = Engine("bert-tiny", device="cuda", dtype="float32")
    for i in range(2):
        engine.add_tenant(f"t{i}", tenant_weights(spec, i))
    reqs = make_requests(spec, Workload("table", "bert-tiny", 2, 1, 32))
    on, off = Fused(engine, "packed", graphs=True), Fused(engine, "packed", graphs=False)
    got = {}
    for s in (on, off):
        s.load(reqs)
        s.run()
        got[s.name] = (s.logits(), s.graphs_used, op_counts(s, torch.device("cuda")))
    assert got["itif"][1] is True and got["itif_nographs"][1] is False
    assert abs(got["itif"][0] - got["itif_nographs"][0]).max() < 1e-4
    c_on, c_off = got["itif"][2], got["itif_nographs"][2]
    assert c_on["launch_calls_per_run"] < c_off["launch_calls_per_run"], (c_on, c_off)
    assert c_off["kernels_per_run"] > 10, c_off


@pytest.mark.gpu
@requires_cuda
def test_copy_bandwidth_on_cuda():
    from itif.bench.roofline import copy_bandwidth

    bw, src = copy_bandwidth(torch.device("cuda"), 256 << 20)
    assert 50e9 < bw < 20e12 and src.startswith("measured")


def _dry_step(tmp_path, step: str) -> tuple[Path, str]:
    """``gpu_suite.sh OUT --dry-run --steps STEP``: asserts it exits 0; (OUT, suite.log's text).
    TRITON_INTERPRET is left to the suite, which sets it for its dry run."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run", "--steps", step],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    log = (out / "suite.log").read_text() if (out / "suite.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log}"
    return out, log


def test_dry_run_generate_step(tmp_path):
    """``--steps generate``: the Decoding row's three systems on tiny presets, every sequence
    equal to HF's, and a summary line per system in suite.log."""
    pytest.importorskip("transformers")
    out, log = _dry_step(tmp_path, "generate")
    assert "step generate: ok" in log and "every step ok" in log
    d = json.loads((out / "generate.json").read_text())
    assert {r["system"] for r in d["rows"]} == {"hf", "seq", "itif"}
    for r in d["rows"]:
        assert r["tokens_per_s"] > 0 and r["sequences_equal_hf"] == r["sequences"] > 0, r
        assert f"  {r['system']}: {r['tokens_per_s']} tokens/s" in log


def test_dry_run_graphs_step_is_skipped_with_its_reason(tmp_path):
    """``--steps graphs`` times CUDA graphs and torch's attention backends: on the CPU it is
    marked SKIPPED with the reason, and the suite still ends well."""
    out, log = _dry_step(tmp_path, "graphs")
    assert "step graphs: SKIPPED: it times CUDA graphs" in log and "every step ok" in log
    assert not (out / "graph_policy.json").exists()


def test_dry_run_triton_step(tmp_path):
    """``--steps triton``: bench/triton_forward.py on bert-tiny under Triton's interpreter; seq
    and itif with the default GEMMs and with itif's Triton GEMM, the same logits both ways."""
    pytest.importorskip("triton")
    out, log = _dry_step(tmp_path, "triton")
    assert "step triton: ok" in log and "every step ok" in log
    d = json.loads((out / "triton.json").read_text())
    assert not d["errors"]
    rows = {(r["system"], r["gemm"]): r for r in d["rows"]}
    assert set(rows) == {(s, g) for s in ("seq", "itif") for g in ("default", "triton")}
    for s in ("seq", "itif"):
        assert rows[(s, "triton")]["max_abs_logit_diff_vs_default"] < 1e-4
        assert rows[(s, "triton")]["latency_ms"] > 0 and rows[(s, "default")]["latency_ms"] > 0
    assert rows[("itif", "triton")]["speedup_vs_seq"] > 0
    best = min(rows[("seq", g)]["latency_ms"] for g in ("default", "triton"))
    for g in ("default", "triton"):
        it = rows[("itif", g)]
        assert it["speedup_vs_best_seq"] == pytest.approx(best / it["latency_ms"],
                                                         rel=2e-3, abs=6e-4)


def test_triton_forward_refuses_without_cuda_unless_asked(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "triton_forward.py"),
                           "--out", str(tmp_path / "t.json")], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr
    assert not (tmp_path / "t.json").exists()


def test_dry_run_llama_step(tmp_path):
    """``--steps llama``: the decoder suite (issue 66's Llama run) at its CPU quick size writes
    llama.json with measured itif and HF + PEFT rows, and a summary line per row in suite.log."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out, log = _dry_step(tmp_path, "llama")
    assert "step llama: ok" in log and "every step ok" in log
    d = json.loads((out / "llama.json").read_text())
    by = {r["system"]: r for r in d["rows"]}
    assert {"itif", "hf", "vllm"} <= set(by)
    for s in ("itif", "hf"):
        assert by[s]["status"] == "ok" and by[s]["tokens_per_s"] > 0, by[s]
        assert by[s]["ms_per_output_token"] > 0 and by[s]["dtype"] == "float32"
        assert f"  {s} ok " in log
    assert 0.0 <= by["itif"]["equal_fraction"] <= 1.0
