"""Batching strategies, selectable by name: each turns (tenant, length) arrays into a Layout.

The contract: ``plan(name, tenant, length, cost_model) -> Layout`` where ``tenant`` [n] holds
batch-tenant indices and ``length`` [n] token counts; every request appears exactly once.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from itif.batching.layout import Layout, layout_packed, layout_pad_per_tenant, layout_pad_to_max
from itif.errors import InvalidRequest

Strategy = Callable[[np.ndarray, np.ndarray, object], Layout]

STRATEGIES: dict[str, Strategy] = {
    "packed": lambda t, n, cost: layout_packed(t, n),
    "pad_per_tenant": lambda t, n, cost: layout_pad_per_tenant(t, n),
    "pad_to_max": lambda t, n, cost: layout_pad_to_max(t, n),
}
DEFAULT_STRATEGY = "packed"


def plan(name: str, tenant: np.ndarray, length: np.ndarray, cost=None) -> Layout:
    try:
        strategy = STRATEGIES[name]
    except KeyError:
        raise InvalidRequest(f"unknown batching strategy {name!r}; choose from {sorted(STRATEGIES)}") from None
    return strategy(np.asarray(tenant, np.int32), np.asarray(length, np.int32), cost)
