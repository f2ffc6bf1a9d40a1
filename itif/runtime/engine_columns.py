"""``Engine.infer_columns``: a batch of token-id rows as columns in, flat outputs out.

The columnar host path (``itif.hostpath``) hands the engine a taken batch as a tenant index a
row, flat token ids and offsets; building a ``Request`` a row to call ``Engine.infer`` would put
back the per-request Python the path exists to remove. This entry point runs the same steps as
``infer`` (the batch's tenants in the store's slot order, the same checks with the same errors
and messages, ``plan``, one forward, the same slicing of the flat output) with numpy over the
batch instead of a loop over requests, so its outputs equal ``infer``'s bit for bit.

What stays per row: nothing in this module. Per tenant of the batch: the tenant's name lookup,
its head and tag (``Engine._batch_tenants``, ``slot_tables``). ``plan`` (``packed`` and the
padded strategies) and ``prepare`` are already vectorised; the DP planners' own loops are
theirs, as under ``infer``. Text backbones only: a ViT request is an image, which a front end
would send as pixels, not ids (``infer`` serves them).

Lives beside ``engine.py`` as a mixin of ``Engine`` because of the 600-line limit; it uses the
engine's own ``_batch_tenants`` / ``_run`` / ``plan`` so that nothing is done two ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from itif.errors import InvalidRequest
from itif.requests import OUTPUTS

__all__ = ["ColumnOutputs", "ColumnsMixin"]


@dataclass
class ColumnOutputs:
    """Each row's output, flat: row ``i`` is ``values[offsets[i]:offsets[i+1]]`` (logits: the
    tenant's labels; pooled: hidden; last_hidden_state: length x hidden, row-major)."""

    values: np.ndarray  # float32
    offsets: np.ndarray  # int64 [n+1]
    logits: np.ndarray  # bool [n]: the row's output is logits (else pooled / hidden states)
    weights: dict[str, str] = field(default_factory=dict)  # tenant -> its weights' tag


@dataclass
class _ColumnInputs:
    """What ``Engine._run`` reads of a batch's inputs (``_Inputs`` without a list per row)."""

    tenant_idx: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray
    wants: list[tuple[str, ...]]
    types: None = None
    pixels: None = None


def _first_seen(names: Any, table: Sequence[str] | None) -> tuple[list[str], np.ndarray | None]:
    """The batch's distinct tenant names in first-seen order, and (with a table) the table
    index of each."""
    if table is None:
        return list(dict.fromkeys(names)), None
    idx = np.asarray(names)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise InvalidRequest("tenant: with a table, tenant must be a 1-D array of indices")
    uniq, first = np.unique(idx, return_index=True)
    uniq = uniq[np.argsort(first)]
    if uniq.size and (uniq[0] < 0 or uniq.max() >= len(table)):
        bad = uniq[(uniq < 0) | (uniq >= len(table))][0]
        raise InvalidRequest(f"tenant: index {int(bad)} is outside the table of {len(table)}")
    return [table[int(i)] for i in uniq], uniq


class ColumnsMixin:
    """``infer_columns``; mixed into ``itif.runtime.engine.Engine``."""

    def infer_columns(self, tenant: Any, ids: Any, offsets: Any, *,
                      table: Sequence[str] | None = None, output: str | None = None,
                      strategy: str | None = None) -> ColumnOutputs:
        """Run rows given as columns in one fused forward, as ``infer`` runs the equivalent
        ``Request(tenant, input_ids=ids[offsets[i]:offsets[i+1]], outputs=...)`` list.

        ``tenant``: a name a row, or (with ``table``, the tenant table) an index a row;
        ``ids``: integer token ids, flat; ``offsets``: int [n+1], starting at 0.
        ``output``: one of OUTPUTS for every row; None: each tenant's default (logits with a
        classification head, else pooled), as a Request without ``outputs``. Raises what
        ``infer`` raises for the same requests, with the same messages."""
        offs = np.asarray(offsets)
        if offs.ndim != 1 or offs.size < 1 or (offs.dtype.kind not in "iu"):
            raise InvalidRequest("offsets must be a 1-D integer array of n+1 entries")
        n = offs.size - 1
        names, index = _first_seen(tenant, table)
        if len(names) > n or (index is None and len(tenant) != n) or (
                index is not None and np.asarray(tenant).size != n):
            raise InvalidRequest(f"tenant has {np.asarray(tenant).size} entries for "
                                 f"{n} rows (offsets has n+1)")
        if n == 0:
            return ColumnOutputs(np.zeros(0, np.float32), np.zeros(1, np.int64),
                                 np.zeros(0, bool))
        with self.store.read() as view:
            tenants = self._batch_tenants(view, names)
            order = {t: i for i, t in enumerate(tenants)}
            pos = np.fromiter((order[t] for t in names), np.int32, count=len(names))
            if index is None:  # names: one dict lookup a row
                tenant_idx = np.fromiter((order[t] for t in tenant), np.int32, count=n)
            else:
                lut = np.zeros(len(table), np.int32)
                lut[index] = pos
                tenant_idx = lut[np.asarray(tenant)]
            heads = np.fromiter((bool(view.tenants[t].num_labels) for t in tenants), bool,
                                count=len(tenants))
            logits = self._check_outputs(output, tenants, tenant_idx, heads)
            ids64, lengths = self._check_ids(ids, offs)
            if output is None:
                wants = [("logits",)] if logits.all() else [("pooled",)] if not logits.any() \
                    else [("logits",), ("pooled",)]
            else:
                wants = [(output,)]
            inputs = _ColumnInputs(tenant_idx, lengths, ids64, wants)
            layout = self.plan(tenant_idx, lengths, strategy)
            batch, flat = self._run(view, tenants, layout, inputs)
            tags = {t: view.tenants[t].tag for t in tenants}
        values, out_offs = _slice(self.spec.hidden, batch, flat, layout, logits, output)
        return ColumnOutputs(values, out_offs, logits, tags)

    def _check_outputs(self, output: str | None, tenants: tuple[str, ...],
                       tenant_idx: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """Whether each row's output is logits; ``infer``'s errors for a bad ``output``."""
        if output is None:
            return heads[tenant_idx]
        if output not in OUTPUTS:
            raise InvalidRequest(f"request 0: unknown output {output!r}; choose from {OUTPUTS}")
        if output != "logits":
            return np.zeros(tenant_idx.size, bool)
        headless = ~heads[tenant_idx]
        if headless.any():
            i = int(np.argmax(headless))
            raise InvalidRequest(f"request {i}: tenant {tenants[tenant_idx[i]]!r} has no "
                                 "classification head")
        return np.ones(tenant_idx.size, bool)

    def _check_ids(self, ids: Any, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``infer``'s text checks on the columns: (ids as int64, lengths as int32)."""
        spec = self.spec
        if not spec.is_text:
            raise InvalidRequest(f"a {spec.family} backbone takes pixel_values: infer_columns "
                                 "runs token ids only (use infer)")
        a = np.asarray(ids)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise InvalidRequest(f"ids must be a 1-D array of integers, got shape {a.shape} "
                                 f"{a.dtype}")
        offs = offs.astype(np.int64, copy=False)
        if offs[0] != 0 or offs[-1] != a.size or (np.diff(offs) < 0).any():
            raise InvalidRequest(f"offsets must start at 0, never decrease and end at the "
                                 f"{a.size} ids")
        lengths = np.diff(offs).astype(np.int32)
        if lengths.min() < 1 or lengths.max() > self.max_seq_len:
            i = int(np.flatnonzero((lengths < 1) | (lengths > self.max_seq_len))[0])
            raise InvalidRequest(
                f"request {i}: input_ids length {int(lengths[i])} is outside "
                f"1..{self.max_seq_len} (the backbone's maximum sequence length)")
        ids64 = a.astype(np.int64)
        if ids64.min() < 0 or ids64.max() >= spec.vocab_size:
            pos = int(np.flatnonzero((ids64 < 0) | (ids64 >= spec.vocab_size))[0])
            i = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
            raise InvalidRequest(
                f"request {i}: input_ids holds token id {int(ids64[pos])}, which is outside "
                f"the vocabulary [0, {spec.vocab_size})")
        return ids64, lengths


def _slice(H: int, batch, flat: np.ndarray, layout, logits: np.ndarray,
           output: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's output out of the forward's flat buffer, as ``Engine._results`` slices it,
    in a fixed number of numpy calls: (values, offsets)."""
    n = logits.size
    n_logits, n_pooled, _ = batch.out_sizes
    offsets = np.zeros(n + 1, np.int64)
    if output == "last_hidden_state":
        hidden = flat[n_logits + n_pooled :].reshape(batch.rows, H)
        length = layout.length.astype(np.int64)
        np.cumsum(length * H, out=offsets[1:])
        ends = np.cumsum(length)
        rows = np.arange(ends[-1]) + np.repeat(layout.offset - (ends - length), length)
        return hidden[rows].reshape(-1), offsets
    width = np.full(n, H, np.int64)
    if logits.any():
        width[logits] = batch.labels[layout.tenant[logits]]
    np.cumsum(width, out=offsets[1:])
    if not logits.any():
        cls_pos = np.empty(n, np.int64)
        cls_pos[batch.cls_order] = np.arange(n)
        return flat[n_logits : n_logits + n_pooled].reshape(n, H)[cls_pos].reshape(-1), offsets
    head_pos = np.empty(n, np.int64)
    head_pos[batch.head_order] = np.arange(n)
    L = batch.max_labels
    mat = flat[:n_logits].reshape(n, L)[head_pos]
    if not logits.all():  # some rows' tenants have no head: their pooled output
        cls_pos = np.empty(n, np.int64)
        cls_pos[batch.cls_order] = np.arange(n)
        wide = np.zeros((n, max(L, H)), np.float32)
        wide[logits, :L] = mat[logits]
        wide[~logits, :H] = flat[n_logits : n_logits + n_pooled].reshape(n, H)[cls_pos[~logits]]
        mat = wide
    keep = np.arange(mat.shape[1]) < width[:, None]
    return mat[keep], offsets
