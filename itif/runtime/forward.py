"""The fused forward: one pass over the token buffer for the requests of every tenant.

The hot path, from the public call down to the kernels:

1. ``Engine.infer`` (``itif.runtime.engine``) validates the requests in bulk and snapshots the
   weight store;
2. ``Engine.plan`` -> ``itif.batching.strategies.plan``: a Layout (where each request's rows go);
3. ``prepare`` (``itif.runtime.batch``): every index array of the batch in one pinned host
   buffer, a GEMM plan per distinct slot table, attention and head groups (host only);
4. ``PreparedBatch.upload``: one non-blocking copy to the device; or, with CUDA graphs
   (``itif.runtime.graphs``), a copy into a captured graph's static buffer and a replay;
5. ``run`` (here): embeddings, every layer, the heads, all written into one flat output buffer
   that comes back to the host in one copy;
6. per layer: ``gemm.run_gemm`` for the per-tenant matrix products (one ``mm``/``bmm``/
   ``_grouped_mm`` launch per parameter kind, whatever the tenant count, when slots allow), and
   ``itif.ops.dispatch`` for the memory-bound ops (bias, activation, residual + LayerNorm,
   embeddings, attention): once over all rows, each row reading its own tenant's parameters;
   CUDA RawKernels from ``kernels/*.cu`` on a GPU, the torch reference
   (``itif.ops.reference``, which is also each op's written contract) elsewhere.

Nothing in ``run`` reads a tensor on the host: no ``.item()``, ``.tolist()``, ``.cpu()``,
``nonzero`` or boolean mask; every Python-level decision comes from the PreparedBatch, so the
whole function can be captured in a CUDA graph. The only Python loops are over layers and over
the (few) attention and head groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from itif.backbones.spec import BackboneSpec
from itif.ops import dispatch as ops
from itif.ops.reference import AttnGroup, RotParam
from itif.platform import attention_backends
from itif.runtime import cpu_attention, cpu_linear, triton_gemm
from itif.runtime.batch import PreparedBatch
from itif.runtime.gemm import GemmPlan, Segments, broadcast_rows, plan_gemm, run_gemm
from itif.runtime.lora_update import apply_lora


class _Bound:
    """A PreparedBatch bound to its device buffers: device views by name."""

    def __init__(self, b: PreparedBatch, ints: torch.Tensor, floats: torch.Tensor | None) -> None:
        self.batch = b
        self.ints = ints
        self.floats = floats
        self.params = b.params
        self.row_tenant = self.get("row_tenant")
        tables = self.get("tables")  # [K, n_tenants]
        # Per-row slot of every distinct slot table: one gather for the whole batch.
        self.slot_rows = tables.index_select(1, self.row_tenant)  # [K, T]
        self._offs: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        return self.batch.packer.view(self.ints, name)

    def offs(self, name: str) -> torch.Tensor:
        o = self._offs.get(name)
        if o is None:
            o = self._offs[name] = self.get(name).to(torch.int32)
        return o

    def rot(self, name: str) -> RotParam:
        k = self.params.index(name)
        return RotParam(self.params.buffer(name), self.slot_rows[k], self.plan_of(k))

    def plan_of(self, k: int) -> GemmPlan:
        """The GEMM plan of slot table ``k`` over this forward's rows."""
        return self.params.plans[k]

    def linear(self, x: torch.Tensor, name: str, bias: str | None = None,
               act: str = "none") -> torch.Tensor:
        """``act(x @ W[slot].T + bias[slot])`` of each row, W and bias the parameters ``name``
        and ``bias``: one launch where the batch packed a Triton tile table for the product
        (``itif.runtime.triton_gemm``); on the CPU one oneDNN call with bias and activation
        inside where that applies (:meth:`fused`); else the GEMM plan, then ``bias_act``."""
        k = self.params.index(name)
        plan = self.plan_of(k)
        groups = self.batch.lora.get(name)
        bm = self.batch.tile_rows.get(k)
        if not groups and bm:
            rot = self.rot(bias) if bias is not None else None
            return triton_gemm.run(x, self.params.buffer(name), self.get(f"tiles{k}"), bm,
                                   rot.buf if rot else None, rot.slot if rot else None, act)
        y = self.fused(x, name, bias, act)
        if y is not None:
            return y
        offs = self.offs(f"offs{k}") if plan.backend == "grouped_mm" else None
        y = run_gemm(x, self.params.buffer(name), plan, offs)
        if groups:  # LoRA tenants' low-rank updates of their rows (itif.runtime.lora_update)
            apply_lora(y, x, groups, self.params.view.buffers, self.get, self.offs)
        if bias is not None:
            y = ops.bias_act(y, self.rot(bias), act)
        return y

    def fused(self, x: torch.Tensor, name: str, bias: str | None, act: str = "none",
              residual: torch.Tensor | None = None, norm: tuple | None = None
              ) -> torch.Tensor | None:
        """``act(x @ W[slot].T + bias[slot]) (+ residual)`` in one oneDNN call per segment on
        the CPU (``itif.runtime.cpu_linear``: float32 / bfloat16, long segments), rounded once;
        None where that does not apply (LoRA or Triton tiles on the product, the bias's slots
        not following the weight's segments, short segments): the caller runs the plain
        product and the memory-bound ops, whose rounding this then matches. ``norm``: (gamma,
        beta, eps), LayerNorm of that result, inside the same parallel region where
        ``cpu_linear`` can (each chunk still in cache), else after it."""
        k = self.params.index(name)
        plan, w = self.plan_of(k), self.params.buffer(name)
        if (self.batch.lora.get(name) or self.batch.tile_rows.get(k) or act not in cpu_linear.ACTS
                or (residual is not None and act != "none")
                or not cpu_linear.usable(x, w, plan)):
            return None
        b = bslots = None
        if bias is not None:
            bsegs = self.plan_of(self.params.index(bias)).segs
            if (bsegs.start, bsegs.end) != (plan.segs.start, plan.segs.end):
                return None
            b, bslots = self.params.buffer(bias), bsegs.slot
        if norm is None:
            return cpu_linear.linear(x, w, plan, b, bslots, act, residual)
        gamma, beta, eps = norm
        inside = cpu_linear.norm_args(plan, gamma, beta, x.dtype)
        y = cpu_linear.linear(x, w, plan, b, bslots, act, residual, inside, eps)
        return y if inside is not None else ops.bias_residual_layernorm(y, None, None, gamma,
                                                                         beta, eps)

    def varlen(self) -> tuple[torch.Tensor, int] | None:
        """The batch's attention as sequence boundaries (int32 [S+1]) and the longest sequence,
        for a backend with a variable-length kernel; None with one group (already one call)."""
        if not self.batch.varlen_L:
            return None
        return self.offs("varlen.cu"), self.batch.varlen_L

    def attn_groups(self) -> list[AttnGroup]:
        out = []
        dev = self.ints.device
        for g in self.batch.attn:
            mask = None
            if g.masked:
                lens = self.get(g.name + ".lens")
                mask = (torch.arange(g.L, device=dev)[None, :] < lens[:, None]).view(g.n, 1, 1, g.L)
            if g.gather:
                out.append(AttnGroup(n=g.n, L=g.L, rows=self.get(g.name + ".rows"),
                                     valid=self.get(g.name + ".valid"),
                                     dest=self.get(g.name + ".dest"), key_mask=mask))
            else:
                out.append(AttnGroup(n=g.n, L=g.L, start=g.start, key_mask=mask))
        return out


class _Rows(_Bound):
    """The batch restricted to the rows ``sel`` (sorted, host int64): each parameter's per-row
    slots and GEMM plans over those rows only. On the CPU the last encoder layer of a
    classifier runs here on the [CLS] rows (``_cls_only``): its attention needs every row's
    keys and values, but nothing after it reads another row, so the attention output's
    projection, both LayerNorms and the FFN (about 15% of the forward's FLOPs at 4 layers)
    run on n rows instead of T."""

    def __init__(self, bound: _Bound, sel: np.ndarray, dtype: torch.dtype) -> None:
        self.__dict__.update(bound.__dict__)
        self.sel, self.dtype = sel, dtype
        self.slot_rows = bound.slot_rows.index_select(1, torch.from_numpy(sel))
        self._plans: dict[int, GemmPlan] = {}
        self._offs = {}

    def plan_of(self, k: int) -> GemmPlan:
        plan = self._plans.get(k)
        if plan is None:
            segs = self.params.plans[k].segs
            a = np.searchsorted(self.sel, segs.start)
            b = np.searchsorted(self.sel, segs.end)
            keep = b > a
            sub = Segments(tuple(a[keep].tolist()), tuple(b[keep].tolist()),
                           tuple(np.asarray(segs.slot)[keep].tolist()))
            plan = self._plans[k] = plan_gemm(sub, len(self.sel), self.ints.device, self.dtype)
        return plan

    def offs(self, name: str) -> torch.Tensor:
        o = self._offs.get(name)
        if o is None:  # grouped_mm offsets of this subset's plans ("offs{k}" only)
            k = int(name.removeprefix("offs"))
            o = self._offs[name] = torch.tensor(self.plan_of(k).offs, dtype=torch.int32)
        return o


def _cls_only(spec: BackboneSpec, bound: _Bound, ints: torch.Tensor) -> np.ndarray | None:
    """The [CLS] rows (sorted) when the last layer may run on them alone: a post-LN text model
    on the CPU whose batch wants no per-token hidden state and has no LoRA tenants (their
    updates index rows of the full buffer); else None."""
    b = bound.batch
    if (ints.device.type != "cpu" or not spec.is_text or spec.pre_ln or b.want_hidden or b.lora
            or b.tile_rows or not (b.want_logits or b.want_pooled)):
        return None
    return np.sort(bound.get("cls_rows").numpy())


class _LazyGroups(Sequence):
    """The batch's attention groups, built on first use (once a forward). A backend that runs
    the batch as one variable-length call (``varlen``) never reads them, and building them is
    about a dozen Python calls into torch per gathered group, each of which gives the GIL away
    under load."""

    def __init__(self, bound: _Bound) -> None:
        self._bound = bound
        self._groups: list[AttnGroup] | None = None

    def _built(self) -> list[AttnGroup]:
        if self._groups is None:
            self._groups = self._bound.attn_groups()
        return self._groups

    def __len__(self) -> int:
        return len(self._bound.batch.attn)

    def __getitem__(self, i):
        return self._built()[i]

    def __iter__(self):
        return iter(self._built())


def _embed(spec: BackboneSpec, bound: _Bound, dtype: torch.dtype) -> torch.Tensor:
    if spec.is_text:
        x = ops.embed_text(bound.rot("emb.word"), bound.rot("emb.pos"), bound.rot("emb.type"),
                           bound.get("ids"), bound.get("positions"), bound.get("types"))
        gamma, beta = bound.rot("emb.ln.weight"), bound.rot("emb.ln.bias")
        inside = (cpu_linear.norm_args(gamma.plan, gamma, beta, x.dtype)
                  if x.device.type == "cpu" and gamma.plan is not None else None)
        x = (cpu_linear.layer_norm(x, gamma.plan, inside, spec.layer_norm_eps) if inside is not None
             else ops.bias_residual_layernorm(x, None, None, gamma, beta, spec.layer_norm_eps))
        if spec.family == "albert":
            x = bound.linear(x, "emb.proj.weight", "emb.proj.bias")
        return x
    # ViT: patches through the per-tenant projection, then the CLS token over row 0 of each
    # request, then position embeddings by each row's position.
    T = bound.batch.rows
    C, P = spec.num_channels, spec.patch_size
    g = spec.image_size // P
    flat = (bound.floats.view(-1, C, g, P, g, P).permute(0, 2, 4, 1, 3, 5)
            .reshape(-1, C * P * P).to(dtype))  # [n * g * g, C*P*P], one copy on the device
    patches = torch.zeros(T, C * P * P, dtype=dtype, device=bound.ints.device)
    patches.index_copy_(0, bound.get("patch_rows"), flat)
    x = bound.linear(patches, "emb.patch.weight", "emb.patch.bias")
    cls = bound.rot("emb.cls")
    cls_rows = bound.get("cls_token_rows")
    x.index_copy_(0, cls_rows, cls.buf.index_select(0, cls.slot.index_select(0, cls_rows)))
    pos = bound.rot("emb.pos")
    x += pos.buf[pos.slot, bound.get("positions")]
    return x


def encode(spec: BackboneSpec, bound: _Bound, dtype: torch.dtype,
           cls: np.ndarray | None = None) -> torch.Tensor:
    """Embeddings and every encoder layer; returns the last hidden state [T, H], or with
    ``cls`` (sorted rows, ``_cls_only``) the last layer's output of those rows only [n, H]."""
    eps, heads = spec.layer_norm_eps, spec.heads
    x = _embed(spec, bound, dtype)
    varlen = bound.varlen()
    groups = _LazyGroups(bound)
    T, H = x.shape
    if x.device.type == "cpu" and not spec.pre_ln:
        return _encode_cpu(spec, bound, x, groups, varlen, cls)
    if spec.pre_ln:
        # ViT: LN before each block; the sum of each residual add is kept in place (keep_sum)
        # and the next LayerNorm is fused into that add.
        a = ops.bias_residual_layernorm(x, None, None, bound.rot("layers.0.ln1.weight"),
                                        bound.rot("layers.0.ln1.bias"), eps)
    for layer in range(spec.layers):
        p = f"layers.{spec.layer_params(layer)}."
        qkv = bound.linear(a if spec.pre_ln else x, p + "qkv.weight", p + "qkv.bias")
        # Every row belongs to exactly one attention group, so no row is left unwritten.
        ctx = ops.attention(qkv, groups, heads, torch.empty(T, H, dtype=qkv.dtype,
                                                            device=qkv.device), varlen)
        h = bound.linear(ctx, p + "attn_out.weight")
        if spec.pre_ln:
            y = ops.bias_residual_layernorm(h, bound.rot(p + "attn_out.bias"), x,
                                            bound.rot(p + "ln2.weight"), bound.rot(p + "ln2.bias"),
                                            eps, keep_sum=True)  # h := x + attn
        else:
            y = ops.bias_residual_layernorm(h, bound.rot(p + "attn_out.bias"), x,
                                            bound.rot(p + "ln1.weight"),
                                            bound.rot(p + "ln1.bias"), eps)
        f = bound.linear(y, p + "ffn_in.weight", p + "ffn_in.bias", spec.hidden_act)
        o = bound.linear(f, p + "ffn_out.weight")
        if spec.pre_ln:
            nxt = (f"layers.{spec.layer_params(layer + 1)}.ln1" if layer + 1 < spec.layers
                   else "final_ln")
            a = ops.bias_residual_layernorm(o, bound.rot(p + "ffn_out.bias"), h,
                                            bound.rot(nxt + ".weight"), bound.rot(nxt + ".bias"),
                                            eps, keep_sum=True)  # o := h + ffn
            x = o
        else:
            x = ops.bias_residual_layernorm(o, bound.rot(p + "ffn_out.bias"), y,
                                            bound.rot(p + "ln2.weight"),
                                            bound.rot(p + "ln2.bias"), eps)
    return a if spec.pre_ln else x


def _encode_cpu(spec: BackboneSpec, bound: _Bound, x: torch.Tensor, groups, varlen,
                cls: np.ndarray | None) -> torch.Tensor:
    """The post-LN layers on the CPU: each product with its bias, GELU or residual add in one
    oneDNN call where that applies (``_Bound.linear``), so LayerNorm reads a finished sum;
    attention over the batch's sequence boundaries in one call where it has several length
    groups (``itif.runtime.cpu_attention``: no gather, padding or mask); and with ``cls``, the
    last layer after its attention on those rows only (``_Rows``)."""
    eps = spec.layer_norm_eps
    T, H = x.shape
    for layer in range(spec.layers):
        p = f"layers.{spec.layer_params(layer)}."
        qkv = bound.linear(x, p + "qkv.weight", p + "qkv.bias")
        ctx = torch.empty(T, H, dtype=qkv.dtype)
        if varlen is not None and cpu_attention.applies(qkv):
            ctx = cpu_attention.attention(qkv, varlen[0], spec.heads, ctx)
        else:
            ctx = ops.attention(qkv, groups, spec.heads, ctx, varlen)
        r = bound
        if cls is not None and layer == spec.layers - 1:
            idx = torch.from_numpy(cls)
            r, ctx, x = _Rows(bound, cls, x.dtype), ctx.index_select(0, idx), x.index_select(0, idx)
        y = _out_norm(r, ctx, p + "attn_out", x, p + "ln1", eps)
        f = r.linear(y, p + "ffn_in.weight", p + "ffn_in.bias", spec.hidden_act)
        x = _out_norm(r, f, p + "ffn_out", y, p + "ln2", eps)
    return x


def _out_norm(bound: _Bound, x: torch.Tensor, proj: str, residual: torch.Tensor, ln: str,
              eps: float) -> torch.Tensor:
    """``LayerNorm(x @ W.T + bias + residual)`` (``proj`` W and bias, ``ln`` gamma and beta):
    bias and residual inside the oneDNN call where it applies, else in the reference's one
    float32 pass before LayerNorm (float16, few rows: their rounding as before)."""
    gamma, beta = bound.rot(ln + ".weight"), bound.rot(ln + ".bias")
    y = bound.fused(x, proj + ".weight", proj + ".bias", residual=residual,
                    norm=(gamma, beta, eps))
    if y is not None:
        return y
    h = bound.linear(x, proj + ".weight")
    return ops.bias_residual_layernorm(h, bound.rot(proj + ".bias"), residual, gamma, beta, eps)


def _add_rows(y: torch.Tensor, buf: torch.Tensor, plan: GemmPlan, slots: torch.Tensor) -> None:
    """``y += buf[slot of each row]``: a broadcast view when the plan allows, else a gather."""
    view = broadcast_rows(buf, plan)
    if view is None:
        y += buf.index_select(0, slots)
    elif plan.backend == "bmm":
        y.view(plan.n, plan.L, y.shape[1]).add_(view)
    else:
        y += view


def heads(spec: BackboneSpec, bound: _Bound, hidden: torch.Tensor, out: torch.Tensor,
          cls_index: torch.Tensor | None = None) -> None:
    """Pooler and classification heads into the flat output buffer: one grouped product per
    head kind (tenants with the same label count), never a loop over tenants. ``cls_index``:
    where each [CLS] row (cls order) sits in ``hidden`` when that holds those rows only."""
    b = bound.batch
    view = b.params.view
    H = spec.hidden
    n_logits, n_pooled, _ = b.out_sizes
    # [n, H] in cls order
    cls = hidden.index_select(0, bound.get("cls_rows") if cls_index is None else cls_index)
    pooled = cls
    if b.pooler_plans is not None:
        pw, pb = b.pooler_plans
        r = b.pooler_rows
        pooled = cls.clone()
        buf = view.buffers[("pooler.weight", (H, H))]
        offs = bound.offs("pool.offs") if pw.backend == "grouped_mm" else None
        y = run_gemm(cls[:r], buf, pw, offs)
        # bias and tanh in one pass, in float32 and rounded once (as HF's addmm, then tanh)
        ops.bias_act(y, RotParam(view.buffers[("pooler.bias", (H,))], bound.get("pool.bias_slots"),
                                 pb), "tanh")
        pooled[:r] = y
    if b.want_logits:
        logits = out[:n_logits].view(b.n, b.max_labels)
        if sum((g.b - g.a) * g.labels for g in b.heads) < b.n * b.max_labels:
            logits.zero_()  # padding columns and head-less rows: defined, never garbage
        src = pooled if spec.is_text else cls
        if b.head_permuted:  # rows grouped by head kind (one gather of n x H activations)
            src = src.index_select(0, bound.get("head_perm"))
        for g in b.heads:
            offs = bound.offs(g.name + ".offs") if g.weight_plan.backend == "grouped_mm" else None
            dst = logits[g.a : g.b, : g.labels]  # float32: the bias is added there, unrounded
            dst.copy_(run_gemm(src[g.a : g.b], view.buffers[g.weight_kind], g.weight_plan, offs))
            _add_rows(dst, view.buffers[g.bias_kind], g.bias_plan,
                      bound.get(g.name + ".bias_slots"))
    if b.want_pooled:
        out[n_logits : n_logits + n_pooled].view(b.n, H).copy_(pooled)
    if b.want_hidden:
        out[n_logits + n_pooled :].view(b.rows, H).copy_(hidden)


def run(spec: BackboneSpec, b: PreparedBatch, ints: torch.Tensor,
        floats: torch.Tensor | None = None) -> torch.Tensor:
    """The forward of ``b`` over its device buffers; returns the flat float32 output (see
    ``PreparedBatch.out_sizes``). Launches only: safe to capture in a CUDA graph."""
    with torch.inference_mode(), attention_backends(ints.device):
        bound = _Bound(b, ints, floats)
        dtype = next(iter(b.params.view.buffers.values())).dtype
        cls = _cls_only(spec, bound, ints)
        hidden = encode(spec, bound, dtype, cls)
        out = torch.empty(sum(b.out_sizes), dtype=torch.float32, device=hidden.device)
        cls_index = None
        if cls is not None:  # hidden holds the sorted [CLS] rows only
            cls_index = torch.from_numpy(np.searchsorted(cls, bound.get("cls_rows").numpy()))
        heads(spec, bound, hidden, out, cls_index)
        return out
