"""The GPU suite's results as a docs section, so no number in it is typed by hand.

    python -m itif.bench.gpu_report OUT/table.json --ops OUT/ops.json [--serve OUT/serve.json] \
        --into docs/gpu.md          # replaces the section between the markers of docs/gpu.md
    python -m itif.bench.gpu_report OUT/table.json > section.md          # or print it

More results of the same session render below the table: ``--extra-table`` (a table.json of
another call, e.g. hf_compiled where the main call left no time), ``--profile`` (profile.json of
``bench/profile_forward.py``: where a forward's time goes) and ``--generate`` (generate.json of
``bench/bench_generate.py``).

``OUT`` is what ``bench/gpu_suite.sh OUT`` wrote. The section goes between
``<!-- gpu-results:begin -->`` and ``<!-- gpu-results:end -->``; the rest of the page is hand
written. :func:`diagnostics` (launches, the weight bound, the float32 check, CUDA graphs on/off)
is also what ``itif.bench.report`` appends to its page when a result has those fields.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from itif.bench.cells import fmt_ms, md_table

BEGIN = "<!-- gpu-results:begin -->"
END = "<!-- gpu-results:end -->"
SYSTEMS = ("seq", "multi_stream", "mps", "hf", "hf_compiled", "itif", "itif_nographs")


def _strategy(rows) -> str | None:
    from itif.batching.strategies import DEFAULT_STRATEGY  # noqa: PLC0415

    have = {r.get("strategy") for r in rows if str(r.get("system", "")).startswith("itif")
            and r.get("status") == "ok"}
    if DEFAULT_STRATEGY in have or not have:
        return DEFAULT_STRATEGY
    return sorted(h for h in have if h)[0]


def _pick(rows, model, tenants, system, strat, suites=("table", "scale")):
    for r in rows:
        if (r.get("model") == model and r.get("tenants") == tenants and r.get("system") == system
                and r.get("suite") in suites
                and (not system.startswith("itif") or r.get("strategy") == strat)):
            return r
    return None


def _cell(r, key="latency_ms", fmt=fmt_ms):
    if r is None:
        return "–"
    if r.get("status") != "ok":
        return r.get("status", "–")
    v = r.get(key)
    return "–" if v is None else fmt(v)


def _keys(rows, suites=("table", "scale")):
    return sorted({(r["model"], r["tenants"]) for r in rows if r.get("suite") in suites},
                  key=lambda k: (list(dict.fromkeys(r["model"] for r in rows)).index(k[0]), k[1]))


def latency_table(rows) -> str:
    strat = _strategy(rows)
    present = [s for s in SYSTEMS if any(r.get("system") == s for r in rows)]
    # speedups of the back-to-back timings too, where the table has them (--back-to-back)
    ratios = [("speedup_vs_seq", "itif vs seq"), ("speedup_vs_hf_compiled", "itif vs hf_compiled")]
    if any("speedup_vs_seq_alone" in r for r in rows):
        ratios.append(("speedup_vs_seq_alone", "itif vs seq, back to back"))
    body = []
    for m, t in _keys(rows):
        cells = [_cell(_pick(rows, m, t, s, strat)) for s in present]
        it = _pick(rows, m, t, "itif", strat)
        ok = it is not None and it.get("status") == "ok"
        body.append([m, t] + cells + [f"{it[k]:.2f}×" if ok and k in it else "–"
                                      for k, _ in ratios])
    return md_table(["model", "tenants"] + [s if s != "itif" else f"itif ({strat})"
                                          for s in present] + [h for _, h in ratios], body)


def diagnostics(rows, meta) -> list[str]:
    """Markdown blocks for the per-row diagnostics a result carries (empty when it has none)."""
    out = []
    strat = _strategy(rows)
    ok = [r for r in rows if r.get("status") == "ok" and r.get("suite") in ("table", "scale",
                                                                             "batch")]
    present = [s for s in SYSTEMS if any(r.get("system") == s for r in ok)]
    keys = _keys(ok)

    def pair_table(first: str, second: str) -> str:
        """A model x tenants table of every system's ``first / second`` counts."""
        body = [[m, t] + [_cell(_pick(ok, m, t, s, strat), first, str) + " / " +
                          _cell(_pick(ok, m, t, s, strat), second, str)
                          for s in present] for m, t in keys]
        return md_table(["model", "tenants"] + present, body) + "\n"

    if any("kernels_per_run" in r for r in ok):
        out.append("### What one run launches\n")
        out.append("CUDA kernels / launch calls of one run, from torch.profiler (outside the "
                   "timed runs): kernels are device-side kernel events (a CUDA graph's nodes "
                   "included), launch calls the runtime/driver API events that launch work "
                   "(`cudaLaunchKernel`, `cuLaunchKernel`, `cudaGraphLaunch`, ...). mps runs "
                   "in other processes and is not counted.\n")
        out.append(pair_table("kernels_per_run", "launch_calls_per_run"))
    elif any("aten_ops_per_run" in r for r in ok):
        out.append("### What one run dispatches\n")
        out.append("Aten ops / matmul-family ops (mm, bmm, addmm, matmul, _grouped_mm, linear, "
                   "baddbmm) of one run on the CPU: a TorchDispatchMode, and for hf_compiled the "
                   "profiler's top-level aten ops (compiled code runs its fused kernels outside "
                   "aten).\n")
        out.append(pair_table("aten_ops_per_run", "matmul_ops_per_run"))
    wb = [r for r in ok if r.get("system", "").startswith("itif") and "weight_bound_ms" in r
          and r.get("strategy") == strat]
    if wb:
        bw = (meta.get("copy_bandwidth") or {})
        out.append("### Weight-bandwidth bound\n")
        out.append("Distinct weight bytes the fused forward reads (each shared tensor once, "
                   "embedding tables by the rows gathered) over the measured copy bandwidth "
                   f"({bw.get('source', 'measured')}); fraction = bound / measured latency "
                   "(1.0: as fast as reading the weights once).\n")
        body = [[r["model"], r["tenants"], r["system"], f"{r['weight_bytes'] / 2**20:.1f}",
                 fmt_ms(r["weight_bound_ms"]), fmt_ms(r["latency_ms"]),
                 f"{100 * r['weight_bound_fraction']:.1f}%"] for r in wb]
        out.append(md_table(["model", "tenants", "system", "weights MiB", "bound ms",
                           "measured ms", "of bound"], body) + "\n")
    g = [(m, t) for m, t in keys if _pick(ok, m, t, "itif_nographs", strat)
         and _pick(ok, m, t, "itif", strat)]
    if g:
        out.append("### CUDA graphs on and off (the same engine)\n")
        body = []
        for m, t in g:
            on, off = _pick(ok, m, t, "itif", strat), _pick(ok, m, t, "itif_nographs", strat)
            body.append([m, t, fmt_ms(on["latency_ms"]), fmt_ms(off["latency_ms"]),
                         f"{off['latency_ms'] / on['latency_ms']:.2f}×",
                         on.get("launch_calls_per_run", "–"), off.get("launch_calls_per_run", "–")])
        out.append(md_table(["model", "tenants", "graphs on ms", "graphs off ms", "off / on",
                           "launch calls on", "launch calls off"], body) + "\n")
    comp = [r for r in ok if r.get("system") == "hf_compiled"]
    if comp:
        r = comp[0]
        warm = max((x.get("compile_warmup_s") or 0) for x in comp)
        out.append(f"hf_compiled: `torch.compile(mode={r.get('compile_mode')!r})` (asked "
                   f"{r.get('compile_mode_requested')!r}"
                   + (f", options {json.dumps(r['compile_options'])}" if r.get("compile_options")
                      else "") + f"), CUDA graphs {r.get('compile_cudagraphs')}; the longest "
                   f"compile + warm-up of a workload took {warm:.1f} s (untimed).\n")
    diffs: dict[str, float] = {}
    for r in ok:
        if "max_abs_diff_vs_hf_fp32" in r:
            diffs[r["system"]] = max(diffs.get(r["system"], 0.0), r["max_abs_diff_vs_hf_fp32"])
    if diffs:
        dtype = meta.get("dtype")
        out.append("### Against Hugging Face in float32\n")
        out.append(f"Largest |Δ logits| of each system ({dtype}) against a Hugging Face model of "
                   "the same tenant in float32 on the same device, same requests, over every "
                   "offline row.\n")
        out.append(md_table(["system", "max |Δ logits| vs HF float32"],
                          [[s, f"{v:.2e}"] for s, v in diffs.items()]) + "\n")
    return out


def ops_section(ops: dict) -> list[str]:
    out = ["### Table 5.3: per-op times, SEQ vs fused\n"]
    sh = ops.get("shapes", {})
    out.append(f"`bench/bench_ops.py` on {ops.get('device')} ({ops.get('dtype')}), "
               f"{ops.get('when', 'undated')}, "
               f"{sh.get('tenants')} tenants x {sh.get('tokens_per_tenant')} tokens, hidden "
               f"{sh.get('hidden')}, FFN {sh.get('ffn')}; {ops.get('timing', {}).get('method')}"
               + (" (**reduced CPU pass**)" if ops.get("reduced_cpu_pass") else "") + ".\n")
    t53 = ops.get("table_5_3", [])
    if t53:
        out.append(md_table(["op", "SEQ (per-tenant launches) µs", "SEQ torch µs", "fused µs",
                           "fused variant", "SEQ / fused"],
                          [[r["op"], f"{r['seq_kernel_us']:.1f}",
                            "–" if r.get("seq_torch_us") is None else f"{r['seq_torch_us']:.1f}",
                            f"{r['fused_us']:.1f}", r["fused_variant"],
                            f"{r['speedup_seq_kernel']:.2f}×"] for r in t53]) + "\n")
    gemm = [r for r in ops.get("results", []) if r.get("op", "").startswith("gemm_")]
    if gemm:
        out.append("GEMM backends (`itif.runtime.gemm`) per plan; *skipped*: the backend cannot "
                   "run that plan.\n")
        out.append(md_table(["plan", "backend", "µs", "max |err| vs loop", "planner's choice"],
                          [[r["op"].removeprefix("gemm_qkv_"), r["variant"],
                            f"{r['median_us']:.1f}" if "median_us" in r else "skipped",
                            f"{r['max_abs_err_vs_loop']:.1e}" if "max_abs_err_vs_loop" in r
                            else "–", "yes" if r.get("chosen_by_planner") else ""]
                           for r in gemm]) + "\n")
    tri = [r for r in ops.get("results", []) if r.get("op", "").startswith("triton_gemm_")]
    if tri:
        out.append("itif's Triton GEMM (`ITIF_TRITON_GEMM=1`) against cuBLAS as the forward "
                   "plans each product, its `bias_act` pass included where the layer has one; "
                   "GB/s: the distinct weight bytes over the time.\n")
        out.append(md_table(["product", "variant", "µs", "weight GB/s", "max |err| vs cuBLAS"],
                          [[r["op"].removeprefix("triton_gemm_"), r["variant"],
                            f"{r['median_us']:.1f}",
                            f"{r['weight_bytes'] / r['median_us'] / 1e3:.0f}",
                            f"{r['max_abs_err_vs_cublas']:.1e}"
                            if "max_abs_err_vs_cublas" in r else "–"] for r in tri]) + "\n")
    for s in ops.get("skipped", []):
        out.append(f"- skipped {s['section']}: {s['reason']}")
    for e in ops.get("errors", []):
        out.append(f"- error in {e['section']}: {e['error']}")
    return out


def serve_section(doc: dict) -> list[str]:
    rows = doc.get("rows", [])
    sat = [r for r in rows if r.get("suite") == "serve_saturation"]
    if not sat:
        bad = [r for r in rows if r.get("status") not in (None, "ok")]
        return [f"### Serving\n\nThe serving sweep failed: {bad[0].get('reason')}\n"] if bad \
            else []
    r0 = sat[0]
    out = ["### Serving through the daemon\n",
           f"{r0['model']}, {r0['tenants']} tenants, open-loop Poisson arrivals; **itif** mixes "
           "tenants in one fused batch, **per_tenant** batches each tenant alone "
           "(`scheduler.isolate_tenants`). Saturation = the best answered rate of the sweep; "
           "then one more run at a fraction of each mode's own saturation.\n"]
    out.append(md_table(["mix", "system", "saturation req/s", "p99 at saturation ms",
                       "fraction", "rate req/s", "p50 ms there", "p99 ms there"],
                      [[r["mix"], r["system"], f"{r['throughput_rps']:.1f}", fmt_ms(r["p99_ms"]),
                        r.get("at_fraction", "–"), r.get("at_fraction_rate_rps", "–"),
                        fmt_ms(r.get("p50_at_fraction_ms")), fmt_ms(r.get("p99_at_fraction_ms"))]
                       for r in sat]) + "\n")
    return out


def _link(path: str, doc_dir: Path) -> str:
    return f"[`{path}`]({os.path.relpath(path, doc_dir)})"


def extra_table_section(doc: dict, path: str, doc_dir: Path) -> list[str]:
    """The latency table of another call of the session (its own baselines beside it)."""
    meta, rows = doc["meta"], doc["rows"]
    systems = sorted({r["system"] for r in rows if r.get("status") == "ok"})
    return [f"### Another call: {', '.join(dict.fromkeys(r['model'] for r in rows))} "
            f"({', '.join(systems)})\n",
            f"{meta.get('date')}, {meta.get('device')}, {meta.get('dtype')}; result "
            f"{_link(path, doc_dir)}.\n", latency_table(rows) + "\n"]


def _kind_us(r: dict, kind: str) -> str:
    k = r.get("eager_kernel_us_by_kind", {}).get(kind)
    return "–" if not k else f"{k['us']:.0f} ({k['launches']})"


def profile_section(docs: list[tuple[str, list]], doc_dir: Path) -> list[str]:
    """Where the fused forward's time goes (``bench/profile_forward.py``), one row per run."""
    out = ["### Where the fused forward's time goes\n",
           "`bench/profile_forward.py`, one 128-token request (ViT: one image) per tenant, "
           "medians of back-to-back calls: `infer` with CUDA graphs; the GPU time of the graph "
           "replay alone; `infer` with the forward replaced by a no-op (validation, planning, "
           "the copies in and out); the kernels of one eager forward by kind, µs (launches); "
           "the host function with the most own time. Results: "
           + ", ".join(_link(p, doc_dir) for p, _ in docs) + ".\n"]
    body = []
    for path, rows in docs:
        run = Path(path).stem
        for r in rows:
            if "error" in r:
                body.append([run, r["model"], r["tenants"], f"error: {r['error']}"] + ["–"] * 8)
                continue
            top = next((h for h in r.get("host_functions", [])
                        if "method 'cpu'" not in h["function"]), None)
            body.append([run, r["model"], r["tenants"], fmt_ms(r["infer_graphs_ms"]),
                         fmt_ms(r["graph_replay_gpu_ms"]), fmt_ms(r["infer_host_only_ms"]),
                         _kind_us(r, "gemm"), _kind_us(r, "itif_rawkernel"),
                         _kind_us(r, "attention"), _kind_us(r, "other"),
                         f"{100 * r['weight_bound_fraction_gpu']:.0f}%",
                         "–" if top is None else
                         f"`{top['function']}` {top['own_ms_per_run']:.2f} ms"])
    out.append(md_table(["run", "model", "tenants", "infer ms", "replay GPU ms", "host only ms",
                       "GEMM µs", "itif kernels µs", "attention µs", "other µs",
                       "weight bound / replay", "top host function"], body) + "\n")
    return out


def generate_section(doc: dict, path: str, doc_dir: Path) -> list[str]:
    meta, st = doc["meta"], doc["meta"].get("settings", {})
    out = ["### Generation (the thesis' Decoding row)\n",
           f"`bench/bench_generate.py` on {meta.get('device')} ({meta.get('dtype')}), "
           f"{meta.get('date')}: {st.get('preset')}, {st.get('tenants')} tenants x "
           f"{st.get('requests_per_tenant')} requests, beam {st.get('beams')}, "
           f"{st.get('src_len')} source tokens, {st.get('new_tokens')} new; best of "
           f"{st.get('repeats')}; result {_link(path, doc_dir)}.\n"]
    out.append(md_table(["system", "tokens/s", "vs HF generate", "sequences equal to HF"],
                      [[r["system"], f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_hf']:.2f}×",
                        f"{r['sequences_equal_hf']}/{r['sequences']}"]
                       for r in doc.get("rows", [])]) + "\n")
    return out


def triton_section(doc: dict, path: str, doc_dir: Path) -> list[str]:
    """``bench/triton_forward.py``: seq and itif with cuBLAS and with itif's Triton GEMM."""
    rows = doc.get("rows", [])
    out = ["### itif's Triton GEMM in the forward\n",
           f"`bench/triton_forward.py` on {doc.get('device')}, torch {doc.get('torch')}: "
           "latency ms (interleaved medians; back to back in brackets), seq and itif with "
           "each GEMM; itif against seq with the same GEMM and against the faster seq; "
           f"result {_link(path, doc_dir)}.\n"]
    lat = {(r["model"], r["tenants"], r["system"], r["gemm"]): r for r in rows}
    body = []
    for (model, T, system, gemm), r in lat.items():
        if system != "itif":
            continue
        seq = lat.get((model, T, "seq", gemm), {})
        diff = next((v for k, v in r.items() if k.startswith("max_abs_logit_diff_vs_")), None)
        body.append([model, T, gemm, f"{fmt_ms(seq.get('latency_ms'))} "
                     f"({fmt_ms(seq.get('latency_ms_alone'))})",
                     f"{fmt_ms(r['latency_ms'])} ({fmt_ms(r.get('latency_ms_alone'))})",
                     f"{r['speedup_vs_seq']:.2f}×", f"{r['speedup_vs_best_seq']:.2f}×",
                     "–" if diff is None else f"{diff:.1e}"])
    out.append(md_table(["model", "tenants", "GEMM", "seq", "itif", "itif vs seq",
                       "itif vs faster seq", "max |logits - cuBLAS's|"], body) + "\n")
    out += [f"- error: {e['model']} T = {e['tenants']}: {e['error']}"
            for e in doc.get("errors", [])]
    return out


def render(table_doc: dict | None, table_path: str | None, ops: dict | None = None,
           serve: dict | None = None, doc_dir: Path = Path("docs"),
           extra_tables: list[tuple[str, dict]] = (), profiles: list[tuple[str, list]] = (),
           generate: tuple[str, dict] | None = None,
           triton: tuple[str, dict] | None = None) -> str:
    out = [BEGIN, "<!-- generated by `python -m itif.bench.gpu_report`; do not edit by hand -->",
           ""]
    if table_doc is not None:
        meta, rows = table_doc["meta"], table_doc["rows"]
        v = meta.get("versions", {})
        link = _link(table_path, doc_dir) if table_path else ""
        out.append(f"## Results: {meta.get('device')}, {meta.get('dtype')}\n")
        out.append(f"{meta.get('date')}; torch {v.get('torch')}, CUDA {v.get('cuda')}, "
                   f"transformers {v.get('transformers')}; {meta.get('cpu_count')} CPU cores; "
                   f"result {link}.\n")
        if meta.get("device_type") != "cuda":
            out.append("> **Not a GPU run**: this section was rendered from a CPU (dry) run; "
                       "its numbers only show that the pipeline works.\n")
        out.append("### Latency (ms) of one call answering every tenant's request\n")
        out.append(latency_table(rows) + "\n")
        out += diagnostics(rows, meta)
        why = {}
        for r in rows:
            if r.get("status") != "ok" and r.get("reason"):
                why[(r["system"], r["status"], r["reason"])] = why.get(
                    (r["system"], r["status"], r["reason"]), 0) + 1
        if why:
            out.append("### Not run\n")
            out.append(md_table(["system", "status", "rows", "reason"],
                              [[s, st, n, re_] for (s, st, re_), n in why.items()]) + "\n")
    for path, doc in extra_tables:
        out += extra_table_section(doc, path, doc_dir)
    if profiles:
        out += profile_section(list(profiles), doc_dir)
    if generate is not None:
        out += generate_section(generate[1], generate[0], doc_dir)
    if triton is not None:
        out += triton_section(triton[1], triton[0], doc_dir)
    if ops is not None:
        out += ops_section(ops)
        out.append("")
    if serve is not None:
        out += serve_section(serve)
    if (table_doc is None and ops is None and serve is None and not profiles and not generate
            and triton is None):
        out.append("> **No GPU results yet.** Run `bench/gpu_suite.sh OUT` on a GPU machine, "
                   "then `python -m itif.bench.gpu_report OUT/table.json --ops OUT/ops.json "
                   "--into docs/gpu.md`.\n")
    out.append(END)
    return "\n".join(out) + "\n"


def splice(page: str, section: str) -> str:
    """``page`` with the text between the markers replaced by ``section`` (appended when the
    page has no markers)."""
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        return head + section.rstrip("\n") + tail
    return page.rstrip("\n") + "\n\n" + section


def _load(path: str | None):
    return json.loads(Path(path).read_text()) if path else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m itif.bench.gpu_report",
                                description=__doc__.splitlines()[0])
    p.add_argument("table", nargs="?", help="OUT/table.json of bench/gpu_suite.sh")
    p.add_argument("--ops", help="OUT/ops.json (Table 5.3)")
    p.add_argument("--serve", help="OUT/serve.json (the serving step)")
    p.add_argument("--into", help="a page with the gpu-results markers to update in place")
    p.add_argument("--doc-dir", default="docs", help="where the page lives (for links)")
    p.add_argument("--extra-table", nargs="+", default=[],
                   help="table.json of other calls of the session, each as its own table")
    p.add_argument("--profile", nargs="+", default=[], help="profile.json of profile_forward.py")
    p.add_argument("--generate", help="generate.json of bench_generate.py")
    p.add_argument("--triton", help="triton.json of bench/triton_forward.py")
    a = p.parse_args(argv)
    section = render(_load(a.table), a.table, _load(a.ops), _load(a.serve), Path(a.doc_dir),
                     [(x, _load(x)) for x in a.extra_table], [(x, _load(x)) for x in a.profile],
                     (a.generate, _load(a.generate)) if a.generate else None,
                     (a.triton, _load(a.triton)) if a.triton else None)
    if a.into:
        page = Path(a.into)
        page.write_text(splice(page.read_text() if page.exists() else "", section))
    else:
        sys.stdout.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
