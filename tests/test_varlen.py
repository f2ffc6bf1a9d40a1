"""A batch's attention as one variable-length call: the sequence boundaries ``prepare`` packs
("varlen.cu", ``PreparedBatch.varlen_L``) must give every request exactly its own rows, so the
CUDA path's single call (``itif.ops.cuda.attention``) computes what the per-length groups do.
On the CPU the call itself is emulated sequence by sequence; tests/test_kernels_gpu.py runs
torch's kernel against the groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import itif
from itif.backbones.random import random_weights
from itif.ops import reference
from itif.runtime import cpu_attention, forward
from itif.runtime.batch import prepare


def _batch(strategy: str, lengths, tenants: int = 3, preset: str = "bert-tiny"):
    eng = itif.Engine(preset)
    for i in range(tenants):
        eng.add_tenant(f"t{i}", random_weights(eng.spec, num_labels=2, seed=i))
    rng = np.random.default_rng(len(lengths))
    names = [f"t{i % tenants}" for i in range(len(lengths))]
    reqs = [itif.Request(t, input_ids=rng.integers(0, eng.spec.vocab_size, int(n)))
            for t, n in zip(names, lengths)]
    view = eng.store.view
    order = eng.batch_tenants(view, names)
    inputs = eng._validate(reqs, order, view)
    layout = eng.plan(inputs.tenant_idx, inputs.lengths, strategy)
    b = prepare(eng.spec, layout, order, view, eng.slot_tables(view, order), eng.device,
                eng.dtype, ids=inputs.ids, types=inputs.types, want_hidden=True)
    return eng, b


RAGGED = [5, 17, 17, 40, 3, 64, 1, 9, 100, 33, 2, 57]


@pytest.mark.parametrize("strategy", ["packed", "pad_per_tenant"])
def test_boundaries_tile_the_rows_and_give_each_request_its_own(strategy):
    _, b = _batch(strategy, RAGGED)
    assert len(b.attn) > 1  # several length groups: the case the single call is for
    cu = b.packer.view(b.host_ints, "varlen.cu").numpy()
    assert cu[0] == 0 and cu[-1] == b.rows and np.all(np.diff(cu) > 0)
    assert b.varlen_L == int(np.diff(cu).max())
    lay = b.layout
    for i in range(lay.num_requests):
        s, n = int(lay.offset[i]), int(lay.length[i])
        k = int(np.searchsorted(cu, s))
        assert cu[k] == s and cu[k + 1] == s + n, f"request {i}: rows {s}..{s + n} vs {cu}"
    if strategy == "pad_per_tenant":  # padding rows exist and sit in sequences of their own
        assert int(lay.padded_len.sum()) > int(lay.length.sum())


def test_one_group_packs_no_boundaries():
    _, b = _batch("packed", [24] * 6)
    assert len(b.attn) == 1
    assert b.varlen_L == 0 and "varlen.cu" not in b.packer.slices


@pytest.mark.parametrize("strategy", ["packed", "pad_per_tenant"])
def test_one_call_over_the_boundaries_equals_the_groups(strategy):
    """Attention run sequence by sequence over the boundaries (what a variable-length kernel
    computes) equals the reference over the batch's groups on every real token's row."""
    eng, b = _batch(strategy, RAGGED)
    heads, H = eng.spec.heads, eng.spec.hidden
    d = forward._Bound(b, b.host_ints, None)
    cu, L = d.varlen()
    assert cu.dtype == torch.int32 and L == b.varlen_L
    qkv = torch.randn(b.rows, 3 * H, generator=torch.Generator().manual_seed(3))
    want = reference.attention(qkv, d.attn_groups(), heads)
    got = torch.zeros(b.rows, H)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        q, k, v = (qkv[s:e, i * H : (i + 1) * H].view(e - s, heads, H // heads).transpose(0, 1)
                   for i in range(3))
        got[s:e] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(e - s, H)
    rows = torch.as_tensor(b.tok_row)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    # the reference ignores the boundaries: a backend without the kernel runs the groups
    again = reference.attention(qkv, d.attn_groups(), heads, None, (cu, L))
    torch.testing.assert_close(again, want, atol=0, rtol=0)


def test_the_forward_hands_the_boundaries_to_attention_only_for_several_groups(monkeypatch):
    """Every layer's attention call gets (boundaries, longest) for a ragged batch, None for a
    batch of one group; the engine's answers are those of the groups either way (the CPU
    reference ignores the boundaries)."""
    seen = []
    real = forward.ops.attention

    def spy(qkv, groups, heads, out=None, varlen=None):
        seen.append(None if varlen is None else (varlen[0].tolist(), varlen[1]))
        return real(qkv, groups, heads, out, varlen)

    monkeypatch.setattr(forward.ops, "attention", spy)
    eng, b = _batch("packed", RAGGED)
    with cpu_attention.suspended():  # the CPU's own one call (test_cpu_attention) off
        forward.run(eng.spec, b, b.host_ints, b.host_floats)
    cu = b.packer.view(b.host_ints, "varlen.cu").tolist()
    assert seen == [(cu, max(RAGGED))] * eng.spec.layers
    seen.clear()
    eng, b = _batch("packed", [24] * 6)
    forward.run(eng.spec, b, b.host_ints, b.host_floats)
    assert seen == [None] * eng.spec.layers


def test_groups_are_built_only_when_attention_runs_them(monkeypatch):
    """With boundaries to hand over, the forward builds its attention groups lazily: a backend
    that runs the one call never pays for them; the reference (which runs the groups) builds
    them once per forward, not once per layer."""
    built = []
    real_groups = forward._Bound.attn_groups
    monkeypatch.setattr(forward._Bound, "attn_groups",
                        lambda self: built.append(1) or real_groups(self))
    eng, b = _batch("packed", RAGGED)
    with cpu_attention.suspended():  # the CPU reference runs the groups
        forward.run(eng.spec, b, b.host_ints, b.host_floats)
    assert built == [1]
    built.clear()

    def one_call(qkv, groups, heads, out=None, varlen=None):
        assert varlen is not None and len(groups) == len(b.attn) > 1
        return out.zero_()

    monkeypatch.setattr(forward.ops, "attention", one_call)
    forward.run(eng.spec, b, b.host_ints, b.host_floats)
    assert built == []
