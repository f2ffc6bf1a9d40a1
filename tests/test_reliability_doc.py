"""docs/reliability.md's recorded-run section is generated from the committed run record
(bench/results/reliability-*.jsonl) by itif.bench.reliability_doc, and says nothing else."""

from __future__ import annotations

import ast
from pathlib import Path

from itif.bench import reliability_doc as rd

ROOT = Path(__file__).resolve().parent.parent


def test_committed_doc_is_what_the_committed_record_renders_to():
    text = rd.DOC.read_text()
    source = rd.source_of(text)
    record = ROOT / source
    assert source.startswith("bench/results/reliability-") and source.endswith(".jsonl"), source
    assert record.is_file(), f"{source} (named by docs/reliability.md) is not committed"
    assert text == rd.generate(text, record), (
        f"docs/reliability.md is stale: run `python -m itif.bench.reliability_doc {source}`")


def test_the_record_is_a_complete_run_of_tests_that_exist():
    meta, records = rd.load(ROOT / rd.source_of(rd.DOC.read_text()))
    assert {"date", "commit", "cpus", "wall_s", "pytest_exit_codes"} <= set(meta), meta
    assert records
    names: dict[str, set[str]] = {}
    for r in records:
        file, _, name = r["test"].partition("::")
        if file not in names:
            tree = ast.parse((ROOT / file).read_text())
            names[file] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in names[file], f"{r['test']} is no longer a test: re-record"
        assert r["promises"], r["test"]


def test_render_rows_for_failures_missing_and_new_promises():
    rec = {"test": "tests/test_reliability_x.py::test_a", "promises": [1, 99],
           "doc": "A new promise", "passed": False, "inputs": 3, "faults": 1, "failures": 1,
           "codes": {"OK": 2}, "notes": {"m": [1, 2]}, "seconds": 0.5}
    out = rd.render({"date": "2026-01-01", "commit": "abc", "cpus": 2, "machine": "x",
                     "python": "3", "wall_s": 60}, [rec], "r.jsonl")
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| ")}
    assert "**FAIL**" in rows["| 1"] and "`x::test_a`" in rows["| 1"]
    assert "A new promise" in rows["| 99"]  # not in PROMISES: the test's doc line
    assert "NOT RUN" in rows["| 2"]
    assert "**1 tests, 0 passed; 3 inputs tried, 1 faults injected, 1 failures.**" in out
    assert 'm: [1, 2]; status codes seen: OK 2' in out and "1.0 min" in out
    doc = "a\n<!-- reliability-table:start -->\nold\n<!-- reliability-table:end -->\nb\n"
    new = rd.rewrite(doc, out, "r.jsonl")
    assert rd.source_of(new) == "r.jsonl" and new.startswith("a\n") and new.endswith("end -->\nb\n")


def test_stdout_after_the_record_prints_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """``RUN.jsonl --stdout`` (the module's own example) prints the section and leaves the doc
    alone; before, argparse handed ``--stdout`` to pytest's REMAINDER and the doc was rewritten
    from that record."""
    older = ROOT / "bench/results/reliability-2026-11-23.jsonl"
    stale = rd.generate(rd.DOC.read_text(), older)
    doc = tmp_path / "reliability.md"
    doc.write_text(stale)
    monkeypatch.setattr(rd, "DOC", doc)
    record = ROOT / "bench/results/reliability-2026-11-24.jsonl"
    assert rd.main([str(record), "--stdout"]) == 0
    assert capsys.readouterr().out == rd.render(*rd.load(record), str(record))
    assert doc.read_text() == stale
