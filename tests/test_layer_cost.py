"""Cost model: profiling, interpolation, monotone repair, persistence, cache, report."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from itif.batching import layer_cost
from itif.batching.layer_cost import CostModel, LayerShape

TINY = LayerShape(hidden=32, intermediate=64, heads=2)


@pytest.fixture(scope="module")
def quick_model() -> CostModel:
    return CostModel.profile(TINY, quick=True)


def assert_monotone(model: CostModel) -> None:
    # Exactly on the grid and in the planner's dense table.
    for table in (model.single_ms, model.batched_ms, model.single_table(200, 40)):
        for axis in range(table.ndim):
            assert np.all(np.diff(table, axis=axis) >= 0)
    # Between and beyond grid points, up to float rounding.
    lens, batches, ns = np.arange(1, 200, 3), np.arange(1, 40), np.arange(1, 12)
    grid = model.single_v(lens[:, None], batches[None, :])
    cube = model.batched_v(lens[:, None, None], ns[None, :, None], batches[None, None, :])
    for values in (grid, cube):
        for axis in range(values.ndim):
            assert np.all(np.diff(values, axis=axis) >= -1e-12 * values.max())


def test_quick_profile_is_fast_positive_and_monotone():
    start = time.perf_counter()
    model = CostModel.profile(TINY, quick=True)
    elapsed = time.perf_counter() - start
    assert elapsed < 15.0  # ~0.1 s on an idle machine; generous for a loaded CI box
    assert model.lens.tolist() == [4, 16, 64]
    assert model.batches.tolist() == [1, 4, 16] and model.ns.tolist() == [1, 2, 4]
    assert np.all(model.single_ms > 0) and np.all(model.batched_ms > 0)
    assert model.quick and model.source == "profiled" and model.device == "cpu"
    assert model.dtype == "float32" and model.device_name.startswith("cpu-")
    assert_monotone(model)


def test_quick_grid_is_capped_by_the_maxima():
    model = CostModel.profile(TINY, quick=True, max_len=10, max_batch=2, max_n=1)
    assert model.lens.tolist() == [4, 10]
    assert model.batches.tolist() == [1, 2] and model.ns.tolist() == [1]


def test_interpolation_hits_grid_points_exactly(quick_model):
    for model in (quick_model, CostModel.analytic(TINY, max_len=64, max_batch=16, max_n=4)):
        for li, seq_len in enumerate(model.lens.tolist()):
            for bi, batch in enumerate(model.batches.tolist()):
                assert model.single(seq_len, batch) == model.single_ms[li, bi]
                for ni, n in enumerate(model.ns.tolist()):
                    assert model.batched(seq_len, n, batch) == model.batched_ms[li, ni, bi]


def test_interpolation_between_and_beyond_the_grid():
    model = CostModel.analytic(TINY, overhead_ms=0.5, max_len=64, max_batch=16, max_n=4)
    # Linear in the raw coordinates inside a cell: the midpoint is the mean of its ends.
    assert model.single(24, 1) == pytest.approx((model.single(16, 1) + model.single(32, 1)) / 2)
    assert model.single(16, 3) == pytest.approx((model.single(16, 2) + model.single(16, 4)) / 2)
    assert model.batched(16, 3, 2) == pytest.approx(
        (model.batched(16, 2, 2) + model.batched(16, 4, 2)) / 2
    )
    # The analytic cost is linear in batch, so interpolating in batch is exact.
    flops = TINY.flops(16, 3)
    assert model.single(16, 3) == pytest.approx(0.5 + flops / 1e10)
    # Beyond the grid: proportional to the extra tokens (or members).
    assert model.single(128, 4) == pytest.approx(2 * model.single(64, 4))
    assert model.single(8, 48) == pytest.approx(3 * model.single(8, 16))
    assert model.single(640, 32) == pytest.approx(20 * model.single(64, 16))
    assert model.batched(8, 12, 2) == pytest.approx(3 * model.batched(8, 4, 2))
    # Below the grid (quick grids start at len 4): flat.
    quick_grid = CostModel(TINY, [4, 16], [1, 4], [1, 2], [[1.0, 2.0], [3.0, 4.0]],
                           np.ones((2, 2, 2)))
    assert quick_grid.single(1, 1) == quick_grid.single(4, 1) == 1.0


def test_vectorised_forms_match_scalar(quick_model):
    lens, batches, ns = np.array([1, 5, 17, 64, 300]), np.array([1, 3, 4, 9, 70]), np.arange(1, 6)
    got = quick_model.single_v(lens, batches)
    assert got.shape == (5,)
    assert got.tolist() == [quick_model.single(int(s), int(b)) for s, b in zip(lens, batches)]
    got = quick_model.batched_v(lens, ns, batches)
    assert got.tolist() == [
        quick_model.batched(int(s), int(n), int(b)) for s, n, b in zip(lens, ns, batches)
    ]
    assert quick_model.single_v(np.array([[3], [40]]), np.array([1, 2, 3])).shape == (2, 3)


def test_single_table_matches_single_and_grows(quick_model):
    table = quick_model.single_table(70, 5)
    assert table.shape[0] > 70 and table.shape[1] > 5 and not table.flags.writeable
    assert table[0].sum() == 0 and table[:, 0].sum() == 0
    assert table[37, 5] == pytest.approx(quick_model.single(37, 5), rel=1e-12)
    assert quick_model.single_table(10, 2) is table  # cached while big enough
    bigger = quick_model.single_table(600, 100)
    assert bigger.shape[0] > 600 and bigger.shape[1] > 100
    assert bigger[600, 100] == pytest.approx(quick_model.single(600, 100), rel=1e-12)


def test_monotone_repair_uses_suffix_minimum():
    # A slow outlier at (len 1, batch 2) is pulled down to the cheapest larger point instead of
    # being copied into every larger point.
    model = CostModel(TINY, [1, 2], [1, 2, 4], [1], [[1.0, 50.0, 3.0], [2.0, 4.0, 5.0]],
                      [[[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]]])
    assert model.single_ms.tolist() == [[1.0, 3.0, 3.0], [2.0, 4.0, 5.0]]
    assert not model.single_ms.flags.writeable
    assert_monotone(model)


def test_constructor_and_queries_validate():
    with pytest.raises(ValueError, match="divisible"):
        LayerShape(hidden=30, intermediate=64, heads=4)
    with pytest.raises(ValueError, match="positive"):
        LayerShape(hidden=0, intermediate=64, heads=1)
    with pytest.raises(ValueError, match="shape"):
        CostModel(TINY, [1, 2], [1], [1], [[1.0]], [[[1.0]], [[1.0]]])
    with pytest.raises(ValueError, match="non-negative"):
        CostModel(TINY, [1], [1], [1], [[-1.0]], [[[1.0]]])
    with pytest.raises(ValueError, match="ascending"):
        CostModel(TINY, [2, 1], [1], [1], [[1.0], [1.0]], [[[1.0]], [[1.0]]])
    model = CostModel.analytic(TINY, max_len=8, max_batch=2, max_n=2)
    with pytest.raises(ValueError, match="seq_len"):
        model.single(0, 1)
    with pytest.raises(ValueError, match="n must"):
        model.batched(4, 0, 1)


def test_analytic_is_deterministic_and_monotone():
    a, b = CostModel.analytic(TINY), CostModel.analytic(TINY)
    assert np.array_equal(a.single_ms, b.single_ms)
    assert np.array_equal(a.batched_ms, b.batched_ms)
    assert a.source == "analytic"
    assert_monotone(a)
    # One launch instead of n: batching pays at full bmm efficiency.
    assert a.batched(32, 4, 2) < 4 * a.single(32, 2)


def test_save_load_round_trip(tmp_path, quick_model):
    path = tmp_path / "sub" / "model.json"
    quick_model.save(path)
    loaded = CostModel.load(path)
    assert loaded.shape == quick_model.shape
    for name in ("lens", "batches", "ns", "single_ms", "batched_ms"):
        assert np.array_equal(getattr(loaded, name), getattr(quick_model, name)), name
    assert loaded.cache_key() == quick_model.cache_key()
    assert (loaded.device, loaded.source) == (quick_model.device, quick_model.source)
    assert loaded.single(37, 5) == quick_model.single(37, 5)
    assert [p.name for p in path.parent.iterdir()] == ["model.json"]  # no temp file left

    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version"):
        CostModel.load(path)


@pytest.fixture
def counted_measure(monkeypatch):
    """Replace the timer with a counter returning fake milliseconds."""
    calls = []

    def fake(fn, sync, timing):
        calls.append(1)
        return 0.1 * len(calls)

    monkeypatch.setattr(layer_cost, "_measure_ms", fake)
    return calls


def test_cache_hit_does_not_reprofile(tmp_path, counted_measure):
    first = CostModel.cached(TINY, device="cpu", cache_dir=tmp_path, quick=True)
    measured = len(counted_measure)
    assert measured == 9 + 27  # every quick grid point once
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"

    again = CostModel.cached(TINY, device="cpu", cache_dir=tmp_path, quick=True)
    assert len(counted_measure) == measured
    assert np.array_equal(again.single_ms, first.single_ms)

    # A different key (dtype, shape) is a different file.
    CostModel.cached(TINY, device="cpu", dtype=torch.float64, cache_dir=tmp_path, quick=True)
    CostModel.cached(LayerShape(32, 128, 2), device="cpu", cache_dir=tmp_path, quick=True)
    assert len(counted_measure) == 3 * measured
    assert len(list(tmp_path.iterdir())) == 3


def test_cache_reprofiles_a_corrupt_file(tmp_path, counted_measure):
    CostModel.cached(TINY, cache_dir=tmp_path, quick=True)
    (path,) = tmp_path.iterdir()
    path.write_text("{not json")
    measured = len(counted_measure)
    model = CostModel.cached(TINY, cache_dir=tmp_path, quick=True)
    assert len(counted_measure) == 2 * measured
    assert CostModel.load(path).single(4, 1) == model.single(4, 1)


def test_cache_dir_from_environment_at_call_time(tmp_path, monkeypatch, counted_measure):
    monkeypatch.setenv("ITIF_CACHE_DIR", str(tmp_path / "first"))
    CostModel.cached(TINY, quick=True)
    monkeypatch.setenv("ITIF_CACHE_DIR", str(tmp_path / "second"))
    CostModel.cached(TINY, quick=True)
    assert len(list((tmp_path / "first" / "costmodel").iterdir())) == 1
    assert len(list((tmp_path / "second" / "costmodel").iterdir())) == 1


def test_report_rows(quick_model):
    rows = quick_model.report([(8, 2), (20, 3)])
    assert [(r["seq_len"], r["batch"]) for r in rows] == [(8, 2), (20, 3)]
    for row in rows:
        assert set(row) == {"seq_len", "batch", "predicted_ms", "measured_ms", "rel_err"}
        assert row["predicted_ms"] > 0 and row["measured_ms"] > 0
        assert row["rel_err"] == pytest.approx(
            (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
        )
