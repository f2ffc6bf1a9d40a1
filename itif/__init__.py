"""itif: one fused transformer instance serving many fine-tuned tenants of a shared backbone."""

from itif.errors import (
    InvalidConfig,
    InvalidRequest,
    InvalidWeights,
    ItifError,
    NoWeights,
    Overloaded,
    TenantNotFound,
)

__all__ = [
    "InvalidConfig",
    "InvalidRequest",
    "InvalidWeights",
    "ItifError",
    "NoWeights",
    "Overloaded",
    "TenantNotFound",
]
__version__ = "0.1.0"
