"""Weight tiers under churn: re-uploads, deletes, config reloads and restarts while requests
wait for weights, LoRA and delta tenants and their bases (each case a defect a review found,
fixed; every test fails on the code before the fix).

A device budget of about 1.5-3.5 bert-tiny tenants (``P`` bytes each, float32, CPU), real
``Daemon`` objects in this process; answers are checked against Hugging Face's model (PEFT's for
LoRA) with the tenant's own weights.
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import pytest
import torch

from itif import daemon_tiers
from itif.config import hash_token, parse_config
from itif.daemon import Daemon, Identity, State
from itif.errors import NoWeights, Overloaded
from itif.requests import Request
from itif.safetensors_io import save_safetensors
from itif.weights.tiers import Tier
from tests.oracle import make_hf_model, reference

ADMIN = Identity(None, admin=True)
IDS = [1, 7, 42, 3, 9]
WAIT_S = 20.0  # before the fixes these requests waited for ever


@pytest.fixture(scope="module")
def P():  # bytes of one full bert-tiny tenant in the float32 store
    import itif  # noqa: PLC0415

    w = itif.Engine("bert-tiny").load_weights(make_hf_model("bert-tiny", 3, seed=0).state_dict())
    return sum(t.numel() * 4 for t in w.tensors.values())


def _fine_tune(base, seed: int):
    """``base`` plus noise of 1% of each weight's std (LayerNorms untouched): a delta's input."""
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.01)
    return model


def _config(root, tenants: dict, budget: int, pinned=()):
    """tenants: id -> extra lines (``base: b``, ``compress: int8``)."""
    text = ("server:\n  listen: 127.0.0.1:0\n  data_dir: ./data\n"
            f"  admin_token_sha256: {hash_token('admin')}\n"
            "backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n"
            f"  device_weight_bytes: {budget}\nscheduler:\n  max_wait_ms: 1\ntenants:\n")
    for t, extra in tenants.items():
        text += f"  - id: {t}\n    token_sha256: {hash_token('t-' + t)}\n"
        for line in (*extra, *(["pinned: true"] if t in pinned else [])):
            text += f"    {line}\n"
    return parse_config(text, root)


def _daemon(cfg) -> Daemon:
    d = Daemon(cfg)
    d.start()
    return d


def _upload_bytes(d: Daemon, tenant: str, data: bytes) -> None:
    d.upload(ADMIN, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])


def _upload(d: Daemon, tenant: str, model, tmp) -> bytes:
    path = tmp / f"{tenant}-{id(model)}.safetensors"
    save_safetensors({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
                     path)
    data = path.read_bytes()
    _upload_bytes(d, tenant, data)
    return data


def _request(tenant: str) -> list[Request]:
    return [Request(tenant, input_ids=IDS, outputs=("logits",))]


def _logits(d: Daemon, tenant: str) -> np.ndarray:
    (res,) = d.infer(ADMIN, tenant, _request(tenant), timeout=WAIT_S)
    return res.logits


def _diff(d: Daemon, tenant: str, model) -> float:
    want = reference(model, Request(tenant, input_ids=IDS))["logits"]
    return float(np.max(np.abs(_logits(d, tenant) - want)))


def _adapter(base, tmp):
    peft = pytest.importorskip("peft")
    from itif.backbones.lora_tenants import pack_adapter  # noqa: PLC0415

    torch.manual_seed(7)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, target_modules=["query", "value"], init_lora_weights=False)).eval()
    lora.save_pretrained(tmp / "adapter")
    packed = pack_adapter(tmp / "adapter", tmp / "adapter.safetensors")
    return lora.base_model.model, packed.read_bytes()


def test_base_uploaded_again_keeps_its_lora_and_delta_tenants_servable(tmp_path, P):
    """Any upload of a base re-registered its LoRA and delta tenants with the tiers as
    "no weights" while reporting them READY: every request of theirs waited for ever (only a
    restart helped). Here the base is uploaded again with the very same bytes."""
    cfg = _config(tmp_path, {"base": [], "la": ["base: base"],
                             "d8": ["base: base", "compress: int8"]}, int(3.5 * P))
    base = make_hf_model("bert-tiny", 3, seed=11)
    ft = _fine_tune(base, 21)
    lora, adapter = _adapter(base, tmp_path)
    d = _daemon(cfg)
    try:
        data = _upload(d, "base", base, tmp_path)
        _upload(d, "d8", ft, tmp_path)
        _upload_bytes(d, "la", adapter)
        assert _diff(d, "la", lora) < 1e-4 and _diff(d, "d8", ft) < 2e-4
        _upload_bytes(d, "base", data)
        for t in ("la", "d8"):
            assert d.tenant_view(t).state is State.READY
            assert d.tiers.view(t).tier is not Tier.NONE
        assert _diff(d, "la", lora) < 1e-4 and _diff(d, "d8", ft) < 2e-4
    finally:
        d.stop(0)


def test_tenant_removed_and_added_back_while_its_request_waits_is_served(tmp_path, P):
    names = [f"t{i}" for i in range(4)]
    full = _config(tmp_path, {n: [] for n in names}, int(1.5 * P))
    less = _config(tmp_path, {n: [] for n in names if n != "t3"}, int(1.5 * P))
    models = {n: make_hf_model("bert-tiny", 3, seed=100 + i) for i, n in enumerate(names)}
    d = _daemon(full)
    try:
        for n in names:
            _upload(d, n, models[n], tmp_path)
        _upload(d, "t0", models["t0"], tmp_path)  # t0 resident, t3 on disk
        waiting = d.submit(ADMIN, "t3", _request("t3"))
        d.apply_config(less)
        d.apply_config(full)  # back at once: its file is kept
        assert d.tenant_view("t3").state is State.READY
        res = waiting[0].result(WAIT_S)
        want = reference(models["t3"], Request("t3", input_ids=IDS))["logits"]
        assert np.max(np.abs(res.logits - want)) < 1e-4
        assert _diff(d, "t3", models["t3"]) < 1e-4
    finally:
        d.stop(0)


def test_deleting_a_tenant_fails_the_requests_waiting_for_its_weights(tmp_path, P):
    """Before: they stayed parked for ever (outstanding, the tenant NO_WEIGHTS), and a later
    upload would have answered them with the new weights."""
    names = [f"t{i}" for i in range(4)]
    d = _daemon(_config(tmp_path, {n: [] for n in names}, int(1.5 * P)))
    models = {n: make_hf_model("bert-tiny", 3, seed=100 + i) for i, n in enumerate(names)}
    try:
        for n in names:
            _upload(d, n, models[n], tmp_path)
        tickets = {n: d.submit(ADMIN, n, _request(n)) for n in names[:3]}  # all on disk
        d.delete_weights(ADMIN, "t2")
        for n in ("t0", "t1"):
            want = reference(models[n], Request(n, input_ids=IDS))["logits"]
            assert np.max(np.abs(tickets[n][0].result(WAIT_S).logits - want)) < 1e-4
        with pytest.raises(NoWeights, match="deleted"):
            tickets["t2"][0].result(WAIT_S)
        assert d.scheduler.outstanding("t2") == 0
        with pytest.raises(NoWeights):  # and a new request is refused as it comes
            _logits(d, "t2")
    finally:
        d.stop(0)


def test_a_delta_tenant_does_not_keep_its_base_resident(tmp_path, P):
    """A delta tenant's W_hat is whole: its base is read to decompress it, not kept beside it.
    Before, the tiers treated it like a LoRA tenant: with room for 1.5 tenants, once evicted it
    could never be loaded again (its promotion kept the base, and both did not fit), and each
    try evicted another tenant for nothing."""
    cfg = _config(tmp_path, {"base": [], "d8": ["base: base", "compress: int8"], "f1": []},
                  int(1.5 * P))
    base = make_hf_model("bert-tiny", 3, seed=11)
    ft, f1 = _fine_tune(base, 21), make_hf_model("bert-tiny", 3, seed=31)
    d = _daemon(cfg)
    try:
        _upload(d, "base", base, tmp_path)
        _upload(d, "d8", ft, tmp_path)
        first = _logits(d, "d8")
        _upload(d, "f1", f1, tmp_path)  # evicts d8
        assert d.engine.tenants() == ["f1"]
        for _ in range(2):
            np.testing.assert_array_equal(_logits(d, "d8"), first)
            assert _diff(d, "f1", f1) < 1e-4
        assert d.tiers.view("d8").failures == 0
        assert _diff(d, "d8", ft) < 2e-4
    finally:
        d.stop(0)


def test_lora_upload_keeps_its_base_or_is_refused_naming_the_budget(tmp_path, P):
    """Making room for a LoRA adapter evicted its own base (the other tenant busy), and the
    upload failed NOT_FOUND "base tenant not found". With the other tenant pinned it can
    never fit beside it: RESOURCE_EXHAUSTED naming device_weight_bytes."""
    import threading  # noqa: PLC0415

    base = make_hf_model("bert-tiny", 3, seed=11)
    lora, adapter = _adapter(base, tmp_path)
    x = make_hf_model("bert-tiny", 3, seed=12)
    tenants = {"b0": [], "x": [], "la": ["base: b0"]}
    d = _daemon(_config(tmp_path / "busy", tenants, 2 * P + 1000))
    stop = threading.Event()
    try:
        _upload(d, "b0", base, tmp_path)
        _upload(d, "x", x, tmp_path)

        def traffic():  # x busy, with gaps: evicted in one of them
            while not stop.wait(0.01):
                _logits(d, "x")

        client = threading.Thread(target=traffic)
        client.start()
        _upload_bytes(d, "la", adapter)  # b0 idle, x busy: before, b0 was evicted
        stop.set()
        client.join()
        assert "b0" in d.engine.store
        assert _diff(d, "la", lora) < 1e-4 and _diff(d, "x", x) < 1e-4
    finally:
        stop.set()
        d.stop(0)
    d = _daemon(_config(tmp_path / "pinned", tenants, 2 * P + 1000, pinned=("x",)))
    try:
        _upload(d, "b0", base, tmp_path)
        _upload(d, "x", x, tmp_path)
        with pytest.raises(Overloaded, match="device_weight_bytes"):
            _upload_bytes(d, "la", adapter)
        assert d.tenant_view("la").state is State.NO_WEIGHTS and not d.blobs.exists("la")
        assert sorted(d.engine.tenants()) == ["b0", "x"]
    finally:
        d.stop(0)


def test_a_stored_delta_tenant_is_judged_and_described_at_start(tmp_path, P):
    """After a restart with tiers a delta tenant comes from its blob's header: FAILED at once
    when its base has other weights now (before: READY until a request failed), else its
    report and head are known before it is loaded (before: empty until then), and KServe's
    metadata of it evicts nobody (before: it promoted the base to read the blob)."""
    tenants = {"base": [], "d8": ["base: base", "compress: int8"], "f1": []}
    cfg = _config(tmp_path, tenants, int(1.5 * P))
    base = make_hf_model("bert-tiny", 3, seed=11)
    d = _daemon(cfg)
    try:
        _upload(d, "base", base, tmp_path)
        _upload(d, "d8", _fine_tune(base, 21), tmp_path)
        _upload(d, "f1", make_hf_model("bert-tiny", 3, seed=31), tmp_path)
        before = d.tenant_view("d8").delta
    finally:
        d.stop(0)
    d = _daemon(cfg)
    try:
        view = d.tenant_view("d8")
        assert view.state is State.READY and view.num_labels == 3 and view.delta == before
        _logits(d, "f1")
        assert daemon_tiers.tenant_info(d, "d8").num_labels == 3
        assert d.engine.tenants() == ["f1"] and d.tiers.view("f1").evictions == 0
        _upload(d, "base", make_hf_model("bert-tiny", 3, seed=12), tmp_path)
    finally:
        d.stop(0)
    d = _daemon(cfg)
    try:
        st = d.status["d8"]
        assert st.state is State.FAILED and "upload the fine-tune again" in st.error
        with pytest.raises(NoWeights, match="upload the fine-tune again"):
            _logits(d, "d8")
    finally:
        d.stop(0)


def test_a_pinned_tenant_that_can_never_be_resident_says_why(tmp_path, P):
    """Pinning two tenants where one fits: the reload is applied (the sizes of tenants on disk
    are not known before they load) and the one that cannot be loaded answered UNAVAILABLE
    while ListTenants showed it READY with no error; now its error names the budget."""
    import time  # noqa: PLC0415

    d = _daemon(_config(tmp_path, {"a": [], "b": []}, int(1.5 * P)))
    try:
        _upload(d, "a", make_hf_model("bert-tiny", 3, seed=1), tmp_path)
        _upload(d, "b", make_hf_model("bert-tiny", 3, seed=2), tmp_path)
        d.apply_config(_config(tmp_path, {"a": [], "b": []}, int(1.5 * P), pinned=("a", "b")))
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end and not any(d.tenant_view(t).error for t in "ab"):
            time.sleep(0.02)
        (loser,) = [t for t in "ab" if d.tenant_view(t).error]
        assert "device_weight_bytes" in d.tenant_view(loser).error
        with pytest.raises(Exception, match="device_weight_bytes"):
            _logits(d, loser)
    finally:
        d.stop(0)


def test_what_a_tenant_sees_of_itself_does_not_move_with_other_tenants_requests(tmp_path, P):
    """A tenant's own view showed its tier and its device bytes: another tenant's request that
    evicted it turned them into 'disk' and 0 (a review read other tenants' traffic from it).
    It now shows its weights' size wherever they are and no tier; the operator sees both."""
    cfg = _config(tmp_path, {"a": [], "b": []}, int(1.5 * P))
    d = _daemon(cfg)
    me = Identity("a")
    try:
        _upload(d, "a", make_hf_model("bert-tiny", 3, seed=1), tmp_path)
        _upload(d, "b", make_hf_model("bert-tiny", 3, seed=2), tmp_path)  # evicts a
        _logits(d, "a")
        resident = d.get_tenant(me, "a")
        assert resident.weight_bytes == resident.exclusive_bytes >= P
        _logits(d, "b")  # evicts a again
        assert d.get_tenant(ADMIN, "a").tier == "disk"  # the operator's view
        evicted = d.get_tenant(me, "a")
        assert evicted == resident, (resident, evicted)
        assert (evicted.tier, evicted.host_bytes) == ("", 0)
        assert d.list_tenants(me) == [evicted]
    finally:
        d.stop(0)


def test_a_tenant_never_viewed_while_resident_sees_its_size_after_an_eviction(tmp_path, P):
    """The size a tenant sees of itself was recorded when a view of it was built while it was
    resident, not when its weights were loaded: after a restart, a tenant its own request
    promoted and another tenant's request evicted before it looked saw 0 bytes (resident: its
    size), so its view still moved with the other tenant's traffic. Its size is now recorded
    whenever its weights are installed on the device."""
    cfg = _config(tmp_path, {"a": [], "b": []}, int(1.5 * P))
    d = _daemon(cfg)
    try:
        _upload(d, "a", make_hf_model("bert-tiny", 3, seed=1), tmp_path)
        _upload(d, "b", make_hf_model("bert-tiny", 3, seed=2), tmp_path)
    finally:
        d.stop(0)
    d = _daemon(cfg)  # both on disk; nothing seen resident by this run
    me = Identity("a")
    try:
        _logits(d, "a")  # its own request promotes it
        _logits(d, "b")  # another tenant's request evicts it, before it looks
        assert d.get_tenant(ADMIN, "a").tier == "disk"
        evicted = d.get_tenant(me, "a")
        _logits(d, "a")
        resident = d.get_tenant(me, "a")
        assert resident.weight_bytes == resident.exclusive_bytes >= P
        assert evicted == resident, (evicted, resident)
    finally:
        d.stop(0)
