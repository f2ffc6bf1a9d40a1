"""Tenants leaving and coming back through live tenants.yaml edits (in-process daemons):
- removing many tenants at once costs O(1) per tenant: one retire thread, which reads each
  tenant's outstanding count (before: one thread per tenant, each copying every tenant's
  counters every 50 ms, so removing 2,000 tenants held the reload 6-9 s and slowed requests);
- with weight tiers, a tenant whose stored file's sidecar is corrupt comes back FAILED alone:
  the reload goes on for the others and the daemon still starts (before: the reload stopped
  half applied, the other tenants left without weights, and the start raised);
- a pinned tenant that comes back is loaded at once, as at start-up (before: on disk until its
  first request).
"""

from __future__ import annotations

import hashlib
import time

import safetensors.torch

from itif.config import hash_token, parse_config
from itif.daemon import Daemon, Identity, State
from itif.requests import Request
from itif.scheduler import Scheduler
from itif.weights.tiers import Tier
from tests.oracle import make_hf_model

ADMIN = Identity(None, admin=True)
TIERS = "  device_weight_bytes: 64MiB\n"


def _config(root, ids, backbone: str = "", pinned=()):
    lines = [f"server:\n  listen: 127.0.0.1:0\n  data_dir: {root}/data\n"
             f"  admin_token_sha256: {hash_token('admin')}\n",
             f"backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n{backbone}",
             "scheduler:\n  max_wait_ms: 1\n", "tenants:\n"]
    for t in ids:
        lines.append(f"  - id: {t}\n    token_sha256: {hash_token(t + '-tok')}\n")
        if t in pinned:
            lines.append("    pinned: true\n")
    return parse_config("".join(lines), root)


_WEIGHTS: list[bytes] = []


def _upload(d: Daemon, tenant: str) -> None:
    if not _WEIGHTS:
        m = make_hf_model("bert-tiny", 2, seed=0)
        _WEIGHTS.append(safetensors.torch.save({k: v.contiguous()
                                                for k, v in m.state_dict().items()}))
    data = _WEIGHTS[0]
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
