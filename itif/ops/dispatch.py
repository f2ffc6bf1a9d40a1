"""One dispatch for the memory-bound ops: CUDA RawKernels on CUDA tensors, else the reference.

Each op has the signature of its torch reference (``itif.ops.reference``, the spec and the CPU
path). On a CUDA tensor of a supported dtype, with CuPy present and the kernel sources found
(detected once), the op runs ``itif.ops.cuda``; otherwise the reference. Validation errors
(``ValueError``) are never swallowed.

Fallbacks: a kernel that cannot be used on a (device, dtype) sends its op to the reference, and
the fallback is recorded (``fallbacks()``: exported as the ``itif_kernel_fallback`` gauge and in
the daemon's health detail), not only logged:

* a kernel build that fails at run time (``KernelBuildError``, raised before any launch) is
  logged once per (device, dtype), and every op of that pair falls back from then on;
* the start-up kernel self-test (``itif.ops.selftest``) disables each op whose kernel failed to
  build or did not match the reference (``disable``), and records the ops that passed
  (``record_kernel_ok``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from itif.ops import reference as _ref
from itif.ops.reference import AttnGroup, RotParam, activation
from itif.platform import cupy_module

log = logging.getLogger("itif.ops")

R = TypeVar("R")

#: The ops dispatch chooses a backend for (``masked_softmax`` is a step of ``attention``).
OPS: tuple[str, ...] = (
    "bias_act", "bias_residual", "bias_residual_layernorm", "embed_text", "attention")

_broken: set[tuple] = set()  # (device index, dtype) whose kernels failed to build
_broken_lock = threading.Lock()
_disabled: set[tuple] = set()  # (op, device index, dtype) that run the reference


@dataclass(frozen=True)
class KernelState:
    """What one op's CUDA kernel does on one (device, dtype): ``fallback`` True means the op runs
    the torch reference there, for ``reason``; ``source`` is ``"self-test"`` or ``"runtime"``."""

    op: str
    device: str  # "cuda:0"
    dtype: str  # "float16"
    fallback: bool
    reason: str = ""
    source: str = "self-test"


_states: dict[tuple[str, str, str], KernelState] = {}
_states_lock = threading.Lock()


def _names(device: torch.device | str | int, dtype: torch.dtype | str) -> tuple[str, str]:
    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = str(torch.device(device))
    dt = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return dev, dt


def _index(device: torch.device | str | int) -> int | None:
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return d.index


def record_kernel_ok(op: str, device, dtype) -> None:
    """Note that ``op``'s kernel passed the self-test on (device, dtype); a recorded fallback
    for that key is kept (a kernel once seen wrong stays off)."""
    dev, dt = _names(device, dtype)
    with _states_lock:
        _states.setdefault((op, dev, dt), KernelState(op, dev, dt, False, "", "self-test"))


def disable(op: str, device, dtype: torch.dtype, reason: str, source: str = "self-test") -> bool:
    """Send ``op`` on (device, dtype) to the torch reference from now on, and record why.
    Returns whether this is new (it is logged as a warning only then)."""
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {OPS}")
    dev, dt = _names(device, dtype)
    _disabled.add((op, _index(device), getattr(torch, dt)))
    with _states_lock:
        old = _states.get((op, dev, dt))
        new = old is None or not old.fallback
        if new:
            _states[(op, dev, dt)] = KernelState(op, dev, dt, True, reason, source)
    if new:
        log.warning("kernel %s on %s (%s) falls back to the torch reference (%s): %s",
                    op, dev, dt, source, reason)
    return new


def kernel_states() -> list[KernelState]:
    """Every recorded kernel state (self-test passes and fallbacks), sorted."""
    with _states_lock:
        return [_states[k] for k in sorted(_states)]


def fallbacks() -> list[KernelState]:
    """The recorded fallbacks: ops whose CUDA kernel is not used on some (device, dtype)."""
    return [s for s in kernel_states() if s.fallback]


def clear_kernel_states() -> None:
    """Forget every recorded state and re-enable every op (tests)."""
    with _states_lock:
        _states.clear()
    _disabled.clear()
    _broken.clear()


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


def backend_name(tensor: torch.Tensor, op: str | None = None) -> Literal["cuda", "reference"]:
    """The backend an op on ``tensor`` tries first (a later build failure still falls back);
    with ``op``, also whether that op was disabled on the tensor's (device, dtype)."""
    if _backend_for(tensor) is None:
        return "reference"
    if op is not None and (op, tensor.device.index, tensor.dtype) in _disabled:
        return "reference"
    return "cuda"


def _run(op: str, t: torch.Tensor, cuda_call: Callable[[object], R],
         ref_call: Callable[[], R]) -> R:
    be = _backend_for(t)
    if be is not None and not (_disabled and (op, t.device.index, t.dtype) in _disabled):
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
                if t.is_cuda:
                    for name in OPS:
                        _record_runtime_fallback(name, t.device, t.dtype, f"build failed: {e}")
    return ref_call()


def _record_runtime_fallback(op: str, device, dtype, reason: str) -> None:
    dev, dt = _names(device, dtype)
    with _states_lock:
        old = _states.get((op, dev, dt))
        if old is None or not old.fallback:
            _states[(op, dev, dt)] = KernelState(op, dev, dt, True, reason, "runtime")


def bias_act(x: torch.Tensor, bias: RotParam, act: str = "none") -> torch.Tensor:
    """``x = act(x + bias[row])``. x: [T, N], modified in place and returned."""
    return _run("bias_act", x, lambda be: be.bias_act(x, bias, act),
                lambda: _ref.bias_act(x, bias, act))


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
        "bias_residual_layernorm",
        x,
        lambda be: be.bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum),
        lambda: _ref.bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum),
    )


def bias_residual(x: torch.Tensor, bias: RotParam, residual: torch.Tensor) -> torch.Tensor:
    """``x = x + bias[row] + residual``, in place (pre-LN residual adds)."""
    return _run(
        "bias_residual",
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
        "embed_text",
        word.buf,
        lambda be: be.embed_text(word, pos, type_, ids, positions, types),
        lambda: _ref.embed_text(word, pos, type_, ids, positions, types),
    )


def attention(
    qkv: torch.Tensor, groups: list[AttnGroup], heads: int, out: torch.Tensor | None = None,
    varlen: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Multi-head self-attention strictly within each request: qkv [T, 3H] -> [T, H].
    ``varlen``: the same sequences as (boundaries, longest) for a backend that runs them in one
    call (``PreparedBatch.varlen_L``); the reference runs ``groups``."""
    return _run(
        "attention",
        qkv,
        lambda be: be.attention(qkv, groups, heads, out, varlen),
        lambda: _ref.attention(qkv, groups, heads, out, varlen),
    )


__all__ = [
    "OPS",
    "AttnGroup",
    "KernelState",
    "RotParam",
    "activation",
    "attention",
    "backend_name",
    "bias_act",
    "bias_residual",
    "bias_residual_layernorm",
    "clear_kernel_states",
    "disable",
    "embed_text",
    "fallbacks",
    "gated_act",
    "kernel_states",
    "record_kernel_ok",
    "rms_norm",
    "rotary",
]


# ---- llama-family ops. No CUDA kernel yet: on every device (CUDA tensors included) these run
# the torch reference, which is why they are not in ``OPS`` (the self-test and the fallback
# gauge cover kernels only). A kernel would take its place in ``_run`` like the ops above.


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, gamma: RotParam, eps: float,
             keep_sum: bool = False) -> torch.Tensor:
    """``RMSNorm(x + residual) * gamma[row]`` (``itif.ops.reference.rms_norm``)."""
    return _ref.rms_norm(x, residual, gamma, eps, keep_sum)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotary positions over ``heads`` heads of each row, in place (``reference.rotary``)."""
    return _ref.rotary(x, cos, sin, heads)


def gated_act(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` of x [T, 2I] -> [T, I] (``reference.gated_act``)."""
    return _ref.gated_act(x, act)
