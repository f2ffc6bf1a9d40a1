"""bench/grpc_floor.py: a bare gRPC server of itif's service, its CPU time per unary call."""

from __future__ import annotations

import json

from tests.bench_scripts import load


def _module():
    return load("grpc_floor")


def test_each_server_answers_every_call_and_reports_its_cpu_per_call(tmp_path):
    out = tmp_path / "floor.json"
    assert _module().main(["--rates", "200", "--seconds", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["server"] for r in doc["rows"]] == ["aio", "sync"]
    for r in doc["rows"]:
        assert r["requests"] == 200 and r["achieved_rps"] > 0
        # a real reading of the server's CPU (in 10 ms clock ticks: ~70 ms of work is several),
        # more than nothing and less than four cores' worth of the wall time
        assert 0 < r["server_cpu_ms_per_request"] < 1e3 / r["achieved_rps"] * 4
