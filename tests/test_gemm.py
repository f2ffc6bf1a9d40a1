"""GEMM plans (``itif.runtime.gemm``): which backend a segment list gets, and that every backend
computes exactly what one ``torch.mm`` per segment computes. CPU here; gpu-marked ones on CUDA."""

from __future__ import annotations

import zlib

import pytest
import torch

from itif.runtime.gemm import (
    BACKENDS,
    Segments,
    _weight_first,
    broadcast_rows,
    grouped_linear,
    grouped_mm_supported,
    plan_gemm,
)


def _segs(start, end, slot) -> Segments:
    return Segments(tuple(start), tuple(end), tuple(slot))


# (segments, the backend the chooser must pick on the CPU in float32, backends that can run it)
CASES = {
    "one_slot": (_segs([0], [32], [3]), "mm", {"mm", "loop"}),
    "consecutive": (_segs([0, 8, 16, 24], [8, 16, 24, 32], [1, 2, 3, 4]), "bmm",
                    {"bmm", "grouped_mm", "loop"}),
    "slot_step_2": (_segs([0, 8, 16, 24], [8, 16, 24, 32], [0, 2, 4, 6]), "bmm",
                    {"bmm", "grouped_mm", "loop"}),
    "one_row_each": (_segs(range(32), range(1, 33), range(32)), "bmm",
                     {"bmm", "grouped_mm", "loop"}),
    "increasing_unequal": (_segs([0, 5, 17], [5, 17, 32], [0, 1, 5]), "grouped_mm",
                           {"grouped_mm", "loop"}),
    "equal_uneven_slots": (_segs([0, 8, 16, 24], [8, 16, 24, 32], [0, 1, 3, 4]), "grouped_mm",
                           {"grouped_mm", "loop"}),
    "decreasing": (_segs([0, 8, 16, 24], [8, 16, 24, 32], [4, 3, 2, 1]), "loop", {"loop"}),
    "arbitrary": (_segs([0, 7, 13, 30], [7, 13, 30, 32], [4, 0, 5, 1]), "loop", {"loop"}),
    "sparse_slots": (_segs([0, 10], [10, 32], [0, 63]), "loop", {"loop"}),
    "far_slots_equal": (_segs([0, 16], [16, 32], [0, 63]), "bmm", {"bmm", "loop"}),
}


def _loop_ref(x, w, segs):
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float64)
    for a, b, c in zip(segs.start, segs.end, segs.slot):
        y[a:b] = x[a:b].double() @ w[c].double().t()
    return y


@pytest.mark.parametrize("case", CASES)
def test_chooser_picks_the_fewest_launches(case):
    segs, want, _ = CASES[case]
    plan = plan_gemm(segs, 32, torch.device("cpu"), torch.float32)
    assert plan.backend == want
    assert plan.launches == (len(segs) if want == "loop" else 1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_that_can_run_a_plan_matches_the_loop(case, backend):
    segs, _, able = CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))  # same seed in every process
    x = torch.randn(32, 16, generator=g)
    w = torch.randn(64, 24, 16, generator=g)
    if backend not in able:
        with pytest.raises(ValueError, match="cannot run"):
            grouped_linear(x, w, segs, backend=backend)
        return
    y = grouped_linear(x, w, segs, backend=backend)
    torch.testing.assert_close(y.double(), _loop_ref(x, w, segs), atol=1e-5, rtol=1e-5)
    out = torch.full((32, 24), float("nan"))
    assert grouped_linear(x, w, segs, backend=backend, out=out) is out
    assert not out.isnan().any(), "every row must be written"
    torch.testing.assert_close(out, y)


def test_grouped_offsets_count_empty_slots():
    plan = plan_gemm(_segs([0, 5, 17], [5, 17, 32], [1, 2, 4]), 32, backend="grouped_mm")
    assert (plan.lo, plan.hi) == (1, 4)
    assert plan.offs == (5, 17, 17, 32)  # slot 3 is an empty group


def test_plans_reject_segments_that_do_not_tile_the_rows():
    with pytest.raises(ValueError, match="do not tile"):
        plan_gemm(_segs([0, 10], [8, 32], [0, 1]), 32)
    with pytest.raises(ValueError, match="do not tile"):
        plan_gemm(_segs([0], [30], [0]), 32)
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        plan_gemm(_segs([0], [32], [0]), 32, backend="magic")


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x[:, :15].contiguous(), w), "w has K=16 but x has K=15"),
    (lambda x, w: (x, w.double()), "w is torch.float64"),
    (lambda x, w: (x, w[:2]), "slot 3 is not within w's capacity 2"),
])
def test_grouped_linear_checks_its_operands(bad, match):
    x, w = bad(torch.randn(32, 16), torch.randn(6, 24, 16))
    with pytest.raises(ValueError, match=match):
        grouped_linear(x, w, _segs([0], [32], [3]))


def test_broadcast_rows_is_a_view_of_the_buffer():
    buf = torch.randn(8, 5)
    plan = plan_gemm(_segs([0, 4, 8], [4, 8, 12], [1, 3, 5]), 12)
    v = broadcast_rows(buf, plan)
    assert v.shape == (3, 1, 5) and v.data_ptr() == buf[1].data_ptr()  # no copy
    x = torch.zeros(12, 5)
    x.view(3, 4, 5).add_(v)
    torch.testing.assert_close(x, buf[torch.tensor([1, 3, 5])].repeat_interleave(4, 0))
    assert broadcast_rows(buf, plan_gemm(_segs([0, 3], [3, 12], [0, 1]), 12)) is None


def test_grouped_mm_support_is_dtype_aware():
    assert grouped_mm_supported(torch.device("cpu"), torch.float32) == hasattr(torch, "_grouped_mm")
    assert not grouped_mm_supported(torch.device("cpu"), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_cuda_backends_match_the_loop(case, dtype):
    segs, _, able = CASES[case]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 64, generator=g).to("cuda", dtype)
    w = torch.randn(64, 48, 64, generator=g).to("cuda", dtype)
    ref = _loop_ref(x.cpu().float(), w.cpu().float(), segs)
    chosen = plan_gemm(segs, 32, x.device, dtype).backend
    for backend in able:
        if backend == "grouped_mm" and not grouped_mm_supported(x.device, dtype):
            continue
        y = grouped_linear(x, w, segs, backend=backend).double().cpu()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y, ref, atol=tol, rtol=tol, msg=f"{backend} ({chosen})")


@pytest.mark.parametrize("case", ("one_slot", "consecutive", "one_row_each"))
def test_wide_few_row_products_weight_first_match_the_loop(case):
    """A vocabulary-head shape (N >= 8 K, few rows a segment) runs as ``(w @ x.T).T`` on the
    CPU (``_weight_first``); it computes what the loop computes, into ``out`` when given."""
    segs, _, _ = CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    x, w = torch.randn(32, 16, generator=g), torch.randn(64, 8 * 16, 16, generator=g)
    plan = plan_gemm(segs, 32, torch.device("cpu"), torch.float32)
    rows = plan.rows if plan.backend == "mm" else plan.L
    assert _weight_first(x, w.shape[1], rows)
    out = torch.full((32, w.shape[1]), float("nan"))
    assert grouped_linear(x, w, segs, out=out) is out
    torch.testing.assert_close(out.double(), _loop_ref(x, w, segs), atol=1e-5, rtol=1e-5)
    assert not _weight_first(x, 8 * 16 - 1, rows)  # narrower: the plain product
