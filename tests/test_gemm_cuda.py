"""GPU tests of the per-slot GEMM backends (``itif.runtime.gemm_cuda``) against the loop.

Every backend either declines a plan (returns None) or matches one ``torch.mm`` per segment,
for f32/f16/bf16, under tenant mixes of distinct, uniform and skewed slots, with and without a
caller-provided ``out``. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from itif.runtime import gemm_cuda

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {  # (atol, rtol): different kernels sum K products in different orders
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-2, 1e-2),
    torch.bfloat16: (2.5e-1, 2e-2),
}
K, N, CAP = 64, 96, 8

# name -> (start, end, slot) over T = 128 rows
CASES = {
    "distinct_consecutive": ([0, 32, 64, 96], [32, 64, 96, 128], [2, 3, 4, 5]),
    "distinct_step_2": ([0, 32, 64, 96], [32, 64, 96, 128], [0, 2, 4, 6]),
    "distinct_arbitrary_equal": ([0, 32, 64, 96], [32, 64, 96, 128], [5, 0, 7, 3]),
    "distinct_unequal_sorted": ([0, 7, 7, 50, 51], [7, 7, 50, 51, 128], [0, 1, 2, 5, 7]),
    "distinct_unequal_unsorted": ([0, 7, 50, 51], [7, 50, 51, 128], [6, 1, 4, 0]),
    "uniform": ([0, 40, 90], [40, 90, 128], [3, 3, 3]),
    "skewed": ([0, 115, 120], [115, 120, 128], [1, 4, 6]),
    "spaced_rows": ([0, 40, 80], [24, 64, 104], [1, 2, 3]),
    "single_row_segments": ([0, 1, 2], [1, 2, 3], [7, 6, 5]),
    "empty": ([], [], []),
}
BACKENDS = ["loop", "single_mm", "bmm_consecutive", "pointer_batched", "grouped_mm",
            "streams"]


def _loop_ref(x, w, start, end, slot):
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for a, b, c in zip(start, end, slot):
        y[a:b] = x[a:b].float() @ w[c].float().t()
    return y


def _inputs(dtype, T=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype).cuda()
    w = (torch.randn(CAP, N, K, generator=g) / K**0.5).to(dtype).cuda()
    return x, w


def _covered(start, end, T):
    m = torch.zeros(T, dtype=torch.bool)
    for a, b in zip(start, end):
        m[a:b] = True
    return m.cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_loop(backend, case, dtype):
    start, end, slot = CASES[case]
    x, w = _inputs(dtype)
    fn = gemm_cuda.BACKENDS[backend]
    y = fn(x, w, start, end, slot)
    if y is None:
        assert backend not in ("loop", "streams"), f"{backend} must always apply"
        return
    atol, rtol = TOL[dtype]
    want = _loop_ref(x, w, start, end, slot)
    torch.testing.assert_close(y.float(), want, atol=atol, rtol=rtol)
    # into a caller's buffer: covered rows written, the others untouched
    out = torch.full((x.shape[0], N), 3.0, dtype=dtype, device="cuda")
    y2 = fn(x, w, start, end, slot, out=out)
    assert y2 is out
    cov = _covered(start, end, x.shape[0])
    torch.testing.assert_close(out[cov].float(), want[cov], atol=atol, rtol=rtol)
    assert bool((out[~cov] == 3.0).all())


@pytest.mark.parametrize("case", CASES)
def test_choose_runs_something_correct(case):
    start, end, slot = CASES[case]
    x, w = _inputs(torch.bfloat16)
    name, _ = gemm_cuda.choose(x, w, start, end, slot)
    assert name in gemm_cuda.BACKENDS
    y = gemm_cuda.grouped_linear_cuda(x, w, start, end, slot)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(y.float(), _loop_ref(x, w, start, end, slot), atol=atol, rtol=rtol)


def test_choose_policy():
    x, w = _inputs(torch.float16)
    assert gemm_cuda.choose(x, w, *CASES["uniform"])[0] == "single_mm"
    assert gemm_cuda.choose(x, w, *CASES["distinct_consecutive"])[0] == "bmm_consecutive"
    assert gemm_cuda.choose(x, w, *CASES["distinct_arbitrary_equal"])[0] == "pointer_batched"
    assert gemm_cuda.choose(x, w, *CASES["distinct_unequal_unsorted"])[0] == "streams"


def test_pointer_batched_arbitrary_slots():
    x, w = _inputs(torch.float16)
    assert gemm_cuda.linear_pointer_batched(x, w, *CASES["distinct_arbitrary_equal"]) is not None
    assert gemm_cuda.linear_pointer_batched(x, w, *CASES["skewed"]) is None  # unequal lengths


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0), reason="needs sm90")
def test_grouped_mm_skips_empty_groups():
    x, w = _inputs(torch.bfloat16)
    start, end, slot = CASES["distinct_unequal_sorted"]  # slots 3, 4, 6 have no rows
    y = gemm_cuda.linear_grouped_mm(x, w, start, end, slot)
    assert y is not None
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(y.float(), _loop_ref(x, w, start, end, slot), atol=atol, rtol=rtol)


def test_streams_order_with_the_current_stream():
    """Inputs written on a side stream just before, results read right after: no sync."""
    x, w = _inputs(torch.float16)
    start, end, slot = CASES["distinct_unequal_unsorted"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        x2 = x * 2
        y = gemm_cuda.linear_streams(x2, w, start, end, slot)
        z = y * 1  # consumed on the caller's stream
    torch.cuda.current_stream().wait_stream(s)
    atol, rtol = TOL[torch.float16]
    torch.testing.assert_close(z.float(), _loop_ref(x2, w, start, end, slot), atol=atol,
                               rtol=rtol)


def test_validation_on_gpu():
    x, w = _inputs(torch.float16)
    with pytest.raises(ValueError, match="w is on cpu but x is on cuda"):
        gemm_cuda.linear_pointer_batched(x, w.cpu(), [0], [128], [0])
    with pytest.raises(ValueError, match="slot 8 is not within w's capacity 8"):
        gemm_cuda.linear_streams(x, w, [0], [128], [8])
