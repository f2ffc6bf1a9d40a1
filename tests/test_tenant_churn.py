"""Tenants leaving and coming back through live tenants.yaml edits (in-process daemons):
- removing many tenants at once costs O(1) per tenant: one retire thread, which reads each
  tenant's outstanding count (before: one thread per tenant, each copying every tenant's
  counters every 50 ms, so removing 2,000 tenants held the reload 6-9 s and slowed requests);
- with weight tiers, a tenant whose stored file's sidecar is corrupt comes back FAILED alone:
  the reload goes on for the others and the daemon still starts (before: the reload stopped
  half applied, the other tenants left without weights, and the start raised);
- a pinned tenant that comes back is loaded at once, as at start-up (before: on disk until its
  first request);
- a LoRA tenant that comes back on another base is FAILED, its adapter not served there (before:
  the adapter trained for one base answered on the other, READY);
- a removed tenant leaves no Prometheus series behind.
"""

from __future__ import annotations

import copy
import hashlib
import time

import pytest
import safetensors.torch
import torch

from itif.config import hash_token, parse_config
from itif.daemon import Daemon, Identity, State
from itif.requests import Request
from itif.scheduler import Scheduler
from itif.weights.tiers import Tier
from tests.oracle import make_hf_model

ADMIN = Identity(None, admin=True)
TIERS = "  device_weight_bytes: 64MiB\n"


def _config(root, ids, backbone: str = "", pinned=(), bases=None):
    lines = [f"server:\n  listen: 127.0.0.1:0\n  data_dir: {root}/data\n"
             f"  admin_token_sha256: {hash_token('admin')}\n",
             f"backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n{backbone}",
             "scheduler:\n  max_wait_ms: 1\n", "tenants:\n"]
    for t in ids:
        lines.append(f"  - id: {t}\n    token_sha256: {hash_token(t + '-tok')}\n")
        if t in pinned:
            lines.append("    pinned: true\n")
        if bases and t in bases:
            lines.append(f"    base: {bases[t]}\n")
    return parse_config("".join(lines), root)


_WEIGHTS: list[bytes] = []


def _upload(d: Daemon, tenant: str, data: bytes | None = None) -> None:
    if not _WEIGHTS:
        m = make_hf_model("bert-tiny", 2, seed=0)
        _WEIGHTS.append(safetensors.torch.save({k: v.contiguous()
                                                for k, v in m.state_dict().items()}))
    data = _WEIGHTS[0] if data is None else data
    d.upload(ADMIN, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])


def _until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_removing_many_tenants_retires_them_without_a_scan_per_tenant(tmp_path, monkeypatch):
    ids = [f"t{i}" for i in range(400)]
    d = Daemon(_config(tmp_path, ids))
    d.start()
    reads = []
    stats = Scheduler.stats
    monkeypatch.setattr(Scheduler, "stats", property(lambda s: reads.append(1) or stats.fget(s)))
    try:
        for t in ("t1", "t2"):
            _upload(d, t)
        start = time.monotonic()
        d.apply_config(_config(tmp_path, ids[:1]))
        assert time.monotonic() - start < 2.0
        assert _until(lambda: "t1" not in d.engine.store and "t2" not in d.engine.store)
        assert reads == []  # no copy of every tenant's counters per removed tenant
        assert sorted(d.status) == ["t0"]
    finally:
        d.stop(0)


def test_a_corrupt_sidecar_fails_its_tenant_alone_with_tiers(tmp_path):
    ids = ["a", "b", "c"]
    d = Daemon(_config(tmp_path, ids, TIERS))
    d.start()
    try:
        for t in ids:
            _upload(d, t)
        d.apply_config(_config(tmp_path, ["a"], TIERS))
        (tmp_path / "data/store/weights/b.sha256").write_bytes(b"garbage\n")
        d.apply_config(_config(tmp_path, ids, TIERS))
        assert d.status["b"].state is State.FAILED and "sha256" in d.status["b"].error
        assert d.status["c"].state is State.READY
        (res,) = d.infer(ADMIN, "c", [Request("c", input_ids=[1, 2, 3])], timeout=30)
        assert res.logits is not None
    finally:
        d.stop(0)
    again = Daemon(_config(tmp_path, ids, TIERS))
    again.start()  # the corrupt sidecar fails b, not the start
    try:
        assert again.status["b"].state is State.FAILED
        assert again.status["a"].state is again.status["c"].state is State.READY
    finally:
        again.stop(0)


def test_a_pinned_tenant_that_comes_back_is_loaded_at_once(tmp_path):
    d = Daemon(_config(tmp_path, ["a", "b"], TIERS, pinned=("b",)))
    d.start()
    try:
        _upload(d, "b")
        assert d.tiers.view("b").tier is Tier.DEVICE
        d.apply_config(_config(tmp_path, ["a"], TIERS))
        assert _until(lambda: d.tiers.view("b") is None)
        d.apply_config(_config(tmp_path, ["a", "b"], TIERS, pinned=("b",)))
        assert _until(lambda: d.tiers.view("b").tier is Tier.DEVICE), d.tiers.view("b")
    finally:
        d.stop(0)


def test_a_removed_tenant_leaves_no_series_behind(tmp_path):
    from prometheus_client import generate_latest  # noqa: PLC0415

    from itif.metrics import Metrics  # noqa: PLC0415

    d = Daemon(_config(tmp_path, ["a", "b"]))
    d.metrics = Metrics(d, nvml=None)
    d.start()
    try:
        for t in ("a", "b"):
            _upload(d, t)
            d.infer(ADMIN, t, [Request(t, input_ids=[1, 2, 3])], timeout=30)
        _until(lambda: d.scheduler.outstanding("b") == 0)
        assert b'tenant="b"' in generate_latest(d.metrics.registry)
        d.apply_config(_config(tmp_path, ["a"]))
        assert _until(lambda: b'tenant="b"' not in generate_latest(d.metrics.registry))
        assert b'tenant="a"' in generate_latest(d.metrics.registry)
        assert "b" not in d.metrics._stats
    finally:
        d.stop(0)


def _adapter(tmp_path, base) -> bytes:
    """A packed PEFT LoRA adapter (query, rank 4) trained on nothing, for ``base``."""
    peft = pytest.importorskip("peft")
    from itif.backbones.lora_tenants import pack_adapter  # noqa: PLC0415

    torch.manual_seed(1)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["query"]))
    lora.save_pretrained(tmp_path / "adapter")
    return pack_adapter(tmp_path / "adapter", tmp_path / "adapter.safetensors").read_bytes()


LORA = ["b1", "b2", "l"]


def _lora_on_b1(tmp_path, backbone: str = "") -> tuple[Daemon, bytes]:
    """A started daemon with full tenants b1 and b2 and l, a LoRA tenant of b1, all uploaded;
    and l's adapter."""
    b1 = make_hf_model("bert-tiny", 2, seed=3)
    adapter = _adapter(tmp_path, b1)
    d = Daemon(_config(tmp_path, LORA, backbone, bases={"l": "b1"}))
    d.start()
    try:
        _upload(d, "b1", safetensors.torch.save({k: v.contiguous()
                                                for k, v in b1.state_dict().items()}))
        _upload(d, "b2")
        _upload(d, "l", adapter)
    except BaseException:
        d.stop(0)
        raise
    return d, adapter


def test_a_lora_tenant_back_on_another_base_is_failed_not_served(tmp_path):
    d, _ = _lora_on_b1(tmp_path)
    ids = LORA
    try:
        d.apply_config(_config(tmp_path, ["b1", "b2"]))
        assert _until(lambda: "l" not in d.engine.store)
        d.apply_config(_config(tmp_path, ids, bases={"l": "b2"}))
        st = d.status["l"]
        assert st.state is State.FAILED and "a LoRA tenant of 'b1'" in st.error, st
        assert "l" not in d.engine.store and d.blobs.exists("l")  # the file kept
        d.apply_config(_config(tmp_path, ["b1", "b2"]))
        d.apply_config(_config(tmp_path, ids, bases={"l": "b1"}))  # back as it was: served
        assert d.status["l"].state is State.READY and "l" in d.engine.store
    finally:
        d.stop(0)


def test_with_tiers_a_lora_tenant_whose_base_was_deleted_restarts_failed(tmp_path):
    """As without tiers: FAILED (FAILED_PRECONDITION), not READY failing every request with a
    retryable UNAVAILABLE (before: its registration marked any stored file READY)."""
    from itif.errors import NoWeights  # noqa: PLC0415

    base = make_hf_model("bert-tiny", 2, seed=3)
    adapter = _adapter(tmp_path, base)
    cfg = lambda: _config(tmp_path, ["b", "l"], TIERS, bases={"l": "b"})  # noqa: E731
    d = Daemon(cfg())
    d.start()
    try:
        _upload(d, "b", safetensors.torch.save({k: v.contiguous()
                                               for k, v in base.state_dict().items()}))
        _upload(d, "l", adapter)
        d.delete_weights(ADMIN, "b")
        assert d.status["l"].state is State.FAILED
    finally:
        d.stop(0)
    d = Daemon(cfg())
    d.start()
    try:
        st = d.status["l"]
        assert st.state is State.FAILED and "'b' has no weights" in st.error, st
        with pytest.raises(NoWeights):
            d.infer(ADMIN, "l", [Request("l", input_ids=[1, 2, 3])], timeout=30)
    finally:
        d.stop(0)


@pytest.mark.parametrize("tiers", ["", TIERS], ids=["resident", "tiers"])
def test_a_lora_tenant_on_another_base_after_a_restart_is_failed(tmp_path, tiers):
    """What a stored file was committed for is noted beside it: a config edited while the
    daemon was down (l moved from b1 to b2) does not serve b1's adapter on b2 (before: READY
    after any restart); back on b1, or after a delete and a new upload, it serves again."""
    d, adapter = _lora_on_b1(tmp_path, tiers)
    ids = LORA
    d.stop(0)
    d = Daemon(_config(tmp_path, ids, tiers, bases={"l": "b2"}))
    d.start()
    try:
        st = d.status["l"]
        assert st.state is State.FAILED and "a LoRA tenant of 'b1'" in st.error, st
        d.delete_weights(ADMIN, "l")
        _upload(d, "l", adapter)  # uploaded again for b2: its own now
        assert d.status["l"].state is State.READY
    finally:
        d.stop(0)
    d = Daemon(_config(tmp_path, ids, tiers, bases={"l": "b2"}))
    d.start()
    try:
        assert d.status["l"].state is State.READY
    finally:
        d.stop(0)


@pytest.mark.parametrize("tiers", ["", TIERS], ids=["resident", "tiers"])
def test_a_lora_tenant_removed_over_a_restart_and_back_on_another_base_is_failed(tmp_path,
                                                                                 tiers):
    """The note of a stored file whose tenant was not configured at start is read when the
    tenant comes back (before: only configured tenants' notes were read at start, so l, out of
    tenants.yaml over a restart and added back live on b2, served b1's adapter on b2, READY)."""
    d, _ = _lora_on_b1(tmp_path, tiers)
    d.stop(0)
    d = Daemon(_config(tmp_path, ["b1", "b2"], tiers))
    d.start()
    try:
        assert d.blobs.exists("l")  # kept while not configured
        d.apply_config(_config(tmp_path, LORA, tiers, bases={"l": "b2"}))
        st = d.status["l"]
        assert st.state is State.FAILED and "a LoRA tenant of 'b1'" in st.error, st
        assert "l" not in d.engine.store
        d.apply_config(_config(tmp_path, ["b1", "b2"], tiers))
        d.apply_config(_config(tmp_path, LORA, tiers, bases={"l": "b1"}))  # as uploaded: served
        assert _until(lambda: d.status["l"].state is State.READY), d.status["l"]
    finally:
        d.stop(0)
