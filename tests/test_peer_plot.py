"""The peer suite's plot (``itif.bench.plots._peer``, issue 65 asks for one): written next to
the result for peer rows, with each system's median and its round range; absent otherwise."""

from __future__ import annotations

import pytest

from itif.bench.plots import make_plots

pytest.importorskip("matplotlib")


def _row(workload, tenants, system, rps, dtype="float32"):
    ms = 256 / rps * 1e3
    return dict(suite="peer", status="ok", model="bert-peer", requests=256, workload=workload,
                tenants=tenants, system=system, dtype=dtype, throughput_rps=rps, latency_ms=ms,
                latency_ms_min=ms * 0.8, latency_ms_max=ms * 1.5)


def test_peer_rows_make_a_plot(tmp_path):
    rows = [_row("one model", 1, "itif", 500), _row("one model", 1, "vllm", 450),
            _row("8 fine-tunes", 8, "itif", 480), _row("8 fine-tunes", 8, "vllm", 300),
            _row("8 fine-tunes", 8, "itif_bf16", 700, "bfloat16"),
            dict(suite="peer", status="skipped", workload="one model", system="hf")]
    paths = make_plots(rows, {"device": "cpu-x86_64-2threads"}, tmp_path / "r")
    assert [p.name for p in paths] == ["r-peer.png"]
    assert paths[0].stat().st_size > 10_000


def test_no_peer_rows_no_peer_plot(tmp_path):
    rows = [dict(suite="peer", status="skipped", workload="one model", system="vllm")]
    assert make_plots(rows, {"device": "cpu"}, tmp_path / "r") == []
