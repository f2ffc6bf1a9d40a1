"""Weight tiers (issue 14, items 1 and 5): device and host budgets, promotion on demand, LRU
eviction of idle unpinned tenants, parked requests, failing promotions, restart, visibility.

The backbone is a tiny BERT (hidden 32, 2 layers, vocab 128) written as a config.json; every
tenant is a random full fine-tune (no tensor shared) unless a test shares on purpose. Answers
are compared with Hugging Face's model holding the tenant's own weights.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

import numpy as np
import pytest
import torch

from itif.config import hash_token, parse_config
from itif.daemon import Daemon, Identity, State
from itif.errors import InvalidRequest, Overloaded, Unavailable
from itif.requests import Request, Result
from itif.safetensors_io import save_safetensors
from itif.scheduler import Scheduler, TenantQuota
from itif.weights.tiers import Tier
from tests.oracle import make_hf_model, reference

ADMIN = Identity(None, admin=True)
IDS = ([3, 17, 42, 9, 101], [5, 6, 7], list(range(1, 21)))
CONFIG = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 128,
          "max_position_embeddings": 64, "type_vocab_size": 2, "hidden_act": "gelu"}


# ---- the scheduler's parked queues (no engine) --------------------------------------------------
def _echo(requests):
    return [Result(tenant=r.tenant) for r in requests]


def test_parked_tenant_waits_while_others_run_then_runs_or_fails():
    ran: list[str] = []

    def run(requests):
        ran.extend(r.tenant for r in requests)
        return _echo(requests)

    s = Scheduler(run, max_wait_ms=0)
    for t in ("hot", "cold"):
        s.set_tenant(t, TenantQuota())
    s.park("cold")
    s.start()
    try:
        cold = s.submit(Request("cold", input_ids=[1]), tokens=1)
        hot = [s.submit(Request("hot", input_ids=[1]), tokens=1) for _ in range(5)]
        for t in hot:
            t.result(5)
        assert not cold.done() and ran == ["hot"] * 5  # parked: no batch takes it
        assert s.stats.queued == 1 and s.queue_depth("cold") == 1
        s.park("cold", False)
        cold.result(5)
        assert ran[-1] == "cold"
        s.park("cold")
        lost = [s.submit(Request("cold", input_ids=[1]), tokens=1) for _ in range(3)]
        assert s.fail_parked("cold", Unavailable("weights could not be loaded")) == 3
        for t in lost:
            with pytest.raises(Unavailable, match="could not be loaded"):
                t.result(5)
        assert s.stats.tenants["cold"].failed == 3
        left = s.submit(Request("cold", input_ids=[1]), tokens=1)
    finally:
        s.stop(grace_s=0.3)
    with pytest.raises(Unavailable, match="shut down"):  # the grace ends a parked request
        left.result(1)


# ---- a daemon with tiers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    (root / "config.json").write_text(json.dumps(CONFIG))
    return root / "config.json"


_MODELS: dict[int, torch.nn.Module] = {}
_FILES: dict[int, bytes] = {}


def model_of(backbone, seed: int):
    if seed not in _MODELS:
        _MODELS[seed] = make_hf_model(str(backbone), num_labels=3, seed=seed)
    return _MODELS[seed]


def file_of(backbone, seed: int, tmp) -> bytes:
    if seed not in _FILES:
        p = tmp / f"w{seed}.safetensors"
        save_safetensors({k: v.detach().contiguous() for k, v in
                          model_of(backbone, seed).state_dict().items()}, p)
        _FILES[seed] = p.read_bytes()
    return _FILES[seed]


def make_daemon(root, backbone, names, *, device_tenants: float | None, host_tenants: float = 0,
                pinned=(), per_tenant: int | None = None, metrics: bool = False,
                bases: dict | None = None) -> Daemon:
    per = per_tenant or tenant_bytes(backbone)
    lines = ["server:", "  listen: 127.0.0.1:0", "  data_dir: ./data",
             f"  admin_token_sha256: {hash_token('admin')}",
             "backbone:", f"  config: {backbone}", "  device: cpu", "  dtype: float32"]
    if device_tenants is not None:
        lines.append(f"  device_weight_bytes: {int(device_tenants * per)}")
    lines.append(f"  host_weight_bytes: {int(host_tenants * per)}")
    lines += ["scheduler:", "  max_wait_ms: 1", "tenants:"]
    for n in names:
        lines += [f"  - id: {n}", f"    token_sha256: {hash_token('t-' + n)}",
                  "    max_queue: 1000"]
        if n in pinned:
            lines.append("    pinned: true")
        if bases and n in bases:
            lines.append(f"    base: {bases[n]}")
    d = Daemon(parse_config("\n".join(lines) + "\n", root))
    if metrics:
        from itif.metrics import Metrics  # noqa: PLC0415

        d.metrics = Metrics(d, nvml=None)
    d.start()
    return d


@pytest.fixture(scope="module")
def per_tenant(backbone):
    return tenant_bytes(backbone)


def tenant_bytes(backbone) -> int:
    """Bytes one full tenant holds in the store (float32)."""
    from itif import Engine  # noqa: PLC0415

    w = Engine(str(backbone)).load_weights(model_of(backbone, 0).state_dict())
    return sum(t.numel() * 4 for t in w.tensors.values())


def upload(d: Daemon, backbone, tenant: str, seed: int, tmp) -> None:
    data = file_of(backbone, seed, tmp)
    d.upload(ADMIN, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])


def check_answer(backbone, tenant: str, seed: int, ids, res) -> None:
    ref = reference(model_of(backbone, seed), Request(tenant, input_ids=ids))
    np.testing.assert_allclose(res.logits, ref["logits"], rtol=0, atol=1e-4)


def ask(d: Daemon, tenant: str, ids, timeout: float = 60.0):
    (res,) = d.infer(ADMIN, tenant, [Request(tenant, input_ids=ids, outputs=("logits",))],
                     timeout=timeout)
    return res


def tier(d: Daemon, tenant: str) -> Tier:
    return d.tiers.view(tenant).tier


def test_lru_eviction_pins_and_promotion_from_host_and_disk(tmp_path, backbone, per_tenant):
    """Device tier of 3 tenants, host tier of 1: an idle unpinned tenant leaves, segmented LRU
    (promoted and not used since before used again, least recently used first); the host tier
    takes it, its own coldest falls to disk; a pinned one never leaves."""
    names = ["p", "a", "b", "c", "d"]
    d = make_daemon(tmp_path, backbone, names, device_tenants=3.5, host_tenants=1.5,
                    pinned=("p",))
    try:
        for i, n in enumerate(names):
            upload(d, backbone, n, i, tmp_path)
        # uploads are installed resident: a and b make room for c and d (coldest first);
        # b's copy in the host tier pushed a's out
        assert [tier(d, n) for n in names] == [Tier.DEVICE, Tier.DISK, Tier.HOST, Tier.DEVICE,
                                               Tier.DEVICE]
        assert d.engine.weight_bytes == 3 * per_tenant
        with pytest.raises(InvalidRequest, match="vocabulary"):  # checked without its weights
            d.submit(ADMIN, "a", [Request("a", input_ids=[3, 999])])
        assert tier(d, "a") is Tier.DISK and not d.tiers.view("a").loading
        check_answer(backbone, "d", 4, IDS[0], ask(d, "d", IDS[0]))  # used again while
        check_answer(backbone, "c", 3, IDS[1], ask(d, "c", IDS[1]))  # resident: protected d, c
        check_answer(backbone, "b", 2, IDS[2], ask(d, "b", IDS[2]))  # from host: d leaves
        assert [tier(d, n) for n in "bcd"] == [Tier.DEVICE, Tier.DEVICE, Tier.HOST]
        # a from disk: b (promoted, not used since: probation) leaves before c (protected)
        check_answer(backbone, "a", 1, IDS[0], ask(d, "a", IDS[0]))
        assert [tier(d, n) for n in "abcd"] == [Tier.DEVICE, Tier.HOST, Tier.DEVICE, Tier.DISK]
        ask(d, "c", IDS[0])
        check_answer(backbone, "b", 2, IDS[0], ask(d, "b", IDS[0]))  # now a leaves, not c
        assert [tier(d, n) for n in "abcd"] == [Tier.HOST, Tier.DEVICE, Tier.DEVICE, Tier.DISK]
        views = {n: d.tiers.view(n) for n in names}
        assert [views[n].promotions for n in "abcd"] == [1, 2, 0, 0]
        assert [views[n].evictions for n in "abcd"] == [2, 2, 0, 1]  # device -> host or disk
        assert views["p"].tier is Tier.DEVICE and views["p"].evictions == 0
        check_answer(backbone, "p", 0, IDS[1], ask(d, "p", IDS[1]))
        v = d.tenant_view("a")
        assert (v.tier, v.weight_bytes, v.host_bytes) == ("host", 0, per_tenant)
        totals = d.tiers.totals()
        assert totals["host_bytes"] == per_tenant and totals["device_tenants"] == 3
        assert totals["device_bytes"] == 3 * per_tenant
    finally:
        d.stop(0)


def test_admission_by_bytes(tmp_path, backbone):
    """Weights that could never be resident beside the pinned tenants are refused, naming the
    setting; anything else is admitted, whatever is resident now."""
    d = make_daemon(tmp_path, backbone, ["p", "a"], device_tenants=1.5, pinned=("p",))
    try:
        upload(d, backbone, "p", 0, tmp_path)
        with pytest.raises(Overloaded, match="device_weight_bytes"):
            upload(d, backbone, "a", 1, tmp_path)
        assert d.status["a"].state is State.NO_WEIGHTS and not d.blobs.exists("a")
    finally:
        d.stop(0)


def test_failing_promotion_fails_only_that_tenant(tmp_path, backbone, monkeypatch):
    """A corrupt blob and an error while copying up (an injected out-of-memory) each fail only
    their tenant's requests, with UNAVAILABLE and the reason; the others are answered, and the
    transient failure heals on the next request."""
    names = ["a", "b", "c", "bad", "oom"]
    d = make_daemon(tmp_path, backbone, names, device_tenants=2.5)
    try:
        for i, n in enumerate(names):
            upload(d, backbone, n, i, tmp_path)
        assert tier(d, "bad") is Tier.DEVICE and tier(d, "a") is Tier.DISK
        ask(d, "a", IDS[0])
        ask(d, "b", IDS[0])  # bad and oom now on disk
        path = d.blobs.path_for("bad")
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
        add = d.engine.add_tenant

        def faulty(tenant, *a, **kw):
            if tenant == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return add(tenant, *a, **kw)

        monkeypatch.setattr(d.engine, "add_tenant", faulty)
        bad = d.submit(ADMIN, "bad", [Request("bad", input_ids=IDS[0])] * 3)
        oom = d.submit(ADMIN, "oom", [Request("oom", input_ids=IDS[1])] * 2)
        good = d.submit(ADMIN, "c", [Request("c", input_ids=ids) for ids in IDS])
        for t, ids in zip(good, IDS):
            check_answer(backbone, "c", 2, ids, t.result(30))
        for t in bad:
            with pytest.raises(Unavailable, match="sha256"):
                t.result(30)
        for t in oom:
            with pytest.raises(Unavailable, match="OutOfMemoryError"):
                t.result(30)
        assert d.status["bad"].state is State.FAILED and "sha256" in d.status["bad"].error
        assert d.status["oom"].state is State.READY  # transient: the next request retries
        assert d.tiers.view("oom").failures == 1
        monkeypatch.setattr(d.engine, "add_tenant", add)
        check_answer(backbone, "oom", 4, IDS[2], ask(d, "oom", IDS[2]))
        check_answer(backbone, "a", 0, IDS[1], ask(d, "a", IDS[1]))
    finally:
        d.stop(0)


def test_request_during_its_eviction_promotes_it_back(tmp_path, backbone, monkeypatch):
    """A request that arrives while its tenant's weights are being copied out (evicted, parked,
    not yet in the host tier) starts a promotion: it is answered once the eviction is done, not
    left parked until some later request of that tenant comes (it used to find the tenant
    still marked DEVICE, start nothing, and wait; the 64-tenant test then hung 120 s)."""
    d = make_daemon(tmp_path, backbone, ["a", "b"], device_tenants=1.5, host_tenants=1.5)
    try:
        upload(d, backbone, "a", 0, tmp_path)
        upload(d, backbone, "b", 1, tmp_path)  # a -> host
        demote = d.tiers._demote
        inside, go = threading.Event(), threading.Event()

        def slow_demote(tenant, st):
            if tenant == "b":
                inside.set()
                go.wait(30)
            return demote(tenant, st)

        monkeypatch.setattr(d.tiers, "_demote", slow_demote)
        (ta,) = d.submit(ADMIN, "a", [Request("a", input_ids=IDS[0], outputs=("logits",))])
        assert inside.wait(30)  # a's promotion is evicting b: b parked, being copied out
        (tb,) = d.submit(ADMIN, "b", [Request("b", input_ids=IDS[1], outputs=("logits",))])
        go.set()
        check_answer(backbone, "a", 0, IDS[0], ta.result(30))
        check_answer(backbone, "b", 1, IDS[1], tb.result(30))
    finally:
        d.stop(0)


def _closed_loop(d: Daemon, pick, stop: threading.Event, out: list, seed: int) -> None:
    """One client: a request, its answer, the next (server-side latency: enqueue to result)."""
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        tenant, ids = pick(rng)
        (t,) = d.submit(ADMIN, tenant, [Request(tenant, input_ids=ids, outputs=("logits",))])
        err = t.exception(120)
        out.append((tenant, ids, t.finished_at - t.enqueued_at, err, t._result))


def _run(d: Daemon, clients: list, seconds: float) -> list[list]:
    stop = threading.Event()
    outs = [[] for _ in clients]
    threads = [threading.Thread(target=_closed_loop, args=(d, pick, stop, out, i), daemon=True)
               for i, (pick, out) in enumerate(zip(clients, outs))]
    for th in threads:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join(150)
    return outs


def test_64_registered_16_resident_uniform_stream(tmp_path, backbone, per_tenant):
    """Issue 14's "Done when": a device tier of 16 full tenants, 64 registered (a host tier
    that holds the other 48). A uniform stream over all 64 is answered correctly (every answer
    against Hugging Face with that tenant's weights); the hot tenants' p99 with that stream
    beside them is compared with their p99 without it. Rounds alternate (hot only, hot +
    uniform) so slow drifts in the machine's load hit both; each p99 is over all rounds'
    samples (server side: enqueue to result). The bound is the issue's 2: on this 2-core
    machine shared with other jobs (load average 1.5-3.6) the ratio measured 1.04-1.84 over
    fifteen runs (median 1.40) once a promotion waits for the gaps between batches step by step
    and hashes nothing coming from the host tier; the loader as it was (whole promotions at a
    CPU share of 0.5) measured 1.51-2.35 (median 1.89) in runs alternated with those (see
    docs/operator.md, "Weight tiers"). A p99 of 300 samples is their third-worst, so one
    descheduled thread moves it: a ratio over 2 measures again (all of it: both streams, three
    rounds), at most three times in all, and the last must be within 2 (a CI run on 2026-11-26
    measured 2.16 once, on code that measured 1.16 and 1.4 the same day). Every answer of every
    attempt is checked. Then a restart: the 64 are registered again, on disk, and answer
    correctly."""
    names = [f"t{i:02d}" for i in range(64)]
    hot = names[:8]
    d = make_daemon(tmp_path, backbone, names, device_tenants=16.5, host_tenants=48.5)
    try:
        for i, n in enumerate(names):
            upload(d, backbone, n, i, tmp_path)
        for n in hot:  # warm: the hot set resident and most recently used
            ask(d, n, IDS[0])
        assert sum(tier(d, n) is Tier.DEVICE for n in names) == 16

        def pick_hot(rng):
            return hot[int(rng.integers(8))], IDS[int(rng.integers(3))]

        def pick_any(rng):
            return names[int(rng.integers(64))], IDS[int(rng.integers(3))]

        answers: list = []
        ratios: list[float] = []
        while not ratios or (ratios[-1] > 2.0 and len(ratios) < 3):
            alone: list[float] = []
            mixed: list[float] = []
            for _ in range(3):
                (a1, a2) = _run(d, [pick_hot, pick_hot], 2.0)
                alone += [r[2] for r in a1 + a2]
                outs = _run(d, [pick_hot, pick_hot, pick_any, pick_any], 2.0)
                mixed += [r[2] for r in outs[0] + outs[1]]
                answers += outs[2] + outs[3]
            assert len(alone) >= 300 and len(mixed) >= 300
            p99_alone, p99_mixed = np.percentile(alone, 99), np.percentile(mixed, 99)
            ratios.append(float(p99_mixed / p99_alone))
            print(f"\nhot p99 alone {p99_alone * 1e3:.2f} ms ({len(alone)} samples), with the "
                  f"uniform stream {p99_mixed * 1e3:.2f} ms ({len(mixed)}), ratio {ratios[-1]:.2f}")
        for tenant, ids, _, err, res in answers:
            assert err is None, (tenant, err)
            check_answer(backbone, tenant, int(tenant[1:]), ids, res)
        promoted = sum(d.tiers.view(n).promotions for n in names)
        print(f"uniform answers {len(answers)} over {len({a[0] for a in answers})} tenants; "
              f"promotions {promoted}")
        assert len({a[0] for a in answers}) >= 32 and promoted >= 40
        assert ratios[-1] <= 2.0, ratios
        assert d.engine.weight_bytes <= 16.5 * per_tenant
    finally:
        d.stop(0)
    d = make_daemon(tmp_path, backbone, names, device_tenants=16.5, host_tenants=16.5)
    try:
        assert all(d.status[n].state is State.READY for n in names)
        assert all(tier(d, n) is Tier.DISK for n in names) and d.engine.weight_bytes == 0
        for n in names[::9]:
            check_answer(backbone, n, int(n[1:]), IDS[2], ask(d, n, IDS[2]))
    finally:
        d.stop(0)


def test_visibility_metrics_views_and_live_pinning(tmp_path, backbone, per_tenant):
    """/metrics: each tenant's tier and counts, bytes/budgets/tenants per tier, promotions by
    source and result with their time, evictions by destination (no tenant label on those);
    the tenant view carries tier and bytes; ``pinned`` set by a live reload loads the tenant
    and keeps it."""
    import dataclasses  # noqa: PLC0415

    from prometheus_client import generate_latest  # noqa: PLC0415

    d = make_daemon(tmp_path, backbone, ["a", "b"], device_tenants=1.5, host_tenants=1.5,
                    metrics=True)
    try:
        upload(d, backbone, "a", 0, tmp_path)
        upload(d, backbone, "b", 1, tmp_path)  # a -> host
        check_answer(backbone, "a", 0, IDS[0], ask(d, "a", IDS[0]))  # b -> host, a's copy out
        text = generate_latest(d.metrics.registry).decode()
        for line in ('itif_tenant_tier{tenant="a",tier="device"} 1.0',
                     'itif_tenant_tier{tenant="b",tier="host"} 1.0',
                     'itif_tenant_promotions_total{tenant="a"} 1.0',
                     'itif_tenant_evictions_total{tenant="b"} 1.0',
                     'itif_tier_promotions_total{result="ok",source="host"} 1.0',
                     'itif_tier_promotion_seconds_count{source="host"} 1.0',
                     'itif_tier_evictions_total{to="host"} 2.0',
                     f'itif_tier_bytes{{tier="device"}} {float(per_tenant)}',
                     f'itif_tier_bytes{{tier="host"}} {float(per_tenant)}',
                     f'itif_tier_budget_bytes{{tier="device"}} {float(int(1.5 * per_tenant))}',
                     'itif_tier_tenants{tier="host"} 1.0'):
            assert line in text, line
        assert 'itif_tier_promotions_total{result="ok",source="host",tenant' not in text
        views = {v.id: v for v in d.list_tenants(ADMIN)}
        assert (views["a"].tier, views["a"].weight_bytes) == ("device", per_tenant)
        assert (views["b"].tier, views["b"].host_bytes) == ("host", per_tenant)
        from itif.server.service import _tenant_info  # noqa: PLC0415 - what itif tenants prints

        info = _tenant_info(views["b"])
        assert (info.tier, info.host_bytes, info.weight_bytes) == ("host", per_tenant, 0)
        cfg = d.config
        pinned = dataclasses.replace(cfg, tenants=tuple(
            dataclasses.replace(t, pinned=t.id == "b") for t in cfg.tenants))
        d.apply_config(pinned)
        deadline = time.monotonic() + 30
        while tier(d, "b") is not Tier.DEVICE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier(d, "b") is Tier.DEVICE and d.tiers.view("b").pinned
        with pytest.raises(Unavailable, match="could never be resident"):
            ask(d, "a", IDS[0])  # only b's place would fit it, and b is pinned
        assert tier(d, "b") is Tier.DEVICE and tier(d, "a") is Tier.HOST
    finally:
        d.stop(0)


def test_lora_tenant_leaves_and_returns_with_its_base(tmp_path, backbone, per_tenant):
    """A LoRA tenant is evicted like any other (its base stays while it is resident); its
    promotion loads its base first when the base left meanwhile; answers equal PEFT's."""
    import copy  # noqa: PLC0415

    peft = pytest.importorskip("peft")
    from itif.backbones.lora_tenants import pack_adapter  # noqa: PLC0415

    d = make_daemon(tmp_path, backbone, ["b0", "la", "x", "y"], device_tenants=2.5,
                    host_tenants=1.5, bases={"la": "b0"})
    try:
        upload(d, backbone, "b0", 0, tmp_path)
        torch.manual_seed(7)
        lora = peft.get_peft_model(copy.deepcopy(model_of(backbone, 0)), peft.LoraConfig(
            r=4, target_modules=["query", "value", "dense"], init_lora_weights=False)).eval()
        lora.save_pretrained(tmp_path / "adapter")
        packed = pack_adapter(tmp_path / "adapter", tmp_path / "adapter.safetensors")
        data = open(packed, "rb").read()
        d.upload(ADMIN, "la", hashlib.sha256(data).hexdigest(), len(data), [data])
        ref = lora.base_model.model

        def check_la(ids):
            got = ask(d, "la", ids).logits
            want = reference(ref, Request("la", input_ids=ids))["logits"]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)

        check_la(IDS[0])
        la_bytes = d.engine.tenant_info("la").exclusive_bytes  # its adapters and head
        per = per_tenant
        assert 0 < la_bytes < per // 4
        d.engine.store.max_bytes = 2 * per + la_bytes // 2  # x fits only if la or b0 leaves
        upload(d, backbone, "x", 2, tmp_path)  # la goes: b0 is older, but la's base
        assert tier(d, "b0") is Tier.DEVICE and tier(d, "la") is not Tier.DEVICE
        upload(d, backbone, "y", 3, tmp_path)  # now b0 can go
        assert tier(d, "b0") is not Tier.DEVICE
        check_la(IDS[1])  # b0 first, then la on its slots
        assert tier(d, "b0") is Tier.DEVICE and tier(d, "la") is Tier.DEVICE
        check_answer(backbone, "b0", 0, IDS[2], ask(d, "b0", IDS[2]))
    finally:
        d.stop(0)


def test_shared_tensors_counted_once_in_both_tiers(tmp_path, backbone, per_tenant):
    """Two tenants that differ only in their head: the device tier holds their backbone once
    (the store), and so does the host tier once both are evicted (its interned pool)."""
    for seed in (100, 101):
        _MODELS[seed] = make_hf_model(str(backbone), num_labels=3, seed=seed,
                                      base_of=model_of(backbone, 0))
    d = make_daemon(tmp_path, backbone, ["s1", "s2", "x", "y"], device_tenants=2.5,
                    host_tenants=3)
    try:
        upload(d, backbone, "s1", 100, tmp_path)
        upload(d, backbone, "s2", 101, tmp_path)
        shared = d.engine.weight_bytes
        head = shared - per_tenant
        assert 0 < head < per_tenant // 10  # the second tenant added only its head
        upload(d, backbone, "x", 2, tmp_path)
        upload(d, backbone, "y", 3, tmp_path)
        assert tier(d, "s1") is Tier.HOST and tier(d, "s2") is Tier.HOST
        assert d.tiers.totals()["host_bytes"] == shared  # not 2 x per_tenant
        assert d.tiers.view("s2").host_bytes == per_tenant  # what it reads, shared included
        check_answer(backbone, "s2", 101, IDS[0], ask(d, "s2", IDS[0]))
        check_answer(backbone, "s1", 100, IDS[1], ask(d, "s1", IDS[1]))
    finally:
        d.stop(0)


def test_itif_serve_with_tiers(tmp_path):
    """A real ``itif serve`` with a device tier of 1.5 bert-tiny tenants: three uploads, each
    answered (the others promoted in turn); ``itif tenants`` and /metrics show the tiers."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    from tests.daemon_harness import ADMIN as ADMIN_TOKEN  # noqa: PLC0415
    from tests.daemon_harness import Daemon as Served  # noqa: PLC0415
    from tests.daemon_harness import free_port  # noqa: PLC0415
    from tests.reliability_util import upload_bytes, weights_bytes  # noqa: PLC0415

    one = len(weights_bytes(1))  # float32 tensors: the file is the tensors and a header
    d = Served(tmp_path / "d", {"a": "ta", "b": "tb", "c": "tc"},
               backbone_extra={"device_weight_bytes": int(one * 1.5)},
               server_extra={"metrics_listen": f"127.0.0.1:{free_port()}"})
    d.start()
    try:
        with d.client(ADMIN_TOKEN) as c:
            for i, n in enumerate("abc"):
                upload_bytes(c, n, weights_bytes(i + 1))
            first = {n: c.infer(n, [1, 2, 3], outputs=("logits",))["logits"] for n in "abc"}
            again = {n: c.infer(n, [1, 2, 3], outputs=("logits",))["logits"] for n in "cab"}
            for n in "abc":
                np.testing.assert_array_equal(first[n], again[n])
        ls = subprocess.run([sys.executable, "-m", "itif", "tenants", "--server", d.addr,
                             "--token", ADMIN_TOKEN], capture_output=True, text=True, timeout=60)
        rows = [json.loads(line) for line in ls.stdout.splitlines()]
        assert sorted(r["tier"] for r in rows) == ["device", "disk", "disk"], ls.stdout
        text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert 'itif_tenant_tier{tenant="b",tier="device"} 1.0' in text
        assert 'itif_tier_promotions_total{result="ok",source="disk"} 5.0' in text
    finally:
        d.stop()


def test_kserve_metadata_and_default_outputs_do_not_depend_on_the_tier(tmp_path, backbone):
    """A tenant on disk (a restart registers it without reading it) or on the host tier: KServe
    metadata and config name its logits output as for a resident tenant, an inference that asks
    for no output gets logits (the engine's default for a tenant with a head), and its view
    reports its labels; the metadata read its file once and installed nothing."""
    import asyncio  # noqa: PLC0415

    from itif.server.kserve_core import KServeCore  # noqa: PLC0415

    d = make_daemon(tmp_path, backbone, ["a", "b"], device_tenants=1.5, host_tenants=1.5)
    try:
        upload(d, backbone, "a", 0, tmp_path)
        resident = KServeCore(d).model_metadata(ADMIN, "a")
        upload(d, backbone, "b", 1, tmp_path)  # a -> host
        assert tier(d, "a") is Tier.HOST
        core = KServeCore(d)
        assert core.model_metadata(ADMIN, "a") == resident
        assert d.tenant_view("a").num_labels == 3
    finally:
        d.stop(0)
    d = make_daemon(tmp_path, backbone, ["a", "b"], device_tenants=1.5, host_tenants=1.5)
    try:
        core = KServeCore(d)
        assert tier(d, "a") is Tier.DISK and d.tiers.signature("a") is None
        meta = core.model_metadata(ADMIN, "a")
        assert meta == resident and [o["name"] for o in meta["outputs"]][:1] == ["logits"]
        assert tier(d, "a") is Tier.DISK and d.engine.weight_bytes == 0  # read, not installed
        assert d.tenant_view("a").num_labels == 3
        config = core.model_config(ADMIN, "a")
        assert config["output"][0] == {"name": "logits", "data_type": "TYPE_FP32", "dims": [3]}
        ids = np.array([IDS[0]], np.int64)
        assert tier(d, "b") is Tier.DISK and d.tiers.signature("b") is None
        outs = asyncio.run(core.infer(ADMIN, "b", "", {"input_ids": ids}, []))
        assert [name for name, _ in outs] == ["logits"]
        check_answer(backbone, "b", 1, IDS[0], Result("b", logits=outs[0][1][0]))
    finally:
        d.stop(0)


def test_a_promotion_waiting_for_an_idle_tenant_is_not_throttled_for_its_wait():
    """The loader leaves the forward its share of the CPU by sleeping after each promotion as
    long as its work took (loader_share 0.5), not counting the time it only waited. A wait for
    a busy tenant to become evictable was counted as work: b's promotion, which waits wait_s
    (1 s) for busy x and fails, then slept 1 s more, and c, queued behind it though it needs
    no eviction, became resident after 2 s. Now after about 1 s."""
    import itif
    from itif.weights.tiers import TierManager

    probe = itif.Engine("bert-tiny", device="cpu", dtype="float32")
    ma = make_hf_model("bert-tiny", 3, 1)
    models = {"a": ma, "x": make_hf_model("bert-tiny", 3, 2), "b": make_hf_model("bert-tiny", 3, 3),
              "c": make_hf_model("bert-tiny", 3, 4, base_of=ma)}  # c: a's backbone, its own head
    W = {t: probe.load_weights({k: v.detach().clone() for k, v in m.state_dict().items()})
         for t, m in models.items()}
    size = sum(t.numel() * 4 for t in W["a"].tensors.values())
    engine = itif.Engine(
        "bert-tiny", device="cpu", dtype="float32", max_weight_bytes=2 * size + 8192
    )
    sched = Scheduler(engine.infer)
    for t in W:
        sched.set_tenant(t, TenantQuota())
    tiers = TierManager(engine, sched, host_bytes=0, load=lambda t: W[t], wait_s=1.0)
    try:
        for t in W:
            tiers.register(t, stored=True, pinned=(t == "a"))
        tiers.promote("a")
        tiers.promote("x")
        tiers.acquire("x")  # x is busy throughout: b's promotion waits for it, then fails
        t0 = time.monotonic()
        tiers.ensure("b")
        time.sleep(0.05)
        tiers.ensure("c")  # fits as it is, but queues behind b
        while tiers.view("c").tier is not Tier.DEVICE and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert tiers.view("c").tier is Tier.DEVICE
        assert tiers.view("b").tier is not Tier.DEVICE and tiers.view("b").error
        assert 0.95 < took < 1.6, took
    finally:
        tiers.close()
