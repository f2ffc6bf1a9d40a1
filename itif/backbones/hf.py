"""Import Hugging Face checkpoints onto a backbone's canonical parameter table.

Accepted: a safetensors file, a checkpoint directory (``model.safetensors`` or a sharded
``model.safetensors.index.json``), or a dict of tensors with Hugging Face names. Base models
with or without the family prefix (``bert.``, ``albert.``, ``vit.``) and the
``*ForSequenceClassification`` / ``ViTForImageClassification`` heads are understood; ViT names
of both the hub layout (``encoder.layer.N.attention.attention.query``) and transformers 5
(``layers.N.attention.q_proj``) are. Pickled checkpoints are refused without being opened.

A checkpoint that does not fit gets an ``InvalidWeights`` naming the first tensor that differs
(in canonical order: missing, wrong shape), then the first tensor the backbone has no place for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from itif.backbones.spec import BackboneSpec, check_tenant_config
from itif.errors import InvalidConfig, InvalidWeights
from itif.safetensors_io import load_safetensors

# Tensors some checkpoints carry that are buffers, not weights.
_IGNORED_SUFFIXES = ("position_ids",)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class CanonicalWeights:
    """A tenant's weights under canonical names (float32, contiguous, CPU)."""

    tensors: dict[str, torch.Tensor]
    num_labels: int | None  # classification head size; None: no head
    has_pooler: bool


@dataclass(frozen=True)
class SourceEntry:
    """One canonical parameter and the Hugging Face tensors it is read from (the bench writes
    checkpoints back from the same table)."""

    canonical: str
    sources: tuple[str, ...]  # Hugging Face names, after the family prefix is stripped
    source_shapes: tuple[tuple[int, ...], ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]


def _one(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, 0)


def _flatten_from(dim: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    return lambda ts: ts[0].reshape(*ts[0].shape[:dim], -1)


def _squeeze_lead(ts: list[torch.Tensor]) -> torch.Tensor:
    t = ts[0]
    while t.dim() > 1 and t.shape[0] == 1:
        t = t[0]
    return t


def layer_sources(spec: BackboneSpec, i: int, scheme: str) -> dict[str, tuple[str, ...]]:
    """Hugging Face names of layer parameter set ``i`` for each canonical layer parameter."""
    if spec.family == "bert":
        p = f"encoder.layer.{i}."
        q, k, v = (p + f"attention.self.{n}" for n in ("query", "key", "value"))
        names = dict(attn_out=p + "attention.output.dense", ln1=p + "attention.output.LayerNorm",
                     ffn_in=p + "intermediate.dense", ffn_out=p + "output.dense",
                     ln2=p + "output.LayerNorm")
    elif spec.family == "albert":
        p = f"encoder.albert_layer_groups.{i}.albert_layers.0."
        q, k, v = (p + f"attention.{n}" for n in ("query", "key", "value"))
        names = dict(attn_out=p + "attention.dense", ln1=p + "attention.LayerNorm",
                     ffn_in=p + "ffn", ffn_out=p + "ffn_output", ln2=p + "full_layer_layer_norm")
    elif scheme == "hub":  # ViT as saved on the hub and by save_pretrained
        p = f"encoder.layer.{i}."
        q, k, v = (p + f"attention.attention.{n}" for n in ("query", "key", "value"))
        names = dict(attn_out=p + "attention.output.dense", ln1=p + "layernorm_before",
                     ffn_in=p + "intermediate.dense", ffn_out=p + "output.dense",
                     ln2=p + "layernorm_after")
    else:  # ViT state_dict names of transformers 5
        p = f"layers.{i}."
        q, k, v = (p + f"attention.{n}" for n in ("q_proj", "k_proj", "v_proj"))
        names = dict(attn_out=p + "attention.o_proj", ln1=p + "layernorm_before",
                     ffn_in=p + "mlp.fc1", ffn_out=p + "mlp.fc2", ln2=p + "layernorm_after")
    out = {"qkv.weight": (q + ".weight", k + ".weight", v + ".weight"),
           "qkv.bias": (q + ".bias", k + ".bias", v + ".bias")}
    for canon, hf in names.items():
        out[f"{canon}.weight"] = (hf + ".weight",)
        out[f"{canon}.bias"] = (hf + ".bias",)
    return out


def canonical_entries(spec: BackboneSpec, scheme: str) -> list[SourceEntry]:
    """Canonical order, required parameters only (pooler and head are handled apart)."""
    H = spec.hidden
    fixed: dict[str, tuple[tuple[str, ...], tuple[tuple[int, ...], ...], Callable]] = {}
    if spec.is_text:
        E = spec.emb_width
        fixed.update(
            {
                "emb.word": (("embeddings.word_embeddings.weight",), ((spec.vocab_size, E),), _one),
                "emb.pos": (
                    ("embeddings.position_embeddings.weight",),
                    ((spec.max_position, E),),
                    _one,
                ),
                "emb.type": (
                    ("embeddings.token_type_embeddings.weight",),
                    ((spec.type_vocab_size, E),),
                    _one,
                ),
                "emb.ln.weight": (("embeddings.LayerNorm.weight",), ((E,),), _one),
                "emb.ln.bias": (("embeddings.LayerNorm.bias",), ((E,),), _one),
                "emb.proj.weight": (
                    ("encoder.embedding_hidden_mapping_in.weight",),
                    ((H, E),),
                    _one,
                ),
                "emb.proj.bias": (("encoder.embedding_hidden_mapping_in.bias",), ((H,),), _one),
            }
        )
    else:
        C, P, N = spec.num_channels, spec.patch_size, spec.num_patches
        fixed.update({
            "emb.patch.weight": (("embeddings.patch_embeddings.projection.weight",),
                                 ((H, C, P, P),), _flatten_from(1)),
            "emb.patch.bias": (("embeddings.patch_embeddings.projection.bias",), ((H,),), _one),
            "emb.cls": (("embeddings.cls_token",), ((1, 1, H),), _squeeze_lead),
            "emb.pos": (("embeddings.position_embeddings",), ((1, N + 1, H),), _squeeze_lead),
            "final_ln.weight": (("layernorm.weight",), ((H,),), _one),
            "final_ln.bias": (("layernorm.bias",), ((H,),), _one),
        })
    out: list[SourceEntry] = []
    for p in spec.params(num_labels=None, pooler=False):
        if p.group == "layer":
            i_str, rest = p.name.split(".", 2)[1:]
            sources = layer_sources(spec, int(i_str), scheme)[rest]
            if rest.startswith("qkv"):
                shapes = tuple((H, H) if rest.endswith("weight") else (H,) for _ in sources)
                out.append(SourceEntry(p.name, sources, shapes, _cat))
            else:
                out.append(SourceEntry(p.name, sources, (p.shape,), _one))
        else:
            sources, shapes, combine = fixed[p.name]
            out.append(SourceEntry(p.name, sources, shapes, combine))
    return out


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def to_canonical(spec: BackboneSpec, tensors: Mapping[str, torch.Tensor]) -> CanonicalWeights:
    """Map Hugging Face-named tensors onto ``spec``'s canonical table, checking every tensor."""
    if not tensors:
        raise InvalidWeights("the checkpoint holds no tensors")
    prefix = spec.family + "."
    src: dict[str, torch.Tensor] = {}
    shown: dict[str, str] = {}  # stripped name -> name as the tenant wrote it (for messages)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidWeights(f"tensor {name!r} is a {type(t).__name__}, not a tensor")
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        key = name[len(prefix):] if name.startswith(prefix) else name
        if key in src:
            raise InvalidWeights(f"tensor {name!r} appears twice (with and without {prefix!r})")
        src[key], shown[key] = t, name

    scheme = "hub"
    if spec.family == "vit" and any(k.startswith("layers.") for k in src):
        scheme = "v5"

    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(names: tuple[str, ...], shapes, combine, canonical: str) -> torch.Tensor:
        parts = []
        for n, shape in zip(names, shapes):
            if n not in src:
                raise InvalidWeights(
                    f"missing tensor {prefix + n!r} ({canonical}): the {spec.family} backbone "
                    f"{spec.name!r} needs it with shape {_fmt(shape)}"
                )
            t = src[n]
            if tuple(t.shape) != tuple(shape):
                raise InvalidWeights(
                    f"tensor {shown[n]!r} has shape {_fmt(t.shape)}; the {spec.family} backbone "
                    f"{spec.name!r} expects {_fmt(shape)}"
                )
            if not t.is_floating_point():
                raise InvalidWeights(
                    f"tensor {shown[n]!r} has dtype {t.dtype}; expected a float type"
                )
            parts.append(t)
            used.add(n)
        return combine(parts)

    for e in canonical_entries(spec, scheme):
        out[e.canonical] = take(e.sources, e.source_shapes, e.combine, e.canonical)

    H = spec.hidden
    pooler = ("pooler.dense.weight", "pooler.dense.bias")
    if spec.family == "albert":
        pooler = ("pooler.weight", "pooler.bias")
    has_pooler = any(n in src for n in pooler)
    if has_pooler:
        out["pooler.weight"] = take(pooler[:1], ((H, H),), _one, "pooler.weight")
        out["pooler.bias"] = take(pooler[1:], ((H,),), _one, "pooler.bias")

    num_labels = None
    if "classifier.weight" in src or "classifier.bias" in src:
        w = src.get("classifier.weight")
        labels = int(w.shape[0]) if w is not None and w.dim() == 2 else 0
        if labels < 1:
            raise InvalidWeights(
                f"tensor 'classifier.weight' has shape "
                f"{_fmt(w.shape) if w is not None else 'missing'}; expected [num_labels, {H}]"
            )
        out["head.weight"] = take(("classifier.weight",), ((labels, H),), _one, "head.weight")
        out["head.bias"] = take(("classifier.bias",), ((labels,),), _one, "head.bias")
        num_labels = labels

    extra = [shown[n] for n in src if n not in used]
    if extra:
        raise InvalidWeights(
            f"unexpected tensor {extra[0]!r}: not part of the {spec.family} backbone "
            f"{spec.name!r} ({spec.layers} layers, hidden {spec.hidden})"
            + (f", and {len(extra) - 1} more" if len(extra) > 1 else "")
        )

    canon: dict[str, torch.Tensor] = {}
    for name, t in out.items():
        t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise InvalidWeights(f"tensor {name!r} has {bad} non-finite values (NaN/Inf)")
        canon[name] = t
    return CanonicalWeights(canon, num_labels, has_pooler)


def read_checkpoint(source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file or checkpoint directory. Never unpickles."""
    path = Path(source)
    if path.is_dir():
        single = path / "model.safetensors"
        index = path / "model.safetensors.index.json"
        if single.is_file():
            return load_safetensors(single)
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise InvalidWeights(f"bad shard index {str(index)!r}: {e}") from None
            merged: dict[str, torch.Tensor] = {}
            for shard in shards:
                shard_path = (path / shard).resolve()
                if shard_path.parent != path.resolve():
                    raise InvalidWeights(f"shard {shard!r} lies outside the checkpoint directory")
                for k, v in load_safetensors(shard_path).items():
                    if k in merged:
                        raise InvalidWeights(f"tensor {k!r} appears in two shards")
                    merged[k] = v
            return merged
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise InvalidWeights(
                f"{str(path)!r} holds only pickled weights ({pickles[0]}); itif reads safetensors "
                "only and never unpickles: convert with safetensors.torch.save_file"
            )
        raise InvalidWeights(f"no model.safetensors in checkpoint directory {str(path)!r}")
    if path.suffix in _PICKLE_SUFFIXES:
        raise InvalidWeights(
            f"{path.name!r} is a pickle-based checkpoint; itif reads safetensors only"
        )
    if not path.is_file():
        raise InvalidWeights(f"weights file {str(path)!r} does not exist")
    return load_safetensors(path)


def load_tenant_weights(spec: BackboneSpec, source) -> CanonicalWeights:
    """Canonical weights from a path (file or directory) or a dict of Hugging Face tensors."""
    if isinstance(source, Mapping):
        return to_canonical(spec, source)
    config = Path(source) / "config.json"
    if config.is_file():  # a checkpoint directory says what it was trained as: it must agree
        try:
            cfg = json.loads(config.read_text())
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
            check_tenant_config(spec, cfg)
        except InvalidConfig as e:  # (a ValueError too)
            raise InvalidWeights(str(e)) from None
        except (OSError, ValueError) as e:
            raise InvalidWeights(f"cannot read {str(config)!r}: {e}") from None
    return to_canonical(spec, read_checkpoint(source))
