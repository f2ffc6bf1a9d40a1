"""Uploads that race another change to the same tenant or to its base (in-process daemons).

The daemon probes an upload's weights before it takes the tenant's lock (without weight tiers);
whatever happens meanwhile to the tenant or to its base must leave the acknowledged outcome the
durable one:
- an upload and a delete of one tenant at once, with weight tiers on (where the upload holds the
  tiers' io while it probes): both finish, in one order, and other tenants' uploads go on;
- a LoRA tenant's upload while its base is deleted, a delta tenant's upload while its base is
  replaced: refused (FAILED_PRECONDITION, "upload it again") with nothing stored, where before
  the first was refused yet stored (and served once the base came back) and the second was
  accepted, then FAILED after a restart.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time

import pytest
import safetensors.torch
import torch

from itif.config import hash_token, parse_config
from itif.daemon import Daemon, Identity, State
from itif.errors import NoWeights
from itif.requests import Request
from tests.oracle import make_hf_model

ADMIN = Identity(None, admin=True)


def _config(root, tenants: str, backbone: str = ""):
    return parse_config(
        "server:\n  listen: 127.0.0.1:0\n  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token('admin')}\n"
        f"backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n{backbone}"
        f"tenants:\n{tenants}", root)


def _daemon(root, tenants: str, backbone: str = "") -> Daemon:
    d = Daemon(_config(root, tenants, backbone))
    d.start()
    return d


def _tenant(name: str, extra: str = "", token: str = "") -> str:
    return f"  - id: {name}\n    token_sha256: {hash_token(token or 't-' + name)}\n{extra}"


def _bytes(model) -> bytes:
    return safetensors.torch.save({k: v.contiguous() for k, v in model.state_dict().items()})


def _upload(d: Daemon, tenant: str, data: bytes):
    return d.upload(ADMIN, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])


def _during_probe(d: Daemon, monkeypatch, action) -> None:
    """Run ``action()`` once, right after the next upload's probe."""
    probe = d.engine.probe

    def probe_then_act(*a, **kw):
        probe(*a, **kw)
        monkeypatch.setattr(d.engine, "probe", probe)
        action()

    monkeypatch.setattr(d.engine, "probe", probe_then_act)


def test_upload_and_delete_of_one_tenant_at_once_with_tiers(tmp_path, monkeypatch):
    d = _daemon(tmp_path, _tenant("x") + _tenant("y"), "  device_weight_bytes: 100MiB\n")
    deleted: list = []
    deleting = threading.Thread(target=lambda: deleted.append(d.delete_weights(ADMIN, "x")),
                                daemon=True)
    try:
        _upload(d, "x", _bytes(make_hf_model("bert-tiny", 2, seed=1)))

        def start_delete():
            deleting.start()  # the admin's delete arrives while the upload is being probed
            time.sleep(0.3)

        _during_probe(d, monkeypatch, start_delete)
        uploading = threading.Thread(
            target=_upload, args=(d, "x", _bytes(make_hf_model("bert-tiny", 2, seed=2))),
            daemon=True)
        uploading.start()
        uploading.join(30)
        deleting.join(30)
        assert not uploading.is_alive() and not deleting.is_alive(), "deadlocked"
        # the delete waited for the upload's commit: it removed the new weights and their file
        assert deleted == [(True, deleted[0][1])]
        assert d.status["x"].state is State.NO_WEIGHTS and not d.blobs.exists("x")
        y = make_hf_model("bert-tiny", 2, seed=3)
        _upload(d, "y", _bytes(y))
        (res,) = d.infer(ADMIN, "y", [Request("y", input_ids=[1, 7, 42])], timeout=30)
        assert res.logits is not None and d.status["y"].state is State.READY
    finally:
        d.stop(0)


@pytest.fixture(scope="module")
def base():
    return make_hf_model("bert-tiny", 2, seed=3)


def test_lora_upload_while_its_base_is_deleted_is_refused_and_not_stored(tmp_path, monkeypatch,
                                                                         base):
    peft = pytest.importorskip("peft")
    from itif.backbones.lora_tenants import pack_adapter  # noqa: PLC0415

    torch.manual_seed(1)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["query"])).eval()
    lora.save_pretrained(tmp_path / "adapter")
    adapter = pack_adapter(tmp_path / "adapter", tmp_path / "adapter.safetensors").read_bytes()
    d = _daemon(tmp_path / "d", _tenant("base") + _tenant("la", "    base: base\n"))
    try:
        _upload(d, "base", _bytes(base))
        _during_probe(d, monkeypatch, lambda: d.delete_weights(ADMIN, "base"))
        with pytest.raises(NoWeights, match="'base' was deleted or replaced during this upload"):
            _upload(d, "la", adapter)
        assert d.status["la"].state is State.NO_WEIGHTS and not d.blobs.exists("la")
        _upload(d, "base", _bytes(base))  # the base back: the refused adapter stays refused
        assert d.status["la"].state is State.NO_WEIGHTS and "la" not in d.engine.store
        _upload(d, "la", adapter)  # uploaded again: served
        assert d.status["la"].state is State.READY
    finally:
        d.stop(0)


def test_delta_upload_while_its_base_is_replaced_is_refused_and_not_stored(tmp_path,
                                                                           monkeypatch, base):
    fine = copy.deepcopy(base)
    with torch.no_grad():
        for p in fine.parameters():
            p.add_(torch.randn_like(p) * 5e-4)
    d = _daemon(tmp_path, _tenant("base") + _tenant("d8", "    base: base\n    compress: int8\n"))
    try:
        _upload(d, "base", _bytes(base))
        other = _bytes(make_hf_model("bert-tiny", 2, seed=12))
        _during_probe(d, monkeypatch, lambda: _upload(d, "base", other))
        with pytest.raises(NoWeights, match="'base' was deleted or replaced during this upload"):
            _upload(d, "d8", _bytes(fine))
        assert d.status["d8"].state is State.NO_WEIGHTS and not d.blobs.exists("d8")
        _upload(d, "base", _bytes(base))
        _upload(d, "d8", _bytes(fine))  # against the base it has now: accepted, and restored
        d.stop(0)
        d.start()
        assert d.status["d8"].state is State.READY, d.status["d8"]
    finally:
        d.stop(0)


def test_an_upload_whose_note_cannot_be_written_is_refused_and_not_stored(tmp_path, monkeypatch):
    """The note (what the file is for) is written before the commit point: a full disk there
    refuses the upload with nothing stored (before, the note was written after the commit, so
    a refused upload's weights were on disk and served after a restart)."""
    from itif.errors import Overloaded  # noqa: PLC0415

    d = _daemon(tmp_path, _tenant("x"))
    try:
        first = _bytes(make_hf_model("bert-tiny", 2, seed=1))
        _upload(d, "x", first)

        def full(*_):
            raise Overloaded("no space left on the device for this upload")

        monkeypatch.setattr(d.blobs, "stage_note", full)
        with pytest.raises(Overloaded):
            _upload(d, "x", _bytes(make_hf_model("bert-tiny", 2, seed=2)))
        want = hashlib.sha256(first).hexdigest()
        assert d.blobs.stored_sha256("x") == want and d.status["x"].sha256 == want
    finally:
        d.stop(0)


def test_an_upload_whose_token_was_rotated_while_it_streamed_is_refused(tmp_path):
    """The operator rotates a tenant's token (tenants.yaml) while an upload sent with the old
    one streams: the upload is refused (UNAUTHENTICATED) with nothing stored; before, it
    committed once its stream ended. The new token's upload is accepted."""
    from itif.errors import Unauthenticated  # noqa: PLC0415

    d = _daemon(tmp_path, _tenant("x"))
    try:
        data = _bytes(make_hf_model("bert-tiny", 2, seed=1))
        digest = hashlib.sha256(data).hexdigest()
        old = d.identify("Bearer t-x")
        up = d.begin_upload(old, "x", digest, len(data))
        up.write(data)
        d.apply_config(_config(tmp_path, _tenant("x", token="rotated")))
        with pytest.raises(Unauthenticated, match="rotated or revoked"):
            d.finish_upload("x", up, old)
        assert not d.blobs.exists("x") and d.status["x"].state is State.NO_WEIGHTS
        new = d.identify("Bearer rotated")
        d.upload(new, "x", digest, len(data), [data])
        assert d.status["x"].state is State.READY
    finally:
        d.stop(0)


def test_kserve_load_charges_a_tenant_as_upload_weights_does(tmp_path):
    """A tenant's repository load is charged every byte, as its UploadWeights is, so neither
    tells it whether another tenant holds the same weights (before: the load was credited
    with a's tensors and accepted where UploadWeights was refused)."""
    import asyncio  # noqa: PLC0415

    from itif import Engine  # noqa: PLC0415
    from itif.errors import Overloaded  # noqa: PLC0415
    from itif.server.kserve_core import KServeCore  # noqa: PLC0415

    model = make_hf_model("bert-tiny", 2, seed=1)
    one = sum(t.numel() * 4 for t in Engine("bert-tiny").load_weights(
        model.state_dict()).tensors.values())
    d = _daemon(tmp_path, _tenant("a") + _tenant("b"), f"  max_weight_bytes: {int(1.5 * one)}\n")
    try:
        data = _bytes(model)
        _upload(d, "a", data)
        b = d.identify("Bearer t-b")
        with pytest.raises(Overloaded):
            asyncio.run(KServeCore(d).load(b, "b", {"file:model.safetensors": data}))
        assert not d.blobs.exists("b")
    finally:
        d.stop(0)
