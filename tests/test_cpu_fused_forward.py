"""The CPU forward of issue 65: oneDNN products with bias / activation / residual fused
(``itif/runtime/cpu_linear.py``), LayerNorm with gamma and beta per segment
(``reference._layernorm_segments``) and a classifier's last layer on its [CLS] rows only
(``forward._Rows``). Every path must answer as Hugging Face float32 does (1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import itif
from itif.ops import reference as ref
from itif.ops.reference import RotParam
from itif.runtime import cpu_linear, forward
from itif.runtime.gemm import Segments, plan_gemm
from tests.oracle import make_hf_model, reference

needs_onednn = pytest.mark.skipif(not cpu_linear.enabled(torch.float32),
                                  reason="PyTorch without oneDNN (mkldnn)")


def _segs(lengths, slots):
    ends = np.cumsum(lengths).tolist()
    return Segments(tuple([0] + ends[:-1]), tuple(ends), tuple(slots))


@needs_onednn
@pytest.mark.parametrize("act", ["none", "gelu", "gelu_new", "relu", "tanh"])
def test_linear_equals_torch_per_segment(act):
    gen = torch.Generator().manual_seed(0)
    segs = _segs([70, 130, 90], [2, 0, 2])
    plan = plan_gemm(segs, 290, torch.device("cpu"), torch.float32)
    x = torch.randn(290, 48, generator=gen)
    w = torch.randn(3, 40, 48, generator=gen) * 0.2
    b = torch.randn(4, 40, generator=gen)
    bslots = (1, 3, 0)  # the bias's own slots, not the weight's
    got = cpu_linear.linear(x, w, plan, b, bslots, act)
    fn = ref.activation(act)
    want = torch.cat([fn(x[s:e] @ w[k].T + b[bk])
                      for s, e, k, bk in zip(segs.start, segs.end, segs.slot, bslots)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if act == "none":
        r = torch.randn(290, 40, generator=gen)
        got = cpu_linear.linear(x, w, plan, b, bslots, residual=r)
        torch.testing.assert_close(got, want + r, rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="residual"):
            cpu_linear.linear(x, w, plan, b, bslots, act, residual=x)


@pytest.mark.skipif(not cpu_linear.enabled(torch.bfloat16), reason="no native bfloat16 oneDNN")
def test_bfloat16_product_rounds_once():
    """bfloat16: accumulated and GELU'd in float32, rounded once at the end (at most one
    bfloat16 step from the float32 result rounded, where MKL's mm then a bias pass round
    twice)."""
    gen = torch.Generator().manual_seed(1)
    plan = plan_gemm(_segs([300], [0]), 300, torch.device("cpu"), torch.bfloat16)
    x = torch.randn(300, 64, generator=gen).bfloat16()
    w = (torch.randn(1, 96, 64, generator=gen) * 0.2).bfloat16()
    b = torch.randn(1, 96, generator=gen).bfloat16()
    got = cpu_linear.linear(x, w, plan, b, None, "gelu")
    assert got.dtype == torch.bfloat16
    exact = F.gelu(x.float() @ w[0].float().T + b[0].float())
    step = exact.abs().clamp_min(1e-30) * 2.0 ** -7  # one bfloat16 ulp, at most
    assert bool(((got.float() - exact).abs() <= step + 1e-6).all())


def test_usable_only_for_long_segments_and_its_dtypes(monkeypatch):
    w = torch.zeros(2, 8, 8)
    m = cpu_linear.MIN_ROWS
    few = plan_gemm(_segs([m - 1, m - 1], [0, 1]), 2 * m - 2, torch.device("cpu"), torch.float32)
    many = plan_gemm(_segs([m, m], [0, 1]), 2 * m, torch.device("cpu"), torch.float32)
    assert not cpu_linear.usable(torch.zeros(2 * m - 2, 8), w, few)
    assert cpu_linear.usable(torch.zeros(2 * m, 8), w, many) == cpu_linear.enabled(torch.float32)
    assert not cpu_linear.usable(torch.zeros(2 * m, 8, dtype=torch.float16), w.half(), many)
    monkeypatch.setattr(cpu_linear, "_state", {})
    monkeypatch.setenv("ITIF_CPU_ONEDNN", "0")
    assert not cpu_linear.usable(torch.zeros(2 * m, 8), w, many)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_per_segment_equals_per_row(dtype):
    gen = torch.Generator().manual_seed(2)
    segs = _segs([5, 7, 4], [1, 0, 2])
    plan = plan_gemm(segs, 16, torch.device("cpu"), dtype)
    x = torch.randn(16, 32, generator=gen).to(dtype)
    g, b = (torch.randn(3, 32, generator=gen).to(dtype) for _ in range(2))
    slot = torch.repeat_interleave(torch.tensor(segs.slot),
                                   torch.tensor(segs.end) - torch.tensor(segs.start))
    got = ref.bias_residual_layernorm(x, None, None, RotParam(g, slot, plan),
                                      RotParam(b, slot, plan), 1e-12)
    want = (F.layer_norm(x.float(), (32,), eps=1e-12) * g[slot].float()
            + b[slot].float()).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # no plan (per-row values only): the per-row path, same answer
    plain = ref.bias_residual_layernorm(x, None, None, RotParam(g, slot), RotParam(b, slot), 1e-12)
    torch.testing.assert_close(plain, want, rtol=tol, atol=tol)


def _engine_and_models(tenants: int):
    models = {f"t{i}": make_hf_model("bert-tiny", 2 + i % 2, seed=300 + i) for i in range(tenants)}
    eng = itif.Engine("bert-tiny", device="cpu", dtype="float32")
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    return eng, models


def _requests(tenants: int, per_tenant: int, outputs, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [itif.Request(tenant=f"t{i % tenants}", outputs=outputs,
                         input_ids=rng.integers(0, 1000, int(rng.integers(20, 90))))
            for i in range(tenants * per_tenant)]


@pytest.mark.parametrize("tenants", [1, 3])
def test_engine_fused_and_cls_only_equal_hf(tenants, monkeypatch):
    """Long segments go through oneDNN; a logits-only batch runs its last layer's products on
    n rows (n requests), and answers equal Hugging Face float32 either way; a batch that wants
    the last hidden state runs every layer on all rows."""
    monkeypatch.setattr(cpu_linear, "MIN_ROWS", 64)  # this small batch's segments go to oneDNN
    eng, models = _engine_and_models(tenants)
    rows_seen: list[int] = []
    onednn_calls: list[int] = []
    out_norm, linear = forward._out_norm, cpu_linear.linear

    def spy_norm(d, x, *a, **k):
        rows_seen.append(x.shape[0])
        return out_norm(d, x, *a, **k)

    def spy_linear(x, *a, **k):
        onednn_calls.append(x.shape[0])
        return linear(x, *a, **k)

    monkeypatch.setattr(forward, "_out_norm", spy_norm)
    monkeypatch.setattr(cpu_linear, "linear", spy_linear)
    reqs = _requests(tenants, 4, ("logits",))
    T, n = sum(len(r.input_ids) for r in reqs), len(reqs)
    for res, req in zip(eng.infer(reqs), reqs):
        want = reference(models[req.tenant], req)["logits"]
        np.testing.assert_allclose(res.logits, want, rtol=0, atol=1e-4)
    layers = eng.spec.layers
    # two products with LayerNorm a layer; the last layer's on the [CLS] rows only
    assert rows_seen == [T] * (2 * layers - 2) + [n, n]
    if cpu_linear.enabled(torch.float32):
        assert T in onednn_calls

    rows_seen.clear()
    reqs = _requests(tenants, 2, ("logits", "last_hidden_state"), seed=1)
    T = sum(len(r.input_ids) for r in reqs)
    for res, req in zip(eng.infer(reqs), reqs):
        want = reference(models[req.tenant], req)
        np.testing.assert_allclose(res.logits, want["logits"], rtol=0, atol=1e-4)
        np.testing.assert_allclose(res.last_hidden_state, want["last_hidden_state"],
                                   rtol=0, atol=1e-4)
    assert rows_seen == [T] * (2 * layers)


def test_engine_without_onednn_still_equals_hf(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_state", {})
    monkeypatch.setenv("ITIF_CPU_ONEDNN", "0")
    called = []
    monkeypatch.setattr(cpu_linear, "linear", lambda *a, **k: called.append(1))
    eng, models = _engine_and_models(2)
    reqs = _requests(2, 3, ("logits",), seed=2)
    for res, req in zip(eng.infer(reqs), reqs):
        np.testing.assert_allclose(res.logits, reference(models[req.tenant], req)["logits"],
                                   rtol=0, atol=1e-4)
    assert not called
