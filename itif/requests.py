"""What an inference request is and what it returns: plain data, no torch.

The scheduler, the daemon and the servers pass these around without loading the engine;
``itif.runtime.engine`` (and ``itif``) re-export them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["OUTPUTS", "Request", "Result"]

#: The outputs a request may ask for, in the order ``Result.as_dict`` lists them.
OUTPUTS = ("logits", "pooled", "last_hidden_state")


@dataclass
class Request:
    """One inference input of one tenant.

    Text backbones take ``input_ids`` (and optionally ``token_type_ids``), 1-D, at most the
    backbone's max positions; ViT takes ``pixel_values`` [C, H, W] float. ``outputs`` defaults to
    ``("logits",)`` for a tenant with a classification head and ``("pooled",)`` otherwise.
    """

    tenant: str
    input_ids: Sequence[int] | np.ndarray | None = None
    token_type_ids: Sequence[int] | np.ndarray | None = None
    pixel_values: np.ndarray | None = None
    outputs: Sequence[str] | None = None


@dataclass
class Result:
    """Outputs of one request (numpy float32); fields not asked for are None."""

    tenant: str
    logits: np.ndarray | None = None  # [num_labels]
    pooled: np.ndarray | None = None  # [hidden]
    last_hidden_state: np.ndarray | None = None  # [length, hidden]

    def as_dict(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in OUTPUTS if getattr(self, k) is not None}
