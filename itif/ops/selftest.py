"""Kernel self-test: every CUDA kernel once against its torch reference, on the engine's device
and dtype, before the daemon serves.

``self_test(device, dtype)`` runs each op of ``itif.ops.dispatch.OPS`` through the CUDA backend
on small random inputs (a few rows, per-row slots of three tenants, a vectorisable and an odd
width, so both launch forms of each kernel run) and compares it with ``itif.ops.reference`` run
in float32 on the same rounded inputs, cast to the dtype, within about two storage ulps
(``TOLERANCE``). ``attention`` is checked through its own kernel, the fused masked softmax (the
rest of that op is torch's SDPA and bmm).

With ``record`` (the default) each result goes to ``itif.ops.dispatch``: an op whose kernel
failed to build, raised, or mismatched is disabled there (the reference runs it from then on,
and the fallback shows as the ``itif_kernel_fallback`` gauge and in the daemon's health
detail); an op that passed is recorded as such (gauge 0).

Runs anywhere: on a CPU device it only reports ``"reference (no CUDA)"`` for every op (that is
the design there, not a fallback) and returns at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from itif.ops import dispatch, reference
from itif.ops.reference import RotParam

log = logging.getLogger("itif.ops.selftest")

NO_CUDA = "reference (no CUDA)"

#: (atol, rtol) against the float32 oracle rounded to the dtype: twice the GPU tests' bounds.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 5e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3.2e-2, 2e-2),
}
WIDTHS: tuple[int, ...] = (64, 1030)  # vectorised + warp-per-row LN; unvectorised + block LN
SLOTS = (0, 2, 2, 1, 2, 0, 2)
ROWS = len(SLOTS)
CAPACITY = 3


@dataclass(frozen=True)
class KernelCheck:
    """One op's self-test result on one (device, dtype)."""

    op: str
    device: str
    dtype: str
    backend: str  # "cuda" (its kernel ran) or "reference"
    ok: bool  # False: the kernel failed to build, raised or mismatched; the op falls back
    detail: str = ""  # "" when it passed; else why (or NO_CUDA)
    max_error: float | None = None  # largest |kernel - oracle| seen
    seconds: float = 0.0


class _Mismatch(Exception):
    pass


def _close(got: torch.Tensor, want_f32: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    """Compare ``got`` with the float32 oracle rounded to ``dtype``; returns the max error."""
    atol, rtol = TOLERANCE[dtype]
    want = want_f32.to(dtype).float()
    got = got.float()
    if got.shape != want.shape:
        raise _Mismatch(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    ok = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    err = (got - want).abs().nan_to_num(nan=math.inf)
    max_err = float(err.max()) if err.numel() else 0.0
    if not bool(ok.all()):
        bad = int((~ok).sum())
        raise _Mismatch(f"{what}: {bad} of {ok.numel()} values off the reference "
                        f"(max |error| {max_err:.3g}, atol {atol:g}, rtol {rtol:g})")
    return max_err


class _Inputs:
    """Random inputs of one width on the device in ``dtype``; ``f32`` gives float32 twins."""

    def __init__(self, h: int, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed * 1009 + h)
        self.g, self.h, self.dtype, self.device = g, h, dtype, device
        self.slot = torch.tensor(SLOTS).to(device)  # three tenants, one of them most rows
        self.x = self.rand(ROWS, h)
        self.res = self.rand(ROWS, h)
        self.bias = RotParam(self.rand(CAPACITY, h), self.slot)
        self.gamma = RotParam(self.rand(CAPACITY, h) + 1, self.slot.flip(0).contiguous())
        self.beta = RotParam(self.rand(CAPACITY, h), torch.roll(self.slot, 1).contiguous())

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(self.dtype).to(self.device)

    @staticmethod
    def f32(p):
        if p is None:
            return None
        if isinstance(p, RotParam):
            return RotParam(p.buf.float(), p.slot)
        return p.float()


def _check_bias_act(be, i: _Inputs) -> float:
    err = 0.0
    for act in ("none", "gelu", "gelu_new", "relu", "silu", "tanh"):
        got = be.bias_act(i.x.clone(), i.bias, act)
        want = reference.bias_act(i.f32(i.x), i.f32(i.bias), act)
        err = max(err, _close(got, want, i.dtype, f"act={act}, width {i.h}"))
    return err


def _check_bias_residual(be, i: _Inputs) -> float:
    got = be.bias_residual(i.x.clone(), i.bias, i.res)
    want = reference.bias_residual(i.f32(i.x), i.f32(i.bias), i.f32(i.res))
    return _close(got, want, i.dtype, f"width {i.h}")


def _check_layernorm(be, i: _Inputs) -> float:
    err = 0.0
    for bias, res, keep in ((i.bias, i.res, False), (None, None, False), (i.bias, i.res, True)):
        x, x_ref = i.x.clone(), i.f32(i.x)
        got = be.bias_residual_layernorm(x, bias, res, i.gamma, i.beta, 1e-5, keep)
        want = reference.bias_residual_layernorm(x_ref, i.f32(bias), i.f32(res), i.f32(i.gamma),
                                                 i.f32(i.beta), 1e-5, keep)
        what = f"width {i.h}, bias={bias is not None}, keep_sum={keep}"
        err = max(err, _close(got, want, i.dtype, what))
        err = max(err, _close(x, x_ref, i.dtype, what + " (x after the call)"))
    return err


def _check_embed_text(be, i: _Inputs) -> float:
    vocab, npos = 30, 16
    word = RotParam(i.rand(CAPACITY, vocab, i.h), i.slot)
    pos = RotParam(i.rand(CAPACITY, npos, i.h), i.slot.flip(0).contiguous())
    typ = RotParam(i.rand(CAPACITY, 2, i.h), i.slot)
    ids = torch.randint(0, vocab, (ROWS,), generator=i.g).to(i.device)
    positions = torch.randint(0, npos, (ROWS,), generator=i.g).to(i.device)
    types = torch.randint(0, 2, (ROWS,), generator=i.g).to(i.device)
    got = be.embed_text(word, pos, typ, ids, positions, types)
    want = reference.embed_text(i.f32(word), i.f32(pos), i.f32(typ), ids, positions, types)
    return _close(got, want, i.dtype, f"width {i.h}")


def softmax_oracle(s: torch.Tensor, rows_per_seq: int, lengths, key_mask, scale: float):
    """What ``masked_softmax`` computes, in float32 torch (dead keys 0, no live key: zeros)."""
    rows, L = s.shape
    n = rows // rows_per_seq
    live = torch.ones(n, L, dtype=torch.bool, device=s.device)
    if lengths is not None:
        live &= torch.arange(L, device=s.device)[None] < lengths[:, None]
    if key_mask is not None:
        live &= key_mask.reshape(n, L)
    live = live.repeat_interleave(rows_per_seq, 0)
    z = (s.float() * scale).masked_fill(~live, float("-inf"))
    return torch.softmax(z, -1).nan_to_num(0.0)


def _check_attention(be, i: _Inputs) -> float:
    """The attention op's own kernel: the fused masked softmax (width = keys per row)."""
    n, heads, L = 3, 2, 5 if i.h < 100 else 33
    s = (torch.randn(n * heads * L, L, generator=i.g) * 3).to(i.dtype).to(i.device)
    lengths = torch.tensor([L, max(L - 2, 1), 0]).to(i.device)
    mask = (torch.rand(n, 1, 1, L, generator=i.g) < 0.7).to(i.device)
    err = 0.0
    for lm, km in ((None, None), (lengths, mask)):
        got = be.masked_softmax(s.clone(), heads * L, lm, km, 0.5)
        want = softmax_oracle(s, heads * L, lm, km, 0.5)
        err = max(err, _close(got, want, i.dtype, f"masked_softmax, {L} keys"))
    return err


CHECKS: dict[str, Callable[[object, _Inputs], float]] = {
    "bias_act": _check_bias_act,
    "bias_residual": _check_bias_residual,
    "bias_residual_layernorm": _check_layernorm,
    "embed_text": _check_embed_text,
    "attention": _check_attention,
}
assert tuple(CHECKS) == dispatch.OPS


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unavailable_reason() -> str:
    from itif.platform import cupy_module  # noqa: PLC0415

    if cupy_module() is None:
        return "CUDA kernels unavailable: CuPy does not import or sees no GPU"
    try:
        from itif.ops import cuda_loader  # noqa: PLC0415

        cuda_loader.kernel_files()
    except Exception as e:  # noqa: BLE001
        return f"CUDA kernels unavailable: {e}"
    return "CUDA kernels unavailable"


def self_test(
    device: torch.device | str,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    *,
    record: bool = True,
    seed: int = 0,
    backend=None,
) -> list[KernelCheck]:
    """Check every dispatched op's kernel on ``device`` for ``dtype`` (a dtype, several, or
    None: every dtype the kernels support). ``backend`` replaces ``itif.ops.cuda`` (tests)."""
    device = torch.device(device)
    if dtype is None:
        dtypes = list(TOLERANCE)
    elif isinstance(dtype, torch.dtype):
        dtypes = [dtype]
    else:
        dtypes = list(dtype)
    if backend is None and device.type != "cuda":
        return [KernelCheck(op, str(device), _dtype_name(dt), "reference", True, NO_CUDA)
                for dt in dtypes for op in CHECKS]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    be = backend if backend is not None else dispatch.cuda_backend()
    results: list[KernelCheck] = []
    for dt in dtypes:
        if be is None or dt not in getattr(be, "SUPPORTED_DTYPES", TOLERANCE):
            why = _unavailable_reason() if be is None else f"no kernels for {dt}"
            results += [KernelCheck(op, str(device), _dtype_name(dt), "reference", False, why)
                        for op in CHECKS]
            continue
        build_error = getattr(be, "KernelBuildError", None)
        for op, check in CHECKS.items():
            t0 = time.perf_counter()
            err, detail = None, ""
            try:
                for w in WIDTHS:
                    e = check(be, _Inputs(w, dt, device, seed))
                    err = e if err is None else max(err, e)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except _Mismatch as e:
                detail = f"mismatch: {e}"
            except Exception as e:  # noqa: BLE001 - any failure disables the kernel
                if build_error is not None and isinstance(e, build_error):
                    detail = f"build failed: {e}"
                else:
                    detail = f"error: {type(e).__name__}: {e}"
            results.append(KernelCheck(op, str(device), _dtype_name(dt),
                                       "cuda" if not detail else "reference", not detail,
                                       detail, err, time.perf_counter() - t0))
    if record:
        for r in results:
            if r.ok:
                dispatch.record_kernel_ok(r.op, device, r.dtype)
            else:
                dispatch.disable(r.op, device, r.dtype, r.detail, "self-test")
    return results


def summary(results: Sequence[KernelCheck]) -> str:
    """One line for the log: how many kernels passed, and each failure."""
    if results and all(r.detail == NO_CUDA for r in results):
        return f"no CUDA on {results[0].device}: every op runs the torch reference"
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    line = f"{len(ok)}/{len(results)} CUDA kernels match the torch reference"
    if results:
        line += f" on {results[0].device} ({', '.join(sorted({r.dtype for r in results}))})"
    if bad:
        line += "; falling back to the reference: " + "; ".join(
            f"{r.op} ({r.dtype}): {r.detail}" for r in bad)
    return line


__all__ = ["CHECKS", "NO_CUDA", "TOLERANCE", "KernelCheck", "self_test", "softmax_oracle",
           "summary"]
