"""Import GPT-2, BART, Marian and llama-family (Llama, Qwen2, Mistral) Hugging Face checkpoints
onto a DecoderSpec's canonical table.

Accepted: a safetensors file, a checkpoint directory, or a dict of tensors with Hugging Face
names (``GPT2LMHeadModel`` / ``GPT2Model``, ``BartForConditionalGeneration`` / ``BartModel``,
``MarianMTModel``, ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` and
their bare models; with or without the ``transformer.`` / ``model.`` prefix). GPT-2's
``Conv1D`` weights ([in, out]) are transposed to ``[out, in]``. Tied tensors are read once:
the encoder's and decoder's word embeddings and the LM head all become ``emb.word`` (a separate
``lm_head.weight`` only where the spec says it is not tied); Marian's sinusoidal position tables
(buffers) are skipped, as are the llama family's ``rotary_emb.inv_freq`` buffers of older
checkpoints (itif computes the frequencies from the config). The llama family's Q, K and V
projections become one ``qkv`` (rows: Q, then K, then V), its gate and up projections one
``gate_up`` (gate rows first). A checkpoint that does not fit raises ``InvalidWeights`` naming
the tensor.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from itif.backbones.hf import CanonicalWeights, read_checkpoint
from itif.errors import InvalidWeights
from itif.generation.spec import DecoderSpec

_IGNORED = ("attn.bias", "attn.masked_bias", "position_ids")
_LLAMA_IGNORED = ("rotary_emb.inv_freq",)


def _gpt2_sources(spec: DecoderSpec) -> dict[str, tuple[tuple[str, ...], Callable]]:
    t = lambda ts: ts[0].t()  # noqa: E731  (Conv1D stores [in, out])
    one = lambda ts: ts[0]  # noqa: E731
    out = {"emb.word": (("wte.weight",), one), "emb.pos": (("wpe.weight",), one),
           "final_ln.weight": (("ln_f.weight",), one), "final_ln.bias": (("ln_f.bias",), one)}
    for i in range(spec.dec_layers):
        h, p = f"h.{i}.", f"dec.{i}."
        for canon, hf, conv in (("ln1", "ln_1", False), ("ln2", "ln_2", False),
                                ("qkv", "attn.c_attn", True), ("attn_out", "attn.c_proj", True),
                                ("ffn_in", "mlp.c_fc", True),
                                ("ffn_out", "mlp.c_proj", True)):
            out[p + canon + ".weight"] = ((h + hf + ".weight",), t if conv else one)
            out[p + canon + ".bias"] = ((h + hf + ".bias",), one)
    return out


def _llama_sources(spec: DecoderSpec) -> dict[str, tuple[tuple[str, ...], Callable]]:
    one = lambda ts: ts[0]  # noqa: E731
    cat = lambda ts: torch.cat(ts, 0)  # noqa: E731
    out = {"final_ln.weight": (("norm.weight",), one)}
    have = {n for n, _ in spec.params()}
    for i in range(spec.dec_layers):
        h, p = f"layers.{i}.", f"dec.{i}."
        sa, mlp = h + "self_attn.", h + "mlp."
        out[p + "ln1.weight"] = ((h + "input_layernorm.weight",), one)
        out[p + "ln2.weight"] = ((h + "post_attention_layernorm.weight",), one)
        for suf in ("weight", "bias"):
            parts = {"qkv": (tuple(sa + f"{x}_proj.{suf}" for x in "qkv"), cat),
                     "attn_out": ((sa + f"o_proj.{suf}",), one),
                     "gate_up": ((mlp + f"gate_proj.{suf}", mlp + f"up_proj.{suf}"), cat),
                     "ffn_out": ((mlp + f"down_proj.{suf}",), one)}
            for canon, src in parts.items():
                if f"{p}{canon}.{suf}" in have:
                    out[f"{p}{canon}.{suf}"] = src
    return out


def _seq2seq_sources(spec: DecoderSpec) -> dict[str, tuple[tuple[str, ...], Callable]]:
    one = lambda ts: ts[0]  # noqa: E731
    cat = lambda ts: torch.cat(ts, 0)  # noqa: E731
    out: dict[str, tuple[tuple[str, ...], Callable]] = {
        "final_logits_bias": (("final_logits_bias",), lambda ts: ts[0].reshape(-1))}
    if spec.family == "bart":
        for side in ("encoder", "decoder"):
            s = side[:3]
            out[f"{s}.emb.pos"] = ((f"{side}.embed_positions.weight",), one)
            out[f"{s}.emb.ln.weight"] = ((f"{side}.layernorm_embedding.weight",), one)
            out[f"{s}.emb.ln.bias"] = ((f"{side}.layernorm_embedding.bias",), one)

    for side, n in (("encoder", spec.enc_layers), ("decoder", spec.dec_layers)):
        for i in range(n):
            h, p = f"{side}.layers.{i}.", f"{side[:3]}.{i}."
            sa = h + "self_attn."
            for suf in ("weight", "bias"):
                out[p + "qkv." + suf] = (tuple(sa + f"{x}_proj.{suf}" for x in "qkv"), cat)
                out[p + "attn_out." + suf] = ((sa + "out_proj." + suf,), one)
                out[p + "ln1." + suf] = ((h + "self_attn_layer_norm." + suf,), one)
                out[p + "ffn_in." + suf] = ((h + "fc1." + suf,), one)
                out[p + "ffn_out." + suf] = ((h + "fc2." + suf,), one)
                out[p + "ln2." + suf] = ((h + "final_layer_norm." + suf,), one)
                if side == "decoder":
                    ca = h + "encoder_attn."
                    out[p + "cross_q." + suf] = ((ca + "q_proj." + suf,), one)
                    out[p + "cross_kv." + suf] = ((ca + "k_proj." + suf, ca + "v_proj." + suf), cat)
                    out[p + "cross_out." + suf] = ((ca + "out_proj." + suf,), one)
                    out[p + "ln_cross." + suf] = ((h + "encoder_attn_layer_norm." + suf,), one)
    return out


def _strip(src: Mapping[str, torch.Tensor], spec: DecoderSpec) -> dict[str, torch.Tensor]:
    prefix = "transformer." if spec.family == "gpt2" else "model."
    out = {}
    for k, v in src.items():
        if not isinstance(v, torch.Tensor):
            raise InvalidWeights(f"entry {k!r} is not a tensor")
        out[k[len(prefix):] if k.startswith(prefix) else k] = v
    return out


def to_canonical(spec: DecoderSpec, src: Mapping[str, torch.Tensor]) -> CanonicalWeights:
    """Map one checkpoint's tensors onto ``spec``'s canonical table (float32, contiguous, CPU)."""
    src = _strip(src, spec)
    table = (_gpt2_sources(spec) if spec.family == "gpt2" else
             _llama_sources(spec) if spec.family == "llama" else _seq2seq_sources(spec))
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    # Word embeddings: every tied copy must be the same tensor; the first present one is read.
    emb_names = (("wte.weight", "lm_head.weight") if spec.family == "gpt2" else
                 ("embed_tokens.weight", "lm_head.weight") if spec.family == "llama" else
                 ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                  "lm_head.weight"))
    if not spec.tied_lm_head:
        emb_names = emb_names[:-1]
        table["lm_head.weight"] = (("lm_head.weight",), lambda ts: ts[0])
    present = [n for n in emb_names if n in src]
    if not present:
        raise InvalidWeights(f"missing tensor {emb_names[0]!r} (the word embeddings)")
    word = src[present[0]]
    for n in present[1:]:
        if tuple(src[n].shape) != tuple(word.shape) or not torch.equal(src[n].float(),
                                                                       word.float()):
            raise InvalidWeights(f"tensor {n!r} differs from {present[0]!r}; the {spec.family} "
                                 f"backbone {spec.name!r} ties them (tie_word_embeddings)")
    used.update(present)
    table = {k: v for k, v in table.items() if k != "emb.word"}
    out["emb.word"] = word
    for canon, (names, combine) in table.items():
        parts = []
        for n in names:
            if n not in src:
                raise InvalidWeights(
                    f"missing tensor {n!r} (canonical {canon!r}) of the {spec.family} "
                    f"backbone {spec.name!r}"
                )
            t = src[n]
            if not t.is_floating_point():
                raise InvalidWeights(f"tensor {n!r} has dtype {t.dtype}; expected a float type")
            parts.append(t)
            used.add(n)
        out[canon] = combine(parts)
    for n in src:
        if (n.endswith(_IGNORED)
                or (spec.family == "marian" and n.endswith("embed_positions.weight"))
                or (spec.family == "llama" and n.endswith(_LLAMA_IGNORED))):
            used.add(n)
    extra = [n for n in src if n not in used]
    if extra:
        raise InvalidWeights(
            f"unexpected tensor {extra[0]!r}: not part of the {spec.family} backbone "
            f"{spec.name!r}" + (f", and {len(extra) - 1} more" if len(extra) > 1 else "")
        )
    canon: dict[str, torch.Tensor] = {}
    for name, shape in spec.params():
        t = out[name]
        if tuple(t.shape) != shape:
            raise InvalidWeights(f"tensor {name!r} has shape {list(t.shape)}; the {spec.family} "
                                 f"backbone {spec.name!r} expects {list(shape)}")
        t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if not torch.isfinite(t).all():
            raise InvalidWeights(f"tensor {name!r} has non-finite values (NaN/Inf)")
        canon[name] = t
    return CanonicalWeights(canon, None, False)


def load_decoder_weights(spec: DecoderSpec, source) -> CanonicalWeights:
    """Canonical weights from a safetensors file, a checkpoint directory or a dict of tensors."""
    if isinstance(source, CanonicalWeights):
        return source
    if isinstance(source, Mapping):
        return to_canonical(spec, source)
    return to_canonical(spec, read_checkpoint(source))


__all__ = ["load_decoder_weights", "to_canonical"]
