"""The multi-tenant decoder forward: rows of every tenant in one pass.

Three calls, each over rows grouped by tenant (each tenant's rows contiguous; the engine orders
them so):

* ``encode`` (BART, Marian): the encoder over the tokens of new source sequences, then every
  decoder layer's cross-attention keys and values written once per source into the KV pool;
* ``prefill`` (GPT-2): the prompts of new requests, one row per prompt token (never per beam),
  causal attention within each prompt, K/V written to the prompt's cache locations; returns the
  logits of each prompt's last token;
* ``decode``: one row per running sequence (beam), one input token each at its own position; its
  K/V go to the row's location for that position, attention reads the row's history through its
  location table (``itif.generation.cache``); cross-attention groups a request's beams as the
  queries of one attention over the request's single copy of the source K/V.

Matrix products are ``itif.runtime.gemm`` plans over the tenant runs (one launch per parameter
kind when slots allow; tenants sharing a tensor form one segment); bias, activation, residual and
LayerNorm run once over all rows through ``itif.ops.dispatch``, each row reading its tenant's
slot. Attention is by lengths and offsets: sequences are gathered into ``[n, L]`` blocks with a
per-sequence length mask (never one mask across sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from itif.generation.decoder_lora import LoraBank, LoraRows
from itif.generation.spec import DecoderSpec
from itif.ops import dispatch as ops
from itif.ops.reference import RotParam
from itif.platform import attention_backends
from itif.runtime.gemm import plan_gemm, run_gemm, segments_for, tenant_runs
from itif.weights.store import StoreView


class SlotMatrix:
    """Slots of every canonical parameter of every stored tenant: ``slots [tenant ids, names]``,
    built once per store view (tenant registration), read by fancy indexing per call.

    ``ids``: each tenant's stable id (its row here); ids outlive store versions, so the running
    requests' tenant ids stay valid when other tenants come and go. Rows of ids whose tenant is
    not stored are zeros (no running request refers to them)."""

    def __init__(self, spec: DecoderSpec, view: StoreView, ids: dict[str, int],
                 lora: LoraBank | None = None) -> None:
        self.version = view.version
        self.names = [n for n, _ in spec.params()]
        self.col = {n: j for j, n in enumerate(self.names)}
        for t in view.tenants:
            ids.setdefault(t, len(ids))
        self.tenant_index = ids
        kinds: dict[str, tuple] = {}
        self.slots = np.zeros((len(ids), len(self.names)), dtype=np.int64)
        for t, entry in view.tenants.items():  # registration-time: once per tenant per view
            self.slots[ids[t]] = [entry.slots[n][1] for n in self.names]
            for n in self.names:
                kinds.setdefault(n, entry.slots[n][0])
        self.kinds = kinds
        self.view = view
        # LoRA tenants' adapter slots (-1: none), read with the view they were added with
        self.lora = lora
        self.lora_slot = None if lora is None else lora.slots_for(ids, len(ids))


class TenantParams:
    """One call's binding of canonical names to buffers, GEMM plans and per-row slots.

    ``tenant_ids``: the batch's tenants (indices into ``SlotMatrix``); ``row_tenant [T]``: each
    row's batch tenant, in runs. Plans are cached per distinct slot column."""

    def __init__(self, sm: SlotMatrix, tenant_ids: np.ndarray, row_tenant: np.ndarray,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.sm = sm
        self.tenant_ids = tenant_ids
        self.S = sm.slots[tenant_ids]  # [batch tenants, names]
        self.row_tenant = row_tenant
        self.T = int(row_tenant.size)
        self.runs = tenant_runs(row_tenant)
        self.device, self.dtype = device, dtype
        self._rt = torch.as_tensor(row_tenant, dtype=torch.int64, device=device)
        self._bound: dict[bytes, tuple] = {}
        self._by_name: dict[str, tuple] = {}
        self.lora: LoraRows | None = None  # the rows of LoRA tenants, one segment set
        if sm.lora_slot is not None:
            row_slot = sm.lora_slot[tenant_ids][row_tenant]
            if (row_slot >= 0).any():
                self.lora = LoraRows(sm.lora, row_slot, device)

    def bind(self, name: str):
        """(buffer, plan, offs, slot_rows) of ``name`` for these rows."""
        got = self._by_name.get(name)
        if got is not None:
            return got
        col = self.S[:, self.sm.col[name]]
        key = col.tobytes()
        b = self._bound.get(key)
        if b is None:
            plan = plan_gemm(segments_for(self.runs, col), self.T, self.device, self.dtype)
            offs = (torch.tensor(plan.offs, dtype=torch.int32, device=self.device)
                    if plan.backend == "grouped_mm" else None)
            slot_rows = torch.as_tensor(col, device=self.device).index_select(0, self._rt)
            b = self._bound[key] = (plan, offs, slot_rows)
        buf = self.sm.view.buffers[self.sm.kinds[name]]
        got = self._by_name[name] = (buf, *b)
        return got

    def rot(self, name: str) -> RotParam:
        buf, plan, _, slot_rows = self.bind(name)
        return RotParam(buf, slot_rows, plan)

    def gemm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x W^T`` of every row with its tenant's ``name``; plus, for the rows of LoRA
        tenants, their adapters' low-rank products (``itif.generation.decoder_lora``)."""
        buf, plan, offs, _ = self.bind(name)
        y = run_gemm(x, buf, plan, offs)
        return y if self.lora is None else self.lora.apply(y, x, name)

    def linear(self, x: torch.Tensor, name: str, act: str = "none") -> torch.Tensor:
        return ops.bias_act(self.gemm(x, name + ".weight"), self.rot(name + ".bias"), act)

    def ln(self, x: torch.Tensor, name: str, eps: float, residual: torch.Tensor | None = None,
           bias: str | None = None) -> torch.Tensor:
        return ops.bias_residual_layernorm(
            x,
            self.rot(bias) if bias else None,
            residual,
            self.rot(name + ".weight"),
            self.rot(name + ".bias"),
            eps,
        )


@dataclass(frozen=True)
class SeqGroup:
    """Packed sequences as a padded ``[n, L]`` gather: ``rows`` (a sequence's padding -> its own
    first row: a masked key still reaches the output as 0 x its value, NaN where that value is
    not finite, so it must never be another request's), ``lens [n]``, ``valid`` (flat positions
    of real tokens) and ``dest`` (their rows)."""

    n: int
    L: int
    rows: torch.Tensor
    lens: torch.Tensor
    valid: torch.Tensor
    dest: torch.Tensor

    @staticmethod
    def build(starts: np.ndarray, lens: np.ndarray, device) -> "SeqGroup":
        """Sequence ``i`` holds rows ``starts[i] : starts[i] + lens[i]`` (host arrays)."""
        n, L = int(lens.size), int(lens.max())
        cols = np.arange(L)[None, :]
        ok = cols < lens[:, None]
        rows = starts[:, None] + np.where(ok, cols, 0)
        valid = np.flatnonzero(ok.reshape(-1))
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
        return SeqGroup(n, L, t(rows), t(lens), t(valid), t(rows.reshape(-1)[valid]))


class Scratch:
    """Output buffers of a decode step's gathers (each layer's history and source K/V), reused
    by every layer and step: on the CPU a fresh multi-MB tensor per layer is fresh pages from
    the system each time, which cost more than the copy itself (measured: a 16 MB gather
    3.7 ms into a new tensor, 1.0 ms into a reused one). A layer's gathered K/V are read by its
    attention before the next layer gathers into the same buffer."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[rows, like.shape[1]]`` buffer of ``like``'s dtype and device."""
        n = rows * like.shape[1]
        b = self._bufs.get(name)
        if b is None or b.numel() < n or b.dtype != like.dtype or b.device != like.device:
            b = self._bufs[name] = torch.empty(max(n, 1), dtype=like.dtype, device=like.device)
        return b[:n].view(rows, like.shape[1])


def gather_rows(src: torch.Tensor, index: torch.Tensor, scratch: Scratch | None, name: str
                ) -> torch.Tensor:
    """``src``'s rows ``index`` (the K/V cache rows of a step's histories), into
    ``scratch``'s buffer ``name`` when given (no allocation per step), else a new tensor."""
    if scratch is None:
        return src.index_select(0, index)
    return torch.index_select(src, 0, index, out=scratch.take(name, index.numel(), src))


def _heads(x: torch.Tensor, n: int, L: int, heads: int) -> torch.Tensor:
    return x.reshape(n, L, heads, -1).transpose(1, 2)


def _seq_attention(qkv: torch.Tensor, g: SeqGroup, heads: int, causal: bool) -> torch.Tensor:
    """Self-attention within each packed sequence of ``g``. qkv [T, 3H] -> [T, H]."""
    T, H3 = qkv.shape
    H = H3 // 3
    blk = qkv.index_select(0, g.rows.reshape(-1)).view(g.n, g.L, 3, H)
    q, k, v = (_heads(blk[:, :, i], g.n, g.L, heads) for i in range(3))
    cols = torch.arange(g.L, device=qkv.device)
    mask = (cols[None, :] < g.lens[:, None])[:, None, None, :]
    if causal:
        mask = mask & (cols[None, :] <= cols[:, None])[None, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o = o.transpose(1, 2).reshape(g.n * g.L, H)
    out = torch.empty(T, H, dtype=qkv.dtype, device=qkv.device)
    out.index_copy_(0, g.dest, o.index_select(0, g.valid))
    return out


#: Bytes a running batch may spend keeping its requests' source keys/values gathered per layer
#: (``CrossGroup.cached``): within it, a decode step reads them in place instead of gathering
#: them from the pool again at every step (measured on the CPU, marian-decoding 32 requests x 128
#: source tokens: a 16 MB gather per layer per step, 9% of a beam-4 generation). Above it the
#: step gathers into scratch as before, so memory stays bounded whatever the batch.
CROSS_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class CrossGroup:
    """The cross-attention of decode rows: request ``i``'s rows (``rows.rows[i]``) attend to its
    source, ``src_loc [n, S]`` pool locations with ``rows.lens``-style source lengths."""

    rows: SeqGroup
    src_loc: torch.Tensor
    src_len: torch.Tensor
    #: ``[n, 1, 1, S]`` source-length mask, built once for every layer and step of this group;
    #: None when every source fills all ``S`` columns (no mask to apply).
    mask: torch.Tensor | None = None
    #: layer -> that layer's source (keys transposed ``[n, heads, d, S]``, values
    #: ``[n, heads, S, d]``), gathered at the group's
    #: first step and read by the next ones; None: gather at every step (one-off groups, or a
    #: batch whose sources exceed ``CROSS_CACHE_BYTES``). The pool's source K/V never change
    #: while a request runs, and a membership change builds a new group.
    cached: dict | None = None

    @staticmethod
    def build(rows: SeqGroup, src_loc: torch.Tensor, src_len: np.ndarray, layers: int = 0,
              width: int = 0, itemsize: int = 4) -> "CrossGroup":
        """``src_len``: host lengths (whether a mask is needed is decided without a sync).
        ``layers``, ``width`` (2 x hidden) and ``itemsize``: give them to keep the sources
        gathered across steps when they fit ``CROSS_CACHE_BYTES``."""
        S = src_loc.shape[1]
        lens = torch.as_tensor(src_len, device=src_loc.device)
        mask = None
        if int(src_len.min()) < S:
            ok = torch.arange(S, device=src_loc.device)[None, :] < lens[:, None]
            mask = ok[:, None, None, :]
            # Padding columns read the request's own first source position (as SeqGroup's rows).
            src_loc = torch.where(ok, src_loc, src_loc[:, :1])
        keep = 0 < layers * src_loc.numel() * width * itemsize <= CROSS_CACHE_BYTES
        return CrossGroup(rows, src_loc, lens, mask, {} if keep else None)


def _source_heads(kv: torch.Tensor, c: CrossGroup, layer: int, heads: int,
                  scratch: Scratch | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s source keys (transposed, ``[n, heads, d, S]``) and values
    (``[n, heads, S, d]``) of ``c``'s requests."""
    got = None if c.cached is None else c.cached.get(layer)
    if got is not None:
        return got
    n, S = c.src_loc.shape
    H = kv.shape[1] // 2
    src = gather_rows(kv, c.src_loc.reshape(-1), scratch if c.cached is None else None, "source")
    src = src.view(n, S, 2 * H)
    kt, v = _heads(src[:, :, :H], n, S, heads).transpose(2, 3), _heads(src[:, :, H:], n, S, heads)
    if c.cached is None:
        return kt, v
    got = c.cached[layer] = (kt.contiguous(), v.contiguous())
    return got


def _attend(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for few queries a sequence (a request's beams): two batched
    products, where the CPU's fused attention kernel costs twice as much at 4 queries over 128
    keys (measured 0.7 vs 1.6 ms for 32 requests x 8 heads). q [n, h, L, d]; kt [n, h, d, S];
    v [n, h, S, d]; mask [n, 1, 1, S] (True: attend) or None."""
    s = torch.matmul(q, kt).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return torch.matmul(s.softmax(-1), v)


def _cross_attention(q: torch.Tensor, kv: torch.Tensor, c: CrossGroup, heads: int, layer: int,
                     scratch: Scratch | None = None) -> torch.Tensor:
    """q [R, H]; kv [capacity, 2H] layer ``layer``'s pool -> [R, H]. Each request's beams are the
    queries of one attention over its one copy of the source keys/values."""
    R, H = q.shape
    g = c.rows
    qq = _heads(q.index_select(0, g.rows.reshape(-1)), g.n, g.L, heads)
    kt, v = _source_heads(kv, c, layer, heads, scratch)
    o = _attend(qq, kt, v, c.mask).transpose(1, 2).reshape(g.n * g.L, H)
    out = torch.empty(R, H, dtype=q.dtype, device=q.device)
    out.index_copy_(0, g.dest, o.index_select(0, g.valid))
    return out


@dataclass(frozen=True)
class StepRows:
    """What every layer of one decode step reads about its rows, built once per step: the
    history locations ``loc [R, L]``, the location each row writes (``loc[r, pos[r]]``) and the
    ``[R, 1, 1, L]`` history mask. Columns past ``pos[r]`` read the row's write location: the
    table's own ones may hold a freed request's stale K/V and its padding points at location 0,
    and a masked key still reaches the output as 0 x its value (NaN where it is not finite)."""

    loc: torch.Tensor
    write: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def build(loc: torch.Tensor, pos: torch.Tensor) -> "StepRows":
        L = loc.shape[1]
        ok = torch.arange(L, device=loc.device)[None, :] <= pos[:, None]
        write = loc.gather(1, pos[:, None])
        return StepRows(torch.where(ok, loc, write), write.squeeze(1), ok[:, None, None, :])


def _cache_attention(qkv: torch.Tensor, kv: torch.Tensor, s: StepRows, heads: int,
                     scratch: Scratch | None = None) -> torch.Tensor:
    """One query per row over the row's history: write the row's K/V at ``loc[r, pos[r]]``, then
    attend to ``loc[r, :pos[r] + 1]``. qkv [R, 3H]; kv one layer's pool [capacity, 2H]."""
    R, H3 = qkv.shape
    H = H3 // 3
    L = s.loc.shape[1]
    kv.index_copy_(0, s.write, qkv[:, H:])
    hist = gather_rows(kv, s.loc.reshape(-1), scratch, "history").view(R, L, 2 * H)
    q = _heads(qkv[:, :H], R, 1, heads)
    k, v = _heads(hist[:, :, :H], R, L, heads), _heads(hist[:, :, H:], R, L, heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask).transpose(1, 2).reshape(R, H)


def _embed(spec: DecoderSpec, P: TenantParams, ids: torch.Tensor, pos: torch.Tensor,
           side: str) -> torch.Tensor:
    word = P.rot("emb.word")
    x = word.buf[word.slot, ids]
    if spec.scale_embedding:
        x = x * spec.embed_scale
    if spec.family == "gpt2":
        p = P.rot("emb.pos")
        return x + p.buf[p.slot, pos]
    if spec.family == "marian":
        return x + _sinusoids(spec, x.device, x.dtype).index_select(0, pos)
    p = P.rot(f"{side}.emb.pos")
    x = x + p.buf[p.slot, pos + spec.pos_offset]
    return P.ln(x, f"{side}.emb.ln", spec.eps)


_SIN: dict = {}


def _sinusoids(spec: DecoderSpec, device, dtype) -> torch.Tensor:
    key = (spec.max_position, spec.hidden, str(device), dtype)
    t = _SIN.get(key)
    if t is None:
        t = _SIN[key] = spec.sinusoidal(dtype).to(device)
    return t


def lm_logits(spec: DecoderSpec, P: TenantParams, x: torch.Tensor) -> torch.Tensor:
    """The LM head of each row's tenant over final hidden states ``x``: the word embeddings
    when the spec ties them, else ``lm_head``, plus Marian's / BART's final logits bias."""
    y = P.gemm(x, "emb.word" if spec.tied_lm_head else "lm_head.weight")
    if spec.encoder_decoder:
        ops.bias_act(y, P.rot("final_logits_bias"))
    return y


def _post_ln_tail(spec: DecoderSpec, P: TenantParams, p: str, x: torch.Tensor) -> torch.Tensor:
    f = P.linear(x, p + "ffn_in", spec.act)
    return P.ln(P.gemm(f, p + "ffn_out.weight"), p + "ln2", spec.eps, x, p + "ffn_out.bias")


def encode(spec: DecoderSpec, P: TenantParams, kv: torch.Tensor, ids: torch.Tensor,
           pos: torch.Tensor, seqs: SeqGroup, src_loc: torch.Tensor) -> None:
    """The encoder over packed source tokens; each decoder layer's cross K/V of every token are
    written to ``kv[layer, src_loc[token]]`` (once per source, whatever its beam count)."""
    with torch.inference_mode(), attention_backends(kv.device):
        x = _embed(spec, P, ids, pos, "enc")
        for i in range(spec.enc_layers):
            p = f"enc.{i}."
            ctx = _seq_attention(P.linear(x, p + "qkv"), seqs, spec.heads, causal=False)
            x = P.ln(
                P.gemm(ctx, p + "attn_out.weight"), p + "ln1", spec.eps, x, p + "attn_out.bias"
            )
            x = _post_ln_tail(spec, P, p, x)
        for i in range(spec.dec_layers):
            kv[i].index_copy_(0, src_loc, P.linear(x, f"dec.{i}.cross_kv"))


def prefill(spec: DecoderSpec, P: TenantParams, kv: torch.Tensor, ids: torch.Tensor,
            pos: torch.Tensor, seqs: SeqGroup, wloc: torch.Tensor,
            last: np.ndarray) -> torch.Tensor:
    """Decoder-only prompts (packed rows): K/V to ``kv[layer, wloc[row]]``; returns the logits
    [n, V] of rows ``last`` (host array: each prompt's last token)."""
    with torch.inference_mode(), attention_backends(kv.device):
        x = _embed(spec, P, ids, pos, "dec")
        for i in range(spec.dec_layers):
            p = f"dec.{i}."
            qkv = P.linear(P.ln(x, p + "ln1", spec.eps), p + "qkv")
            H = spec.hidden
            kv[i].index_copy_(0, wloc, qkv[:, H:])
            ctx = _seq_attention(qkv, seqs, spec.heads, causal=True)
            x = ops.bias_residual(P.gemm(ctx, p + "attn_out.weight"), P.rot(p + "attn_out.bias"), x)
            f = P.linear(P.ln(x, p + "ln2", spec.eps), p + "ffn_in", spec.act)
            x = ops.bias_residual(P.gemm(f, p + "ffn_out.weight"), P.rot(p + "ffn_out.bias"), x)
        x = P.ln(x, "final_ln", spec.eps)
        # The head over the last rows only: a row subset has its own tenant runs.
        return head_rows(spec, P, x, last)


def head_rows(spec: DecoderSpec, P: TenantParams, x: torch.Tensor, last: np.ndarray
              ) -> torch.Tensor:
    """:func:`lm_logits` of rows ``last`` of ``x`` only (a prefill's last prompt tokens),
    each with its own tenant's head."""
    sub = TenantParams(P.sm, P.tenant_ids, P.row_tenant[last], P.device, P.dtype)
    rows = torch.as_tensor(last, dtype=torch.int64, device=x.device)
    return lm_logits(spec, sub, x.index_select(0, rows))


def decode(spec: DecoderSpec, P: TenantParams, kv: torch.Tensor, ids: torch.Tensor,
           pos: torch.Tensor, loc: torch.Tensor, cross: CrossGroup | None,
           scratch: Scratch | None = None) -> torch.Tensor:
    """One token per row at position ``pos[r]``; ``loc [R, L]`` the rows' cache locations
    (L > max pos). Returns the logits [R, V]."""
    with torch.inference_mode(), attention_backends(kv.device):
        x = _embed(spec, P, ids, pos, "dec")
        rows = StepRows.build(loc, pos)
        for i in range(spec.dec_layers):
            p = f"dec.{i}."
            if spec.pre_ln:
                qkv = P.linear(P.ln(x, p + "ln1", spec.eps), p + "qkv")
                ctx = _cache_attention(qkv, kv[i], rows, spec.heads, scratch)
                x = ops.bias_residual(
                    P.gemm(ctx, p + "attn_out.weight"), P.rot(p + "attn_out.bias"), x
                )
                f = P.linear(P.ln(x, p + "ln2", spec.eps), p + "ffn_in", spec.act)
                x = ops.bias_residual(P.gemm(f, p + "ffn_out.weight"), P.rot(p + "ffn_out.bias"), x)
                continue
            ctx = _cache_attention(P.linear(x, p + "qkv"), kv[i], rows, spec.heads, scratch)
            x = P.ln(
                P.gemm(ctx, p + "attn_out.weight"), p + "ln1", spec.eps, x, p + "attn_out.bias"
            )
            c = _cross_attention(P.linear(x, p + "cross_q"), kv[i], cross, spec.heads, i, scratch)
            x = P.ln(
                P.gemm(c, p + "cross_out.weight"), p + "ln_cross", spec.eps, x, p + "cross_out.bias"
            )
            x = _post_ln_tail(spec, P, p, x)
        if spec.pre_ln:
            x = P.ln(x, "final_ln", spec.eps)
        return lm_logits(spec, P, x)


def group_rows(tenant_of_row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order rows so each tenant's are contiguous (stable: a request's rows stay together and in
    order). Returns (perm: forward row -> original row, batch tenant ids, row_tenant in batch
    ids)."""
    perm = np.argsort(tenant_of_row, kind="stable")
    ordered = tenant_of_row[perm]
    tenant_ids, row_tenant = np.unique(ordered, return_inverse=True)
    return perm, tenant_ids, row_tenant.astype(np.int64)


def rows_of_requests(counts: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start row and count of each of consecutive requests with ``counts`` rows."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return starts, counts


__all__ = [
    "CrossGroup",
    "Scratch",
    "SeqGroup",
    "SlotMatrix",
    "StepRows",
    "TenantParams",
    "decode",
    "encode",
    "gather_rows",
    "group_rows",
    "head_rows",
    "lm_logits",
    "prefill",
    "rows_of_requests",
]
