"""A LoRA adapter's config and tensors are cross-checked as PEFT loads them (issue 63, items 5
and 6): an adapter that contradicts itself, or names what the backbone lacks, is refused with
InvalidWeights naming the module and both sides, on every door that takes adapters, and the
tenant keeps serving its previous adapter.

Each bad adapter is a real PEFT adapter (``get_peft_model`` on a tiny random
BertForSequenceClassification, ``save_pretrained``) with its config or tensors corrupted, and
each is compared with what PEFT does with the same directory: it raises (a rank that is not
the config's, a target that is not in the model, a pair that does not fit), or it loads and
leaves tensors unused or modules at their initial values. itif refuses both kinds: serving
the second would answer otherwise than PEFT's model of that adapter."""

from __future__ import annotations

import copy
import json
import re
import shutil

import grpc
import numpy as np
import pytest
import torch

from itif.backbones.lora_tenants import pack_adapter
from itif.errors import InvalidWeights
from itif.safetensors_io import load_safetensors, save_safetensors
from tests.daemon_harness import ADMIN, Daemon
from tests.oracle import make_hf_model, random_request
from tests.reliability_util import (
    error_of,
    promise,
    rel,  # noqa: F401 - the fixture, used by name
    upload_bytes,
    weights_bytes,
)
from tests.test_lora import _check, _engine_with_base
from tests.test_lora_daemon import _adapter, _assert_equal

peft = pytest.importorskip("peft")

Q = "base_model.model.bert.encoder.layer.0.attention.self.query"
QUERY = "bert.encoder.layer.0.attention.self.query"  # as PEFT names the module
A, B = ".lora_A.weight", ".lora_B.weight"
# the good adapter every bad one is made from (r 4 on query and value of both layers)
GOOD = {"r": 4, "lora_alpha": 8, "target_modules": ["query", "value"]}


def _with(tensors: dict, **changed) -> dict:
    out = {k: v.clone() for k, v in tensors.items()}
    out.update(changed)
    return out


def _renamed(tensors: dict, old: str, new: str) -> dict:
    return {k.replace(old, new): v.clone() for k, v in tensors.items()}


# id -> (the corruption: (config, tensors) -> (config, tensors), PEFT's behaviour on it: a
# regex of the error it raises, or "unused" (it loads and drops tensors: unexpected keys) or
# "initial" (it loads and leaves modules at their initial values: missing keys), itif's message)
CASES = {
    # item 5: r 8 in the config, rank-4 tensors
    "r": (lambda c, t: ({**c, "r": 8}, t), "size mismatch",
          rf"{QUERY}': its tensors have rank 4 .*adapter_config r is 8"),
    # ... or a rank_pattern entry that says 8 for query
    "rank_pattern": (lambda c, t: ({**c, "rank_pattern": {"query": 8}}, t), "size mismatch",
                     rf"{QUERY}': its tensors have rank 4 .*rank_pattern\['query'\] is 8"),
    # item 6: target_modules naming a module the backbone does not have
    "target": (lambda c, t: ({**c, "target_modules": ["quack"]}, _renamed(t, "query", "quack")),
               "not found in the base model", r"target_modules=\['quack'\] selects no module"),
    # ... tensors of a module the backbone does not have (the config's target is there)
    "tensors": (lambda c, t: (c, _renamed(t, "layer.1.", "layer.7.")), "unused",
                r"layer.7.attention.self.\w+' is not an encoder linear or a head"),
    # ... tensors of a module the backbone has but the config does not adapt
    "untargeted": (lambda c, t: (c, {**t, **_renamed({k: v for k, v in t.items() if Q in k},
                                                     "query", "key")}),
                   "unused", r"does not adapt 'bert.encoder.layer.0.attention.self.key'"),
    # ... a module the config adapts, with no tensors (a truncated adapter)
    "truncated": (lambda c, t: (c, {k: v for k, v in t.items() if "layer.1.attention.self.value"
                                    not in k}),
                  "initial", r"adapts 'bert.encoder.layer.1.attention.self.value'.*no lora_A"),
    # lora_A of rank 3, its lora_B of rank 4
    "pair": (lambda c, t: (c, _with(t, **{Q + A: t[Q + A][:3]})), "size mismatch",
             rf"{QUERY}': lora_A has rank 3 \(\[3, 64\]\) but lora_B has rank 4"),
    # lora_A with 66 in_features on a 64-wide linear; lora_B with 65 out_features
    "in_features": (lambda c, t: (c, _with(t, **{Q + A: torch.randn(4, 66)})), "size mismatch",
                    (rf"{QUERY}': lora_A \[4, 66\] and lora_B \[64, 4\] do not fit its weight "
                     r"\[64, 64\]")),
    "out_features": (lambda c, t: (c, _with(t, **{Q + B: torch.randn(65, 4)})), "size mismatch",
                     rf"{QUERY}': lora_A \[4, 64\] and lora_B \[65, 4\] do not fit"),
}


def _good(tmp_path):
    base = make_hf_model("bert-tiny", 3, seed=11)  # test_lora's _engine_with_base's base
    model = _adapter(base, tmp_path / "good", 3, **GOOD)
    return base, model, tmp_path / "good"


def _corrupt(good, out, case: str):
    """A copy of adapter directory ``good`` at ``out`` with CASES[case]'s corruption."""
    config = json.loads((good / "adapter_config.json").read_text())
    tensors = load_safetensors(good / "adapter_model.safetensors")
    config, tensors = CASES[case][0](config, tensors)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_safetensors({k: v.contiguous() for k, v in tensors.items()},
                     out / "adapter_model.safetensors")
    return out


def _peft_loads(base, path):
    """What PEFT does with the adapter at ``path``: as ``PeftModel.from_pretrained`` does it
    (the LoRA layers from the config, then the tensors into them), the load's result."""
    config = peft.LoraConfig.from_pretrained(path)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    state = load_safetensors(path / "adapter_model.safetensors")
    return peft.set_peft_model_state_dict(model, state)


@pytest.mark.parametrize("case", list(CASES))
def test_a_contradicting_adapter_is_refused_where_peft_refuses_or_drops_it(tmp_path, case):
    eng, base = _engine_with_base("bert-tiny")
    _, model, good = _good(tmp_path)
    bad = _corrupt(good, tmp_path / case, case)
    _, peft_does, message = CASES[case]
    if peft_does in ("unused", "initial"):
        result = _peft_loads(base, bad)
        lost = result.unexpected_keys if peft_does == "unused" else [
            k for k in result.missing_keys if "lora_" in k]
        assert lost, (case, result)  # PEFT loads it, and does not serve what the files say
    else:
        with pytest.raises((RuntimeError, ValueError), match=peft_does):
            _peft_loads(base, bad)
    eng.add_tenant("la", good, base="base")
    with pytest.raises(InvalidWeights, match=message):
        eng.add_tenant("la", bad, base="base")
    config = json.loads((bad / "adapter_config.json").read_text())  # the (config, tensors) door
    with pytest.raises(InvalidWeights, match=message):
        eng.add_tenant("lb", (config, load_safetensors(bad / "adapter_model.safetensors")),
                       base="base")
    assert "lb" not in eng.store
    rng = np.random.default_rng(3)  # "la" still serves the good adapter, as PEFT does
    _check(eng, {"la": model, "base": base},
           [random_request(eng.spec, t, rng) for t in ("la", "base", "la")])


@pytest.mark.parametrize("cfg", [
    {"r": 4, "target_modules": "all-linear"},
    {"r": 4, "target_modules": ["query", "dense"], "layers_to_transform": [1],
     "modules_to_save": ["pooler"]},
    {"r": 4, "target_modules": r".*\.(query|value)", "rank_pattern": {"layer.1.*value": 2},
     "exclude_modules": ["bert.encoder.layer.0.attention.self.value"]},
    {"r": 2, "target_modules": ["query", "classifier"], "task_type": "SEQ_CLS"},
], ids=["all-linear", "layers+pooler-saved", "regex+exclude+rank_pattern", "seq-cls"])
def test_adapters_selecting_modules_every_peft_way_are_served_as_peft(tmp_path, cfg):
    """The cross-check selects modules as PEFT does (target_modules as a regex, all-linear,
    layers_to_transform, exclude_modules, modules_to_save of an enclosing module, rank_pattern):
    PEFT's own adapters are served, equal to PEFT's model, none refused."""
    eng, base = _engine_with_base("bert-tiny")
    model = _adapter(base, tmp_path / "a", 5, **cfg)
    if cfg.get("task_type") == "SEQ_CLS":  # PEFT's classification model: the head is saved
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a").eval()
        model = model.base_model.model
    eng.add_tenant("a", tmp_path / "a", base="base")
    rng = np.random.default_rng(2)
    _check(eng, {"a": model}, [random_request(eng.spec, "a", rng) for _ in range(3)])


@promise(40)
def test_the_daemon_refuses_each_contradicting_adapter_and_keeps_the_previous(tmp_path, rel):
    """Over gRPC (UploadWeights of a packed adapter, as ``itif upload --adapter`` sends it)
    each bad adapter answers INVALID_ARGUMENT with the loader's message; the LoRA tenant's
    previous adapter keeps answering PEFT's logits and its sha256 does not change."""
    d = Daemon(tmp_path / "d", {"base": "tb", "la": "ta"}, tenant_extra={"la": {"base": "base"}})
    base = make_hf_model("bert-tiny", 2, seed=130)  # weights_bytes(130)'s model
    la = _adapter(base, tmp_path / "good", 3, **GOOD)
    packed = {}
    for case in CASES:
        bad = _corrupt(tmp_path / "good", tmp_path / case, case)
        packed[case] = pack_adapter(bad, tmp_path / f"{case}.safetensors").read_bytes()
    d.start()
    try:
        with d.client(ADMIN) as c:
            upload_bytes(c, "base", weights_bytes(130))
            good = pack_adapter(tmp_path / "good", tmp_path / "good.safetensors").read_bytes()
            upload_bytes(c, "la", good)
            sha = c.get_tenant("la").sha256
            for case, data in packed.items():
                code, details = error_of(lambda data=data: upload_bytes(c, "la", data))
                rel.inputs += 1
                rel.saw(code)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details)
                assert re.search(CASES[case][2], details), (case, details)
                info = c.get_tenant("la")
                assert (info.state, info.sha256) == (info.READY, sha), (case, info)
        _assert_equal(d, "la", la)
    finally:
        d.stop()
