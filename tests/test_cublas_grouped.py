"""itif.runtime.cublas_grouped: every segment of a product in one cublasGemmGroupedBatchedEx call.

On the CPU the call goes to a stand-in that does what cuBLAS documents, on host memory: for each
problem, ``C = op(A) @ op(B)`` in column-major terms with the sizes, leading dimensions and
pointers it was handed. That checks everything itif packs (the column-major mapping, the
per-problem arrays, the pointer arithmetic) against the loop of ``torch.mm``. On a GPU the real
function runs against the loop (and the forward against Hugging Face).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from itif.runtime import cublas_grouped, gemm
from itif.runtime.gemm import Segments, plan_gemm

_NP = {0: (np.float32, 4), 2: (np.float16, 2)}


def _matrix(address: int, rows: int, cols: int, ld: int, dtype_code: int) -> np.ndarray:
    """A column-major ``rows x cols`` matrix with leading dimension ``ld`` at ``address``."""
    dt, size = _NP[dtype_code]
    n = ld * (cols - 1) + rows
    flat = np.frombuffer((ctypes.c_char * (n * size)).from_address(address), dtype=dt)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (size, ld * size))


class StandIn:
    """cublasGemmGroupedBatchedEx on host memory (every group of size 1, beta 0)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, handle, ta, tb, m, n, k, alpha, A, atype, lda, B, btype, ldb, beta, C,
                 ctype, ldc, count, sizes, compute):
        self.calls += 1
        ints = lambda addr: list((ctypes.c_int * count).from_address(addr))  # noqa: E731
        ptrs = lambda addr: list((ctypes.c_int64 * count).from_address(addr))  # noqa: E731
        ta, tb, m, n, k = ints(ta), ints(tb), ints(m), ints(n), ints(k)
        lda, ldb, ldc, sizes = ints(lda), ints(ldb), ints(ldc), ints(sizes)
        alpha = list((ctypes.c_float * count).from_address(alpha))
        beta = list((ctypes.c_float * count).from_address(beta))
        assert sizes == [1] * count and compute == 68 and atype == btype == ctype
        for i, (pa, pb, pc) in enumerate(zip(ptrs(A), ptrs(B), ptrs(C))):
            a_rows, a_cols = (k[i], m[i]) if ta[i] == 1 else (m[i], k[i])
            b_rows, b_cols = (n[i], k[i]) if tb[i] == 1 else (k[i], n[i])
            a = _matrix(pa, a_rows, a_cols, lda[i], atype).astype(np.float64)
            b = _matrix(pb, b_rows, b_cols, ldb[i], btype).astype(np.float64)
            c = _matrix(pc, m[i], n[i], ldc[i], ctype)
            prod = alpha[i] * ((a.T if ta[i] else a) @ (b.T if tb[i] else b))
            if beta[i] != 0:  # as in BLAS, C is not read when beta is 0
                prod = prod + beta[i] * c
            c[...] = prod.astype(c.dtype)
        return 0


def _segments(rows_per_slot: dict[int, int]) -> Segments:
    start, end, slot, s = [], [], [], 0
    for sl, r in rows_per_slot.items():
        start.append(s)
        end.append(s + r)
        slot.append(sl)
        s += r
    return Segments(tuple(start), tuple(end), tuple(slot))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_call_equals_the_loop_of_products(dtype):
    g = torch.Generator().manual_seed(0)
    N, K = 24, 40
    w = torch.randn(9, N, K, generator=g).to(dtype)
    segs = _segments({7: 5, 2: 1, 4: 13, 0: 3, 8: 2})  # ragged, slots out of order
    x = torch.randn(segs.end[-1], K, generator=g).to(dtype)
    want = gemm.run_gemm(x.float(), w.float(), plan_gemm(segs, x.shape[0], backend="loop"))
    fake = StandIn()
    out = torch.full((x.shape[0], N), float("nan"), dtype=dtype)
    got = cublas_grouped.run(x, w, segs.start, segs.end, segs.slot, out, function=fake)
    assert got is out and fake.calls == 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_problems_are_cached_and_describe_the_column_major_mapping():
    p = cublas_grouped.problems((0, 3), (3, 8), (5, 1), N=16, K=8, slot_stride=128, element=2)
    assert p is cublas_grouped.problems((0, 3), (3, 8), (5, 1), 16, 8, 128, 2)
    assert list(p.m) == [16, 16] and list(p.n) == [3, 5] and list(p.k) == [8, 8]
    assert list(p.lda) == list(p.ldb) == [8, 8] and list(p.ldc) == [16, 16]
    assert list(p.transa) == [1, 1] and list(p.transb) == [0, 0]
    # byte offsets: weight slot, input rows, output rows
    assert p.offsets.tolist() == [[5 * 128 * 2, 1 * 128 * 2], [0, 3 * 8 * 2], [0, 3 * 16 * 2]]


def test_a_refusal_is_an_error_naming_the_status():
    w = torch.zeros(2, 4, 4)
    x = torch.zeros(3, 4)
    with pytest.raises(cublas_grouped.Refused, match="status 7"):
        cublas_grouped.run(x, w, (0, 1), (1, 3), (0, 1), torch.zeros(3, 4),
                           function=lambda *a: 7)


def test_the_loop_plan_takes_it_when_enabled(monkeypatch):
    """run_gemm sends a loop plan to the grouped call when it is enabled, and keeps the loop of
    torch.mm otherwise (here: the CPU)."""
    fake = StandIn()
    monkeypatch.setattr(cublas_grouped, "_function", lambda: fake)
    N, K = 8, 12
    w = torch.randn(4, N, K)
    segs = _segments({3: 2, 0: 5})
    plan = plan_gemm(segs, 7, backend="loop")
    x = torch.randn(7, K)
    want = gemm.run_gemm(x, w, plan)
    assert fake.calls == 0
    monkeypatch.setattr(cublas_grouped, "enabled", lambda device, dtype: True)
    monkeypatch.setattr(gemm.cpu_gemm, "applies", lambda *a: False)
    got = gemm.run_gemm(x, w, plan)
    assert fake.calls == 1
    torch.testing.assert_close(got, want)


def test_a_refused_call_leaves_the_loop_to_answer_from_then_on(monkeypatch, caplog):
    """A cuBLAS that refuses the grouped call (a status other than success) does not fail the
    product: the loop answers it, and the next products on that device and
    dtype go straight to the loop, with one warning."""
    monkeypatch.setattr(cublas_grouped, "_refused", set())
    monkeypatch.setenv(cublas_grouped.ENV, "cublas")  # float32 goes to it only when asked
    monkeypatch.setattr(cublas_grouped, "_function", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    real_enabled = cublas_grouped.enabled
    # a CPU tensor stands in for a CUDA one: enabled() is asked about a CUDA device, index None
    monkeypatch.setattr(cublas_grouped, "enabled",
                        lambda device, dtype: real_enabled(torch.device("cuda"), dtype))
    monkeypatch.setattr(gemm.cpu_gemm, "applies", lambda *a: False)
    tries = []

    def refuse(*a, **k):
        tries.append(1)
        raise cublas_grouped.Refused("cublasGemmGroupedBatchedEx returned status 7")

    monkeypatch.setattr(cublas_grouped, "run", refuse)
    w = torch.randn(4, 8, 12)
    x = torch.randn(7, 12)
    plan = plan_gemm(_segments({3: 2, 0: 5}), 7, backend="loop")
    want = torch.cat([x[:2] @ w[3].T, x[2:] @ w[0].T])
    with caplog.at_level("WARNING", logger="itif.runtime"):
        torch.testing.assert_close(gemm.run_gemm(x, w, plan), want)
        torch.testing.assert_close(gemm.run_gemm(x, w, plan), want)
    assert len(tries) == 1
    assert len([r for r in caplog.records if "refused" in r.message]) == 1


def test_any_other_error_of_the_call_propagates_and_keeps_it_on(monkeypatch):
    """Out of memory (say) while packing the call is the forward's error, as the loop's would
    be; it does not turn the grouped call off for the rest of the process."""
    monkeypatch.setattr(cublas_grouped, "_refused", set())

    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(cublas_grouped, "run", oom)
    segs = _segments({1: 2, 0: 3})
    with pytest.raises(RuntimeError, match="out of memory"):
        cublas_grouped.run_or_refuse(torch.randn(5, 4), torch.randn(2, 6, 4), segs,
                                     torch.empty(5, 6))
    assert cublas_grouped._refused == set()


def test_on_by_default_on_cuda_in_half_precision_off_when_asked_and_on_the_cpu(monkeypatch):
    monkeypatch.setattr(cublas_grouped, "_function", lambda: object())  # a cuBLAS that has it
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv(cublas_grouped.ENV, raising=False)
    assert cublas_grouped.enabled(torch.device("cuda"), torch.float16)
    assert cublas_grouped.enabled(torch.device("cuda"), torch.bfloat16)
    assert not cublas_grouped.enabled(torch.device("cuda"), torch.float32)  # graphs = eager
    monkeypatch.setenv(cublas_grouped.ENV, "loop")
    assert not cublas_grouped.enabled(torch.device("cuda"), torch.float16)
    monkeypatch.setenv(cublas_grouped.ENV, "cublas")
    assert cublas_grouped.enabled(torch.device("cuda"), torch.bfloat16)
    assert cublas_grouped.enabled(torch.device("cuda"), torch.float32)
    assert not cublas_grouped.enabled(torch.device("cuda"), torch.int8)
    assert not cublas_grouped.enabled(torch.device("cpu"), torch.float16)
    monkeypatch.setattr(cublas_grouped, "_function", lambda: None)  # older than 12.5
    assert not cublas_grouped.enabled(torch.device("cuda"), torch.float16)
    x, w = torch.zeros(4, 8), torch.zeros(2, 6, 8)
    assert cublas_grouped.usable(x, w, torch.zeros(4, 6))
    assert not cublas_grouped.usable(x.t().contiguous().t(), w, torch.zeros(4, 6))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_one_call_equals_the_loop_and_never_synchronises(dtype):
    assert cublas_grouped._function() is not None, "this cuBLAS lacks cublasGemmGroupedBatchedEx"
    g = torch.Generator().manual_seed(1)
    N, K = 768, 768
    w = torch.randn(40, N, K, generator=g).to(dtype).cuda()
    segs = _segments({39: 61, 3: 1, 17: 130, 0: 7, 22: 64})
    x = torch.randn(segs.end[-1], K, generator=g).to(dtype).cuda()
    want = gemm.run_gemm(x, w, plan_gemm(segs, x.shape[0], backend="loop"))
    out = torch.empty_like(want)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cublas_grouped.run(x, w, segs.start, segs.end, segs.slot, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-3}[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@requires_cuda
def test_cuda_forward_with_the_grouped_call_answers_as_with_the_loop(monkeypatch):
    """A ragged float16 batch of 4 full fine-tunes: the engine's answers with the grouped call
    (the default) match those of the loop (ITIF_GROUPED_GEMM=loop), and the grouped call did
    run."""
    import itif  # noqa: PLC0415
    from itif.backbones.random import random_weights  # noqa: PLC0415

    eng = itif.Engine("bert-tiny", device="cuda", dtype="float16", cuda_graphs="off")
    for i in range(4):
        eng.add_tenant(f"t{i}", random_weights(eng.spec, num_labels=3, seed=i))
    rng = np.random.default_rng(4)
    reqs = [itif.Request(f"t{i % 4}", input_ids=rng.integers(0, eng.spec.vocab_size, n))
            for i, n in enumerate((5, 40, 17, 3, 64, 9, 22, 1))]
    calls = []
    real = cublas_grouped.run
    monkeypatch.setattr(cublas_grouped, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(cublas_grouped.ENV, "loop")
    want = eng.infer(reqs)
    assert not calls
    monkeypatch.delenv(cublas_grouped.ENV)
    got = eng.infer(reqs)
    assert calls, "no product went through the grouped call"
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.logits, b.logits, atol=2e-2, rtol=2e-2)


def test_python_calls_do_not_grow_with_the_segments(monkeypatch):
    """What the grouped call is for: the torch calls a product makes from Python (each a chance
    to give the GIL away under load) stay flat with the segment count, where the loop's grow
    with it (TorchFunctionMode counts every call and tensor attribute read from Python)."""
    from torch.overrides import TorchFunctionMode  # noqa: PLC0415

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(gemm.cpu_gemm, "applies", lambda *a: False)
    N, K = 32, 16
    w = torch.randn(16, N, K)
    counts = {}
    for g in (4, 16):
        segs = _segments({i: 2 + i for i in range(g)})
        x = torch.randn(segs.end[-1], K)
        with Count() as loop:
            gemm.run_gemm(x, w, plan_gemm(segs, x.shape[0], backend="loop"))
        out = torch.empty(x.shape[0], N)
        with Count() as grouped:
            cublas_grouped.run(x, w, segs.start, segs.end, segs.slot, out, function=StandIn())
        counts[g] = (loop.n, grouped.n)
    assert counts[16][1] == counts[4][1] < 20, counts  # flat
    assert counts[16][0] - counts[4][0] >= 2 * 12, counts  # the loop: 2+ calls a segment
