"""Argument validation of the CUDA RawKernel wrappers (a RawKernel checks nothing).

Pure host code: runs, and is tested, without a GPU. ``validate_<op>`` raises ``ValueError``
naming the bad argument and the value it conflicts with; ``require_cuda=False`` runs everything
but the device check (CPU tests, the kernel emulator).

How often the wrappers validate (``validation_mode``; ``validate_launches(mode)`` changes it for
a block, ``set_validation_mode`` for good):

* ``"once"`` (default): the full validation runs the first time an argument *signature* is seen
  (every tensor's shape, dtype, device and contiguity, the structure of the RotParams and groups,
  the scalar arguments with their types): exactly what the validators read. A later call with
  the same signature would pass the same checks, so it only builds and looks up the signature,
  a fraction of the full checks' cost. Signatures are kept per validator (at most
  ``SIGNATURES_MAX``, then the set is cleared).
* ``"always"``: the full validation on every call (debugging, tests).
* ``"off"``: none; for a caller that has validated a batch's arguments itself.

Nothing here reads tensor values (no device sync): slot and index values are never checked,
a kernel turns a row with an out-of-range slot into NaN instead.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Literal

import torch

from itif.ops.cuda_loader import ACT_CODES, SUPPORTED_DTYPES
from itif.ops.reference import AttnGroup

_INT32_MAX = 2**31 - 1

# ---------------------------------------------------------------------------------------------
# validators


def _fail(op: str, msg: str):
    raise ValueError(f"{op}: {msg}")


def _check_main(op: str, name: str, t, ndim: int, require_cuda: bool) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if require_cuda and not t.is_cuda:
        _fail(op, f"{name} is on {t.device}, but the CUDA kernels need a CUDA tensor")
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(op, f"{name} has dtype {t.dtype}; supported: {sorted(map(str, SUPPORTED_DTYPES))}")
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}")


def _check_like(op: str, name: str, t, like: torch.Tensor, like_name: str, shape=None) -> None:
    """``t`` on ``like``'s device, of its dtype, contiguous, of ``shape`` (if given)."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != like.device:
        _fail(op, f"{name} is on {t.device} but {like_name} is on {like.device}")
    if t.dtype != like.dtype:
        _fail(op, f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} has shape {tuple(t.shape)} but {like_name} needs {tuple(shape)}")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}")


def _check_index(op: str, name: str, t, rows: int, device: torch.device, rows_of: str) -> None:
    """A per-row int64 index vector (slots, token ids, positions) of ``rows`` entries."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device} but {rows_of} is on {device}")
    if t.dtype != torch.int64:
        _fail(op, f"{name} has dtype {t.dtype} but must be torch.int64")
    if t.dim() != 1:
        _fail(op, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.shape[0] != rows:
        _fail(op, f"{name} has {t.shape[0]} entries but {rows_of} has {rows} rows")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}")


def _check_rot(op: str, name: str, p, rows: int, row_shape: tuple, like: torch.Tensor,
               like_name: str) -> None:
    """A RotParam whose buffer is [capacity, *row_shape] and whose slot has one entry a row."""
    if not (isinstance(p, tuple) and len(p) in (2, 3)):
        _fail(op, f"{name} must be a RotParam(buf, slot), got {type(p).__name__}")
    buf, slot = p[0], p[1]
    _check_like(op, f"{name}.buf", buf, like, like_name)
    if buf.dim() != 1 + len(row_shape) or tuple(buf.shape[1:]) != tuple(row_shape):
        _fail(op, f"{name}.buf has shape {tuple(buf.shape)} but {like_name} needs "
                  f"[capacity, {', '.join(map(str, row_shape))}]")
    if buf.shape[0] < 1:
        _fail(op, f"{name}.buf has capacity 0")
    _check_index(op, f"{name}.slot", slot, rows, like.device, like_name)


def _check_width(op: str, name: str, n: int) -> None:
    if n > _INT32_MAX:
        _fail(op, f"{name} width {n} exceeds {_INT32_MAX}")


def validate_bias_act(x, bias, act, *, require_cuda: bool = True) -> None:
    op = "bias_act"
    _check_main(op, "x", x, 2, require_cuda)
    if act not in ACT_CODES:
        _fail(op, f"act {act!r} is not one of {sorted(ACT_CODES)}")
    _check_width(op, "x", x.shape[1])
    _check_rot(op, "bias", bias, x.shape[0], (x.shape[1],), x, "x")


def validate_bias_residual(x, bias, residual, *, require_cuda: bool = True) -> None:
    op = "bias_residual"
    _check_main(op, "x", x, 2, require_cuda)
    _check_width(op, "x", x.shape[1])
    _check_rot(op, "bias", bias, x.shape[0], (x.shape[1],), x, "x")
    _check_like(op, "residual", residual, x, "x", shape=x.shape)


def validate_bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum, *,
                                     require_cuda: bool = True) -> None:
    op = "bias_residual_layernorm"
    _check_main(op, "x", x, 2, require_cuda)
    t, h = x.shape
    _check_width(op, "x", h)
    if bias is not None:
        _check_rot(op, "bias", bias, t, (h,), x, "x")
    if residual is not None:
        _check_like(op, "residual", residual, x, "x", shape=x.shape)
    _check_rot(op, "gamma", gamma, t, (h,), x, "x")
    _check_rot(op, "beta", beta, t, (h,), x, "x")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) \
            or eps < 0:
        _fail(op, f"eps {eps!r} must be a finite number >= 0")
    if not isinstance(keep_sum, bool):
        _fail(op, f"keep_sum {keep_sum!r} must be a bool")


def validate_embed_text(word, pos, type_, ids, positions, types, *,
                        require_cuda: bool = True) -> None:
    op = "embed_text"
    if not (isinstance(word, tuple) and len(word) in (2, 3)):
        _fail(op, f"word must be a RotParam(buf, slot), got {type(word).__name__}")
    wbuf = word[0]
    _check_main(op, "word.buf", wbuf, 3, require_cuda)
    e = wbuf.shape[2]
    _check_width(op, "word.buf", e)
    _check_index(op, "ids", ids, ids.shape[0] if isinstance(ids, torch.Tensor) else -1,
                 wbuf.device, "word.buf")
    t = ids.shape[0]
    _check_index(op, "positions", positions, t, wbuf.device, "ids")
    _check_index(op, "types", types, t, wbuf.device, "ids")
    _check_rot(op, "word", word, t, tuple(wbuf.shape[1:]), wbuf, "word.buf")
    for name, p in (("pos", pos), ("type_", type_)):
        if not (isinstance(p, tuple) and len(p) in (2, 3) and isinstance(p[0], torch.Tensor)):
            _fail(op, f"{name} must be a RotParam(buf, slot)")
        if p[0].dim() != 3 or p[0].shape[2] != e:
            _fail(op, f"{name}.buf has shape {tuple(p[0].shape)} but word.buf has width {e}: "
                      f"needs [capacity, rows, {e}]")
        _check_rot(op, name, p, t, tuple(p[0].shape[1:]), wbuf, "word.buf")


def validate_masked_softmax(scores, rows_per_seq, lengths, key_mask, scale, *,
                            require_cuda: bool = True) -> None:
    op = "masked_softmax"
    _check_main(op, "scores", scores, 2, require_cuda)
    rows, L = scores.shape
    _check_width(op, "scores", L)
    if isinstance(rows_per_seq, bool) or not isinstance(rows_per_seq, int) or rows_per_seq < 1:
        _fail(op, f"rows_per_seq {rows_per_seq!r} must be a positive int")
    if rows % rows_per_seq:
        _fail(op, f"scores has {rows} rows, not a multiple of rows_per_seq {rows_per_seq}")
    n = rows // rows_per_seq
    if lengths is not None:
        _check_index(op, "lengths", lengths, n, scores.device, "scores (sequences)")
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
            _fail(op, f"key_mask must be a bool tensor, got "
                      f"{getattr(key_mask, 'dtype', type(key_mask).__name__)}")
        if key_mask.device != scores.device:
            _fail(op, f"key_mask is on {key_mask.device} but scores is on {scores.device}")
        if key_mask.numel() != n * L or key_mask.shape[0] != n or key_mask.shape[-1] != L:
            _fail(op, f"key_mask has shape {tuple(key_mask.shape)} but scores needs "
                      f"[{n}, ..., {L}] ({n} sequences of {L} keys)")
        if not key_mask.is_contiguous():
            _fail(op, f"key_mask must be contiguous, got strides {key_mask.stride()}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _fail(op, f"scale {scale!r} must be a finite number")


def validate_attention(qkv, groups, heads, out, *, require_cuda: bool = True) -> None:
    op = "attention"
    _check_main(op, "qkv", qkv, 2, require_cuda)
    t, h3 = qkv.shape
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        _fail(op, f"heads {heads!r} must be a positive int")
    if h3 % 3 or (h3 // 3) % heads:
        _fail(op, f"qkv width {h3} is not 3 x hidden with hidden a multiple of heads {heads}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.device != qkv.device
                            or out.dtype != qkv.dtype or tuple(out.shape) != (t, h3 // 3)):
        _fail(op, f"out must be a [{t}, {h3 // 3}] {qkv.dtype} tensor on {qkv.device}, got "
                  f"{getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))} on "
                  f"{getattr(out, 'device', None)}")
    for i, g in enumerate(groups):
        if not isinstance(g, AttnGroup):
            _fail(op, f"groups[{i}] is a {type(g).__name__}, not an AttnGroup")
        if g.n < 0 or g.L < 1:
            _fail(op, f"groups[{i}] has n={g.n}, L={g.L}")
        if g.rows is None:
            if g.start < 0 or g.start + g.n * g.L > t:
                _fail(op, f"groups[{i}] rows {g.start}:{g.start + g.n * g.L} exceed qkv's {t}")
        else:
            for name in ("rows", "valid", "dest"):
                v = getattr(g, name)
                if not isinstance(v, torch.Tensor) or v.device != qkv.device \
                        or v.dtype != torch.int64:
                    _fail(op, f"groups[{i}].{name} must be an int64 tensor on {qkv.device}, got "
                              f"{getattr(v, 'dtype', type(v).__name__)} on "
                              f"{getattr(v, 'device', None)}")
            if tuple(g.rows.shape) != (g.n, g.L):
                _fail(op, f"groups[{i}].rows has shape {tuple(g.rows.shape)} but n, L = "
                          f"{g.n}, {g.L}")
            if g.valid.shape != g.dest.shape:
                _fail(op, f"groups[{i}].valid has shape {tuple(g.valid.shape)} but dest has "
                          f"{tuple(g.dest.shape)}")
        if g.key_mask is not None:
            m = g.key_mask
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool \
                    or m.device != qkv.device or tuple(m.shape) != (g.n, 1, 1, g.L):
                _fail(op, f"groups[{i}].key_mask must be a bool [{g.n}, 1, 1, {g.L}] tensor on "
                          f"{qkv.device}, got {getattr(m, 'dtype', None)} "
                          f"{tuple(getattr(m, 'shape', ()))} on {getattr(m, 'device', None)}")


# ---------------------------------------------------------------------------------------------
# signatures: everything a validator reads, as a hashable tuple (raises on malformed arguments,
# which then go to the full validation and its error message)


def _t(t):
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.is_contiguous())


def _rot(p):
    return (type(p), len(p), _t(p[0]), _t(p[1]))


def sig_bias_act(x, bias, act):
    return (act, _t(x), _rot(bias))


def sig_bias_residual(x, bias, residual):
    return (_t(x), _rot(bias), _t(residual))


def sig_bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum):
    return (_t(x), None if bias is None else _rot(bias), _t(residual), _rot(gamma), _rot(beta),
            type(eps), eps, type(keep_sum), keep_sum)


def sig_embed_text(word, pos, type_, ids, positions, types):
    return (_rot(word), _rot(pos), _rot(type_), _t(ids), _t(positions), _t(types))


def sig_masked_softmax(scores, rows_per_seq, lengths, key_mask, scale):
    return (_t(scores), type(rows_per_seq), rows_per_seq, _t(lengths), _t(key_mask),
            type(scale), scale)


def _group(g):
    return (type(g), g.n, g.L, g.start, _t(g.rows), _t(g.valid), _t(g.dest), _t(g.key_mask))


def sig_attention(qkv, groups, heads, out):
    return (_t(qkv), type(heads), heads, _t(out), tuple(map(_group, groups)))


# ---------------------------------------------------------------------------------------------
# how often to validate

ValidationMode = Literal["always", "once", "off"]
_MODES = ("always", "once", "off")
SIGNATURES_MAX = 4096

_mode: ValidationMode = "once"
_seen: set = set()


def validation_mode() -> ValidationMode:
    return _mode


def set_validation_mode(mode: ValidationMode) -> ValidationMode:
    """Set how the wrappers validate (``"always"``, ``"once"``, ``"off"``); returns the old
    mode. Process-wide, like the launch policy."""
    global _mode
    if mode not in _MODES:
        raise ValueError(f"validation mode {mode!r} is not one of {_MODES}")
    old, _mode = _mode, mode
    return old


@contextlib.contextmanager
def validate_launches(mode: ValidationMode = "always") -> Iterator[ValidationMode]:
    """Validate launches as ``mode`` says inside the block, e.g. ``with validate_launches("off"):``
    around a batch whose arguments were validated once already. Not thread-safe by design."""
    old = set_validation_mode(mode)
    try:
        yield mode
    finally:
        set_validation_mode(old)


def forget_signatures() -> None:
    """Drop the signatures validated so far (the next call of each validates in full)."""
    _seen.clear()


def check(validator: Callable[..., None], signature: Callable[..., tuple], *args) -> None:
    """Run ``validator(*args)`` as the validation mode says (see the module docstring)."""
    mode = _mode
    if mode == "off":
        return
    if mode == "always":
        validator(*args)
        return
    try:
        key = (validator, signature(*args))
        if key in _seen:
            return
    except Exception:  # noqa: BLE001 - malformed (or unhashable) arguments: the validator
        key = None  # says what is wrong
    validator(*args)
    if key is not None:
        if len(_seen) >= SIGNATURES_MAX:
            _seen.clear()
        _seen.add(key)


__all__ = [
    "SIGNATURES_MAX",
    "ValidationMode",
    "check",
    "forget_signatures",
    "set_validation_mode",
    "sig_attention",
    "sig_bias_act",
    "sig_bias_residual",
    "sig_bias_residual_layernorm",
    "sig_embed_text",
    "sig_masked_softmax",
    "validate_attention",
    "validate_bias_act",
    "validate_bias_residual",
    "validate_bias_residual_layernorm",
    "validate_embed_text",
    "validate_launches",
    "validate_masked_softmax",
    "validation_mode",
]
