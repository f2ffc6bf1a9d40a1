"""itif's Triton per-slot GEMM with its bias / activation epilogue (itif.runtime.triton_gemm).

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, which
tests/conftest.py sets before Triton is imported): the same kernel source, tile tables and
epilogue, checked against torch, and Triton compiles it for sm_90 without a GPU; on a GPU the
gpu-marked tests run it compiled, against Hugging Face float32 and with CUDA graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import itif
from itif.ops import dispatch as ops
from itif.ops.reference import activation
from itif.runtime import triton_gemm as tg
from itif.runtime.gemm import Segments
from tests.oracle import max_diff, random_request, reference, reference_on_device
from tests.test_engine_dtypes import (  # noqa: F401 - exact_float32_cuda: a fixture, by name
    BERT_SMALL,
    LOGITS_ATOL_GPU,
    PRESETS,
    _check_dtype,
    _tenants,
    exact_float32_cuda,
)

pytestmark = [
    pytest.mark.skipif(not tg.available(), reason="triton is not installed"),
    # the interpreter's numpy exp overflows to inf for large negative inputs of the sigmoid
    # (the GELU-tanh and SiLU epilogues), which then give the right 0
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_configuration(monkeypatch):
    """On a GPU: one fixed configuration (a compile per kernel variant, not one per autotuned
    configuration); ``test_autotuned_launch_matches`` turns tuning back on."""
    monkeypatch.setenv(tg.AUTOTUNE_ENV, "0")


def _reference(x, w, segs, bias=None, bslot=None, act="none"):
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float64)
    for s, e, k in zip(segs.start, segs.end, segs.slot):
        y[s:e] = x[s:e].double() @ w[k].double().T
    if bias is not None:
        y += bias.double()[bslot]
    return activation(act)(y)


RAGGED = Segments((0, 3, 40, 41, 90), (3, 40, 41, 90, 300), (2, 0, 4, 2, 1))


def test_block_rows_follows_the_longest_segment():
    assert [tg.block_rows(n) for n in (1, 16, 17, 64, 65, 128, 129, 4096)] == [
        16, 16, 32, 64, 128, 128, 128, 128]


def test_tile_table_cuts_each_segment_into_blocks_of_at_most_bm_rows():
    bm = 64
    t = tg.tile_table(RAGGED, bm)
    assert t.dtype == np.int64 and t.shape[1] == 3
    assert t[0, 0] == 0 and t[-1, 1] == 300
    assert (t[1:, 0] == t[:-1, 1]).all()  # contiguous, in row order
    assert ((t[:, 1] - t[:, 0] >= 1) & (t[:, 1] - t[:, 0] <= bm)).all()
    for s, e, k in zip(RAGGED.start, RAGGED.end, RAGGED.slot):  # no tile straddles segments
        inside = (t[:, 0] >= s) & (t[:, 1] <= e)
        assert (t[inside, 2] == k).all() and t[inside, 1].max() == e
        assert inside.sum() == -(-(e - s) // bm)
    assert len(t) == 1 + 1 + 1 + 1 + 4  # 3, 37, 1, 49 rows: one tile each; 210 rows: four


def test_max_block_rows_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(tg.MAX_BM_ENV, raising=False)
    assert tg.max_block_rows() == 128
    monkeypatch.setenv(tg.MAX_BM_ENV, "64")
    assert tg.max_block_rows() == 64 and tg.block_rows(128, 64) == 64
    monkeypatch.setenv(tg.MAX_BM_ENV, "100")
    with pytest.raises(ValueError, match="ITIF_TRITON_MAX_BM='100': choose 16, 32, 64 or 128"):
        tg.max_block_rows()


def test_enabled_needs_the_switch_and_a_runnable_place(monkeypatch):
    monkeypatch.delenv(tg.ENV, raising=False)
    assert not tg.enabled(CPU, torch.float32)
    monkeypatch.setenv(tg.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tg.enabled(CPU, torch.float32)  # compiled Triton needs a GPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tg.enabled(CPU, torch.float32)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert tg.enabled(cuda, torch.float16) and tg.enabled(cuda, torch.bfloat16)
        assert not tg.enabled(cuda, torch.float32)


def _operands(device, dtype, K=40, N=48, rows=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g).to(device, dtype)
    w = torch.randn(5, N, K, generator=g).to(device, dtype)
    b = torch.randn(3, N, generator=g).to(device, dtype)
    bslot = torch.randint(0, 3, (rows,), generator=g).to(device)
    return x, w, b, bslot


@pytest.mark.parametrize("act", sorted(tg.ACT_CODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_epilogue_matches_product_bias_activation(act, dtype):
    if torch.cuda.is_available() and dtype == torch.float32:
        pytest.skip("float32 is not among the kernel's CUDA dtypes")
    dev = torch.device("cuda") if torch.cuda.is_available() else CPU
    x, w, b, bslot = _operands(dev, dtype)
    bm = tg.block_rows(max(e - s for s, e in zip(RAGGED.start, RAGGED.end)))
    tiles = torch.from_numpy(tg.tile_table(RAGGED, bm)).to(dev)
    y = tg.run(x, w, tiles, bm, b, bslot, act)
    ref = _reference(x.cpu(), w.cpu(), RAGGED, b.cpu(), bslot.cpu(), act)
    assert y.dtype == dtype and y.shape == (300, 48)
    # float32: the sum's order only; float16: one rounding of values up to ~25
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double().cpu(), ref, atol=tol, rtol=tol)
    # without bias or activation: the product alone, into a given output
    out = torch.full_like(y, float("nan"))
    assert tg.run(x, w, tiles, bm, out=out) is out
    torch.testing.assert_close(out.double().cpu(), _reference(x.cpu(), w.cpu(), RAGGED),
                               atol=tol, rtol=tol)


@pytest.mark.gpu
def test_autotuned_launch_matches(monkeypatch):
    monkeypatch.setenv(tg.AUTOTUNE_ENV, "1")
    dev = torch.device("cuda")
    x, w, b, bslot = _operands(dev, torch.float16)
    bm = tg.block_rows(210)
    tiles = torch.from_numpy(tg.tile_table(RAGGED, bm)).to(dev)
    y = tg.run(x, w, tiles, bm, b, bslot, "gelu")
    ref = _reference(x.cpu(), w.cpu(), RAGGED, b.cpu(), bslot.cpu(), "gelu")
    torch.testing.assert_close(y.double().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_k_not_a_multiple_of_the_step_and_rows_past_the_tiles_untouched():
    """K = 50 takes the masked K loop; a tile table covering rows 0-20 of 30 leaves 20-29 as
    they were (the kernel writes exactly its tiles' rows)."""
    dev = torch.device("cuda") if torch.cuda.is_available() else CPU
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    x, w, _, _ = _operands(dev, dtype, K=50, N=40, rows=30, seed=3)
    segs = Segments((0, 7), (7, 20), (4, 1))
    tiles = torch.from_numpy(tg.tile_table(segs, 16)).to(dev)
    out = torch.zeros(30, 40, dtype=dtype, device=dev)
    tg.run(x, w, tiles, 16, out=out)
    ref = _reference(x[:20].cpu(), w.cpu(), segs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:20].double().cpu(), ref, atol=tol, rtol=tol)
    assert not out[20:].any()


COMPILE_SM90 = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from itif.runtime import _triton_kernels as K
sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "out_ptr": "*fp16", "tiles_ptr": "*i64",
       "bias_ptr": "*fp16", "bslot_ptr": "*i64", "N": "i32", "fill": "i32", "K": "constexpr",
       "HAS_BIAS": "constexpr", "ACT": "constexpr", "BM": "constexpr", "BN": "constexpr",
       "BK": "constexpr"}
# what a launch specialises on aligned tensors and N % 16 == 0 (bert-base's widths)
attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 6)}
out = []
for bn, bk, warps, stages in K.CONFIGS + (K.FIXED,):
    for k, bias, act in ((768, True, 0), (768, True, 1), (768, True, 2), (3072, False, 0),
                         (50, True, 3)):
        src = ASTSource(fn=K.seg_gemm, signature=sig, attrs=attrs, constexprs=dict(
            K=k, HAS_BIAS=bias, ACT=act, BM=128, BN=bn, BK=bk))
        c = compile(src, target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=warps, num_stages=stages))
        ptx = c.asm["ptx"]
        out.append(dict(cfg=[bn, bk, warps, stages], k=k, shared=c.metadata.shared,
                        wgmma="wgmma.mma_async" in ptx, cp_async="cp.async" in ptx))
json.dump(dict(configs=len(K.CONFIGS) + 1, rows=out), sys.stdout)
"""


def test_kernel_compiles_for_sm90_as_a_pipelined_wgmma_loop():
    """Without a GPU, Triton still compiles the kernel for the H100 (sm_90, its own ptxas):
    every configuration the autotuner tries and every epilogue builds, and with aligned
    operands the K loop runs on Hopper's warpgroup MMA fed by asynchronous copies (a
    pipelined loop), in the shared memory an SM has."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    rows = got["rows"]
    assert got["configs"] >= 2 and len(rows) == 5 * got["configs"]
    for r in rows:
        assert r["wgmma"], r
        assert r["shared"] <= 227 * 1024, r
        if r["k"] % r["cfg"][1] == 0:
            assert r["cp_async"], r  # the multiple-of-BK loop is pipelined


# ---- the forward -----------------------------------------------------------------------------
def _engine(preset, hf_factory, n=3, **kw):
    models = {f"t{i}": hf_factory(preset, 2 + i, seed=40 + i) for i in range(n)}
    eng = itif.Engine(preset, **kw)
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    return eng, models


@pytest.mark.parametrize("preset", ["bert-tiny", "albert-tiny", "vit-tiny"])
def test_fused_forward_with_the_kernel_equals_hf(preset, hf_factory, monkeypatch):
    """ITIF_TRITON_GEMM=1: every backbone product runs through the kernel (the batch packs a
    tile table per slot table) and no ``bias_act`` pass is left but the pooler's, yet each
    request still matches its own tenant's Hugging Face model."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter's test; the GPU's is below")
    monkeypatch.setenv(tg.ENV, "1")
    eng, models = _engine(preset, hf_factory)
    rng = np.random.default_rng(3)
    names = list(models)
    reqs = [random_request(eng.spec, names[i % 3], rng,
                           length=None if not eng.spec.is_text else [5, 17, 17, 40, 1][i])
            for i in range(5)]
    with (mock.patch.object(ops, "bias_act", wraps=ops.bias_act) as bias_act,
          mock.patch.object(tg, "run", wraps=tg.run) as run):
        results = eng.infer(reqs)
    # every backbone bias and activation went into the kernel's epilogue; the one bias_act
    # left is the pooler's (bias and tanh, after its run_gemm), which BERT and ALBERT have
    assert [c.args[2] for c in bias_act.call_args_list] == (["tanh"] if eng.spec.is_text else [])
    per_layer = 4 * eng.spec.layers
    assert run.call_count >= per_layer
    for i, (res, req) in enumerate(zip(results, reqs)):
        d = max_diff(res, reference(models[req.tenant], req))
        assert d <= 1e-4, f"request {i} of {req.tenant}: max abs diff {d:.3g}"


def _two_tenants_switched_on(hf_factory, monkeypatch, n: int, length: int, seed: int):
    """ITIF_TRITON_GEMM=1, a bert-tiny engine with tenants t0 and t1, and ``n`` requests of
    ``length`` tokens alternating between them."""
    monkeypatch.setenv(tg.ENV, "1")
    eng, _ = _engine("bert-tiny", hf_factory, n=2)
    rng = np.random.default_rng(seed)
    return eng, [random_request(eng.spec, f"t{i % 2}", rng, length=length) for i in range(n)]


def test_smaller_tiles_are_part_of_the_structure(hf_factory, monkeypatch):
    """ITIF_TRITON_MAX_BM=16: the batch cuts its 40-row requests into tiles of 16 rows or fewer
    (kept with the batch, read by the forward), a structure of its own beside the 128-row
    one, and the same answers."""
    eng, reqs = _two_tenants_switched_on(hf_factory, monkeypatch, n=2, length=40, seed=9)
    with mock.patch.object(tg, "run", wraps=tg.run) as run:
        wide = eng.infer(reqs)
        assert {c.args[3] for c in run.call_args_list} == {64}  # 40 rows: one 64-row tile
        run.reset_mock()
        monkeypatch.setenv(tg.MAX_BM_ENV, "16")
        narrow = eng.infer(reqs)
        assert {c.args[3] for c in run.call_args_list} == {16}
        assert all(c.args[2].numel() == 3 * 3 * 2 for c in run.call_args_list)  # 3 tiles each
    for a, b in zip(wide, narrow):
        np.testing.assert_allclose(a.last_hidden_state, b.last_hidden_state, atol=1e-5)


def test_switch_is_read_when_a_batch_is_prepared(hf_factory, monkeypatch):
    """The same structure prepared with and without the switch: two cache entries, tile tables
    only in the one prepared with it, and the same answers from both."""
    eng, reqs = _two_tenants_switched_on(hf_factory, monkeypatch, n=4, length=12, seed=5)
    with mock.patch.object(tg, "run", wraps=tg.run) as run:
        fused = eng.infer(reqs)
        assert run.call_count > 0
        monkeypatch.delenv(tg.ENV)
        plain = eng.infer(reqs)
        n = run.call_count
        plain_again = eng.infer(reqs)
        assert run.call_count == n  # the second structure has no tile tables
    for a, b, c in zip(fused, plain, plain_again):
        np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
        np.testing.assert_array_equal(b.logits, c.logits)


@pytest.mark.gpu
@pytest.mark.parametrize(("preset", "dtype"), [
    ("bert-tiny", "float16"), ("albert-tiny", "float16"), ("vit-tiny", "float16"),
    ("bert-small", "bfloat16")])
@pytest.mark.usefixtures("exact_float32_cuda")
def test_cuda_kernel_forward_within_tolerance_of_hf_float32(preset, dtype, monkeypatch):
    monkeypatch.setenv(tg.ENV, "1")
    spec = BERT_SMALL if preset == "bert-small" else PRESETS[preset]
    with mock.patch.object(tg, "run", wraps=tg.run) as run:
        _check_dtype(spec, dtype, "cuda", reference_on_device, logits_atol=LOGITS_ATOL_GPU,
                     models=_tenants(spec, "cuda"))
    assert run.call_count >= 4 * spec.layers


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["bert-tiny", "vit-tiny"])
def test_cuda_kernel_under_graphs_bit_identical_to_eager(preset, hf_factory, monkeypatch):
    monkeypatch.setenv(tg.ENV, "1")
    eng, _ = _engine(preset, hf_factory, device="cuda", dtype="float16", cuda_graphs="on")
    rng = np.random.default_rng(2)
    reqs = [random_request(eng.spec, f"t{i % 3}", rng, length=[5, 17, 17, 40, 3, 64][i])
            for i in range(6)]
    before = eng._graphs.replays
    on = eng.infer(reqs)
    on_again = eng.infer(reqs)
    assert eng._graphs.replays >= before + 2
    eng.cuda_graphs = False
    off = eng.infer(reqs)
    for a, b, c in zip(on, on_again, off):
        np.testing.assert_array_equal(a.logits, c.logits)
        np.testing.assert_array_equal(b.last_hidden_state, c.last_hidden_state)

