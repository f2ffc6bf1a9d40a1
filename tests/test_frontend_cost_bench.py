"""bench/frontend_cost.py: a real CPU daemon's event-loop CPU time per Infer call."""

from __future__ import annotations

import json

from tests.bench_scripts import load


def _module():
    return load("frontend_cost")


def test_reports_the_event_loop_threads_cpu_per_answered_call(tmp_path):
    out = tmp_path / "fc.json"
    assert _module().main(["--rate", "100", "--seconds", "1", "--repeats", "1", "--ingress", "0",
                           "--tenants", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["completed"] == row["sent"] > 0 and not row["errors"]
    # a real reading: some CPU (10 ms clock ticks over ~100 calls), less than a core's worth
    # of each call's share of the wall time
    assert 0 < row["main_thread_us_per_request"] < 1e6 / row["throughput_rps"] * 1.5
    assert doc["median_main_thread_us_per_request"] == row["main_thread_us_per_request"]
    # the CPU by thread name: the scheduler's thread is named in the OS and works every batch
    assert row["threads_us_per_request"]["itif-scheduler"] > 0
