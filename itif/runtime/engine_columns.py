"""``Engine.infer_columns``: a batch of token-id rows as columns in, flat outputs out.

The columnar host path (``itif.hostpath``) hands the engine a taken batch as a tenant index a
row, flat token ids and offsets; building a ``Request`` a row to call ``Engine.infer`` would put
back the per-request Python the path exists to remove. This entry point runs the same steps as
``infer`` (the batch's tenants in the store's slot order, the same checks with the same errors
and messages, ``plan``, one forward, the same slicing of the flat output) with numpy over the
batch instead of a loop over requests, so its outputs equal ``infer``'s bit for bit.

What stays per row: nothing in this module. Per tenant of the batch: the tenant's name lookup,
its head and tag (``Engine.batch_tenants``, ``slot_tables``). ``plan`` (``packed`` and the
padded strategies) and ``prepare`` are already vectorised; the DP planners' own loops are
theirs, as under ``infer``. Text backbones only: a ViT request is an image, which a front end
would send as pixels, not ids (``infer`` serves them).

Lives beside ``engine.py`` as a mixin of ``Engine`` because of the 600-line limit; it uses the
engine's own ``batch_tenants`` / ``_run`` / ``plan`` so that nothing is done two ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from itif.errors import InvalidRequest, TenantNotFound
from itif.requests import OUTPUTS, check_token_rows

__all__ = ["ColumnOutputs", "ColumnsMixin"]


@dataclass
class ColumnOutputs:
    """Each row's output, flat: row ``i`` is ``values[offsets[i]:offsets[i+1]]`` (logits: the
    tenant's labels; pooled: hidden; last_hidden_state: length x hidden, row-major)."""

    values: np.ndarray  # float32
    offsets: np.ndarray  # int64 [n+1]
    logits: np.ndarray  # bool [n]: the row's output is logits (else pooled / hidden states)
    weights: dict[str, str] = field(default_factory=dict)  # tenant -> its weights' tag
    computed_rows: int = 0  # token rows the forward computed, padding included


@dataclass
class _ColumnInputs:
    """What ``Engine._run`` reads of a batch's inputs (``_Inputs`` without a list per row)."""

    tenant_idx: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray
    wants: list[tuple[str, ...]]
    types: None = None
    pixels: None = None


def _first_seen(names: Any, table: Sequence[str] | None) -> list[str]:
    """The batch's distinct tenant names in first-seen order (the order ``infer`` reports
    the first unknown one in)."""
    if table is None:
        return list(dict.fromkeys(names))
    uniq, first = np.unique(names, return_index=True)
    return [table[int(i)] for i in uniq[np.argsort(first)]]


def _table_rows(idx: np.ndarray, n: int, table: Sequence[str]) -> np.ndarray:
    """The distinct table indices of a batch (ascending): one ``bincount``, no sort."""
    if idx.ndim != 1 or idx.size != n or (n and idx.dtype.kind not in "iu"):
        raise InvalidRequest(f"tenant: with a table, tenant must be {n} indices (offsets "
                             "has n+1 entries)")
    try:
        counts = np.bincount(idx)
    except ValueError:  # a negative index
        counts = None
    if counts is None or counts.size > len(table):
        bad = idx[(idx < 0) | (idx >= len(table))][0]
        raise InvalidRequest(f"tenant: index {int(bad)} is outside the table of {len(table)}")
    return np.flatnonzero(counts)


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
        ``infer`` raises for the same requests, with the same messages.

        The batches it runs are small under a moderate load (about five rows at 1,000 req/s
        on a 2-core CPU), so it counts numpy calls as ``infer`` counts Python per request:
        a few a batch, with the exact checks (first-seen order of an unknown tenant) only on
        the way to an error."""
        offs = np.asarray(offsets)
        if offs.ndim != 1 or offs.size < 1 or (offs.dtype.kind not in "iu"):
            raise InvalidRequest("offsets must be a 1-D integer array of n+1 entries")
        n = offs.size - 1
        if table is None:
            names = list(dict.fromkeys(tenant))
            if len(tenant) != n:
                raise InvalidRequest(f"tenant has {len(tenant)} entries for {n} rows (offsets "
                                     "has n+1)")
        else:
            idx = np.asarray(tenant)
            uniq = _table_rows(idx, n, table)
            names = [table[i] for i in uniq.tolist()]
        if n == 0:
            return ColumnOutputs(np.zeros(0, np.float32), np.zeros(1, np.int64),
                                 np.zeros(0, bool))
        with self.store.read() as view:
            try:
                tenants = self.batch_tenants(view, names)
            except TenantNotFound:  # report the first unknown one in infer's order
                self.batch_tenants(view, _first_seen(tenant if table is None else idx, table))
                raise
            order = {t: i for i, t in enumerate(tenants)}
            if table is None:  # names: one dict lookup a row
                tenant_idx = np.fromiter((order[t] for t in tenant), np.int32, count=n)
            else:
                lut = np.empty(len(table), np.int32)
                lut[uniq] = [order[t] for t in names]
                tenant_idx = lut[idx]
            heads = [bool(view.tenants[t].num_labels) for t in tenants]
            logits = self._check_outputs(output, tenants, tenant_idx, heads)
            ids64, lengths = self._check_ids(ids, offs)
            if output is not None:
                wants = [(output,)]
            elif logits is True:
                wants = [("logits",)]
            elif logits is False:  # no tenant of the batch has a head
                wants = [("pooled",)]
            else:
                wants = [("logits",), ("pooled",)] if logits.any() else [("pooled",)]
            inputs = _ColumnInputs(tenant_idx, lengths, ids64, wants)
            layout = self.plan(tenant_idx, lengths, strategy)
            batch, flat = self._run(view, tenants, layout, inputs)
            tags = {t: view.tenants[t].tag for t in tenants}
        if logits is True or logits is False:
            logits = np.full(n, logits)
            values, out_offs = _slice(self.spec.hidden, batch, flat, layout, logits, output,
                                      every=True)
        else:
            values, out_offs = _slice(self.spec.hidden, batch, flat, layout, logits, output)
        return ColumnOutputs(values, out_offs, logits, tags, int(layout.total_rows))

    def _check_outputs(self, output: str | None, tenants: tuple[str, ...],
                       tenant_idx: np.ndarray, heads: list[bool]) -> np.ndarray | bool:
        """Whether each row's output is logits (True / False: every row's); ``infer``'s
        errors for a bad ``output``."""
        if output is None:
            if all(heads):
                return True
            return np.array(heads)[tenant_idx] if any(heads) else False
        if output not in OUTPUTS:
            raise InvalidRequest(f"request 0: unknown output {output!r}; choose from {OUTPUTS}")
        if output != "logits":
            return False
        if not all(heads):
            headless = ~np.array(heads)[tenant_idx]
            if headless.any():
                i = int(np.argmax(headless))
                raise InvalidRequest(f"request {i}: tenant {tenants[tenant_idx[i]]!r} has no "
                                     "classification head")
        return True

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
        lengths = offs[1:] - offs[:-1]
        if offs[0] != 0 or offs[-1] != a.size or (lengths.size and int(lengths.min()) < 0):
            raise InvalidRequest(f"offsets must start at 0, never decrease and end at the "
                                 f"{a.size} ids")
        ids64 = a.astype(np.int64)
        check_token_rows(lengths, ids64, self.max_seq_len, spec.vocab_size)
        return ids64, lengths.astype(np.int32)


def _slice(H: int, batch, flat: np.ndarray, layout, logits: np.ndarray, output: str | None,
           every: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each row's output out of the forward's flat buffer, as ``Engine._results`` slices it,
    in a fixed number of numpy calls: (values, offsets). ``every``: ``logits`` holds one value
    for every row."""
    n = logits.size
    n_logits, n_pooled, _ = batch.out_sizes
    if output == "last_hidden_state":
        hidden = flat[n_logits + n_pooled :].reshape(batch.rows, H)
        length = layout.length.astype(np.int64)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(length * H, out=offsets[1:])
        ends = np.cumsum(length)
        rows = np.arange(ends[-1]) + np.repeat(layout.offset - (ends - length), length)
        return hidden[rows].reshape(-1), offsets
    if every and not logits[0]:  # every row pooled
        pooled = flat[n_logits : n_logits + n_pooled].reshape(n, H)
        return pooled[np.argsort(batch.cls_order)].reshape(-1), np.arange(0, (n + 1) * H, H)
    L = batch.max_labels
    mat = flat[:n_logits].reshape(n, L)[np.argsort(batch.head_order)]
    width = batch.labels[layout.tenant]
    if every and int(width.min()) == L:  # every row logits, every tenant L labels
        return mat.reshape(-1), np.arange(0, (n + 1) * L, L)
    if not every:  # some rows' tenants have no head: their pooled output
        width[~logits] = H
        wide = np.zeros((n, max(L, H)), np.float32)
        wide[logits, :L] = mat[logits]
        pooled = flat[n_logits : n_logits + n_pooled].reshape(n, H)
        wide[~logits, :H] = pooled[np.argsort(batch.cls_order)[~logits]]
        mat = wide
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(width, out=offsets[1:])
    return mat[np.arange(mat.shape[1]) < width[:, None]], offsets
