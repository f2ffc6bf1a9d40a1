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
from itif.requests import Request, Result

_LAZY = {"Engine": "itif.runtime.engine", "TenantInfo": "itif.runtime.engine",
         "GenEngine": "itif.generation.engine", "GenerateRequest": "itif.generation.api"}


def __getattr__(name: str):
    """``itif.Engine`` and ``itif.TenantInfo`` (encoders), ``itif.GenEngine`` and
    ``itif.GenerateRequest`` (decoders) load their engine (and torch) on first use, so that
    ``import itif.scheduler`` or ``import itif.config`` stays light."""
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'itif' has no attribute {name!r}")

__all__ = [
    "PRESETS",
    "BackboneSpec",
    "Engine",
    "GenEngine",
    "GenerateRequest",
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
