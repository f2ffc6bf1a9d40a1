"""Random Hugging Face decoders for the gpt2, bart and marian DecoderSpec presets: the models the
generation tests check GenEngine against (``tests.oracle`` has the encoders')."""

from __future__ import annotations

import torch

#: The end token of each family's test models (GPT-2's is 0 here: its tiny vocabulary has no
#: 50256); bart and marian force it at the last step, as their checkpoints do.
EOS = {"gpt2": 0, "bart": 2, "marian": 0}


def hf_decoder(spec, seed: int, init_std: float | None = None):
    """``spec``'s family's Hugging Face model, random weights drawn after
    ``torch.manual_seed(seed)`` (``init_std``: their scale, transformers' default when None),
    with the family's ids: begin 0 (gpt2, bart), end :data:`EOS`, bart's decoder start 2,
    marian's the pad token. The caller perturbs it further (biases, EOS) as its test needs."""
    from transformers import (  # noqa: PLC0415 - transformers on demand
        BartConfig,
        BartForConditionalGeneration,
        GPT2Config,
        GPT2LMHeadModel,
        MarianConfig,
        MarianMTModel,
    )

    torch.manual_seed(seed)
    cfg = spec.hf_config()
    eos = EOS[spec.family]
    if spec.family == "gpt2":
        init = {} if init_std is None else {"initializer_range": init_std}
        return GPT2LMHeadModel(GPT2Config(**cfg, bos_token_id=eos, eos_token_id=eos, **init))
    init = {} if init_std is None else {"init_std": init_std}
    if spec.family == "bart":
        return BartForConditionalGeneration(BartConfig(
            **cfg, bos_token_id=0, eos_token_id=eos, decoder_start_token_id=2,
            forced_eos_token_id=eos, **init))
    return MarianMTModel(MarianConfig(
        **cfg, eos_token_id=eos, decoder_start_token_id=spec.pad_token_id,
        forced_eos_token_id=eos, **init))
