"""The memory-bound ops, one class each: the op's contract said once, its reference and CUDA
forwards side by side, and one dispatch between them.

Each op is a subclass of :class:`Op` whose docstring is the op's contract, in the form of
Punica's ops: a ``Semantics:`` line in index notation, then, per argument, its shape, dtype and
whether it is written in place. ``forward_reference`` is the torch reference
(``itif.ops.reference``: the spec, the CPU path and the kernels' test oracle) and declares the
parameters; ``forward_cuda`` runs the kernel wrapper of the same name in ``itif.ops.cuda``,
which takes exactly those parameters (``tests/test_op_contracts.py`` holds both). The module
exports one instance per op under the op's name (``dispatch.bias_act(x, bias, "gelu")``):
calling it runs the CUDA forward on a CUDA tensor of a supported dtype, with CuPy present and
the kernel sources found (detected once), and the reference otherwise. Validation errors
(``ValueError``) are never swallowed.

Index notation, in every op and GEMM contract of itif:

* ``T`` rows of the token buffer (padding rows included), ``t`` one of them; ``H`` the hidden
  width, ``N`` any width, ``C`` a parameter buffer's capacity in slots.
* **slot** is the one word for the index a row reads its tenant's parameters at: a
  ``RotParam`` ``p`` holds ``p.buf [C, ...]`` and ``p.slot [T]`` (int64), and
  ``p[t] = p.buf[p.slot[t]]`` (Punica's per-row adapter index; thesis 4.2.2's rotation).
  The GEMMs' segments (``itif.runtime.gemm.Segments``) carry one slot per run of rows.
* DType "float" is float32, float16 or bfloat16; the arithmetic is float32 whatever the
  storage type, rounded once when stored.

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
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

import torch

from itif.ops import reference as _ref
from itif.ops.reference import AttnGroup, RotParam, activation
from itif.platform import cupy_module

log = logging.getLogger("itif.ops")

R = TypeVar("R")

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


def cuda_backend():
    """``itif.ops.cuda`` where its kernels can run here (CuPy sees a GPU and the kernel sources
    exist; detected once), else None: what the self-test checks."""
    return _cuda_backend()


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


# ---- one class per op ----------------------------------------------------------------------


class Op:
    """One memory-bound op: its contract (the subclass's docstring, the one place it is said),
    its torch reference forward and its CUDA forward side by side; calling an instance picks
    between them (``_run``: CUDA where the kernels load and the op is not disabled there).

    A subclass names the op (``name``: its function in ``itif.ops.reference`` and its wrapper
    in ``itif.ops.cuda``) and sets ``forward_reference``; the parameters are those of that
    function, and the CUDA wrapper takes the same ones. An op without a kernel
    (``has_kernel = False``) runs the reference on every device and is not in :data:`OPS`.
    """

    name: ClassVar[str]
    has_kernel: ClassVar[bool] = True
    forward_reference: ClassVar[Callable[..., torch.Tensor]]

    def __init__(self) -> None:
        # help() and inspect show the reference's parameters: the op's one declaration of them
        self.__signature__ = inspect.signature(self.forward_reference)
        params = self.__signature__.parameters.values()
        self._names = tuple(p.name for p in params)
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def forward_cuda(self, backend, *args) -> torch.Tensor:
        """The kernel wrapper of this op in ``backend`` (``itif.ops.cuda``, or a stand-in)."""
        return getattr(backend, self.name)(*args)

    def device_tensor(self, args: tuple) -> torch.Tensor:
        """The tensor whose device and dtype choose the backend: the first argument."""
        return args[0]

    def complete(self, args: tuple, kwargs: dict) -> tuple:
        """Every argument, positionally, defaults filled in: both forwards take them so, as the
        dispatch functions before these classes passed them (a TypeError names a missing or
        unknown argument, as a call of the reference would)."""
        names = self._names[len(args):]
        if len(args) <= len(self._names) and all(n in kwargs or n in self._defaults
                                                 for n in names):
            left = dict(kwargs)
            rest = tuple(left.pop(n) if n in left else self._defaults[n] for n in names)
            if not left:
                return args + rest
        self.__signature__.bind(*args, **kwargs)  # raises the TypeError
        raise AssertionError("unreachable")

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if not self.has_kernel:
            return self.forward_reference(*args, **kwargs)
        if kwargs or len(args) != len(self._names):
            args = self.complete(args, kwargs)
        return _run(self.name, self.device_tensor(args), lambda be: self.forward_cuda(be, *args),
                    lambda: self.forward_reference(*args))

    def __repr__(self) -> str:
        return f"<op {self.name}>"


class BiasAct(Op):
    """Each row's own bias, then the activation, in place.

    Semantics:
        x[t, n] = act(x[t, n] + bias.buf[bias.slot[t], n])

    Args:
        x: Shape: [T, N]. DType: float. Written in place and returned.
        bias: Shape: buf [C, N], slot [T]. DType: buf x's, slot int64. Read only.
        act: Type: str, a name of ``activation`` ("none": the bias only).
    """

    name = "bias_act"
    forward_reference = staticmethod(_ref.bias_act)


class BiasResidual(Op):
    """Each row's own bias and the residual added, in place (the pre-LN blocks' residual).

    Semantics:
        x[t, n] = x[t, n] + bias.buf[bias.slot[t], n] + residual[t, n]

    Args:
        x: Shape: [T, N]. DType: float. Written in place and returned.
        bias: Shape: buf [C, N], slot [T]. DType: buf x's, slot int64. Read only.
        residual: Shape: [T, N]. DType: x's. Read only.
    """

    name = "bias_residual"
    forward_reference = staticmethod(_ref.bias_residual)


class BiasResidualLayerNorm(Op):
    """Bias, residual and LayerNorm fused: one pass over the rows, each with its own slots.

    Semantics:
        s[t, h] = x[t, h] + bias.buf[bias.slot[t], h] + residual[t, h]
        y[t, h] = (s[t, h] - mean_h s[t]) / sqrt(var_h s[t] + eps)
                  * gamma.buf[gamma.slot[t], h] + beta.buf[beta.slot[t], h]

    A ``None`` bias or residual drops its term. Returns y, a new [T, H] tensor of x's dtype.

    Args:
        x: Shape: [T, H]. DType: float. Read only, but written in place (x = s) with keep_sum.
        bias: Shape: buf [C, H], slot [T], or None. DType: buf x's, slot int64. Read only.
        residual: Shape: [T, H], or None. DType: x's. Read only.
        gamma: Shape: buf [C, H], slot [T]. DType: buf x's, slot int64. Read only.
        beta: Shape: buf [C, H], slot [T]. DType: buf x's, slot int64. Read only.
        eps: Type: float, added to the variance.
        keep_sum: Type: bool; True also stores s into x (a pre-LN block's next residual).
    """

    name = "bias_residual_layernorm"
    forward_reference = staticmethod(_ref.bias_residual_layernorm)


class EmbedText(Op):
    """BERT/ALBERT embeddings: each row's token, position and token type, from its own slots.

    Semantics:
        out[t, e] = word.buf[word.slot[t], ids[t], e] + pos.buf[pos.slot[t], positions[t], e]
                    + type_.buf[type_.slot[t], types[t], e]

    Returns out, a new [T, E] tensor of the tables' dtype. The kernel turns a row whose slot or
    index is out of range into NaN; token ids are checked against the vocabulary upstream.

    Args:
        word: Shape: buf [C, V, E], slot [T]. DType: buf float, slot int64. Read only.
        pos: Shape: buf [C, P, E], slot [T]. DType: buf word's, slot int64. Read only.
        type_: Shape: buf [C, Y, E], slot [T]. DType: buf word's, slot int64. Read only.
        ids: Shape: [T]. DType: int64, in [0, V). Read only.
        positions: Shape: [T]. DType: int64, in [0, P), restarting per request. Read only.
        types: Shape: [T]. DType: int64, in [0, Y). Read only.
    """

    name = "embed_text"
    forward_reference = staticmethod(_ref.embed_text)

    def device_tensor(self, args: tuple) -> torch.Tensor:
        return args[0].buf


class Attention(Op):
    """Multi-head self-attention strictly within each request (``AttnGroup``: n sequences of
    L rows each; a sequence's rows r_0 .. r_{L-1}).

    Semantics:
        q[t], k[t], v[t] = qkv[t, 0:H], qkv[t, H:2H], qkv[t, 2H:3H], each as heads x d (H = heads d)
        out[r_i, h, j] = sum_k softmax_k(q[r_i, h] . k[r_k, h] / sqrt(d) | key_mask) v[r_k, h, j]

    Rows no group covers keep out's values. Returns out.

    Args:
        qkv: Shape: [T, 3H], Q, K and V side by side, bias added. DType: float. Read only.
        groups: Type: a sequence of ``AttnGroup`` (view or gather form; see its docstring).
        heads: Type: int, dividing H.
        out: Shape: [T, H], or None (a new zero tensor). DType: qkv's. Written in place and
            returned (the rows the groups cover).
        varlen: Type: (boundaries [S+1] int32, longest) or None: the same sequences for a
            backend that runs them in one call (``PreparedBatch.varlen_L``); the reference
            runs ``groups``.
    """

    name = "attention"
    forward_reference = staticmethod(_ref.attention)


# ---- llama-family ops. No CUDA kernel yet: on every device (CUDA tensors included) these run
# the torch reference, which is why they are not in ``OPS`` (the self-test and the fallback
# gauge cover kernels only). A kernel would set ``has_kernel`` and go in ``itif.ops.cuda``.


class RmsNorm(Op):
    """RMSNorm over each row (Llama's: no mean subtracted, no beta), with its own gamma slot.

    Semantics:
        s[t, h] = x[t, h] + residual[t, h]
        y[t, h] = s[t, h] / sqrt(mean_h s[t]^2 + eps) * gamma.buf[gamma.slot[t], h]

    Returns y, a new [T, H] tensor of x's dtype.

    Args:
        x: Shape: [T, H]. DType: float. Read only, but written in place (x = s) with keep_sum.
        residual: Shape: [T, H], or None (s = x). DType: x's. Read only.
        gamma: Shape: buf [C, H], slot [T]. DType: buf x's, slot int64. Read only.
        eps: Type: float, added to the mean square.
        keep_sum: Type: bool; True also stores s into x (the pre-norm block's next residual).
    """

    name = "rms_norm"
    has_kernel = False
    forward_reference = staticmethod(_ref.rms_norm)


class Rotary(Op):
    """Rotary positions, in place, on each of a row's ``heads`` heads of d columns (the halves
    convention of Hugging Face's Llama, not interleaved pairs).

    Semantics:
        x[t, h, j] = x[t, h, j] cos[t, j] - x[t, h, j + d/2] sin[t, j]      (j < d/2)
        x[t, h, j] = x[t, h, j] cos[t, j] + x[t, h, j - d/2] sin[t, j]      (j >= d/2)

    Args:
        x: Shape: [T, heads * d], a column slice of a wider buffer is fine. DType: float.
            Written in place and returned.
        cos: Shape: [T, d]. DType: float32. Read only.
        sin: Shape: [T, d]. DType: float32. Read only.
        heads: Type: int, the heads x holds.
    """

    name = "rotary"
    has_kernel = False
    forward_reference = staticmethod(_ref.rotary)


class GatedAct(Op):
    """The gated MLP's middle (SwiGLU for ``silu``): the gate and up projections side by side.

    Semantics:
        y[t, i] = act(x[t, i]) * x[t, I + i]

    Returns y, a new [T, I] tensor of x's dtype.

    Args:
        x: Shape: [T, 2I], the gate projection then the up projection. DType: float.
            Read only.
        act: Type: str, a name of ``activation``.
    """

    name = "gated_act"
    has_kernel = False
    forward_reference = staticmethod(_ref.gated_act)


bias_act = BiasAct()
bias_residual = BiasResidual()
bias_residual_layernorm = BiasResidualLayerNorm()
embed_text = EmbedText()
attention = Attention()
rms_norm = RmsNorm()
rotary = Rotary()
gated_act = GatedAct()

#: Every op, in the order the self-test checks the kernels.
ALL_OPS: tuple[Op, ...] = (bias_act, bias_residual, bias_residual_layernorm, embed_text,
                           attention, rms_norm, rotary, gated_act)
#: The ops dispatch chooses a backend for (``masked_softmax`` is a step of ``attention``).
OPS: tuple[str, ...] = tuple(op.name for op in ALL_OPS if op.has_kernel)

__all__ = [
    "ALL_OPS",
    "OPS",
    "Attention",
    "AttnGroup",
    "BiasAct",
    "BiasResidual",
    "BiasResidualLayerNorm",
    "EmbedText",
    "GatedAct",
    "KernelState",
    "Op",
    "RmsNorm",
    "RotParam",
    "Rotary",
    "activation",
    "attention",
    "backend_name",
    "bias_act",
    "bias_residual",
    "bias_residual_layernorm",
    "clear_kernel_states",
    "cuda_backend",
    "disable",
    "embed_text",
    "fallbacks",
    "gated_act",
    "kernel_states",
    "record_kernel_ok",
    "rms_norm",
    "rotary",
]
