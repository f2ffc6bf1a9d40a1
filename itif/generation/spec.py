"""DecoderSpec: the generative backbone every tenant of one GenEngine shares, and its canonical
parameters.

Four families:

* ``gpt2``: decoder-only, pre-LayerNorm blocks, learned positions, a final LayerNorm, the LM head
  tied to the word embeddings;
* ``bart``: encoder-decoder, post-LayerNorm, learned positions read at ``position + 2``, a
  LayerNorm over the embeddings (``layernorm_embedding``), embeddings scaled by sqrt(hidden) when
  ``scale_embedding``, a ``final_logits_bias``;
* ``marian``: as BART but with fixed sinusoidal positions (computed here, never stored), no
  embedding LayerNorm, scaled embeddings (per its config) and decoder start = pad.
* ``llama``: decoder-only, pre-RMSNorm blocks, rotary positions (nothing stored; the RoPE
  variants of ``itif.generation.rope``), grouped-query attention (``kv_heads`` key/value heads
  shared by ``heads / kv_heads`` query heads each), a gated MLP (SwiGLU), a final RMSNorm, the
  LM head tied or not. Hugging Face ``model_type`` llama, qwen2 and mistral (``model_type``
  records which); biases only where the checkpoint has them (Qwen2: Q/K/V; Llama's
  ``attention_bias``: Q/K/V and the output; ``mlp_bias``: the three MLP matrices).

Canonical names (``{i}`` a layer; ``H`` hidden, ``I`` FFN width, ``V`` vocabulary)::

    emb.word [V,H]                       word embeddings; also the LM head (tied, stored once)
    lm_head.weight [V,H]                 only when the checkpoint does not tie it
    final_logits_bias [V]                bart, marian
    gpt2:  emb.pos [P,H]  final_ln.{weight,bias} [H]
    llama: final_ln.weight [H]; per layer (pre-RMSNorm, no LayerNorm biases, ``A = heads x d``,
           ``G = kv_heads x d``, ``d`` the head size):
           dec.{i}.ln1.weight  dec.{i}.qkv.weight [A+2G,H] (+ .bias when qkv_bias)
           dec.{i}.attn_out.weight [H,A] (+ .bias when out_bias)  dec.{i}.ln2.weight
           dec.{i}.gate_up.weight [2I,H] (gate rows, then up rows; + .bias when mlp_bias)
           dec.{i}.ffn_out.weight [H,I] (+ .bias when mlp_bias)
    bart:  enc.emb.pos [P+2,H]  dec.emb.pos [P+2,H]
           enc.emb.ln.{weight,bias}  dec.emb.ln.{weight,bias}
    encoder layer (bart, marian), post-LN:
           enc.{i}.qkv.{weight [3H,H], bias [3H]}  enc.{i}.attn_out.{weight [H,H], bias}
           enc.{i}.ln1.{weight,bias}  enc.{i}.ffn_in.{weight [I,H], bias [I]}
           enc.{i}.ffn_out.{weight [H,I], bias}  enc.{i}.ln2.{weight,bias}
    decoder layer: dec.{i}.qkv / attn_out / ffn_in / ffn_out as above, and
           gpt2 (pre-LN): dec.{i}.ln1 (before attention), dec.{i}.ln2 (before the FFN)
           bart, marian (post-LN): dec.{i}.ln1 (after self-attention),
               dec.{i}.cross_q.{weight [H,H], bias}  dec.{i}.cross_kv.{weight [2H,H], bias [2H]}
               dec.{i}.cross_out.{weight [H,H], bias}  dec.{i}.ln_cross.{weight,bias}
               dec.{i}.ln2 (after the FFN)

Q, K and V are one fused kind (one GEMM; llama's gate and up projections too); the
cross-attention keys and values are one kind too
(``cross_kv``), computed once per source sequence. Encoder and decoder word embeddings must be
the same tensor (all three families share them); they are ``emb.word``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Literal

import torch

from itif.backbones.spec import SpecShape, config_errors, read_config_json
from itif.errors import InvalidConfig
from itif.generation.api import GenerationDefaults

Family = Literal["gpt2", "bart", "marian", "llama"]
FAMILIES = ("gpt2", "bart", "marian", "llama")
#: Hugging Face model_type -> family, for the model types served under another family's name.
LLAMA_TYPES = ("llama", "qwen2", "mistral")
_ACT_NAMES = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new",
              "relu": "relu", "swish": "silu", "silu": "silu", "tanh": "tanh"}


@dataclass(frozen=True)
class DecoderSpec(SpecShape):
    """The decoder's sizes and family; ``pre_ln`` and ``head_dim`` are ``SpecShape``'s, as the
    encoder spec's are."""

    PRE_LN_FAMILIES: ClassVar[tuple[str, ...]] = ("gpt2", "llama")

    family: Family
    vocab_size: int
    hidden: int
    heads: int
    ffn: int
    dec_layers: int
    enc_layers: int = 0
    max_position: int = 128
    act: str = "gelu"
    eps: float = 1e-5
    scale_embedding: bool = False
    tied_lm_head: bool = True
    pad_token_id: int | None = None
    #: llama: key/value heads (grouped-query attention); 0 means ``heads``.
    kv_heads: int = 0
    #: llama: the head size when the config gives one (``head_dim``); 0 means hidden / heads.
    head_size: int = 0
    #: llama: the RoPE settings as sorted (key, value) pairs (a frozen spec must hash), always
    #: with ``rope_type`` and ``rope_theta``: ``itif.generation.rope`` reads them.
    rope: tuple = (("rope_theta", 10000.0), ("rope_type", "default"))
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    #: llama (Mistral): a query attends to at most this many positions, itself included; 0: all.
    sliding_window: int = 0
    #: llama: the Hugging Face model_type it was read from (llama, qwen2, mistral).
    model_type: str = ""
    name: str = field(default="custom", compare=False)
    source_dir: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InvalidConfig(f"model_type {self.family!r} is not a served decoder "
                                f"({', '.join(FAMILIES[:3] + LLAMA_TYPES)})")
        if self.hidden % self.heads and not (self.family == "llama" and self.head_size):
            raise InvalidConfig(f"hidden size {self.hidden} is not divisible by {self.heads} heads")
        if self.act not in _ACT_NAMES.values():
            raise InvalidConfig(f"activation {self.act!r} is not one of {sorted(set(_ACT_NAMES))}")
        if self.encoder_decoder and self.enc_layers < 1:
            raise InvalidConfig(f"{self.family} needs encoder layers, got {self.enc_layers}")
        if self.family == "llama":
            if self.kv_heads < 0 or self.heads % self.kv_heads_n:
                raise InvalidConfig(f"num_key_value_heads {self.kv_heads} does not divide "
                                    f"num_attention_heads {self.heads}")
            if self.head_dim % 2:
                raise InvalidConfig(f"head_dim {self.head_dim} is odd: rotary positions "
                                    "rotate pairs of dimensions")
            if self.sliding_window < 0:
                raise InvalidConfig(f"sliding_window {self.sliding_window} is negative")
            from itif.generation.rope import check_rope  # noqa: PLC0415 (torch-free, small)

            check_rope(self.rope_params, self.max_position)

    @property
    def encoder_decoder(self) -> bool:
        return self.family in ("bart", "marian")

    @property
    def kv_heads_n(self) -> int:
        """Key/value heads: ``kv_heads`` (llama's grouped-query attention), else ``heads``."""
        return self.kv_heads or self.heads

    @property
    def q_width(self) -> int:
        """Width of the attention's queries and context: heads x head size."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of one position's keys (and of its values) in the KV cache: kv heads x head
        size (the hidden size for gpt2, bart and marian)."""
        return self.kv_heads_n * self.head_dim

    @property
    def rope_params(self) -> dict:
        return dict(self.rope)

    @property
    def pos_offset(self) -> int:
        return 2 if self.family == "bart" else 0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden) if self.scale_embedding else 1.0

    @property
    def max_len(self) -> int:
        """Longest sequence (source, or prompt plus new tokens) the positions allow: the position
        table's length; for a dynamic RoPE, ``factor`` times ``max_position_embeddings`` (what
        that scaling stretches the context to; the other RoPE variants' configs already give
        the stretched length as ``max_position_embeddings``)."""
        p = self.rope_params if self.family == "llama" else {}
        if p.get("rope_type") == "dynamic":
            return int(self.max_position * p["factor"])
        return self.max_position

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """The canonical table, in a fixed order: (name, shape)."""
        H, I, V, P = self.hidden, self.ffn, self.vocab_size, self.max_position  # noqa: E741 (I: the intermediate width, as in the papers)
        out: list[tuple[str, tuple[int, ...]]] = [("emb.word", (V, H))]
        if not self.tied_lm_head:
            out.append(("lm_head.weight", (V, H)))
        lin = lambda p, n, o, i: [(f"{p}{n}.weight", (o, i)), (f"{p}{n}.bias", (o,))]  # noqa: E731
        ln = lambda p, n: [(f"{p}{n}.weight", (H,)), (f"{p}{n}.bias", (H,))]  # noqa: E731
        if self.family == "llama":
            return out + self._llama_params()
        if self.family == "gpt2":
            out.append(("emb.pos", (P, H)))
        else:
            out.append(("final_logits_bias", (V,)))
            if self.family == "bart":
                out += [("enc.emb.pos", (P + 2, H)), ("dec.emb.pos", (P + 2, H))]
                out += ln("enc.emb.", "ln") + ln("dec.emb.", "ln")
            for i in range(self.enc_layers):
                p = f"enc.{i}."
                out += (lin(p, "qkv", 3 * H, H) + lin(p, "attn_out", H, H) + ln(p, "ln1")
                        + lin(p, "ffn_in", I, H) + lin(p, "ffn_out", H, I) + ln(p, "ln2"))
        for i in range(self.dec_layers):
            p = f"dec.{i}."
            out += ln(p, "ln1") + lin(p, "qkv", 3 * H, H) + lin(p, "attn_out", H, H)
            if self.encoder_decoder:
                out += (lin(p, "cross_q", H, H) + lin(p, "cross_kv", 2 * H, H)
                        + lin(p, "cross_out", H, H) + ln(p, "ln_cross"))
            out += lin(p, "ffn_in", I, H) + lin(p, "ffn_out", H, I) + ln(p, "ln2")
        if self.family == "gpt2":
            out += ln("", "final_ln")
        return out

    def _llama_params(self) -> list[tuple[str, tuple[int, ...]]]:
        H, I = self.hidden, self.ffn  # noqa: E741 (I: the intermediate width, as in the papers)
        qkv = self.q_width + 2 * self.kv_width
        out: list[tuple[str, tuple[int, ...]]] = []
        for i in range(self.dec_layers):
            p = f"dec.{i}."
            out += [(p + "ln1.weight", (H,)), (p + "qkv.weight", (qkv, H))]
            if self.qkv_bias:
                out.append((p + "qkv.bias", (qkv,)))
            out.append((p + "attn_out.weight", (H, self.q_width)))
            if self.out_bias:
                out.append((p + "attn_out.bias", (H,)))
            out += [(p + "ln2.weight", (H,)), (p + "gate_up.weight", (2 * I, H))]
            if self.mlp_bias:
                out.append((p + "gate_up.bias", (2 * I,)))
            out.append((p + "ffn_out.weight", (H, I)))
            if self.mlp_bias:
                out.append((p + "ffn_out.bias", (H,)))
        return out + [("final_ln.weight", (H,))]

    def sinusoidal(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Marian's fixed position table [max_position, H]: sines of the even frequencies in the
        first half, cosines of the odd ones in the second (not interleaved)."""
        n, dim = self.max_position, self.hidden
        pos = torch.arange(n, dtype=torch.float64)[:, None]
        j = torch.arange(dim, dtype=torch.float64)
        enc = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)
        out = torch.empty(n, dim, dtype=torch.float64)
        half = dim // 2 if dim % 2 == 0 else dim // 2 + 1
        out[:, :half] = torch.sin(enc[:, 0::2])
        out[:, half:] = torch.cos(enc[:, 1::2])
        return out.to(torch.float32).to(dtype)

    def hf_config(self) -> dict:
        """A Hugging Face config.json dict of this spec (tests and tools)."""
        if self.family == "llama":
            return llama_hf_config(self)
        if self.family == "gpt2":
            return dict(
                model_type="gpt2",
                vocab_size=self.vocab_size,
                n_positions=self.max_position,
                n_embd=self.hidden,
                n_layer=self.dec_layers,
                n_head=self.heads,
                n_inner=self.ffn,
                activation_function=self.act if self.act != "silu" else "silu",
                layer_norm_epsilon=self.eps,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=self.tied_lm_head,
            )
        act = {"silu": "swish"}.get(self.act, self.act)
        return dict(model_type=self.family, vocab_size=self.vocab_size, d_model=self.hidden,
                    encoder_layers=self.enc_layers, decoder_layers=self.dec_layers,
                    encoder_attention_heads=self.heads, decoder_attention_heads=self.heads,
                    encoder_ffn_dim=self.ffn, decoder_ffn_dim=self.ffn,
                    max_position_embeddings=self.max_position, activation_function=act,
                    scale_embedding=self.scale_embedding, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, tie_word_embeddings=self.tied_lm_head,
                    pad_token_id=self.pad_token_id)


PRESETS: dict[str, DecoderSpec] = {
    # Tiny shapes for tests and the CPU demo (vocabulary small enough that EOS occurs).
    "gpt2-tiny": DecoderSpec("gpt2", 96, 32, 4, 64, 2, max_position=64, act="gelu_new"),
    "bart-tiny": DecoderSpec("bart", 96, 32, 4, 64, 2, 2, max_position=64, pad_token_id=1),
    "marian-tiny": DecoderSpec("marian", 96, 32, 4, 64, 2, 2, max_position=64, act="silu",
                               scale_embedding=True, pad_token_id=95),
    # A tiny Llama: grouped-query attention (4 query heads over 2 key/value heads), SwiGLU,
    # RoPE, an untied head; model_type llama (its config.json: ``llama_hf_config``).
    "llama-tiny": DecoderSpec("llama", 96, 32, 4, 48, 2, max_position=64, act="silu",
                              tied_lm_head=False, kv_heads=2, model_type="llama"),
    # The thesis' "Decoding" model (Table 5.1): 6+6 layers, 8 heads, hidden 512, Marian-shaped.
    "marian-decoding": DecoderSpec("marian", 8000, 512, 8, 2048, 6, 6, max_position=512,
                                   act="silu", scale_embedding=True, pad_token_id=7999),
}
PRESETS = {k: replace(v, name=k) for k, v in PRESETS.items()}


def _marian_defaults(pad: int) -> GenerationDefaults:
    """Marian's: end token 0, forced at the last step; the pad token (the last id) starts the
    decoder and is never generated (Marian checkpoints ban it: ``bad_words_ids``)."""
    return GenerationDefaults(eos_token_ids=(0,), pad_token_id=pad, decoder_start_token_id=pad,
                              forced_eos_token_id=0, bad_words_ids=((pad,),))


#: A preset backbone's generation settings (tenants upload weights only, so a preset daemon has
#: no checkpoint to read them from): each family's own ids, as its Hugging Face config class
#: sets them. GPT-2's end token is its last id (50256); ``gpt2-tiny`` has none (its vocabulary
#: is 96): a sequence ends at max_new_tokens or at the request's ``eos_token_id``. ``llama-tiny``
#: has LlamaConfig's: begin 1, end 2, no pad.
PRESET_DEFAULTS: dict[str, GenerationDefaults] = {
    "gpt2-tiny": GenerationDefaults(),
    "bart-tiny": GenerationDefaults(eos_token_ids=(2,), pad_token_id=1, bos_token_id=0,
                                    decoder_start_token_id=2, forced_eos_token_id=2),
    "marian-tiny": _marian_defaults(95),
    "llama-tiny": GenerationDefaults(eos_token_ids=(2,), bos_token_id=1),  # LlamaConfig's
    "marian-decoding": _marian_defaults(7999),
}


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


#: RoPE settings read from a config (the rest, such as ``type``, are aliases or unused).
_ROPE_KEYS = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings")


def _rope_of(cfg: dict) -> tuple:
    """The RoPE settings as Hugging Face resolves them: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (older config.json), ``rope_theta`` beside them, ``type`` an old name of
    ``rope_type``; llama3 without ``original_max_position_embeddings`` takes the config's."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise InvalidConfig("config.json partial_rotary_factor other than 1 is not supported "
                            "(rotary positions over part of each head)")
    rp.setdefault("rope_type", rp.get("type", "default"))
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if rp["rope_type"] == "llama3":
        rp.setdefault("original_max_position_embeddings",
                      cfg.get("original_max_position_embeddings",
                              cfg.get("max_position_embeddings")))
    out = {k: rp[k] for k in _ROPE_KEYS if rp.get(k) is not None}
    out["rope_theta"] = float(out["rope_theta"])
    return tuple(sorted(out.items()))


def _llama_spec(cfg: dict, name: str, source_dir: Path | None) -> DecoderSpec:
    """A llama-family spec from a llama, qwen2 or mistral config.json."""
    mt = cfg["model_type"]
    heads = int(cfg["num_attention_heads"])
    act = str(cfg.get("hidden_act", "silu"))
    if act not in _ACT_NAMES:
        raise InvalidConfig(f"config.json hidden_act {act!r} is not one of {sorted(_ACT_NAMES)}")
    window = 0
    if mt == "qwen2":
        layers = cfg.get("layer_types") or ()
        sliding = cfg.get("use_sliding_window") or "sliding_attention" in layers
        if sliding:
            raise InvalidConfig("Qwen2 with use_sliding_window (sliding-window attention on some "
                                "layers) is not supported")
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif mt == "mistral":
        qkv_bias = out_bias = mlp_bias = False
        window = int(cfg.get("sliding_window") or 0)
    else:
        qkv_bias = out_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    return DecoderSpec(
        "llama", int(cfg["vocab_size"]), int(cfg["hidden_size"]), heads,
        int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]),
        max_position=int(cfg.get("max_position_embeddings", 2048)), act=_ACT_NAMES[act],
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_lm_head=bool(cfg.get("tie_word_embeddings", False)),
        pad_token_id=cfg.get("pad_token_id"), kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_size=int(cfg.get("head_dim") or 0), rope=_rope_of(cfg), qkv_bias=qkv_bias,
        out_bias=out_bias, mlp_bias=mlp_bias, sliding_window=window, model_type=mt, name=name,
        source_dir=source_dir)


def llama_hf_config(spec: DecoderSpec) -> dict:
    """A config.json dict of a llama-family spec, for its ``model_type``."""
    rp = spec.rope_params
    cfg = dict(model_type=spec.model_type or "llama", vocab_size=spec.vocab_size,
               hidden_size=spec.hidden, intermediate_size=spec.ffn,
               num_hidden_layers=spec.dec_layers, num_attention_heads=spec.heads,
               num_key_value_heads=spec.kv_heads_n, head_dim=spec.head_dim,
               hidden_act={"gelu_new": "gelu_pytorch_tanh"}.get(spec.act, spec.act),
               max_position_embeddings=spec.max_position, rms_norm_eps=spec.eps,
               tie_word_embeddings=spec.tied_lm_head, pad_token_id=spec.pad_token_id,
               rope_parameters=rp, rope_theta=rp["rope_theta"], attention_dropout=0.0)
    if cfg["model_type"] == "llama":
        if spec.qkv_bias != spec.out_bias:
            raise InvalidConfig("a llama config has one attention_bias for Q/K/V and the output")
        cfg.update(attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)
    elif cfg["model_type"] == "mistral":
        cfg["sliding_window"] = spec.sliding_window or None
    return cfg


def spec_from_hf_config(cfg: dict, name: str = "custom",
                        source_dir: Path | None = None) -> DecoderSpec:
    """A spec from a Hugging Face config.json dict (model_type gpt2, bart, marian, or llama,
    qwen2, mistral: the llama family)."""
    family = cfg.get("model_type")
    if family not in FAMILIES[:3] + LLAMA_TYPES:
        raise InvalidConfig(f"model_type {family!r} is not a served decoder "
                            f"({', '.join(FAMILIES[:3] + LLAMA_TYPES)})")
    with config_errors(family):
        if family in LLAMA_TYPES:
            return _llama_spec(cfg, name, source_dir)
        if family == "gpt2":
            H = int(_get(cfg, "n_embd", "hidden_size"))
            act = str(cfg.get("activation_function", "gelu_new"))
            if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
                raise InvalidConfig("GPT-2 with scale_attn_by_inverse_layer_idx or "
                                    "reorder_and_upcast_attn is not supported")
            if cfg.get("scale_attn_weights") is False:
                raise InvalidConfig("GPT-2 with scale_attn_weights false is not supported")
            return DecoderSpec(
                "gpt2",
                int(cfg["vocab_size"]),
                H,
                int(_get(cfg, "n_head", "num_attention_heads")),
                int(_get(cfg, "n_inner", default=4 * H)),
                int(_get(cfg, "n_layer", "num_hidden_layers")),
                max_position=int(_get(cfg, "n_positions", "max_position_embeddings", default=1024)),
                act=_ACT_NAMES.get(act, act),
                eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                tied_lm_head=bool(cfg.get("tie_word_embeddings", True)),
                pad_token_id=cfg.get("pad_token_id"),
                name=name,
                source_dir=source_dir,
            )
        if family == "bart" and (cfg.get("add_final_layer_norm") or cfg.get("normalize_before")):
            raise InvalidConfig(
                "BART with add_final_layer_norm or normalize_before (mBART) is not supported"
            )
        heads = int(cfg["encoder_attention_heads"])
        if (int(cfg["decoder_attention_heads"]) != heads
                or int(cfg["encoder_ffn_dim"]) != int(cfg["decoder_ffn_dim"])):
            raise InvalidConfig(
                "encoder and decoder with different head counts or FFN widths are not supported"
            )
        dec_vocab = cfg.get("decoder_vocab_size")
        if dec_vocab is not None and int(dec_vocab) != int(cfg["vocab_size"]):
            raise InvalidConfig("a decoder_vocab_size other than vocab_size is not supported")
        act = str(cfg.get("activation_function", "gelu"))
        return DecoderSpec(
            family,
            int(cfg["vocab_size"]),
            int(cfg["d_model"]),
            heads,
            int(cfg["encoder_ffn_dim"]),
            int(cfg["decoder_layers"]),
            int(cfg["encoder_layers"]),
            max_position=int(cfg.get("max_position_embeddings", 1024)),
            act=_ACT_NAMES.get(act, act),
            eps=1e-5,
            scale_embedding=bool(cfg.get("scale_embedding", False)),
            tied_lm_head=bool(cfg.get("tie_word_embeddings", True)),
            pad_token_id=cfg.get("pad_token_id"),
            name=name,
            source_dir=source_dir,
        )


def load_decoder_spec(backbone: str | os.PathLike | DecoderSpec) -> DecoderSpec:
    """A DecoderSpec, a preset name, a config.json or a checkpoint directory holding one."""
    if isinstance(backbone, DecoderSpec):
        return backbone
    text = str(backbone)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise InvalidConfig(f"backbone {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                            "nor an existing config.json or checkpoint directory")
    return spec_from_hf_config(read_config_json(cfg_path), cfg_path.parent.name, cfg_path.parent)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


#: generate() settings that change every request's scores and that itif does not apply, with
#: the values that leave them off: a checkpoint with another value is refused (its answers
#: would differ from generate()'s) rather than served differently.
_NOT_APPLIED: dict[str, tuple] = {
    "repetition_penalty": (None, 1, 1.0), "encoder_repetition_penalty": (None, 1, 1.0),
    "begin_suppress_tokens": (None, [], ()), "sequence_bias": (None, {}, []),
    "exponential_decay_length_penalty": (None,), "encoder_no_repeat_ngram_size": (None, 0),
    "forced_decoder_ids": (None, [], ()), "renormalize_logits": (None, False),
    "typical_p": (None, 1, 1.0), "epsilon_cutoff": (None, 0, 0.0), "eta_cutoff": (None, 0, 0.0),
    "min_p": (None,), "guidance_scale": (None, 1, 1.0),
}


def defaults_from_config(cfg: dict, gen: dict | None = None) -> GenerationDefaults:
    """GenerationDefaults as ``generate()`` reads them: ``generation_config.json`` when the
    checkpoint has one, else the generation keys of ``config.json``."""
    src = gen if gen is not None else cfg

    def opt(key):
        v = src.get(key)
        return None if v is None else int(v)

    for key, neutral in _NOT_APPLIED.items():
        if src.get(key) not in neutral:
            raise InvalidConfig(
                f"generation setting {key}={src[key]!r} is not applied by itif (generate() would "
                f"apply it to every request); remove it from the checkpoint's "
                f"{'generation_config.json' if gen is not None else 'config.json'}")
    if int(src.get("num_beam_groups") or 1) > 1:
        raise InvalidConfig("generation setting num_beam_groups > 1 (diverse beam search) is "
                            "not applied by itif; remove it from the checkpoint")
    bad = src.get("bad_words_ids") or ()
    return GenerationDefaults(
        eos_token_ids=_ids(src.get("eos_token_id")),
        pad_token_id=opt("pad_token_id"),
        bos_token_id=opt("bos_token_id"),
        decoder_start_token_id=opt("decoder_start_token_id"),
        forced_bos_token_id=opt("forced_bos_token_id"),
        forced_eos_token_id=opt("forced_eos_token_id"),
        bad_words_ids=tuple(tuple(int(t) for t in w) for w in bad),
        min_length=int(src.get("min_length") or 0),
        min_new_tokens=int(src.get("min_new_tokens") or 0),
        suppress_tokens=tuple(int(t) for t in src.get("suppress_tokens") or ()),
    )


def defaults_from_dir(path: str | os.PathLike) -> GenerationDefaults | None:
    """A checkpoint directory's generation settings, or None when it has no config at all."""
    p = Path(path)
    cfg_path, gen_path = p / "config.json", p / "generation_config.json"
    if not cfg_path.is_file() and not gen_path.is_file():
        return None
    cfg = read_config_json(cfg_path) if cfg_path.is_file() else {}
    gen = read_config_json(gen_path) if gen_path.is_file() else None
    return defaults_from_config(cfg, gen)


__all__ = ["DecoderSpec", "FAMILIES", "LLAMA_TYPES", "PRESETS", "PRESET_DEFAULTS",
           "defaults_from_config", "defaults_from_dir", "llama_hf_config", "load_decoder_spec",
           "spec_from_hf_config"]
