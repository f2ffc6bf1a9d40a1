"""The fused forward: one pass over the token buffer for the requests of every tenant.

Per layer: grouped per-slot GEMMs (``gemm.grouped_linear``) for the compute-bound products, and
each memory-bound op (bias, residual + LayerNorm, activation) once over all rows with per-row
parameters (``itif.ops.dispatch``). Attention runs strictly within each request. The only Python
loops are over layers, GEMM segments, attention groups and (for the heads) tenants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from itif.backbones.spec import BackboneSpec
from itif.ops import dispatch as ops
from itif.runtime.batch import PreparedBatch
from itif.runtime.gemm import grouped_linear


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, H] last hidden state of every row
    pooled: torch.Tensor | None  # [n, H] in cls_order
    logits: dict[int, torch.Tensor]  # batch tenant -> [requests of that tenant, labels]


def _linear(b: PreparedBatch, x: torch.Tensor, name: str) -> torch.Tensor:
    w, segs = b.params.segments(name)
    return grouped_linear(x, w, segs)


def _embed(spec: BackboneSpec, b: PreparedBatch) -> torch.Tensor:
    P = b.params
    if spec.is_text:
        x = ops.embed_text(P.rot("emb.word"), P.rot("emb.pos"), P.rot("emb.type"),
                           b.ids, b.positions, b.types)
        x = ops.bias_residual_layernorm(x, None, None, P.rot("emb.ln.weight"),
                                        P.rot("emb.ln.bias"), spec.layer_norm_eps)
        if spec.family == "albert":
            x = ops.bias_act(_linear(b, x, "emb.proj.weight"), P.rot("emb.proj.bias"))
        return x
    # ViT: patches through the per-tenant projection, then the CLS token over row 0 of each
    # request, then position embeddings by each row's position.
    x = ops.bias_act(_linear(b, b.patches, "emb.patch.weight"), P.rot("emb.patch.bias"))
    cls = P.rot("emb.cls")
    x[b.cls_rows] = cls.buf[cls.slot[b.cls_rows]]
    pos = P.rot("emb.pos")
    x += pos.buf[pos.slot, b.positions]
    return x


def encode(spec: BackboneSpec, b: PreparedBatch) -> torch.Tensor:
    """Embeddings and every encoder layer; returns the last hidden state [T, H]."""
    P, eps, heads = b.params, spec.layer_norm_eps, spec.heads
    x = _embed(spec, b)
    if spec.pre_ln:
        # ViT: LN before each block; the sum of each residual add is kept in place (keep_sum)
        # and the next LayerNorm is fused into that add.
        a = ops.bias_residual_layernorm(x, None, None, P.rot("layers.0.ln1.weight"),
                                        P.rot("layers.0.ln1.bias"), eps)
    for layer in range(spec.layers):
        p = f"layers.{spec.layer_params(layer)}."
        qkv = ops.bias_act(_linear(b, a if spec.pre_ln else x, p + "qkv.weight"),
                           P.rot(p + "qkv.bias"))
        ctx = ops.attention(qkv, b.attn, heads)
        h = _linear(b, ctx, p + "attn_out.weight")
        if spec.pre_ln:
            y = ops.bias_residual_layernorm(h, P.rot(p + "attn_out.bias"), x,
                                            P.rot(p + "ln2.weight"), P.rot(p + "ln2.bias"),
                                            eps, keep_sum=True)  # h := x + attn
        else:
            y = ops.bias_residual_layernorm(h, P.rot(p + "attn_out.bias"), x,
                                            P.rot(p + "ln1.weight"), P.rot(p + "ln1.bias"), eps)
        f = ops.bias_act(_linear(b, y, p + "ffn_in.weight"), P.rot(p + "ffn_in.bias"),
                         spec.hidden_act)
        o = _linear(b, f, p + "ffn_out.weight")
        if spec.pre_ln:
            nxt = (f"layers.{spec.layer_params(layer + 1)}.ln1" if layer + 1 < spec.layers
                   else "final_ln")
            a = ops.bias_residual_layernorm(o, P.rot(p + "ffn_out.bias"), h,
                                            P.rot(nxt + ".weight"), P.rot(nxt + ".bias"),
                                            eps, keep_sum=True)  # o := h + ffn
            x = o
        else:
            x = ops.bias_residual_layernorm(o, P.rot(p + "ffn_out.bias"), y,
                                            P.rot(p + "ln2.weight"), P.rot(p + "ln2.bias"), eps)
    return a if spec.pre_ln else x


def heads(spec: BackboneSpec, b: PreparedBatch, hidden: torch.Tensor,
          want_pooled: bool, want_logits: bool) -> ForwardOutput:
    """Pooler and classification heads, one small GEMM per tenant (label counts differ)."""
    view = b.params.view
    cls = hidden.index_select(0, b.cls_rows)  # [n, H] in cls_order
    pooled = torch.empty_like(cls) if (want_pooled or (want_logits and spec.is_text)) else None
    logits: dict[int, torch.Tensor] = {}
    for s, e, t in zip(*b.cls_runs):
        s, e = int(s), int(e)
        entry = view.tenants[b.tenants[t]]
        if pooled is not None:
            if entry.has_pooler:
                w, slot = view.param(b.tenants[t], "pooler.weight")
                bias, bslot = view.param(b.tenants[t], "pooler.bias")
                torch.tanh(torch.addmm(bias[bslot], cls[s:e], w[slot].t()), out=pooled[s:e])
            else:
                pooled[s:e] = cls[s:e]
        if want_logits and entry.num_labels:
            w, slot = view.param(b.tenants[t], "head.weight")
            bias, bslot = view.param(b.tenants[t], "head.bias")
            src = pooled[s:e] if spec.is_text else cls[s:e]
            logits[int(t)] = torch.addmm(bias[bslot], src, w[slot].t())
    return ForwardOutput(hidden, pooled, logits)


def run(spec: BackboneSpec, b: PreparedBatch, want_pooled: bool, want_logits: bool) -> ForwardOutput:
    with torch.inference_mode():
        hidden = encode(spec, b)
        return heads(spec, b, hidden, want_pooled, want_logits)

