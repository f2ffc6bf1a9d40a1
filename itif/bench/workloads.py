"""What ``itif bench`` measures: offline workloads (the thesis' Table 5.2, more tenants, request
batches) and the inputs and arrivals of the serving sweep.

Offline workloads are grouped by ``(model, tenants)``: every system is built once per group (the
expensive part: weights, Hugging Face models, processes) and then runs each workload of the group.
Inputs are random token ids (fixed length) or random images; timing does not depend on values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from itif.backbones.spec import BackboneSpec
from itif.calibration.plan_report import sample_lengths, sample_tenants
from itif.errors import InvalidRequest
from itif.runtime.engine import Request

__all__ = [
    "Workload", "SUITES", "offline_workloads", "tenant_names", "make_requests",
    "poisson_arrivals", "sample_lengths", "sample_tenants", "ServeMix", "parse_mix",
]

SUITES = ("table", "scale", "batch", "serve")

# The thesis' models (Table 5.2) and their tiny stand-ins for --quick.
FULL_MODELS = ("bert-base", "albert-large", "vit-base")
QUICK_MODELS = ("bert-tiny", "albert-tiny", "vit-tiny")
TABLE_TENANTS = (2, 3, 4, 5)  # Table 5.2
SCALE_TENANTS = (8, 16, 32, 64)  # beyond the thesis (it stopped at 5 for GPU memory)
TABLE_SEQ = 128  # Table 5.2: text at sequence 128, ViT at 224x224
BATCH_SEQ = 64  # Fig. 5.2-5.4: ALBERT, requests of sequence 64
BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Workload:
    """One offline measurement: ``tenants`` x ``requests_per_tenant`` requests, all answered by one
    call of each system. ``seq_len`` is the text length (ViT requests are images)."""

    suite: str
    model: str
    tenants: int
    requests_per_tenant: int
    seq_len: int | None

    @property
    def requests(self) -> int:
        return self.tenants * self.requests_per_tenant


def offline_workloads(suites, models, tenants=None, requests=None, quick=False,
                      gpu=False, seq_len: int | None = None) -> list[Workload]:
    """The offline workloads of ``suites`` (``table``, ``scale``, ``batch``).

    Defaults: the thesis' models and tenant counts; ``quick`` swaps in the tiny presets, 2-4
    tenants and small batches. On the CPU the full defaults are trimmed (``scale`` to 8 and 16
    tenants, ``batch`` to 2 and 4 tenants with up to 8 requests each): a CPU forward of many
    BERT-base tenants takes seconds. ``tenants`` / ``requests`` override the counts of every
    suite (tenant counts above 5 are labelled ``scale``).
    """
    out: list[Workload] = []
    if tenants:
        table_t, scale_t, batch_t = (), (), tuple(tenants)
    elif quick:
        table_t, scale_t, batch_t = (2, 3, 4), (), (2, 4)
    elif gpu:
        table_t, scale_t, batch_t = TABLE_TENANTS, SCALE_TENANTS, (2, 3, 4, 5, 8, 16, 32, 64)
    else:
        table_t, scale_t, batch_t = TABLE_TENANTS, (8, 16), (2, 4)
    if requests:
        batch_r = tuple(requests)
    elif quick:
        batch_r = (1, 8)
    elif gpu:
        batch_r = BATCH_REQUESTS
    else:
        batch_r = (1, 2, 4, 8)
    from itif.backbones.spec import load_spec  # noqa: PLC0415

    for model in models:
        spec = load_spec(model)
        text_len = min(seq_len or TABLE_SEQ, spec.max_position) if spec.is_text else None
        if tenants and ("table" in suites or "scale" in suites):
            # explicit counts: every one of them, labelled by the suite it falls in
            out += [Workload("table" if t <= 5 else "scale", model, t, 1, text_len)
                    for t in tenants]
        else:
            if "table" in suites:
                out += [Workload("table", model, t, 1, text_len) for t in table_t]
            if "scale" in suites:
                out += [Workload("scale", model, t, 1, text_len) for t in scale_t]
        if "batch" in suites:
            # Fig. 5.2-5.4 use ALBERT; with explicit --models every model gets the sweep.
            if models_default_batch(models, model):
                blen = min(seq_len or BATCH_SEQ, spec.max_position) if spec.is_text else None
                out += [Workload("batch", model, t, r, blen) for t in batch_t for r in batch_r]
    return out


def models_default_batch(models, model: str) -> bool:
    """The batch sweep runs ALBERT when the default model set is used, else every model."""
    defaults = set(FULL_MODELS) | set(QUICK_MODELS)
    if set(models) <= defaults and any(m.startswith("albert") for m in models):
        return model.startswith("albert")
    return True


def tenant_names(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


def make_requests(spec: BackboneSpec, w: Workload, seed: int = 0) -> list[Request]:
    """The workload's requests, tenant by tenant (``t0`` first), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    reqs = []
    for name in tenant_names(w.tenants):
        for _ in range(w.requests_per_tenant):
            if spec.is_text:
                ids = rng.integers(0, spec.vocab_size, w.seq_len).astype(np.int64)
                reqs.append(Request(name, input_ids=ids))
            else:
                px = rng.standard_normal((spec.num_channels, spec.image_size, spec.image_size))
                reqs.append(Request(name, pixel_values=px.astype(np.float32)))
    return reqs


def poisson_arrivals(rate: float, duration_s: float, max_requests: int,
                     rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds from 0) of a Poisson process of ``rate`` per second, cut at
    ``duration_s`` and at ``max_requests``; at least one arrival."""
    if rate <= 0 or duration_s <= 0 or max_requests < 1:
        raise InvalidRequest("poisson_arrivals needs rate > 0, duration > 0, max_requests >= 1")
    n = int(min(max_requests, max(1, np.ceil(rate * duration_s * 1.5 + 10))))
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    t = t[t <= duration_s]
    if t.size == 0:
        t = np.zeros(1)
    return t[:max_requests]


@dataclass(frozen=True)
class ServeMix:
    """A serving load: request lengths (``uniform:LO-HI`` / ``normal:MEAN:VAR``) and tenant
    popularity (None: uniform; ``zipf:A``)."""

    lengths: str
    skew: str | None = None

    @property
    def name(self) -> str:
        return self.lengths + (f"+{self.skew}" if self.skew else "")


DEFAULT_MIXES = (ServeMix("uniform:2-100"), ServeMix("normal:20:20"),
                 ServeMix("uniform:2-100", "zipf:1.2"))


def parse_mix(text: str) -> ServeMix:
    """``uniform:2-100``, ``normal:20:20`` or either with ``+zipf:A``."""
    lengths, _, skew = text.partition("+")
    if not re.fullmatch(r"uniform:\d+-\d+|normal:[\d.]+:[\d.]+", lengths):
        raise InvalidRequest(f"mix {text!r}: lengths must be uniform:LO-HI or normal:MEAN:VAR")
    if skew and not re.fullmatch(r"zipf:[\d.]+", skew):
        raise InvalidRequest(f"mix {text!r}: popularity must be zipf:A")
    return ServeMix(lengths, skew or None)
