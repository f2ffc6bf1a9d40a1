"""Float16 / bfloat16: itif is no less accurate than Hugging Face's own model in that dtype.

Both are measured against Hugging Face in float32 with the tenant's own weights, request by
request. The memory-bound ops compute in float32 and round once when they store
(``itif.ops.reference``, as ``kernels/rotation.cu`` does); the pooler adds its bias and takes
its tanh in one such op, and the classifier adds its bias to the float32 logits. Before that,
on this repository's CPU (24 requests, seeds 7 and 8), itif's last hidden state was 1.15-1.28x
as far off as Hugging Face's own model in the same dtype (bert-small, albert-tiny, vit-tiny;
float16 and bfloat16); after it 0.85-0.995x (seeds 7 to 9, bert-tiny too). The logits' ratio
is noisier (a few logits a request: 0.77-1.24x after, 1.01-1.62x before), so it only has to
stay within 1.3x.

The ops' own rounding is checked first: each result equals the float32 computation rounded once.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import itif
from itif.ops import reference as ref
from itif.ops.reference import RotParam
from tests.oracle import random_request, reference_on_device, rel_norm
from tests.test_engine_dtypes import (  # noqa: F401 - exact_float32_cuda: a fixture, by name
    BERT_SMALL,
    PRESETS,
    _tenants,
    exact_float32_cuda,
)

REDUCED = [torch.bfloat16, torch.float16]


def _rot(buf: torch.Tensor, T: int, gen: torch.Generator) -> RotParam:
    return RotParam(buf, torch.randint(0, buf.shape[0], (T,), generator=gen))


def _rows(p: RotParam) -> torch.Tensor:
    return ref.rows_of(p).float()


@pytest.mark.parametrize("dtype", REDUCED)
def test_memory_bound_ops_round_once(dtype):
    gen = torch.Generator().manual_seed(3)
    T, H = 37, 48

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x, res = rnd(T, H, scale=4.0), rnd(T, H, scale=4.0)
    bias, gamma, beta = (_rot(rnd(3, H), T, gen) for _ in range(3))
    want = (F.layer_norm(x.float() + _rows(bias) + res.float(), (H,), eps=1e-6)
            * _rows(gamma) + _rows(beta)).to(dtype)
    assert torch.equal(ref.bias_residual_layernorm(x, bias, res, gamma, beta, 1e-6), want)

    s = x.clone()
    got = ref.bias_residual_layernorm(s, bias, res, gamma, beta, 1e-6, keep_sum=True)
    assert torch.equal(got, want)
    assert torch.equal(s, (x.float() + _rows(bias) + res.float()).to(dtype))

    for act, fn in (("gelu", F.gelu), ("none", lambda v: v)):
        y = x.clone()
        assert ref.bias_act(y, bias, act) is y
        assert torch.equal(y, fn(x.float() + _rows(bias)).to(dtype))

    y = x.clone()
    assert ref.bias_residual(y, bias, res) is y
    assert torch.equal(y, (x.float() + _rows(bias) + res.float()).to(dtype))

    word, pos, typ = rnd(2, 50, H), rnd(2, 16, H), rnd(2, 2, H)
    slot = torch.randint(0, 2, (T,), generator=gen)
    ids, p, t = (torch.randint(0, n, (T,), generator=gen) for n in (50, 16, 2))
    got = ref.embed_text(RotParam(word, slot), RotParam(pos, slot), RotParam(typ, slot), ids, p, t)
    assert got.dtype == dtype
    assert torch.equal(got, (word[slot, ids].float() + pos[slot, p].float()
                             + typ[slot, t].float()).to(dtype))


def test_float32_ops_still_in_place():
    """The float32 path (the CPU's usual one) keeps its in-place updates and allocates no
    float32 copy where it wrote in place before."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 8, generator=gen)
    bias = _rot(torch.randn(2, 8, generator=gen), 9, gen)
    want = x + _rows(bias)
    assert ref.bias_act(x, bias) is x and torch.equal(x, want)
    keep = x.clone()
    ref.bias_residual_layernorm(keep, bias, None, bias, bias, 1e-6, keep_sum=True)
    assert torch.equal(keep, x + _rows(bias))


def _errors(spec, dtype: str, device: str, n: int, seed: int):
    """Per request: itif's and Hugging Face's (same dtype) max |logits - HF float32| and
    relative error of the last hidden state."""
    models = _tenants(spec, device)
    eng = itif.Engine(spec, device=device, dtype=dtype)
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    rng = np.random.default_rng(seed)
    outs = ("logits", "last_hidden_state")
    reqs = [random_request(spec, f"t{i % 4}", rng, outputs=outs,
                           length=int(rng.integers(1, 65)) if spec.is_text else None)
            for i in range(n)]
    low = {k: copy.deepcopy(m).to(getattr(torch, dtype)) for k, m in models.items()}
    mine, theirs = [], []
    for res, req in zip(eng.infer(reqs), reqs):
        exact = reference_on_device(models[req.tenant], req)
        hf = reference_on_device(low[req.tenant], req)
        mine.append((np.abs(res.logits - exact["logits"]).max(),
                     rel_norm(res.last_hidden_state, exact["last_hidden_state"])))
        theirs.append((np.abs(hf["logits"] - exact["logits"]).max(),
                       rel_norm(hf["last_hidden_state"], exact["last_hidden_state"])))
    return np.array(mine), np.array(theirs)


def _assert_no_less_accurate(mine, theirs, dtype: str) -> None:
    rms = lambda a: float(np.sqrt((a ** 2).mean()))  # noqa: E731 (a one-line local helper)
    for col, what, bound in ((1, "last hidden state rel error", 1.05),
                             (0, "max |logits error|", 1.3)):
        a, b = rms(mine[:, col]), rms(theirs[:, col])
        assert a <= bound * b, f"{what}: itif {a:.3g} against Hugging Face {dtype} {b:.3g}"


@pytest.mark.parametrize("preset", ["bert-small", "albert-tiny", "vit-tiny"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cpu_engine_no_less_accurate_than_hf_in_its_dtype(preset, dtype):
    spec = BERT_SMALL if preset == "bert-small" else PRESETS[preset]
    _assert_no_less_accurate(*_errors(spec, dtype, "cpu", n=24, seed=7), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("triton", [False, True], ids=["cublas", "triton_gemm"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.usefixtures("exact_float32_cuda")
def test_cuda_engine_no_less_accurate_than_hf_in_its_dtype(dtype, triton, monkeypatch):
    """The same on the GPU, with cuBLAS and with itif's Triton GEMM (``ITIF_TRITON_GEMM``)."""
    if triton:
        monkeypatch.setenv("ITIF_TRITON_GEMM", "1")
    _assert_no_less_accurate(*_errors(BERT_SMALL, dtype, "cuda", n=24, seed=7), dtype)
