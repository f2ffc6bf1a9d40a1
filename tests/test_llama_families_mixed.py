"""Every kind of tenant of every llama-family variant in one ``generate`` call, against HF/PEFT.

Issue #62's bar: tiny random Llama, Qwen2 and Mistral models (grouped-query attention, RoPE
scaling, tied and untied embeddings) with full, LoRA and int8-delta tenants mixed in one
``generate`` call, greedy and beam outputs equal to Hugging Face's and PEFT's ``generate()``
token for token in float32.

Per variant of ``tests/test_llama.py`` (Qwen2 with Q/K/V biases and a tied head, Mistral with
GQA and a sliding window, Llama with llama3 / linear / dynamic RoPE, one with ``head_dim`` other
than hidden / heads, attention and MLP biases): a base tenant ``a``, another full fine-tune
``c``, ``b8`` = ``a`` with its last down projection and a norm retrained, stored as an int8
delta of ``a``, and four PEFT adapters of different ranks and targets made with PEFT itself
(random, nonzero ``lora_B``): Q and V on ``a``; ``all-linear`` with ``use_rslora`` and a
``rank_pattern`` on ``a``; O and down on the last layer only with an ``alpha_pattern`` on
``c``; K, gate and up on the delta tenant ``b8``. Fourteen requests of the seven tenants (greedy
and beam search, several returned sequences, each ``early_stopping``) in one call, each equal
to ``generate()`` of its oracle: the PEFT model of its adapter on its base's model (for ``gu``:
on ``b8``'s model holding W_hat), ``c``'s own model, or ``b8``'s W_hat model. Beam scores agree
too.

The adapters' oracle generates through the model PEFT injected its LoRA layers into
(``PeftModel.get_base_model()``; ``tests/test_llama.py``'s ``hf_generate`` resets the dynamic
RoPE there), and one request per variant checks that ``PeftModel.generate`` answers the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

from itif.generation.api import GenerateRequest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from itif.generation.engine import GenEngine  # noqa: E402 (imported after importorskip)
from tests.test_llama import EOS, VARIANTS, hf_generate, hf_model  # noqa: E402 (imported after importorskip)
from tests.test_llama_lora import peft_model  # noqa: E402 (imported after importorskip)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: adapter tenant -> (base tenant, LoraConfig kwargs)
ADAPTERS = {
    "qv": ("a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    "all": ("a", {"r": 2, "lora_alpha": 4, "use_rslora": True, "target_modules": "all-linear",
                  "rank_pattern": {"k_proj": 5, "down_proj": 3}}),
    "od": ("c", {"r": 6, "lora_alpha": 12, "target_modules": ["o_proj", "down_proj"],
                 "layers_to_transform": [1], "alpha_pattern": {"down_proj": 3}}),
    "gu": ("b8", {"r": 3, "lora_alpha": 6, "target_modules": ["k_proj", "gate_proj", "up_proj"]}),
}
TENANTS = [*ADAPTERS, "a", "c", "b8"]


@pytest.fixture(scope="module", params=list(VARIANTS))
def mixed(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"mixed-{name}")
    models = {"a": hf_model(name, 1), "c": hf_model(name, 2), "b": hf_model(name, 1)}
    with torch.no_grad():  # b: a with its last down projection and a norm retrained
        last = models["b"].model.layers[-1]
        last.mlp.down_proj.weight.add_(torch.randn_like(last.mlp.down_proj.weight) * 0.1)
        last.post_attention_layernorm.weight.add_(0.1)
    for t in ("a", "c"):
        models[t].save_pretrained(root / t)
    eng = GenEngine(root / "a")
    eng.add_tenant("a", root / "a")
    eng.add_tenant("c", root / "c")
    w_hat, _ = eng.load_delta(models["b"].state_dict(), "a", "int8")
    eng.add_tenant("b8", w_hat)
    b_hat = copy.deepcopy(models["b"])
    down = f"dec.{eng.spec.dec_layers - 1}.ffn_out.weight"
    with torch.no_grad():
        b_hat.model.layers[-1].mlp.down_proj.weight.copy_(w_hat.tensors[down])
    oracles = {"a": models["a"], "c": models["c"], "b8": b_hat}
    peft_models = {}
    for i, (t, (base, kw)) in enumerate(ADAPTERS.items()):
        pm = peft_model(oracles[base], kw, 20 + i)
        pm.save_pretrained(root / t)
        eng.add_tenant(t, root / t, base=base)
        peft_models[t] = pm
        oracles[t] = pm.get_base_model()  # the LoRA layers injected: what PeftModel runs
    return name, eng, oracles, peft_models


def requests_for(name: str) -> list[GenerateRequest]:
    """Each tenant greedy, then each with beams (2-4, two or three sequences returned from the
    wider searches); prompts of 1-13 tokens (the dynamic RoPE variant: two prompts longer than
    its 16 positions and every request running past them)."""
    out = []
    for i in range(14):
        beams = 1 if i < 7 else 2 + i % 3
        n = 1 + (5 * i) % 13
        mx = 8 + i % 5
        if "dynamic" in name:
            n = 18 if i in (3, 10) else n
            mx = 26 - n
        ids = [(7 * i + 3 * j) % 80 + 5 for j in range(n)]
        out.append(GenerateRequest(TENANTS[i % 7], ids, max_new_tokens=mx, num_beams=beams,
                                   num_return_sequences=min(beams, 1 + i % 3),
                                   early_stopping=(False, True, "never")[i % 3]))
    return out


def test_full_lora_and_delta_tenants_mixed_equal_hf_and_peft_generate(mixed):
    name, eng, oracles, _ = mixed
    reqs = requests_for(name)
    got = eng.generate(reqs)
    differs = eos_seen = returned = 0
    for r, g in zip(reqs, got):
        want, scores = hf_generate(oracles[r.tenant], r)
        assert g.tenant == r.tenant
        assert g.sequences == want, (name, r, g.sequences, want)
        if scores is not None:
            assert g.scores == pytest.approx(scores, abs=1e-4), (name, r)
        if r.tenant in ADAPTERS:  # the adapter changes its base's answer
            differs += want != hf_generate(oracles[ADAPTERS[r.tenant][0]], r)[0]
        eos_seen += sum(1 for s in want if s and s[-1] == EOS)
        returned += len(want) > 1
    assert differs >= 5, (name, differs)
    assert eos_seen >= 1 and returned >= 3


def test_peft_generate_equals_its_injected_model(mixed):
    """The oracle above is the model PEFT injected its layers into: PeftModel.generate agrees."""
    name, _, oracles, peft_models = mixed
    r = requests_for(name)[1]
    assert r.tenant == "all"
    with torch.no_grad():
        out = peft_models["all"].generate(input_ids=torch.tensor([list(r.input_ids)]),
                                          max_new_tokens=r.max_new_tokens, do_sample=False,
                                          pad_token_id=EOS)
    seq = out[0].tolist()[len(r.input_ids):]
    seq = seq[: seq.index(EOS) + 1] if EOS in seq else seq
    assert [seq] == hf_generate(oracles["all"], r)[0]
