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
        kwargs = dict(
            input_ids=torch.as_tensor(np.asarray(request.input_ids), dtype=torch.long)[None]
        )
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


# ---- reduced precision (tests/test_engine_dtypes.py) -----------------------------------------
@torch.no_grad()
def reference_on_device(model, request: itif.Request) -> dict[str, np.ndarray]:
    """``reference`` with the inputs on the model's device (HF float32 on the GPU, say)."""
    dev = next(model.parameters()).device
    if request.pixel_values is not None:
        kwargs = dict(pixel_values=torch.as_tensor(np.asarray(request.pixel_values))[None].to(dev))
    else:
        kwargs = dict(input_ids=torch.as_tensor(np.asarray(request.input_ids), dtype=torch.long,
                                                device=dev)[None])
        if request.token_type_ids is not None:
            kwargs["token_type_ids"] = torch.as_tensor(
                np.asarray(request.token_type_ids), dtype=torch.long, device=dev)[None]
    np_ = lambda t: t[0].float().cpu().numpy()  # noqa: E731
    res = {}
    base = getattr(model, model.base_model_prefix, model)
    if hasattr(model, "classifier"):
        res["logits"] = np_(model(**kwargs).logits)
    base_out = base(**kwargs)
    res["last_hidden_state"] = np_(base_out.last_hidden_state)
    if getattr(base_out, "pooler_output", None) is not None:
        res["pooled"] = np_(base_out.pooler_output)
    return res


def rel_norm(value: np.ndarray, ref: np.ndarray) -> float:
    """||value - ref|| / ||ref|| (Frobenius)."""
    return float(np.linalg.norm(value - ref) / max(np.linalg.norm(ref), 1e-30))


def logit_scale(model, ref: dict[str, np.ndarray]) -> np.ndarray:
    """Per label, ``||W_j|| * ||h|| + |b_j|``: what logit j's error is relative to.

    A logit is a dot product ``w_j . h + b_j`` that often cancels to near zero, so its error
    is not proportional to its own size: a relative error ``r`` in the head's input ``h``
    (pooled for text, the final CLS state for ViT) and weights moves it by up to
    ``r * (||w_j|| ||h|| + |b_j|)`` (Cauchy-Schwarz).
    """
    h = ref["pooled"] if "pooled" in ref else ref["last_hidden_state"][0]
    w = model.classifier.weight.detach().float().cpu().numpy()
    b = model.classifier.bias.detach().float().cpu().numpy()
    return np.linalg.norm(w, axis=1) * float(np.linalg.norm(h)) + np.abs(b)


def precision_errors(result: itif.Result, ref: dict[str, np.ndarray], model) -> dict[str, dict]:
    """Error figures of one request's outputs against its reference, per output:
    ``rel`` (relative norm), ``row_rel`` (worst token row's relative norm, last_hidden_state),
    ``abs`` (max abs), ``abs_scaled`` (max abs / max |ref|; for logits, max over labels of
    abs error / ``logit_scale``)."""
    out = {}
    for name, value in result.as_dict().items():
        if name not in ref:
            continue
        r = ref[name]
        assert value.shape == r.shape, (name, value.shape, r.shape)
        err = np.abs(value - r)
        e = dict(rel=rel_norm(value, r), abs=float(err.max()))
        if name == "logits":
            e["abs_scaled"] = float((err / logit_scale(model, ref)).max())
        else:
            e["abs_scaled"] = float(err.max() / max(np.abs(r).max(), 1e-30))
        if name == "last_hidden_state":
            e["row_rel"] = float((np.linalg.norm(value - r, axis=-1)
                                  / np.maximum(np.linalg.norm(r, axis=-1), 1e-30)).max())
        out[name] = e
    return out
