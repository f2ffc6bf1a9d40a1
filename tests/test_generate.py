"""GenEngine.generate against Hugging Face generate() (CPU, float32, tiny random checkpoints).

Per family (GPT-2, BART, Marian): three tenants saved as Hugging Face checkpoint directories
(config, generation_config, safetensors), many requests of all of them in one ``generate`` call
(greedy and beam search: num_beams 1-5, early_stopping True/False/"never", length penalties,
no_repeat_ngram_size 0 and 3, num_return_sequences > 1, varied prompt lengths), each equal token
for token to ``generate()`` of its tenant's own model. Plus: a beam-4 request's cross-attention
cache holds one copy of its source; requests joining a running batch leave the others' outputs
unchanged; a cancelled request frees its blocks; sampling is reproducible for a seed; bad
parameters raise InvalidRequest naming the field.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from itif.errors import InvalidRequest, TenantNotFound
from itif.generation.api import GenerateRequest
from itif.generation.spec import PRESETS

transformers = pytest.importorskip("transformers")
pytest.importorskip("itif.generation.search")

from itif.generation.engine import GenEngine  # noqa: E402
from tests.decoder_oracle import EOS, hf_decoder  # noqa: E402


def hf_model(spec, seed: int):
    m = hf_decoder(spec, seed, init_std=0.2)
    eos = EOS[spec.family]
    if spec.family == "marian":
        m.generation_config.bad_words_ids = [[spec.pad_token_id]]  # as Marian checkpoints ship
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        # make EOS likely enough to end some sequences within a few tokens
        if spec.family == "gpt2":
            w = m.transformer.wte.weight[eos]
            m.transformer.ln_f.bias.add_(w * (2.0 / (w @ w)))  # +2 on the EOS logit
        else:
            m.final_logits_bias[0, eos] += 2.5
    return m.eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["gpt2-tiny", "bart-tiny", "marian-tiny"])
def family(request, tmp_path_factory):
    spec = PRESETS[request.param]
    models = {"a": hf_model(spec, 1), "b": hf_model(spec, 1), "c": hf_model(spec, 2)}
    with torch.no_grad():  # b: a's weights with one decoder FFN retrained (the rest shared)
        ffn = (models["b"].transformer.h[-1].mlp.c_fc.weight if spec.family == "gpt2"
               else models["b"].model.decoder.layers[-1].fc1.weight)
        ffn.add_(torch.randn_like(ffn) * 0.1)
    eng = GenEngine(request.param)
    root = tmp_path_factory.mktemp(request.param)
    for name, m in models.items():
        m.save_pretrained(root / name)
        eng.add_tenant(name, root / name)
    return spec, models, eng


def hf_generate(spec, m, r: GenerateRequest) -> tuple[list[list[int]], list[float] | None]:
    kw = dict(max_new_tokens=r.max_new_tokens, num_beams=r.num_beams, do_sample=False,
              length_penalty=r.length_penalty, early_stopping=r.early_stopping,
              no_repeat_ngram_size=r.no_repeat_ngram_size,
              num_return_sequences=r.num_return_sequences, return_dict_in_generate=True,
              output_scores=True)
    if r.eos_token_id is not None:
        kw["eos_token_id"] = r.eos_token_id
    with torch.no_grad():
        out = m.generate(torch.tensor([list(r.input_ids)]), **kw)
    eos = r.eos_token_id if r.eos_token_id is not None else m.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    seqs = []
    for s in out.sequences.tolist():
        s = s[1:] if spec.encoder_decoder else s[len(r.input_ids):]
        for i, t in enumerate(s):  # everything after the first EOS is padding
            if t in eos:
                s = s[: i + 1]
                break
        seqs.append(s)
    scores = out.sequences_scores.tolist() if r.num_beams > 1 else None
    return seqs, scores


def requests_for(spec) -> list[GenerateRequest]:
    R = GenerateRequest
    lens = [3, 9, 1, 14, 6, 11, 4, 7, 2, 12, 5, 8]
    grid = [  # (tenant, beams, early_stopping, ngram, return, length_penalty, max_new)
        ("a", 1, False, 0, 1, 1.0, 12),
        ("b", 1, False, 3, 1, 1.0, 12),
        ("c", 2, False, 0, 1, 1.0, 10),
        ("a", 3, True, 0, 2, 1.0, 10),
        ("b", 4, "never", 3, 3, 0.5, 10),
        ("c", 5, False, 3, 5, 2.0, 9),
        ("a", 4, True, 3, 1, 1.0, 11),
        ("b", 2, "never", 0, 2, -1.0, 8),
        ("c", 1, False, 0, 1, 1.0, 7),
        ("a", 5, "never", 0, 4, 1.0, 10),
        ("b", 3, False, 0, 1, 1.5, 12),
        ("c", 4, True, 0, 2, 1.0, 6),
    ]
    out = []
    for i, ((t, nb, es, ng, nr, lp, mx), n) in enumerate(zip(grid, lens)):
        ids = [(7 * i + 3 * j) % (spec.vocab_size - 10) + 5 for j in range(n)]
        out.append(
            R(
                t,
                ids,
                max_new_tokens=mx,
                num_beams=nb,
                early_stopping=es,
                no_repeat_ngram_size=ng,
                num_return_sequences=nr,
                length_penalty=lp,
            )
        )
    out.append(R("a", [9, 8, 7], max_new_tokens=8, num_beams=3, eos_token_id=11))
    return out


def test_greedy_and_beam_equal_hf_generate_tenants_mixed(family):
    spec, models, eng = family
    reqs = requests_for(spec)
    got = eng.generate(reqs)
    eos_seen = 0
    for r, g in zip(reqs, got):
        want, scores = hf_generate(spec, models[r.tenant], r)
        assert g.tenant == r.tenant
        assert g.sequences == want, (r, g.sequences, want)
        eos_seen += sum(1 for s in want if s and s[-1] in (EOS[spec.family], 11))
        if scores is not None:
            assert g.scores == pytest.approx(scores, abs=1e-4)
        else:
            assert g.scores is None
    assert eos_seen >= 3  # the grid exercises finished beams, not only max_new_tokens
    assert eng.cache_stats()["blocks_used"] == 0


def test_cross_attention_cache_one_copy_per_source(family):
    """Encoder-decoder: the source's cross K/V once for 4 beams; decoder-only: none at all."""
    spec, models, eng = family
    src = list(range(5, 25))
    t = eng.submit(GenerateRequest("a", src, max_new_tokens=6, num_beams=4), lambda ev: None)
    eng._iterate()  # the request joins: its encoder runs once
    assert eng.cache_stats()["rows"] == 4
    # one copy, not num_beams copies
    assert eng.cross_positions(t) == (len(src) if spec.encoder_decoder else 0)
    eng._iterate()  # a decode step of the running batch: its sources stay gathered per layer
    cross = eng._batch._structure()[2]
    if spec.encoder_decoder:  # the gathered copy is per source too: [1 request, heads, S, d]
        assert sorted(cross.cached) == list(range(spec.dec_layers))
        d = spec.hidden // spec.heads
        for kt, v in cross.cached.values():
            assert kt.shape == (1, spec.heads, d, len(src)) and v.shape == (
                1,
                spec.heads,
                len(src),
                d,
            )
    else:
        assert cross is None
    while eng.cache_stats()["running"]:
        eng._iterate()
    assert eng.cache_stats()["blocks_used"] == 0


def test_requests_joining_a_running_batch_do_not_change_the_others(family):
    spec, models, eng = family
    reqs = requests_for(spec)
    first, later = reqs[:6], reqs[6:]
    alone = eng.generate(first)
    results: dict[int, object] = {}
    done = threading.Event()
    tokens_seen = threading.Event()

    def sink(i):
        def on(ev):
            if ev.kind == "tokens":
                tokens_seen.set()
            elif ev.kind in ("done", "error"):
                results[i] = ev
                if len(results) == len(reqs):
                    done.set()
        return on

    eng.start()
    try:
        for i, r in enumerate(first):
            eng.submit(r, sink(i))
        assert tokens_seen.wait(30)  # the first requests are running
        for i, r in enumerate(later, start=len(first)):
            eng.submit(r, sink(i))
        assert done.wait(60)
    finally:
        eng.stop()
    assert all(results[i].kind == "done" for i in results)
    assert [results[i].generation.sequences for i in range(len(first))] == [
        g.sequences for g in alone
    ]
    for i, r in enumerate(later, start=len(first)):
        assert results[i].generation.sequences == hf_generate(spec, models[r.tenant], r)[0]


def test_streamed_tokens_are_the_result_and_cancel_frees_blocks(family):
    spec, models, eng = family
    streamed, events = [], []
    r = GenerateRequest("c", [5, 6, 7], max_new_tokens=10)
    t = eng.submit(
        r, lambda ev: (events.append(ev), ev.kind == "tokens" and streamed.extend(ev.tokens))
    )
    while not any(e.kind == "done" for e in events):
        eng._iterate()
    assert streamed == events[-1].generation.sequences[0]
    long_events: list = []
    long = eng.submit(
        GenerateRequest("b", [5, 6], max_new_tokens=40, num_beams=3), long_events.append
    )
    eng._iterate()
    assert eng.cache_stats()["blocks_used"] > 0 and eng.cache_stats()["rows"] == 3
    eng.cancel(long)
    eng._iterate()
    stats = eng.cache_stats()
    assert (stats["blocks_used"], stats["rows"], stats["running"]) == (0, 0, 0)
    assert long_events == []  # a cancelled request gets no result
    del t


def test_sampling_reproducible_for_a_seed(family):
    spec, models, eng = family
    R = GenerateRequest
    reqs = [R("a", [5, 9, 13], max_new_tokens=10, do_sample=True, seed=7, num_return_sequences=2,
              top_k=20, top_p=0.9, temperature=0.8),
            R("b", [6, 6], max_new_tokens=10, do_sample=True, seed=8)]
    one = eng.generate(reqs)
    two = eng.generate(list(reversed(reqs)) + [R("c", [4], max_new_tokens=5)])
    assert [g.sequences for g in one] == [g.sequences for g in reversed(two[:2])]
    other = eng.generate([R("a", [5, 9, 13], max_new_tokens=10, do_sample=True, seed=99,
                            num_return_sequences=2, top_k=20, top_p=0.9, temperature=0.8)])
    assert other[0].sequences != one[0].sequences


def test_bad_requests_name_the_field(family):
    spec, models, eng = family
    with pytest.raises(InvalidRequest, match="num_beams"):
        eng.generate([GenerateRequest("a", [5], num_beams=0)])
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        eng.generate([GenerateRequest("a", [5], max_new_tokens=spec.max_position + 1)])
    with pytest.raises(InvalidRequest, match="input_ids"):
        eng.generate([GenerateRequest("a", [spec.vocab_size])])
    with pytest.raises(TenantNotFound):
        eng.generate([GenerateRequest("nobody", [5])])
    # one bad request refuses the whole call before anything runs
    with pytest.raises(InvalidRequest, match="temperature"):
        eng.generate([GenerateRequest("a", [5]), GenerateRequest("b", [5], temperature=0.5)])
    assert eng.cache_stats()["waiting"] == 0


def test_removing_a_tenant_ends_its_requests_only(family, tmp_path):
    spec, models, eng = family
    models["c"].save_pretrained(tmp_path / "d")
    eng.add_tenant("d", tmp_path / "d")
    events = {"a": [], "d": []}
    ra = GenerateRequest("a", [5, 6, 7, 8], max_new_tokens=8, num_beams=2)
    eng.submit(GenerateRequest("d", [5, 6], max_new_tokens=30, num_beams=3), events["d"].append)
    eng.submit(ra, events["a"].append)
    eng._iterate()
    eng.remove_tenant("d")
    assert [e.kind for e in events["d"]] == ["error"]
    assert isinstance(events["d"][0].error, TenantNotFound)
    while not events["a"]:
        eng._iterate()
    assert events["a"][0].generation.sequences == hf_generate(spec, models["a"], ra)[0]
    assert eng.cache_stats()["blocks_used"] == 0 and "d" not in eng.tenants()


def test_extreme_search_parameters_are_refused_or_served_exactly(family):
    spec, models, eng = family
    R = GenerateRequest
    # values whose float32 form overflows the search: refused, naming the field
    for field_name, req in (("temperature", R("a", [5], do_sample=True, temperature=1e308)),
                            ("temperature", R("a", [5], do_sample=True, temperature=1e-320)),
                            ("length_penalty", R("a", [5], num_beams=2, length_penalty=1e308)),
                            ("length_penalty", R("a", [5], num_beams=2, max_new_tokens=20,
                                                 length_penalty=-30.0)),
                            # one request's size would set every running row's cost
                            ("no_repeat_ngram_size", R("a", [5], no_repeat_ngram_size=65))):
        with pytest.raises(InvalidRequest, match=field_name):
            eng.generate([req])
    # sizes past the vocabulary / the whole sequence mean "no limit": served as such
    sample = dict(max_new_tokens=6, do_sample=True, seed=3)
    huge_k, no_k = eng.generate([R("a", [5, 9], top_k=2 ** 70, **sample), R("a", [5, 9], **sample)])
    assert huge_k.sequences == no_k.sequences
    long_n = eng.generate([R("b", [5, 9], max_new_tokens=8, no_repeat_ngram_size=64)])
    assert (
        long_n[0].sequences == hf_generate(spec, models["b"], R("b", [5, 9], max_new_tokens=8))[0]
    )
    assert eng.cache_stats()["blocks_used"] == 0


def test_a_request_the_search_refuses_fails_alone(family, monkeypatch):
    from itif.errors import ItifError
    spec, models, eng = family
    events: dict[str, list] = {"a": [], "b": []}
    rb = GenerateRequest("b", [5, 6, 7], max_new_tokens=10, num_beams=2)
    eng.submit(rb, events["b"].append)
    eng._iterate()  # b is running
    sb = eng._sb
    real_add = sb.add
    doomed = eng.submit(GenerateRequest("a", [5], max_new_tokens=4), events["a"].append)

    def add(key, params, history):
        if key == doomed.id:
            raise RuntimeError("an unforeseen failure adding this request")
        return real_add(key, params, history)

    monkeypatch.setattr(sb, "add", add)
    while not events["b"]:
        eng._iterate()
    assert [e.kind for e in events["a"]] == ["error"] and isinstance(
        events["a"][0].error, ItifError
    )
    assert "unforeseen" in str(events["a"][0].error)
    assert [e.kind for e in events["b"]] == ["done"]
    assert events["b"][0].generation.sequences == hf_generate(spec, models["b"], rb)[0]
    stats = eng.cache_stats()
    assert (stats["blocks_used"], stats["rows"], stats["running"]) == (0, 0, 0)


def test_a_prompt_that_runs_out_of_memory_fails_alone(family, monkeypatch):
    """Requests a and c join a running b in one step; any prompt (encoder) run holding c's
    prompt raises CUDA's out-of-memory error, after their cache blocks are reserved. Before, the
    step failed and with it every running generation; now the two prompts run again alone, c
    fails with RESOURCE_EXHAUSTED, a and b finish as Hugging Face generates, and no block stays
    reserved."""
    from itif.generation import running  # noqa: PLC0415

    spec, models, eng = family
    events: dict[str, list] = {"a": [], "b": [], "c": []}
    rb = GenerateRequest("b", [5, 6, 7], max_new_tokens=10, num_beams=2)
    eng.submit(rb, events["b"].append)
    eng._iterate()  # b is running
    ra = GenerateRequest("a", [5, 9], max_new_tokens=6)
    eng.submit(ra, events["a"].append)
    eng.submit(GenerateRequest("c", [5, 8], max_new_tokens=4, num_beams=2), events["c"].append)
    runs = []

    def failing(real):
        def run(*args, **kwargs):
            runs.append(args[3].tolist())  # the packed prompt (or source) ids
            if (args[3] == 8).any():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real(*args, **kwargs)
        return run

    first = running.encode if spec.encoder_decoder else running.prefill
    monkeypatch.setattr(running, "encode" if spec.encoder_decoder else "prefill", failing(first))
    def ended(tenant):
        return any(e.kind in ("done", "error") for e in events[tenant])

    while not (ended("a") and ended("b")):
        eng._iterate()
    assert runs[0] == [5, 9, 5, 8] or runs[0] == [5, 8, 5, 9]  # together, then each alone
    assert sorted(runs[1:]) == [[5, 8], [5, 9]]
    (err,) = events["c"]
    assert err.kind == "error" and err.error.code == "RESOURCE_EXHAUSTED"
    assert "out of memory" in str(err.error) and not re.search(r"\d", str(err.error))
    for tenant, r in (("a", ra), ("b", rb)):  # a streams its tokens; b does not (beams)
        assert {e.kind for e in events[tenant][:-1]} <= {"tokens"}, events[tenant]
        assert events[tenant][-1].kind == "done"
        want = hf_generate(spec, models[tenant], r)[0]
        assert events[tenant][-1].generation.sequences == want
    stats = eng.cache_stats()
    assert (stats["blocks_used"], stats["rows"], stats["running"]) == (0, 0, 0)


def _run_with_failing_decode(family, monkeypatch, fails):
    """b (2 beams), a (greedy, streamed) and c (2 beams) start together (prompts none of the
    families ends at its first token); from the next step on,
    every decode forward for which ``fails(P, ids)`` holds raises CUDA's out-of-memory error.
    Returns the requests, their events and the decode calls' row counts."""
    from itif.generation import running  # noqa: PLC0415

    spec, models, eng = family
    reqs = {"b": GenerateRequest("b", [11, 12], max_new_tokens=10, num_beams=2),
            "a": GenerateRequest("a", [20, 21], max_new_tokens=6),
            "c": GenerateRequest("c", [13, 4, 6], max_new_tokens=7, num_beams=2)}
    events: dict[str, list] = {k: [] for k in reqs}
    for k, r in reqs.items():
        eng.submit(r, events[k].append)
    eng._iterate()  # all three start in one step
    assert eng.cache_stats()["running"] == 3
    real, calls = running.decode, []

    def decode(*args, **kwargs):
        calls.append(args[3].numel())
        if fails(args[1], args[3]):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(running, "decode", decode)
    while not all(any(e.kind in ("done", "error") for e in ev) for ev in events.values()):
        eng._iterate()
    assert eng.cache_stats()["blocks_used"] == 0 and eng.cache_stats()["rows"] == 0
    return spec, models, reqs, events, calls


def _assert_as_hf(spec, models, reqs, events, tenants):
    for tenant in tenants:
        assert {e.kind for e in events[tenant][:-1]} <= {"tokens"}, events[tenant]
        assert events[tenant][-1].kind == "done", events[tenant]
        assert events[tenant][-1].generation.sequences == hf_generate(spec, models[tenant],
                                                                      reqs[tenant])[0]


def test_a_decode_step_out_of_memory_runs_again_in_halves(family, monkeypatch):
    """A decode forward of over 3 rows runs out of memory: the 5 running rows fail together,
    then run as halves of the requests (b and a: 3 rows; c: 2); nobody fails and every output
    is Hugging Face's. Before, the first failure failed all three requests."""
    spec, models, reqs, events, calls = _run_with_failing_decode(
        family, monkeypatch, lambda P, ids: ids.numel() > 3)
    assert calls[:3] == [5, 2, 3] or calls[:3] == [5, 3, 2]
    _assert_as_hf(spec, models, reqs, events, "abc")


def test_a_request_whose_decode_fails_alone_fails_alone(family, monkeypatch):
    """Every decode forward holding tenant c's rows runs out of memory: the step runs again in
    halves until c is alone; c fails with RESOURCE_EXHAUSTED (no figures in the message), its
    rows and blocks leave, and a and b finish as Hugging Face generates, one forward a step."""
    eng = family[2]
    c = eng._batch._slots().tenant_index["c"]
    spec, models, reqs, events, calls = _run_with_failing_decode(
        family, monkeypatch, lambda P, ids: c in P.tenant_ids.tolist())
    (err,) = events["c"]
    assert err.kind == "error" and err.error.code == "RESOURCE_EXHAUSTED"
    assert "out of memory" in str(err.error) and not re.search(r"\d", str(err.error))
    assert calls[:3] == [5, 3, 2] or calls[:3] == [5, 2, 3]
    assert 5 not in calls[3:] and all(n <= 3 for n in calls[3:])
    steps = len(calls) - 3  # after the failing step, one decode forward per step
    assert steps <= reqs["b"].max_new_tokens
    _assert_as_hf(spec, models, reqs, events, "ab")


def test_a_failing_search_step_fails_every_running_request_without_its_text(family, monkeypatch):
    """A failure of the decoding search itself still fails every running request (a known
    limit), but what each is told names the exception's type only: its text may hold another
    request's data (before, its repr went to every tenant). The engine serves on after."""
    from itif.errors import ItifError

    spec, models, eng = family
    events: dict[str, list] = {"a": [], "b": []}
    eng.submit(GenerateRequest("a", [20, 21], max_new_tokens=6), events["a"].append)
    eng.submit(GenerateRequest("b", [11, 12], max_new_tokens=6, num_beams=2), events["b"].append)
    eng._iterate()
    sb = eng._sb

    def step(logits):
        raise RuntimeError("tenant b's prompt [11, 12] broke the search")

    monkeypatch.setattr(sb, "step", step)
    pool = eng._batch.pool
    eng._iterate()
    for ev in events.values():
        assert [e.kind for e in ev if e.kind != "tokens"] == ["error"]
        err = ev[-1].error
        assert isinstance(err, ItifError) and str(err) == "generation step failed: RuntimeError"
    stats = eng.cache_stats()
    assert (stats["blocks_used"], stats["rows"], stats["running"]) == (0, 0, 0)
    # the batch was emptied, its KV pool kept: a second pool was allocated beside the first
    # before, which where the step ran out of memory failed too and ended the loop thread
    assert eng._batch.pool is pool
    r = GenerateRequest("a", [20, 21], max_new_tokens=4)
    assert eng.generate([r])[0].sequences == hf_generate(spec, models["a"], r)[0]


def test_the_loop_survives_a_batch_that_cannot_be_emptied_or_made_again(family, monkeypatch):
    """The worst case of a failed step: the batch cannot be emptied and a new one cannot be
    allocated. The running request still gets its error, the loop thread lives on, and once
    memory is back the next request is served (the batch made again at its step)."""
    from itif.generation import engine as engine_mod

    spec, models, eng = family
    events: list = []
    eng.submit(GenerateRequest("a", [20, 21], max_new_tokens=30, eos_token_id=95), events.append)
    eng._iterate()  # running

    def broken(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")

    real = engine_mod.RunningBatch
    monkeypatch.setattr(eng._sb, "step", broken)
    monkeypatch.setattr(eng._batch, "remove", broken)
    monkeypatch.setattr(engine_mod, "RunningBatch", broken)
    deadline = time.monotonic() + 30
    eng.start()
    try:
        while not any(e.kind == "error" for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[-1].kind == "error" and events[-1].error.code == "RESOURCE_EXHAUSTED"
        assert eng._thread.is_alive()
        monkeypatch.setattr(engine_mod, "RunningBatch", real)
        r = GenerateRequest("a", [20, 21], max_new_tokens=4)
        done: list = []
        eng.submit(r, done.append)
        while not (done and done[-1].kind in ("done", "error")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done[-1].kind == "done", done
        assert done[-1].generation.sequences == hf_generate(spec, models["a"], r)[0]
    finally:
        eng.stop()


def test_an_event_callback_that_raises_ends_its_own_request_only(family):
    """a's caller fails on its first token event (a closed event loop, say): a is cancelled
    (blocks freed, no more events), b and c, running beside it, finish as Hugging Face
    generates. Before, the exception left the step and failed every running request, and
    the error events to a's callback raised again out of the loop (the loop thread died)."""
    spec, models, eng = family
    reqs = {"a": GenerateRequest("a", [20, 21], max_new_tokens=6),
            "b": GenerateRequest("b", [11, 12], max_new_tokens=6, num_beams=2),
            "c": GenerateRequest("c", [13, 4, 6], max_new_tokens=6)}
    events: dict[str, list] = {k: [] for k in reqs}

    def broken(ev):
        events["a"].append(ev)
        raise RuntimeError("Event loop is closed")

    eng.submit(reqs["a"], broken)
    eng.submit(reqs["b"], events["b"].append)
    eng.submit(reqs["c"], events["c"].append)
    for _ in range(20):
        eng._iterate()
        if all(events[k] and events[k][-1].kind == "done" for k in "bc"):
            break
    assert [e.kind for e in events["a"]] == ["tokens"]
    for k in "bc":
        assert events[k][-1].kind == "done", events[k]
        assert events[k][-1].generation.sequences == hf_generate(spec, models[k], reqs[k])[0]
    eng._iterate()  # a's cancellation, if b and c ended first
    stats = eng.cache_stats()
    assert (stats["blocks_used"], stats["rows"], stats["running"]) == (0, 0, 0)


def test_a_tenant_removed_while_its_request_is_submitted_fails_that_request_alone(
        family, tmp_path, monkeypatch):
    """submit checks the tenant, then queues: a remove_tenant in between used to leave the
    request queued for a tenant that is gone (served on another tenant's slots, or a KeyError
    that failed every running generation). It now fails alone when its step comes."""
    spec, models, eng = family
    models["c"].save_pretrained(tmp_path / "d")
    eng.add_tenant("d", tmp_path / "d")
    prepare, checked, removed = eng._prepare, threading.Event(), threading.Event()

    def slow_prepare(r):
        t = prepare(r)
        if r.tenant == "d":  # the tenant was checked; it goes before the request is queued
            checked.set()
            removed.wait(10)
        return t

    monkeypatch.setattr(eng, "_prepare", slow_prepare)
    ea, ed = [], []
    ra = GenerateRequest("a", [5, 6, 7], max_new_tokens=8)
    eng.submit(ra, ea.append)
    eng._iterate()  # a is running
    th = threading.Thread(target=eng.submit,
                          args=(GenerateRequest("d", [5, 6], max_new_tokens=4), ed.append))
    th.start()
    assert checked.wait(10)
    eng.remove_tenant("d")
    removed.set()
    th.join(10)
    for _ in range(100):
        if ed and [e for e in ea if e.kind != "tokens"]:
            break
        eng._iterate()
    assert [e.kind for e in ed] == ["error"] and isinstance(ed[0].error, TenantNotFound)
    assert "'d'" in str(ed[0].error)
    done = [e for e in ea if e.kind != "tokens"]
    assert [e.kind for e in done] == ["done"]
    assert done[0].generation.sequences == hf_generate(spec, models["a"], ra)[0]
    assert eng.cache_stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", ["gpt2-tiny", "bart-tiny", "marian-tiny"])
def test_a_preset_backbone_generates_with_its_familys_ids_for_uploaded_weights(name):
    """A daemon's tenants upload weights only: on a preset backbone nothing else says which ids
    start, pad and end a sequence. Before, bart-tiny refused every request ('sets no
    decoder_start_token_id') and marian-tiny never ended one (its end token unknown); each
    preset now carries its family's ids (gpt2-tiny has none: the request names its end)."""
    spec = PRESETS[name]
    m = hf_model(spec, 5)
    eng = GenEngine(name)
    eng.add_tenant("t", {k: v.detach().clone() for k, v in m.state_dict().items()})
    eos = {"eos_token_id": 0} if spec.family == "gpt2" else {}
    reqs = [GenerateRequest("t", [5, 9, 13, 4], max_new_tokens=12, num_beams=b,
                            num_return_sequences=b, **eos) for b in (1, 3)]
    got = eng.generate(reqs)
    for r, g in zip(reqs, got):
        want, _ = hf_generate(spec, m, r)
        assert g.sequences == want, (r, g.sequences, want)
    assert any(EOS[spec.family] in s for g in got for s in g.sequences)  # the end is known


def test_checkpoint_generation_settings_are_applied_or_refused_by_name(tmp_path):
    """generate() applies every setting of a checkpoint's generation_config.json to every
    request. suppress_tokens is applied (banned at every step);
    settings itif does not apply are refused naming the key (before: ignored, so the answers
    differed from generate()'s: repetition_penalty 1.5 gave [11, 11, 11, 0] for [11, 0])."""
    import json  # noqa: PLC0415

    from itif.errors import InvalidConfig  # noqa: PLC0415

    spec = PRESETS["bart-tiny"]
    m = hf_model(spec, 3)
    r = GenerateRequest("s", [5, 9, 13, 4], max_new_tokens=10)
    free, _ = hf_generate(spec, m, r)
    banned = [t for t in dict.fromkeys(free[0]) if t != EOS["bart"]][:2]
    assert banned
    m.generation_config.suppress_tokens = banned
    m.save_pretrained(tmp_path / "s")
    eng = GenEngine("bart-tiny")
    eng.add_tenant("s", tmp_path / "s")
    got = eng.generate([r])[0].sequences
    want, _ = hf_generate(spec, m, r)
    assert got == want and want != free and not set(banned) & set(want[0]), (got, want, free)
    # an end token among them is suppressed too (generate() drops an end token from
    # bad_words_ids only; before, itif dropped it from both and stopped where HF does not)
    path = tmp_path / "s" / "generation_config.json"
    saved = json.loads(path.read_text())
    for key, value in (("repetition_penalty", 1.5), ("begin_suppress_tokens", [94]),
                       ("num_beam_groups", 2), ("sequence_bias", [[[5], 1.0]])):
        path.write_text(json.dumps({**saved, key: value}))
        with pytest.raises(InvalidConfig, match=key):
            eng.add_tenant(f"x-{key}", tmp_path / "s")
    path.write_text(json.dumps({**saved, "repetition_penalty": 1.0}))  # off: served
    eng.add_tenant("neutral", tmp_path / "s")


def test_a_suppressed_end_token_is_suppressed(tmp_path):
    """generate() drops an end token from bad_words_ids but never from suppress_tokens; itif
    folded suppress_tokens into its bad words and dropped it from both, so a checkpoint that
    suppresses its end token stopped where generate() goes on (an audit: 10 of 10 differed)."""
    spec = PRESETS["gpt2-tiny"]
    m = hf_model(spec, 1)
    eng = GenEngine("gpt2-tiny")
    ends = [q for q in ([13, 4, 6], [11, 12], [20, 21], [5, 9], [7, 8])
            if EOS["gpt2"] in hf_generate(spec, m, GenerateRequest("x", q, max_new_tokens=8))[0][0]]
    assert ends  # prompts whose answer ends on the end token, unsuppressed
    m.generation_config.suppress_tokens = [EOS["gpt2"]]
    m.save_pretrained(tmp_path / "x")
    eng.add_tenant("x", tmp_path / "x")
    for q in ends:
        for beams in (1, 3):
            r = GenerateRequest("x", q, max_new_tokens=8, num_beams=beams)
            want, _ = hf_generate(spec, m, r)
            assert eng.generate([r])[0].sequences == want and EOS["gpt2"] not in want[0], (q, want)


def test_generation_reaches_the_last_position_as_generate_does(family):
    """generate() never feeds the last new token back, so prompt + max_new_tokens may be one
    more than the positions (a GPT-2 prompt of all 64 positions and 1 new token; 64 new BART
    tokens). Before, itif refused both; a prompt alone over the positions blamed max_new_tokens."""
    from dataclasses import replace  # noqa: PLC0415

    spec, models, eng = family
    P = spec.max_position
    if spec.encoder_decoder:
        r = GenerateRequest("a", [5, 6, 7], max_new_tokens=P, eos_token_id=spec.vocab_size - 2)
    else:
        r = GenerateRequest("a", [5 + i % 80 for i in range(P)], max_new_tokens=1)
    want, _ = hf_generate(spec, models["a"], r)
    assert eng.generate([r])[0].sequences == want
    with pytest.raises(InvalidRequest, match="^max_new_tokens"):
        eng.generate([replace(r, max_new_tokens=r.max_new_tokens + 1)])
    with pytest.raises(InvalidRequest, match="^input_ids"):
        eng.generate([replace(r, input_ids=[5] * (P + 1))])
    assert eng.cache_stats()["waiting"] == 0 and eng.cache_stats()["running"] == 0
