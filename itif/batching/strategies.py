"""Batching strategies, selectable by name: each turns (tenant, length) arrays into a Layout.

Contract: ``plan(name, tenant, length, cost, layers) -> Layout`` where ``tenant`` [n] holds
batch-tenant indices and ``length`` [n] token counts; every request appears exactly once.
``cost`` is a ``CostModel`` of one encoder layer (needed by the DP strategies only) and
``layers`` scales its per-layer prediction to a whole forward.

| name | what |
| --- | --- |
| ``packed`` | no padding: each tenant's requests back to back, GEMMs over variable segments |
| ``itif_two_stage`` | thesis Alg. 1 + 2: per-tenant DP, then same-shape batches as GEMM groups |
| ``turbo_dp`` | TurboTransformers: one DP over all requests sorted by length, tenant-agnostic |
| ``pad_per_tenant`` | one mini-batch per tenant, padded to its longest request |
| ``pad_to_max`` | one mini-batch padded to the longest request (the naive baseline) |
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from itif.batching import dp
from itif.batching.layout import (
    SINGLE_GEMM,
    Layout,
    build_layout,
    layout_packed,
    layout_pad_per_tenant,
    layout_pad_to_max,
)
from itif.errors import InvalidRequest

Strategy = Callable[[np.ndarray, np.ndarray, object, int], Layout]


def _need(cost, name: str):
    if cost is None:
        raise InvalidRequest(f"strategy {name!r} needs a cost model (Engine.cost_model)")
    return cost


def _two_stage(tenant: np.ndarray, length: np.ndarray, cost, layers: int) -> Layout:
    cost = _need(cost, "itif_two_stage")
    mbs = dp.stage1(tenant, length, cost)
    groups = dp.stage2(mbs, cost)
    members = np.split(mbs.order, mbs.mb_start[1:])
    order = groups.members  # mini-batches in GEMM-group order
    ops = groups.op.astype(np.int8)  # dp's ops are GemmOp values
    return build_layout(
        "itif_two_stage", tenant, length, [members[k] for k in order], mbs.mb_len[order],
        groups.mb_group[order], ops, predicted_ms=groups.total_cost * layers,
    )


def _turbo(tenant: np.ndarray, length: np.ndarray, cost, layers: int) -> Layout:
    cost = _need(cost, "turbo_dp")
    mbs = dp.turbo_dp(length, cost)
    members = np.split(mbs.order, mbs.mb_start[1:])
    m = len(members)
    return build_layout(
        "turbo_dp", tenant, length, members, mbs.mb_len, np.arange(m, dtype=np.int32),
        np.full(m, SINGLE_GEMM, np.int8), predicted_ms=mbs.total_cost * layers,
    )


def _predicted(layout: Layout, cost, layers: int) -> Layout:
    """Attach the cost model's prediction to a layout planned without it."""
    if cost is None:
        return layout
    dense = layout.mb_len > 0
    ms = (
        float(cost.single_v(layout.mb_len[dense], layout.mb_size[dense]).sum())
        if dense.any()
        else 0.0
    )
    packed = ~dense
    if packed.any():
        # A packed mini-batch is one tenant's requests back to back: its GEMMs see all its
        # tokens, its attention runs per request. Cost it as its requests at their mean length.
        tokens = np.bincount(layout.minibatch, weights=layout.length, minlength=len(dense))[packed]
        n = layout.mb_size[packed]
        ms += float(cost.single_v(np.maximum(np.rint(tokens / n), 1), n).sum())
    return replace(layout, predicted_ms=ms * layers)


STRATEGIES: dict[str, Strategy] = {
    "packed": lambda t, n, cost, layers: _predicted(layout_packed(t, n), cost, layers),
    "itif_two_stage": _two_stage,
    "turbo_dp": _turbo,
    "pad_per_tenant": lambda t, n, cost, layers: _predicted(
        layout_pad_per_tenant(t, n), cost, layers
    ),
    "pad_to_max": lambda t, n, cost, layers: _predicted(layout_pad_to_max(t, n), cost, layers),
}
# Chosen by measurement on the CPU (docs/performance.md, `itif plan`): packed never computes a
# padding row and its attention buckets keep padding inside attention under 25%.
DEFAULT_STRATEGY = "packed"


def plan(name: str, tenant: np.ndarray, length: np.ndarray, cost=None, layers: int = 1) -> Layout:
    try:
        strategy = STRATEGIES[name]
    except KeyError:
        raise InvalidRequest(
            f"unknown batching strategy {name!r}; choose from {sorted(STRATEGIES)}"
        ) from None
    return strategy(np.asarray(tenant, np.int32), np.asarray(length, np.int32), cost, layers)
