"""The llama family (Llama, Qwen2, Mistral) in GenEngine against Hugging Face generate().

Per variant, three full fine-tune tenants saved as checkpoint directories: ``a`` and ``c`` with
different random weights of the same shapes, ``b`` = ``a`` with a few tensors retrained (the
rest shared in the weight store). Many requests of all of them in one ``generate`` call (greedy
and beam search, prompts of 1-14 tokens), each equal token for token (float32) to
``generate()`` of its tenant's own model. The variants cover grouped-query attention (4 query
heads over 2 or 1 key/value heads), the RoPE variants (llama3, linear, dynamic past
``max_position_embeddings``, default), tied and untied LM heads, a ``head_dim`` other than
hidden / heads, Llama's ``attention_bias`` and ``mlp_bias``, Qwen2's Q/K/V bias, and Mistral's
sliding window shorter than the prompts (HF's dynamic RoPE remembers the longest sequence of
earlier calls: ``hf_generate`` resets it, the fresh model itif matches). Plus: the RoPE
frequencies are transformers' bits; a fine-tune stored as an int8 delta of its base generates
as its W_hat does in HF; bad configs and checkpoints are refused by name; the public API names
GenEngine.
"""

from __future__ import annotations

import json

import pytest
import torch

import itif
from itif.errors import InvalidConfig, InvalidRequest, InvalidWeights
from itif.generation.api import GenerateRequest
from itif.generation.spec import spec_from_hf_config

transformers = pytest.importorskip("transformers")

from itif.generation.engine import GenEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 0
_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=EOS, initializer_range=0.2, attention_dropout=0.0)
#: name -> (model_type, config overrides)
VARIANTS = {
    "llama-gqa-llama3-untied": ("llama", dict(
        num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16))),
    "llama-mqa-linear-tied-bias-headdim": ("llama", dict(
        num_key_value_heads=1, tie_word_embeddings=True, head_dim=12, attention_bias=True,
        mlp_bias=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-dynamic": ("llama", dict(
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=16,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "qwen2-gqa-tied": ("qwen2", dict(
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral-window": ("mistral", dict(
        num_key_value_heads=2, tie_word_embeddings=False, sliding_window=5)),
}
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}


def hf_config(variant: str):
    model_type, over = VARIANTS[variant]
    return getattr(transformers, _CLASSES[model_type][0])(**{**_BASE, **over})


def hf_model(variant: str, seed: int):
    """A random model; RMSNorm weights and biases randomised too (HF starts them at 1 and 0,
    which would hide a tenant reading another tenant's), and the EOS row of the head made
    longer so that some sequences end."""
    model_type, _ = VARIANTS[variant]
    torch.manual_seed(seed)
    m = getattr(transformers, _CLASSES[model_type][1])(hf_config(variant))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        m.lm_head.weight[EOS] *= 1.4
    return m.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    name = request.param
    models = {"a": hf_model(name, 1), "b": hf_model(name, 1), "c": hf_model(name, 2)}
    with torch.no_grad():  # b: a with its last layer's MLP down projection and norm retrained
        last = models["b"].model.layers[-1]
        last.mlp.down_proj.weight.add_(torch.randn_like(last.mlp.down_proj.weight) * 0.1)
        last.post_attention_layernorm.weight.add_(0.1)
    root = tmp_path_factory.mktemp(name)
    for t, m in models.items():
        m.save_pretrained(root / t)
    eng = GenEngine(root / "a")
    for t in models:
        eng.add_tenant(t, root / t)
    return name, models, eng


def hf_generate(m, r: GenerateRequest) -> tuple[list[list[int]], list[float] | None]:
    kw = dict(max_new_tokens=r.max_new_tokens, num_beams=r.num_beams, do_sample=False,
              length_penalty=r.length_penalty, early_stopping=r.early_stopping,
              num_return_sequences=r.num_return_sequences, return_dict_in_generate=True,
              output_scores=True, pad_token_id=EOS)
    rot = m.model.rotary_emb
    if rot.rope_type == "dynamic":  # forget the longest sequence of earlier calls (a fresh model)
        rot.register_buffer("inv_freq", rot.original_inv_freq.clone(), persistent=False)
        rot.max_seq_len_cached = rot.original_max_seq_len
    with torch.no_grad():
        out = m.generate(torch.tensor([list(r.input_ids)]), **kw)
    seqs = []
    for s in out.sequences.tolist():
        s = s[len(r.input_ids):]
        if EOS in s:  # everything after the first EOS is padding
            s = s[: s.index(EOS) + 1]
        seqs.append(s)
    return seqs, (out.sequences_scores.tolist() if r.num_beams > 1 else None)


def requests_for(variant: str) -> list[GenerateRequest]:
    lens = [3, 9, 1, 14, 6, 11, 4, 7, 2, 12]
    grid = [  # (tenant, beams, early_stopping, return, max_new)
        ("a", 1, False, 1, 14), ("b", 1, False, 1, 14), ("c", 1, False, 1, 12),
        ("a", 3, True, 2, 10), ("b", 4, "never", 3, 10), ("c", 2, False, 1, 9),
        ("a", 4, False, 1, 11), ("b", 2, True, 2, 8), ("c", 3, "never", 1, 12),
        ("b", 1, False, 1, 13),
    ]
    out = []
    for i, ((t, nb, es, nr, mx), n) in enumerate(zip(grid, lens)):
        ids = [(7 * i + 3 * j) % 80 + 5 for j in range(n)]
        if variant == "llama-dynamic":  # prompt + new tokens reach past max_position_embeddings
            n = 20 if i in (3, 9) else n  # and two prompts are longer than it
            ids = [(7 * i + 3 * j) % 80 + 5 for j in range(n)]
            mx = 30 - n
        out.append(GenerateRequest(t, ids, max_new_tokens=mx, num_beams=nb, early_stopping=es,
                                   num_return_sequences=nr))
    return out


def test_greedy_and_beam_equal_hf_generate_tenants_mixed(variant):
    name, models, eng = variant
    reqs = requests_for(name)
    got = eng.generate(reqs)
    eos_seen = longest = 0
    for r, g in zip(reqs, got):
        want, scores = hf_generate(models[r.tenant], r)
        assert g.tenant == r.tenant
        assert g.sequences == want, (name, r, g.sequences, want)
        if scores is not None:
            assert g.scores == pytest.approx(scores, abs=1e-4)
        eos_seen += sum(1 for s in want if s and s[-1] == EOS)
        longest = max(longest, len(r.input_ids) + max(map(len, want)))
    assert eng.cache_stats()["blocks_used"] == 0
    assert eos_seen >= 2  # finished beams and early ends, not only max_new_tokens
    # the dynamic RoPE grows past max_position_embeddings; the window slides past the prompts
    assert longest > (eng.spec.max_position if "dynamic" in name else 3 * 5)


def test_shared_tensors_are_stored_once(variant):
    """Tenant b differs from a in two tensors per the fixture: the store keeps the rest once."""
    _, _, eng = variant
    total, own = eng.store.tenant_bytes("b")
    spec = eng.spec
    down, norm = spec.hidden * spec.ffn * 4, spec.hidden * 4
    assert own == down + norm and total > 10 * own
    assert eng.store.tenant_bytes("c")[1] == total  # c shares nothing


def test_the_spec_reads_each_family(variant):
    name, models, eng = variant
    spec = eng.spec
    cfg = models["a"].config
    assert spec.family == "llama" and spec.model_type == cfg.model_type
    assert spec.kv_heads_n == cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert spec.head_dim == head_dim
    assert spec.tied_lm_head == cfg.tie_word_embeddings
    assert spec.qkv_bias == (name.startswith("qwen2") or "bias" in name)
    assert spec.out_bias == spec.mlp_bias == ("bias" in name)
    assert spec.sliding_window == (5 if name.startswith("mistral") else 0)
    # the pool caches kv_heads x head_dim keys and values per position, not the hidden size
    assert eng._batch.pool.kv.shape[-1] == 2 * cfg.num_key_value_heads * head_dim
    # the canonical table matches the checkpoint's parameter count (a tied head counted once)
    n_hf = sum(p.numel() for p in models["a"].parameters())
    assert sum(torch.Size(s).numel() for _, s in spec.params()) == n_hf


def test_a_full_fine_tune_stored_as_an_int8_delta_generates_as_its_w_hat(variant, tmp_path):
    """Tenant b stored as base a plus an int8 delta: the report counts the tensors shared with
    a and the matrices' 1/4 size and measures a small error; the store holds only the two
    tensors b changed; generation equals HF generate() of b's model holding W_hat; the blob
    read back gives the same W_hat."""
    import copy

    from itif.weights import delta

    name, models, eng = variant
    spec = eng.spec
    w_hat, report = eng.load_delta(models["b"].state_dict(), "a", "int8")
    down = f"dec.{spec.dec_layers - 1}.ffn_out.weight"
    assert report.compress == "int8" and report.base == "a" and report.output == "logits"
    assert report.shared == len(spec.params()) - 2  # the down projection and the norm differ
    assert 0.25 <= report.matrix_ratio < 0.25 + 2 / spec.ffn  # int8 codes + a scale per row
    assert 0 < report.max_abs_error < 1e-2, report
    exact = models["b"].model.layers[-1].mlp.down_proj.weight.detach()
    scale = (exact - models["a"].model.layers[-1].mlp.down_proj.weight.detach()).abs().amax(1)
    err = (w_hat.tensors[down] - exact).abs()
    assert 0 < float(err.max()) and bool((err <= scale[:, None] / 254 + 1e-7).all())
    try:
        eng.add_tenant("b8", models["b"].state_dict(), base="a", compress="int8")
        total, own = eng.store.tenant_bytes("b8")
        # W_hat's down projection is its own; the rest is a's, the retrained norm is b's
        assert own == spec.hidden * spec.ffn * 4 and total > 10 * own
        b_hat = copy.deepcopy(models["b"])
        with torch.no_grad():
            b_hat.model.layers[-1].mlp.down_proj.weight.copy_(w_hat.tensors[down])
        reqs = [GenerateRequest("b8", r.input_ids, max_new_tokens=r.max_new_tokens,
                                num_beams=r.num_beams, early_stopping=r.early_stopping,
                                num_return_sequences=r.num_return_sequences)
                for r in requests_for(name)[:6]]
        for r, g in zip(reqs, eng.generate(reqs)):
            assert g.sequences == hf_generate(b_hat, r)[0], (name, r)
    finally:
        eng.remove_tenant("b8")
    path = tmp_path / "b.delta"
    path.write_bytes(delta.to_bytes(w_hat))
    again = eng.load_delta_blob(path, "a")
    assert again.tensors.keys() == w_hat.tensors.keys()
    assert all(torch.equal(again.tensors[k], w_hat.tensors[k]) for k in w_hat.tensors)
    with pytest.raises(InvalidRequest, match="compress"):
        eng.load_delta(models["b"].state_dict(), "a", "int4")


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
         high_freq_factor=4.0, original_max_position_embeddings=32),
    dict(rope_type="dynamic", rope_theta=10000.0, factor=3.0),
])
def test_rope_frequencies_are_transformers_bits(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from itif.generation.rope import Rope, inv_freq

    cfg = transformers.LlamaConfig(**{**_BASE, "hidden_size": 64, "max_position_embeddings": 48,
                                      "rope_parameters": dict(rope)})
    spec = spec_from_hf_config(cfg.to_dict())
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        want = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0]
    else:
        want = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")[0]
    got = inv_freq(spec.rope_params, spec.head_dim, spec.max_position)
    assert torch.equal(got, want)
    if rope["rope_type"] == "dynamic":  # grown past max_position_embeddings, per row
        r = Rope(spec.rope_params, spec.head_dim, spec.max_position, "cpu")
        lens = torch.tensor([10, 48, 49, 77, 140])
        got = r._dynamic_inv(lens)
        for i, s in enumerate(lens):
            want = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=s)[0]
            base = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu")[0]
            assert torch.equal(got[i], want if s > 48 else base), int(s)
        assert not torch.equal(got[3], got[4])
        assert spec.max_len == 3 * 48


@pytest.mark.parametrize("over, message", [
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)), "rope_type 'yarn'"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4)), "factor"),
    (dict(num_key_value_heads=3), "num_key_value_heads 3"),
    (dict(hidden_act="mish"), "hidden_act 'mish'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_configs_itif_does_not_serve_are_refused_by_name(over, message):
    cfg = {**_BASE, "model_type": "llama", **over}
    with pytest.raises(InvalidConfig, match=message):
        spec_from_hf_config(cfg)


def test_qwen2_sliding_window_layers_are_refused():
    cfg = {**_BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}
    with pytest.raises(InvalidConfig, match="use_sliding_window"):
        spec_from_hf_config(cfg)


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor():
    qwen = hf_model("qwen2-gqa-tied", 3)
    spec = spec_from_hf_config({**hf_config("qwen2-gqa-tied").to_dict(), "model_type": "llama"})
    eng = GenEngine(spec)
    unexpected = r"unexpected tensor 'layers\.0\.self_attn\.q_proj\.bias'"
    with pytest.raises(InvalidWeights, match=unexpected):
        eng.add_tenant("x", qwen.state_dict())
    sd = dict(qwen.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InvalidWeights, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.weight'"):
        GenEngine(spec_from_hf_config(hf_config("qwen2-gqa-tied").to_dict())).add_tenant("x", sd)


def test_positions_past_the_context_are_refused_naming_the_field(variant):
    name, _, eng = variant
    limit = eng.spec.max_len
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        eng.check(GenerateRequest("a", [5] * 4, max_new_tokens=limit))
    with pytest.raises(InvalidRequest, match="input_ids"):
        eng.check(GenerateRequest("a", [5] * (limit + 1), max_new_tokens=1))


def test_the_public_api_names_the_decoder_engine(tmp_path):
    """itif.Engine refuses a decoder naming GenEngine; GenEngine and GenerateRequest are
    exported at the top level."""
    assert itif.GenEngine is GenEngine and itif.GenerateRequest is GenerateRequest
    for model_type, cfg in (("gpt2", dict(model_type="gpt2", vocab_size=96)),
                            ("llama", {**_BASE, "model_type": "llama"})):
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        for backbone in (d, d / "config.json"):
            with pytest.raises(InvalidConfig, match=rf"model_type '{model_type}'.*itif\.GenEngine"):
                itif.Engine(backbone)
    with pytest.raises(InvalidConfig, match=r"decoder preset 'gpt2-tiny'.*GenEngine"):
        itif.Engine("gpt2-tiny")
    with pytest.raises(InvalidConfig, match=r"model_type 't5' is not supported \(bert, albert"):
        (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5"}))
        itif.Engine(tmp_path / "t5.json")
