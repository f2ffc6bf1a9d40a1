"""Sampling on a llama base tenant and a LoRA tenant draws from Hugging Face's distribution.

Issue #62: sampling with a fixed seed matches HF's distribution (a chi-squared test over many
draws). The oracle distribution of the first sampled token is ``generate()``'s own: with
``output_scores`` it returns the scores after every logits processor and warper it applied
(temperature, top-k, top-p, in its order), whose softmax is what it samples from; for the LoRA
tenant, the PEFT model's. itif draws the first token of thousands of rows (many requests with
different seeds, each returning many sequences, both tenants with their own settings in one
``generate`` call), and Pearson's chi-squared test (``scipy.stats.chisquare``, bins expected
under 5 draws pooled, a draw where the oracle has probability 0 rejecting outright) accepts
them at p > 0.001. The seeds are fixed, so the test is deterministic; a correct sampler would
fail it for 1 choice of seeds in 1,000.

The test has power: the same draws reject distributions a sampler with a typical bug would
draw from (temperature ignored, top-p keeping one token too many or too few, top-k ignored),
and itif's own draws with the temperature left at 1 are rejected against the distribution at
the requested temperature. The draws are independent too (a test of independence of pairs:
neighbouring rows of one request, requests of neighbouring seeds), which a marginal test alone
would not see. A fixed seed gives the same tokens twice, a different one others.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from itif.generation.api import GenerateRequest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
stats = pytest.importorskip("scipy.stats")

from itif.generation.engine import GenEngine  # noqa: E402 (imported after importorskip)
from tests.test_llama_lora import ADAPTERS, EOS, base_model, peft_model  # noqa: E402 (imported after importorskip)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 33, 8]
#: tenant -> its sampling settings (the LoRA tenant's differ: settings are per row)
SETTINGS = {"a": {"temperature": 0.7, "top_k": 12, "top_p": 0.9},
            "qv4": {"temperature": 0.9, "top_k": 0, "top_p": 0.7}}
REQUESTS, RETURNED = 200, 40  # per tenant: 8,000 draws
ALPHA = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_sampling")
    base = base_model(1)
    base.save_pretrained(root / "a")
    pm = peft_model(base, ADAPTERS["qv4"][1], 10)
    pm.save_pretrained(root / "qv4")
    eng = GenEngine(root / "a")
    eng.add_tenant("a", root / "a")
    eng.add_tenant("qv4", root / "qv4", base="a")
    return eng, {"a": base, "qv4": pm}


def hf_probs(model, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution ``generate()`` samples PROMPT's next token from (float64)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([PROMPT]), do_sample=True, max_new_tokens=1,
                             temperature=temperature, top_k=top_k, top_p=top_p,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=EOS)
    return out.scores[0][0].double().softmax(-1).numpy()


def draws(eng: GenEngine, settings: dict[str, dict], seed0: int = 1000
          ) -> dict[str, np.ndarray]:
    """Per tenant, itif's first sampled token of REQUESTS x RETURNED rows ``[request, row]``
    (request ``i`` with seed ``seed0 + i``), all of both tenants in one generate call."""
    reqs = [GenerateRequest(t, PROMPT, max_new_tokens=1, do_sample=True, seed=seed0 + i,
                            num_return_sequences=RETURNED, **kw)
            for t, kw in settings.items() for i in range(REQUESTS)]
    got = eng.generate(reqs)
    out = {}
    for j, t in enumerate(settings):
        rows = [g.sequences for g in got[j * REQUESTS:(j + 1) * REQUESTS]]
        assert all(g.tenant == t for g in got[j * REQUESTS:(j + 1) * REQUESTS])
        assert all(len(s) == RETURNED and all(len(x) == 1 for x in s) for s in rows)
        out[t] = np.array([[x[0] for x in s] for s in rows])
    return out


def counts_of(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(tokens.reshape(-1), minlength=vocab)


def independence_p(first: np.ndarray, second: np.ndarray) -> float:
    """The chi-squared test of independence of paired draws (the 4 most frequent tokens and
    the rest as bins): a sampler whose rows or seeds share their noise draws pairs alike."""
    top = np.argsort(-np.bincount(np.concatenate([first, second])))[:4]
    bin_of = np.full(int(max(first.max(), second.max())) + 1, 4)
    bin_of[top] = np.arange(4)
    table = np.zeros((5, 5), dtype=np.int64)
    np.add.at(table, (bin_of[first], bin_of[second]), 1)
    return float(stats.chi2_contingency(table).pvalue)


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-squared p-value of ``counts`` drawn from ``probs``; bins expected under 5
    draws pooled into one; 0 when a token of probability 0 was drawn."""
    n = int(counts.sum())
    expected = probs * n
    if counts[probs == 0].any():
        return 0.0
    rare = (expected < 5) & (probs > 0)
    obs, exp = list(counts[expected >= 5]), list(expected[expected >= 5])
    if rare.any():
        obs.append(counts[rare].sum())
        exp.append(expected[rare].sum())
    exp = np.asarray(exp) * n / np.sum(exp)  # the float sum of the expectations is n
    return float(stats.chisquare(np.asarray(obs), exp).pvalue)


def top_p_off_by_one(model, settings: dict, more: bool) -> np.ndarray:
    """The distribution of a top-p that keeps one token more (or fewer) than ``generate()``."""
    right = hf_probs(model, **settings)
    before = hf_probs(model, **{**settings, "top_p": 1.0})  # temperature and top-k only
    kept = right > 0
    order = np.argsort(-before, kind="stable")
    n = int(kept.sum())
    assert set(order[:n]) == set(np.flatnonzero(kept))
    keep = order[: n + 1] if more else order[: n - 1]
    wrong = np.zeros_like(before)
    wrong[keep] = before[keep]
    return wrong / wrong.sum()


def test_first_sampled_tokens_follow_hf_distribution_base_and_lora(setup):
    eng, models = setup
    tokens = draws(eng, SETTINGS)
    vocab = eng.spec.vocab_size
    for t, kw in SETTINGS.items():
        want, counts = hf_probs(models[t], **kw), counts_of(tokens[t], vocab)
        assert counts.sum() == REQUESTS * RETURNED
        p = chi2_p(counts, want)
        print(f"{t}: {int((want > 0).sum())} tokens kept, chi-squared p = {p:.3f}")
        assert p > ALPHA, (t, p)
        # what a wrong sampler would draw from is rejected by the same draws
        wrong = {"temperature ignored": hf_probs(models[t], **{**kw, "temperature": 1.0}),
                 "top_p one more": top_p_off_by_one(models[t], kw, more=True),
                 "top_p one fewer": top_p_off_by_one(models[t], kw, more=False)}
        if kw["top_k"]:
            wrong["top_k ignored"] = hf_probs(models[t], **{**kw, "top_k": 0})
        for what, probs in wrong.items():
            assert chi2_p(counts, probs) < 1e-6, (t, what)
        # independent draws: neighbouring rows of a request, and requests of neighbouring seeds
        rows = tokens[t]
        assert independence_p(rows[:, 0::2].reshape(-1), rows[:, 1::2].reshape(-1)) > ALPHA
        assert independence_p(rows[:-1:2].reshape(-1), rows[1::2].reshape(-1)) > ALPHA
    # the adapter changes the distribution: the base's draws do not pass for the adapter's
    assert chi2_p(counts_of(tokens["a"], vocab), hf_probs(models["qv4"], **SETTINGS["a"])) < 1e-6


def test_a_sampler_ignoring_the_temperature_is_rejected(setup):
    """itif's draws at temperature 1 fail the test against generate()'s at 0.7."""
    eng, models = setup
    kw = SETTINGS["a"]
    tokens = draws(eng, {"a": {**kw, "temperature": 1.0}}, seed0=5000)["a"]
    counts = counts_of(tokens, eng.spec.vocab_size)
    assert chi2_p(counts, hf_probs(models["a"], **{**kw, "temperature": 1.0})) > ALPHA
    assert chi2_p(counts, hf_probs(models["a"], **kw)) < 1e-6


def test_the_same_seed_gives_the_same_tokens(setup):
    eng, _ = setup

    def run(seed: int) -> list[list[list[int]]]:
        reqs = [GenerateRequest(t, PROMPT[: 2 + i], max_new_tokens=10, do_sample=True,
                                seed=seed + i, num_return_sequences=3, **SETTINGS[t])
                for i, t in enumerate(["a", "qv4", "a", "qv4"])]
        return [g.sequences for g in eng.generate(reqs)]

    first = run(7)
    assert run(7) == first
    assert run(107) != first
    assert all(len(set(map(tuple, seqs))) > 1 for seqs in first)  # rows draw apart
