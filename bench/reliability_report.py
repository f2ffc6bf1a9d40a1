"""Render the promise -> test -> result table of docs/reliability.md from a real run.

    python bench/reliability_report.py --run            # run the suite, rewrite the table
    python bench/reliability_report.py RUN.jsonl        # render an existing record (stdout)
    python bench/reliability_report.py RUN.jsonl --write docs/reliability.md

The reliability tests (tests/test_reliability_*.py) append one JSON line per test to the file
named by ``ITIF_RELIABILITY_REPORT`` (tests/reliability_util.py, fixture ``rel``): the promise
numbers it shows, whether it passed, how many inputs it sent, how many faults it injected, how
many unexpected outcomes it saw, and its measurements. ``--run`` runs the suite with that
variable set, times it, and replaces the part of the docs page between the two markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- reliability-table:start -->", "<!-- reliability-table:end -->"

#: shared/reference/reliability.md, shortened.
PROMISES = {
    1: "Bounded per-tenant queue: full -> RESOURCE_EXHAUSTED within 50 ms, counted, nothing lost",
    2: "Deadlines and cancellation free their work; 1 ms deadline -> DEADLINE_EXCEEDED, next OK",
    3: "Sustained mixed load over 8 tenants: only OK / RESOURCE_EXHAUSTED, bounded memory",
    4: "Noisy neighbour at 10x capacity: the quiet tenant all OK, p99 <= 2x its idle p99",
    5: "Health truthful: NOT_SERVING while loading, SERVING after, NOT_SERVING after SIGTERM",
    6: "Graceful shutdown: in-flight calls finish, new ones UNAVAILABLE, exit within grace",
    7: "Metrics exact: per-tenant request counters equal client-side counts",
    8: "kill -9 mid-upload: old or new weights exactly, no partial file, re-upload OK",
    9: "Restart restores every tenant: outputs before == outputs after",
    10: "One corrupted stored file fails only its tenant (FAILED_PRECONDITION)",
    11: "Bad config edits: last good config kept, error reported, fixed file applies in a poll",
    12: "Half-written file, editor rename, symlink swap: never a half state, applied once",
    13: "Reload under traffic drops nothing; a removed tenant's in-flight calls finish",
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
}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _short(nodeid: str) -> str:
    file, _, name = nodeid.partition("::")
    return f"`{Path(file).stem.replace('test_reliability_', '')}::{name}`"


def render(records: list[dict], wall_s: float | None = None) -> str:
    by_promise: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        for p in r["promises"]:
            by_promise[p].append(r)
    lines = [
        "| # | promise | tests | result | inputs | faults | failures |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for p, text in PROMISES.items():
        rs = by_promise.get(p, [])
        if not rs:
            lines.append(f"| {p} | {text} | (none) | NOT RUN | | | |")
            continue
        ok = all(r["passed"] for r in rs)
        lines.append(
            f"| {p} | {text} | {'<br>'.join(_short(r['test']) for r in rs)} | "
            f"{'pass' if ok else '**FAIL**'} | {sum(r['inputs'] for r in rs)} | "
            f"{sum(r['faults'] for r in rs)} | {sum(r['failures'] for r in rs)} |")
    tests = {r["test"]: r for r in records}.values()
    passed = sum(r["passed"] for r in tests)
    totals = (f"**{len(tests)} tests, {passed} passed; {sum(r['inputs'] for r in tests)} inputs "
              f"tried, {sum(r['faults'] for r in tests)} faults injected, "
              f"{sum(r['failures'] for r in tests)} failures.**")
    if wall_s is not None:
        totals += f" Suite wall time {wall_s / 60:.1f} min"
    where = (f" on {os.cpu_count()} CPU cores ({platform.machine()}, Python "
             f"{platform.python_version()}), {time.strftime('%Y-%m-%d')}.")
    out = [totals + where, "", *lines, "", "Measurements of the same run:", ""]
    for r in tests:
        notes = {k: v for k, v in r["notes"].items() if k != "calls by kind and code"}
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
        bits = [f"{k}: {json.dumps(v)}" for k, v in notes.items()]
        if codes:
            bits.append(f"status codes seen: {codes}")
        if bits:
            out.append(f"- {_short(r['test'])} ({r['seconds']} s): " + "; ".join(bits))
    return "\n".join(out) + "\n"


def write(doc: Path, table: str) -> None:
    text = doc.read_text()
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"{doc}: markers {START} / {END} not found")
    doc.write_text(f"{head}{START}\n{table}{END}{tail}")


def run_suite(out: Path, extra: list[str]) -> tuple[int, float]:
    env = dict(os.environ, ITIF_RELIABILITY_REPORT=str(out))
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_reliability_*.py"))
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *files, *extra], cwd=ROOT, env=env)
    return rc, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", nargs="?", type=Path, help="JSON lines written by a run")
    ap.add_argument("--run", action="store_true", help="run the suite first (then --write)")
    ap.add_argument("--write", type=Path, help="replace the table in this markdown file")
    ap.add_argument("--wall-seconds", type=float, help="suite wall time to print")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: for pytest")
    a = ap.parse_args()
    wall, rc = a.wall_seconds, 0
    if a.run:
        record = a.record or Path(tempfile.mkstemp(prefix="reliability-", suffix=".jsonl")[1])
        record.write_text("")
        rc, wall = run_suite(record, [x for x in a.pytest_args if x != "--"])
        a.write = a.write or ROOT / "docs" / "reliability.md"
    elif a.record is None:
        ap.error("give a record file or --run")
    else:
        record = a.record
    table = render(load(record), wall)
    if a.write:
        write(a.write, table)
        print(f"wrote {a.write} ({record})")
    else:
        sys.stdout.write(table)
    return rc


if __name__ == "__main__":
    sys.exit(main())
