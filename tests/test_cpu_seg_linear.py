"""The CPU's one-region segment linear (``kernels/seg_linear_cpu.cpp`` through
``itif.runtime.cpu_linear``, issue 65): every segment's oneDNN product, and the LayerNorm after
it, in one parallel region, chunk by chunk, written in place. It must answer exactly as a call
per segment and a concatenation did (the same primitive on the same rows), never concatenate,
and carry LayerNorm inside the post-LN encoder's residual products."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import itif
from itif.ops import dispatch as ops
from itif.ops.reference import RotParam
from itif.runtime import cpu_linear
from itif.runtime.gemm import Segments, plan_gemm
from tests.oracle import make_hf_model, reference

pytestmark = pytest.mark.skipif(not cpu_linear.enabled(torch.float32),
                                reason="PyTorch without oneDNN (mkldnn)")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_linear.ensure(), cpu_linear.seg_state["why_not"]


def _plan(lengths, slots, dtype=torch.float32):
    ends = np.cumsum(lengths).tolist()
    segs = Segments(tuple([0] + ends[:-1]), tuple(ends), tuple(slots))
    return plan_gemm(segs, ends[-1], torch.device("cpu"), dtype)


def _operands(rows, K, N, cap, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    w = (torch.randn(cap, N, K, generator=gen) * 0.2).to(dtype)
    b = torch.randn(cap + 1, N, generator=gen).to(dtype)
    return x, w, b


# segments longer than a chunk (cut in equal pieces), shorter, and a slot used twice
LENGTHS, SLOTS = [3 * cpu_linear.CHUNK + 17, 40, cpu_linear.CHUNK, 1], [2, 0, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["none", "gelu", "gelu_new", "residual"])
def test_one_region_equals_a_call_per_segment(dtype, act):
    if not cpu_linear.enabled(dtype):
        pytest.skip("no native bfloat16 oneDNN here")
    plan = _plan(LENGTHS, SLOTS, dtype)
    x, w, b = _operands(plan.rows, 64, 96, 3, dtype, 0)
    bslots = (3, 1, 0, 2)  # the bias's own slots
    res = torch.randn(plan.rows, 96).to(dtype) if act == "residual" else None
    a = "none" if act == "residual" else act
    got = cpu_linear.linear(x, w, plan, b, bslots, a, res)
    with cpu_linear.seg_suspended():
        want = cpu_linear.linear(x, w, plan, b, bslots, a, res)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_inside_equals_after(dtype):
    if not cpu_linear.enabled(dtype):
        pytest.skip("no native bfloat16 oneDNN here")
    plan = _plan(LENGTHS, SLOTS, dtype)
    x, w, b = _operands(plan.rows, 64, 96, 3, dtype, 1)
    res = torch.randn(plan.rows, 96).to(dtype)
    g, be = (torch.randn(4, 96).to(dtype) for _ in range(2))
    gs, bs = (1, 3, 0, 2), (0, 0, 3, 1)
    got = cpu_linear.linear(x, w, plan, b, None, "none", res, (g, gs, be, bs), 1e-5)
    with cpu_linear.seg_suspended():
        h = cpu_linear.linear(x, w, plan, b, None, "none", res)
    segs = plan.segs
    want = torch.cat([F.layer_norm(h[s:e], (96,), g[kg], be[kb], 1e-5)
                      for s, e, kg, kb in zip(segs.start, segs.end, gs, bs)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_alone_equals_a_call_per_segment(dtype):
    if not cpu_linear.enabled(dtype):
        pytest.skip("no native bfloat16 oneDNN here")
    plan = _plan(LENGTHS, SLOTS, dtype)
    x = torch.randn(plan.rows, 96).to(dtype)
    g, be = (torch.randn(4, 96).to(dtype) for _ in range(2))
    gs, bs = (1, 3, 0, 2), (0, 0, 3, 1)
    got = cpu_linear.layer_norm(x, plan, (g, gs, be, bs), 1e-12)
    segs = plan.segs
    want = torch.cat([F.layer_norm(x[s:e], (96,), g[kg], be[kb], 1e-12)
                      for s, e, kg, kb in zip(segs.start, segs.end, gs, bs)])
    assert torch.equal(got, want)


def test_eight_segments_never_concatenate(monkeypatch):
    """The point of the kernel: no ``torch.cat`` of the segments' outputs (a call per segment
    and a cat cost 4x on the 2 shared vCPUs, see cpu_linear's docstring)."""
    plan = _plan([300 + 7 * i for i in range(8)], list(range(8)))
    x, w, b = _operands(plan.rows, 32, 48, 8, torch.float32, 2)
    with cpu_linear.seg_suspended():
        want = cpu_linear.linear(x, w, plan, b, None, "gelu")

    def no_cat(*a, **k):
        raise AssertionError("torch.cat called")

    monkeypatch.setattr(torch, "cat", no_cat)
    assert torch.equal(cpu_linear.linear(x, w, plan, b, None, "gelu"), want)


def test_errors_inside_the_region_reach_the_caller():
    plan = _plan([600, 600], [0, 1])
    x, w, b = _operands(plan.rows, 32, 48, 2, torch.float32, 3)
    g = torch.ones(2, 47)  # LayerNorm over 47 features of a 48-wide output
    with pytest.raises(RuntimeError):
        cpu_linear.linear(x, w, plan, b, None, "none", torch.zeros(plan.rows, 48),
                          (g, (0, 1), g, (0, 1)))


def test_norm_args_only_where_layernorm_follows_the_segments():
    plan = _plan([500, 700], [0, 1])
    rows = torch.zeros(plan.rows, dtype=torch.long)
    g = torch.ones(2, 8)
    same = RotParam(g, rows, _plan([500, 700], [1, 0]))
    shared = RotParam(g, rows, _plan([1200], [0]))  # one LayerNorm for both tenants
    assert cpu_linear.norm_args(plan, same, same, torch.float32) == (g, (1, 0), g, (1, 0))
    assert cpu_linear.norm_args(plan, same, shared, torch.float32) is None
    assert cpu_linear.norm_args(plan, same, same, torch.bfloat16) is None
    with cpu_linear.seg_suspended():
        assert cpu_linear.norm_args(plan, same, same, torch.float32) is None
    # one segment: in the kernel only as one chunk (a longer one is one multi-threaded call)
    for rows, inside in ((cpu_linear.CHUNK, True), (cpu_linear.CHUNK + 1, False)):
        one = _plan([rows], [0])
        p = RotParam(g, torch.zeros(rows, dtype=torch.long), one)
        assert (cpu_linear.norm_args(one, p, p, torch.float32) is not None) == inside


def test_one_segment_goes_to_onednn_as_one_chunk_or_long():
    """A 1-tenant [CLS]-rows layer (128-256 rows) runs as one chunk on the calling thread; one
    segment between a chunk and MIN_ROWS stays with run_gemm, as before the kernel."""
    w = torch.zeros(1, 8, 8)
    for rows, want in ((cpu_linear.ONE_CHUNK_MIN_ROWS - 1, False),
                       (cpu_linear.ONE_CHUNK_MIN_ROWS, True), (cpu_linear.CHUNK, True),
                       (cpu_linear.CHUNK + 1, False), (cpu_linear.MIN_ROWS, True)):
        plan = _plan([rows], [0])
        assert cpu_linear.usable(torch.zeros(rows, 8), w, plan) == want, rows
        with cpu_linear.seg_suspended():
            assert cpu_linear.usable(torch.zeros(rows, 8), w, plan) == (
                rows >= cpu_linear.MIN_ROWS)


def test_engine_runs_layernorm_inside_and_equals_hf(monkeypatch):
    """A 3-tenant post-LN forward: every LayerNorm runs in the kernel (the residual products'
    inside them, the embeddings' alone), and the answers equal HF float32."""
    monkeypatch.setattr(cpu_linear, "MIN_ROWS", 64)  # this small batch's segments qualify
    models = {f"t{i}": make_hf_model("bert-tiny", 2, seed=500 + i) for i in range(3)}
    eng = itif.Engine("bert-tiny", device="cpu", dtype="float32")
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    rng = np.random.default_rng(5)
    reqs = [itif.Request(tenant=f"t{i % 3}", outputs=("logits", "last_hidden_state"),
                         input_ids=rng.integers(0, 1000, int(rng.integers(30, 90))))
            for i in range(12)]
    calls = []
    norm = ops.bias_residual_layernorm
    monkeypatch.setattr(ops, "bias_residual_layernorm",
                        lambda *a, **k: calls.append(1) or norm(*a, **k))
    for res, req in zip(eng.infer(reqs), reqs):
        want = reference(models[req.tenant], req)
        np.testing.assert_allclose(res.logits, want["logits"], rtol=0, atol=1e-4)
        np.testing.assert_allclose(res.last_hidden_state, want["last_hidden_state"],
                                   rtol=0, atol=1e-4)
    assert calls == []
