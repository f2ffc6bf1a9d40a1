"""docs/performance.md is generated from the committed result files (bench/results/) by
itif.bench.perf_doc: it is exactly what they render to, every table says where its numbers come
from, and a newer result of a kind replaces the older one on the page."""

from __future__ import annotations

import json
import re
from pathlib import Path

from itif.bench import perf_doc as pd

ROOT = Path(__file__).resolve().parent.parent
_SOURCE = re.compile(r"Source: \[`(?P<path>bench/results/[^`]+\.json)`\]\([^)]+\)\. "
                     r"Command: `(?P<command>[^`]+)`\. Date: (?P<date>20\d\d-\d\d-\d\d\S*)\. "
                     r"Device: (?P<device>.+?)(; load average \[[^\]]*\])?\.$")


def _tables(text: str) -> list[tuple[int, list[str]]]:
    """(line of the header, the lines since the previous table or heading) of each table."""
    lines = text.splitlines()
    out, since = [], []
    for i, line in enumerate(lines):
        if line.startswith("|"):
            if not lines[i - 1].startswith("|"):
                out.append((i + 1, since))
                since = []
            continue
        since = [] if line.startswith("#") else since + [line]
    return out


def test_committed_doc_is_what_the_committed_results_render_to():
    text = pd.DOC.read_text()
    assert text == pd.render(pd.load_results()), (
        "docs/performance.md is stale (a result under bench/results/ changed or was added): "
        "run `python -m itif.bench.perf_doc`")
    assert pd.main(["--check"]) == 0


def test_every_table_names_its_source_command_date_and_device():
    text = pd.DOC.read_text()
    tables = _tables(text)
    assert len(tables) >= 10, len(tables)
    for line, before in tables:
        found = [m for m in map(_SOURCE.search, before) if m]
        assert found, f"docs/performance.md:{line}: no Source/Command/Date/Device line above"
        for m in found:
            r = pd.Result(m["path"], json.loads((ROOT / m["path"]).read_text()))
            assert m["command"] == r.command(next((k.script for k in pd.KINDS.values()
                                                   if k.script and k.accepts(r)), None))
            assert m["date"] == r.date and m["device"] == r.device, m.group(0)
            assert r.command() != "?" or "argv" in r.meta, m["path"]


def test_kinds_the_issue_names_are_on_the_page():
    picked = pd.pick(pd.load_results())
    for key in ("cpu-table", "cpu-serve", "cpu-generate", "cpu-decoder", "cpu-peer",
                "cpu-hostpath", "gpu-table", "gpu-serve", "gpu-generate"):
        assert picked[key], f"no committed result of kind {key}"
    assert picked["cpu-peer"][0].path.startswith("bench/results/cpu-peer-")
    assert picked["cpu-decoder"][0].path.startswith("bench/results/cpu-decoder-")
    assert picked["gpu-table"][0].meta["device"].startswith("NVIDIA H")
    text = pd.DOC.read_text()
    assert "n/a (no decoder backbone)" not in text
    assert "](gpu.md)" in text and "](cpu-peer.md)" in text


def _peer(date: str, rate: float) -> dict:
    rows = [{"suite": "peer", "workload": "one model", "system": s, "dtype": "float32",
             "status": "ok", "throughput_rps": v, "max_abs_diff_vs_hf_fp32": 1e-7}
            for s, v in (("itif", rate), ("hf", 100.0))]
    rows[0]["vs_hf"] = rate / 100.0
    return {"meta": {"device": "cpu-x86_64-2threads", "date": date, "dtype": "float32",
                     "command": f"itif bench --suites peer # {date}"}, "rows": rows}


def test_the_newest_file_of_a_kind_is_rendered_whatever_its_name(tmp_path):
    # the older file's name sorts last: the recorded date decides, not the name
    (tmp_path / "z-old.json").write_text(json.dumps(_peer("2026-11-29T01:38:43+00:00", 50.0)))
    (tmp_path / "a-new.json").write_text(json.dumps(_peer("2026-11-29T09:00:00+0000", 250.0)))
    (tmp_path / "broken.json").write_text("{not json")
    page = pd.render(pd.load_results(tmp_path))
    assert "a-new.json" in page and "z-old.json" not in page
    assert "| one model | itif | float32 | 250.0 |  | 2.50× |" in page
    assert "*No committed result of this kind.*" in page  # kinds with no file say so
    # and a newer committed result of a kind makes the committed page stale
    newer = pd.Result("bench/results/cpu-peer-vllm-2099-01-01.json",
                      _peer("2099-01-01T00:00:00+00:00", 1.0))
    assert pd.render([*pd.load_results(), newer]) != pd.DOC.read_text()


def test_dates_compare_across_their_recorded_forms():
    def when(d):
        return pd.Result("x.json", {"meta": {"date": d}}).when

    assert when("2026-11-29T03:14:06+0000") > when("2026-11-29T03:14:05+00:00")
    assert when("2026-11-29T04:14:06+01:00") == when("2026-11-29T03:14:06Z")
    assert when("2026-11-30") > when("2026-11-29T23:59:59+00:00") > when("not a date")


def test_stdout_prints_and_writes_nothing_check_fails_on_a_stale_page(tmp_path, monkeypatch,
                                                                      capsys):
    doc = tmp_path / "performance.md"
    doc.write_text("old\n")
    monkeypatch.setattr(pd, "DOC", doc)
    monkeypatch.setattr(pd, "ROOT", tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "p.json").write_text(json.dumps(_peer("2026-11-29T01:00:00+00:00", 9.0)))
    assert pd.main(["--results", str(tmp_path / "r"), "--stdout"]) == 0
    assert "# Performance" in capsys.readouterr().out and doc.read_text() == "old\n"
    assert pd.main(["--results", str(tmp_path / "r"), "--check"]) == 1
    assert pd.main(["--results", str(tmp_path / "r")]) == 0
    assert doc.read_text().startswith("# Performance")
    assert pd.main(["--results", str(tmp_path / "r"), "--check"]) == 0


def test_decoder_rows_of_a_cuda_run_render():
    """The Llama step's rows (issue 66): ms per output token, vLLM skipped, no HF comparison."""
    base = {"suite": "decoder", "model": "llama3-8b-l2", "adapters": 8, "full": 2, "prompts": 64,
            "prompt_lengths": "16-64", "new_tokens": 32, "dtype": "bfloat16"}
    rows = [dict(base, system="itif", status="ok", tokens_per_s=9000.0, latency_ms=227.5,
                 latency_ms_min=220.0, ms_per_output_token=7.109, vs_hf=3.2, equal_to_hf=None,
                 compared=0),
            dict(base, system="vllm", status="skipped", reason="vLLM runs on the CPU only")]
    out = pd.decoder_table(pd.Result("g.json", {"meta": {"device": "NVIDIA H100"}, "rows": rows}))
    assert "| itif | 9,000 | 0.228 | 0.220 | 7.11 | 3.20 |  |  |" in out
    assert "| vllm | skipped |  |  |  |  |  | vLLM runs on the CPU only |" in out
    assert "ms per output token" in out.splitlines()[2]


def test_a_run_of_another_copy_of_the_code_is_not_the_figure(tmp_path):
    """bench/hostpath_cost.py records the tree it imported (``meta.itif``); the 'before' arm of
    a comparison, run from a copy under /tmp, is newer but is not this code's figure."""
    def hostpath(date: str, tree: str, extra: float) -> dict:
        return {"meta": {"date": date, "argv": ["--out", "x.json"], "itif": tree,
                         "cpu_count": 2}, "median_extra_us_per_request": extra,
                "median_extra_us_per_batch": 3 * extra,
                "rows": [{"repeat": 0, "requests": 10, "batches": 3,
                          "extra_us_per_request": extra}]}
    (tmp_path / "now.json").write_text(json.dumps(hostpath("2026-11-29T06:46:16+0000",
                                                           "/work/main", 103.4)))
    (tmp_path / "before.json").write_text(json.dumps(hostpath("2026-11-29T06:47:22+0000",
                                                              "/tmp/h4/oldhp", 139.5)))
    (got,) = pd.pick(pd.load_results(tmp_path))["cpu-hostpath"]
    assert got.path.endswith("now.json")
    page = pd.render(pd.load_results(tmp_path))
    assert "**103.4 µs a request" in page and "139.5" not in page
