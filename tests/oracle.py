"""The correctness oracle: Hugging Face's own model with the tenant's own weights, per request."""

from __future__ import annotations

import numpy as np
import torch
import transformers as T

import itif

_CLASSES = {
    "bert": (T.BertConfig, T.BertForSequenceClassification, T.BertModel),
    "albert": (T.AlbertConfig, T.AlbertForSequenceClassification, T.AlbertModel),
    "vit": (T.ViTConfig, T.ViTForImageClassification, T.ViTModel),
}


def make_hf_model(preset: str, num_labels: int | None = 3, seed: int = 0, base_of=None):
    """A random HF model for a preset; LayerNorms and biases are randomised too (HF initialises
    them to 1/0, which would hide a tenant reading another tenant's LayerNorm).

    ``base_of``: copy every backbone weight from that model (tenants identical but for the head).
    """
    spec = itif.load_spec(preset)
    cfg_cls, head_cls, base_cls = _CLASSES[spec.family]
    cfg = cfg_cls(**spec.hf_config(num_labels=num_labels or 2))
    torch.manual_seed(seed)
    model = (head_cls if num_labels else base_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        if base_of is not None:
            src = base_of.state_dict()
            for name, p in model.state_dict().items():
                if not name.startswith("classifier") and name in src:
                    p.copy_(src[name])
    return model


@torch.no_grad()
def reference(model, request: itif.Request) -> dict[str, np.ndarray]:
    """HF outputs for one request run alone (batch of one, no padding)."""
    if request.pixel_values is not None:
        kwargs = dict(pixel_values=torch.as_tensor(np.asarray(request.pixel_values))[None])
    else:
        kwargs = dict(input_ids=torch.as_tensor(np.asarray(request.input_ids), dtype=torch.long)[None])
        if request.token_type_ids is not None:
            kwargs["token_type_ids"] = torch.as_tensor(
                np.asarray(request.token_type_ids), dtype=torch.long)[None]
    out = model(**kwargs, output_hidden_states=True)
    res = {}
    if hasattr(out, "logits"):
        res["logits"] = out.logits[0].numpy()
        # Heads' models return the encoder's final hidden state through hidden_states; ViT
        # applies its final LayerNorm after the last block, so ask the base model for that.
        base = getattr(model, model.base_model_prefix)
        base_out = base(**kwargs)
        res["last_hidden_state"] = base_out.last_hidden_state[0].numpy()
        if getattr(base_out, "pooler_output", None) is not None:
            res["pooled"] = base_out.pooler_output[0].numpy()
    else:
        res["last_hidden_state"] = out.last_hidden_state[0].numpy()
        if out.pooler_output is not None:
            res["pooled"] = out.pooler_output[0].numpy()
    return res


def max_diff(result: itif.Result, ref: dict[str, np.ndarray]) -> float:
    """Largest abs difference over the outputs both sides have; asserts the result has them."""
    worst = 0.0
    for name, value in result.as_dict().items():
        if name not in ref:
            continue
        assert value.shape == ref[name].shape, (name, value.shape, ref[name].shape)
        worst = max(worst, float(np.abs(value - ref[name]).max()))
    return worst


def random_request(spec, tenant: str, rng: np.random.Generator, length: int | None = None,
                   outputs=("logits", "last_hidden_state")) -> itif.Request:
    if spec.family == "vit":
        px = rng.standard_normal((spec.num_channels, spec.image_size, spec.image_size))
        return itif.Request(tenant=tenant, pixel_values=px.astype(np.float32), outputs=outputs)
    n = int(length if length is not None else rng.integers(1, spec.max_position + 1))
    ids = rng.integers(0, spec.vocab_size, n)
    types = rng.integers(0, spec.type_vocab_size, n) if rng.random() < 0.5 else None
    return itif.Request(tenant=tenant, input_ids=ids, token_type_ids=types, outputs=outputs)
