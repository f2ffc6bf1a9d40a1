"""The benchmark's tenants: random canonical weights, Hugging Face names for them, HF models.

Every system of a run reads the same weights: the engines take :func:`tenant_weights` directly,
the daemon gets them as Hugging Face-named safetensors (:func:`to_hf`), and the Hugging Face
baseline loads :func:`to_hf` into ``transformers`` models (:func:`hf_model`). ``to_hf`` is the
exact inverse of the importer's table (``itif.backbones.hf``), so the names cannot drift apart.

Fine-tune modes (how much tenants share):

- ``full``: every tensor differs (each tenant a full fine-tune; the thesis' setting);
- ``head``: one backbone, per-tenant pooler and classification head;
- ``last:K``: the backbone shared except the last K layer parameter sets (and pooler, head).

Sharing lets the fused engine store and multiply shared layers once; the one-instance-per-tenant
baselines hold and run a full copy per tenant either way.
"""

from __future__ import annotations

import functools
import re

import torch

from itif.backbones.hf import CanonicalWeights, canonical_entries
from itif.backbones.spec import BackboneSpec
from itif.errors import InvalidRequest

NUM_LABELS = 2
_BASE_SEED = 0


def parse_fine_tune(mode: str) -> int | None:
    """Layer sets each tenant owns: None for ``full``, 0 for ``head``, K for ``last:K``."""
    if mode == "full":
        return None
    if mode == "head":
        return 0
    m = re.fullmatch(r"last:(\d+)", mode)
    if not m:
        raise InvalidRequest(f"fine-tune mode {mode!r} is not full, head or last:K")
    return int(m.group(1))


def _rand(shape, name: str, gen: torch.Generator) -> torch.Tensor:
    # as itif.backbones.random: scaled noise, LayerNorm gains near one
    t = torch.randn(shape, generator=gen) * 0.02
    if name.endswith(("ln.weight", "ln1.weight", "ln2.weight")):
        t += 1.0
    return t


def _random(spec: BackboneSpec, seed: int, names=None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p.name: _rand(p.shape, p.name, gen)
            for p in spec.params(num_labels=NUM_LABELS, pooler=spec.is_text)
            if names is None or p.name in names}


@functools.lru_cache(maxsize=2)
def _base(spec: BackboneSpec) -> dict[str, torch.Tensor]:
    return _random(spec, _BASE_SEED)


def tenant_weights(spec: BackboneSpec, index: int, fine_tune: str = "full") -> CanonicalWeights:
    """Tenant ``index``'s weights (deterministic). Text tenants have a pooler and a 2-label head
    (as ``*ForSequenceClassification``); ViT tenants a head on the CLS row and no pooler (as
    ``ViTForImageClassification``)."""
    own = parse_fine_tune(fine_tune)
    seed = 1000 + index
    if own is None:
        tensors = _random(spec, seed)
    else:
        first = spec.num_param_layers - own
        mine = {p.name for p in spec.params(num_labels=NUM_LABELS, pooler=spec.is_text)
                if p.group in ("pooler", "head")
                or (p.group == "layer" and int(p.name.split(".")[1]) >= first)}
        tensors = dict(_base(spec))
        tensors.update(_random(spec, seed, mine))
    return CanonicalWeights(tensors, NUM_LABELS, spec.is_text)


def tenant_bytes(spec: BackboneSpec, element_size: int = 4) -> int:
    """Bytes of one tenant's full weights."""
    n = 0
    for p in spec.params(num_labels=NUM_LABELS, pooler=spec.is_text):
        k = 1
        for d in p.shape:
            k *= d
        n += k
    return n * element_size


def to_hf(spec: BackboneSpec, w: CanonicalWeights, scheme: str = "hub",
          prefix: bool = True) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors for canonical weights: the inverse of ``to_canonical``.

    ``scheme``: ``hub`` (checkpoint names) or ``v5`` (transformers 5 ViT module names);
    ``prefix``: backbone names under ``bert.`` / ``albert.`` / ``vit.`` (as in the
    ``*ForSequenceClassification`` models), the classifier never.
    """
    pre = spec.family + "." if prefix else ""
    out: dict[str, torch.Tensor] = {}
    for e in canonical_entries(spec, scheme):
        t = w.tensors[e.canonical]
        if len(e.sources) > 1:  # fused QKV back into query, key, value
            parts = torch.split(t, [s[0] for s in e.source_shapes], 0)
        else:
            parts = (t.reshape(e.source_shapes[0]),)
        for name, part in zip(e.sources, parts):
            out[pre + name] = part.contiguous()
    if w.has_pooler:
        pooler = "pooler." if spec.family == "albert" else "pooler.dense."
        out[pre + pooler + "weight"] = w.tensors["pooler.weight"].contiguous()
        out[pre + pooler + "bias"] = w.tensors["pooler.bias"].contiguous()
    if w.num_labels:
        out["classifier.weight"] = w.tensors["head.weight"].contiguous()
        out["classifier.bias"] = w.tensors["head.bias"].contiguous()
    return out


def hf_model(spec: BackboneSpec, w: CanonicalWeights, device: torch.device,
             dtype: torch.dtype) -> torch.nn.Module:
    """A ``transformers`` classification model holding ``w``, in eval mode on ``device``.

    Raises ImportError without transformers. The model's own state_dict names decide the ViT
    naming scheme, so both transformers 4 and 5 load.
    """
    import transformers as T  # noqa: PLC0415 - optional (the test extra)

    classes = {"bert": (T.BertConfig, T.BertForSequenceClassification),
               "albert": (T.AlbertConfig, T.AlbertForSequenceClassification),
               "vit": (T.ViTConfig, T.ViTForImageClassification)}
    cfg_cls, model_cls = classes[spec.family]
    cfg = cfg_cls(**spec.hf_config(num_labels=w.num_labels))
    with _no_init():
        model = model_cls(cfg)
    load_hf_weights(model, spec, w)
    return model.to(device=device, dtype=dtype).eval()


def load_hf_weights(model: torch.nn.Module, spec: BackboneSpec, w: CanonicalWeights) -> None:
    """Copy ``w`` into a ``transformers`` model of ``spec`` in place (any device and dtype): how
    the benchmark's float32 reference model takes one tenant after another without rebuilding."""
    keys = model.state_dict().keys()
    scheme = "v5" if any(k.startswith(f"{spec.family}.layers.") for k in keys) else "hub"
    sd = to_hf(spec, w, scheme=scheme)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
    if missing or unexpected:
        raise RuntimeError(f"HF {type(model).__name__} does not take the exported weights: "
                           f"missing {missing[:3]}, unexpected {list(unexpected)[:3]}")


def _no_init():
    """transformers' context that skips random initialisation (the weights are loaded next)."""
    try:
        from transformers.initialization import no_init_weights  # noqa: PLC0415 - v5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # noqa: PLC0415 - v4
        except ImportError:
            import contextlib  # noqa: PLC0415

            return contextlib.nullcontext()
    return no_init_weights()
