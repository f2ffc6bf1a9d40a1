"""The llama family's multi-tenant forward (Llama, Qwen2, Mistral): ``prefill`` and ``decode``.

The same two calls as ``itif.generation.model`` for a decoder-only backbone, over rows of every
tenant grouped by tenant, with the same GEMM plans (``TenantParams``), the same cache tables
(``StepRows``, ``SeqGroup``) and the same KV pool, whose rows are ``kv_heads x d`` keys then as
many values wide (grouped-query attention caches only the shared heads). A block:

    h = RMSNorm(x) ; qkv = h W_qkv (+ b) ; rotate Q and K ; attend ; o = ctx W_o (+ b)
    h = RMSNorm(x + o) ; f = act(h W_gate) * (h W_up) ; x = x + o + f W_down (+ b)

Each residual add is fused into the next RMSNorm (``ops.rms_norm(keep_sum=True)``: one pass
adds the sublayer's output and normalises for the next sublayer), and the gate and up
projections are one ``gate_up`` GEMM. Rotary positions (``itif.generation.rope``) rotate the
query and key heads in one op, before the keys enter the cache: a cached key is never rotated
again. No position embeddings are stored.

Attention: ``heads`` query heads over ``kv_heads`` key/value heads (each key/value head serves
``heads / kv_heads`` consecutive query heads, as Hugging Face's ``repeat_kv``), causal, and for
Mistral's ``sliding_window`` w a query at position i sees keys i - w < j <= i (HF's sliding
mask); a decode step masks the older columns of the row's history the same way.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from itif.generation.model import (
    Scratch,
    SeqGroup,
    StepRows,
    TenantParams,
    gather_rows,
    head_rows,
    lm_logits,
)
from itif.generation.rope import Rope
from itif.generation.spec import DecoderSpec
from itif.ops import dispatch as ops
from itif.platform import attention_backends

_ROPES: dict[tuple, Rope] = {}


def rope_of(spec: DecoderSpec, device: torch.device) -> Rope:
    """The spec's rotary tables on ``device`` (built once)."""
    key = (spec, str(device))
    r = _ROPES.get(key)
    if r is None:
        r = _ROPES[key] = Rope(spec.rope_params, spec.head_dim, spec.max_position, device)
    return r


def _bias(P: TenantParams, y: torch.Tensor, name: str, present: bool) -> torch.Tensor:
    return ops.bias_act(y, P.rot(name)) if present else y


def _split(t: torch.Tensor, n: int, L: int, spec: DecoderSpec):
    """q [n, heads, L, d], k and v [n, kv_heads, L, d] of ``t [n, L, A + 2G]`` (views)."""
    A, G, d = spec.q_width, spec.kv_width, spec.head_dim
    q = t[..., :A].reshape(n, L, spec.heads, d).transpose(1, 2)
    k = t[..., A:A + G].reshape(n, L, spec.kv_heads_n, d).transpose(1, 2)
    v = t[..., A + G:].reshape(n, L, spec.kv_heads_n, d).transpose(1, 2)
    return q, k, v


def _sdpa(spec: DecoderSpec, q, k, v, mask) -> torch.Tensor:
    gqa = spec.kv_heads_n != spec.heads
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _seq_attention(spec: DecoderSpec, qkv: torch.Tensor, g: SeqGroup) -> torch.Tensor:
    """Causal self-attention within each packed prompt of ``g``: qkv [T, A + 2G] -> [T, A]."""
    T, A = qkv.shape[0], spec.q_width
    blk = qkv.index_select(0, g.rows.reshape(-1)).view(g.n, g.L, qkv.shape[1])
    q, k, v = _split(blk, g.n, g.L, spec)
    cols = torch.arange(g.L, device=qkv.device)
    causal = cols[None, :] <= cols[:, None]
    if spec.sliding_window:
        causal = causal & (cols[None, :] > cols[:, None] - spec.sliding_window)
    mask = (cols[None, :] < g.lens[:, None])[:, None, None, :] & causal[None, None]
    o = _sdpa(spec, q, k, v, mask).transpose(1, 2).reshape(g.n * g.L, A)
    out = torch.empty(T, A, dtype=qkv.dtype, device=qkv.device)
    out.index_copy_(0, g.dest, o.index_select(0, g.valid))
    return out


def _cache_attention(spec: DecoderSpec, qkv: torch.Tensor, kv: torch.Tensor, s: StepRows,
                     mask: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """One query per row: its K/V written at ``loc[r, pos[r]]``, attention over its history.
    qkv [R, A + 2G]; kv one layer's pool [capacity, 2G] -> [R, A]."""
    R, A = qkv.shape[0], spec.q_width
    L = s.loc.shape[1]
    kv.index_copy_(0, s.write, qkv[:, A:])
    hist = gather_rows(kv, s.loc.reshape(-1), scratch, "history").view(R, L, kv.shape[1])
    G, d = spec.kv_width, spec.head_dim
    q = qkv[:, :A].reshape(R, 1, spec.heads, d).transpose(1, 2)
    k = hist[:, :, :G].reshape(R, L, spec.kv_heads_n, d).transpose(1, 2)
    v = hist[:, :, G:].reshape(R, L, spec.kv_heads_n, d).transpose(1, 2)
    return _sdpa(spec, q, k, v, mask).transpose(1, 2).reshape(R, A)


def _layers(spec: DecoderSpec, P: TenantParams, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, attend) -> torch.Tensor:
    """Every block over rows ``x``; ``attend(layer, qkv)`` -> context [T, A] (it writes the
    layer's K/V). Returns the final RMSNorm's output."""
    eps, rot_heads = spec.eps, spec.heads + spec.kv_heads_n
    qk = spec.q_width + spec.kv_width
    h = ops.rms_norm(x, None, P.rot("dec.0.ln1.weight"), eps)
    for i in range(spec.dec_layers):
        p = f"dec.{i}."
        qkv = _bias(P, P.gemm(h, p + "qkv.weight"), p + "qkv.bias", spec.qkv_bias)
        ops.rotary(qkv[:, :qk], cos, sin, rot_heads)
        o = _bias(P, P.gemm(attend(i, qkv), p + "attn_out.weight"), p + "attn_out.bias",
                  spec.out_bias)
        h = ops.rms_norm(o, x, P.rot(p + "ln2.weight"), eps, keep_sum=True)
        x = o
        gu = _bias(P, P.gemm(h, p + "gate_up.weight"), p + "gate_up.bias", spec.mlp_bias)
        f = _bias(P, P.gemm(ops.gated_act(gu, spec.act), p + "ffn_out.weight"),
                  p + "ffn_out.bias", spec.mlp_bias)
        nxt = f"dec.{i + 1}.ln1.weight" if i + 1 < spec.dec_layers else "final_ln.weight"
        h = ops.rms_norm(f, x, P.rot(nxt), eps, keep_sum=True)
        x = f
    return h


def _embed(P: TenantParams, ids: torch.Tensor) -> torch.Tensor:
    word = P.rot("emb.word")
    return word.buf[word.slot, ids]


def prefill(spec: DecoderSpec, P: TenantParams, kv: torch.Tensor, ids: torch.Tensor,
            pos: torch.Tensor, seqs: SeqGroup, wloc: torch.Tensor, last: np.ndarray
            ) -> torch.Tensor:
    """Prompts (packed rows): rotated K and V to ``kv[layer, wloc[row]]``; the logits [n, V]
    of rows ``last`` (host array: each prompt's last token). A dynamic RoPE rotates a prompt
    with its own length as the sequence length (as ``generate()`` on that prompt alone)."""
    with torch.inference_mode(), attention_backends(kv.device):
        rope = rope_of(spec, kv.device)
        seq_len = seqs.lens.repeat_interleave(seqs.lens) if rope.dynamic else None
        cos, sin = rope.cos_sin(pos, seq_len)
        A = spec.q_width

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            kv[i].index_copy_(0, wloc, qkv[:, A:])
            return _seq_attention(spec, qkv, seqs)

        h = _layers(spec, P, _embed(P, ids), cos, sin, attend)
        return head_rows(spec, P, h, last)


def decode(spec: DecoderSpec, P: TenantParams, kv: torch.Tensor, ids: torch.Tensor,
           pos: torch.Tensor, loc: torch.Tensor, cross=None,
           scratch: Scratch | None = None) -> torch.Tensor:
    """One token per row at position ``pos[r]``; ``loc [R, L]`` the rows' cache locations
    (L > max pos). Returns the logits [R, V]. ``cross`` is unused (decoder-only)."""
    with torch.inference_mode(), attention_backends(kv.device):
        rope = rope_of(spec, kv.device)
        cos, sin = rope.cos_sin(pos, pos + 1 if rope.dynamic else None)
        rows = StepRows.build(loc, pos)
        mask = rows.mask
        if spec.sliding_window:
            cols = torch.arange(loc.shape[1], device=loc.device)
            recent = cols[None, :] > (pos - spec.sliding_window)[:, None]
            mask = mask & recent[:, None, None, :]

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            return _cache_attention(spec, qkv, kv[i], rows, mask, scratch)

        return lm_logits(spec, P, _layers(spec, P, _embed(P, ids), cos, sin, attend))


__all__ = ["decode", "prefill", "rope_of"]
