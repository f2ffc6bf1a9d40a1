"""The pieces of ``bench/gpu_suite.sh`` that are easier in Python than in bash.

    python3 -m itif.bench.suite table --out-dir OUT --budget 300 --models bert-base ... \
        --tenants 1 2 4 8 32 --systems seq multi_stream hf hf_compiled mps itif itif_nographs
    python3 -m itif.bench.suite summary-ops OUT/ops.json
    python3 -m itif.bench.suite summary-tests OUT/tests.log
    python3 -m itif.bench.suite summary-serve OUT/serve.json
    python3 -m itif.bench.suite summary-generate OUT/generate.json

``table`` runs ``python3 -m itif bench --suites table`` once per model for every system but
``hf_compiled`` (so a slow compile cannot cost the other rows), then once per model for
``hf_compiled`` alone, each under its own timeout carved from ``--budget`` (what is left, shared
among the parts still to run). Every part writes its rows after each tenant group, so a part cut
by its timeout keeps the groups it finished; the rows a part never produced are added as skipped
with the reason. The parts are merged into ``OUT/table.json`` (speedups recomputed across them,
``speedup_vs_hf_compiled`` included) after every part, the plots go into one
``OUT/plots.tar.gz``, and the bench runs' stderr is appended to ``OUT/bench.log``.

The summaries print the lines ``gpu_suite.sh`` appends to ``suite.log``: a first line with the
step's counts, then one ``  SKIPPED <what>: <reason>`` line per part that did not run (GPU-only
parts on the CPU, parts over the time budget) and one ``  ERROR <what>: <reason>`` per failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SUITE_SYSTEMS = ("seq", "multi_stream", "hf", "hf_compiled", "mps", "itif", "itif_nographs")
MERGE_RESERVE_S = 15.0  # kept back from the budget for the merge and the plots
COMPILED_MIN_S = 45.0  # a compile part given less than this is skipped outright (GPU default)
MAIN_MIN_S = 40.0  # what a main part (every system but hf_compiled, one model) needs at least


def _log(log: Path | None, line: str) -> None:
    print(line, flush=True)
    if log is not None:
        with open(log, "a") as f:
            f.write(line + "\n")


# ---- table ----------------------------------------------------------------------------------
def _part_tenants(a, kind: str) -> list[int]:
    """The tenant counts of a part: ``--tenants``, narrowed by ``--compiled-tenants`` for the
    hf_compiled parts."""
    if kind == "compiled" and a.compiled_tenants:
        return [t for t in a.tenants if t in a.compiled_tenants]
    return a.tenants


def _bench_cmd(a, models: list[str], systems: list[str], tenants: list[int],
               out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "itif", "bench", "--suites", "table", "--models", *models,
           "--tenants", *map(str, tenants), "--systems", *systems, "--repeats", str(a.repeats),
           "--device", a.device, "--dtype", a.dtype, "--no-plots", "--out", str(out)]
    if a.strategies:
        cmd += ["--strategies", *a.strategies]
    if "hf_compiled" in systems:
        cmd += ["--compile-mode", a.compile_mode]
        if a.compile_bound:
            cmd.append("--compile-bound")
    if "mps" in systems and a.mps_max_tenants:
        cmd += ["--mps-max-tenants", str(a.mps_max_tenants)]
    if a.quick:
        cmd.append("--quick")
    if a.back_to_back:
        cmd.append("--back-to-back")
    return cmd


def _run(cmd: list[str], err, timeout: float) -> tuple[int | None, bool]:
    """Run ``cmd`` in its own session; on timeout kill its whole process group (mps workers,
    inductor's compile workers), not only the bench process."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, True


def _load_rows(path: Path) -> tuple[dict | None, list[dict]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, []
    return doc.get("meta"), doc.get("rows", [])


def _missing_rows(rows: list[dict], models: list[str], tenants, systems, strategies,
                  reason: str, status: str) -> list[dict]:
    """Rows for every (model, tenants, system) of a part that it did not write."""
    have = {(r.get("model"), r.get("tenants"), r.get("system")) for r in rows}
    out = []
    for model in models:
        for t in tenants:
            for s in systems:
                if (model, t, s) in have:
                    continue
                for st in (strategies if s.startswith("itif") else [None]):
                    out.append(dict(suite="table" if t <= 5 else "scale", model=model,
                                    tenants=t, requests_per_tenant=1, seq_len=None, system=s,
                                    strategy=st, status=status, reason=reason,
                                    latency_ms=None))
    return out


def merge_parts(parts: list[tuple[Path, list[dict]]], out: Path, extra_meta: dict) -> dict:
    """One result from the parts' files (plus rows standing in for what a part never wrote)."""
    from itif.bench.offline import speedups  # noqa: PLC0415

    metas, rows = [], []
    for path, extra in parts:
        meta, got = _load_rows(path)
        if meta is not None:
            metas.append(meta)
        rows += got + extra
    meta = dict(metas[0]) if metas else {}
    meta.pop("plots", None)
    meta.pop("partial", None)
    if metas:
        meta["command"] = "; ".join(m.get("command", "") for m in metas)
        meta["wall_s"] = round(sum(m.get("settings", {}).get("wall_s", 0) for m in metas), 1)
    meta.update(extra_meta)
    speedups(rows)
    doc = dict(meta=meta, rows=rows)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    return doc


def table(a) -> int:
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Path(a.log) if a.log else None
    bench_log = out_dir / "bench.log"
    t_end = time.monotonic() + a.budget
    systems = list(a.systems)
    main_systems = [s for s in systems if s != "hf_compiled"]
    compiled = "hf_compiled" in systems
    strategies = a.strategies or ["packed"]
    work = Path(tempfile.mkdtemp(prefix="itif-suite-"))
    groups = [list(a.models)] if a.one_part else [[m] for m in a.models]
    plan = [("main", ms, main_systems) for ms in groups if main_systems]
    parts: list[tuple[Path, list[dict]]] = []
    status = dict(ok=0, timeout=0, failed=0, skipped=0)
    if compiled:
        # hf_compiled runs where selected (--compiled-models, --compiled-tenants); the other rows
        # of the table say so
        chosen = [m for m in a.models if not a.compiled_models or m in a.compiled_models]
        plan += [("compiled", ms, ["hf_compiled"])
                 for ms in ([chosen] if a.one_part else [[m] for m in chosen]) if ms]
        ct = _part_tenants(a, "compiled")
        left_out = [r for r in _missing_rows([], a.models, a.tenants, ["hf_compiled"], strategies,
                                             "", "skipped")
                    if r["model"] not in chosen or r["tenants"] not in ct]
        for r in left_out:
            r["reason"] = ("not selected for this run (--compiled-models "
                           f"{' '.join(chosen)}, --compiled-tenants {' '.join(map(str, ct))})")
        if left_out:
            path = work / "compiled-not-selected.json"
            parts.append((path, left_out))
            _log(log, f"  SKIPPED hf_compiled ({len(left_out)} rows): {left_out[0]['reason']}")
    for k, (kind, models, syst) in enumerate(plan):
        left = t_end - time.monotonic() - MERGE_RESERVE_S
        later = plan[k + 1:]
        # what the parts after this one need at least: a compile part --compiled-min seconds
        reserve = sum(a.compiled_min for kd, _, _ in later if kd == "compiled")
        n_main_left = sum(1 for kd, _, _ in plan[k:] if kd == "main")
        if kind == "main":
            # the main parts come first: each may take up to 1.5 x its share of what is left
            # (at least MAIN_MIN_S), keeping MAIN_MIN_S for every later main part; the compile
            # parts get what the main parts leave (at most --compiled-min each is kept for them
            # while there is room)
            share = left / max(1, n_main_left)
            timeout = min(left - MAIN_MIN_S * (n_main_left - 1),
                          max(1.5 * share, MAIN_MIN_S),
                          left - reserve if left - reserve > MAIN_MIN_S * n_main_left else left)
        else:
            # an equal share of what is left, unless that is too little to compile: then this
            # part takes it all (one finished compile beats several cut ones)
            timeout = left / max(1, len(plan) - k)
            if timeout < a.compiled_min:
                timeout = left
        name = "-".join(models)
        tenants = _part_tenants(a, kind)
        path = work / f"{kind}-{name}.json"
        label = f"table/{kind} {' '.join(models)} ({' '.join(syst)})"
        if timeout < (a.compiled_min if kind == "compiled" else 20.0):
            reason = (f"not run: {max(0.0, left):.0f} s of the suite's time budget left "
                      f"(--budget {a.budget:.0f} s)")
            parts.append((path, _missing_rows([], models, tenants, syst,
                                              strategies, reason, "skipped")))
            _log(log, f"  SKIPPED {label}: {reason}")
            status["skipped"] += 1
            continue
        cmd = _bench_cmd(a, models, syst, tenants, path)
        t0 = time.monotonic()
        with open(bench_log, "a") as err:
            err.write(f"\n==== {label}: {' '.join(cmd)} (timeout {timeout:.0f} s)\n")
            err.flush()
            rc, timed_out = _run(cmd, err, timeout)
        dt = time.monotonic() - t0
        _, rows = _load_rows(path)
        if timed_out:
            reason = (f"timed out: {label} ran past its {timeout:.0f} s share of the suite's "
                      f"time budget" + (" (compiling)" if kind == "compiled" else ""))
            extra = _missing_rows(rows, models, tenants, syst, strategies, reason,
                                  "skipped")
            _log(log, f"  SKIPPED {label}: {reason}; {len(rows)} rows kept")
            status["timeout"] += 1
        elif rc != 0:
            reason = f"{label} exited {rc} (see bench.log)"
            extra = _missing_rows(rows, models, tenants, syst, strategies, reason,
                                  "error")
            _log(log, f"  ERROR {label}: {reason}")
            status["failed"] += 1
        else:
            extra = _missing_rows(rows, models, tenants, syst, strategies,
                                  f"{label} wrote no row for it", "error")
            status["ok"] += 1
        _log(log, f"  part {label}: {'timeout' if timed_out else f'rc {rc}'}, {len(rows)} rows, "
                  f"{dt:.1f} s (timeout {timeout:.0f} s)")
        parts.append((path, extra))
        merge_parts(parts, out_dir / "table.json", dict(suite_parts=len(parts)))
    doc = merge_parts(parts, out_dir / "table.json",
                      dict(suite_parts=len(parts), suite_budget_s=a.budget))
    if not a.no_plots:
        _plots(doc, out_dir, log)
    rows = doc["rows"]
    counts = {s: sum(1 for r in rows if r.get("status") == s) for s in ("ok", "skipped", "error")}
    _log(log, f"  SUMMARY {len(rows)} rows: {counts['ok']} ok, {counts['skipped']} skipped, "
              f"{counts['error']} error; parts {status}")
    for line in table_lines(rows):
        _log(log, line)
    return 0 if counts["ok"] else 1


def _plots(doc: dict, out_dir: Path, log: Path | None) -> None:
    try:
        from itif.bench.plots import make_plots  # noqa: PLC0415
    except ImportError as e:
        _log(log, f"  SKIPPED plots: {e}")
        return
    with tempfile.TemporaryDirectory(prefix="itif-suite-plots-") as tmp:
        try:
            files = make_plots(doc["rows"], doc["meta"], Path(tmp) / "table")
        except Exception as e:  # noqa: BLE001 - plots are a by-product
            _log(log, f"  ERROR plots: {type(e).__name__}: {e}")
            return
        with tarfile.open(out_dir / "plots.tar.gz", "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=Path(f).name)
    _log(log, f"  plots: {len(files)} PNGs in plots.tar.gz")


def table_lines(rows: list[dict]) -> list[str]:
    """SKIPPED/ERROR lines (one per system and reason) and what a CPU run leaves out."""
    out = []
    seen = set()
    for r in rows:
        if r.get("status") in ("skipped", "error"):
            key = (r["status"], r["system"], r.get("reason"))
            if key not in seen:
                seen.add(key)
                n = sum(1 for x in rows if (x.get("status"), x.get("system"), x.get("reason"))
                        == key)
                tag = "SKIPPED" if r["status"] == "skipped" else "ERROR"
                out.append(f"  {tag} {r['system']} ({n} rows): {r.get('reason')}")
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok and not any("kernels_per_run" in r for r in ok):
        out.append("  SKIPPED kernels_per_run / launch_calls_per_run: CUDA only (torch.profiler "
                   "CUDA activity); this run counted aten_ops_per_run / matmul_ops_per_run")
    comp = [r for r in ok if r["system"] == "hf_compiled"]
    if comp and any(r.get("compile_mode") != r.get("compile_mode_requested") for r in comp):
        r = comp[0]
        out.append(f"  SKIPPED hf_compiled mode {r.get('compile_mode_requested')}: needs CUDA; "
                   f"compiled with mode {r.get('compile_mode')} instead")
    diffs = [r["max_abs_diff_vs_hf_fp32"] for r in ok if "max_abs_diff_vs_hf_fp32" in r]
    if diffs:
        out.append(f"  check: max |logits - HF float32| over {len(diffs)} rows: {max(diffs):.3g}")
    return out


# ---- summaries ------------------------------------------------------------------------------
def _read_result(path: Path, what: str) -> dict | None:
    """A step's JSON, or None after saying why there is none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"no {what} result ({e})")
        return None


def summary_ops(path: Path) -> int:
    d = _read_result(path, "ops")
    if d is None:
        return 1
    timed = [r for r in d.get("results", []) if "median_us" in r]
    print(f"SUMMARY {len(timed)} timings on {d.get('device')} ({d.get('dtype')}), "
          f"{len(d.get('table_5_3', []))} Table 5.3 rows")
    for s in d.get("skipped", []):
        print(f"  SKIPPED ops/{s['section']}: {s['reason']}")
    for e in d.get("errors", []):
        print(f"  ERROR ops/{e['section']}: {e['error']}")
    for r in d.get("table_5_3", []):
        print(f"  {r['op']}: seq {r['seq_kernel_us']:.1f} us, fused {r['fused_us']:.1f} us "
              f"({r['fused_variant']}), {r['speedup_seq_kernel']:.2f}x")
    return 0


def summary_tests(path: Path, cuda: bool) -> int:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        print(f"no test log ({e})")
        return 1
    tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    last = tail[-1].strip("= ") if tail else "no pytest summary line"
    print(f"SUMMARY {last}")
    if not cuda:
        m = re.search(r"(\d+) skipped", last)
        print(f"  SKIPPED tests/gpu-marked ({m.group(1) if m else '?'} tests): need CUDA "
              "(tests/conftest.py skips the gpu marker without it)")
    for ln in text.splitlines():
        if ln.startswith(("FAILED", "ERROR")):
            print(f"  ERROR {ln}")
    return 0


def summary_serve(path: Path) -> int:
    d = _read_result(path, "serve")
    if d is None:
        return 1
    rows = d.get("rows", [])
    sat = [r for r in rows if r.get("suite") == "serve_saturation"]
    bad = [r for r in rows if r.get("status") not in (None, "ok")]
    print(f"SUMMARY {len(rows)} rows, {len(sat)} saturation rows, {len(bad)} failed")
    if d.get("meta", {}).get("partial"):
        print("  (partial: the sweep was cut short; saturation rows are of the points it ran)")
    for r in sat:
        ingress = f", ingress {r['ingress_cpu_cores']}" if "ingress_cpu_cores" in r else ""
        print(f"  {r.get('mix')} {r['system']}: saturation {r['throughput_rps']:.1f} req/s, p99 "
              f"there {r.get('p99_ms')} ms; p99 at {r.get('at_fraction')} of it "
              f"({r.get('at_fraction_rate_rps')} req/s): {r.get('p99_at_fraction_ms')} ms; "
              f"CPU cores at saturation: daemon {r.get('daemon_cpu_cores')}{ingress}, load "
              f"generator {r.get('loadgen_cpu_cores')}; there a mean batch of "
              f"{r.get('mean_batch_size')} "
              f"rows, {r.get('row_compute_ms')} ms a forward (as its rows waited on it), "
              f"graph replays/eager/captures {r.get('graph_replays', '-')}/"
              f"{r.get('graph_eager', '-')}/{r.get('graph_captures', '-')}")
    by = {(r.get("mix"), r["system"], r.get("strategy")): r for r in sat}
    for (mix, system, strategy), r in by.items():
        base = next((v for (m, s, _), v in by.items() if m == mix and s == "per_tenant"), None)
        if system == "per_tenant" or base is None:
            continue
        if base["throughput_rps"]:
            print(f"  {mix} {system}/{strategy} over per_tenant at saturation: "
                  f"{r['throughput_rps'] / base['throughput_rps']:.2f}x")
        for slo, rps in (r.get("goodput_rps") or {}).items():
            other = (base.get("goodput_rps") or {}).get(slo)
            ratio = f"{rps / other:.2f}x" if other else "per_tenant none"
            print(f"    goodput at p99 <= {slo} ms: {rps:.1f} vs {other} req/s ({ratio})")
    for r in bad:
        print(f"  ERROR serve/{r.get('system')}: {r.get('reason')}")
    return 0


def summary_generate(path: Path) -> int:
    """One line per system of ``bench/bench_generate.py``'s JSON."""
    d = _read_result(path, "generate")
    if d is None:
        return 1
    st = d["meta"]["settings"]
    print(f"SUMMARY generate {st['preset']} on {d['meta']['device']} ({d['meta']['dtype']}): "
          f"{st['tenants']} tenants x {st['requests_per_tenant']} requests, beam {st['beams']}, "
          f"{st['src_len']} source tokens, {st['new_tokens']} new")
    for r in d["rows"]:
        print(f"  {r['system']}: {r['tokens_per_s']} tokens/s, {r['speedup_vs_hf']}x hf, "
              f"{r['sequences_equal_hf']}/{r['sequences']} sequences equal hf")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m itif.bench.suite",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="the table step: parts under timeouts, merged")
    t.add_argument("--out-dir", required=True)
    t.add_argument("--log", help="suite.log to append the part lines to")
    t.add_argument("--budget", type=float, required=True, help="seconds for the whole step")
    t.add_argument("--models", nargs="+", required=True)
    t.add_argument("--tenants", nargs="+", type=int, required=True)
    t.add_argument("--systems", nargs="+", default=list(SUITE_SYSTEMS))
    t.add_argument("--strategies", nargs="+")
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--compile-mode", default="max-autotune")
    t.add_argument("--compile-bound", action="store_true")
    t.add_argument("--compiled-models", nargs="+",
                   help="models whose hf_compiled part runs (default: every --models)")
    t.add_argument("--compiled-tenants", nargs="+", type=int,
                   help="tenant counts of the hf_compiled parts (default: every --tenants)")
    t.add_argument("--mps-max-tenants", type=int)
    t.add_argument("--quick", action="store_true")
    t.add_argument("--back-to-back", action="store_true",
                   help="also time each system back to back (itif bench --back-to-back)")
    t.add_argument("--one-part", action="store_true",
                   help="one bench process for every model (and one for hf_compiled) instead of "
                   "one per model: fewer process starts (the dry run), less isolation")
    t.add_argument("--compiled-min", type=float, default=COMPILED_MIN_S,
                   help="seconds a hf_compiled part needs at least (less left: skipped)")
    t.add_argument("--no-plots", action="store_true")
    for name in ("summary-ops", "summary-tests", "summary-serve", "summary-generate"):
        s = sub.add_parser(name)
        s.add_argument("path")
        if name == "summary-tests":
            s.add_argument("--cuda", choices=("True", "False"), default="True")
    a = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if a.cmd == "table":
        return table(a)
    if a.cmd == "summary-ops":
        return summary_ops(Path(a.path))
    if a.cmd == "summary-tests":
        return summary_tests(Path(a.path), a.cuda == "True")
    if a.cmd == "summary-generate":
        return summary_generate(Path(a.path))
    return summary_serve(Path(a.path))


if __name__ == "__main__":
    sys.exit(main())
