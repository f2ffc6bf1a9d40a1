"""Whole-batch cost model (itif.calibration.batch_cost): predictions against measured forwards.

Everything runs at one torch thread, where ``batch_cost.clock`` is the calling thread's CPU time:
on the shared 2-core CI machine wall times of the same forward moved by 2-10x from minute to
minute (other jobs; a descheduled OpenMP thread stalls a parallel op for a whole time slice),
while thread CPU time moved by about 10-20 %.

Bounds, from measurements on that machine (bert-tiny, 1 thread, best of 7 rounds): on ``itif
plan``'s three workloads x five strategies the error was within +-8 % on a quiet machine; on
the three layouts below -1 .. -10 %. Under heavy load from other jobs even thread CPU time
rose by up to 60 % (measured 12 -> 20 ms for one layout), moving every layout together. So:

* the drift common to all layouts (geometric mean of predicted / measured) is within 1.6x;
* after removing it, each layout's error is within 15 %;
* a predictor that prices every GEMM as one ``mm`` over its rows, whatever the backend, misses
  by more than 15 % on some layout whatever common factor it is given (measured: 26-40 % on
  the 128-segment ``loop`` and the ``bmm`` layouts; asserted, so the bound means something).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import itif
from itif.backbones.random import random_weights
from itif.batching.layout import SINGLE_GEMM, build_layout, layout_packed, layout_pad_to_max
from itif.calibration.batch_cost import (
    BatchCostModel,
    measure_layout,
    prepare_for,
    structure_of_batch,
    structure_of_layout,
)
from itif.runtime import cpu_gemm, cpu_linear

TENANTS = 32
ABS_BOUND = 0.60
REL_BOUND = 0.15


@pytest.fixture(scope="module", autouse=True)
def mkl_only():
    """The tests below are about MKL's backends (grouped_mm, bmm, loop): the CPU few-rows kernel
    would take these 4-16-row segments, so it stays off in this thread, except where a test
    turns it back on (``test_the_cpu_kernel_is_priced_as_it_runs``)."""
    with cpu_gemm.suspended(), cpu_linear.suspended():  # oneDNN's products: not calibrated
        yield


@pytest.fixture(scope="module")
def setup(mkl_only):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = itif.Engine("bert-tiny")
        for i in range(TENANTS):
            eng.add_tenant(f"t{i}", random_weights(eng.spec, num_labels=2, seed=i))
        model = BatchCostModel.profile(eng, passes=2)
        rng = np.random.default_rng(7)
        tenant = np.repeat(np.arange(TENANTS, dtype=np.int32), 4)
        length = rng.integers(4, 17, tenant.size).astype(np.int32)
        reqs = [itif.Request(f"t{t}", rng.integers(0, 1000, int(n)))
                for t, n in zip(tenant, length)]
        layouts = _layouts(tenant, length)
        yield eng, model, reqs, layouts
    finally:
        torch.set_num_threads(before)


def _layouts(tenant, length):
    """Three ways to run the same 128 requests of 32 tenants, one per GEMM backend."""
    packed = layout_packed(tenant, length)  # unequal per-tenant segments: grouped_mm
    padded = layout_pad_to_max(tenant, length)  # 4 x 16 rows per tenant, slots 0..31: bmm
    # 4 mini-batches, each one request of every tenant: tenants repeat -> 128 segments, loop.
    idx = np.arange(tenant.size).reshape(TENANTS, 4)
    members = [idx[:, k] for k in range(4)]
    interleaved = build_layout(
        "interleaved", tenant, length, members,
        np.array([length[m].max() for m in members], np.int32), np.arange(4, dtype=np.int32),
        np.full(4, SINGLE_GEMM, np.int8))
    return {"packed": packed, "padded": padded, "interleaved": interleaved}


def _measure(eng, reqs, layouts, rounds=15):
    """Best of ``rounds``, the layouts taking turns (so load from other work hits them alike)."""
    best = {k: float("inf") for k in layouts}
    for r in range(rounds):
        for k, lay in layouts.items():
            best[k] = min(best[k], measure_layout(eng, reqs, lay, repeats=1, warmup=r == 0))
    return best


class BackendBlind(BatchCostModel):
    """Deliberately wrong: prices every GEMM as one ``mm`` over all its rows, whatever backend
    the runtime picks (what the layer cost model did, up to calibration)."""

    def components(self, s):
        from dataclasses import replace

        from itif.runtime.gemm import GemmPlan, Segments

        def mm(p):
            return GemmPlan("mm", Segments((0,), (p.rows,), (0,)), p.rows)

        layers = [{k: mm(p) for k, p in d.items()} for d in s.layer_plans]
        return super().components(replace(s, layer_plans=layers))


def test_backends_are_the_ones_meant(setup):
    eng, _, reqs, layouts = setup
    want = {"packed": "grouped_mm", "padded": "bmm", "interleaved": "loop"}
    for k, lay in layouts.items():
        b = prepare_for(eng, reqs, lay)
        backends = {p.backend for d in structure_of_batch(b).layer_plans for p in d.values()}
        assert backends == {want[k]}, (k, backends)
    # The layout-only structure agrees with the engine's prepare for full fine-tunes.
    _, model, _, _ = setup
    for k, lay in layouts.items():
        exact = model.raw(structure_of_batch(prepare_for(eng, reqs, lay)))
        approx = model.raw(structure_of_layout(lay, eng.spec.layers))
        assert abs(exact - approx) <= 0.05 * exact + 0.05, (k, exact, approx)


def _drift(pred, measured):
    """Geometric mean of predicted / measured: the error common to every layout (the load on
    the machine now versus during calibration moves all of them together)."""
    return float(np.exp(np.mean([np.log(pred[k] / measured[k]) for k in measured])))


def _retried(attempt, tries: int = 3) -> list[dict]:
    """Calls ``attempt(n)`` for n = 0, 1, ... until one returns ``ok``, at most ``tries`` times, and
    returns them all. A burst of load from other jobs between a calibration and a measurement
    skews single points, so each retry passes a fresh calibration."""
    attempts: list[dict] = []
    while not (attempts and attempts[-1]["ok"]) and len(attempts) < tries:
        attempts.append(attempt(len(attempts)))
    return attempts


def _attempt(eng, model, reqs, layouts) -> dict:
    """One calibration checked against one measurement: both predictors' errors per layout."""
    measured = _measure(eng, reqs, layouts)
    blind = BackendBlind(model.meta, model.t)
    pred = {k: model.predict_batch(lay, prepare_for(eng, reqs, lay), key=())
            for k, lay in layouts.items()}
    wrong = {k: blind.predict_batch(lay, prepare_for(eng, reqs, lay), key=())
             for k, lay in layouts.items()}
    drift, wrong_drift = _drift(pred, measured), _drift(wrong, measured)
    err = {k: pred[k] / measured[k] / drift - 1 for k in layouts}
    wrong_err = {k: wrong[k] / measured[k] / wrong_drift - 1 for k in layouts}
    ok = (1 / (1 + ABS_BOUND) <= drift <= 1 + ABS_BOUND
          and all(abs(e) <= REL_BOUND for e in err.values())
          # the deliberately wrong predictor cannot be made to fit by any common factor
          and max(abs(e) for e in wrong_err.values()) > REL_BOUND)
    return dict(ok=ok, measured=measured, predicted=pred, blind=wrong, drift=drift, err=err,
                blind_err=wrong_err)


def test_prediction_error_and_a_backend_blind_predictor_fails(setup):
    """Within one attempt (a calibration, then the three layouts measured in turns), the model's
    per-layout error is within REL_BOUND after the common drift, and the backend-blind predictor's
    is not. A burst of load from other jobs between calibration and measurement skews single
    points (CI once measured 15.7 % on one layout), so a failed attempt is re-run from a fresh
    calibration, at most three times; every attempt must keep the blind predictor failing, so
    the bound keeps its teeth."""
    eng, model, reqs, layouts = setup
    attempts = _retried(lambda n: _attempt(
        eng, BatchCostModel.profile(eng, passes=2) if n else model, reqs, layouts))
    assert attempts[-1]["ok"], attempts
    for a in attempts:
        assert max(abs(e) for e in a["blind_err"].values()) > REL_BOUND, attempts


def test_ranking_matches_on_a_clear_case(setup):
    """Every pair of layouts whose measured times differ clearly (by > 25 %) is ordered alike by
    the predictions; the loop layout (128 GEMM launches per linear) is such a case against the
    packed one. (packed vs padded is a near tie here: not asserted either way.)"""
    eng, model, reqs, layouts = setup
    measured = _measure(eng, reqs, layouts)
    pred = {k: model.predict_batch(lay, prepare_for(eng, reqs, lay), key=())
            for k, lay in layouts.items()}
    clear = [(a, b) for a in layouts for b in layouts if measured[b] > 1.25 * measured[a]]
    assert ("packed", "interleaved") in clear, measured
    for a, b in clear:
        assert pred[a] < pred[b], (a, b, pred, measured)


def test_online_correction_moves_predictions_toward_measurements(setup):
    eng, model, reqs, layouts = setup
    m = BatchCostModel(model.meta, model.t)  # fresh ratios
    lay = layouts["interleaved"]
    b = prepare_for(eng, reqs, lay)
    key = m.key_of(lay)
    raw = m.raw(structure_of_batch(b))
    assert m.predict_batch(lay, b) == pytest.approx(raw)
    # A machine 1.6x slower than calibrated: every observation pulls the prediction closer.
    truth = 1.6 * raw
    gap = abs(raw - truth)
    m.observe(raw, truth, key)
    assert abs(m.predict_batch(lay, b) - truth) < 0.01 * truth  # first observation sets it
    m.observe(raw, 1.2 * raw, key)  # then an exponentially weighted average
    after = m.predict_batch(lay, b)
    assert 1.2 * raw < after < 1.6 * raw
    for _ in range(20):
        m.observe(raw, 1.2 * raw, key)
    assert abs(m.predict_batch(lay, b) - 1.2 * raw) < 0.02 * raw < gap
    # Other keys are untouched; one wild sample is clipped.
    other = layouts["packed"]
    assert m.predict_batch(other, key=("x",)) == pytest.approx(m.raw(structure_of_layout(
        other, eng.spec.layers)))
    m.observe(raw, 1000 * raw, ("wild",))
    assert m.ratio(("wild",)) == 4.0
    # With a real measurement: the corrected prediction is closer than the raw one.
    real = measure_layout(eng, reqs, lay, repeats=3)
    m2 = BatchCostModel(model.meta, model.t)
    m2.observe(raw, real, key)
    assert abs(m2.predict_batch(lay, b) - real) <= abs(raw - real) + 1e-9


def test_save_load_roundtrip(setup, tmp_path):
    _, model, _, layouts = setup
    path = tmp_path / "bc.json"
    model.save(path)
    again = BatchCostModel.load(path)
    lay = layouts["packed"]
    assert again.predict_batch(lay) == pytest.approx(model.predict_batch(lay))



def test_attention_beyond_the_grid_is_priced_superlinearly(setup):
    """Past the attention grid's last length (512 now; it was 256, under bert's 512) a doubled
    sequence costs between 2x (row-wise work) and 4x (the score matrix), measured nearer 4x on
    this CPU (bert-small, one thread, 256 -> 512: 3.9x; bert-tiny 3.8x). Proportional
    extrapolation priced it at 2x, so ``itif plan`` under-predicted long sequences; a fit of
    c1*L + c2*L^2 through the last two grid lengths is used instead. Checked as a growth ratio
    against the two lengths measured in turns (load on the machine moves both alike). The
    prediction comes from the calibration's 256 and 512 points, timed earlier: a CI run whose
    calibration read 256 -> 512 as 2.65x (3.43-3.46x here) predicted 2.49x against 3.42x
    measured, so a failed attempt re-calibrates, at most three times, as above."""
    from itif.calibration.batch_timing import measure_ms
    from itif.ops import dispatch as ops
    from itif.ops.reference import AttnGroup
    from itif.runtime.batch import AttnSpec

    eng, first, _, _ = setup
    H, heads = eng.spec.hidden, eng.spec.heads

    def attempt(n: int) -> dict:
        model = BatchCostModel.profile(eng, passes=2) if n else first
        top = int(model.grids["att_lens"][-1])
        best = {}
        for _ in range(5):
            for L in (top, 2 * top):
                qkv, out = torch.randn(L, 3 * H), torch.empty(L, H)
                g = AttnGroup(n=1, L=L, start=0, key_mask=None)
                t = measure_ms(lambda: ops.attention(qkv, [g], heads, out))
                best[L] = min(best.get(L, t), t)
        grown = best[2 * top] / best[top]
        predicted = model.attn_ms(AttnSpec(n=1, L=2 * top)) / model.attn_ms(AttnSpec(n=1, L=top))
        assert 2.0 < predicted <= 4.0 + 1e-9, predicted
        # proportional pricing (2x) would be more than 23 % off a growth over 2.6
        return dict(ok=grown > 2.6 and abs(predicted / grown - 1) < 0.25,
                    measured_growth=grown, predicted_growth=predicted, best_ms=best)

    attempts = _retried(attempt)
    detail = attempts[-1]
    assert detail["measured_growth"] > 2.6, attempts
    assert abs(detail["predicted_growth"] / detail["measured_growth"] - 1) < 0.25, attempts


def test_the_cpu_kernel_is_priced_as_it_runs(setup):
    """With the CPU few-rows kernel on (the default on an AVX2 CPU, ``itif.runtime.cpu_gemm``),
    every GEMM of the three layouts runs in it (segments of 4-16 rows, one call each, whatever
    the plan's backend): a model calibrated with the kernel prices them there, and predicts
    each layout within REL_BOUND after the common drift (a failed attempt re-calibrates, at most
    three times, as above)."""
    assert cpu_gemm.ensure(), cpu_gemm.state["why_not"]
    eng, _, reqs, layouts = setup

    def attempt(_n: int) -> dict:
        model = BatchCostModel.profile(eng, passes=2)
        assert "kernel" in model.t
        parts = {k: model.components(structure_of_batch(prepare_for(eng, reqs, lay)))
                 for k, lay in layouts.items()}
        for k, c in parts.items():  # all of the GEMM time on the kernel
            assert c["gemm_cpu_kernel"] > 0, (k, c)
            others = (c["gemm_mm"], c["gemm_bmm"], c["gemm_grouped_mm"], c["gemm_loop"])
            assert others == (0.0, 0.0, 0.0, 0.0), (k, c)
        measured = _measure(eng, reqs, layouts)
        pred = {k: model.predict_batch(lay, prepare_for(eng, reqs, lay), key=())
                for k, lay in layouts.items()}
        drift = _drift(pred, measured)
        err = {k: pred[k] / measured[k] / drift - 1 for k in layouts}
        return dict(ok=(1 / (1 + ABS_BOUND) <= drift <= 1 + ABS_BOUND
                        and all(abs(e) <= REL_BOUND for e in err.values())),
                    measured=measured, predicted=pred, drift=drift, err=err)

    with cpu_gemm.suspended(False):
        attempts = _retried(attempt)
    assert attempts[-1]["ok"], attempts


def test_the_overhead_fit_caps_what_it_charges_a_launch():
    from itif.calibration.batch_cost import _LAUNCH_CAP_MS, _overhead_coefficients

    rng = np.random.default_rng(0)
    n = 30
    rows, reqs = rng.integers(100, 5000, n), rng.integers(4, 128, n)
    loops, groups = rng.integers(0, 3000, n), rng.integers(0, 100, n)
    X = np.stack([np.ones(n), rows, reqs, loops, groups], axis=1).astype(float)
    w = np.full(n, 1.0)
    # a plausible remainder: 2 ms fixed, 2 us a launch -- recovered as it is
    quiet = _overhead_coefficients(X, 2.0 + 0.002 * loops, w)
    assert quiet[0] == pytest.approx(2.0, abs=1e-6) and quiet[3] == pytest.approx(0.002, abs=1e-6)
    # drift that happens to follow the launch count: 150 us a launch is not believed; the
    # launch term stops at the cap and the other terms take up what they can
    drift = _overhead_coefficients(X, 5.0 + 0.15 * loops, w)
    assert drift[3] == pytest.approx(_LAUNCH_CAP_MS) and drift[4] <= _LAUNCH_CAP_MS
    assert all(c >= 0 for c in drift) and drift[0] > 5.0
