"""The multi-tenant decoder forward against Hugging Face (CPU, float32, tiny random models).

For GPT-2, BART and Marian: three tenants each (two of them sharing tensors with the first),
requests of every tenant admitted together, several decode steps with beam-like reorders (rows
continue other rows of their request) and requests leaving; every row's logits equal the Hugging
Face model of its tenant recomputing the row's whole token history.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from itif.errors import InvalidWeights
from itif.generation import model as gen_model
from itif.generation.hf_import import to_canonical
from itif.generation.running import JoiningRequest, RunningBatch
from itif.generation.spec import PRESETS, spec_from_hf_config
from itif.weights.store import WeightStore
from tests.decoder_oracle import hf_decoder

transformers = pytest.importorskip("transformers")

SPECS = ("gpt2-tiny", "bart-tiny", "marian-tiny")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model(spec, seed: int):
    m = hf_decoder(spec, seed)
    # random init leaves biases and final_logits_bias at zero: make them count
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or "layer_norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
        if hasattr(m, "final_logits_bias"):
            m.final_logits_bias.normal_(0, 0.5)
    return m.eval()


def tenants_for(spec):
    """Three tenants: a, b (a's weights with its last decoder layer's FFN retrained), c (own)."""
    a, c = hf_model(spec, 1), hf_model(spec, 2)
    b = hf_model(spec, 1)
    with torch.no_grad():
        ffn = (b.transformer.h[-1].mlp.c_fc.weight if spec.family == "gpt2"
               else b.model.decoder.layers[-1].fc1.weight)
        ffn.add_(torch.randn_like(ffn) * 0.05)
    return {"a": a, "b": b, "c": c}


def make_batch(spec, models, kv_bytes=1 << 22):
    store = WeightStore("cpu", torch.float32)
    for name, m in models.items():
        store.add(name, to_canonical(spec, m.state_dict()))
    return RunningBatch(spec, store, kv_bytes, block=4)


def hf_logits(spec, m, source, history):
    with torch.no_grad():
        if spec.encoder_decoder:
            out = m(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([history]))
        else:
            out = m(input_ids=torch.tensor([history]))
    return out.logits[0, -1]


@pytest.mark.parametrize("keep_sources, stale", ((True, False), (False, False), (True, True)),
                         ids=("sources-kept", "sources-gathered", "stale-nan-pool"))
@pytest.mark.parametrize("name", SPECS)
def test_mixed_tenants_prefill_decode_reorder_equal_hf(name, keep_sources, stale, monkeypatch):
    """``keep_sources``: decode steps read the sources gathered once per membership
    (``CrossGroup.cached``) or, with no byte budget for that, gather them at every step.
    ``stale``: every pool position starts NaN, as if freed by a request whose K/V overflowed;
    a row reads only positions its request wrote, so nothing changes (a masked position read
    would enter the output as 0 x NaN)."""
    if not keep_sources:
        monkeypatch.setattr(gen_model, "CROSS_CACHE_BYTES", 0)
    spec = PRESETS[name]
    models = tenants_for(spec)
    batch = make_batch(spec, models)
    if stale:
        batch.pool.kv.fill_(float("nan"))
    rng = np.random.default_rng(0)
    start = {"bart": 2, "marian": spec.pad_token_id}.get(spec.family)
    items, hist, src = [], [], []  # per row: token history; per row: its request's source
    plan = [("a", 3, 5), ("c", 1, 9), ("b", 2, 4), ("a", 1, 12), ("b", 1, 1), ("c", 2, 7)]
    for k, (tenant, rows, n) in enumerate(plan):
        toks = rng.integers(3, spec.vocab_size - 1, n).tolist()
        if spec.encoder_decoder:
            items.append(JoiningRequest(k, tenant, [start], rows, 8, source=toks))
            hist += [[start] for _ in range(rows)]
        else:
            items.append(JoiningRequest(k, tenant, toks, rows, 8))
            hist += [list(toks) for _ in range(rows)]
        src += [toks] * rows
    row_tenant = [t for t, r, _ in plan for _ in range(r)]
    row_req = [k for k, (_, r, _) in enumerate(plan) for _ in range(r)]
    n4 = sum(r for _, r, _ in plan[:4])
    later = hist[n4:], src[n4:], row_tenant[n4:], row_req[n4:]
    hist, src, row_tenant, row_req = hist[:n4], src[:n4], row_tenant[:n4], row_req[:n4]
    logits = batch.admit(items[:4])  # two admissions: the second joins a running batch
    for step in range(5):
        if step == 1:
            logits = torch.cat([logits, batch.admit(items[4:])])
            hist, src = hist + later[0], src + later[1]
            row_tenant, row_req = row_tenant + later[2], row_req + later[3]
        R = batch.rows
        assert logits.shape == (R, spec.vocab_size)
        for r in range(R):
            want = hf_logits(spec, models[row_tenant[r]], src[r], hist[r])
            torch.testing.assert_close(logits[r], want, atol=1e-4, rtol=1e-4)
        # beam-like reorder: each row continues a random row of its own request
        parent = []
        for r in range(R):
            same = [j for j in range(R) if row_req[j] == row_req[r]]
            parent.append(int(rng.choice(same)))
        tokens = rng.integers(3, spec.vocab_size, R).tolist()
        hist = [hist[p] + [t] for p, t in zip(parent, tokens)]
        batch.apply(torch.tensor(tokens), torch.tensor(parent))
        if step == 2:  # request 1 (tenant c) leaves; the others continue unchanged
            keep = batch.remove([1]).tolist()
            hist, src = [hist[i] for i in keep], [src[i] for i in keep]
            row_tenant = [row_tenant[i] for i in keep]
            row_req = [row_req[i] for i in keep]
        logits = batch.decode()
    assert batch.rows == sum(r for _, r, _ in plan) - 1
    cross = batch._structure()[2]
    if spec.encoder_decoder:
        assert (cross.cached is not None) == keep_sources
        assert not keep_sources or len(cross.cached) == spec.dec_layers


@pytest.mark.parametrize("name", ("bart-tiny",))
def test_cross_cache_one_copy_per_source(name):
    spec = PRESETS[name]
    models = tenants_for(spec)
    batch = make_batch(spec, models)
    free0 = batch.pool.free_blocks
    batch.admit([JoiningRequest("k", "a", [2], 4, 8, source=list(range(3, 23)))])
    assert batch.rows == 4
    assert batch.cross_positions("k") == 20  # once, not 4 x 20
    B = batch.pool.block
    used = free0 - batch.pool.free_blocks
    assert used == 1 + 4 * (8 // B) + -(-20 // B)
    batch.remove(["k"])
    assert batch.pool.free_blocks == free0


def overflowing(spec, seed: int):
    """A model whose first attention's scores overflow to inf (finite weights, as an upload
    must have), so its rows and the K/V it writes become NaN from there on."""
    m = hf_model(spec, seed)
    if spec.family == "gpt2":
        ws = [m.transformer.h[0].attn.c_attn.weight]
    else:
        att = (m.model.encoder if spec.encoder_decoder else m.model.decoder).layers[0].self_attn
        ws = [att.q_proj.weight, att.k_proj.weight]
    with torch.no_grad():
        for w in ws:
            w.mul_(1e20)
    return m


@pytest.mark.parametrize("name", SPECS)
def test_a_tenant_whose_activations_overflow_never_reaches_another(name):
    """Tenant ``hot`` is the batch's first (row 0 of the packed prompts/sources, the first
    pool blocks) and its rows turn NaN; every other row still equals Hugging Face. Then ``hot``
    leaves and a new request takes its freed blocks, NaN K/V and all."""
    spec = PRESETS[name]
    models = {"hot": overflowing(spec, 3), **tenants_for(spec)}
    batch = make_batch(spec, models)
    rng = np.random.default_rng(1)
    start = {"bart": 2, "marian": spec.pad_token_id}.get(spec.family)
    rows = {}  # key -> (tenant, source, history); each request here has one row

    def admission(key, tenant, n):
        toks = rng.integers(3, spec.vocab_size - 1, n).tolist()
        hist = [start] if spec.encoder_decoder else list(toks)
        rows[key] = (tenant, toks, hist)
        src = toks if spec.encoder_decoder else None
        return JoiningRequest(key, tenant, hist, 1, 6, source=src)

    order = ["h", "a", "c"]
    logits = batch.admit([admission("h", "hot", 9), admission("a", "a", 3), admission("c", "c", 6)])
    for step in range(6):
        if step == 3:  # hot left at the end of step 2: b's request takes its freed blocks
            free = batch.pool.free_blocks
            logits = torch.cat([logits, batch.admit([admission("b", "b", 7)])])
            assert batch.pool.free_blocks < free
            order.append("b")
        for r, key in enumerate(order):
            tenant, src, hist = rows[key]
            if tenant == "hot":
                assert not torch.isfinite(logits[r]).any()  # the premise: its rows overflowed
                continue
            want = hf_logits(spec, models[tenant], src, hist)
            torch.testing.assert_close(logits[r], want, atol=1e-4, rtol=1e-4)
        tokens = rng.integers(3, spec.vocab_size, len(order)).tolist()
        for key, t in zip(order, tokens):
            rows[key][2].append(t)
        batch.apply(torch.tensor(tokens), torch.arange(len(order)))
        if step == 2:  # after two decode steps: its blocks hold NaN K/V of 2 positions
            order = [order[i] for i in batch.remove(["h"]).tolist()]
        logits = batch.decode()


def test_tied_embeddings_stored_once_and_shared_across_tenants():
    spec = PRESETS["gpt2-tiny"]
    models = tenants_for(spec)
    w = to_canonical(spec, models["a"].state_dict())
    assert "lm_head.weight" not in w.tensors
    store = WeightStore("cpu", torch.float32)
    store.add("a", w)
    one = store.weight_bytes
    store.add("b", to_canonical(spec, models["b"].state_dict()))
    ffn = spec.ffn * spec.hidden * 4
    assert store.weight_bytes == one + ffn  # b adds only its retrained FFN weight


def test_untied_lm_head_that_differs_is_refused():
    spec = PRESETS["bart-tiny"]
    sd = dict(hf_model(spec, 1).state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(InvalidWeights, match="lm_head.weight"):
        to_canonical(spec, sd)


def test_spec_from_config_and_marian_sinusoids():
    spec = PRESETS["marian-tiny"]
    m = hf_model(spec, 1)
    s = spec_from_hf_config(m.config.to_dict())
    assert (s.family, s.hidden, s.enc_layers, s.scale_embedding, s.act) == (
        "marian",
        32,
        2,
        True,
        "silu",
    )
    torch.testing.assert_close(
        spec.sinusoidal(), m.model.decoder.embed_positions.weight, atol=0, rtol=0
    )
