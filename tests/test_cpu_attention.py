"""The CPU's variable-length attention kernel (``itif.runtime.cpu_attention``): every sequence of
the boundaries attends to itself alone, as a per-sequence softmax attention does, in float32
and bfloat16; rows outside every sequence keep their values; bad operands are refused; and the
CPU forward of a ragged batch runs it once a layer, answering as the length groups do."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import itif
from itif.backbones.random import random_weights
from itif.runtime import cpu_attention, forward

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the kernel needs AVX2/FMA; without it the length groups run")


@pytest.fixture(scope="module")
def built():
    assert cpu_attention.ensure(), cpu_attention.state["why_not"]  # a compiler is part of CI


def _naive(qkv: torch.Tensor, cu: list[int], heads: int, out: torch.Tensor) -> torch.Tensor:
    """Each sequence alone, explicit softmax in float64."""
    x = qkv.double()
    H = x.shape[1] // 3
    d = H // heads
    out = out.double().clone()
    for s, e in zip(cu[:-1], cu[1:]):
        q, k, v = (x[s:e, i * H:(i + 1) * H].view(e - s, heads, d).transpose(0, 1)
                   for i in range(3))
        p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
        out[s:e] = (p @ v).transpose(0, 1).reshape(e - s, H)
    return out


@pytest.mark.parametrize("heads, d", [(4, 64), (2, 8), (3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equal_to_per_sequence_attention(built, heads, d, dtype):
    lens = [1, 2, 7, 16, 33, 100, 3]
    cu = [4] + list(4 + np.cumsum(lens))  # rows 0-3 and the last 5 are in no sequence
    T = cu[-1] + 5
    H = heads * d
    qkv = torch.randn(T, 3 * H, generator=torch.Generator().manual_seed(d)).to(dtype)
    out = torch.full((T, H), 7.0, dtype=dtype)
    got = cpu_attention.attention(qkv, torch.tensor(cu, dtype=torch.int32), heads, out)
    assert got is out
    want = _naive(qkv, cu, heads, out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's rounding
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert (got[:4] == 7).all() and (got[cu[-1]:] == 7).all()


def test_bad_operands_are_refused(built):
    qkv = torch.randn(10, 12)
    with pytest.raises(RuntimeError, match="boundaries"):
        cpu_attention.attention(qkv, torch.tensor([0, 6, 4, 10]), 2)
    with pytest.raises(RuntimeError, match="boundaries"):
        cpu_attention.attention(qkv, torch.tensor([0, 11]), 2)
    with pytest.raises(RuntimeError, match="shapes"):
        cpu_attention.attention(qkv, torch.tensor([0, 10]), 3, torch.empty(10, 5))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_attention.attention(qkv, torch.tensor([0, 10]), 2, torch.empty(10, 4).double())


@pytest.mark.parametrize("strategy", ["packed", "pad_per_tenant"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_forward_runs_it_once_a_layer_and_answers_as_the_groups(built, monkeypatch,
                                                                      strategy, dtype):
    eng = itif.Engine("bert-tiny", device="cpu", dtype=dtype)
    for i in range(3):
        eng.add_tenant(f"t{i}", random_weights(eng.spec, num_labels=2, seed=i))
    rng = np.random.default_rng(0)
    lens = [5, 17, 17, 40, 3, 64, 1, 9, 100, 33, 2, 57]
    reqs = [itif.Request(f"t{i % 3}", input_ids=rng.integers(0, eng.spec.vocab_size, n),
                         outputs=("logits", "last_hidden_state")) for i, n in enumerate(lens)]
    with cpu_attention.suspended():
        want = eng.infer(reqs, strategy=strategy)
    monkeypatch.setattr(cpu_attention, "MIN_ROWS", 0)  # 348 rows: a serving-size batch
    calls = []
    real = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    groups = []
    monkeypatch.setattr(forward.ops, "attention", lambda *a, **k: groups.append(1))
    got = eng.infer(reqs, strategy=strategy)
    assert len(calls) == eng.spec.layers and groups == []
    tol = 1e-5 if dtype == "float32" else 5e-2
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logits, w.logits, atol=tol, rtol=tol)
        np.testing.assert_allclose(g.last_hidden_state, w.last_hidden_state, atol=tol * 10,
                                   rtol=tol * 10)


def test_a_serving_size_batch_keeps_the_length_groups(built, monkeypatch):
    """Under :data:`cpu_attention.MIN_ROWS` rows the kernel is dearer than the length groups'
    attention (its docstring has the figures): such a batch never calls it."""
    eng = itif.Engine("bert-tiny", device="cpu")
    eng.add_tenant("t", random_weights(eng.spec, num_labels=2, seed=0))
    calls = []
    monkeypatch.setattr(cpu_attention, "attention", lambda *a, **k: calls.append(1))
    rng = np.random.default_rng(1)
    eng.infer([itif.Request("t", input_ids=rng.integers(0, 100, n)) for n in (5, 40, 90)])
    assert calls == []
