"""GPU tests of the CUDA RawKernels (``itif.ops.cuda``) against the torch reference.

Every kernel is compared with ``itif.ops.reference`` over hidden sizes 8, 768, 769, 1024, 1030,
row counts 1, 7, 65, storage dtypes f32/f16/bf16 and three tenant mixes (per-row slots all
different, all the same, 90% one slot), under each launch configuration. The oracle is the
reference run in float32 on the same (rounded) inputs, cast to the storage dtype: the kernels
accumulate in float32 and round once, so the tolerance is about one storage ulp.

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import pytest
import torch

from itif.ops import cuda, dispatch, reference
from itif.ops.reference import AttnGroup, RotParam
from itif.ops.selftest import softmax_oracle
from itif.platform import cupy_module


def _cuda_and_cupy() -> bool:
    return torch.cuda.is_available() and cupy_module() is not None


requires_cuda = pytest.mark.skipif(not _cuda_and_cupy(), reason="needs CUDA and CuPy")
pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {  # (atol, rtol) against the float32 oracle rounded to the storage dtype
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
HIDDEN = [8, 768, 769, 1024, 1030]
ROWS = [1, 7, 65]
MIXES = ["distinct", "uniform", "skewed"]
ACTS = ["none", "gelu", "gelu_new", "relu", "silu", "tanh"]
ELEMENTWISE_POLICIES = [
    {},
    {"elementwise": "flat"},
    {"vectorize": False},
    {"elementwise": "flat", "vectorize": False},
]
LN_POLICIES = [
    {},
    {"layernorm": "block"},
    {"layernorm": "warp"},
    {"layernorm": "block", "ln_smem_cache": False},
    {"layernorm": "warp", "ln_smem_cache": False},
    {"layernorm": "warp", "warps_per_block": 8},
    {"layernorm": "block", "vectorize": False},
]


def _pid(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items()) or "default"


def _slots(mix: str, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Per-row slots of a tenant mix, and the buffer capacity they need."""
    if mix == "distinct":
        return torch.arange(rows, dtype=torch.int64), max(rows, 2)
    if mix == "uniform":
        return torch.full((rows,), 1, dtype=torch.int64), 3
    cap = 5
    s = torch.randint(0, cap, (rows,), generator=gen)
    s[torch.rand(rows, generator=gen) < 0.9] = 2
    return s, cap


class Case:
    """Random inputs of one (hidden, rows, mix, dtype) on the GPU, plus float32 twins."""

    def __init__(self, h: int, rows: int, mix: str, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed * 7919 + h * 31 + rows)
        slot, cap = _slots(mix, rows, g)
        self.dtype = dtype

        def t(*shape):
            return torch.randn(*shape, generator=g).to(dtype).cuda()

        def rot(*shape, s=slot):
            return RotParam(t(cap, *shape), s.cuda())

        self.x, self.res = t(rows, h), t(rows, h)
        self.bias = rot(h)
        # gamma/beta read other slots than the bias: the store dedups per parameter kind.
        self.gamma = rot(h, s=slot.flip(0).contiguous())
        self.beta = rot(h, s=torch.roll(slot, 1))


def f32(p):
    if p is None:
        return None
    if isinstance(p, RotParam):
        return RotParam(p.buf.float(), p.slot)
    return p.to(torch.float32, copy=True)  # a copy: the in-place references must not alias


def assert_close(got: torch.Tensor, want_f32: torch.Tensor, dtype: torch.dtype):
    atol, rtol = TOL[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want_f32.to(dtype).float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# elementwise ops


@pytest.mark.parametrize("policy", ELEMENTWISE_POLICIES, ids=_pid)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HIDDEN)
def test_bias_act(h, rows, mix, dtype, policy):
    c = Case(h, rows, mix, dtype)
    with cuda.launch_policy(**policy):
        for act in ACTS:
            got = cuda.bias_act(c.x.clone(), c.bias, act)
            assert_close(got, reference.bias_act(f32(c.x), f32(c.bias), act), dtype)


@pytest.mark.parametrize("policy", ELEMENTWISE_POLICIES, ids=_pid)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HIDDEN)
def test_bias_residual(h, rows, mix, dtype, policy):
    c = Case(h, rows, mix, dtype)
    x = c.x.clone()
    with cuda.launch_policy(**policy):
        got = cuda.bias_residual(x, c.bias, c.res)
    assert got is x
    assert_close(got, reference.bias_residual(f32(c.x), f32(c.bias), f32(c.res)), dtype)


def test_bias_act_intermediate_width():
    """BERT-base FFN width (3072) with GELU, all mixes: the shape the engine runs most."""
    for mix in MIXES:
        c = Case(3072, 512, mix, torch.float16)
        assert_close(cuda.bias_act(c.x.clone(), c.bias, "gelu"),
                     reference.bias_act(f32(c.x), f32(c.bias), "gelu"), torch.float16)


# ---------------------------------------------------------------------------------------------
# LayerNorm


@pytest.mark.parametrize("policy", LN_POLICIES, ids=_pid)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HIDDEN)
def test_bias_residual_layernorm(h, rows, mix, dtype, policy):
    c = Case(h, rows, mix, dtype)
    with cuda.launch_policy(**policy):
        for bias, res in ((c.bias, c.res), (None, None), (c.bias, None), (None, c.res)):
            for keep_sum in (False, True):
                x = c.x.clone()
                x_ref = f32(c.x)
                got = cuda.bias_residual_layernorm(x, bias, res, c.gamma, c.beta, 1e-5, keep_sum)
                want = reference.bias_residual_layernorm(
                    x_ref, f32(bias), f32(res), f32(c.gamma), f32(c.beta), 1e-5, keep_sum)
                assert_close(got, want, dtype)
                assert_close(x, x_ref, dtype)  # the sum when keep_sum, else unchanged
                if not keep_sum:
                    assert torch.equal(x, c.x)


def test_layernorm_large_hidden_without_cache():
    """A row too wide for the shared-memory cache takes the re-reading path by itself."""
    c = Case(16384, 5, "skewed", torch.float32)
    for keep_sum in (False, True):
        x, x_ref = c.x.clone(), f32(c.x)
        got = cuda.bias_residual_layernorm(x, c.bias, c.res, c.gamma, c.beta, 1e-6, keep_sum)
        want = reference.bias_residual_layernorm(x_ref, c.bias, c.res, c.gamma, c.beta, 1e-6,
                                                 keep_sum)
        assert_close(got, want, torch.float32)
        assert_close(x, x_ref, torch.float32)


# ---------------------------------------------------------------------------------------------
# embeddings


@pytest.mark.parametrize("policy", ELEMENTWISE_POLICIES, ids=_pid)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("e", [8, 128, 768, 769, 1030])
def test_embed_text(e, rows, mix, dtype, policy):
    g = torch.Generator().manual_seed(e + rows)
    slot, cap = _slots(mix, rows, g)
    vocab, npos = 50, 40

    def rot(n, s):
        return RotParam(torch.randn(cap, n, e, generator=g).to(dtype).cuda(), s.cuda())

    word, pos, typ = rot(vocab, slot), rot(npos, slot.flip(0).contiguous()), rot(2, slot)
    ids = torch.randint(0, vocab, (rows,), generator=g).cuda()
    positions = torch.randint(0, npos, (rows,), generator=g).cuda()
    types = torch.randint(0, 2, (rows,), generator=g).cuda()
    with cuda.launch_policy(**policy):
        got = cuda.embed_text(word, pos, typ, ids, positions, types)
    want = reference.embed_text(f32(word), f32(pos), f32(typ), ids, positions, types)
    assert_close(got, want, dtype)


# ---------------------------------------------------------------------------------------------
# out-of-range slots and ids poison their row (no out-of-bounds read)


def test_bad_slot_rows_are_nan():
    x = torch.randn(4, 64, device="cuda")
    slot = torch.tensor([0, 7, 1, -1], device="cuda")
    bias = RotParam(torch.randn(2, 64, device="cuda"), slot)
    y = cuda.bias_act(x.clone(), bias, "gelu")
    assert torch.isnan(y).all(1).tolist() == [False, True, False, True]
    gamma = RotParam(torch.ones(2, 64, device="cuda"), slot)
    y = cuda.bias_residual_layernorm(x, None, None, gamma, gamma, 1e-5)
    assert torch.isnan(y).all(1).tolist() == [False, True, False, True]
    word = RotParam(torch.randn(2, 10, 64, device="cuda"), torch.zeros(4, dtype=torch.int64,
                                                                        device="cuda"))
    ids = torch.tensor([0, 10, 3, -2], device="cuda")
    y = cuda.embed_text(word, word, word, ids, torch.zeros_like(ids), torch.zeros_like(ids))
    assert torch.isnan(y).all(1).tolist() == [False, True, False, True]


# ---------------------------------------------------------------------------------------------
# masked softmax and attention


_softmax_oracle = softmax_oracle  # the one oracle, shared with the start-up self-test


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", [1, 5, 32, 33, 128, 512])
@pytest.mark.parametrize("warps", [4, 8])
def test_masked_softmax(L, dtype, warps):
    n, heads = 3, 4
    g = torch.Generator().manual_seed(L)
    s = (torch.randn(n * heads * L, L, generator=g) * 4).to(dtype).cuda()
    lengths = torch.tensor([L, max(L - 3, 1), 0]).cuda()
    mask = (torch.rand(n, 1, 1, L, generator=g) < 0.8).cuda()
    with cuda.launch_policy(warps_per_block=warps):
        for lm, km in ((None, None), (lengths, None), (None, mask), (lengths, mask)):
            got = cuda.masked_softmax(s.clone(), heads * L, lm, km, 0.125)
            assert_close(got, _softmax_oracle(s, heads * L, lm, km, 0.125), dtype)


def _groups(n, L, heads, H, gen):
    """A view-form group (one row of offset) and the same requests in gather form, masked."""
    T = n * L + 3
    lengths = torch.randint(1, L + 1, (n,), generator=gen)
    lengths[0] = L
    view = AttnGroup(n=n, L=L, start=2)
    rows = (torch.arange(n * L) + 2).view(n, L)
    key_mask = torch.arange(L)[None] < lengths[:, None]
    rows = torch.where(key_mask, rows, torch.zeros_like(rows))
    valid = torch.nonzero(key_mask.reshape(-1)).squeeze(1)
    gather = AttnGroup(n=n, L=L, rows=rows.cuda(), valid=valid.cuda(),
                       dest=rows.reshape(-1)[valid].cuda(),
                       key_mask=key_mask.view(n, 1, 1, L).cuda())
    return T, view, gather


@pytest.mark.parametrize("mode", ["auto", "sdpa", "softmax_bmm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,H", [(2, 8), (12, 768), (3, 30)])
@pytest.mark.parametrize("L", [1, 7, 64])
def test_attention(L, heads, H, dtype, mode):
    g = torch.Generator().manual_seed(L * heads)
    T, view, gather = _groups(3, L, heads, H, g)
    qkv = torch.randn(T, 3 * H, generator=g).to(dtype).cuda()
    for groups in ([view], [gather]):
        with cuda.launch_policy(attention=mode):
            got = cuda.attention(qkv, groups, heads)
        want = reference.attention(qkv.float(), groups, heads)
        atol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("strategy", ["packed", "pad_per_tenant"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_attention_of_many_length_groups_in_one_variable_length_call(dtype, strategy):
    """A ragged batch (several length groups, padding rows under pad_per_tenant) through torch's
    variable-length kernel over the boundaries ``prepare`` packed, against the float32
    reference over its groups, on every real token's row; the per-group path agrees too."""
    from itif.runtime import forward  # noqa: PLC0415
    from tests.test_varlen import RAGGED, _batch  # noqa: PLC0415

    eng, b = _batch(strategy, RAGGED)
    d = forward._Bound(b, b.host_ints.cuda(), None)
    groups, varlen = d.attn_groups(), d.varlen()
    assert len(groups) > 1 and varlen is not None
    heads, H = eng.spec.heads, eng.spec.hidden
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(b.rows, 3 * H, generator=g).to(dtype).cuda()
    want = reference.attention(qkv.float(), groups, heads)
    rows = torch.as_tensor(b.tok_row).cuda()
    atol = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert cuda._varlen_kernel(qkv.device.index) is not None, "torch lacks varlen_attn here"
    got = cuda.attention(qkv, groups, heads, torch.zeros(b.rows, H, dtype=dtype, device="cuda"),
                         varlen)
    assert (qkv.device.index, dtype) not in cuda._varlen_failed  # the one call did run
    torch.testing.assert_close(got.float()[rows], want[rows], atol=atol, rtol=atol)
    with cuda.launch_policy(attention="sdpa"):  # the per-group path, for comparison
        per_group = cuda.attention(qkv, groups, heads, None, varlen)
    torch.testing.assert_close(per_group.float()[rows], want[rows], atol=atol, rtol=atol)


# ---------------------------------------------------------------------------------------------
# streams, dispatch, validation


def test_kernels_run_on_torchs_current_stream():
    side = torch.cuda.Stream()
    c = Case(768, 64, "skewed", torch.float16)
    want = reference.bias_act(f32(c.x) * 2, f32(c.bias), "gelu")
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(50_000_000)  # a long kernel ahead on this stream
        x = c.x * 2  # produced on `side`, consumed next without a sync
        got = cuda.bias_act(x, c.bias, "gelu")
    torch.cuda.current_stream().wait_stream(side)
    assert_close(got, want, torch.float16)


def test_dispatch_uses_cuda_kernels():
    c = Case(768, 7, "skewed", torch.float16)
    assert dispatch.backend_name(c.x) == "cuda"
    got = dispatch.bias_residual_layernorm(c.x, c.bias, c.res, c.gamma, c.beta, 1e-12)
    want = reference.bias_residual_layernorm(f32(c.x), f32(c.bias), f32(c.res), f32(c.gamma),
                                             f32(c.beta), 1e-12)
    assert_close(got, want, torch.float16)


def test_validation_errors_name_both_values():
    c = Case(64, 5, "skewed", torch.float16)
    with pytest.raises(ValueError, match="bias.slot is on cpu but x is on cuda"):
        cuda.bias_act(c.x, RotParam(c.bias.buf, c.bias.slot.cpu()), "gelu")
    with pytest.raises(ValueError, match="bias.buf has dtype torch.float32 but x has"):
        cuda.bias_act(c.x, RotParam(c.bias.buf.float(), c.bias.slot), "gelu")
    with pytest.raises(ValueError, match="bias.slot has 4 entries but x has 5 rows"):
        cuda.bias_act(c.x, RotParam(c.bias.buf, c.bias.slot[:4]), "gelu")
    with pytest.raises(ValueError, match="x must be contiguous"):
        cuda.bias_act(c.x.t().contiguous().t(), c.bias, "gelu")
    with pytest.raises(ValueError, match="residual has shape"):
        cuda.bias_residual_layernorm(c.x, None, c.res[:4], c.gamma, c.beta, 1e-5)
    with pytest.raises(ValueError, match="float64"):
        cuda.bias_act(c.x.double(), c.bias, "gelu")
    with pytest.raises(ValueError, match="x is on cpu"):
        cuda.bias_act(c.x.cpu(), c.bias, "gelu")


def test_empty_rows():
    x = torch.empty(0, 768, device="cuda", dtype=torch.float16)
    b = RotParam(torch.randn(2, 768, device="cuda").half(),
                 torch.empty(0, dtype=torch.int64, device="cuda"))
    assert cuda.bias_act(x, b, "gelu").shape == (0, 768)
    assert cuda.bias_residual_layernorm(x, b, None, b, b, 1e-5).shape == (0, 768)


def test_auto_attention_uses_softmax_only_where_sdpa_is_unfused():
    assert cuda._sdpa_takes(torch.float16, 64)
    assert not cuda._sdpa_takes(torch.float16, 10)
