"""BackboneSpec: the architecture every tenant of one daemon shares, and its canonical parameters.

A spec is built from a Hugging Face ``config.json`` (or a checkpoint directory holding one) or
from a named preset. It fixes the sizes, where LayerNorm sits (post-LN BERT/ALBERT, pre-LN ViT),
cross-layer sharing (ALBERT) and the *canonical parameter table*: one name and shape per
parameter kind. The weight store keeps one contiguous buffer per kind; the engine reads them by
canonical name; ``itif.backbones.hf`` maps Hugging Face checkpoint names onto this table.

Canonical names (``{i}`` is the layer parameter set, 0..num_param_layers-1)::

    text:  emb.word [V,E]  emb.pos [P,E]  emb.type [TV,E]  emb.ln.{weight,bias} [E]
           (ALBERT) emb.proj.{weight [H,E], bias [H]}
    vit:   emb.patch.{weight [H, C*p*p], bias [H]}  emb.cls [H]  emb.pos [N+1,H]
           final_ln.{weight,bias} [H]
    layer: layers.{i}.qkv.{weight [3H,H], bias [3H]}   layers.{i}.attn_out.{weight [H,H], bias [H]}
           layers.{i}.ln1.{weight,bias} [H]            layers.{i}.ffn_in.{weight [I,H], bias [I]}
           layers.{i}.ffn_out.{weight [H,I], bias [H]} layers.{i}.ln2.{weight,bias} [H]
    optional: pooler.{weight [H,H], bias [H]}          head.{weight [L,H], bias [L]} (L per tenant)

Q, K and V are stored fused as one ``qkv`` kind: one GEMM instead of three per layer, and one
sha256 decides whether two tenants share the whole attention input projection.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Literal

from itif.errors import InvalidConfig

Family = Literal["bert", "albert", "vit"]
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "tanh")


@dataclass(frozen=True)
class ParamDef:
    """One canonical parameter kind. ``head`` kinds have a per-tenant first dimension."""

    name: str
    shape: tuple[int, ...]
    group: Literal["embeddings", "layer", "final", "pooler", "head"]


class SpecShape:
    """What an encoder :class:`BackboneSpec` and a decoder ``DecoderSpec``
    (``itif.generation.spec``) derive alike from their ``family``, ``hidden`` and ``heads``
    fields, said once: both engines' block code reads these names, whichever spec it has."""

    #: the families whose blocks normalise before attention and the FFN (pre-LN) rather than
    #: after the residual (post-LN)
    PRE_LN_FAMILIES: ClassVar[tuple[str, ...]] = ()
    #: the head size a config gives apart from ``hidden / heads`` (a DecoderSpec field, for
    #: llama's ``head_dim``); 0: ``hidden / heads``
    head_size: ClassVar[int] = 0

    @property
    def pre_ln(self) -> bool:
        """True for pre-LayerNorm (or pre-RMSNorm) blocks; the others normalise after the
        residual."""
        return self.family in self.PRE_LN_FAMILIES

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


@contextlib.contextmanager
def config_errors(family: str) -> Iterator[None]:
    """Reading a ``family`` config.json: a missing key or a value of the wrong type becomes
    InvalidConfig naming it (the specs' own InvalidConfig passes through)."""
    try:
        yield
    except KeyError as e:
        raise InvalidConfig(f"config.json of a {family} model lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, InvalidConfig):
            raise
        raise InvalidConfig(f"config.json has a bad value: {e}") from None


def read_config_json(path: Path, what: str = "") -> dict:
    """The JSON object in ``path``; InvalidConfig when it cannot be read or is not an object
    (``what``: how the messages name the file before its path, e.g. "backbone config ")."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidConfig(f"cannot read {what}{str(path)!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidConfig(f"{what}{str(path)!r} is not a JSON object")
    return cfg


@dataclass(frozen=True)
class BackboneSpec(SpecShape):
    #: ViT's blocks are pre-LN; BERT and ALBERT normalise after the residual
    PRE_LN_FAMILIES: ClassVar[tuple[str, ...]] = ("vit",)

    family: Family
    hidden: int
    layers: int
    heads: int
    intermediate: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    # text backbones
    vocab_size: int = 0
    max_position: int = 0
    type_vocab_size: int = 0
    pad_token_id: int = 0
    embedding_size: int = 0  # ALBERT's factorized embedding width; equals hidden otherwise
    num_hidden_groups: int = 1  # ALBERT: layer parameter sets shared across all layers
    # vision backbones
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 0
    name: str = field(default="custom", compare=False)
    source_dir: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise InvalidConfig(
                f"hidden_size {self.hidden} is not divisible by num_attention_heads {self.heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise InvalidConfig(f"hidden_act {self.hidden_act!r} is not one of {ACTIVATIONS}")
        if self.family == "vit" and self.image_size % max(self.patch_size, 1):
            raise InvalidConfig(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.family == "albert" and self.num_hidden_groups < 1:
            raise InvalidConfig(f"num_hidden_groups {self.num_hidden_groups} must be >= 1")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def is_text(self) -> bool:
        return self.family in ("bert", "albert")

    @property
    def emb_width(self) -> int:
        return self.embedding_size or self.hidden

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.family == "vit" else 0

    @property
    def seq_len_max(self) -> int:
        """Longest sequence the backbone accepts: position table size, or patches + CLS."""
        return self.num_patches + 1 if self.family == "vit" else self.max_position

    @property
    def num_param_layers(self) -> int:
        """Distinct layer parameter sets: ALBERT shares its groups across all layers."""
        return self.num_hidden_groups if self.family == "albert" else self.layers

    def layer_params(self, layer: int) -> int:
        """Index of the parameter set that encoder layer ``layer`` uses."""
        if self.family == "albert":  # transformers' own float formula, to the last rounding
            return int(layer / (self.layers / self.num_hidden_groups))
        return layer

    # ---- canonical table -----------------------------------------------------------------
    def params(self, num_labels: int | None = None, pooler: bool = True) -> list[ParamDef]:
        """Canonical parameter table in a fixed order (embeddings, layers, final, pooler, head)."""
        H, I = self.hidden, self.intermediate  # noqa: E741 (I: the intermediate width, as in the papers)
        out: list[ParamDef] = []
        if self.is_text:
            E = self.emb_width
            out += [
                ParamDef("emb.word", (self.vocab_size, E), "embeddings"),
                ParamDef("emb.pos", (self.max_position, E), "embeddings"),
                ParamDef("emb.type", (self.type_vocab_size, E), "embeddings"),
                ParamDef("emb.ln.weight", (E,), "embeddings"),
                ParamDef("emb.ln.bias", (E,), "embeddings"),
            ]
            if self.family == "albert":
                out += [
                    ParamDef("emb.proj.weight", (H, E), "embeddings"),
                    ParamDef("emb.proj.bias", (H,), "embeddings"),
                ]
        else:
            patch = self.num_channels * self.patch_size**2
            out += [
                ParamDef("emb.patch.weight", (H, patch), "embeddings"),
                ParamDef("emb.patch.bias", (H,), "embeddings"),
                ParamDef("emb.cls", (H,), "embeddings"),
                ParamDef("emb.pos", (self.num_patches + 1, H), "embeddings"),
            ]
        for i in range(self.num_param_layers):
            p = f"layers.{i}."
            out += [
                ParamDef(p + "qkv.weight", (3 * H, H), "layer"),
                ParamDef(p + "qkv.bias", (3 * H,), "layer"),
                ParamDef(p + "attn_out.weight", (H, H), "layer"),
                ParamDef(p + "attn_out.bias", (H,), "layer"),
                ParamDef(p + "ln1.weight", (H,), "layer"),
                ParamDef(p + "ln1.bias", (H,), "layer"),
                ParamDef(p + "ffn_in.weight", (I, H), "layer"),
                ParamDef(p + "ffn_in.bias", (I,), "layer"),
                ParamDef(p + "ffn_out.weight", (H, I), "layer"),
                ParamDef(p + "ffn_out.bias", (H,), "layer"),
                ParamDef(p + "ln2.weight", (H,), "layer"),
                ParamDef(p + "ln2.bias", (H,), "layer"),
            ]
        if self.family == "vit":
            out += [
                ParamDef("final_ln.weight", (H,), "final"),
                ParamDef("final_ln.bias", (H,), "final"),
            ]
        if pooler:
            out += [
                ParamDef("pooler.weight", (H, H), "pooler"),
                ParamDef("pooler.bias", (H,), "pooler"),
            ]
        if num_labels:
            out += [
                ParamDef("head.weight", (num_labels, H), "head"),
                ParamDef("head.bias", (num_labels,), "head"),
            ]
        return out

    def param_count(self) -> int:
        total = 0
        for p in self.params():
            n = 1
            for d in p.shape:
                n *= d
            total += n
        return total

    def hf_config(self, num_labels: int | None = None) -> dict:
        """A Hugging Face config.json dict for this spec (used by tests and tools)."""
        common = dict(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.intermediate,
            hidden_act=self.hidden_act,
            layer_norm_eps=self.layer_norm_eps,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        if self.is_text:
            common.update(
                vocab_size=self.vocab_size,
                max_position_embeddings=self.max_position,
                type_vocab_size=self.type_vocab_size,
                pad_token_id=self.pad_token_id,
            )
        if self.family == "albert":
            common.update(embedding_size=self.emb_width, num_hidden_groups=self.num_hidden_groups)
        if self.family == "vit":
            common.update(
                image_size=self.image_size,
                patch_size=self.patch_size,
                num_channels=self.num_channels,
            )
        common["model_type"] = self.family
        if num_labels:
            common["num_labels"] = num_labels
        return common


# ---- presets -------------------------------------------------------------------------------
_BERT_TEXT = dict(vocab_size=30522, max_position=512, type_vocab_size=2)
PRESETS: dict[str, BackboneSpec] = {
    "bert-base": BackboneSpec("bert", 768, 12, 12, 3072, **_BERT_TEXT),
    "bert-large": BackboneSpec("bert", 1024, 24, 16, 4096, **_BERT_TEXT),
    "albert-base": BackboneSpec(
        "albert", 768, 12, 12, 3072, "gelu_new", vocab_size=30000, max_position=512,
        type_vocab_size=2, embedding_size=128,
    ),
    "albert-large": BackboneSpec(
        "albert", 1024, 24, 16, 4096, "gelu_new", vocab_size=30000, max_position=512,
        type_vocab_size=2, embedding_size=128,
    ),
    "vit-base": BackboneSpec(
        "vit", 768, 12, 12, 3072, image_size=224, patch_size=16, num_channels=3
    ),
    # A small BERT (21 MB in float32): the CPU benchmark's model (hidden 256, 4 layers).
    "bert-small": BackboneSpec(
        "bert", 256, 4, 4, 1024, vocab_size=8192, max_position=128, type_vocab_size=2
    ),
    # Tiny shapes for tests, CI and the CPU demo: same code paths, milliseconds per forward.
    "bert-tiny": BackboneSpec(
        "bert", 64, 2, 4, 128, vocab_size=1000, max_position=128, type_vocab_size=2
    ),
    "albert-tiny": BackboneSpec(
        "albert", 64, 3, 4, 128, "gelu_new", vocab_size=1000, max_position=128,
        type_vocab_size=2, embedding_size=32,
    ),
    "vit-tiny": BackboneSpec("vit", 64, 2, 4, 128, image_size=32, patch_size=8, num_channels=3),
}
PRESETS = {k: replace(v, name=k) for k, v in PRESETS.items()}


def spec_from_hf_config(cfg: dict, name: str = "custom",
                        source_dir: Path | None = None) -> BackboneSpec:
    """Build a spec from a Hugging Face config.json dict (bert, albert or vit model_type)."""
    family = cfg.get("model_type")
    if family not in ("bert", "albert", "vit"):
        raise InvalidConfig(f"model_type {family!r} is not supported (bert, albert, vit)")
    for key in ("is_decoder", "add_cross_attention"):  # causal attention, cross-attention
        if cfg.get(key):
            raise InvalidConfig(f"config.json {key}: true is not supported (itif serves "
                                f"{family} as an encoder: bidirectional self-attention only)")
    if family == "vit" and cfg.get("pooler_act", "tanh") != "tanh":
        raise InvalidConfig(f"config.json pooler_act {cfg['pooler_act']!r} is not supported "
                            "(only 'tanh')")
    with config_errors(family):
        common = dict(
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=int(cfg["num_attention_heads"]),
            intermediate=int(cfg["intermediate_size"]),
            # transformers' defaults where config.json leaves it out: ALBERT's is gelu_new
            hidden_act=str(cfg.get("hidden_act", "gelu_new" if family == "albert" else "gelu")),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            name=name,
            source_dir=source_dir,
        )
        if family in ("bert", "albert"):
            if cfg.get("position_embedding_type", "absolute") != "absolute":
                raise InvalidConfig(
                    f"position_embedding_type {cfg['position_embedding_type']!r} is not supported"
                    " (only 'absolute')"
                )
            text = dict(
                vocab_size=int(cfg["vocab_size"]),
                max_position=int(cfg["max_position_embeddings"]),
                type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                pad_token_id=int(cfg.get("pad_token_id") or 0),
            )
            if family == "albert":
                if int(cfg.get("inner_group_num", 1)) != 1:
                    raise InvalidConfig("ALBERT inner_group_num != 1 is not supported")
                return BackboneSpec(
                    "albert", **common, **text,
                    embedding_size=int(cfg.get("embedding_size", 128)),
                    num_hidden_groups=int(cfg.get("num_hidden_groups", 1)),
                )
            return BackboneSpec("bert", **common, **text)
        if not cfg.get("qkv_bias", True):
            raise InvalidConfig("ViT without qkv_bias is not supported")
        return BackboneSpec(
            "vit", **common,
            image_size=_side(cfg.get("image_size", 224), "image_size"),
            patch_size=_side(cfg.get("patch_size", 16), "patch_size"),
            num_channels=int(cfg.get("num_channels", 3)),
        )


def _side(value, key: str) -> int:
    """A ViT size: an int, or a [height, width] pair (as transformers takes) that is square."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise InvalidConfig(f"config.json {key} {list(value)!r}: only square sizes are "
                                "supported")
        value = value[0]
    return int(value)


#: What a tenant's own config.json must agree on with the backbone: the fields that change
#: the computation (weight shapes are checked anyway, by the tensors).
_COMPUTE_FIELDS = ("hidden", "layers", "heads", "intermediate", "hidden_act", "layer_norm_eps",
                   "vocab_size", "max_position", "type_vocab_size", "embedding_size",
                   "num_hidden_groups", "image_size", "patch_size", "num_channels")


def check_tenant_config(spec: BackboneSpec, cfg: dict) -> None:
    """InvalidConfig naming the first field where a tenant checkpoint's config.json differs
    from the backbone (itif computes every tenant with the backbone's settings: a tenant of
    another activation or epsilon would be served wrong, silently), or whose head is per token
    (itif serves one label vector per sequence)."""
    archs = cfg.get("architectures") or []
    if any(str(a).endswith("ForTokenClassification") for a in archs):
        raise InvalidConfig(f"config.json architectures {archs!r}: per-token classification "
                            "heads are not served (one label vector per sequence)")
    mine = spec_from_hf_config(cfg, name="tenant")
    for key in _COMPUTE_FIELDS:
        want, got = getattr(spec, key), getattr(mine, key)
        if key == "layer_norm_eps" and math.isclose(want, got, rel_tol=1e-9, abs_tol=0.0):
            continue
        if want != got:
            raise InvalidConfig(f"the checkpoint's config.json has {key} {got!r}; backbone "
                                f"{spec.name!r} computes with {want!r}: a tenant must share the "
                                "backbone's architecture")


def load_spec(backbone: str | os.PathLike | BackboneSpec) -> BackboneSpec:
    """Resolve a backbone: a BackboneSpec, a preset name, a config.json or a checkpoint dir."""
    if isinstance(backbone, BackboneSpec):
        return backbone
    text = str(backbone)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.is_dir():
        cfg_path = path / "config.json"
    elif path.is_file():
        cfg_path = path
    else:
        raise InvalidConfig(
            f"backbone {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor an existing config.json or checkpoint directory"
        )
    cfg = read_config_json(cfg_path, "backbone config ")
    return spec_from_hf_config(cfg, name=cfg_path.parent.name, source_dir=cfg_path.parent)
