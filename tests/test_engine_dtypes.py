"""The fused engine in reduced precision (bfloat16, float16) against Hugging Face float32.

Tolerance, per dtype and depth. A dtype with ``p`` significand bits (bfloat16 8, float16 11)
rounds each value with a relative error uniform in +-u, ``u = 2**-p`` (bf16 3.9e-3, fp16
4.9e-4): RMS ``u/sqrt(3)``. On its way to the output a value goes through about ``n`` such
roundings: 6 for the embeddings (three table reads, their sum, LayerNorm) and the pooler/head,
14 per encoder layer (qkv, scores, probabilities, context, attn_out, LN1, ffn_in, activation,
ffn_out, LN2, and its four weight matrices), 2 more for ALBERT's embedding projection.
Independent errors add in quadrature and LayerNorm keeps activations at unit scale, so the
relative-norm error of an output is about ``u/sqrt(3) * sqrt(n)``; the bound is 1.5x that:
bf16 ~2.0e-2 for 2-layer BERT/ViT tiny, 2.4e-2 for 3-layer ALBERT tiny, 2.7e-2 for 4 layers.

Checks per request and output: ``||out - ref|| / ||ref|| <= rel_tol`` (last_hidden_state,
pooled), the same per token row of last_hidden_state within ``1.5 * rel_tol`` (a norm over
only ``hidden`` values, the worst of up to 128 rows, spreads wider), ``max|out - ref| <=
2 * rel_tol * max|ref|`` (a single bad element), and for
logits ``|out_j - ref_j| <= rel_tol * (||W_j|| ||h|| + |b_j|)``: a logit is a dot product
that often cancels to near zero, so its error scales with its inputs, not with its own size
(per-request relative norms of 2-5 logits reach 8e-2 for Hugging Face's *own* bf16 model).
Each test also runs the same comparison against another tenant's reference and requires it
to fail, so the tolerances discriminate (a wrong tenant is off by ~100 % relative norm).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import itif
from itif.backbones.spec import PRESETS
from tests.oracle import (
    make_hf_model,
    precision_errors,
    random_request,
    reference,
    reference_on_device,
)

FAMILIES = ["bert-tiny", "albert-tiny", "vit-tiny"]
# A meaningful but quick GPU model: no preset sits between tiny and base.
BERT_SMALL = replace(PRESETS["bert-tiny"], hidden=256, layers=4, heads=4, intermediate=1024,
                     name="bert-small-test")
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}
LOGITS_ATOL_GPU = 1e-2  # the product's bar: fp16/bf16 logits within 1e-2 of HF float32
OUTPUTS_TEXT = ("logits", "pooled", "last_hidden_state")
OUTPUTS_VIT = ("logits", "last_hidden_state")


def roundings(spec) -> int:
    return 6 + 14 * spec.layers + (2 if spec.family == "albert" else 0)


def rel_tol(dtype: torch.dtype, spec) -> float:
    u = 2.0 ** -SIGNIFICAND_BITS[dtype]
    return 1.5 * u / math.sqrt(3) * math.sqrt(roundings(spec))


def violations(errs: dict[str, dict], tol: float, logits_atol: float | None = None) -> list[str]:
    """Which of one request's checks fail (empty: all pass)."""
    bad = []
    for name, e in errs.items():
        if name == "logits":
            if e["abs_scaled"] > tol:
                bad.append(
                    f"logits: abs err / (|W_j| |h| + |b_j|) {e['abs_scaled']:.3g} > {tol:.3g}"
                )
            if logits_atol is not None and e["abs"] > logits_atol:
                bad.append(f"logits: max abs {e['abs']:.3g} > {logits_atol:.3g}")
            continue
        if e["rel"] > tol:
            bad.append(f"{name}: rel norm {e['rel']:.3g} > {tol:.3g}")
        if e["abs_scaled"] > 2 * tol:
            bad.append(f"{name}: max abs / max|ref| {e['abs_scaled']:.3g} > {2 * tol:.3g}")
        if e.get("row_rel", 0.0) > 1.5 * tol:
            bad.append(f"{name}: worst row's rel norm {e['row_rel']:.3g} > {1.5 * tol:.3g}")
    return bad


def _tenants(spec_or_preset, device: str | None = None) -> dict:
    """Four distinct random models; tenants i and i+2 share a label count so a wrong tenant's
    logits can be compared too."""
    models = {f"t{i}": make_hf_model(spec_or_preset, 2 + i % 2, seed=200 + i) for i in range(4)}
    if device is not None:
        models = {n: m.to(device) for n, m in models.items()}
    return models


def _requests(spec, names: list[str], rng: np.random.Generator) -> list[itif.Request]:
    if not spec.is_text:
        return [random_request(spec, names[i % len(names)], rng, outputs=OUTPUTS_VIT)
                for i in range(2 * len(names))]
    lengths = [1, spec.max_position, 7, 33, 64, 100, 2, 19, 120, 50, 12, 90]
    return [random_request(spec, names[i % len(names)], rng, length=n, outputs=OUTPUTS_TEXT)
            for i, n in enumerate(lengths)]


def _wrong(name: str) -> str:
    return f"t{(int(name[1:]) + 2) % 4}"


def _check_dtype(spec, dtype_name: str, device: str, ref_fn, logits_atol=None, models=None):
    """Run a mixed batch in ``dtype_name``; every request within tolerance of its own tenant's
    HF float32 reference and outside it for another tenant's. Returns the worst figures."""
    dtype = getattr(torch, dtype_name)
    tol = rel_tol(dtype, spec)
    models = models or _tenants(spec)
    eng = itif.Engine(spec, device=device, dtype=dtype_name)
    assert eng.dtype == dtype
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    rng = np.random.default_rng(SIGNIFICAND_BITS[dtype] * 1000 + spec.layers)
    reqs = _requests(spec, list(models), rng)
    results = eng.infer(reqs)
    worst: dict[tuple[str, str], float] = {}
    failures = []
    for i, (res, req) in enumerate(zip(results, reqs)):
        assert res.tenant == req.tenant
        for name in req.outputs:
            assert getattr(res, name) is not None and np.isfinite(getattr(res, name)).all(), (
                i,
                name,
            )
        model = models[req.tenant]
        errs = precision_errors(res, ref_fn(model, req), model)
        assert set(errs) == set(req.outputs), (i, sorted(errs))
        for out, e in errs.items():
            for k, v in e.items():
                worst[(out, k)] = max(worst.get((out, k), 0.0), v)
        bad = violations(errs, tol, logits_atol)
        if bad:
            failures.append(f"request {i} ({req.tenant}, {len(res.last_hidden_state)} rows): "
                            + "; ".join(bad))
        # The same comparison against another tenant's reference must fail.
        other = models[_wrong(req.tenant)]
        wrong_errs = precision_errors(res, ref_fn(other, req), other)
        assert violations(wrong_errs, tol, logits_atol), (
            f"request {i}: tolerance {tol:.3g} does not tell {req.tenant} from {_wrong(req.tenant)}"
        )
        assert min(e["rel"] for n, e in wrong_errs.items() if n != "logits") > 10 * tol
    summary = (f"{spec.name} {dtype_name} on {device} (rel_tol {tol:.3g}) worst: "
               + ", ".join(f"{o}.{k} {v:.3g}" for (o, k), v in sorted(worst.items())))
    print(summary)  # the figures, with -s
    assert not failures, summary + "\n" + "\n".join(failures)
    return worst


# ---- CPU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_reduced_precision_cpu_equals_hf_float32(preset, dtype):
    _check_dtype(PRESETS[preset], dtype, "cpu", reference)


def test_tolerances_pinned():
    """The derived bounds, pinned: a formula change that loosens them shows up here."""
    assert rel_tol(torch.bfloat16, PRESETS["bert-tiny"]) == pytest.approx(1.97e-2, rel=1e-2)
    assert rel_tol(torch.bfloat16, PRESETS["albert-tiny"]) == pytest.approx(2.39e-2, rel=1e-2)
    assert rel_tol(torch.bfloat16, BERT_SMALL) == pytest.approx(2.66e-2, rel=1e-2)
    assert rel_tol(torch.float16, PRESETS["bert-tiny"]) == pytest.approx(2.46e-3, rel=1e-2)


def test_float32_engine_fails_nothing_and_a_perturbed_one_fails():
    """The checker on known answers: float32 passes the bf16 bound a hundredfold; one element
    off by 10 % of the output's range, which the relative norm over the whole output barely
    sees, fails the max-abs bound; one token row replaced by its neighbour fails too."""
    spec = PRESETS["bert-tiny"]
    models = _tenants("bert-tiny")
    eng = itif.Engine("bert-tiny")
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    req = random_request(spec, "t0", np.random.default_rng(5), length=128, outputs=OUTPUTS_TEXT)
    res = eng.infer([req])[0]
    ref = reference(models["t0"], req)
    tol = rel_tol(torch.bfloat16, spec)
    assert not violations(precision_errors(res, ref, models["t0"]), tol / 100)
    good = res.last_hidden_state
    res.last_hidden_state = good.copy()
    res.last_hidden_state[5, 3] += 0.1 * np.abs(ref["last_hidden_state"]).max()
    errs = precision_errors(res, ref, models["t0"])
    assert errs["last_hidden_state"]["rel"] < tol / 2  # diluted over 128 x 64 values...
    assert violations(errs, tol)  # ...but caught
    res.last_hidden_state = good.copy()
    res.last_hidden_state[5] = good[6]
    assert violations(precision_errors(res, ref, models["t0"]), tol)


# ---- GPU -------------------------------------------------------------------------------------
@pytest.fixture
def exact_float32_cuda():
    """HF float32 on the GPU as the reference: no TF32 in its matmuls or ViT's patch conv."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("preset", FAMILIES + ["bert-small"])
def test_reduced_precision_cuda_logits_within_1e2(preset, dtype, exact_float32_cuda):
    spec = BERT_SMALL if preset == "bert-small" else PRESETS[preset]
    _check_dtype(spec, dtype, "cuda", reference_on_device, logits_atol=LOGITS_ATOL_GPU,
                 models=_tenants(spec, "cuda"))


def _same(a: list[itif.Result], b: list[itif.Result]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        dx, dy = x.as_dict(), y.as_dict()
        assert dx.keys() == dy.keys(), i
        for k in dx:
            np.testing.assert_array_equal(dx[k], dy[k], err_msg=f"request {i} {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_cuda_graphs_bit_identical_to_eager(preset, dtype):
    spec = PRESETS[preset]
    models = _tenants(preset)
    eng = itif.Engine(preset, device="cuda", dtype=dtype, cuda_graphs="on")
    assert eng.cuda_graphs is True
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    rng = np.random.default_rng(11)
    names = ["t0", "t1", "t2"]
    lengths = [5, 17, 17, 40, 3, 64]  # equal lengths too: dense mini-batches as well as packed
    outs = OUTPUTS_TEXT if spec.is_text else OUTPUTS_VIT

    def batch():
        return [random_request(spec, names[i % 3], rng, length=n, outputs=outs)
                for i, n in enumerate(lengths)]

    # The graph cache's counters (engine internals) show the graphs really ran, so the test
    # cannot pass by everything silently running eagerly.
    cache = getattr(eng, "_graphs", None)
    replays = lambda: getattr(cache, "replays", None)  # noqa: E731

    def both(reqs):
        eng.cuda_graphs = True
        before = replays()
        on = eng.infer(reqs)
        on_again = eng.infer(reqs)  # a replay of what the first call captured
        if before is not None:
            assert replays() >= before + 2, ("cuda_graphs on, but no graph was replayed "
                                             "(capture failed? see the itif.graphs warning)")
        eng.cuda_graphs = False
        off = eng.infer(reqs)
        eng.cuda_graphs = True
        _same(on, off)
        _same(on_again, off)
        return on

    first_reqs = batch()
    first = both(first_reqs)
    # Same shapes and tenants, new inputs: a replay must read them, not the captured ones.
    second_reqs = batch()
    for a, b in zip(first_reqs, second_reqs):
        assert a.tenant == b.tenant and eng.request_tokens(a) == eng.request_tokens(b)
    second = both(second_reqs)
    assert not np.array_equal(first[0].last_hidden_state, second[0].last_hidden_state)
    # The weight store changes (a new tenant; may grow its buffers): same shapes again.
    eng.add_tenant("t3", models["t3"].state_dict())
    both(second_reqs)
    # Weights replaced under the same name and shapes: a stale graph would read the old slot.
    eng.add_tenant("t1", models["t3"].state_dict())
    swapped = both(second_reqs)
    for i, req in enumerate(second_reqs):
        if req.tenant == "t1":
            assert not np.array_equal(swapped[i].last_hidden_state, second[i].last_hidden_state)
    # A batch with the new tenant.
    both([random_request(spec, t, rng, length=n, outputs=outs)
          for t, n in zip(["t3", "t0", "t3", "t2"], [9, 9, 30, 2])])
