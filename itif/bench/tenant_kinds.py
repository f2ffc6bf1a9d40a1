"""The tenants of ``itif bench --suites tenants``: its settings, its tenant kinds (how each is
built, added and checked against PEFT / Hugging Face) and small helpers.

``itif.bench.tenant_scale`` (tenants added and served per kind) and ``itif.bench.tenant_cold``
(cold first responses, run by the scale suite's ``daemon`` kind) both build on these; they lived
in ``tenant_scale``, which made the two modules import each other. ``tenant_scale`` still
re-exports them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from itif.backbones.spec import BackboneSpec
from itif.bench.tenants import tenant_weights

__all__ = ["COLD_SOURCES", "KINDS", "LORA_TARGETS", "SKEWS", "SUITE_KINDS", "Kind",
           "ScaleSettings", "log", "lora_adapter", "pct", "rss_bytes", "tenant_name"]

log = logging.getLogger("itif.bench")

KINDS = ("head", "lora", "full")
SUITE_KINDS = KINDS + ("daemon",)  # daemon: LoRA tenants uploaded through a Daemon
LORA_TARGETS = ("query", "value")
SKEWS = (None, "zipf:1.2")
COLD_SOURCES = ("disk", "host", "device")  # where a cold row's first responses come from
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class ScaleSettings:
    model: str = "bert-tiny"
    counts: tuple[int, ...] = (100, 1000, 10000)
    kinds: tuple[str, ...] = SUITE_KINDS
    full_max: int = 1000  # full tenants beyond this are not registered (host memory)
    lora_rank: int = 8
    requests: int = 2000  # per serving point
    skews: tuple[str | None, ...] = SKEWS
    lengths: str = "uniform:2-64"
    sample: int = 8
    load_fraction: float = 0.5
    max_wait_ms: float = 2.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    cold_tenants: int = 1000  # LoRA tenants registered for the cold measurement (0: none)
    cold_full: int = 64  # full fine-tunes registered for it, in their own daemon (0: none)
    cold_device: int = 16  # the device tier holds this many of them (LoRA: beside the base)
    cold_host: int = 32  # the host tier this many
    cold_samples: int = 30  # first responses per source tier (disk, host, resident)
    cold_length: int = 16  # tokens per request


# ---- memory -------------------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc/self/statm``; elsewhere the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- tenants ------------------------------------------------------------------------------
def lora_adapter(spec: BackboneSpec, index: int, rank: int = 8,
                 targets: tuple[str, ...] = LORA_TARGETS) -> tuple[dict, dict[str, torch.Tensor]]:
    """Tenant ``index``'s PEFT LoRA adapter (deterministic, non-zero A and B) as
    ``(adapter_config, tensors)`` with PEFT's saved names, as ``Engine.add_tenant(..., base=)``
    and ``peft.set_peft_model_state_dict`` take them. lora_alpha = 2 r (scale 2)."""
    if spec.family != "bert":
        raise ValueError(f"LoRA tenants of the scale suite take a bert backbone, not {spec.family}")
    gen = torch.Generator().manual_seed(50_000 + index)
    H = spec.hidden
    tensors = {}
    for layer in range(spec.layers):
        for t in targets:
            mod = f"{_PEFT_PREFIX}bert.encoder.layer.{layer}.attention.self.{t}"
            tensors[f"{mod}.lora_A.weight"] = torch.randn(rank, H, generator=gen) * 0.1
            tensors[f"{mod}.lora_B.weight"] = torch.randn(H, rank, generator=gen) * 0.1
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                  bias="none", use_rslora=False, use_dora=False, fan_in_fan_out=False)
    return config, tensors


def tenant_name(kind: str, i: int) -> str:
    return f"{kind}{i}"


class Kind:
    """How tenants of one kind are built, added and checked against their reference."""

    def __init__(self, kind: str, spec: BackboneSpec, rank: int = 8, base: str = "base",
                 base_mode: str = "full") -> None:
        """``base``/``base_mode`` (LoRA): the base tenant's name and its weights,
        ``tenant_weights(spec, 0, base_mode)`` (``head``: the head-only tenants' ``head0``)."""
        if kind not in KINDS:
            raise ValueError(f"tenant kind {kind!r} is not one of {KINDS}")
        self.kind, self.spec, self.rank = kind, spec, rank
        self.base, self.base_mode = base, base_mode

    def prepare(self, engine) -> None:
        """What the kind needs before its first tenant (LoRA: its base tenant, unless stored)."""
        if self.kind == "lora" and self.base not in engine.store:
            engine.add_tenant(self.base, tenant_weights(self.spec, 0, self.base_mode))

    def source(self, i: int):
        """(source, base) for ``engine.add_tenant(name, source, base=base)``."""
        if self.kind == "lora":
            return lora_adapter(self.spec, i, self.rank), self.base
        return tenant_weights(self.spec, i, "head" if self.kind == "head" else "full"), None

    def add(self, engine, i: int) -> float:
        """Add tenant ``i``; seconds the ``add_tenant`` call took (the weights built before)."""
        src, base = self.source(i)
        t0 = time.perf_counter()
        engine.add_tenant(tenant_name(self.kind, i), src, base=base)
        return time.perf_counter() - t0

    def reference(self):
        """A callable ``(i, input_ids [1, L]) -> logits [labels]``: Hugging Face float32 with
        tenant ``i``'s weights (head/full), PEFT on the base model (lora)."""
        from itif.bench.tenants import hf_model, load_hf_weights  # noqa: PLC0415

        cpu = torch.device("cpu")
        spec = self.spec
        if self.kind == "lora":
            import peft  # noqa: PLC0415

            model = hf_model(spec, tenant_weights(spec, 0, self.base_mode), cpu, torch.float32)
            cfg = peft.LoraConfig(r=self.rank, lora_alpha=2 * self.rank,
                                  target_modules=list(LORA_TARGETS), init_lora_weights=False)
            model = peft.get_peft_model(model, cfg).eval()

            def ref(i, ids):
                _, tensors = lora_adapter(spec, i, self.rank)
                res = peft.set_peft_model_state_dict(model, tensors)
                if getattr(res, "unexpected_keys", None):
                    raise RuntimeError(f"PEFT does not take the adapter: {res.unexpected_keys[:3]}")
                with torch.no_grad():
                    return model(input_ids=ids).logits[0].numpy()
            return ref
        mode = "head" if self.kind == "head" else "full"
        model = hf_model(spec, tenant_weights(spec, 0, mode), cpu, torch.float32)

        def ref(i, ids):
            load_hf_weights(model, spec, tenant_weights(spec, i, mode))
            with torch.no_grad():
                return model(input_ids=ids).logits[0].numpy()
        return ref


def pct(x, q):
    """The ``q``-th percentile of ``x`` rounded to 3 decimals; None for no values."""
    return round(float(np.percentile(x, q)), 3) if len(x) else None
