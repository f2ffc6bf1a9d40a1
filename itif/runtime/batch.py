"""PreparedBatch: the index tensors one fused forward reads, derived from a Layout.

Everything per request is computed here with numpy in bulk (no per-token Python), moved to the
device once, and then read by every layer: the row -> tenant map, token ids / positions / token
types of every row, attention groups, the CLS rows, and the parameter resolver that turns a
canonical parameter name into a rotated parameter (per-row slots) or GEMM segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from itif.backbones.spec import BackboneSpec
from itif.batching.layout import Layout
from itif.ops.reference import AttnGroup, RotParam
from itif.runtime.gemm import Segments, segments_for, tenant_runs
from itif.weights.store import StoreView


class Params:
    """Resolves canonical parameter names for one batch against one store snapshot.

    ``table(name)`` is the slot of each batch tenant; rotated params and GEMM segments are
    memoised per distinct slot table, so tenants sharing a layer share the index work too.
    """

    def __init__(self, view: StoreView, tenants: tuple[str, ...], row_tenant: torch.Tensor,
                 runs, tables: dict[str, np.ndarray]) -> None:
        self.view = view
        self.tenants = tenants
        self.row_tenant = row_tenant
        self.runs = runs
        self.tables = tables
        entry = view.tenants[tenants[0]]
        self._kind = {name: kind for name, (kind, _) in entry.slots.items()}
        self._row_slot: dict[bytes, torch.Tensor] = {}
        self._segs: dict[bytes, Segments] = {}

    def buffer(self, name: str) -> torch.Tensor:
        return self.view.buffers[self._kind[name]]

    def rot(self, name: str) -> RotParam:
        table = self.tables[name]
        key = table.tobytes()
        slot = self._row_slot.get(key)
        if slot is None:
            t = torch.from_numpy(table).to(self.row_tenant.device)
            slot = self._row_slot[key] = t[self.row_tenant]
        return RotParam(self.buffer(name), slot, self._segments(table, key))

    def segments(self, name: str) -> tuple[torch.Tensor, Segments]:
        table = self.tables[name]
        return self.buffer(name), self._segments(table, table.tobytes())

    def _segments(self, table: np.ndarray, key: bytes) -> Segments:
        segs = self._segs.get(key)
        if segs is None:
            segs = self._segs[key] = segments_for(self.runs, table)
        return segs


def slot_tables(spec: BackboneSpec, view: StoreView, tenants: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Slot of each batch tenant for every shared (non-head) canonical parameter."""
    entries = [view.tenants[t].slots for t in tenants]
    return {
        p.name: np.fromiter((e[p.name][1] for e in entries), np.int64, count=len(entries))
        for p in spec.params(pooler=False)
    }


@dataclass
class PreparedBatch:
    layout: Layout
    tenants: tuple[str, ...]  # batch-tenant index -> tenant id
    row_tenant: torch.Tensor  # [T] int64
    ids: torch.Tensor | None  # [T] int64 (text)
    positions: torch.Tensor  # [T] int64, restarting per request
    types: torch.Tensor | None  # [T] int64 (text)
    patches: torch.Tensor | None  # [T, C*p*p] (vit): zeros on CLS and padding rows
    attn: list[AttnGroup]
    cls_order: np.ndarray  # request indices sorted by tenant
    cls_rows: torch.Tensor  # [n] int64 rows of the CLS tokens, in cls_order
    cls_runs: tuple  # tenant runs over cls_order
    params: Params


def _attention_groups(layout: Layout, device: torch.device) -> list[AttnGroup]:
    """Dense mini-batches become view groups (neighbours of equal padded length merge into one
    call); packed requests are bucketed by length (each bucket padded to < 1.25x its shortest
    request) and gathered, so no mask ever spans requests."""
    groups: list[AttnGroup] = []
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
        mask = None
        if lens.min() < L:
            keys = np.arange(L)[None, :] < lens[:, None]
            mask = torch.from_numpy(keys).to(device).view(n, 1, 1, L)
        groups.append(AttnGroup(n=n, L=L, start=start, key_mask=mask))
        i = j
    packed = np.flatnonzero(layout.mb_len[layout.minibatch] == 0)
    if packed.size:
        lens = length[packed]
        bucket = np.floor(np.log(lens) / np.log(1.25)).astype(np.int64)
        for b in np.unique(bucket):
            reqs = packed[bucket == b]
            lens_b = length[reqs]
            L = int(lens_b.max())
            pos = np.arange(L)[None, :]
            keys = pos < lens_b[:, None]
            rows = np.where(keys, offset[reqs][:, None] + pos, 0)
            valid = np.flatnonzero(keys.reshape(-1))
            t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
            groups.append(AttnGroup(
                n=len(reqs), L=L, rows=t(rows), valid=t(valid), dest=t(rows.reshape(-1)[valid]),
                key_mask=None if keys.all() else t(keys).view(len(reqs), 1, 1, L),
            ))
    return groups


def prepare(
    spec: BackboneSpec,
    layout: Layout,
    tenants: tuple[str, ...],
    view: StoreView,
    tables: dict[str, np.ndarray],
    device: torch.device,
    dtype: torch.dtype,
    ids: np.ndarray | None = None,
    types: np.ndarray | None = None,
    pixels: np.ndarray | None = None,
) -> PreparedBatch:
    """Index tensors for one forward.

    ids/types: concatenation of every request's tokens in request order ([sum(length)] int64);
    pixels: [n, C, H, W] float32 (vit).
    """
    T = layout.total_rows
    order = layout.row_order  # requests in row order
    row_tenant_np = np.repeat(layout.tenant[order], layout.padded_len[order]).astype(np.int64)
    row_req_start = np.repeat(layout.offset[order], layout.padded_len[order])
    positions_np = np.arange(T, dtype=np.int64) - row_req_start
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731

    ids_t = types_t = patches = None
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
        ids_t, types_t = to(ids_np), to(types_np)
    else:
        n, C, P = pixels.shape[0], spec.num_channels, spec.patch_size
        g = spec.image_size // P
        flat = (pixels.reshape(n, C, g, P, g, P).transpose(0, 2, 4, 1, 3, 5)
                .reshape(n * g * g, C * P * P))
        patch_rows = (layout.offset[:, None] + 1 + np.arange(g * g)[None, :]).reshape(-1)
        patches = torch.zeros(T, C * P * P, dtype=dtype, device=device)
        patches[to(patch_rows)] = to(flat).to(dtype)

    cls_order = np.argsort(layout.tenant, kind="stable")
    row_tenant = to(row_tenant_np)
    runs = tenant_runs(row_tenant_np)
    return PreparedBatch(
        layout=layout, tenants=tenants, row_tenant=row_tenant, ids=ids_t, positions=to(positions_np),
        types=types_t, patches=patches, attn=_attention_groups(layout, device),
        cls_order=cls_order, cls_rows=to(layout.offset[cls_order]),
        cls_runs=tenant_runs(layout.tenant[cls_order].astype(np.int64)),
        params=Params(view, tenants, row_tenant, runs, tables),
    )
