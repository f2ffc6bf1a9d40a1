"""docs/reliability.md's "Last recorded run" section, generated from a committed run record.

    python -m itif.bench.reliability_doc --run [-- PYTEST ARGS]  # run, record, rewrite the doc
    python -m itif.bench.reliability_doc RUN.jsonl     # rewrite the doc from a record
    python -m itif.bench.reliability_doc RUN.jsonl --stdout

The record is a JSON-lines file under ``bench/results/`` (``reliability-<date>.jsonl``), committed
with the doc. ``--run`` writes its first line (``"kind": "run"``: date, machine, Python, git
commit), then runs each reliability test file in its own pytest with ``ITIF_RELIABILITY_REPORT``
pointing at the record (each test appends one line: promises, passed, inputs, faults, failures,
status codes, measurements; ``tests/reliability_util.py``, fixture ``rel``), then appends the
suite's wall time and pytest's exit codes. The section is a pure function of the record, so
``tests/test_reliability_doc.py`` checks that the committed doc is what the committed record
renders to.

A new promise: add its number and one line to :data:`PROMISES`, mark its test(s)
``@promise(n)`` and give them the ``rel`` fixture; its measurements (``rel.notes``) appear under
the table. A record naming a promise missing from :data:`PROMISES` still gets a row (the test's
first docstring line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
RESULTS = ROOT / "bench" / "results"
START, END = "<!-- reliability-table:start", "<!-- reliability-table:end -->"

#: shared/reference/reliability.md, shortened (one row each).
PROMISES = {
    1: "Bounded per-tenant queue: full -> RESOURCE_EXHAUSTED within 50 ms, counted, nothing lost",
    2: "Deadlines and cancellation free their work; 1 ms deadline -> DEADLINE_EXCEEDED, next OK",
    3: "Sustained mixed load over 8 tenants: only OK / RESOURCE_EXHAUSTED, bounded memory",
    4: "Noisy neighbour at 10x capacity: the quiet tenant all OK, its p99 at most 2x",
    5: "Health truthful: NOT_SERVING while loading, SERVING after, NOT_SERVING after SIGTERM",
    6: "Graceful shutdown: in-flight calls finish, new ones UNAVAILABLE, exit within grace",
    7: "Metrics exact: per-tenant request counters equal client-side counts",
    8: "kill -9 mid-upload: old or new weights exactly, no partial file, re-upload OK",
    9: "Restart restores every tenant: outputs before == outputs after",
    10: "One corrupted stored file fails only its tenant (FAILED_PRECONDITION)",
    11: "Bad config edits: last good config kept, error reported, fixed file applies in a poll",
    12: "Half-written file, editor rename, symlink swap: never a half state, applied once",
    13: "Reload under traffic drops nothing, takes effect; a removed tenant's calls finish",
    14: "Tenant beyond the memory budget -> RESOURCE_EXHAUSTED, others untouched",
    15: "Out-of-memory in a forward: that batch's calls fail cleanly, the daemon serves on",
    16: "Client killed mid-upload: temp file removed, lock released, no descriptor leak",
    17: "Wrong shapes / empty inputs / mismatched mask -> INVALID_ARGUMENT naming the field",
    18: "Token ids out of vocabulary, negative, huge -> INVALID_ARGUMENT (property test)",
    19: "Length = max OK; max+1 -> INVALID_ARGUMENT",
    20: "Oversized message -> RESOURCE_EXHAUSTED; upload over its cap aborted, temp file gone",
    21: "Hostile weights rejected, nothing executed, previous weights still served",
    22: "Fuzzed bytes to every method: only expected codes, daemon healthy",
    23: "No / wrong token on every RPC (streams too) -> UNAUTHENTICATED, 0 bytes written",
    24: "Tenant A asking for B is refused exactly like a missing tenant",
    25: "A cannot overwrite B; ids like ../B, /abs, A\\x00 rejected; paths under the store",
    26: "Admin operations need the admin credential; no upload from a URL",
    27: "TLS / mTLS: plaintext and untrusted client certificates refused",
    28: "Acknowledged = durable under races: upload vs delete vs config removal agree on disk",
    29: "Nothing a tenant is told depends on other tenants' weights (sharing, budget checks)",
    30: "Weights finite on disk but overflowing the serving dtype or the forward: refused",
    31: "Overload confined to its tenant: a 3,000-call burst, no CANCELLED, counted exactly",
    32: "Noisy neighbour (256 calls in flight): quiet all OK, its p99 bounded vs idle",
    33: "Memory bounded under slow readers: unread replies capped, freed on disconnect",
    34: "Reply over max_message_bytes: refused before it runs, counted, no traceback",
    35: "More calls than a connection's streams: itif's client retries, every call OK",
    36: "Every overload answer says whether to retry: RESOURCE_EXHAUSTED / 429 with a hint",
    37: "Compressed bodies bounded while they inflate: 16 bombs within 64 MiB of idle RSS",
    38: "KServe parameters of the wrong type (REST and gRPC) -> 400 / INVALID_ARGUMENT",
    39: "Idle connections starve nobody: 2,000 idle, another client's p99 within 2x; health 200",
    40: "LoRA config contradicting its tensors or the backbone -> INVALID_ARGUMENT, old kept",
}


def load(path: Path) -> tuple[dict, list[dict]]:
    """(run metadata, test records) of a record file; the last record of a test wins."""
    meta: dict = {}
    tests: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("kind") == "run":
            meta.update({k: v for k, v in r.items() if k != "kind"})
        else:
            tests[r["test"]] = r
    return meta, list(tests.values())


def _short(nodeid: str) -> str:
    file, _, name = nodeid.partition("::")
    return f"`{Path(file).stem.replace('test_reliability_', '')}::{name}`"


def render(meta: dict, records: list[dict], source: str) -> str:
    """The generated section (between the markers), from the record alone."""
    by_promise: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        for p in r["promises"]:
            by_promise[p].append(r)
    texts = dict(PROMISES)
    for p, rs in by_promise.items():
        texts.setdefault(p, rs[0].get("doc", ""))
    rows = ["| # | promise | tests | result | inputs | faults | failures |",
            "| ---: | --- | --- | --- | ---: | ---: | ---: |"]
    for p in sorted(texts):
        rs = by_promise.get(p, [])
        if not rs:
            rows.append(f"| {p} | {texts[p]} | (none) | NOT RUN | | | |")
            continue
        ok = all(r["passed"] for r in rs)
        rows.append(
            f"| {p} | {texts[p]} | {'<br>'.join(_short(r['test']) for r in rs)} | "
            f"{'pass' if ok else '**FAIL**'} | {sum(r['inputs'] for r in rs)} | "
            f"{sum(r['faults'] for r in rs)} | {sum(r['failures'] for r in rs)} |")
    passed = sum(r["passed"] for r in records)
    head = (f"**{len(records)} tests, {passed} passed; {sum(r['inputs'] for r in records)} inputs "
            f"tried, {sum(r['faults'] for r in records)} faults injected, "
            f"{sum(r['failures'] for r in records)} failures.**")
    if meta:
        wall = f"suite wall time {meta['wall_s'] / 60:.1f} min, " if "wall_s" in meta else ""
        head += (f" Run of {meta.get('date', '?')} at commit `{meta.get('commit', '?')}`: {wall}"
                 f"{meta.get('cpus', '?')} CPU cores ({meta.get('machine', '?')}, Python "
                 f"{meta.get('python', '?')}).")
    out = [f"Generated by `python -m itif.bench.reliability_doc {source}` from that record "
           "(committed); do not edit by hand.", "", head, "", *rows, "",
           "Measurements of the same run:", ""]
    for r in sorted(records, key=lambda r: r["test"]):
        notes = {k: v for k, v in r["notes"].items() if k != "calls by kind and code"}
        bits = [f"{k}: {json.dumps(v)}" for k, v in notes.items()]
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
        if codes:
            bits.append(f"status codes seen: {codes}")
        if bits:
            out.append(f"- {_short(r['test'])} ({r['seconds']} s): " + "; ".join(bits))
    return "\n".join(out) + "\n"


def source_of(doc_text: str) -> str:
    """The record a doc's section names (``<!-- reliability-table:start source=PATH -->``)."""
    head = doc_text.partition(START)[2].partition("-->")[0]
    if not head.strip().startswith("source="):
        raise ValueError(f"no source= in the {START} marker")
    return head.strip()[len("source="):]


def rewrite(doc_text: str, section: str, source: str) -> str:
    head, start, rest = doc_text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"markers {START} ... {END} not found")
    return f"{head}{START} source={source} -->\n{section}{END}{tail}"


def generate(doc_text: str, record: Path) -> str:
    """``doc_text`` with its section regenerated from ``record`` (a path under the repo)."""
    source = record.resolve().relative_to(ROOT).as_posix()
    meta, records = load(record)
    return rewrite(doc_text, render(meta, records, source), source)


def suite_files() -> list[str]:
    """The reliability test files (those with ``@promise`` tests), repo-relative."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "\n@promise(" in p.read_text())


def run(record: Path, pytest_args: list[str]) -> int:
    """Run every reliability file in its own pytest, recording into ``record``."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    meta = {"kind": "run", "date": time.strftime("%Y-%m-%d"), "commit": commit,
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version()}
    record.write_text(json.dumps(meta) + "\n")
    env = dict(os.environ, ITIF_RELIABILITY_REPORT=str(record))
    t0, codes = time.monotonic(), {}
    for f in suite_files():
        codes[f] = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    f, *pytest_args], cwd=ROOT, env=env)
    with open(record, "a") as out:
        out.write(json.dumps({"kind": "run", "wall_s": round(time.monotonic() - t0, 1),
                              "pytest_exit_codes": codes}) + "\n")
    return max(codes.values(), default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", nargs="?", type=Path, help="a run record (JSON lines)")
    ap.add_argument("--run", action="store_true",
                    help="run the suite first, recording into RECORD (default "
                         "bench/results/reliability-<date>.jsonl)")
    ap.add_argument("--stdout", action="store_true", help="print the section, write nothing")
    argv = list(sys.argv[1:] if argv is None else argv)
    # what follows "--" goes to pytest; the options may come before or after the record
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    pytest_args = argv[cut + 1:]
    rc = 0
    record = a.record
    if a.run:
        record = record or RESULTS / f"reliability-{time.strftime('%Y-%m-%d')}.jsonl"
        rc = run(record, pytest_args)
    elif pytest_args:
        ap.error("arguments after -- go to pytest, with --run only")
    elif record is None:
        ap.error("give a record file or --run")
    if a.stdout:
        meta, records = load(record)
        sys.stdout.write(render(meta, records, str(record)))
        return rc
    DOC.write_text(generate(DOC.read_text(), record))
    print(f"wrote {DOC.relative_to(ROOT)} from {record}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
