"""PreparedBatch: everything one fused forward reads, built on the host in bulk before it runs.

``prepare`` turns a Layout into (1) one int64 host buffer holding every index array of the batch
(token ids, positions, token types, the batch-tenant of every row, the slot tables of every
parameter kind, grouped-GEMM offsets, attention lengths / gather rows, CLS rows and head slots),
pinned on CUDA so it travels to the device in one non-blocking copy; (2) for ViT, one float
buffer of the patches; and (3) the Python-level structure the forward follows: a GEMM plan per
distinct slot table (``itif.runtime.gemm``), attention groups, head groups and where each output
lands in the one flat output buffer. The forward (``itif.runtime.forward``) reads only device
views of those buffers: nothing inside it reads a tensor on the host.

``key`` names the structure: two batches with equal keys run the same kernels on buffers of the
same sizes, so a CUDA graph captured for one replays for the other (``itif.runtime.graphs``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from itif.backbones.spec import BackboneSpec
from itif.batching.layout import Layout
from itif.runtime import triton_gemm
from itif.runtime.gemm import GemmPlan, Segments, plan_gemm, segments_for, tenant_runs
from itif.runtime.lora_update import lora_tables, plan_lora
from itif.weights.store import StoreView


class Packer:
    """Named int64 arrays laid end to end in one host buffer; device views by name."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self.slices: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name -> start, size, shape
        self.size = 0

    def add(self, name: str, arr) -> str:
        a = np.ascontiguousarray(arr, dtype=np.int64)
        if name in self.slices:
            raise KeyError(f"{name} packed twice")
        self.slices[name] = (self.size, a.size, a.shape)
        self._parts.append(a.reshape(-1))
        self.size += a.size
        return name

    def host(self, pin: bool) -> torch.Tensor:
        buf = torch.empty(max(self.size, 1), dtype=torch.int64, pin_memory=pin)
        if self._parts:
            np.concatenate(self._parts, out=buf.numpy()[: self.size])
        return buf

    def view(self, dev: torch.Tensor, name: str) -> torch.Tensor:
        start, size, shape = self.slices[name]
        return dev[start : start + size].view(shape)


class Params:
    """Canonical parameter names of one batch against one store snapshot (host side).

    Every name has a slot table (the slot of each batch tenant); equal tables share one packed
    row, one per-row slot vector on the device and one GEMM plan, so tenants sharing a layer
    share the index work too.
    """

    def __init__(self, view: StoreView, tenants: tuple[str, ...], runs,
                 tables: dict[str, np.ndarray], rows: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.view = view
        entry = view.tenants[tenants[0]]
        self._kind = {name: kind for name, (kind, _) in entry.slots.items()}
        self._row: dict[str, int] = {}  # name -> row of the packed table matrix
        self._plans: list[GemmPlan] = []
        uniq: dict[bytes, int] = {}
        mats = []
        for name, table in tables.items():
            key = table.tobytes()
            k = uniq.get(key)
            if k is None:
                k = uniq[key] = len(mats)
                mats.append(table)
                self._plans.append(plan_gemm(segments_for(runs, table), rows, device, dtype))
            self._row[name] = k
        self.table_matrix = (np.stack(mats) if mats
                             else np.zeros((0, len(tenants)), np.int64))

    @property
    def plans(self) -> list[GemmPlan]:
        return self._plans

    def buffer(self, name: str) -> torch.Tensor:
        return self.view.buffers[self._kind[name]]

    def index(self, name: str) -> int:
        return self._row[name]

    def plan(self, name: str) -> GemmPlan:
        return self._plans[self._row[name]]

    def segments(self, name: str) -> tuple[torch.Tensor, Segments]:
        return self.buffer(name), self.plan(name).segs


@dataclass(frozen=True)
class AttnSpec:
    """One attention call: ``n`` sequences of ``L`` rows. View form (``gather`` False): rows
    ``start : start + n*L`` of the token buffer. Gather form: packed ``rows`` [n, L], ``valid``
    and ``dest`` (see ``itif.ops.reference.AttnGroup``). ``lens`` is packed when some sequence
    is shorter than L (the key mask is built from it on the device)."""

    n: int
    L: int
    start: int = 0
    gather: bool = False
    masked: bool = False
    name: str = ""  # prefix of this group's packed arrays
    host_rows: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self):  # None for a view group (tests and reports read this)
        return self.host_rows if self.gather else None


@dataclass(frozen=True)
class HeadGroup:
    """CLS rows ``[a, b)`` (in cls order) of tenants sharing one head kind."""

    a: int
    b: int
    labels: int
    weight_kind: object
    bias_kind: object
    weight_plan: GemmPlan
    bias_plan: GemmPlan
    name: str


@dataclass
class PreparedBatch:
    spec: BackboneSpec
    layout: Layout
    tenants: tuple[str, ...]  # batch-tenant index -> tenant id
    rows: int  # T rows of the token buffer
    n: int  # requests
    packer: Packer
    host_ints: torch.Tensor  # [packer.size] int64 (pinned on CUDA)
    host_floats: torch.Tensor | None  # ViT pixels [n*C*H*W] float32 (pinned on CUDA)
    params: Params
    attn: list[AttnSpec]
    cls_order: np.ndarray  # request indices in CLS-row order (pooler first, then tenant)
    head_order: np.ndarray  # request indices in logits-row order (head kind, then tenant)
    head_permuted: bool  # head_order differs from cls_order (the forward gathers "head_perm")
    pooler_rows: int  # CLS rows [0, pooler_rows) go through the pooler
    pooler_plans: tuple[GemmPlan, GemmPlan] | None  # (weight, bias) over those rows
    heads: list[HeadGroup]
    want_pooled: bool
    want_logits: bool
    want_hidden: bool
    max_labels: int
    labels: np.ndarray  # [n_tenants] label count of each batch tenant (0: no head)
    key: tuple = ()
    tok_row: np.ndarray | None = None  # text: row of every real token, in request order
    lora: dict = field(default_factory=dict)  # weight name -> LoraGroups (runtime.lora_update)
    #: The longest sequence of the packed "varlen.cu" boundaries (``_varlen``); 0: not packed
    #: (one attention group, which is already one call).
    varlen_L: int = 0
    #: Slot-table index -> rows a tile holds, for the tables packed as "tiles{k}" (the Triton
    #: GEMM, ``itif.runtime.triton_gemm``); empty when it is off.
    tile_rows: dict = field(default_factory=dict)

    # flat float32 output: [logits n x max_labels][pooled n x H][hidden T x H]
    @property
    def out_sizes(self) -> tuple[int, int, int]:
        H = self.spec.hidden
        return (self.n * self.max_labels if self.want_logits else 0,
                self.n * H if self.want_pooled else 0,
                self.rows * H if self.want_hidden else 0)

    def with_inputs(self, ids, types, pixels, device: torch.device) -> "PreparedBatch":
        """A batch of the same structure with other inputs: the index buffer is copied and only
        the token ids / types (or the pixels) are rewritten."""
        ints = torch.empty_like(self.host_ints, pin_memory=self.host_ints.is_pinned())
        a = ints.numpy()
        a[:] = self.host_ints.numpy()
        floats = None
        if self.spec.is_text:
            start = self.packer.slices["ids"][0]
            a[start + self.tok_row] = ids
            start = self.packer.slices["types"][0]
            a[start : start + self.rows] = 0
            if types is not None:
                a[start + self.tok_row] = types
        else:
            floats = _pixels_host(pixels, device)
        return dataclasses.replace(self, host_ints=ints, host_floats=floats)

    def upload(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's buffers on ``device``: one non-blocking copy each (pinned sources)."""
        if device.type != "cuda":
            return self.host_ints, self.host_floats
        ints = self.host_ints.to(device, non_blocking=True)
        floats = (None if self.host_floats is None
                  else self.host_floats.to(device, non_blocking=True))
        return ints, floats


@dataclass(frozen=True)
class SlotTables:
    """Per batch tenant: the slot of every backbone parameter, and what its head looks like.
    Built once per (tenants, generations) and cached by the engine, so ``prepare`` has no loop
    over tenants."""

    backbone: dict[str, np.ndarray]  # canonical name -> [n_tenants] slot
    head: dict[str, np.ndarray]  # pooler.* / head.* -> [n_tenants] slot (-1: none)
    has_pooler: np.ndarray  # [n_tenants] bool
    labels: np.ndarray  # [n_tenants] int64 (0: no head)
    head_kind: np.ndarray  # [n_tenants] int64 index into head_kinds (-1: no head)
    head_kinds: tuple  # KindKey of each head.weight kind in the batch
    lora: dict = field(default_factory=dict)  # weight name -> LoraTables (runtime.lora_update)


HEAD_PARAMS = ("pooler.weight", "pooler.bias", "head.weight", "head.bias")


def slot_tables(spec: BackboneSpec, view: StoreView, tenants: tuple[str, ...]) -> SlotTables:
    """Slot tables of a batch's tenants (one pass over the tenants; cache the result)."""
    entries = [view.tenants[t] for t in tenants]
    n = len(entries)
    backbone = {
        p.name: np.fromiter((e.slots[p.name][1] for e in entries), np.int64, count=n)
        for p in spec.params(pooler=False)
    }
    head = {name: np.fromiter((e.slots[name][1] if name in e.slots else -1 for e in entries),
                              np.int64, count=n) for name in HEAD_PARAMS}
    kinds: dict[object, int] = {}
    head_kind = np.fromiter(
        (kinds.setdefault(e.slots["head.weight"][0], len(kinds)) if "head.weight" in e.slots
         else -1 for e in entries), np.int64, count=n)
    return SlotTables(
        backbone=backbone, head=head,
        has_pooler=np.fromiter((e.has_pooler for e in entries), bool, count=n),
        labels=np.fromiter((e.num_labels or 0 for e in entries), np.int64, count=n),
        head_kind=head_kind, head_kinds=tuple(kinds), lora=lora_tables(entries),
    )


def attention_groups(layout: Layout, pk: Packer) -> list[AttnSpec]:
    """Dense mini-batches become view groups (neighbours of equal padded length merge into one
    call); packed requests are bucketed by length (each bucket padded to < 1.25x its shortest
    request); a bucket whose requests have one length and sit back to back is a view group too,
    others are gathered, so no mask ever spans requests."""
    groups: list[AttnSpec] = []
    length, offset = layout.length, layout.offset
    dense = np.flatnonzero(layout.mb_len > 0)
    i = 0
    while i < dense.size:
        m = dense[i]
        L = int(layout.mb_len[m])
        j = i + 1
        while (j < dense.size and layout.mb_len[dense[j]] == L
               and layout.mb_start[dense[j]] == layout.mb_start[dense[j - 1]]
               + layout.mb_size[dense[j - 1]] * L):
            j += 1
        mbs = dense[i:j]
        n = int(layout.mb_size[mbs].sum())
        start = int(layout.mb_start[m])
        reqs = np.flatnonzero(np.isin(layout.minibatch, mbs))
        reqs = reqs[np.argsort(offset[reqs], kind="stable")]
        lens = length[reqs]
        name = f"attn{len(groups)}"
        masked = bool(lens.min() < L)
        if masked:
            pk.add(name + ".lens", lens)
        groups.append(AttnSpec(n=n, L=L, start=start, masked=masked, name=name))
        i = j
    packed = np.flatnonzero(layout.mb_len[layout.minibatch] == 0)
    if packed.size:
        lens = length[packed]
        bucket = np.floor(np.log(lens) / np.log(1.25)).astype(np.int64)
        for b in np.unique(bucket):
            reqs = packed[bucket == b]
            reqs = reqs[np.argsort(offset[reqs], kind="stable")]
            lens_b = length[reqs]
            L = int(lens_b.max())
            name = f"attn{len(groups)}"
            off = offset[reqs]
            if np.all(lens_b == L) and np.all(off == off[0] + L * np.arange(len(reqs))):
                groups.append(AttnSpec(n=len(reqs), L=L, start=int(off[0]), name=name))
                continue
            pos = np.arange(L)[None, :]
            keys = pos < lens_b[:, None]
            # padding points at the request's own first row: a masked key is still multiplied
            # in (by 0), so another request's non-finite row would turn this one's to NaN
            rows = np.where(keys, off[:, None] + pos, off[:, None])
            valid = np.flatnonzero(keys.reshape(-1))
            pk.add(name + ".rows", rows)
            pk.add(name + ".valid", valid)
            pk.add(name + ".dest", rows.reshape(-1)[valid])
            masked = not bool(keys.all())
            if masked:
                pk.add(name + ".lens", lens_b)
            groups.append(AttnSpec(n=len(reqs), L=L, gather=True, masked=masked, name=name,
                                   host_rows=rows))
    return groups


def _varlen(layout: Layout, T: int, pk: Packer) -> int:
    """The same attention as the groups of :func:`attention_groups`, as boundaries of sequences
    that tile rows ``[0, T)`` (packed as "varlen.cu"): every request's real rows are one
    sequence, and each run of padding rows (or rows of no request) is a sequence of its own, so
    no real key is ever shared across requests and no padding key is seen by a real query. Lets
    a device that has a variable-length attention kernel run one call per layer however many
    length buckets the batch has (``itif.ops.cuda.attention``). Returns the longest sequence."""
    start = layout.offset.astype(np.int64)
    cuts = np.unique(np.concatenate([[0, T], start, start + layout.length,
                                     start + layout.padded_len]))
    pk.add("varlen.cu", cuts)
    return int(np.diff(cuts).max())


def _head_plan(table: np.ndarray, tsorted: np.ndarray, a: int, b: int, device,
               dtype) -> GemmPlan:
    """GEMM plan of a head parameter (slot ``table`` per batch tenant) over CLS rows [a, b)
    whose tenants are ``tsorted[a:b]``."""
    sub = tsorted[a:b]
    return plan_gemm(segments_for(tenant_runs(sub), table), b - a, device, dtype)


def prepare(
    spec: BackboneSpec,
    layout: Layout,
    tenants: tuple[str, ...],
    view: StoreView,
    tables: SlotTables,
    device: torch.device,
    dtype: torch.dtype,
    ids: np.ndarray | None = None,
    types: np.ndarray | None = None,
    pixels: np.ndarray | torch.Tensor | None = None,
    want_pooled: bool = True,
    want_logits: bool = True,
    want_hidden: bool = False,
    cache: "StructureCache | None" = None,
) -> PreparedBatch:
    """Host buffers and structure of one forward. With ``cache``, a batch whose structure was
    seen before reuses it and only repacks its inputs.

    ids/types: concatenation of every request's tokens in request order ([sum(length)] int64);
    pixels: [n, C, H, W] float32 (vit); the engine passes its pinned buffer, used in place.
    """
    T = layout.total_rows
    n = layout.num_requests
    # ITIF_TRITON_GEMM=1: tile tables (see there); the largest tile is part of the structure
    tile_cap = triton_gemm.max_block_rows() if triton_gemm.enabled(device, dtype) else 0
    key = (view.version, tenants, layout.tenant.tobytes(), layout.length.tobytes(),
           layout.offset.tobytes(), layout.padded_len.tobytes(), layout.mb_len.tobytes(),
           want_pooled, want_logits, want_hidden, tile_cap)
    if cache is not None:
        skel = cache.get(key)
        if skel is not None:  # same structure: only the inputs change
            return skel.with_inputs(ids, types, pixels, device)
    order = layout.row_order  # requests in row order
    pk = Packer()
    row_tenant = np.repeat(layout.tenant[order], layout.padded_len[order]).astype(np.int64)
    row_req_start = np.repeat(layout.offset[order], layout.padded_len[order])
    pk.add("row_tenant", row_tenant)
    pk.add("positions", np.arange(T, dtype=np.int64) - row_req_start)
    floats = None
    tok_row = None
    if spec.is_text:
        # Row of every real token, in request order: the request's offset plus 0..length-1.
        first = np.concatenate([[0], np.cumsum(layout.length)[:-1]])
        tok_row = (np.repeat(layout.offset - first, layout.length)
                   + np.arange(int(layout.length.sum())))
        ids_np = np.full(T, spec.pad_token_id, np.int64)
        ids_np[tok_row] = ids
        types_np = np.zeros(T, np.int64)
        if types is not None:
            types_np[tok_row] = types
        pk.add("ids", ids_np)
        pk.add("types", types_np)
    else:
        # Raw pixels travel as they are; the forward cuts them into patches on the device.
        floats = _pixels_host(pixels, device)
        g = spec.image_size // spec.patch_size
        pk.add("patch_rows", (layout.offset[:, None] + 1 + np.arange(g * g)[None, :]).reshape(-1))
        pk.add("cls_token_rows", layout.offset)

    params = Params(view, tenants, tenant_runs(row_tenant), tables.backbone, T, device, dtype)
    pk.add("tables", params.table_matrix)
    tile_rows = {}
    for k, plan in enumerate(params.plans):
        if plan.backend == "grouped_mm":
            pk.add(f"offs{k}", plan.offs)
        if tile_cap:
            tile_rows[k] = triton_gemm.block_rows(plan.max_rows, tile_cap)
            pk.add(f"tiles{k}", triton_gemm.tile_table(plan.segs, tile_rows[k]))
    attn = attention_groups(layout, pk)
    varlen_L = _varlen(layout, T, pk) if len(attn) > 1 else 0
    lora = plan_lora(tables.lora, row_tenant, pk, device, dtype) if tables.lora else {}

    # ---- heads ------------------------------------------------------------------------------
    # CLS rows in (pooler first, tenant) order: the pooler's slots then follow the tenants'
    # order, as the encoder's do. The classifiers need the rows grouped by head kind (label
    # count) instead: one gather by ``head_perm`` reorders them when the two orders differ.
    req_tenant = layout.tenant.astype(np.int64)
    cls_order = np.lexsort((req_tenant, ~tables.has_pooler[req_tenant]))
    tsorted = req_tenant[cls_order]
    pk.add("cls_rows", layout.offset[cls_order])
    pooler_rows = int(tables.has_pooler[tsorted].sum())
    pooler_plans = None
    # ViT's classifier reads the [CLS] row, not the pooler: its pooler serves ``pooled`` only
    if pooler_rows and (want_pooled or (want_logits and spec.is_text)):
        pw = _head_plan(tables.head["pooler.weight"], tsorted, 0, pooler_rows, device, dtype)
        pb = _head_plan(tables.head["pooler.bias"], tsorted, 0, pooler_rows, device, dtype)
        pooler_plans = (pw, pb)
        _pack_head(pk, "pool", tsorted[:pooler_rows], tables.head["pooler.bias"], pw)
    head_perm = np.lexsort((tsorted, tables.head_kind[tsorted]))
    permuted = bool(np.any(head_perm != np.arange(n)))
    if permuted and want_logits:
        pk.add("head_perm", head_perm)
    group_of = tables.head_kind
    tsorted = tsorted[head_perm]
    heads: list[HeadGroup] = []
    max_labels = 1
    if want_logits:
        cut = np.flatnonzero(np.diff(group_of[tsorted])) + 1
        for a, b in zip(np.concatenate([[0], cut]), np.concatenate([cut, [n]])):
            a, b = int(a), int(b)
            t0 = int(tsorted[a])
            labels = int(tables.labels[t0])
            if not labels:
                continue
            wp = _head_plan(tables.head["head.weight"], tsorted, a, b, device, dtype)
            bp = _head_plan(tables.head["head.bias"], tsorted, a, b, device, dtype)
            kind = tables.head_kinds[int(tables.head_kind[t0])]
            name = f"head{len(heads)}"
            _pack_head(pk, name, tsorted[a:b], tables.head["head.bias"], wp)
            heads.append(HeadGroup(a, b, labels, kind, ("head.bias", (labels,)), wp, bp, name))
            max_labels = max(max_labels, labels)

    host = pk.host(pin=device.type == "cuda")
    batch = PreparedBatch(
        spec=spec, layout=layout, tenants=tenants, rows=T, n=n, packer=pk, host_ints=host,
        host_floats=floats, params=params, attn=attn, cls_order=cls_order,
        head_order=cls_order[head_perm], head_permuted=permuted,
        pooler_rows=pooler_rows if pooler_plans is not None else 0, pooler_plans=pooler_plans,
        heads=heads, want_pooled=want_pooled, want_logits=want_logits, want_hidden=want_hidden,
        max_labels=max_labels, labels=tables.labels, key=key, tok_row=tok_row, lora=lora,
        varlen_L=varlen_L, tile_rows=tile_rows,
    )
    if cache is not None:
        cache.put(key, batch)
    return batch


def _pack_head(pk: Packer, name: str, tsub: np.ndarray, bias_table: np.ndarray,
               w_plan: GemmPlan) -> None:
    """Per-row slots of a head's bias (for plans that cannot broadcast) and grouped offsets."""
    if w_plan.backend == "grouped_mm":
        pk.add(name + ".offs", w_plan.offs)
    pk.add(name + ".bias_slots", bias_table[tsub])


def _pixels_host(pixels: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The pixels as one flat float32 host tensor, pinned for a CUDA upload: the engine's own
    validated buffer as it is, anything else copied once."""
    if (isinstance(pixels, torch.Tensor) and pixels.dtype == torch.float32
            and pixels.device.type == "cpu" and pixels.is_contiguous()
            and (device.type != "cuda" or pixels.is_pinned())):
        return pixels.view(-1)
    flat = np.asarray(pixels, np.float32).reshape(-1)
    floats = torch.empty(flat.size, dtype=torch.float32, pin_memory=device.type == "cuda")
    floats.numpy()[:] = flat
    return floats


class StructureCache:
    """Recently prepared batch structures by key (LRU): a batch that repeats a structure (the
    same tenants, layout and outputs on the same store version) skips planning its GEMMs,
    attention and heads again. Thread-safe."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: OrderedDict[tuple, PreparedBatch] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> PreparedBatch | None:
        with self._lock:
            b = self._items.get(key)
            if b is not None:
                self._items.move_to_end(key)
            return b

    def put(self, key: tuple, batch: PreparedBatch) -> None:
        with self._lock:
            if self._items and next(iter(self._items))[0] != key[0]:
                # a new store version: structures of older versions can never be hit again
                for k in [k for k in self._items if k[0] != key[0]]:
                    del self._items[k]
            self._items[key] = batch
            while len(self._items) > self.size:
                self._items.popitem(last=False)
