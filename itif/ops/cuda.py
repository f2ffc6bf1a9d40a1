"""CUDA RawKernel backend of the memory-bound ops: ``kernels/*.cu`` built through CuPy.

Each wrapper here is the CUDA forward of one op class of ``itif.ops.dispatch``, whose
docstring is the op's contract (semantics, shapes, dtypes, in-place behaviour), said there
once; it takes exactly the parameters of the op's torch reference (``itif.ops.reference``;
``tests/test_op_contracts.py`` holds that), and its docstring only adds what is specific to the
kernels. A wrapper validates its arguments (a RawKernel checks nothing; ``itif.ops.validate``,
by default once per argument signature), picks a launch configuration (``itif.ops.launch``,
memoised per kernel, rows and width) and launches on torch's current stream through the loader
(``itif.ops.cuda_loader``). ``masked_softmax``, a step of the attention path with no op class
of its own, carries its contract here.

The pieces live in their own modules; every public name is re-exported here, so
``from itif.ops import cuda; cuda.X`` keeps working:

* ``itif.ops.cuda_loader``: ``kernel_dir``, ``kernel_files``, ``kernel_source``, ``module_for``,
  ``KernelBuildError``, ``SUPPORTED_DTYPES``, ``ACT_CODES``, ``COMPILE_OPTIONS``;
* ``itif.ops.launch``: ``LaunchPolicy``, ``launch_policy``, ``get_policy``, ``DeviceInfo``,
  ``rows_config``, ``flat_config``, ``warp_config``, ``resident_blocks``;
* ``itif.ops.validate``: ``validate_<op>``, ``validate_launches``, ``set_validation_mode``.

Vectorised 16-byte accesses are used when the row width is a multiple of the pack and every
pointer is 16-byte aligned (checked per call: pointers change from batch to batch).

CuPy is imported lazily; importing this module is safe on machines without CUDA (the validators
and launch-config helpers run anywhere).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from itif.ops import reference
from itif.ops import validate as _validate
from itif.ops.cuda_loader import (
    ACT_CODES,
    COMPILE_OPTIONS,
    SUPPORTED_DTYPES,
    KernelBuildError,
    kernel_dir,
    kernel_files,
    kernel_names,
    kernel_source,
    module_for,
)
from itif.ops.launch import (
    DeviceInfo,
    LaunchPolicy,
    cached_config,
    flat_config,
    get_policy,
    launch_policy,
    resident_blocks,
    rows_config,
    warp_config,
    warp_round,
)
from itif.ops.reference import AttnGroup, RotParam
from itif.ops.validate import (
    set_validation_mode,
    validate_attention,
    validate_bias_act,
    validate_bias_residual,
    validate_bias_residual_layernorm,
    validate_embed_text,
    validate_launches,
    validate_masked_softmax,
    validation_mode,
)

_SMEM_DEFAULT_LIMIT = 48 * 1024  # bytes of dynamic shared memory a block gets without opt-in
_check = _validate.check


# ---------------------------------------------------------------------------------------------
# launch helpers


def _vec_width(dtype: torch.dtype) -> int:
    return 16 // dtype.itemsize


def _aligned(*ptrs: int | None) -> bool:
    """Whether every address (None: a null pointer, ignored) is 16-byte aligned."""
    acc = 0
    for p in ptrs:
        if p:
            acc |= p
    return acc % 16 == 0


def _ptr(t: torch.Tensor | None):
    """A kernel pointer argument: the address, or None for a null pointer."""
    return None if t is None else t.data_ptr()


def _elementwise(x: torch.Tensor, bias: RotParam, residual: torch.Tensor | None, act: int) -> None:
    rows, n = x.shape
    if rows == 0 or n == 0:
        return
    mod = module_for(x.device, x.dtype)
    pol = get_policy()
    buf = bias.buf
    px, pb, pr = x.data_ptr(), buf.data_ptr(), _ptr(residual)
    v = _vec_width(x.dtype)
    vec = pol.vectorize and n % v == 0 and _aligned(px, pb, pr)
    units = n // v if vec else n
    flat = pol.elementwise == "flat"
    grid, block = cached_config(mod, "bias_act", "flat" if flat else "rows", rows, units)
    mod.launch("bias_act", grid, block, (
        px, pb, bias.slot.data_ptr(), np.int64(buf.shape[0]),
        pr, np.int64(rows), np.int32(n), np.int32(act), np.int32(vec),
        np.int32(flat),
    ))


# ---------------------------------------------------------------------------------------------
# the ops: the contracts are the docstrings of itif.ops.dispatch's op classes


def bias_act(x: torch.Tensor, bias: RotParam, act: str = "none") -> torch.Tensor:
    """Kernel of ``dispatch.BiasAct``: one launch, rows or flat (``LaunchPolicy``)."""
    _check(validate_bias_act, _validate.sig_bias_act, x, bias, act)
    _elementwise(x, bias, None, ACT_CODES[act])
    return x


def bias_residual(x: torch.Tensor, bias: RotParam, residual: torch.Tensor) -> torch.Tensor:
    """Kernel of ``dispatch.BiasResidual``: ``bias_act``'s kernel with a residual."""
    _check(validate_bias_residual, _validate.sig_bias_residual, x, bias, residual)
    _elementwise(x, bias, residual, ACT_CODES["none"])
    return x


def bias_residual_layernorm(
    x: torch.Tensor,
    bias: RotParam | None,
    residual: torch.Tensor | None,
    gamma: RotParam,
    beta: RotParam,
    eps: float,
    keep_sum: bool = False,
) -> torch.Tensor:
    """Kernel of ``dispatch.BiasResidualLayerNorm``. Block per row (Eq. 4.3-4.4) or warp per
    row (``LaunchPolicy.layernorm``); the pre-norm sum is cached in shared memory when a row
    fits the default 48 KiB."""
    _check(validate_bias_residual_layernorm, _validate.sig_bias_residual_layernorm,
           x, bias, residual, gamma, beta, eps, keep_sum)
    rows, h = x.shape
    y = torch.empty_like(x)
    if rows == 0 or h == 0:
        return y
    mod = module_for(x.device, x.dtype)
    pol = get_policy()
    px, pr, py = x.data_ptr(), _ptr(residual), y.data_ptr()
    pb = None if bias is None else bias.buf.data_ptr()
    pg, pbe = gamma.buf.data_ptr(), beta.buf.data_ptr()
    v = _vec_width(x.dtype)
    vec = pol.vectorize and h % v == 0 and _aligned(px, pb, pr, pg, pbe, py)
    units = h // v if vec else h
    warp = pol.layernorm == "warp" or (pol.layernorm == "auto" and h <= 1024)
    row_bytes = 4 * h
    cached = pol.ln_smem_cache and row_bytes <= _SMEM_DEFAULT_LIMIT
    if warp:
        warps = pol.warps_per_block
        if cached:
            warps = max(1, min(warps, _SMEM_DEFAULT_LIMIT // row_bytes))
        smem = warps * row_bytes if cached else 0
        grid, block = cached_config(mod, "bias_residual_layernorm", "warp", rows, 0, smem, warps)
    else:
        smem = row_bytes if cached else 0
        grid, block = cached_config(mod, "bias_residual_layernorm", "rows", rows, units, smem)
    b_slot, b_cap = (None, 1) if bias is None else (bias.slot.data_ptr(), bias.buf.shape[0])
    mod.launch("bias_residual_layernorm", grid, block, (
        px, pb, b_slot, np.int64(b_cap), pr,
        pg, gamma.slot.data_ptr(), np.int64(gamma.buf.shape[0]),
        pbe, beta.slot.data_ptr(), np.int64(beta.buf.shape[0]),
        py, np.int64(rows), np.int32(h), np.float32(eps), np.int32(keep_sum),
        np.int32(vec), np.int32(warp), np.int32(cached),
    ), shared_mem=smem)
    return y


def embed_text(
    word: RotParam, pos: RotParam, type_: RotParam,
    ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor,
) -> torch.Tensor:
    """Kernel of ``dispatch.EmbedText``. A row whose slot or index is out of range comes out
    NaN (no out-of-bounds read); token ids are validated against the vocabulary upstream
    (InvalidRequest), not here: that needs a sync."""
    _check(validate_embed_text, _validate.sig_embed_text, word, pos, type_, ids, positions, types)
    wbuf = word.buf
    rows, e = ids.shape[0], wbuf.shape[2]
    out = torch.empty(rows, e, dtype=wbuf.dtype, device=wbuf.device)
    if rows == 0 or e == 0:
        return out
    mod = module_for(wbuf.device, wbuf.dtype)
    pol = get_policy()
    pbuf, tbuf = pos.buf, type_.buf
    po, pw, pp, pt = out.data_ptr(), wbuf.data_ptr(), pbuf.data_ptr(), tbuf.data_ptr()
    v = _vec_width(wbuf.dtype)
    vec = pol.vectorize and e % v == 0 and _aligned(pw, pp, pt, po)
    units = e // v if vec else e
    flat = pol.elementwise == "flat"
    grid, block = cached_config(mod, "embed_text", "flat" if flat else "rows", rows, units)
    mod.launch("embed_text", grid, block, (
        po,
        pw, word.slot.data_ptr(), ids.data_ptr(),
        np.int64(wbuf.shape[0]), np.int64(wbuf.shape[1]),
        pp, pos.slot.data_ptr(), positions.data_ptr(),
        np.int64(pbuf.shape[0]), np.int64(pbuf.shape[1]),
        pt, type_.slot.data_ptr(), types.data_ptr(),
        np.int64(tbuf.shape[0]), np.int64(tbuf.shape[1]),
        np.int64(rows), np.int32(e), np.int32(vec), np.int32(flat),
    ))
    return out


def masked_softmax(
    scores: torch.Tensor,
    rows_per_seq: int,
    lengths: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Softmax over each row's live keys, in place: a step of the CUDA attention path with no
    op class of its own (no torch reference; the GPU tests and ``itif.ops.selftest``'s
    ``softmax_oracle`` hold its oracle).

    Semantics:
        scores[t, j] = exp(scale scores[t, j]) / sum_{k live} exp(scale scores[t, k])  (j live)
        scores[t, j] = 0                                                              (j dead)
        live(t, j) = j < lengths[b] and key_mask[b, j],  b = t // rows_per_seq

    A row with no live key is all zeros. Returns scores.

    Args:
        scores: Shape: [n * rows_per_seq, L], rows t. DType: float. Written in place and returned.
        rows_per_seq: Type: int, rows of one sequence (heads x queries).
        lengths: Shape: [n], or None (every key live). DType: int64. Read only.
        key_mask: Shape: n * L elements ([n, L] or [n, 1, 1, L]), or None. DType: bool.
            Read only.
        scale: Type: float, applied before the exponent.
    """
    _check(validate_masked_softmax, _validate.sig_masked_softmax,
           scores, rows_per_seq, lengths, key_mask, scale)
    rows, L = scores.shape
    if rows == 0 or L == 0:
        return scores
    mod = module_for(scores.device, scores.dtype)
    warps = get_policy().warps_per_block
    grid, block = cached_config(mod, "masked_softmax", "warp", rows, 0, 0, warps)
    mod.launch("masked_softmax", grid, block, (
        scores.data_ptr(), _ptr(lengths), _ptr(key_mask), np.int64(rows), np.int32(L),
        np.int64(rows_per_seq), np.float32(scale),
    ))
    return scores


def _sdpa_takes(dtype: torch.dtype, d: int) -> bool:
    """Whether torch's fused SDPA kernels (flash / memory-efficient) accept this head shape;
    when they do not, SDPA runs its unfused math path."""
    return d % 8 == 0 and d <= 256 and dtype in (torch.float16, torch.bfloat16, torch.float32)


def _softmax_bmm_group(qkv: torch.Tensor, g: AttnGroup, heads: int, out: torch.Tensor) -> None:
    """One group through bmm -> masked_softmax kernel -> bmm (the fallback path)."""
    H = qkv.shape[1] // 3
    d = H // heads
    n, L = g.n, g.L
    if n == 0:
        return
    if g.rows is None:
        block = qkv[g.start : g.start + n * L].view(n, L, 3, heads, d)
    else:
        block = qkv.index_select(0, g.rows.reshape(-1)).view(n, L, 3, heads, d)
    q, k, v = (t.reshape(n * heads, L, d) for t in block.permute(2, 0, 3, 1, 4).unbind(0))
    scores = torch.empty(n * heads, L, L, dtype=qkv.dtype, device=qkv.device)
    # alpha applies the 1/sqrt(d) scale inside the GEMM, in float32, before rounding.
    scores.baddbmm_(q, k.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(d))
    mask = None if g.key_mask is None else g.key_mask.reshape(n, L)
    masked_softmax(scores.view(n * heads * L, L), heads * L, None, mask, 1.0)
    o = torch.bmm(scores, v).view(n, heads, L, d).transpose(1, 2).reshape(n * L, H)
    if g.rows is None:
        out[g.start : g.start + n * L] = o
    else:
        out.index_copy_(0, g.dest, o.index_select(0, g.valid))


log = logging.getLogger("itif.ops")

_varlen_failed: set = set()  # (device index, dtype) where the variable-length kernel raised


@functools.cache
def _varlen_kernel(index: int):
    """torch's variable-length (flash) attention where this device runs it (sm80 or newer),
    else None."""
    if torch.cuda.get_device_capability(index)[0] < 8:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_group(qkv: torch.Tensor, varlen: tuple[torch.Tensor, int], heads: int,
                  out: torch.Tensor) -> bool:
    """Every sequence in one variable-length call; False (nothing written) where that kernel is
    missing or refuses this input, so the groups run instead."""
    T, H3 = qkv.shape
    H = H3 // 3
    d = H // heads
    key = (qkv.device.index, qkv.dtype)
    fn = _varlen_kernel(qkv.device.index)
    if (fn is None or key in _varlen_failed or qkv.dtype not in (torch.float16, torch.bfloat16)
            or d % 8 or d > 256):
        return False
    cu, L = varlen
    q, k, v = (qkv[:, i * H : (i + 1) * H].view(T, heads, d) for i in range(3))
    try:
        o = fn(q, k, v, cu, cu, L, L)
    except RuntimeError as e:  # raised before it wrote anything: the groups can still run
        _varlen_failed.add(key)
        log.warning("variable-length attention failed on %s %s (%s); attention runs per "
                    "length group there", qkv.device, qkv.dtype, e)
        return False
    out.view(T, heads, d).copy_(o)
    return True


def attention(
    qkv: torch.Tensor, groups: list[AttnGroup], heads: int, out: torch.Tensor | None = None,
    varlen: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """CUDA forward of ``dispatch.Attention``.

    A batch of several length groups that comes with ``varlen`` (its sequences as boundaries
    that tile the rows, ``PreparedBatch.varlen_L``) runs as one call of torch's variable-length
    flash attention in float16 / bfloat16 (policy ``"auto"``): one launch and a few Python calls
    a layer instead of a gather, an SDPA and a scatter per group. Under a serving load, where a
    batch spans a dozen length buckets, those per-group calls were most of a forward's host
    work, each one a release and re-take of the GIL the gRPC front end competes for.

    Otherwise, per group: torch's ``scaled_dot_product_attention`` (flash or
    memory-efficient kernels, which read the strided Q/K/V views in place and never materialise
    the [L, L] scores; cuDNN attention is left out around itif's forwards, see
    ``itif.platform.attention_backends``) whenever those kernels accept the head size. The bmm +
    fused masked softmax path is used (policy ``"auto"``) only where SDPA would fall back to its
    unfused math path: a masked group whose head size its fused kernels refuse; there it saves
    the separate mask-add and softmax passes over the [n, heads, L, L] scores.
    ``launch_policy(attention="sdpa" | "softmax_bmm")`` forces one path for measurement.
    """
    mode = get_policy().attention
    one_call = varlen is not None and mode == "auto"
    # groups are only checked (and so only built, see forward._LazyGroups) if they are run
    _check(validate_attention, _validate.sig_attention, qkv, () if one_call else groups, heads,
           out)
    T, H3 = qkv.shape
    H = H3 // 3
    d = H // heads
    if out is None:
        out = torch.zeros(T, H, dtype=qkv.dtype, device=qkv.device)
    if one_call:
        if _varlen_group(qkv, varlen, heads, out):
            return out
        _check(validate_attention, _validate.sig_attention, qkv, groups, heads, out)
    for g in groups:
        if mode == "softmax_bmm" or (
            mode == "auto" and g.key_mask is not None and not _sdpa_takes(qkv.dtype, d)
        ):
            _softmax_bmm_group(qkv, g, heads, out)
        else:
            reference.attention(qkv, [g], heads, out)
    return out


def slots_in_range(p: RotParam) -> bool:
    """Debug helper (syncs): whether every slot indexes the buffer."""
    s = p.slot
    return bool(s.numel() == 0 or (int(s.min()) >= 0 and int(s.max()) < p.buf.shape[0]))


__all__: Sequence[str] = (
    "ACT_CODES",
    "COMPILE_OPTIONS",
    "SUPPORTED_DTYPES",
    "DeviceInfo",
    "KernelBuildError",
    "LaunchPolicy",
    "attention",
    "bias_act",
    "bias_residual",
    "bias_residual_layernorm",
    "embed_text",
    "flat_config",
    "get_policy",
    "kernel_dir",
    "kernel_files",
    "kernel_names",
    "kernel_source",
    "launch_policy",
    "masked_softmax",
    "module_for",
    "resident_blocks",
    "rows_config",
    "set_validation_mode",
    "validate_attention",
    "validate_bias_act",
    "validate_bias_residual",
    "validate_bias_residual_layernorm",
    "validate_embed_text",
    "validate_launches",
    "validate_masked_softmax",
    "validation_mode",
    "warp_config",
    "warp_round",
)
