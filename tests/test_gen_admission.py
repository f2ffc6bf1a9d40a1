"""Fair admission of generation requests across tenants (``itif.generation.join_order``): the
queue's order on its own, and the GenEngine admitting by it when the KV cache is contended."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from itif.generation.api import GenerateRequest
from itif.generation.join_order import FairWaiting
from itif.generation.spec import PRESETS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Item:  # hashable by identity, as the engine's tickets
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def drain(q: FairWaiting) -> list[str]:
    out = []
    while q:
        assert q.peek() is not None
        out.append(q.pop().name)
    return out


def test_a_tenant_arriving_behind_a_long_queue_is_served_next():
    q = FairWaiting()
    for i in range(10):
        q.append(Item(f"a{i}"), "a", 100)
    q.pop()  # a0 is admitted; the clock is at its start
    q.append(Item("b0"), "b", 100)
    q.append(Item("b1"), "b", 100)
    order = drain(q)
    assert order.index("b0") <= 1, order  # FIFO would put it after a9
    assert order.index("b1") <= 3, order
    assert [x for x in order if x.startswith("a")] == [f"a{i}" for i in range(1, 10)]  # in order


def test_shares_follow_weights_and_costs():
    q = FairWaiting()
    q.set_weights({"a": 3.0, "b": 1.0})
    for i in range(200):
        q.append(Item(f"a{i}"), "a", 10)
        q.append(Item(f"b{i}"), "b", 10)
        q.append(Item(f"c{i}"), "c", 30)  # weight 1, three times the tokens per request
    first = Counter(x[0] for x in drain(q)[:250])
    # token shares 3 : 1 : 1  ->  requests 3 : 1 : 1/3
    assert first["a"] / first["b"] == pytest.approx(3.0, rel=0.1), first
    assert first["b"] / first["c"] == pytest.approx(3.0, rel=0.15), first


def test_an_idle_tenant_banks_no_credit():
    q = FairWaiting()
    for i in range(20):
        q.append(Item(f"a{i}"), "a", 10)
    for _ in range(10):
        q.pop()
    for i in range(10):  # b was idle while a was served: it starts at the current clock
        q.append(Item(f"b{i}"), "b", 10)
    nxt = drain(q)[:10]
    assert 4 <= sum(x.startswith("b") for x in nxt) <= 6, nxt  # alternating, not b first 10


def test_remove_peek_pop_and_errors():
    q = FairWaiting()
    items = [Item(f"a{i}") for i in range(3)] + [Item("b0")]
    for it in items[:3]:
        q.append(it, "a", 5)
    q.append(items[3], "b", 5)
    q.remove(items[0])  # the head of a's queue
    q.remove(items[3])  # b's only one
    assert len(q) == 2 and sorted(x.name for x in q) == ["a1", "a2"]
    assert drain(q) == ["a1", "a2"]
    with pytest.raises(ValueError):
        q.remove(items[1])
    with pytest.raises(IndexError):
        q.pop()
    assert q.peek() is None and not q
    with pytest.raises(ValueError, match="> 0"):
        q.set_weights({"a": 0.0})


def test_a_removed_request_gives_its_share_back():
    """b floods; a queues 8 requests and cancels them (deadlines), then retries once: the
    retry joins as a tenant arriving fresh would, next, not after every b (before: the
    cancelled requests' charges stayed on a's tags, so its retry came last)."""
    q = FairWaiting()
    for i in range(6):
        q.append(Item(f"b{i}"), "b", 100)
    q.pop()  # b0 runs
    gone = [Item(f"x{i}") for i in range(8)]
    for it in gone:
        q.append(it, "a", 100)
    for it in gone:
        q.remove(it)
    q.append(Item("a-retry"), "a", 100)
    assert drain(q) == ["a-retry", "b1", "b2", "b3", "b4", "b5"]


def test_removing_a_middle_request_moves_the_later_ones_up():
    q = FairWaiting()
    a = [Item(f"a{i}") for i in range(3)]
    for it in a:
        q.append(it, "a", 100)
    for i in range(3):
        q.append(Item(f"b{i}"), "b", 100)
    q.remove(a[1])  # a2 takes its place: a0, a2 interleave with b0, b1 as before
    assert drain(q) == ["a0", "b0", "a2", "b1", "b2"]


def _hf_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**PRESETS["gpt2-tiny"].hf_config(), bos_token_id=0,
                                      eos_token_id=0)).eval()


def test_engine_admits_a_quiet_tenant_ahead_of_a_flood():
    """A cache that holds one request at a time: tenant a queues six, then b one. b's request
    joins second (after the one a had admitted first), not seventh as first-come-first-served
    would have it, and every result is still the tenant's own generation."""
    pytest.importorskip("transformers")
    from itif.generation.engine import GenEngine

    spec = PRESETS["gpt2-tiny"]
    block_bytes = spec.dec_layers * 16 * 2 * spec.hidden * 4
    eng = GenEngine("gpt2-tiny", kv_cache_bytes=3 * block_bytes)  # one request: 1 + 2 blocks
    ma, mb = _hf_gpt2(1), _hf_gpt2(2)
    eng.add_tenant("a", ma.state_dict())
    eng.add_tenant("b", mb.state_dict())
    finished: list[str] = []
    results = {}

    def sink(name):
        def on(ev):
            if ev.kind in ("done", "error"):
                finished.append(name)
                results[name] = ev
        return on

    reqs = {f"a{i}": GenerateRequest("a", [5 + i, 6, 7], max_new_tokens=20) for i in range(6)}
    for name, r in reqs.items():
        eng.submit(r, sink(name))
    eng._iterate()  # a0 joins
    reqs["b0"] = GenerateRequest("b", [9, 8, 7], max_new_tokens=20)
    eng.submit(reqs["b0"], sink("b0"))
    while len(finished) < len(reqs):
        eng._iterate()
    assert finished[:2] == ["a0", "b0"], finished
    assert finished[2:] == [f"a{i}" for i in range(1, 6)]
    for name, r in reqs.items():
        m = ma if r.tenant == "a" else mb
        with torch.no_grad():
            want = m.generate(torch.tensor([r.input_ids]), max_new_tokens=20, do_sample=False,
                              pad_token_id=0)[0, len(r.input_ids):].tolist()
        assert results[name].generation.sequences == [want], name  # one sequence: no padding


def test_replacing_a_tenant_ends_its_running_requests_and_stop_ends_the_rest():
    """Re-uploaded weights never continue a sequence begun on the old ones: its running request
    ends with Unavailable (retryable) and its cache blocks are freed; another tenant's request
    carries on. ``stop`` ends what still waits or runs with Unavailable, not silence."""
    pytest.importorskip("transformers")
    from itif.errors import Unavailable
    from itif.generation.engine import GenEngine

    eng = GenEngine("gpt2-tiny")
    ma, mb = _hf_gpt2(1), _hf_gpt2(2)
    eng.add_tenant("a", ma.state_dict())
    eng.add_tenant("b", mb.state_dict())
    events: dict[str, list] = {"a": [], "b": []}
    eng.submit(GenerateRequest("a", [5, 6, 7], max_new_tokens=30), events["a"].append)
    eng.submit(GenerateRequest("b", [5, 6, 7], max_new_tokens=30), events["b"].append)
    eng._iterate()
    eng._iterate()
    assert eng.cache_stats()["running"] == 2
    eng.add_tenant("a", _hf_gpt2(3).state_dict())  # a re-upload while a generates
    last = events["a"][-1]
    assert last.kind == "error" and isinstance(last.error, Unavailable)
    assert "replaced" in str(last.error)
    assert eng.cache_stats()["running"] == 1  # b's request is still running
    while not any(e.kind == "done" for e in events["b"]):
        eng._iterate()
    assert eng.cache_stats()["blocks_used"] == 0

    eng.start()
    stopped: list = []
    with eng._step_lock:  # the loop can take at most one step once stop() has been called
        eng.submit(GenerateRequest("b", [5, 6, 7], max_new_tokens=60), stopped.append)
        stopper = threading.Thread(target=eng.stop)
        stopper.start()
        time.sleep(0.05)
    stopper.join(30)
    assert not stopper.is_alive()
    assert stopped and stopped[-1].kind == "error" and isinstance(stopped[-1].error, Unavailable)
    st = eng.cache_stats()
    assert (st["running"], st["waiting"], st["blocks_used"]) == (0, 0, 0)
