"""The KV cache allocates on demand (issue 62 item 3), against Hugging Face generate().

(a) A pool too small for every request's full length at once, but enough for each alone: more
requests run together than their full reservations would allow, every request finishes, token
for token equal to ``generate()`` (GPT-2 and a tiny llama; greedy, beam and seeded sampling,
the latter equal to the same engine with a pool that never preempts), and the engine counts its
preemptions. (b) The blocks in use grow with the sequence, one block per 16 positions. (c) Two
requests of one tenant with a common two-block prefix hold those blocks once (reference count
2) and compute its positions once (counted in the forward calls), equal to ``generate()``;
another tenant's identical prompt shares nothing; the reference counts are back at zero and no
block is in use when they are done; a later request finds the prefix cached and computes none
of it. (d) PEFT LoRA tenants on a llama base (``test_llama_lora``'s adapters), greedy and beam,
under preemption (resumed rows recomputed in one-token chunks) equal PEFT's ``generate()``.
Plus: a decode step runs the same operations whatever is shared or cached; a request preempted
with whole blocks past its last position resumes; a preempted request can be cancelled, streams
each token once when resumed, and ends with TenantNotFound when its tenant is removed.
"""

from __future__ import annotations

import pytest
import torch

from itif.generation import llama, running
from itif.generation.api import GenerateRequest
from itif.generation.spec import PRESETS, load_decoder_spec

transformers = pytest.importorskip("transformers")

from itif.generation.engine import GenEngine  # noqa: E402 (imported after importorskip)
from tests import test_generate, test_llama, test_llama_lora  # noqa: E402 (imported after importorskip)

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


def full_blocks(eng: GenEngine, r: GenerateRequest) -> int:
    """Blocks ``r`` holds if it reserves its full length at join: the prompt's, and per row
    those of its ``max_new_tokens`` - 1 fed-back tokens."""
    blocks = eng._batch.pool.blocks_for
    rows = max(r.num_beams, r.num_return_sequences)
    return blocks(len(r.input_ids)) + rows * blocks(r.max_new_tokens - 1)


@pytest.fixture
def positions_computed(monkeypatch):
    """Every position the decoder forward calls compute (prefill and decode, both families'),
    as a list the test reads: the calls' ``pos`` argument."""
    seen: list[int] = []
    for mod in (running, llama):
        for name in ("prefill", "decode"):
            fn = getattr(mod, name)

            def counted(spec, P, kv, ids, pos, *rest, _fn=fn):
                seen.extend(pos.tolist())
                return _fn(spec, P, kv, ids, pos, *rest)

            monkeypatch.setattr(mod, name, counted)
    return seen


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
    assert sum(full_blocks(eng, r) for r in reqs) > 8
    held: list[int] = []  # the full reservations of the requests running at each forward
    eng.before_forward = lambda tenants: held.append(
        sum(full_blocks(eng, t.request) for t in eng._running.values()))
    out = eng.generate(reqs)
    assert max(held) > 8, "on demand, more requests run at once than full reservations allow"
    assert eng.cache_stats().get("preemptions", 0) > 0
    assert eng.cache_stats()["preemptions"] == eng.preemptions
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
    assert small.cache_stats().get("preemptions", 0) > 0
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


def test_a_tenants_common_prefix_is_shared_and_never_across_tenants(models, positions_computed):
    from itif.generation.cache import prefix_digests

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
    # the common prefix's 32 positions computed once for a's two requests, once for b's
    assert sum(p < 2 * B for p in positions_computed) == 2 * 2 * B
    blocks, refs, used = seen[1]  # the first decode: all three running
    assert None not in blocks["a"] and None not in blocks["b"]
    assert not set(blocks["a"]) & set(blocks["b"])
    assert refs == [2, 2, 1, 1]
    # a: 2 shared + 2 suffix blocks; b: 3; one block of its own per row
    assert used == 4 + 3 + 3
    # finished: nobody references a block; the prefix blocks are unused but cached (counted
    # free), found by a later request
    stats = eng.cache_stats()
    assert [pool.refcount(b) for b in blocks["a"] + blocks["b"]] == [0, 0, 0, 0]
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"]
    assert stats["blocks_cached"] >= 4
    seen.clear()
    positions_computed.clear()
    later = GenerateRequest("a", common + [50], max_new_tokens=8, eos_token_id=STOP)
    (g,) = eng.generate([later])
    assert g.sequences == hf_generate(hf["a"], later)
    blocks, refs, used = seen[0]
    assert refs[:2] == [1, 1] and used == 2 + 1  # the prefix found, one block computed
    assert min(positions_computed) == 2 * B  # none of the prefix computed again
    assert eng.cache_stats()["blocks_used"] == 0


def test_lora_tenants_and_beams_under_preemption_equal_peft(tmp_path, monkeypatch):
    """test_llama_lora's base ``a`` and two of its adapters (Q/V only; every projection with
    a rank pattern and rsLoRA) in a pool of 8 blocks: preempted and resumed, each request
    equals PEFT's generate() of its adapter (or the base's HF model), greedy and beam. The
    resumed rows' tokens are recomputed in chunks of one token (``RECOMPUTE_BYTES``: the
    smallest chunk), each reading what the chunks before it wrote."""
    monkeypatch.setattr(running, "RECOMPUTE_BYTES", 1)
    lm = test_llama_lora
    base = lm.base_model(1)
    base.save_pretrained(tmp_path / "a")
    oracles = {"a": base}
    spec = load_decoder_spec(tmp_path / "a")
    eng = GenEngine(tmp_path / "a", kv_cache_bytes=8 * spec.dec_layers * B * 2 * spec.kv_width * 4)
    assert eng.cache_stats()["blocks_total"] == 8
    eng.add_tenant("a", tmp_path / "a")
    for i, t in enumerate(("qv4", "all2")):
        oracles[t] = lm.peft_model(base, lm.ADAPTERS[t][1], 10 + i)
        oracles[t].save_pretrained(tmp_path / t)
        eng.add_tenant(t, tmp_path / t, base="a")
    reqs = [GenerateRequest(t, [(7 * i + 3 * j) % 80 + 5 for j in range(3 + 4 * i)],
                            max_new_tokens=30 + 2 * i, num_beams=2 if i in (2, 5) else 1)
            for i, t in enumerate(["qv4", "all2", "a", "all2", "qv4", "qv4"])]
    assert max(full_blocks(eng, r) for r in reqs) == 8 < sum(full_blocks(eng, r) for r in reqs)
    out = eng.generate(reqs)
    assert eng.cache_stats().get("preemptions", 0) > 0
    for r, g in zip(reqs, out):
        assert g.sequences == lm.hf_generate(oracles[r.tenant], r), r
    assert eng.cache_stats()["blocks_used"] == 0


def test_a_decode_step_costs_the_same_whatever_is_shared_or_cached(models):
    """One decode step of four requests runs as many aten operations (the same kernels on the
    same shapes) when they share a two-block prefix and 40 more prefix blocks sit cached as
    when nothing is shared or cached: rows read their history through their own location rows,
    and the step never visits the cache's blocks."""
    engine, _ = models
    counts = {}
    for case in ("alone", "shared"):
        eng = engine(96)
        if case == "shared":  # 20 finished requests leave 2 prefix blocks each, unused
            eng.generate([GenerateRequest("a", prompt(20 + k, 2 * B + 1), max_new_tokens=2,
                                          eos_token_id=STOP) for k in range(20)])
            assert eng.cache_stats().get("blocks_cached", 0) == 40
            prompts = [prompt(6, 2 * B) + [10 + k] for k in range(4)]
        else:
            prompts = [prompt(k, 2 * B + 1) for k in range(4)]
        batch, steps = eng._batch, []
        real = batch.decode

        def decode(real=real, steps=steps, case=case, batch=batch):
            steps.append(None)
            if len(steps) != 2:  # the second decode: no row crosses a block boundary
                return real()
            out = []
            batch._scratch = type(batch._scratch)()  # its buffers allocated alike in both cases
            counts[case] = (batch.rows, test_llama_lora._count_ops(lambda: out.append(real())))
            return out[0]

        batch.decode = decode
        eng.generate([GenerateRequest("a", p, max_new_tokens=6, eos_token_id=STOP)
                      for p in prompts])
        assert len(steps) >= 2
        if case == "shared":
            assert eng.cache_stats()["blocks_cached"] == 42
    assert counts["alone"][0] == counts["shared"][0] == 4  # every request still running
    assert counts["alone"][1] == counts["shared"][1] > 0


def test_a_request_preempted_late_in_its_positions_resumes(models):
    """Two requests of 64 positions (the backbone's all) in 8 blocks: together they fit for 48
    tokens, then the newer is preempted with more whole blocks of its own than positions left
    in its row (4 x 16 > 64 - 4): resumed, it finishes equal to ``generate()``, never failed."""
    engine, hf = models
    eng = engine(8)
    reqs = [GenerateRequest(t, prompt(i, 4), max_new_tokens=60, eos_token_id=STOP)
            for i, t in ((8, "a"), (9, "b"))]
    out = eng.generate(reqs)
    for r, g in zip(reqs, out):
        want = hf_generate(hf[r.tenant], r)
        assert g.sequences == want, r
        assert len(want[0]) > 48, "the test needs both requests past 48 tokens"
    assert eng.cache_stats().get("preemptions", 0) > 0
    assert eng.cache_stats()["blocks_used"] == 0


def test_preempted_requests_can_be_cancelled_streamed_and_their_tenant_removed(models):
    """A preempted request waiting to resume: cancelled, it ends with no more events; a
    streamed one resumes and streams exactly its tokens, once each; one whose tenant is removed
    ends with TenantNotFound. The others finish equal to ``generate()``; no block stays used."""
    from itif.errors import TenantNotFound

    engine, hf = models
    eng = engine(8)
    events: dict[int, list] = {}

    def submit(r):
        i = len(events)
        events[i] = []
        return eng.submit(r, lambda ev: events[i].append(ev))

    def run_until(done) -> None:
        for _ in range(500):  # the two requests take about 120 steps
            if done(eng.cache_stats()):
                return
            eng._iterate()
        raise AssertionError("not reached in 500 steps")

    idle = lambda s: not s["running"] and not s["waiting"]  # noqa: E731 (a one-line local helper)
    reqs = [GenerateRequest(t, prompt(i, 4), max_new_tokens=60, eos_token_id=STOP)
            for i, t in ((8, "a"), (9, "b"))]
    tickets = [submit(r) for r in reqs]
    run_until(lambda s: s.get("preemptions", 0) == 1)
    assert list(eng._resume) == [tickets[1]]
    eng.cancel(tickets[1])
    run_until(idle)
    assert [ev.kind for ev in events[0]][-1] == "done"
    assert not any(ev.kind == "done" for ev in events[1])
    assert events[0][-1].generation.sequences == hf_generate(hf["a"], reqs[0])
    streamed = [tok for ev in events[0] if ev.kind == "tokens" for tok in ev.tokens]
    assert streamed == hf_generate(hf["a"], reqs[0])[0]
    # streamed and preempted: resumes, each token streamed once
    for r in reqs:
        submit(r)
    run_until(lambda s: s["preemptions"] == 2)
    run_until(idle)
    for i, r in ((2, reqs[0]), (3, reqs[1])):
        assert [tok for ev in events[i] if ev.kind == "tokens" for tok in ev.tokens] == \
            hf_generate(hf[r.tenant], r)[0]
    # preempted, then its tenant removed
    for r in reqs:
        submit(r)
    run_until(lambda s: s["preemptions"] == 3)
    assert [t.request.tenant for t in eng._resume] == ["b"]
    eng.remove_tenant("b")
    run_until(idle)
    assert isinstance(events[5][-1].error, TenantNotFound)
    assert events[4][-1].generation.sequences == hf_generate(hf["a"], reqs[0])
    assert eng.cache_stats()["blocks_used"] == 0
