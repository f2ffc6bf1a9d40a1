"""The KV cache allocates on demand (issue 62 item 3), against Hugging Face generate().

(a) A pool too small for every request's full length at once, but enough for each alone: every
request finishes, token for token equal to ``generate()`` (GPT-2 and a tiny llama; greedy, beam
and seeded sampling, the latter equal to the same engine with a pool that never preempts), and
the engine counts its preemptions. (b) The blocks in use grow with the sequence, one block per
16 positions. (c) Two requests of one tenant with a common two-block prefix hold those blocks
once (reference count 2), equal to ``generate()``; another tenant's identical prompt does not
share them; a later request finds the prefix cached after its users finished.
"""

from __future__ import annotations

import pytest
import torch

from itif.generation.api import GenerateRequest
from itif.generation.cache import prefix_digests
from itif.generation.spec import PRESETS

transformers = pytest.importorskip("transformers")

from itif.generation.engine import GenEngine
from tests import test_generate, test_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B = 16  # positions per block (RunningBatch's default)
LLAMA = "llama-gqa-llama3-untied"
STOP = 7  # the requests' EOS id: ends some sequences, not most


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, tmp_path_factory):
    """(engine factory, HF models by tenant): tenants a and b with different weights."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        spec = PRESETS["gpt2-tiny"]
        hf = {"a": test_generate.hf_model(spec, 1), "b": test_generate.hf_model(spec, 2)}
        backbone, layers, width = "gpt2-tiny", spec.dec_layers, spec.kv_width
    else:
        hf = {"a": test_llama.hf_model(LLAMA, 1), "b": test_llama.hf_model(LLAMA, 2)}
        cfg = test_llama.hf_config(LLAMA)
        backbone = root / "a"
        layers = cfg.num_hidden_layers
        width = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) // 2
    for t, m in hf.items():
        m.save_pretrained(root / t)

    def engine(blocks: int) -> GenEngine:
        block_bytes = layers * B * 2 * width * 4
        eng = GenEngine(backbone if request.param == "gpt2" else root / "a",
                        kv_cache_bytes=blocks * block_bytes)
        assert eng.cache_stats()["blocks_total"] == blocks
        for t in hf:
            eng.add_tenant(t, root / t)
        return eng

    return engine, hf


def hf_generate(m, r: GenerateRequest) -> list[list[int]]:
    with torch.no_grad():
        out = m.generate(torch.tensor([list(r.input_ids)]), max_new_tokens=r.max_new_tokens,
                         num_beams=r.num_beams, num_return_sequences=r.num_return_sequences,
                         do_sample=False, eos_token_id=r.eos_token_id, pad_token_id=r.eos_token_id,
                         return_dict_in_generate=True)
    seqs = []
    for s in out.sequences.tolist():
        s = s[len(r.input_ids):]
        if r.eos_token_id in s:  # everything after the first EOS is padding
            s = s[: s.index(r.eos_token_id) + 1]
        seqs.append(s)
    return seqs


def prompt(i: int, n: int) -> list[int]:
    return [(11 * i + 5 * j) % 80 + 10 for j in range(n)]


def test_a_pool_too_small_for_all_preempts_and_every_output_equals_hf(models):
    engine, hf = models
    reqs = [GenerateRequest("a", prompt(0, 10), max_new_tokens=40, eos_token_id=STOP),
            GenerateRequest("b", prompt(1, 14), max_new_tokens=38, eos_token_id=STOP),
            GenerateRequest("a", prompt(2, 6), max_new_tokens=44, eos_token_id=STOP),
            GenerateRequest("b", prompt(3, 9), max_new_tokens=20, num_beams=3,
                            num_return_sequences=2, eos_token_id=STOP),
            GenerateRequest("a", prompt(4, 12), max_new_tokens=36, eos_token_id=STOP)]
    # each alone needs at most 1 + 3 x 2 = 7 blocks (the beam request); all at once 23
    eng = engine(8)
    assert sum(eng._batch.blocks_full(eng._prepare(r).admission) for r in reqs) > 8
    out = eng.generate(reqs)
    assert eng.preemptions > 0 and eng.cache_stats()["preemptions"] == eng.preemptions
    for r, g in zip(reqs, out):
        assert g.sequences == hf_generate(hf[r.tenant], r), r
    stats = eng.cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"] and stats["running"] == 0
    # seeded sampling continues its noise where it stopped: equal to a pool that never preempts
    samp = [GenerateRequest(t, prompt(i, 8), max_new_tokens=40, do_sample=True, seed=i,
                            top_k=20, num_return_sequences=2 if i == 1 else 1, eos_token_id=STOP)
            for i, t in enumerate("abab")]
    small = engine(8)
    got = small.generate(samp)
    assert small.preemptions > 0
    assert [g.sequences for g in got] == [g.sequences for g in engine(64).generate(samp)]


def test_blocks_in_use_grow_with_the_sequence(models):
    engine, hf = models
    eng = engine(16)
    r = GenerateRequest("a", prompt(5, 5), max_new_tokens=45, eos_token_id=STOP)
    used: list[int] = []
    eng.before_forward = lambda tenants: used.append(eng.cache_stats()["blocks_used"])
    (g,) = eng.generate([r])
    assert g.sequences == hf_generate(hf["a"], r)
    n = len(g.sequences[0])
    assert n > 2 * B, "the test needs a sequence crossing two block boundaries"
    # the prompt's block at the prefill; before decode k (k = 1..n-1) the row holds
    # ceil(k / 16) blocks of its own
    assert used == [1] + [1 + -(-k // B) for k in range(1, n)]
    assert eng.cache_stats()["blocks_used"] == 0


def test_a_tenants_common_prefix_is_shared_and_never_across_tenants(models):
    engine, hf = models
    eng = engine(32)
    common = prompt(6, 2 * B)
    reqs = [GenerateRequest("a", common + [12, 13, 14], max_new_tokens=8, eos_token_id=STOP),
            GenerateRequest("a", common + [40, 41], max_new_tokens=8, eos_token_id=STOP),
            GenerateRequest("b", common + [12, 13, 14], max_new_tokens=8, eos_token_id=STOP)]
    pool = eng._batch.pool
    seen: list[tuple] = []

    def look(tenants):
        blocks = {}
        for t in ("a", "b"):
            key = (t, eng.store.view.tenants[t].generation)
            blocks[t] = [pool.find(d) for d in prefix_digests(key, common, B)]
        seen.append((blocks, [None if b is None else pool.refcount(b)
                              for t in ("a", "b") for b in blocks[t]],
                     eng.cache_stats()["blocks_used"]))

    eng.before_forward = look
    out = eng.generate(reqs)
    for r, g in zip(reqs, out):
        assert g.sequences == hf_generate(hf[r.tenant], r)
    blocks, refs, used = seen[1]  # the first decode: all three running
    assert None not in blocks["a"] and None not in blocks["b"]
    assert not set(blocks["a"]) & set(blocks["b"])
    assert refs == [2, 2, 1, 1]
    # a: 2 shared + 2 suffix blocks; b: 3; one block of its own per row
    assert used == 4 + 3 + 3
    # finished: the prefix blocks are unused but cached (counted free), found by a later request
    stats = eng.cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"] and stats["blocks_cached"] >= 4
    seen.clear()
    later = GenerateRequest("a", common + [50], max_new_tokens=8, eos_token_id=STOP)
    (g,) = eng.generate([later])
    assert g.sequences == hf_generate(hf["a"], later)
    blocks, refs, used = seen[0]
    assert refs[:2] == [1, 1] and used == 2 + 1  # the prefix found, one block computed
