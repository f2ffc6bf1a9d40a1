"""itif: one fused transformer instance serving many fine-tuned tenants of a shared backbone."""

from itif.backbones.spec import PRESETS, BackboneSpec, load_spec
from itif.errors import (
    InvalidConfig,
    InvalidRequest,
    InvalidWeights,
    ItifError,
    NoWeights,
    Overloaded,
    TenantNotFound,
)
from itif.runtime.engine import Engine, Request, Result, TenantInfo

__all__ = [
    "PRESETS",
    "BackboneSpec",
    "Engine",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidWeights",
    "ItifError",
    "NoWeights",
    "Overloaded",
    "Request",
    "Result",
    "TenantInfo",
    "TenantNotFound",
    "load_spec",
]
__version__ = "0.1.0"
