"""The vectorised decoding search (itif.generation.search) against Hugging Face ``generate()``.

Tenants are tiny random-initialised GPT-2, BART and Marian models sharing one vocabulary (96
tokens, so EOS comes up), with the checkpoint settings their real counterparts ship (BART:
forced BOS/EOS; Marian: forced EOS and its pad token banned). Many requests of all of them, with
different parameters, run in ONE SearchBatch, some joining mid-way; the logits of each step come
from the Hugging Face model of the row's tenant on the row's whole token history (no cache,
called on a request's rows together as ``generate(use_cache=False)`` calls it, so the logits are
the same bits). Every request's token ids must equal ``generate()`` run on that request alone,
and beam scores its ``sequences_scores``.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from itif.errors import InvalidRequest
from itif.generation.api import GenerateRequest, GenerationDefaults
from itif.generation.processors import (
    ban_bad_words,
    ban_repeated_ngrams,
    exponential_noise,
    sample_tokens,
)
from itif.generation.search import SearchBatch, search_params

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore:Unfeasible length constraints"),
              pytest.mark.usefixtures("one_torch_thread")]

V = 96


def _tiny(family: str, seed: int):
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        GPT2Config,
        GPT2LMHeadModel,
        MarianConfig,
        MarianMTModel,
    )
    torch.manual_seed(seed)
    seq2seq = dict(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        init_std=0.1,
    )
    if family == "gpt2":
        m = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=V,
                n_positions=128,
                n_embd=32,
                n_layer=2,
                n_head=2,
                bos_token_id=5,
                eos_token_id=5,
                initializer_range=0.1,
            )
        )
    elif family == "bart":
        m = BartForConditionalGeneration(
            BartConfig(
                **seq2seq, bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2
            )
        )
        m.generation_config.forced_bos_token_id = 0
        m.generation_config.forced_eos_token_id = 2
    else:
        m = MarianMTModel(
            MarianConfig(**seq2seq, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        )
        m.generation_config.forced_eos_token_id = 1
        m.generation_config.bad_words_ids = [[0]]
    with torch.no_grad():  # biases and LayerNorms away from 0/1; a logits bias so the EOS comes up
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
        if hasattr(m, "final_logits_bias"):
            m.final_logits_bias.normal_(0, 1.0)
    return m.eval()


class Tenant:
    def __init__(self, family: str, seed: int, **generation_config):
        self.model = _tiny(family, seed)
        self.enc_dec = family != "gpt2"
        g = self.model.generation_config
        for k, v in generation_config.items():
            setattr(g, k, v)
        eos = g.eos_token_id
        self.defaults = GenerationDefaults(
            eos_token_ids=tuple(eos)
            if isinstance(eos, list)
            else ((eos,) if eos is not None else ()),
            pad_token_id=g.pad_token_id,
            bos_token_id=g.bos_token_id,
            decoder_start_token_id=g.decoder_start_token_id,
            forced_bos_token_id=g.forced_bos_token_id,
            forced_eos_token_id=g.forced_eos_token_id,
            bad_words_ids=tuple(tuple(w) for w in (g.bad_words_ids or ())),
            min_length=g.min_length or 0,
            min_new_tokens=g.min_new_tokens or 0,
        )

    def history(self, req: GenerateRequest) -> list[int]:
        return [self.defaults.decoder_start_token_id] if self.enc_dec else list(req.input_ids)

    @torch.no_grad()
    def encode(self, req: GenerateRequest):
        ids = torch.tensor([list(req.input_ids)])
        return self.model.get_encoder()(
            input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True
        )

    @torch.no_grad()
    def logits(self, rows: list[list[int]], req: GenerateRequest, enc) -> torch.Tensor:
        """The last position's logits of ``rows`` (one request's rows, equal lengths), called as
        generate(use_cache=False) calls the model."""
        n = len(rows)
        if self.enc_dec:
            h = enc.last_hidden_state.repeat_interleave(n, dim=0)
            out = self.model(
                encoder_outputs=(h,),
                attention_mask=torch.ones(n, h.shape[1], dtype=torch.long),
                decoder_input_ids=torch.tensor(rows),
                use_cache=False,
            )
        else:
            out = self.model(input_ids=torch.tensor(rows), use_cache=False, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    @torch.no_grad()
    def generate(self, req: GenerateRequest):
        """(sequences without the prompt / start token and without padding, scores or None)."""
        kw = dict(
            max_new_tokens=req.max_new_tokens,
            num_beams=req.num_beams,
            do_sample=req.do_sample,
            num_return_sequences=req.num_return_sequences,
            use_cache=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
        if req.num_beams > 1:
            kw.update(early_stopping=req.early_stopping, length_penalty=req.length_penalty)
        if req.no_repeat_ngram_size:
            kw["no_repeat_ngram_size"] = req.no_repeat_ngram_size
        if req.eos_token_id is not None:
            kw["eos_token_id"] = req.eos_token_id
        if req.do_sample:
            kw.update(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        out = self.model.generate(torch.tensor([list(req.input_ids)]), **kw)
        start = 1 if self.enc_dec else len(req.input_ids)
        eos = (
            {req.eos_token_id} if req.eos_token_id is not None else set(self.defaults.eos_token_ids)
        )
        if req.num_beams > 1:
            lengths = (out.beam_indices >= 0).sum(-1).tolist()
            seqs = [s[start:start + n] for s, n in zip(out.sequences.tolist(), lengths)]
            return seqs, out.sequences_scores.tolist()
        seqs = []
        for s in out.sequences.tolist():
            s = s[start:]
            cut = next((i + 1 for i, t in enumerate(s) if t in eos), len(s))
            seqs.append(s[:cut])
        return seqs, None


@pytest.fixture(scope="module")
def tenants():
    return {"gpt2-a": Tenant("gpt2", 1), "gpt2-b": Tenant("gpt2", 2), "bart": Tenant("bart", 3),
            "marian": Tenant("marian", 4)}


def drive(tenants, jobs, device="cpu", cancel=None):
    """Run ``jobs`` [(key, join_step, GenerateRequest)] through one SearchBatch; key -> result.

    The driver plays the engine: logits per request from its tenant's model, rows reordered by
    ``parent``, finished requests removed (and the row list compacted by ``keep``)."""
    sb = SearchBatch(V, device=device)
    order: list[tuple] = []         # (key, n_rows) in row order
    rows: list[list[int]] = []      # every row's decoder tokens
    enc, reqs, results, streamed, sent = {}, {}, {}, {}, {}
    pending = sorted(jobs, key=lambda j: j[1])
    step = 0
    while pending or order:
        while pending and pending[0][1] <= step:
            key, _, req = pending.pop(0)
            ten = tenants[req.tenant]
            p = search_params(req, ten.defaults, ten.enc_dec)
            sl = sb.add(key, p, ten.history(req))
            assert sl == slice(len(rows), len(rows) + p.rows)
            order.append((key, p.rows))
            rows += [ten.history(req)] * p.rows
            reqs[key] = req
            enc[key] = ten.encode(req) if ten.enc_dec else None
        assert sb.rows == len(rows)
        logits, at = [], 0
        for key, n in order:
            req = reqs[key]
            logits.append(tenants[req.tenant].logits(rows[at:at + n], req, enc[key]))
            at += n
        res = sb.step(torch.cat(logits).to(device))
        par, tok = res.parent.tolist(), res.tokens.tolist()
        assert all(0 <= q < len(rows) for q in par)
        rows = [rows[q] + [t] for q, t in zip(par, tok)]
        new = sb.new_tokens({k: sent.get(k, 0) for k, _ in order})  # the engine's batched form
        for key, n in order:
            s = sb.tokens_of(key)
            if s is not None:
                streamed.setdefault(key, []).append(list(s))
                assert new.get(key, []) == s[sent.get(key, 0):], (key, new, s)
                sent[key] = len(s)
            else:
                assert key not in new
        if res.finished:
            out, keep = sb.remove(res.finished)
            results.update(out)
            rows = [rows[i] for i in keep.tolist()]
            order = [(k, n) for k, n in order if k not in out]
        gone = [k for k, n in order if (cancel or {}).get(k) == step]
        if gone:  # the engine cancels requests between steps, whatever their state
            out, keep = sb.remove(gone)
            results.update(out)
            rows = [rows[i] for i in keep.tolist()]
            order = [(k, n) for k, n in order if k not in out]
        step += 1
        assert step < 500
    assert sb.rows == 0 and len(sb) == 0
    return results, streamed


def check_against_hf(tenants, jobs, results):
    reasons = set()
    for key, _, req in jobs:
        want, want_scores = tenants[req.tenant].generate(req)
        got = results[key]
        assert got.sequences == want, (key, req)
        if want_scores is None:
            assert got.scores is None
        else:
            assert got.scores == pytest.approx(want_scores, abs=1e-5), (key, req)
        reasons.update(got.finish_reasons)
        assert len(got.finish_reasons) == len(got.sequences)
    return reasons


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(6, V) for _ in range(rng.randrange(1, 12))]


def test_greedy_and_beam_mixed_tenants_equal_hf(tenants):
    rng = random.Random(0)
    jobs = []
    names = list(tenants)
    combos = [(nb, es, ng, lp) for nb in (1, 2, 3, 4, 5) for es in (True, False, "never")
              for ng in (0, 3) for lp in (1.0, 0.6, 1.7)]
    rng.shuffle(combos)
    for i, (nb, es, ng, lp) in enumerate(combos):
        kw = dict(num_beams=nb, no_repeat_ngram_size=ng, max_new_tokens=rng.randrange(1, 14))
        if nb > 1:
            kw.update(
                early_stopping=es, length_penalty=lp, num_return_sequences=rng.randrange(1, nb + 1)
            )
        req = GenerateRequest(tenant=names[i % len(names)], input_ids=_prompt(rng), **kw)
        jobs.append((f"r{i}", rng.choice((0, 0, 1, 3, 6)), req))
    results, streamed = drive(tenants, jobs)
    reasons = check_against_hf(tenants, jobs, results)
    assert reasons == {"eos", "length"}  # the set exercises both ends
    # streaming: a greedy request's tokens grow one by one into its result
    for key, _, req in jobs:
        if req.num_beams == 1:
            seen = streamed[key]
            assert seen[-1] == results[key].sequences[0]
            assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))
        else:
            assert key not in streamed


def test_joining_and_leaving_do_not_change_results(tenants):
    rng = random.Random(1)
    base = [
        (
            f"b{i}",
            0,
            GenerateRequest(
                tenant=t,
                input_ids=_prompt(rng),
                num_beams=nb,
                max_new_tokens=9,
                num_return_sequences=min(2, nb),
                length_penalty=1.3,
            ),
        )
        for i, (t, nb) in enumerate([("gpt2-a", 3), ("bart", 4), ("marian", 2), ("gpt2-b", 1)])
    ]
    alone, _ = drive(tenants, base)
    extra = [
        (
            f"x{i}",
            i + 1,
            GenerateRequest(
                tenant=rng.choice(list(tenants)),
                input_ids=_prompt(rng),
                num_beams=rng.choice((1, 2, 4)),
                max_new_tokens=rng.randrange(1, 8),
                no_repeat_ngram_size=3,
            ),
        )
        for i in range(6)
    ]
    crowded, _ = drive(tenants, base + extra)
    for key, _, _ in base:
        assert crowded[key] == alone[key]


def test_cancelled_requests_leave_without_changing_the_others(tenants):
    rng = random.Random(6)
    keep = [
        (
            f"k{i}",
            0,
            GenerateRequest(tenant=t, input_ids=_prompt(rng), num_beams=nb, max_new_tokens=10),
        )
        for i, (t, nb) in enumerate([("gpt2-a", 3), ("marian", 1), ("bart", 2)])
    ]
    go = [
        (
            "c0",
            0,
            GenerateRequest(
                tenant="gpt2-b",
                input_ids=_prompt(rng),
                num_beams=4,
                max_new_tokens=30,
                num_return_sequences=2,
            ),
        ),
        (
            "c1",
            0,
            GenerateRequest(
                tenant="bart",
                input_ids=[9, 10],
                do_sample=True,
                seed=5,
                max_new_tokens=30,
                num_return_sequences=2,
            ),
        ),
        ("c2", 0, GenerateRequest(tenant="gpt2-a", input_ids=_prompt(rng), max_new_tokens=30)),
    ]
    alone, _ = drive(tenants, keep)
    mixed, _ = drive(tenants, keep + go, cancel={"c0": 1, "c1": 2, "c2": 3})
    for key, _, _ in keep:
        assert mixed[key] == alone[key]
    for key, _, req in go:
        got = mixed[key]
        assert got.finish_reasons == ["cancelled"] * len(got.sequences)
        assert len(got.sequences) == req.num_return_sequences
        assert all(0 < len(s) <= 4 for s in got.sequences)


def test_checkpoint_settings_and_request_eos(tenants):
    """The checkpoint's settings as generate() honours them: min_length (counting the prompt, or
    the start token) and min_new_tokens, forced BOS/EOS, single- and multi-token bad words,
    several EOS ids (3 * num_beams candidates), and a request's own eos_token_id replacing them;
    length penalties below zero, zero and above one."""
    rng = random.Random(2)
    mt = dict(tenants)
    mt["gpt2-min"] = Tenant("gpt2", 5, min_length=6)
    mt["bart-min"] = Tenant("bart", 6, min_new_tokens=3)
    mt["gpt2-multi"] = Tenant(
        "gpt2", 7, eos_token_id=[5, 9], bad_words_ids=[[12, 13], [20, 21, 22], [7], [9]]
    )
    mt["marian-min"] = Tenant("marian", 8, min_length=5)
    jobs = []
    for i, name in enumerate(["gpt2-min", "bart-min", "gpt2-multi", "marian-min", "bart", "marian",
                              "gpt2-multi"]):
        for nb in (1, 2, 3, 4):
            req = GenerateRequest(
                tenant=name,
                input_ids=_prompt(rng)[:4],
                num_beams=nb,
                max_new_tokens=rng.choice((1, 2, 7, 10)),
                eos_token_id=rng.choice((None, 7)) if name.startswith("gpt2") else None,
                length_penalty=rng.choice((1.0, -0.5, 0.0, 2.0)) if nb > 1 else 1.0,
                early_stopping=rng.choice((True, False, "never")) if nb > 1 else False,
                no_repeat_ngram_size=rng.choice((0, 2, 3)),
            )
            jobs.append((f"{name}-{nb}-{i}", rng.choice((0, 2)), req))
    results, _ = drive(mt, jobs)
    check_against_hf(mt, jobs, results)
    for key, _, req in jobs:
        d = mt[req.tenant].defaults
        eos = {req.eos_token_id} if req.eos_token_id is not None else set(d.eos_token_ids)
        for seq in results[key].sequences:
            if req.tenant.startswith("bart"):
                assert seq[0] == 0 or (
                    req.max_new_tokens == 1 and seq == [2]
                )  # forced BOS (EOS wins at 1)
            if req.tenant.startswith("marian"):
                assert 0 not in seq                                                 # pad banned
            if req.tenant == "gpt2-multi":
                assert 7 not in seq or 7 in eos
                assert all(seq[j:j + 2] != [12, 13] for j in range(len(seq)))
            if seq and seq[-1] in eos and len(seq) < req.max_new_tokens:
                if req.tenant == "gpt2-min":
                    assert len(req.input_ids) + len(seq) > 6
                if req.tenant == "bart-min":
                    assert len(seq) > 3


def test_sampling_reproducible_and_equal_to_hf_warpers(tenants):
    """Sampling: the same seed gives the same tokens whatever else is in the batch; and with
    torch.multinomial drawing from the same noise, generate() with its temperature/top-k/top-p
    warpers picks exactly the same tokens (so the warpers and the draw match generate()'s)."""
    rng = random.Random(3)
    names = list(tenants)
    jobs = []
    for i in range(8):
        req = GenerateRequest(
            tenant=names[i % 4],
            input_ids=_prompt(rng),
            do_sample=True,
            seed=1000 + i,
            max_new_tokens=rng.randrange(2, 12),
            num_return_sequences=rng.choice((1, 3)),
            temperature=rng.choice((1.0, 0.7, 1.5)),
            top_k=rng.choice((0, 5, 20)),
            top_p=rng.choice((1.0, 0.9, 0.5)),
            no_repeat_ngram_size=rng.choice((0, 3)),
        )
        jobs.append((f"s{i}", rng.choice((0, 2)), req))
    # top_p = 0 keeps only the most likely token, as generate()'s warper does
    jobs.append(
        (
            "p0",
            1,
            GenerateRequest(
                tenant="gpt2-b",
                input_ids=[4, 8, 15],
                do_sample=True,
                seed=77,
                max_new_tokens=6,
                temperature=1.3,
                top_p=0.0,
            ),
        )
    )
    alone, _ = drive(tenants, jobs[:3])
    crowded, _ = drive(
        tenants,
        jobs
        + [
            (
                f"g{i}",
                i,
                GenerateRequest(
                    tenant="bart", input_ids=_prompt(rng), num_beams=2, max_new_tokens=5
                ),
            )
            for i in range(3)
        ],
    )
    for key, _, _ in jobs[:3]:
        assert crowded[key] == alone[key]
    for key, _, req in jobs:
        seed = torch.tensor([req.seed])
        calls = {"n": 0}

        def multinomial(probs, num_samples, *a, **kw):
            n = probs.shape[0]
            q = exponential_noise(
                seed.expand(n), torch.arange(n), torch.full((n,), calls["n"]), probs.shape[1]
            )
            calls["n"] += 1
            return (probs / q).argmax(-1, keepdim=True)

        with mock.patch("torch.multinomial", multinomial):
            want, _ = tenants[req.tenant].generate(req)
        assert crowded[key].sequences == want, (key, req)
    # different seeds give different samples
    def sampled(key: str, seed: int):
        req = GenerateRequest(tenant="gpt2-a", input_ids=[9, 9], do_sample=True, seed=seed,
                              max_new_tokens=12)
        return drive(tenants, [(key, 0, req)])[0][key].sequences

    assert sampled("a", 1) != sampled("b", 2)


def test_sample_draws_follow_softmax():
    """The draw is distributed as softmax(scores): 20000 draws (seeds, rows and steps varied)
    land on each token within 4 standard deviations of its probability; a banned token never."""
    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    probs = torch.softmax(scores, -1)
    n = 20000
    i = torch.arange(n)
    tok = sample_tokens(scores.expand(n, -1).clone(), seed=i // 7, row=i % 7, step=i % 5)
    freq = torch.bincount(tok, minlength=6).double() / n
    sd = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 4 * sd + 1e-12).all(), (freq, probs)
    assert freq[4] == 0


def _banned_oracle(hist: list[int], n: int) -> set[int]:
    if n <= 0 or len(hist) < n:
        return set()
    prefix = tuple(hist[len(hist) - n + 1:])
    return {hist[s + n - 1] for s in range(len(hist) - n + 1) if tuple(hist[s:s + n - 1]) == prefix}


def test_ngram_blocker_property():
    """On random short histories over a tiny alphabet (repeats everywhere), the vectorised blocker
    bans exactly the tokens that would complete an n-gram already present, per row, whatever the
    mix of sizes and lengths in the batch."""
    rng = random.Random(4)
    for _ in range(30):
        rows = rng.randrange(1, 9)
        vocab = rng.choice((3, 4, 8))
        hists = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 25))] for _ in range(rows)]
        sizes = [rng.choice((0, 1, 2, 3, 4)) for _ in range(rows)]
        width = max(map(len, hists)) + rng.randrange(0, 4)
        h = torch.tensor(
            [x + [rng.randrange(vocab)] * (width - len(x)) for x in hists]
        )  # junk past the end
        scores = torch.randn(rows, vocab)
        out = ban_repeated_ngrams(
            scores.clone(), h, torch.tensor(list(map(len, hists))), torch.tensor(sizes), max(sizes)
        )
        for r in range(rows):
            banned = _banned_oracle(hists[r], sizes[r])
            assert {i for i in range(vocab) if out[r, i] == float("-inf")} == banned
            keep = [i for i in range(vocab) if i not in banned]
            assert torch.equal(out[r, keep], scores[r, keep])
            # the property: appending any token still allowed never repeats an n-gram
            n = sizes[r]
            for t in keep:
                seq = hists[r] + [t]
                if n and len(seq) >= n:
                    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
                    assert grams.count(tuple(seq[-n:])) == 1


def test_bad_words_blocker_against_python():
    """Multi-token bad words: a sequence bans its last token exactly when the history ends with
    the rest of it (a prefix longer than the history bans nothing), rows padded differently."""
    rng = random.Random(5)
    for _ in range(40):
        rows, vocab = rng.randrange(1, 6), rng.choice((3, 5))
        hists = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] for _ in range(rows)]
        words = [
            [
                [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
                for _ in range(rng.randrange(0, 4))
            ]
            for _ in range(rows)
        ]
        w = max(len(x) for x in words)
        p = max([len(s) - 1 for x in words for s in x], default=0)
        width = max(map(len, hists))
        h = torch.tensor([x + [0] * (width - len(x)) for x in hists])
        last = torch.tensor([[s[-1] for s in x] + [-1] * (w - len(x)) for x in words]).view(rows, w)
        plen = torch.tensor([[len(s) - 1 for s in x] + [0] * (w - len(x)) for x in words]).view(
            rows, w
        )
        pre = torch.tensor(
            [
                [[-1] * (p - len(s) + 1) + s[:-1] for s in x] + [[-1] * p] * (w - len(x))
                for x in words
            ]
        ).view(rows, w, p)
        scores = torch.randn(rows, vocab)
        out = ban_bad_words(scores.clone(), h, torch.tensor(list(map(len, hists))), pre, plen, last)
        for r in range(rows):
            want = {s[-1] for s in words[r] if len(s) - 1 <= len(hists[r])
                    and (len(s) == 1 or hists[r][-(len(s) - 1):] == s[:-1])}
            assert {i for i in range(vocab) if out[r, i] == float("-inf")} == want


def test_bad_input_is_named(tenants):
    sb = SearchBatch(V)
    t = tenants["gpt2-a"]
    p = search_params(GenerateRequest(tenant="gpt2-a", input_ids=[3, 4]), t.defaults, False)
    with pytest.raises(InvalidRequest, match="history"):
        sb.add("k", p, [3])
    with pytest.raises(InvalidRequest, match="history"):
        sb.add("k", p, [3, V])
    sb.add("k", p, [3, 4])
    with pytest.raises(InvalidRequest, match="key"):
        sb.add("k", p, [3, 4])
    with pytest.raises(ValueError, match="logits"):
        sb.step(torch.zeros(2, V))
    with pytest.raises(KeyError):
        sb.remove(["nope"])
    for seed in (2 ** 64 + 3, -5):  # any integer seed is accepted (folded into int64)
        r = GenerateRequest(tenant="gpt2-a", input_ids=[3, 4], do_sample=True, seed=seed)
        sb.add(seed, search_params(r, t.defaults, False), [3, 4])
    assert sb.rows == 3


def test_search_params_resolution(tenants):
    bart = tenants["bart"].defaults
    p = search_params(GenerateRequest(tenant="bart", input_ids=[4, 5, 6], num_beams=3), bart, True)
    assert (p.mode, p.rows, p.prompt_len, p.eos_token_ids, p.forced_bos_token_id) == (
        "beam",
        3,
        1,
        (2,),
        0,
    )
    g = GenerationDefaults(eos_token_ids=(5, 9), min_length=10, bad_words_ids=((9,), (7,), (3, 4)))
    p = search_params(GenerateRequest(tenant="x", input_ids=[1, 2, 3, 4], eos_token_id=7), g, False)
    assert p.eos_token_ids == (7,) and p.pad_token_id == 7 and p.min_new_tokens == 6
    assert p.bad_words_ids == (
        (9,),
        (3, 4),
    )  # a ban equal to the EOS is dropped, as generate() does
    p = search_params(
        GenerateRequest(tenant="x", input_ids=[1], do_sample=True, num_return_sequences=4), g, False
    )
    assert p.rows == 4 and p.pad_token_id == 5


def test_repeated_ngram_bans_in_row_chunks_equal_the_whole_batch(monkeypatch):
    """The window comparison of ``ban_repeated_ngrams`` is rows x widest history x (n - 1):
    one request of many long rows with a large n ran it out of memory in the search step (which
    fails every running request). It now runs in row chunks of at most NGRAM_CHUNK elements,
    banning exactly what one pass bans."""
    import torch

    from itif.generation import processors

    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 37, 50, 12
    hist = torch.randint(0, 4, (rows, width), generator=g)  # few ids: many repeats
    hlen = torch.randint(0, width + 1, (rows,), generator=g)
    ngram = torch.randint(0, 5, (rows,), generator=g)
    whole = processors.ban_repeated_ngrams(torch.zeros(rows, vocab), hist, hlen, ngram, 4)
    assert torch.isinf(whole).any()
    monkeypatch.setattr(processors, "NGRAM_CHUNK", 3 * width * 3)  # 3 rows a chunk
    chunked = processors.ban_repeated_ngrams(torch.zeros(rows, vocab), hist, hlen, ngram, 4)
    assert torch.equal(whole, chunked)
