"""The CPU few-rows GEMM kernel (``kernels/seg_gemm_cpu.cpp``, ``itif.runtime.cpu_gemm``):
equal to torch's product per segment, in place over the weight buffer, and chosen by
``run_gemm`` exactly where its rule says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from itif.runtime import cpu_gemm
from itif.runtime.gemm import Segments, grouped_linear, plan_gemm

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the kernel needs AVX2/FMA; without it run_gemm stays on MKL (tested below)")


@pytest.fixture(scope="module")
def built():
    assert cpu_gemm.ensure(), cpu_gemm.state["why_not"]  # a compiler is part of the test machine


def _reference(x, w, start, end, slot, out):
    ref = out.clone()
    for s, e, k in zip(start, end, slot):
        ref[s:e] = x[s:e] @ w[k].T
    return ref


@pytest.mark.parametrize("rows,K,N", [
    ((16, 16, 16), 512, 1536),  # a decode step's segments
    ((1, 5, 17, 33), 64, 50),  # partial chunks, N not a multiple of 6, chunks over 16
    ((3,), 7, 5),  # one partial chunk, odd K, N smaller than one block of 6
    ((64, 2, 40), 96, 200),
])
def test_equals_torch_per_segment(built, rows, K, N):
    g = torch.Generator().manual_seed(sum(rows) + K + N)
    cap = len(rows) + 2
    w = torch.randn(cap, N, K, generator=g)
    starts, ends, slots, at = [], [], [], 0
    for i, r in enumerate(rows):
        starts.append(at)
        ends.append(at + r)
        slots.append((2 * i + 1) % cap)  # slots out of order, not all used
        at += r
    x = torch.randn(at + 3, K, generator=g)  # 3 rows outside every segment
    out = torch.full((at + 3, N), 7.0)
    ref = _reference(x, w, starts, ends, slots, out)
    cpu_gemm.seg_gemm(x, w, starts, ends, slots, out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    assert (out[at:] == 7.0).all()  # rows outside the segments untouched


def test_a_shared_slot_and_the_same_weights_twice(built):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 30, 40, generator=g)
    x = torch.randn(24, 40, generator=g)
    out = torch.empty(24, 30)
    cpu_gemm.seg_gemm(x, w, [0, 8], [8, 24], [1, 1], out)
    torch.testing.assert_close(out, x @ w[1].T, rtol=1e-5, atol=1e-4)


def test_bad_operands_raise_instead_of_reading_out_of_bounds(built):
    w = torch.randn(2, 8, 16)
    x = torch.randn(10, 16)
    out = torch.empty(10, 8)
    with pytest.raises(RuntimeError, match="slot out of the buffer"):
        cpu_gemm.seg_gemm(x, w, [0], [4], [2], out)
    with pytest.raises(RuntimeError, match="segment out of rows"):
        cpu_gemm.seg_gemm(x, w, [0], [11], [0], out)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_gemm.seg_gemm(x.double(), w.double(), [0], [4], [0], out.double())


def test_run_gemm_uses_it_for_few_rows_only(built, monkeypatch):
    """``run_gemm`` sends a product to the kernel when its longest segment has MIN_ROWS to
    MAX_ROWS rows, and to MKL otherwise; both agree with torch."""
    calls = []
    real = cpu_gemm.seg_gemm
    monkeypatch.setattr(cpu_gemm, "seg_gemm", lambda *a: calls.append(a[2]) or real(*a))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 24, 32, generator=g)
    for rows, expect in ((1, False), (cpu_gemm.MIN_ROWS, True), (16, True),
                         (cpu_gemm.MAX_ROWS, True), (cpu_gemm.MAX_ROWS + 1, False)):
        calls.clear()
        x = torch.randn(3 * rows, 32, generator=g)
        segs = Segments((0, rows, 2 * rows), (rows, 2 * rows, 3 * rows), (0, 1, 2))
        assert plan_gemm(segs, 3 * rows).max_rows == rows
        y = grouped_linear(x, w, segs)
        ref = torch.cat([x[i * rows:(i + 1) * rows] @ w[i].T for i in range(3)])
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
        assert bool(calls) is expect, rows


def test_disabled_by_environment_runs_mkl():
    code = ("import torch; from itif.runtime import cpu_gemm; "
            "assert not cpu_gemm.ensure(); print(cpu_gemm.state['why_not'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ITIF_CPU_GEMM="0"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ITIF_CPU_GEMM=0" in out.stdout


# ---- the build lock a killed build leaves --------------------------------------------------------
def test_a_lock_left_by_a_dead_build_is_removed(tmp_path):
    """A process killed while building leaves build_dir/lock; torch's loader would wait on it
    forever (a daemon that never starts). One older than STALE_LOCK_S is removed."""
    import os  # noqa: PLC0415
    import time  # noqa: PLC0415

    from itif.runtime import cpu_gemm  # noqa: PLC0415

    assert cpu_gemm.clear_stale_lock(tmp_path, poll_s=0.01) is False  # no lock: nothing to do
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - cpu_gemm.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert cpu_gemm.clear_stale_lock(tmp_path, poll_s=0.01) is True
    assert not lock.exists()


def test_a_live_build_is_waited_for_and_a_stuck_one_given_up_on(tmp_path):
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from itif.runtime import cpu_gemm  # noqa: PLC0415

    lock = tmp_path / "lock"
    lock.touch()  # another process building: it releases the lock when done
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.perf_counter()
    assert cpu_gemm.clear_stale_lock(tmp_path, stale_s=30, poll_s=0.02) is False
    assert 0.25 < time.perf_counter() - t0 < 5
    lock.touch()  # a build that never finishes: removed once it is stale_s old
    t0 = time.perf_counter()
    assert cpu_gemm.clear_stale_lock(tmp_path, stale_s=0.4, poll_s=0.02) is True
    assert 0.35 < time.perf_counter() - t0 < 5 and not lock.exists()
