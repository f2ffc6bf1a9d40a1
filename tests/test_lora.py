"""LoRA tenants (issue 14, item 2): a PEFT adapter on a base tenant, served in the same fused
batches as full fine-tunes; every request's outputs equal PEFT's model with that adapter.

The oracle is PEFT itself: ``get_peft_model`` on the base tenant's Hugging Face model with
random (non-zero) adapters, saved with ``save_pretrained`` and loaded by itif from that
directory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import itif
from itif.errors import InvalidWeights, TenantNotFound
from itif.safetensors_io import load_safetensors
from tests.oracle import make_hf_model, max_diff, random_request, reference

peft = pytest.importorskip("peft")

TOL = 1e-4


def _adapter(base_model, tmp_path, name: str, seed: int, **cfg):
    """A PEFT LoRA model on a copy of ``base_model`` with random adapters; saved to a dir."""
    import copy  # noqa: PLC0415

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **cfg)
    model = peft.get_peft_model(copy.deepcopy(base_model), config).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return model.base_model.model, path


def _engine_with_base(preset: str, labels: int = 3):
    eng = itif.Engine(preset)
    base = make_hf_model(preset, labels, seed=11)
    eng.add_tenant("base", {k: v for k, v in base.state_dict().items()})
    return eng, base


def _check(eng, models: dict, reqs, tol=TOL):
    results = eng.infer(reqs)
    for req, res in zip(reqs, results):
        diff = max_diff(res, reference(models[req.tenant], req))
        assert diff <= tol, (req.tenant, diff)


@pytest.mark.parametrize("preset", ["bert-tiny", "vit-tiny"])
def test_lora_tenants_equal_peft_mixed_with_full_fine_tunes(preset, tmp_path):
    eng, base = _engine_with_base(preset)
    spec = eng.spec
    targets = (["query", "value", "dense"] if spec.family == "bert"
               else ["q_proj", "v_proj", "o_proj", "fc1", "fc2"])
    models = {"base": base}
    # two ranks (two adapter kinds in one batch), one with a saved head, one with rsLoRA
    for name, seed, cfg in (
        ("lora4", 1, dict(r=4, lora_alpha=8, target_modules=targets)),
        ("lora8", 2, dict(r=8, lora_alpha=16, target_modules=targets[:2],
                          modules_to_save=["classifier"])),
        ("lora4b", 3, dict(r=4, lora_alpha=4, target_modules=targets[1:], use_rslora=True)),
    ):
        model, path = _adapter(base, tmp_path, name, seed, **cfg)
        eng.add_tenant(name, path, base="base")
        models[name] = model
    full = make_hf_model(preset, 3, seed=12)
    eng.add_tenant("full", {k: v for k, v in full.state_dict().items()})
    models["full"] = full
    rng = np.random.default_rng(5)
    names = list(models)
    reqs = [random_request(spec, names[i % len(names)], rng) for i in range(15)]
    _check(eng, models, reqs)
    # a LoRA tenant reads the base's tensors in place: it holds only its adapters and heads
    info, base_info = eng.tenant_info("lora4"), eng.tenant_info("base")
    assert info.exclusive_bytes < base_info.bytes / 4, (info, base_info)
    view = eng.store.view
    w = "layers.0.ffn_in.weight" if spec.family == "bert" else "layers.0.qkv.weight"
    assert view.param("lora4", w) == view.param("base", w)


# per family: the targets, then full module names (as PEFT names them in the model it adapts)
# of a query-like linear, a value-like linear, a feed-forward linear and the pooler
_FULL_NAMES = {
    "bert": (["query", "value", "dense"], "bert.encoder.layer.{}.attention.self.query",
             "bert.encoder.layer.{}.attention.self.value", "bert.encoder.layer.{}.output.dense",
             "bert.pooler.dense"),
    "albert": (["query", "value", "ffn_output", "pooler"],
               "albert.encoder.albert_layer_groups.{}.albert_layers.0.attention.query",
               "albert.encoder.albert_layer_groups.{}.albert_layers.0.attention.value",
               "albert.encoder.albert_layer_groups.{}.albert_layers.0.ffn_output", "albert.pooler"),
    "vit": (["q_proj", "v_proj", "fc2"], "vit.layers.{}.attention.q_proj",
            "vit.layers.{}.attention.v_proj", "vit.layers.{}.mlp.fc2", None),
}


@pytest.mark.parametrize("preset", ["bert-tiny", "albert-tiny", "vit-tiny"])
def test_full_module_name_alpha_and_rank_patterns_equal_peft(preset, tmp_path):
    """alpha_pattern / rank_pattern keys select modules as PEFT does: matched against the full
    module name (``bert.encoder.layer.0.attention.self.query``), regexes and ``^`` included."""
    eng, base = _engine_with_base(preset)
    targets, q, v, ffn, pooler = _FULL_NAMES[eng.spec.family]
    last = eng.spec.num_param_layers - 1
    alpha = {q.format(0): 32, "^" + ffn.format(last): 3, v.format(r"\d+"): 20}
    rank = {q.format(0): 2, v.format(last): 6}
    if pooler is not None:
        alpha[pooler] = 12
    model, path = _adapter(base, tmp_path, "pat", 4, r=4, lora_alpha=8, target_modules=targets,
                           alpha_pattern=alpha, rank_pattern=rank)
    # the keys took effect in PEFT (else this would test nothing)
    lin = model.get_submodule(q.format(0))
    assert (lin.r["default"], lin.scaling["default"]) == (2, 16.0)
    lin = model.get_submodule(v.format(last))
    assert (lin.r["default"], lin.scaling["default"]) == (6, 20 / 6)
    assert model.get_submodule(ffn.format(last)).scaling["default"] == 3 / 4
    eng.add_tenant("pat", path, base="base")
    rng = np.random.default_rng(9)
    reqs = [random_request(eng.spec, t, rng) for t in ("pat", "base", "pat", "pat")]
    _check(eng, {"base": base, "pat": model}, reqs)


def test_lora_changes_only_its_own_rows(tmp_path):
    eng, base = _engine_with_base("bert-tiny")
    model, path = _adapter(base, tmp_path, "a", 7, r=2, lora_alpha=2, target_modules=["key"])
    rng = np.random.default_rng(1)
    reqs = [random_request(eng.spec, "base", rng) for _ in range(3)]
    alone = eng.infer(reqs)
    eng.add_tenant("a", path, base="base")
    mixed = eng.infer(reqs + [random_request(eng.spec, "a", rng) for _ in range(3)])
    for x, y in zip(alone, mixed[:3]):  # a bigger batch may round differently (~1e-8), no more
        np.testing.assert_allclose(x.logits, y.logits, rtol=0, atol=1e-6)
    _check(eng, {"base": base, "a": model}, reqs + [random_request(eng.spec, "a", rng)])


def test_bad_adapters_are_refused_naming_the_problem(tmp_path):
    eng, base = _engine_with_base("bert-tiny")
    _, path = _adapter(base, tmp_path, "ok", 3, r=4, lora_alpha=8, target_modules=["query"])
    with pytest.raises(TenantNotFound, match="base tenant"):
        eng.add_tenant("x", path, base="nobody")
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_safetensors(path / "adapter_model.safetensors")
    for change, match in (({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias"),
                          ({"r": 65}, "r=65"), ({"peft_type": "IA3"}, "only LORA")):
        with pytest.raises(InvalidWeights, match=match):
            eng.add_tenant("x", ({**config, **change}, tensors), base="base")
    a_name = next(k for k in tensors if "lora_A" in k)
    with pytest.raises(InvalidWeights, match="without"):
        eng.add_tenant("x", (config, {a_name: tensors[a_name]}), base="base")
    with pytest.raises(InvalidWeights, match="not an encoder linear"):
        eng.add_tenant("x", (config, {k.replace("query", "quack"): v
                                      for k, v in tensors.items()}), base="base")
    bad = dict(tensors)
    bad[a_name] = torch.full_like(tensors[a_name], float("nan"))
    with pytest.raises(InvalidWeights, match="non-finite"):
        eng.add_tenant("x", (config, bad), base="base")
    for pattern, match in ((["query"], "must be an object"), ({"(": 3}, "not a regex")):
        with pytest.raises(InvalidWeights, match=match):
            eng.add_tenant("x", ({**config, "alpha_pattern": pattern}, tensors), base="base")
    assert "x" not in eng.store


def test_a_saved_head_of_another_shape_is_refused_not_read_from_another_tenant(tmp_path):
    """An adapter's saved pooler or classifier (PEFT's modules_to_save) of a shape the backbone
    does not have: the store files a tensor by name and shape, so such a tensor got a slot in
    a buffer of its own while the forward read that slot number from the buffer of the right
    shape: another tenant's pooler or bias, served to this one (an audit read a victim's pooler
    matrix back through ``pooled``), or an internal error. Each is now refused naming the
    shapes; the engine refuses any tensor off the backbone's table whatever its path."""
    from itif.backbones.hf import CanonicalWeights  # noqa: PLC0415

    eng, base = _engine_with_base("bert-tiny")
    victim = make_hf_model("bert-tiny", 3, seed=12)
    eng.add_tenant("victim", {k: v for k, v in victim.state_dict().items()})
    _, path = _adapter(base, tmp_path, "ok", 3, r=4, lora_alpha=8, target_modules=["query"])
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_safetensors(path / "adapter_model.safetensors")
    H = eng.spec.hidden
    saved = "base_model.model.bert.pooler.dense."
    for extra in ({saved + "weight": torch.randn(H + 1, H), saved + "bias": torch.randn(H + 1)},
                  {saved + "weight": torch.randn(H, H), saved + "bias": torch.randn(H + 1)},
                  {"base_model.model.classifier.bias": torch.randn(2)},  # the base has 3 labels
                  {"base_model.model.classifier.weight": torch.randn(3, H + 6),
                   "base_model.model.classifier.bias": torch.randn(3)}):
        with pytest.raises(InvalidWeights, match="expects"):
            eng.add_tenant("x", (config, {**tensors, **extra}), base="base")
        assert "x" not in eng.store
    good = eng.load_weights({k: v for k, v in victim.state_dict().items()})
    for name, shape in (("pooler.weight", (H + 1, H)), ("head.bias", (2,))):
        bad = CanonicalWeights({**good.tensors, name: torch.randn(shape)}, good.num_labels,
                               good.has_pooler)
        for run in (lambda w: eng.add_tenant("x", w), eng.probe):
            with pytest.raises(InvalidWeights, match=f"tensor '{name}' has shape"):
                run(bad)
    assert "x" not in eng.store
    eng.add_tenant("x", (config, tensors), base="base")  # the adapter as saved is served
    assert "x" in eng.store


def test_alpha_patterns_that_backtrack_for_ever_end_within_their_budget(tmp_path):
    """Regexes whose match never ends froze the daemon: ``re`` holds the GIL while it
    backtracks, and it backtracks on ``(\\w+\\.?)+X`` for longer than anyone
    waits. Matched with ``regex``, that one answers at once (no module matches: the default
    alpha), and one that does run long is refused once the adapter's patterns have spent
    ``PATTERN_BUDGET_S``, naming the field."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from itif.backbones.lora_tenants import PATTERN_BUDGET_S  # noqa: PLC0415

    eng, base = _engine_with_base("bert-tiny")
    model, path = _adapter(base, tmp_path, "ok", 3, r=4, lora_alpha=8, target_modules=["query"])
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_safetensors(path / "adapter_model.safetensors")
    slow = "(.*)" * 6 + r"\8\7\6\5\4\3(?!)"  # groups 1-2 are PEFT's own wrapper's
    for name, pattern in (("re-hang", r"(\w+\.?)+X"), ("slow", slow)):
        got: dict = {}

        def add() -> None:
            t0 = time.monotonic()
            try:
                eng.add_tenant(name, ({**config, "alpha_pattern": {"nothing": 1, pattern: 2}},
                                      tensors), base="base")
            except InvalidWeights as e:
                got["error"] = str(e)
            got["s"] = time.monotonic() - t0

        worker = threading.Thread(target=add, daemon=True)
        worker.start()
        worker.join(PATTERN_BUDGET_S + 30)
        assert "s" in got, f"{name}: still matching 30 s past the budget"
        assert got["s"] < PATTERN_BUDGET_S + 5, got
        if name == "slow":
            assert "alpha_pattern" in got.get("error", "") and "simpler" in got["error"], got
            assert name not in eng.store
        else:
            assert "error" not in got and name in eng.store, got
    rng = np.random.default_rng(5)
    _check(eng, {"base": base, "re-hang": model},
           [random_request(eng.spec, t, rng) for t in ("re-hang", "base")])
