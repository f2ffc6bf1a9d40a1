"""Torch reference implementations of the fused engine's memory-bound ops.

These are the spec, the CPU path and the test oracle of the CUDA kernels in ``kernels/``
(``itif.ops.dispatch`` chooses). Every op runs once over all rows of the token buffer, whatever
their tenants: each row reads its own tenant's parameters through a ``RotParam`` ("model weight
rotation", thesis 4.2.2), an O(1) per-row slot index into the parameter kind's buffer instead of
the thesis' linear scan over tenant offsets.

Shapes: ``T`` rows of the token buffer (padding rows included), ``H`` hidden, ``N`` any width.

Arithmetic is float32 whatever the storage type, each result rounded once when it is stored, as
``kernels/rotation.cu`` does. In float16 / bfloat16 these ops used to add the bias, the residual
and LayerNorm's gamma and beta in the storage type, rounding at each step: bert-small in bfloat16
on the CPU was then further off Hugging Face in float32 than Hugging Face's own bfloat16 model
(last hidden state, median relative error over 48 requests: 1.25e-2 against 1.03e-2; now
0.92e-2). ``tests/test_reduced_precision.py`` holds both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from itif.ops.rows import broadcast_rows


class RotParam(NamedTuple):
    """A rotated parameter: all slots of one kind, and the slot each row reads.

    ``plan`` optionally gives the same information as the batch's GEMM plan for this slot table
    (``itif.runtime.gemm.GemmPlan``). Kernels read ``slot``; the CPU reference, given a plan,
    broadcasts each run's parameters as a view (one op for ``mm``/``bmm`` plans) instead of
    materialising ``[T, *shape]`` per-row copies.
    """

    buf: torch.Tensor  # [capacity, *shape]
    slot: torch.Tensor  # [T] int64, values in [0, capacity)
    plan: object = None  # GemmPlan covering all T rows, or None


def _wide(x: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``x`` in float32 for the arithmetic: a new tensor for float16 / bfloat16; a float32 (or
    wider) ``x`` itself, or a copy of it with ``copy``."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x.clone() if copy else x


def rows_of(p: RotParam) -> torch.Tensor:
    """Per-row parameter values ``[T, *shape]`` (materialised)."""
    return p.buf.index_select(0, p.slot)


def _apply(x: torch.Tensor, p: RotParam, op: str) -> torch.Tensor:
    """``x.<op>_(p[row])`` for every row, in place: one broadcast op when the plan allows it,
    per segment when there are few, else through materialised per-row values."""
    plan = p.plan
    if plan is not None and p.buf.dim() == 2:
        view = broadcast_rows(p.buf, plan)
        if view is not None:
            target = x.view(plan.n, plan.L, x.shape[-1]) if plan.backend == "bmm" else x
            getattr(target, op)(view)
            return x
        if len(plan.segs) <= 4:
            segs = plan.segs
            for s, e, k in zip(segs.start, segs.end, segs.slot):
                getattr(x[s:e], op)(p.buf[k])
            return x
    return getattr(x, op)(rows_of(p))


_ACT = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "none": lambda x: x,
}


def activation(name: str):
    return _ACT[name]


def bias_act(x: torch.Tensor, bias: RotParam, act: str = "none") -> torch.Tensor:
    """``x = act(x + bias[row])``. x: [T, N], modified in place and returned."""
    y = _apply(_wide(x, copy=False), bias, "add_")
    if act != "none":
        y = _ACT[act](y)
    return x if y is x else x.copy_(y)


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

    x: [T, H]. With ``keep_sum`` the pre-norm sum is also written into ``x`` (pre-LN blocks need
    it as the next residual); otherwise x is left unchanged.
    """
    if bias is None and residual is None and not keep_sum:
        y = _layernorm_segments(x, gamma, beta, eps)
        if y is not None:
            return y
    s = _wide(x, copy=not keep_sum)
    if bias is not None:
        _apply(s, bias, "add_")
    if residual is not None:
        s.add_(residual)
    if keep_sum and s is not x:
        x.copy_(s)
    y = F.layer_norm(s, (s.shape[-1],), eps=eps)
    return _apply(_apply(y, gamma, "mul_"), beta, "add_").to(x.dtype)


#: At most this many segments of rows normalise with their own gamma and beta in one
#: ``layer_norm`` call each (``_layernorm_segments``); more go through per-row values.
LN_MAX_SEGMENTS = 64


def _layernorm_segments(x: torch.Tensor, gamma: RotParam, beta: RotParam,
                        eps: float) -> torch.Tensor | None:
    """``LayerNorm(x) * gamma[row] + beta[row]`` as one ``layer_norm`` call per segment of the
    plan, gamma and beta passed to it (on the CPU, bias, GELU and residual already sit in the
    product that made ``x``, ``itif.runtime.cpu_linear``: two more passes over [T, H] for
    gamma and beta were then a fifth of the rest). ``layer_norm`` keeps float32 arithmetic for
    float16 / bfloat16 input and rounds once, as this module's contract asks. None when the
    plan has no segments both parameters follow (the caller then applies them per row)."""
    pg, pb = gamma.plan, beta.plan
    if (pg is None or pb is None or gamma.buf.dim() != 2 or beta.buf.dim() != 2
            or gamma.buf.dtype != x.dtype or beta.buf.dtype != x.dtype):
        return None
    sg, sb = pg.segs, pb.segs
    if (not 0 < len(sg) <= LN_MAX_SEGMENTS or (sg.start, sg.end) != (sb.start, sb.end)
            or sg.start[0] != 0 or sg.end[-1] != x.shape[0] or sg.start[1:] != sg.end[:-1]):
        return None  # the segments must tile the rows, in order
    if max(sg.slot) >= gamma.buf.shape[0] or max(sb.slot) >= beta.buf.shape[0]:
        return None  # a plan made for another slot table (the calibration's): per row
    H = (x.shape[-1],)
    if len(sg) == 1:
        return F.layer_norm(x, H, gamma.buf[sg.slot[0]], beta.buf[sb.slot[0]], eps)
    return torch.cat([F.layer_norm(x[s:e], H, gamma.buf[kg], beta.buf[kb], eps)
                      for s, e, kg, kb in zip(sg.start, sg.end, sg.slot, sb.slot)])


def bias_residual(x: torch.Tensor, bias: RotParam, residual: torch.Tensor) -> torch.Tensor:
    """``x = x + bias[row] + residual``, in place (pre-LN residual adds)."""
    y = _apply(_wide(x, copy=False), bias, "add_").add_(residual)
    return x if y is x else x.copy_(y)


def embed_text(
    word: RotParam, pos: RotParam, type_: RotParam,
    ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor,
) -> torch.Tensor:
    """BERT/ALBERT embeddings: ``word[slot, id] + pos[slot, p] + type[slot, t]`` -> [T, E].

    ids, positions, types: [T] int64, each row's own token, position (restarting per request)
    and token type. The three RotParams hold [capacity, rows, E] tables.
    """
    out = word.buf[word.slot, ids]
    dtype = out.dtype
    out = _wide(out, copy=False)
    out += pos.buf[pos.slot, positions]
    out += type_.buf[type_.slot, types]
    return out.to(dtype)


@dataclass(frozen=True)
class AttnGroup:
    """Requests whose attention runs in one call, as ``n`` sequences of ``L`` rows.

    View form (``rows is None``): the requests sit at stride L from row ``start``, so Q/K/V are
    views of the token buffer. Gather form: ``rows`` [n, L] lists each sequence's rows (padding
    positions point at the sequence's own first row and are masked: a masked key still reaches
    the output as 0 x its value, NaN where that value is not finite, so it must be the
    request's own), ``valid`` the flat positions of real tokens in
    [n*L] and ``dest`` their rows, so results scatter back without touching other rows.
    ``key_mask`` [n, 1, 1, L] bool marks real keys; None when every sequence fills all L rows.
    """

    n: int
    L: int
    start: int = 0
    rows: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    dest: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None


#: PyTorch's CPU flash attention (torch 2.13) runs a key length in whole blocks of 16 rows fast
#: and the rows of a partial block slowly: 32 sequences, 12 heads of 32, one thread, on this
#: project's 2-core EPYC: 0.34 ms at 16 keys, 1.43 at 15 (the query length does not matter: 15
#: queries over 16 keys, one masked, 0.38 ms). Padding the keys costs a copy of K and V, which
#: ate most of the gain beyond the first block (``bench/cpu_attention.py``: 24-63 keys 0.65-1.13x
#: of the op as it was, 8-12 up to 1.29x), and, for a group without a key mask, a new one,
#: which made those slower or no faster (1 sequence of 13-15 rows 1.3x, 8-128 sequences
#: 0.85-1.0x; measured while the rule still covered them). Masked groups of 13-15 rows of 8
#: or more sequences: 0.36-0.94x in every measured shape; of one sequence 1.03-1.21x, so a
#: group of one runs as it is.
CPU_ROUND_UP = range(13, 16)


def cpu_attention_len(L: int) -> int:
    """The key length a CPU attention call over sequences of ``L`` rows runs at: 16 for ``L``
    in :data:`CPU_ROUND_UP` (the added keys zero and masked; queries stay at ``L``), else
    ``L``; ``attention`` asks it for masked groups of two or more sequences only.
    ``python bench/cpu_attention.py`` compares the op both ways."""
    return 16 if L in CPU_ROUND_UP else L


def attention(
    qkv: torch.Tensor, groups: list[AttnGroup], heads: int, out: torch.Tensor | None = None,
    varlen: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Multi-head self-attention strictly within each request.

    qkv: [T, 3H] with Q, K, V side by side (bias already added). Returns [T, H]; rows no group
    covers are left as they were in ``out`` (zeros when allocated here). ``varlen`` (the same
    sequences as boundaries, for a backend with a variable-length kernel) is not read here: the
    reference runs the groups.
    """
    T, H3 = qkv.shape
    H = H3 // 3
    d = H // heads
    if out is None:
        out = torch.zeros(T, H, dtype=qkv.dtype, device=qkv.device)
    scale = 1.0 / math.sqrt(d)
    for g in groups:
        if g.rows is None:
            block = qkv[g.start : g.start + g.n * g.L].view(g.n, g.L, H3)
        else:
            block = qkv.index_select(0, g.rows.reshape(-1)).view(g.n, g.L, H3)
        q = block[:, :, :H].view(g.n, g.L, heads, d).transpose(1, 2)  # [n, heads, L, d]
        kv, mask = block[:, :, H:], g.key_mask
        L2 = g.L
        if mask is not None and g.n > 1 and qkv.device.type == "cpu":
            L2 = cpu_attention_len(g.L)
        if L2 > g.L:  # keys and values only (the query length does not matter): zero rows, masked
            kv = F.pad(kv, (0, 0, 0, L2 - g.L))
            mask = F.pad(mask, (0, L2 - g.L), value=False)
        k, v = kv.reshape(g.n, L2, 2, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.transpose(1, 2).reshape(g.n * g.L, H)
        if g.rows is None:
            out[g.start : g.start + g.n * g.L] = o
        else:
            out.index_copy_(0, g.dest, o.index_select(0, g.valid))
    return out


# ---- llama family (decoders): RMSNorm, rotary positions, the gated MLP ---------------------


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, gamma: RotParam, eps: float,
             keep_sum: bool = False) -> torch.Tensor:
    """``RMSNorm(x + residual) * gamma[row]``, a new [T, H] tensor: ``s / sqrt(mean(s^2) +
    eps)`` in float32, as Llama's RMSNorm (no mean subtracted, no beta).

    With ``keep_sum`` the sum ``x + residual`` is also written into ``x`` (the pre-norm block's
    next residual: one pass over the rows adds the sublayer's output and normalises it)."""
    s = _wide(x, copy=not keep_sum)
    if residual is not None:
        s.add_(residual)
    if keep_sum and s is not x:
        x.copy_(s)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return _apply(y, gamma, "mul_").to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotary positions, in place: each row's ``heads`` heads of ``d`` columns (x [T, heads*d],
    a column slice of a wider buffer is fine) become ``x * cos + rotate_half(x) * sin`` with the
    row's ``cos, sin [T, d]`` (float32), where ``rotate_half(x) = [-x[d/2:], x[:d/2]]`` (the
    halves convention of Hugging Face's Llama, not interleaved pairs)."""
    d = cos.shape[1]
    v = x.unflatten(1, (heads, d))
    f = _wide(v, copy=False)
    half = d // 2
    rot = torch.cat((-f[..., half:], f[..., :half]), dim=-1)
    out = f * cos[:, None, :] + rot * sin[:, None, :]
    v.copy_(out)
    return x


def gated_act(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The gated MLP's middle: x [T, 2I] holds the gate projection then the up projection;
    returns ``act(gate) * up`` [T, I] (SwiGLU for ``silu``), float32 arithmetic, one rounding."""
    n = x.shape[1] // 2
    g, u = _wide(x[:, :n], copy=False), _wide(x[:, n:], copy=False)
    return _ACT[act](g).mul_(u).to(x.dtype)
