"""A daemon whose backbone is a llama-family checkpoint serves Generate and ``/v1/completions``.

The backbone is a tiny Llama checkpoint directory (config.json of a GQA ``LlamaForCausalLM``
and the word-level tokenizer of tests/test_generate_daemon.py); tenants upload random
``LlamaForCausalLM`` weights. gRPC Generate and the ``openai`` client's completions (plain and
streamed) equal ``GenEngine.generate`` and Hugging Face ``generate()``. The config layer knows
the llama family's model types and the ``llama-tiny`` preset without loading torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from itif.config import parse_config
from itif.config.fields import DECODER_MODEL_TYPES, is_decoder_backbone
from itif.daemon import Daemon as InProcess
from itif.daemon import Identity
from itif.generation.api import GenerateRequest
from itif.metrics import Metrics
from tests.daemon_harness import free_port
from tests.test_generate_daemon import VOCAB, weights_bytes
from tests.test_http_completions import TOKENS, config_text, servers

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

EOS = 2
_CFG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False,
            initializer_range=0.2)


def write_llama_backbone(root: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(**_CFG).to_dict()
    (root / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root


def llama_model(seed: int):
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG)).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    return m


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-daemon")
    backbone = write_llama_backbone(root / "backbone")
    http = f"127.0.0.1:{free_port()}"
    d = InProcess(parse_config(config_text(backbone, http, max_new_tokens=64), root))
    d.metrics = Metrics(d, nvml=None)
    d.start()
    models = {"acme": llama_model(1), "beta": llama_model(2)}
    admin = Identity(None, admin=True)
    for tenant, model in models.items():
        data = weights_bytes(model, root)
        d.upload(admin, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])
    with servers(d) as port:
        yield d, port, http, models


def test_the_config_knows_the_llama_family(tmp_path):
    assert {"llama", "qwen2", "mistral"} <= set(DECODER_MODEL_TYPES)
    assert is_decoder_backbone("llama-tiny")
    assert is_decoder_backbone(str(write_llama_backbone(tmp_path / "bb")))


def test_generate_and_completions_equal_the_engine_and_hugging_face(served):
    from itif.client import Client

    d, port, http, models = served
    cases = [("acme", [5, 17, 42], 10, 1), ("beta", [7, 8, 9, 10], 9, 1), ("acme", [30], 8, 3)]
    want = d.generator.generate([GenerateRequest(t, ids, max_new_tokens=n, num_beams=b)
                                 for t, ids, n, b in cases])
    for (tenant, ids, n, beams), w in zip(cases, want):
        with torch.no_grad():
            out = models[tenant].generate(torch.tensor([ids]), max_new_tokens=n, num_beams=beams,
                                          do_sample=False, pad_token_id=EOS)
        hf = out[0, len(ids):].tolist()
        assert w.sequences[0] == (hf[:hf.index(EOS) + 1] if EOS in hf else hf)
        with Client(f"127.0.0.1:{port}", TOKENS[tenant]) as c:
            got = c.generate(tenant, ids, max_new_tokens=n, num_beams=beams, timeout=60)
        assert [list(s.ids) for s in got.sequences] == w.sequences
        oa = openai.OpenAI(base_url=f"http://{http}/v1", max_retries=0, api_key=TOKENS[tenant])
        extra = {"num_beams": beams} if beams > 1 else {}
        plain = oa.completions.create(model=tenant, prompt=ids, max_tokens=n, extra_body=extra)
        assert plain.choices[0].text == " ".join(f"t{t}" for t in w.sequences[0])
        if beams == 1:
            text = "".join(ch.choices[0].text for ch in oa.completions.create(
                model=tenant, prompt=ids, max_tokens=n, stream=True))
            assert text.strip() == plain.choices[0].text
