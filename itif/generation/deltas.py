"""Full fine-tunes of a decoder stored as a base tenant plus a compressed delta (int8 or sign),
as the encoder engine stores them (``itif.weights.delta``: the formats, the blob, W_hat).

The same path as ``itif.runtime.engine.Engine.load_delta``: the fine-tune's canonical tensors
are compressed against the stored base tenant's (float32 copies of its slots), W_hat is
materialised and validated against the decoder's canonical table, and the error is measured,
not assumed: a fixed probe batch of prompts (``PROBE_LENGTHS``, capped by the backbone's
positions, ids from ``PROBE_SEED``) runs its prefill through the exact weights and through
W_hat on the engine's device and dtype, in a scratch store and KV pool (the engine's store and
its budget are untouched), and the report's ``max_abs_error`` is the largest difference of the
prompts' next-token logits. The tenant is then added as W_hat: a full tenant whose tensors
equal to the base's are shared by the weight store's dedup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from itif.backbones.hf import CanonicalWeights
from itif.errors import InvalidRequest, TenantNotFound, shown
from itif.generation.running import JoiningRequest, RunningBatch
from itif.generation.spec import DecoderSpec
from itif.weights import delta
from itif.weights.delta import PROBE_LENGTHS, PROBE_SEED, DeltaReport, DeltaWeights
from itif.weights.store import WeightStore

if TYPE_CHECKING:
    from itif.generation.engine import GenEngine


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]


class _Table:
    """The decoder's canonical table in the shape ``delta.decompress`` reads a backbone's
    (``params(num_labels, pooler=...)`` and a ``name``): a decoder has no head or pooler."""

    def __init__(self, spec: DecoderSpec) -> None:
        self.name = spec.name
        self._params = [_Param(n, s) for n, s in spec.params()]

    def params(self, num_labels=None, pooler: bool = False) -> list[_Param]:
        return self._params


def tensors_of(eng: "GenEngine", tenant: str) -> dict[str, torch.Tensor]:
    """A stored tenant's canonical tensors as float32 CPU copies (copies: W_hat is built from
    them, and the base's slots may be reused before W_hat is added)."""
    view = eng.store.view
    if tenant not in view.tenants:
        raise TenantNotFound(f"base tenant {shown(tenant)} not found")
    out = {}
    for name in view.tenants[tenant].slots:
        buf, slot = view.param(tenant, name)
        out[name] = buf[slot].detach().to("cpu", torch.float32, copy=True)
    return out


def probe_error(eng: "GenEngine", exact: CanonicalWeights, w_hat: CanonicalWeights) -> float:
    """Max |logits(exact) - logits(W_hat)| of the probe prompts' next tokens."""
    spec = eng.spec
    store = WeightStore(eng.device, eng.dtype)
    store.add("exact", exact)
    store.add("delta", w_hat)
    g = torch.Generator().manual_seed(PROBE_SEED)
    prompts = [torch.randint(0, spec.vocab_size, (max(1, min(n, spec.max_len - 1)),),
                             generator=g).tolist() for n in PROBE_LENGTHS]
    items = [JoiningRequest((t, i), t, p, 1, 1)
             for t in ("exact", "delta") for i, p in enumerate(prompts)]
    elem = torch.empty((), dtype=eng.dtype).element_size()
    blocks = sum(-(-len(a.prompt) // 16) + 1 for a in items)  # prompt + one new position each
    kv_bytes = blocks * 16 * spec.dec_layers * 2 * spec.kv_width * elem
    logits = RunningBatch(spec, store, kv_bytes, block=16).admit(items).float()
    n = len(prompts)
    return float((logits[:n] - logits[n:]).abs().max())


def load_delta(eng: "GenEngine", source, base: str, compress: str,
               base_sha256: str = "") -> tuple[DeltaWeights, DeltaReport]:
    """A full checkpoint compressed against stored tenant ``base`` (``compress``: "int8" or
    "sign"): W_hat with its blob, and the report (probe error, byte counts). Nothing is added."""
    if compress not in delta.METHODS:
        raise InvalidRequest(f"compress {compress!r} is not one of {delta.METHODS}")
    if base is None:
        raise InvalidRequest("compress needs base: the tenant the delta is taken against")
    exact = eng.load_weights(source)
    base_t = tensors_of(eng, base)
    blob, table = delta.compress(exact, base_t, compress)
    meta = delta.make_meta(exact, table, compress, base, base_sha256)
    w_hat = delta.decompress(_Table(eng.spec), base_t, blob, meta)
    error = probe_error(eng, exact, w_hat)
    meta["max_abs_error"], meta["error_output"] = repr(error), "logits"
    report = delta.report_of(blob, meta, error, "logits")
    return DeltaWeights(w_hat.tensors, None, False, blob=blob, meta=meta, report=report), report


def load_delta_blob(eng: "GenEngine", source, base: str,
                    base_sha256: str | None = None) -> DeltaWeights:
    """W_hat of a stored delta blob (``delta.to_bytes``) on stored tenant ``base``; with
    ``base_sha256``, InvalidWeights unless the delta was taken against that base."""
    blob, meta = delta.read_blob(source)
    if base_sha256 is not None:
        delta.check_base(meta, base, base_sha256)
    w_hat = delta.decompress(_Table(eng.spec), tensors_of(eng, base), blob, meta)
    return DeltaWeights(w_hat.tensors, None, False, blob=blob, meta=meta,
                        report=delta.report_of(blob, meta))


__all__ = ["load_delta", "load_delta_blob", "probe_error", "tensors_of"]
