"""LoRA tenants: a PEFT adapter on a base tenant, mapped onto the canonical parameter table.

A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as
``PeftModel.save_pretrained`` writes them) changes a linear layer ``y = x W^T + b`` into
``y = x W^T + b + s (x A^T) B^T`` with ``A [r, in]``, ``B [out, r]`` and the scale
``s = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). A LoRA tenant reads every weight of
its base tenant where they are (the store shares the slots, nothing is copied) and owns:

* per adapted encoder linear, canonical ``layers.{i}.{kind}.lora_a`` ``[R, in]`` and
  ``layers.{i}.{kind}.lora_b`` ``[out, R]`` with ``s`` folded into ``B``. The query, key and
  value adapters of a layer become one pair for the fused ``qkv`` product: ``A`` stacks the
  adapted parts' ``A`` (``R`` = the sum of their ranks) and ``B`` is block-diagonal (a part that
  is not adapted has no rows in ``A`` and zero blocks in ``B``). The forward runs the base GEMM
  once for every tenant on it, then one grouped low-rank product per adapter shape over the rows
  of the tenants that have one (``itif.runtime.lora``).
* the heads it saves (``modules_to_save``: the classifier, the pooler), and heads with LoRA on
  them, merged into its own copy (``W + s B A``): heads are per tenant anyway.

Refused with ``InvalidWeights`` naming the field: DoRA, LoRA biases, trained biases
(``bias != "none"``), ``fan_in_fan_out``, adapters of modules outside the encoder's linears and
heads, ranks over :data:`MAX_RANK`, and any tensor the backbone has no place for.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Mapping

import regex
import torch

from itif.backbones.hf import CanonicalWeights, _layer_sources
from itif.backbones.spec import BackboneSpec
from itif.errors import InvalidWeights
from itif.weights.safetensors_io import load_safetensors, read_metadata, save_safetensors

__all__ = ["CONFIG_KEY", "MAX_RANK", "LINEAR_KINDS", "load_lora", "pack_adapter", "read_adapter"]

MAX_RANK = 64
#: safetensors metadata key of a packed adapter's adapter_config.json
CONFIG_KEY = "itif.adapter_config"
LINEAR_KINDS = ("qkv", "attn_out", "ffn_in", "ffn_out")
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
#: seconds all of an adapter's ``alpha_pattern`` regexes may take to match its module names: a
#: regex that backtracks for ever is refused (``re`` would have held the GIL, so every thread of
#: the daemon, for as long as it ran)
PATTERN_BUDGET_S = 1.0


def pack_adapter(adapter_dir: str | Path, out: str | Path) -> Path:
    """One safetensors file holding a PEFT adapter directory: its tensors, and its
    ``adapter_config.json`` in the metadata under :data:`CONFIG_KEY`. This is what a LoRA
    tenant uploads (``itif upload --adapter DIR``) and what the daemon stores."""
    config, tensors = read_adapter(adapter_dir)
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, out,
                     metadata={CONFIG_KEY: json.dumps(config, sort_keys=True)})
    return Path(out)


def read_adapter(source: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config as a dict, the adapter's tensors) of a PEFT adapter directory or of a
    file :func:`pack_adapter` wrote."""
    path = Path(source)
    if path.is_file():
        raw = read_metadata(path).get(CONFIG_KEY)
        if raw is None:
            raise InvalidWeights(f"{path.name!r} is not a LoRA adapter: its safetensors metadata "
                                 f"has no {CONFIG_KEY!r} (pack one with `itif upload --adapter`)")
        try:
            config = json.loads(raw)
        except ValueError as e:
            raise InvalidWeights(f"{path.name!r}: {CONFIG_KEY} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise InvalidWeights(f"{path.name!r}: {CONFIG_KEY} is not a JSON object")
        return config, load_safetensors(path)
    cfg_path, w_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise InvalidWeights(f"{str(path)!r} is not a PEFT adapter directory: it needs "
                             "adapter_config.json and adapter_model.safetensors")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidWeights(f"{str(cfg_path)!r}: {e}") from None
    if not isinstance(config, dict):
        raise InvalidWeights(f"{str(cfg_path)!r} is not a JSON object")
    return config, load_safetensors(w_path)


def _check_config(config: Mapping[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidWeights(f"adapter peft_type {config.get('peft_type')!r}: only LORA is served")
    for key, ok in (("use_dora", False), ("lora_bias", False), ("fan_in_fan_out", False)):
        if bool(config.get(key, ok)) != ok:
            raise InvalidWeights(f"adapter_config {key}={config.get(key)!r} is not supported")
    if config.get("bias", "none") != "none":
        raise InvalidWeights(f"adapter_config bias={config.get('bias')!r}: trained biases are "
                             "not supported (use bias='none')")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        raise InvalidWeights(f"adapter_config r={r!r}: must be an int in [1, {MAX_RANK}]")
    if not isinstance(config.get("alpha_pattern") or {}, dict):
        raise InvalidWeights("adapter_config alpha_pattern must be an object: regex -> alpha")


def _pattern(patterns: Mapping[str, Any], module: str, default, deadline: float):
    """PEFT's per-module override (``peft.utils.other.get_pattern_key``): the value of the first
    key, a regex, that matches the whole of the module's name or a tail of it starting after a
    dot. ``module`` is the name PEFT matched: the full module name in the model it adapted
    (``bert.encoder.layer.0.attention.self.query``), so ``query``, ``layer.0.attention.self.query``
    and that full name all select it. Matched with the ``regex`` package (``re``'s syntax) so
    that the patterns share a time budget ending at ``deadline`` (``time.monotonic``)."""
    for key, value in (patterns or {}).items():
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            if regex.match(rf"(.*\.)?({key})$", module, timeout=left):
                return value
        except regex.error as e:
            raise InvalidWeights(f"adapter_config pattern {key!r} is not a regex: {e}") from None
        except TimeoutError:
            raise InvalidWeights(
                f"adapter_config alpha_pattern takes over {PATTERN_BUDGET_S:g} s to match the "
                f"module names (stopped at {key[:80]!r}): use simpler regexes") from None
    return default


def _scale(config: Mapping[str, Any], module: str, rank: int, deadline: float) -> float:
    alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8), deadline)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidWeights(f"adapter lora_alpha {alpha!r} for {module!r} is not a number")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _module_map(spec: BackboneSpec, scheme: str) -> dict[str, tuple[str, int]]:
    """Hugging Face module name -> (canonical linear of a layer set, part: 0-2 of qkv, else 0)."""
    out: dict[str, tuple[str, int]] = {}
    for i in range(spec.num_param_layers):
        src = _layer_sources(spec, i, scheme)
        for kind in LINEAR_KINDS:
            for part, name in enumerate(src[f"{kind}.weight"]):
                out[name.removesuffix(".weight")] = (f"layers.{i}.{kind}", part)
    return out


def load_lora(spec: BackboneSpec, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
              base_heads: Mapping[str, torch.Tensor]) -> CanonicalWeights:
    """The tensors a LoRA tenant owns (module docstring), ready for ``WeightStore.add`` with
    ``base=``. ``base_heads``: the base tenant's ``pooler.*`` / ``head.*`` tensors (float32)."""
    _check_config(config)
    deadline = time.monotonic() + PATTERN_BUDGET_S
    family = spec.family + "."
    src: dict[str, torch.Tensor] = {}
    peft_names: dict[str, str] = {}  # key of src -> the module name PEFT matched patterns with
    for name, t in tensors.items():
        full = name.removeprefix(_PREFIX)
        full = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", full)  # ".default" names
        key = full.removeprefix(family)
        peft_names[key] = full
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InvalidWeights(f"adapter tensor {name!r} is not a float tensor")
        if not torch.isfinite(t).all():
            raise InvalidWeights(f"adapter tensor {name!r} holds non-finite values")
        src[key] = t.detach().to(torch.float32)
    scheme = "v5" if spec.family == "vit" and any(k.startswith("layers.") for k in src) else "hub"
    modules = _module_map(spec, scheme)
    heads = {"pooler.dense" if spec.family != "albert" else "pooler": "pooler",
             "classifier": "head"}
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    owned: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key in sorted(k for k in src if k.endswith(_A)):
        module = key.removesuffix(_A)
        a, b = src[key], src.get(module + _B)
        if b is None:
            raise InvalidWeights(f"adapter has {module + _A!r} without {module + _B!r}")
        used.update((key, module + _B))
        rank = a.shape[0] if a.dim() == 2 else 0
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or not 1 <= rank <= MAX_RANK:
            raise InvalidWeights(f"adapter {module!r}: lora_A {list(a.shape)} and lora_B "
                                 f"{list(b.shape)} do not form a rank-r pair (r <= {MAX_RANK})")
        s = _scale(config, peft_names[key].removesuffix(_A), rank, deadline)
        if module in modules:
            canon, part = modules[module]
            parts.setdefault(canon, {})[part] = (a, b * s)
        elif module in heads:
            owned[f"{heads[module]}.lora"] = (a, b * s)  # merged below
        else:
            raise InvalidWeights(f"adapter module {module!r} is not an encoder linear or a head "
                                 f"of the {spec.family} backbone {spec.name!r}")
    for head, canon in heads.items():  # modules_to_save copies (a full head of the tenant)
        for suffix in ("weight", "bias"):
            if f"{head}.{suffix}" in src:
                owned[f"{canon}.{suffix}"] = src[f"{head}.{suffix}"]
                used.add(f"{head}.{suffix}")
    extra = sorted(set(src) - used)
    if extra:
        raise InvalidWeights(f"unexpected adapter tensor {extra[0]!r}: not a LoRA pair of an "
                             f"encoder linear or a saved head ({len(extra)} in all)")
    out: dict[str, torch.Tensor] = {}
    for canon, by_part in parts.items():
        out[canon + ".lora_a"], out[canon + ".lora_b"] = _pack(spec, canon, by_part)
    for canon in ("pooler", "head"):
        pair = owned.pop(f"{canon}.lora", None)
        w = owned.get(f"{canon}.weight", base_heads.get(f"{canon}.weight"))
        bias = owned.get(f"{canon}.bias", base_heads.get(f"{canon}.bias"))
        if pair is not None:
            if w is None:
                raise InvalidWeights(f"adapter has LoRA on the {canon} but the base has none")
            a, b = pair
            if tuple((b @ a).shape) != tuple(w.shape):
                raise InvalidWeights(f"adapter LoRA on the {canon}: {list((b @ a).shape)} does "
                                     f"not fit its weight {list(w.shape)}")
            w = w + b @ a
        if pair is not None or f"{canon}.weight" in owned or f"{canon}.bias" in owned:
            if w is None or bias is None:
                raise InvalidWeights(f"adapter saves part of the {canon} but the base has none")
            _check_head(spec, canon, w, bias)
            out[f"{canon}.weight"], out[f"{canon}.bias"] = w.contiguous(), bias.contiguous()
    labels = out.get("head.weight", base_heads.get("head.weight"))
    return CanonicalWeights(
        {k: v.contiguous() for k, v in out.items()},
        num_labels=None if labels is None else int(labels.shape[0]),
        has_pooler="pooler.weight" in out or "pooler.weight" in base_heads,
    )


def _check_head(spec: BackboneSpec, canon: str, w: torch.Tensor, bias: torch.Tensor) -> None:
    """A saved (or LoRA-merged) pooler or classifier must have the backbone's shapes, its
    bias as many rows as its weight (the store files a tensor by name and shape: any other
    shape would be read from another tenant's slot)."""
    H = spec.hidden
    rows = H if canon == "pooler" else (int(w.shape[0]) if w.dim() == 2 else 0)
    if tuple(w.shape) != (rows, H) or rows < 1 or tuple(bias.shape) != (rows,):
        want = f"[{H}, {H}] and [{H}]" if canon == "pooler" else f"[num_labels, {H}] and [num_labels]"
        raise InvalidWeights(f"adapter's {canon}: weight {list(w.shape)} and bias {list(bias.shape)}"
                             f"; the {spec.family} backbone {spec.name!r} expects {want}")


def _pack(spec: BackboneSpec, canon: str, by_part: dict[int, tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) pair for a canonical linear from its parts' pairs (qkv: up to three)."""
    kind = canon.split(".")[-1]
    H, inner = spec.hidden, spec.intermediate
    fan_in, part_out = {"qkv": (H, H), "attn_out": (H, H), "ffn_in": (H, inner),
                        "ffn_out": (inner, H)}[kind]
    parts = sorted(by_part)
    rank = sum(by_part[p][0].shape[0] for p in parts)
    if rank > MAX_RANK * 3:
        raise InvalidWeights(f"{canon}: total adapter rank {rank} is too large")
    n_out = part_out * (3 if kind == "qkv" else 1)
    a = torch.zeros(rank, fan_in)
    b = torch.zeros(n_out, rank)
    col = 0
    for p in parts:
        pa, pb = by_part[p]
        r = pa.shape[0]
        if pa.shape[1] != fan_in or pb.shape[0] != part_out:
            raise InvalidWeights(f"{canon}: adapter pair {list(pa.shape)} x {list(pb.shape)} "
                                 f"does not fit a [{part_out}, {fan_in}] weight")
        a[col:col + r] = pa
        b[p * part_out:(p + 1) * part_out, col:col + r] = pb
        col += r
    return a, b
