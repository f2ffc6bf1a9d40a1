"""The CPU attention op (``itif.ops.reference.attention``) at lengths PyTorch's CPU flash
attention runs slowly: a masked group of 13-15 rows runs over 16 keys, the added ones zero and
masked (a group without a mask, or of one sequence, runs as it is). Results equal a
per-sequence softmax attention at every length, in both group forms, and the rounded-up call
is the faster one."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch

from itif.calibration.batch_timing import measure_ms
from itif.ops import reference
from itif.ops.reference import AttnGroup, cpu_attention_len

HEADS, D = 4, 8
H = HEADS * D


def _naive(qkv: torch.Tensor, seqs: list[np.ndarray]) -> dict[int, torch.Tensor]:
    """Row -> output row, one sequence at a time (explicit softmax, float64)."""
    x = qkv.double()
    out = {}
    for rows in seqs:
        r = torch.as_tensor(rows)
        q, k, v = (x[r, i * H:(i + 1) * H].view(len(rows), HEADS, D).transpose(0, 1)
                   for i in range(3))
        p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D), dim=-1)
        o = (p @ v).transpose(0, 1).reshape(len(rows), H)
        out.update({int(row): o[j] for j, row in enumerate(rows)})
    return out


def test_the_rounding_rule():
    assert [cpu_attention_len(L) for L in (1, 7, 8, 12, 13, 14, 15, 16, 17, 31, 32, 47)] == [
        1, 7, 8, 12, 16, 16, 16, 16, 17, 31, 32, 47]


@pytest.mark.parametrize("L", [3, 8, 12, 13, 14, 15, 16, 24, 31])
@pytest.mark.parametrize("form", ["view", "view_masked", "gather"])
def test_equal_to_per_sequence_attention(L, form):
    rng = np.random.default_rng(L)
    n = 5
    T = 3 + n * L + 4  # rows before and after the group stay as they were
    qkv = torch.randn(T, 3 * H, generator=torch.Generator().manual_seed(L))
    out = torch.full((T, H), 7.0)
    lens = np.full(n, L) if form == "view" else rng.integers(1, L + 1, n)
    lens[0] = L
    mask = (torch.arange(L)[None, :] < torch.as_tensor(lens)[:, None]).view(n, 1, 1, L)
    if form == "gather":  # sequences scattered over the buffer, in no order
        perm = rng.permutation(np.arange(3, 3 + n * L))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        seqs = [perm[s:s + ln] for s, ln in zip(starts, lens)]
        rows = torch.zeros(n, L, dtype=torch.int64)
        for i, s in enumerate(seqs):
            rows[i, : len(s)] = torch.as_tensor(s)
        valid = torch.as_tensor(np.flatnonzero(mask.view(-1).numpy()))
        group = AttnGroup(n=n, L=L, rows=rows, valid=valid, dest=rows.reshape(-1)[valid],
                          key_mask=mask)
    else:
        seqs = [np.arange(3 + i * L, 3 + i * L + ln) for i, ln in enumerate(lens)]
        group = AttnGroup(n=n, L=L, start=3, key_mask=None if form == "view" else mask)
    reference.attention(qkv, [group], HEADS, out)
    want = _naive(qkv, seqs)
    got = torch.stack([out[r] for r in want]).double()
    assert torch.allclose(got, torch.stack(list(want.values())), atol=1e-5, rtol=1e-5)
    # a view group writes its padding rows too (nothing reads them); nothing outside it
    covered = set(want) if form == "gather" else set(range(3, 3 + n * L))
    untouched = sorted(set(range(T)) - covered)
    assert bool((out[untouched] == 7.0).all())


def test_a_partial_block_runs_faster_rounded_up():
    """32 sequences of at most 15 rows (12 heads of 32, one thread): the op over 16 keys (the
    copy of K and V included) against the op with the rounding turned off, taking turns, best of
    7 samples each (thread CPU time), three turns. bench/cpu_attention.py measured 0.41-0.60x for
    masked groups of 15 rows in three shapes on this project's 2-core EPYC; another EPYC of the
    same project gave 0.70-0.82x for this shape (a fresh-clone CI failed at 0.83x against the
    0.8x it asserted before); asserted: at most 0.9x (no rounding: 1x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, L, heads, d = 32, 15, 12, 32
        qkv = torch.randn(n * L, 3 * heads * d)
        out = torch.empty(n * L, heads * d)
        mask = torch.ones(n, 1, 1, L, dtype=torch.bool)
        mask[1:, ..., -1] = False
        group = AttnGroup(n=n, L=L, start=0, key_mask=mask)

        def op():
            reference.attention(qkv, [group], heads, out)

        times = {"rounded": [], "as_is": []}
        for _ in range(3):  # taking turns
            times["rounded"].append(measure_ms(op))
            with mock.patch.object(reference, "cpu_attention_len", lambda L: L):
                times["as_is"].append(measure_ms(op))
        assert min(times["rounded"]) <= 0.9 * min(times["as_is"]), times
    finally:
        torch.set_num_threads(before)


def test_a_request_never_reads_another_requests_rows():
    """A masked key still enters the output as 0 x its value (NaN when the value is not finite,
    shown first), so the gather form's padding positions point at the request's own rows: with
    every row of the other requests NaN, each request's outputs stay finite."""
    q = torch.randn(1, 1, 4, 8)
    kv = q.clone()
    kv[:, :, -1] = float("nan")
    mask = torch.tensor([True, True, True, False]).view(1, 1, 1, 4)
    poisoned = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
    assert not bool(torch.isfinite(poisoned).all())

    import itif
    from itif.backbones.random import random_weights
    from itif.batching.layout import layout_packed
    from itif.runtime.batch import prepare

    eng = itif.Engine("bert-tiny")
    for i in range(2):
        eng.add_tenant(f"t{i}", random_weights(eng.spec, 2, seed=i))
    tenant = np.array([0, 1, 0, 1], np.int32)  # row 0: a tenant-0 request
    length = np.array([14, 13, 3, 14], np.int32)  # 13 and 14 share a bucket: gathered, masked
    layout = layout_packed(tenant, length)
    names = ("t0", "t1")
    view = eng.store.view
    b = prepare(eng.spec, layout, names, view, eng.slot_tables(view, names), eng.device,
                eng.dtype, ids=np.arange(int(length.sum())))
    gathered = [g for g in b.attn if g.gather and g.masked]
    assert gathered
    heads = eng.spec.heads
    H = eng.spec.hidden
    for g in gathered:
        rows = g.host_rows
        reqs = [int(np.flatnonzero(layout.offset == r[0])[0]) for r in rows]
        for r, req in zip(rows, reqs):  # every position, padding included, in its own request
            off, n = int(layout.offset[req]), int(length[req])
            assert set(r.tolist()) <= set(range(off, off + n)), (r, off, n)
        for i, req in enumerate(reqs):
            off, n = int(layout.offset[req]), int(length[req])
            qkv = torch.full((layout.total_rows, 3 * H), float("nan"))
            qkv[off:off + n] = torch.randn(n, 3 * H)
            lens = torch.as_tensor(length[reqs])
            keys = torch.arange(g.L)[None, :] < lens[:, None]
            valid = torch.as_tensor(np.flatnonzero(keys.reshape(-1).numpy()))
            rt = torch.as_tensor(rows)
            group = AttnGroup(n=g.n, L=g.L, rows=rt, valid=valid, dest=rt.reshape(-1)[valid],
                              key_mask=keys.view(g.n, 1, 1, g.L))
            out = reference.attention(qkv, [group], heads)
            assert bool(torch.isfinite(out[off:off + n]).all()), (req, g.L)
