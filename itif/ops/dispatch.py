"""One dispatch for the memory-bound ops: CUDA RawKernels on CUDA tensors, else the reference.

Each op has the signature of its torch reference (``itif.ops.reference``, the spec and the CPU
path). On a CUDA tensor of a supported dtype, with CuPy present and the kernel sources found
(detected once), the op runs ``itif.ops.cuda``; otherwise the reference. A kernel build that
fails (``KernelBuildError``) is logged once per (device, dtype) and that pair falls back to the
reference from then on. Validation errors (``ValueError``) are never swallowed.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Literal, TypeVar

import torch

from itif.ops import reference as _ref
from itif.ops.reference import AttnGroup, RotParam, activation
from itif.platform import cupy_module

log = logging.getLogger("itif.ops")

R = TypeVar("R")

_broken: set[tuple] = set()  # (device index, dtype) whose kernels failed to build
_broken_lock = threading.Lock()


@functools.cache
def _cuda_backend():
    """``itif.ops.cuda`` when CuPy sees a GPU and the kernel sources exist, else None."""
    if cupy_module() is None:
        return None  # itif.platform already logged why
    try:
        from itif.ops import cuda

        cuda.kernel_files()
        return cuda
    except Exception as e:  # noqa: BLE001 - any failure means: use the reference
        log.warning("CUDA kernels unavailable (%s): memory-bound ops use the torch reference", e)
        return None


def _backend_for(t: torch.Tensor):
    if not t.is_cuda:
        return None
    be = _cuda_backend()
    if be is None or t.dtype not in be.SUPPORTED_DTYPES:
        return None
    if (t.device.index, t.dtype) in _broken:
        return None
    return be


def backend_name(tensor: torch.Tensor) -> Literal["cuda", "reference"]:
    """The backend an op on ``tensor`` tries first (a later build failure still falls back)."""
    return "cuda" if _backend_for(tensor) is not None else "reference"


def _run(t: torch.Tensor, cuda_call: Callable[[object], R], ref_call: Callable[[], R]) -> R:
    be = _backend_for(t)
    if be is not None:
        try:
            return cuda_call(be)
        except be.KernelBuildError as e:
            # Raised before any launch, so no input has been touched: the reference can run.
            key = (t.device.index, t.dtype)
            with _broken_lock:
                first = key not in _broken
                _broken.add(key)
            if first:
                log.warning("CUDA kernels for %s on %s failed to build (%s): using the torch "
                            "reference for them", t.dtype, t.device, e)
    return ref_call()


def bias_act(x: torch.Tensor, bias: RotParam, act: str = "none") -> torch.Tensor:
    """``x = act(x + bias[row])``. x: [T, N], modified in place and returned."""
    return _run(x, lambda be: be.bias_act(x, bias, act), lambda: _ref.bias_act(x, bias, act))


def bias_residual_layernorm(
    x: torch.Tensor,
    bias: RotParam | None,
    residual: torch.Tensor | None,
    gamma: RotParam,
    beta: RotParam,
    eps: float,
    keep_sum: bool = False,
) -> torch.Tensor:
    """``LayerNorm(x + bias[row] + residual) * gamma[row] + beta[row]``, a new [T, H] tensor.

    With ``keep_sum`` the pre-norm sum is also written into ``x``; otherwise x is unchanged.
    """
    return _run(
        x,
        lambda be: be.bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum),
        lambda: _ref.bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum),
    )


def bias_residual(x: torch.Tensor, bias: RotParam, residual: torch.Tensor) -> torch.Tensor:
    """``x = x + bias[row] + residual``, in place (pre-LN residual adds)."""
    return _run(
        x,
        lambda be: be.bias_residual(x, bias, residual),
        lambda: _ref.bias_residual(x, bias, residual),
    )


def embed_text(
    word: RotParam, pos: RotParam, type_: RotParam,
    ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor,
) -> torch.Tensor:
    """BERT/ALBERT embeddings ``word[slot, id] + pos[slot, p] + type[slot, t]`` -> [T, E]."""
    return _run(
        word.buf,
        lambda be: be.embed_text(word, pos, type_, ids, positions, types),
        lambda: _ref.embed_text(word, pos, type_, ids, positions, types),
    )


def attention(
    qkv: torch.Tensor, groups: list[AttnGroup], heads: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Multi-head self-attention strictly within each request: qkv [T, 3H] -> [T, H]."""
    return _run(
        qkv,
        lambda be: be.attention(qkv, groups, heads, out),
        lambda: _ref.attention(qkv, groups, heads, out),
    )


__all__ = [
    "AttnGroup",
    "RotParam",
    "activation",
    "attention",
    "backend_name",
    "bias_act",
    "bias_residual",
    "bias_residual_layernorm",
    "embed_text",
]
