"""bench/thread_wake_cost.py: the CPU a timer wake-up costs a thread, beside an idle and a busy
main thread."""

from __future__ import annotations

import json

from tests.bench_scripts import load


def test_reports_a_wake_up_count_and_its_cpu_for_both_main_threads(tmp_path):
    mod = load("thread_wake_cost")
    out = tmp_path / "w.json"
    assert mod.main(["--gap-ms", "10", "--seconds", "0.3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["main_thread"] for r in rows] == ["asleep", "torch ops"]
    for r in rows:
        # ~30 wake-ups of 10 ms in 0.3 s (fewer on a loaded machine, never none or hundreds)
        assert 5 <= r["wakes"] <= 40, r
        assert r["cpu_us_per_wake"] > 0, r
