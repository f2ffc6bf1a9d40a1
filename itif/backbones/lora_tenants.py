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
  of the tenants that have one (``itif.runtime.lora_update``).
* the heads it saves (``modules_to_save``: the classifier, the pooler), and heads with LoRA on
  them, merged into its own copy (``W + s B A``): heads are per tenant anyway.

Refused with ``InvalidWeights`` naming the field: DoRA, LoRA biases, trained biases
(``bias != "none"``), ``fan_in_fan_out``, adapters of modules outside the encoder's linears and
heads, ranks over :data:`MAX_RANK`, and any tensor the backbone has no place for. The config
and the tensors are cross-checked as PEFT loads them (:func:`load_lora`): a module's tensors
must have the rank the config gives it (``rank_pattern``, else ``r``) and fit the module, and
``target_modules`` must select a module of the backbone (all of which PEFT refuses too); a
tensor of a module the config does not adapt or save, and a module it adapts without tensors,
are refused as well, since PEFT would leave them unused or at their initial values and itif's
answers would not be PEFT's.
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

from itif.backbones.hf import CanonicalWeights, layer_sources
from itif.backbones.spec import BackboneSpec
from itif.errors import InvalidWeights
from itif.safetensors_io import load_safetensors, read_metadata, save_safetensors

__all__ = [
    "CONFIG_KEY",
    "LINEAR_KINDS",
    "MAX_RANK",
    "PATTERN_BUDGET_S",
    "check_config",
    "load_lora",
    "module_rank",
    "module_scale",
    "pack_adapter",
    "read_adapter",
    "selection_fields",
    "targeted_modules",
]

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


def check_config(config: Mapping[str, Any]) -> None:
    """InvalidWeights naming the field when an adapter_config asks for what itif does not
    serve (DoRA, LoRA biases, trained biases, ...) or holds a field of the wrong type; the
    checks that need the backbone (which modules, ranks of the tensors) come later. Shared by
    the encoder's LoRA tenants and the decoder's (``itif.generation.decoder_lora``)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidWeights(f"adapter peft_type {config.get('peft_type')!r}: only LORA is served")
    for key, ok in (("use_dora", False), ("lora_bias", False), ("fan_in_fan_out", False)):
        if bool(config.get(key, ok)) != ok:
            raise InvalidWeights(f"adapter_config {key}={config.get(key)!r} is not supported")
    for key in ("target_parameters", "layer_replication"):  # LoRA on raw parameters; new layers
        if config.get(key):
            raise InvalidWeights(f"adapter_config {key}={config.get(key)!r} is not supported")
    if config.get("bias", "none") != "none":
        raise InvalidWeights(f"adapter_config bias={config.get('bias')!r}: trained biases are "
                             "not supported (use bias='none')")
    r = config.get("r")
    if not _is_rank(r):
        raise InvalidWeights(f"adapter_config r={r!r}: must be an int in [1, {MAX_RANK}]")
    for key, what in (("alpha_pattern", "alpha"), ("rank_pattern", "rank")):
        if not isinstance(config.get(key) or {}, dict):
            raise InvalidWeights(f"adapter_config {key} must be an object: regex -> {what}")
    for key, rank in (config.get("rank_pattern") or {}).items():
        if not _is_rank(rank):
            raise InvalidWeights(f"adapter_config rank_pattern[{key!r}]={rank!r}: must be an int "
                                 f"in [1, {MAX_RANK}]")
    targets = config.get("target_modules")
    if not isinstance(targets, str) and not _names(targets):
        raise InvalidWeights(f"adapter_config target_modules={targets!r}: must be a regex or a "
                             "non-empty list of module names (PEFT saves the list it adapted)")
    for key in ("exclude_modules", "layers_pattern", "modules_to_save"):
        value = config.get(key)
        if value is not None and not (isinstance(value, str) and key != "modules_to_save"
                                      or _names(value, empty=True)):
            raise InvalidWeights(f"adapter_config {key}={value!r}: must be a list of names")
    layers = config.get("layers_to_transform")
    if layers is not None and not (_is_int(layers) or isinstance(layers, list)
                                   and all(_is_int(i) for i in layers)):
        raise InvalidWeights(f"adapter_config layers_to_transform={layers!r}: must be a layer "
                             "index or a list of them")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_rank(value) -> bool:
    return _is_int(value) and 1 <= value <= MAX_RANK


def _names(value, empty: bool = False) -> bool:
    return (isinstance(value, list) and (empty or len(value) > 0)
            and all(isinstance(v, str) for v in value))


def _regex(pattern: str, text: str, deadline: float, field: str, shown: str | None = None,
           full: bool = False):
    """``regex.match`` (``fullmatch`` with ``full``) of an adapter_config regex, refused naming
    ``field`` when it is not one or when the adapter's patterns have spent their time budget
    (``deadline``, ``time.monotonic``). ``shown``: the user's part of ``pattern``, for the
    messages. Matched with the ``regex`` package (``re``'s syntax), which can stop a match."""
    shown = pattern if shown is None else shown
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        return (regex.fullmatch if full else regex.match)(pattern, text, timeout=left)
    except regex.error as e:
        raise InvalidWeights(f"adapter_config {field} {shown!r} is not a regex: {e}") from None
    except TimeoutError:
        raise InvalidWeights(
            f"adapter_config {field} takes over {PATTERN_BUDGET_S:g} s to match the module "
            f"names (stopped at {shown[:80]!r}): use simpler regexes") from None


def _pattern(patterns: Mapping[str, Any], module: str, deadline: float, field: str
             ) -> str | None:
    """PEFT's per-module override (``peft.utils.other.get_pattern_key``): the first key, a
    regex, that matches the whole of the module's name or a tail of it starting after a dot;
    None if none does. ``module`` is the name PEFT matched: the full module name in the model
    it adapted (``bert.encoder.layer.0.attention.self.query``), so ``query``,
    ``layer.0.attention.self.query`` and that full name all select it."""
    for key in patterns or {}:
        if _regex(rf"(.*\.)?({key})$", module, deadline, field, shown=key):
            return key
    return None


def module_scale(config: Mapping[str, Any], module: str, rank: int, deadline: float) -> float:
    """The scale PEFT multiplies ``module``'s LoRA product by: its ``alpha_pattern`` entry,
    else ``lora_alpha`` (8 when absent, PEFT's default), over ``rank`` (its square root with
    ``use_rslora``). ``deadline``: the adapter's regex budget (:data:`PATTERN_BUDGET_S`)."""
    patterns = config.get("alpha_pattern") or {}
    key = _pattern(patterns, module, deadline, "alpha_pattern")
    alpha = config.get("lora_alpha", 8) if key is None else patterns[key]
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidWeights(f"adapter lora_alpha {alpha!r} for {module!r} is not a number")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def module_rank(config: Mapping[str, Any], module: str, deadline: float
                ) -> tuple[int, str]:
    """(the rank PEFT gives ``module``'s LoRA layer, which field of adapter_config says so):
    its ``rank_pattern`` entry, else ``r`` (``peft.tuners.lora.model``)."""
    patterns = config.get("rank_pattern") or {}
    key = _pattern(patterns, module, deadline, "rank_pattern")
    return (config["r"], "r") if key is None else (patterns[key], f"rank_pattern[{key!r}]")


def _selects(config: Mapping[str, Any], targets, module: str, deadline: float) -> bool:
    """Whether PEFT puts a LoRA layer on ``module`` (a full module name) for this config
    (``peft.tuners.tuners_utils.check_target_module_exists``): not excluded by
    ``exclude_modules`` or ``modules_to_save``, and selected by ``targets`` (a regex the whole
    name matches, or names it equals or ends with after a dot, then narrowed by
    ``layers_to_transform`` / ``layers_pattern``)."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str):
        if _regex(exclude, module, deadline, "exclude_modules", full=True):
            return False
    elif exclude and (module in exclude or any(module.endswith("." + e) for e in exclude)):
        return False
    for m in config.get("modules_to_save") or ():
        if _regex(rf"(^|.*\.){m}($|\..*)", module, deadline, "modules_to_save", shown=m):
            return False
    if isinstance(targets, str):
        return bool(_regex(targets, module, deadline, "target_modules", full=True))
    if module in targets:
        return True
    if not any(module.endswith("." + t) for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    found = config.get("layers_pattern")
    if not found:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for pattern in [found] if isinstance(found, str) else found:
            match = _regex(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module, deadline,
                           "layers_pattern", shown=pattern)
            if match:
                break
    if not match:
        return False
    index = int(match.group("idx"))
    return index == layers if _is_int(layers) else index in layers


def selection_fields(config: Mapping[str, Any]) -> str:
    """The adapter_config fields that choose the adapted modules (``target_modules=[...],
    layers_to_transform=[...]``, the ones set), for error messages."""
    keys = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
            "modules_to_save")
    return ", ".join(f"{k}={config[k]!r}" for k in keys if config.get(k) not in (None, []))


def targeted_modules(config: Mapping[str, Any], spec: BackboneSpec, known: Mapping[str, str],
              deadline: float) -> set[str]:
    """The modules (values of ``known``: full module name -> adapter key) PEFT adapts for this
    config. ``all-linear`` is every linear PEFT would find (the classifier not, for SEQ_CLS).
    None of them: refused, as PEFT refuses it ("Target modules ... not found in the base
    model"); an entry of a list that matches nothing is ignored, as PEFT ignores it."""
    targets = config["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = [n for n in known
                   if not (n == "classifier" and config.get("task_type") == "SEQ_CLS")]
    out = {key for name, key in known.items() if _selects(config, targets, name, deadline)}
    if not out:
        ends = sorted({n.rsplit(".", 1)[-1] for n in known})
        raise InvalidWeights(
            f"adapter_config {selection_fields(config)} selects no module of the {spec.family} "
            f"backbone {spec.name!r} (PEFT: not found in the base model); its adaptable modules "
            f"end in {', '.join(ends)}")
    return out


def _saves(config: Mapping[str, Any], module: str) -> bool:
    """Whether PEFT keeps a trained copy of ``module`` (``peft.utils.other._set_trainable``):
    its name, or an enclosing module's, ends with an entry of ``modules_to_save`` (so
    ``["pooler"]`` saves ``bert.pooler.dense``)."""
    within = [module.rsplit(".", i)[0] for i in range(module.count(".") + 1)]
    return any(n.endswith(m) for n in within for m in config.get("modules_to_save") or ())


def _module_map(spec: BackboneSpec, scheme: str) -> dict[str, tuple[str, int]]:
    """Hugging Face module name -> (canonical linear of a layer set, part: 0-2 of qkv, else 0)."""
    out: dict[str, tuple[str, int]] = {}
    for i in range(spec.num_param_layers):
        src = layer_sources(spec, i, scheme)
        for kind in LINEAR_KINDS:
            for part, name in enumerate(src[f"{kind}.weight"]):
                out[name.removesuffix(".weight")] = (f"layers.{i}.{kind}", part)
    return out


def _fans(spec: BackboneSpec, kind: str) -> tuple[int, int]:
    """(in_features, out_features) of one part of a canonical linear (qkv: of q, k or v)."""
    H, inner = spec.hidden, spec.intermediate
    return {"qkv": (H, H), "attn_out": (H, H), "ffn_in": (H, inner), "ffn_out": (inner, H)}[kind]


def load_lora(spec: BackboneSpec, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
              base_heads: Mapping[str, torch.Tensor]) -> CanonicalWeights:
    """The tensors a LoRA tenant owns (module docstring), ready for ``WeightStore.add`` with
    ``base=``. ``base_heads``: the base tenant's ``pooler.*`` / ``head.*`` tensors (float32).

    The config and the tensors are cross-checked as PEFT loads them (``PeftModel.from_pretrained``
    builds the LoRA layers from the config, then loads the tensors into them): what PEFT refuses
    is refused, and so is what PEFT would silently drop or leave at its initial values (tensors
    of a module the config does not adapt or save, a module it adapts without tensors), since
    serving either would answer otherwise than PEFT's model of the same adapter."""
    check_config(config)
    deadline = time.monotonic() + PATTERN_BUDGET_S
    family = spec.family + "."
    src: dict[str, torch.Tensor] = {}
    given: dict[str, str] = {}  # key of src -> its name in the adapter
    for name, t in tensors.items():
        full = name.removeprefix(_PREFIX)
        full = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", full)  # ".default" names
        key = full.removeprefix(family)
        given[key] = name
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InvalidWeights(f"adapter tensor {name!r} is not a float tensor")
        if not torch.isfinite(t).all():
            raise InvalidWeights(f"adapter tensor {name!r} holds non-finite values")
        src[key] = t.detach().to(torch.float32)
    scheme = "v5" if spec.family == "vit" and any(k.startswith("layers.") for k in src) else "hub"
    modules = _module_map(spec, scheme)
    heads = {"pooler.dense" if spec.family != "albert" else "pooler": "pooler",
             "classifier": "head"}
    # what an adapter may adapt, by the name PEFT matches the config with: the full module name
    # in the model it adapts (the classifier is outside the family's submodule)
    names = {key: family + key for key in modules}
    names.update((key, key if canon == "head" else family + key) for key, canon in heads.items()
                 if f"{canon}.weight" in base_heads)
    targeted = targeted_modules(config, spec, {n: k for k, n in names.items()}, deadline)
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    owned: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key in sorted(k for k in src if k.endswith(_A)):
        module = key.removesuffix(_A)
        a, b = src[key], src.get(module + _B)
        if module not in names:
            raise InvalidWeights(f"adapter module {given[key].removesuffix(_A)!r} is not an "
                                 f"encoder linear or a head of the {spec.family} backbone "
                                 f"{spec.name!r}")
        name = names[module]
        if module not in targeted:
            raise InvalidWeights(
                f"adapter tensor {given[key]!r}: its adapter_config does not adapt {name!r} "
                f"({selection_fields(config)}): PEFT would leave it unused")
        if b is None:
            raise InvalidWeights(f"adapter has {given[key]!r} without its lora_B")
        used.update((key, module + _B))
        if a.dim() != 2 or b.dim() != 2:
            raise InvalidWeights(f"adapter module {name!r}: lora_A {list(a.shape)} and lora_B "
                                 f"{list(b.shape)} are not matrices")
        rank, field = module_rank(config, name, deadline)
        if a.shape[0] != b.shape[1]:
            raise InvalidWeights(
                f"adapter module {name!r}: lora_A has rank {a.shape[0]} ({list(a.shape)}) but "
                f"lora_B has rank {b.shape[1]} ({list(b.shape)}); adapter_config {field} is "
                f"{rank}")
        if a.shape[0] != rank:
            raise InvalidWeights(
                f"adapter module {name!r}: its tensors have rank {a.shape[0]} (lora_A "
                f"{list(a.shape)}, lora_B {list(b.shape)}) but adapter_config {field} is {rank}")
        if module in modules:
            fan_in, fan_out = _fans(spec, modules[module][0].split(".")[-1])
        else:
            w = base_heads[f"{heads[module]}.weight"]
            fan_out, fan_in = int(w.shape[0]), int(w.shape[1])
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise InvalidWeights(
                f"adapter module {name!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do "
                f"not fit its weight [{fan_out}, {fan_in}] (lora_A is [r, in_features], lora_B "
                "[out_features, r])")
        s = module_scale(config, name, rank, deadline)
        if module in modules:
            canon, part = modules[module]
            parts.setdefault(canon, {})[part] = (a, b * s)
        else:
            owned[f"{heads[module]}.lora"] = (a, b * s)  # merged below
    missing = sorted(names[m] for m in targeted if m + _A not in src)
    if missing:
        raise InvalidWeights(
            f"adapter_config adapts {missing[0]!r} ({selection_fields(config)}) but the adapter "
            f"has no lora_A/lora_B for it ({len(missing)} such modules): PEFT would leave them "
            "at their initial values")
    unsaved = []  # saved heads' tensors that modules_to_save does not name (after the shapes)
    for head, canon in heads.items():  # modules_to_save copies (a full head of the tenant)
        for suffix in ("weight", "bias"):
            if f"{head}.{suffix}" in src:
                if not _saves(config, head if canon == "head" else family + head):
                    unsaved.append(given[f"{head}.{suffix}"])
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
            a, b = pair
            w = w + b @ a
        if pair is not None or f"{canon}.weight" in owned or f"{canon}.bias" in owned:
            if w is None or bias is None:
                raise InvalidWeights(f"adapter saves part of the {canon} but the base has none")
            _check_head(spec, canon, w, bias)
            out[f"{canon}.weight"], out[f"{canon}.bias"] = w.contiguous(), bias.contiguous()
    if unsaved:
        raise InvalidWeights(
            f"adapter tensor {unsaved[0]!r}: its adapter_config modules_to_save="
            f"{config.get('modules_to_save')!r} does not save that module: PEFT would leave it "
            "unused")
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
        want = (
            f"[{H}, {H}] and [{H}]" if canon == "pooler" else f"[num_labels, {H}] and [num_labels]"
        )
        raise InvalidWeights(
            f"adapter's {canon}: weight {list(w.shape)} and bias {list(bias.shape)}"
            f"; the {spec.family} backbone {spec.name!r} expects {want}"
        )


def _pack(spec: BackboneSpec, canon: str, by_part: dict[int, tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) pair for a canonical linear from its parts' pairs (qkv: up to three), each
    already checked to fit its part (:func:`load_lora`)."""
    kind = canon.split(".")[-1]
    fan_in, part_out = _fans(spec, kind)
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
        a[col:col + r] = pa
        b[p * part_out:(p + 1) * part_out, col:col + r] = pb
        col += r
    return a, b
