"""One decode step makes O(1) Python calls in the GenEngine, whatever the number of running
sequences (issue #61 item 5).

The GenEngine's loop runs inline (``_iterate``) over a mix of requests that covers the step's
per-request features: greedy, sampling with its own temperature / top-k / top-p / seed per
request, two-row sampling, beam search (2 and 3 beams, a length penalty), a no-repeat-n-gram
ban, tenants with different weights (GPT-2: two full tenants; a tiny Llama: two full tenants
and a PEFT LoRA adapter on each; BART: encoder-decoder, its forced end token), and every
greedy or one-row sampling request streaming its tokens to a consumer
(``GenEngine.submit(..., sink=)``: one array per step per consumer). The same mix, cycled, is
run at 8 and at 32 requests (12 and 48 rows).

What is counted, for ONE decode step (one ``_iterate`` in which nothing joins, finishes, is
cancelled or preempted, and no row crosses into a new cache block): Python function calls
whose caller or callee is an ``itif`` frame (``sys.setprofile``'s "call" and "c_call" events:
torch ops, numpy, builtins and Python functions called from itif code, and itif's own
functions), and the lines itif frames execute (``sys.settrace``'s "line" events: a Python loop
over the rows shows here even when its body calls nothing). Joins (prefill), finishing,
cancelling and preempting a request are per-event work, so those steps are left out: the
measured step is checked to be none of them (same requests running, none waiting, no result or
error, each streaming request handed exactly one new token).

Both counts must be the same at 32 requests as at 8 (up to ``SLACK``). Before the streaming
consumers existed, each streaming request cost the step a ``GenEvent`` and a callback (and a
property read), so the count grew with the requests; ``python -m tests.test_decode_step_calls``
prints the counts and a step's time at several sizes, for both kinds of consumer.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch

import itif
from itif.generation.api import GenerateRequest, GenerationDefaults

transformers = pytest.importorskip("transformers")

from itif.generation.engine import GenEngine  # noqa: E402 (imported after importorskip)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ITIF_DIR = os.path.dirname(os.path.abspath(itif.__file__)) + os.sep
#: Calls (and lines) the 32-request step may make beyond the 8-request one: none is expected,
#: a few are allowed for a branch a size could take once (not per row).
SLACK = 4
PROMPT = 3  # every prompt this long: rows cross into new blocks at the same steps at any size
NEW = 40  # max_new_tokens: no request finishes during the steps measured
#: EOS banned throughout (min_new_tokens past NEW): requests end only at max_new_tokens
DEFAULTS = GenerationDefaults(eos_token_ids=(0,), pad_token_id=0, min_new_tokens=1000)


def _kinds(t: list[str]) -> list[Callable[[int], GenerateRequest]]:
    """The mix, one request of each kind per cycle (``t``: four tenants)."""
    R = GenerateRequest

    def ids(i: int, first: int) -> list[int]:
        return [first, 3 + i % 40, 4 + (7 * i) % 50]

    return [
        lambda i: R(t[0], ids(i, 5), max_new_tokens=NEW),
        lambda i: R(t[1], ids(i, 6), max_new_tokens=NEW, do_sample=True, seed=i,
                    temperature=0.7, top_k=20, top_p=0.9),
        lambda i: R(t[0], ids(i, 7), max_new_tokens=NEW, num_beams=2),
        lambda i: R(t[2], ids(i, 8), max_new_tokens=NEW, do_sample=True, seed=i,
                    temperature=1.3),
        lambda i: R(t[3], ids(i, 9), max_new_tokens=NEW, no_repeat_ngram_size=2),
        lambda i: R(t[2], ids(i, 10), max_new_tokens=NEW, do_sample=True, seed=i, top_p=0.8),
        lambda i: R(t[1], ids(i, 11), max_new_tokens=NEW, num_beams=3,
                    num_return_sequences=2, length_penalty=0.5),
        lambda i: R(t[3], ids(i, 12), max_new_tokens=NEW, do_sample=True, seed=i, top_k=5,
                    num_return_sequences=2),
    ]


def _gpt2(root, kv_cache_bytes: int = 4 << 20) -> tuple[GenEngine, list[str]]:
    from itif.generation.spec import PRESETS
    from tests import test_generate

    spec = PRESETS["gpt2-tiny"]
    eng = GenEngine("gpt2-tiny", kv_cache_bytes=kv_cache_bytes)
    for t, seed in (("a", 1), ("b", 2)):
        test_generate.hf_model(spec, seed).save_pretrained(root / t)
        eng.add_tenant(t, root / t, defaults=DEFAULTS)
    return eng, ["a", "b", "a", "b"]


def _llama(root) -> tuple[GenEngine, list[str]]:
    """Full tenants a and c, PEFT LoRA adapters qv4 (on a) and lin3 (on c)."""
    from tests import test_llama_lora as tl

    models = {"a": tl.base_model(1), "c": tl.base_model(2)}
    for t, m in models.items():
        m.save_pretrained(root / t)
    eng = GenEngine(root / "a", kv_cache_bytes=4 << 20)
    for t in models:
        eng.add_tenant(t, root / t, defaults=DEFAULTS)
    for i, t in enumerate(("qv4", "lin3")):
        base, kw = tl.ADAPTERS[t]
        tl.peft_model(models[base], kw, 10 + i).save_pretrained(root / t)
        eng.add_tenant(t, root / t, defaults=DEFAULTS, base=base)
    return eng, ["a", "qv4", "c", "lin3"]


class Collect:
    """A streaming consumer: every step's (request ids, tokens) arrays, as handed out."""

    def __init__(self) -> None:
        self.steps: list[tuple[np.ndarray, np.ndarray]] = []

    def put(self, ids: np.ndarray, tokens: np.ndarray) -> None:
        self.steps.append((ids, tokens))

    def per_request(self) -> Counter:
        return Counter(i for ids, _ in self.steps for i in ids.tolist())


def start(eng: GenEngine, tenants: list[str], n: int, bulk: bool = True):
    """Submit ``n`` requests of the mix (streaming to one consumer, or with ``bulk`` False to a
    callback each, the only way before consumers) and run the join step and the first decode
    step (the rows' first own blocks). Returns (consumer, events by kind, streaming ids)."""
    kinds = _kinds(tenants)
    sink, events = Collect(), Counter()
    streaming = []
    for i in range(n):
        r = kinds[i % len(kinds)](i)
        on = (lambda ev: events.update([ev.kind]))  # noqa: E731 (a one-line local helper)
        t = eng.submit(r, on, sink=sink) if bulk else eng.submit(r, on)
        if r.mode != "beam" and r.num_return_sequences == 1:
            streaming.append(t.id)
    eng._iterate()
    eng._iterate()
    return sink, events, streaming


def count_step(fn: Callable[[], None]) -> tuple[int, int]:
    """(calls, lines) of ``fn()``: calls into or out of itif frames, lines of itif frames."""
    calls = lines = 0

    def mine(frame) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(ITIF_DIR)

    def profile(frame, event, arg):
        nonlocal calls
        if (event == "call" and (mine(frame) or mine(frame.f_back))
                or event == "c_call" and mine(frame)):
            calls += 1

    def line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return line

    def trace(frame, event, arg):
        return line if mine(frame) else None

    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return calls, lines


def plain_step(eng: GenEngine, sink: Collect, events: Counter, streaming: list[int],
               bulk: bool = True) -> tuple[int, int]:
    """Count one decode step, checked to be nothing but one (see the module docstring)."""
    before = eng.cache_stats()
    handed, had = len(sink.steps), dict(events)
    counts = count_step(eng._iterate)
    after = eng.cache_stats()
    assert after["running"] == before["running"] > 0 and after["waiting"] == 0
    assert after["blocks_used"] == before["blocks_used"]  # no row took a new block
    assert "done" not in events and "error" not in events
    if bulk:  # streaming on: each streaming request handed its one token, in one array
        assert len(sink.steps) == handed + 1
        ids, toks = sink.steps[-1]
        assert sorted(ids.tolist()) == sorted(streaming) and toks.shape == ids.shape
    else:
        assert events["tokens"] - had.get("tokens", 0) == len(streaming)
    return counts


def finish(eng: GenEngine) -> None:
    for t in list(eng._running.values()):
        eng.cancel(t)
    eng._iterate()
    assert eng.cache_stats()["running"] == 0


def _bart(root) -> tuple[GenEngine, list[str]]:
    """An encoder-decoder backbone: cross-attention, forced end token, its own defaults."""
    from itif.generation.spec import PRESETS, defaults_from_dir
    from tests import test_generate

    eng = GenEngine("bart-tiny", kv_cache_bytes=8 << 20)
    for t, seed in (("a", 1), ("b", 2)):
        test_generate.hf_model(PRESETS["bart-tiny"], seed).save_pretrained(root / t)
        eng.add_tenant(t, root / t, defaults=replace(defaults_from_dir(root / t),
                                                     min_new_tokens=DEFAULTS.min_new_tokens))
    return eng, ["a", "b", "a", "b"]


MODELS = {"gpt2": _gpt2, "llama": _llama, "bart": _bart}


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, tmp_path_factory):
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def test_one_decode_step_makes_as_many_python_calls_for_32_requests_as_for_8(setup):
    eng, tenants = setup
    counts = {}
    for n in (8, 32):
        sink, events, streaming = start(eng, tenants, n)
        counts[n] = plain_step(eng, sink, events, streaming)
        finish(eng)
    (c8, l8), (c32, l32) = counts[8], counts[32]
    assert c32 - c8 <= SLACK, f"calls per step: {c8} at 8 requests, {c32} at 32"
    assert l32 - l8 <= SLACK, f"itif lines per step: {l8} at 8 requests, {l32} at 32"


def test_streamed_arrays_are_each_requests_tokens_once_in_order(setup):
    """What a consumer is handed, step by step, is each streaming request's result, in
    order, each token once; a request cancelled mid-way is handed nothing after its cancel
    is seen, and the others go on."""
    eng, tenants = setup
    kinds = _kinds(tenants)
    sink, out = Collect(), {}
    reqs = [kinds[i](i) for i in (0, 1, 3, 4, 5)]
    reqs = [replace(r, max_new_tokens=6 + i) for i, r in enumerate(reqs)]

    def result(i: int) -> Callable:
        return lambda ev: out.__setitem__(i, ev)

    tickets = [eng.submit(r, result(i), sink=sink) for i, r in enumerate(reqs)]
    eng._iterate()
    eng._iterate()
    eng.cancel(tickets[2])
    cut = len(sink.steps)
    while len(out) < len(reqs) - 1:
        eng._iterate()
    got: dict[int, list[int]] = {}
    for ids, toks in sink.steps:
        assert len(set(ids.tolist())) == ids.size  # a request at most once a step
        for i, tok in zip(ids.tolist(), toks.tolist()):
            got.setdefault(i, []).append(tok)
    for i, t in enumerate(tickets):
        if i == 2:
            assert all(t.id not in ids.tolist() for ids, _ in sink.steps[cut:])
            assert i not in out
            continue
        assert out[i].kind == "done"
        assert got[t.id] == out[i].generation.sequences[0]


def test_a_consumer_given_mid_way_and_under_preemption_is_handed_each_token_once(tmp_path):
    """Two GPT-2 requests in a pool of 8 blocks (too few for both: the newer is preempted,
    then resumed by recomputing its rows): ``a`` streams to a consumer from the start; ``b`` to
    its callback for its first three tokens, then to the consumer (``stream_to``, as the
    server gives it). What each was handed, callback then consumer, is its result: each token
    once, in order."""
    eng, _ = _gpt2(tmp_path, kv_cache_bytes=8 * 2 * 16 * 2 * 32 * 4)  # 8 blocks of 16 positions
    assert eng.cache_stats()["blocks_total"] == 8
    sink, results, own = Collect(), {}, {0: [], 1: []}

    def on(i: int) -> Callable:
        def event(ev) -> None:
            if ev.kind == "tokens":
                own[i].extend(ev.tokens)
            else:
                results[i] = ev
        return event

    reqs = [GenerateRequest("a", [5, 6, 7, 8], max_new_tokens=60),
            GenerateRequest("b", [9, 10, 11, 12], max_new_tokens=60, do_sample=True, seed=3,
                            top_k=10)]
    ta = eng.submit(reqs[0], on(0), sink=sink)
    tb = eng.submit(reqs[1], on(1))
    for _ in range(3):
        eng._iterate()
    eng.stream_to(tb, sink)
    for _ in range(300):
        if len(results) == 2:
            break
        eng._iterate()
    assert eng.preemptions > 0 and results[0].kind == results[1].kind == "done"
    got: dict[int, list[int]] = {ta.id: [], tb.id: []}
    for ids, toks in sink.steps:
        for i, tok in zip(ids.tolist(), toks.tolist()):
            got[i].append(tok)
    assert own[0] == [] and len(own[1]) == 3
    assert got[ta.id] == results[0].generation.sequences[0]
    assert own[1] + got[tb.id] == results[1].generation.sequences[0]
    assert len(results[1].generation.sequences[0]) == 60


def test_the_servers_consumer_hands_a_loops_calls_their_tokens_in_one_put(tmp_path):
    """``itif.server.generate.GenerationStream`` (what gRPC Generate and /v1/completions run),
    the GenEngine on its own thread: the calls of one event loop share the loop's consumer,
    every step hands it one array holding each running call's token, and each call's
    "tokens" events add up to its result. A second engine's call on the same loop (its ticket
    ids are its own: the same numbers) goes through a consumer of its own."""
    import asyncio
    from types import SimpleNamespace

    from itif.server import generate as served

    eng, tenants = _gpt2(tmp_path / "one")
    other, _ = _gpt2(tmp_path / "two")
    reqs = [k(i) for i, k in enumerate(_kinds(tenants)) if i in (0, 1, 3, 5)]
    reqs = [replace(r, max_new_tokens=8) for r in reqs]
    alone = replace(reqs[0], input_ids=[40, 41, 42])

    class Daemon:  # what GenerationStream reads of the daemon
        def __init__(self, gen: GenEngine) -> None:
            self.generator, self.metrics = gen, None
            self.engine = SimpleNamespace(tokenizer_of=lambda tenant: None)

        def submit_generate(self, who, tenant, req, on_event, text=None, reserve=None):
            return self.generator.submit(req, on_event)

        def cancel_generate(self, ticket) -> None:
            self.generator.cancel(ticket)

    puts: list[int] = []

    async def collect(call) -> tuple[list[int], object]:
        toks, done = [], None
        async for kind, value in call.events():
            if kind == "tokens":
                toks += [t for _, ids, _ in value for t in ids]
            else:
                done = value
        return toks, done

    async def main():
        calls = [served.GenerationStream(Daemon(eng), None, r.tenant, r) for r in reqs]
        calls.append(served.GenerationStream(Daemon(other), None, alone.tenant, alone))
        assert calls[0].ticket.id == calls[-1].ticket.id  # each engine numbers its own
        consumer = served._loop_tokens(asyncio.get_running_loop(), eng)
        put = consumer.put
        consumer.put = lambda ids, toks: (puts.append(len(ids)), put(ids, toks))
        for g in (eng, other):
            g.start()
        try:
            return await asyncio.gather(*(collect(c) for c in calls))
        finally:
            for g in (eng, other):
                g.stop()

    outs = asyncio.run(main())
    for toks, done in outs:
        assert len(toks) == 8 and toks == done.sequences[0]
    assert outs[0][0] != outs[-1][0]  # different prompts, different tokens
    assert puts == [len(reqs)] * 8


def _main() -> None:  # pragma: no cover - measurement, printed
    """Counts and a decode step's time at several sizes, one torch thread, streaming to one
    consumer (and to a callback per request too, with ``callbacks`` on the command line;
    ``only-callbacks``: those alone, what a tree before consumers can run). Time: the median
    over 4 x 36 decode steps of this thread's CPU time (``time.thread_time``: on a shared
    machine, less of the others' load than the wall time, also printed), and the wall time of
    the step's hand-out of streamed tokens (``GenEngine._stream``, what the consumers changed)."""
    import tempfile
    from pathlib import Path

    torch.set_num_threads(1)
    handing: list[float] = []  # wall time of each step's hand-out of streamed tokens
    stream = GenEngine._stream

    def timed(self, *args) -> None:
        t0 = time.perf_counter()
        stream(self, *args)
        handing.append(time.perf_counter() - t0)

    GenEngine._stream = timed
    argv = " ".join(sys.argv[1:])
    modes = [b for b in (True, False) if (b and "only-callbacks" not in argv)
             or (not b and "callbacks" in argv)]
    for name, make in MODELS.items():
        eng, tenants = make(Path(tempfile.mkdtemp()))
        for bulk in modes:
            for n in (2, 8, 32, 64):
                cpu, wall, handing[:] = [], [], []
                for rnd in range(4):
                    sink, events, streaming = start(eng, tenants, n, bulk)
                    if rnd == 0:
                        calls, lines = plain_step(eng, sink, events, streaming, bulk)
                        rows = eng.cache_stats()["rows"]
                    del handing[len(cpu):]  # the steps timed only
                    for _ in range(NEW - 4):  # every step a decode step (none finishes)
                        c0, w0 = time.thread_time(), time.perf_counter()
                        eng._iterate()
                        cpu.append(time.thread_time() - c0)
                        wall.append(time.perf_counter() - w0)
                    finish(eng)
                print(f"{name:5s} {'one consumer' if bulk else 'callbacks   '} {n:3d} requests "
                      f"{rows:3d} rows: {calls:5d} calls {lines:5d} lines; a step: CPU "
                      f"{1e3 * float(np.median(cpu)):.2f} ms, wall "
                      f"{1e3 * float(np.median(wall)):.2f} ms, its hand-out of streamed tokens "
                      f"{1e6 * float(np.median(handing)):.0f} us (medians)")


if __name__ == "__main__":
    _main()
