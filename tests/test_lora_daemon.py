"""LoRA tenants through a real ``itif serve`` (issue 14, item 2): ``base:`` in tenants.yaml,
``itif upload --adapter DIR``, answers equal to PEFT's model, restored after a restart, and
following their base when it is re-uploaded or deleted."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from itif.config import hash_token, parse_config
from itif.errors import InvalidConfig
from itif.requests import Request
from itif.server._proto.itif.v1 import itif_pb2
from tests.daemon_harness import ADMIN, Daemon, free_port
from tests.oracle import make_hf_model, reference
from tests.reliability_util import code_of, error_of, upload_bytes, weights_bytes

peft = pytest.importorskip("peft")

C = grpc.StatusCode
READY, FAILED = itif_pb2.TenantInfo.READY, itif_pb2.TenantInfo.FAILED
IDS = [[1, 7, 42, 3, 9], [5, 6], list(range(2, 30))]


def _adapter(base_model, path, seed: int, **cfg):
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base_model),
                                peft.LoraConfig(init_lora_weights=False, **cfg)).eval()
    model.save_pretrained(path)
    return model.base_model.model


def _upload_adapter(d: Daemon, tenant: str, path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "itif", "upload", "--server", d.addr, "--token", ADMIN,
         "--tenant", tenant, "--adapter", str(path), "--quiet"],
        capture_output=True, text=True, timeout=120, env={**os.environ})


def _assert_equal(d: Daemon, tenant: str, model) -> None:
    with d.client(ADMIN) as c:
        for ids in IDS:
            got = c.infer(tenant, ids, outputs=("logits",))["logits"]
            ref = reference(model, Request(tenant, input_ids=ids))["logits"]
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


def test_lora_tenants_serve_restore_and_follow_their_base(tmp_path):
    tenants = {"base": "tb", "la": "ta", "lb": "tl"}
    d = Daemon(tmp_path / "d", tenants, tenant_extra={"la": {"base": "base"},
                                                      "lb": {"base": "base"}})
    d.start()
    try:
        with d.client(ADMIN) as c:
            # an adapter before its base has weights: refused, saying so
            base = make_hf_model("bert-tiny", 2, seed=130)  # weights_bytes(130)'s model
            la = _adapter(base, tmp_path / "la", 1, r=4, lora_alpha=8,
                          target_modules=["query", "value", "dense"])
            out = _upload_adapter(d, "la", tmp_path / "la")
            assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr, out.stderr
            upload_bytes(c, "base", weights_bytes(130))
            for name, model, path in (("la", la, tmp_path / "la"),):
                out = _upload_adapter(d, name, path)
                assert out.returncode == 0, out.stderr
            lb = _adapter(base, tmp_path / "lb", 2, r=8, lora_alpha=8, target_modules=["key"],
                          modules_to_save=["classifier"])
            assert _upload_adapter(d, "lb", tmp_path / "lb").returncode == 0
            # a full checkpoint for a LoRA tenant, an adapter for a full one: refused
            assert error_of(lambda: upload_bytes(c, "la", weights_bytes(131)))[0] == \
                C.INVALID_ARGUMENT
            out = _upload_adapter(d, "base", tmp_path / "la")
            assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr, out.stderr
            assert c.get_tenant("la").weight_bytes > 0
            assert c.get_tenant("la").exclusive_bytes < c.get_tenant("base").weight_bytes / 4
        for name, model in (("base", base), ("la", la), ("lb", lb)):
            _assert_equal(d, name, model)
        d.stop()
        d.start()  # restored from their files, the base first
        for name, model in (("base", base), ("la", la), ("lb", lb)):
            _assert_equal(d, name, model)
        # a new base: its LoRA tenants now adapt that one
        new_base = make_hf_model("bert-tiny", 2, seed=131)
        with d.client(ADMIN) as c:
            upload_bytes(c, "base", weights_bytes(131))
        la_new = _adapter(new_base, tmp_path / "unused", 1, r=4, lora_alpha=8,
                          target_modules=["query", "value", "dense"])
        la_new.load_state_dict(
            {k: v for k, v in la.state_dict().items() if "lora_" in k}, strict=False)
        _assert_equal(d, "la", la_new)
        # no base: its LoRA tenants stop serving, their files stay; the base back, they are back
        with d.client(ADMIN) as c:
            c.delete_weights("base")
            info = c.get_tenant("la")
            assert info.state == FAILED and "base" in info.error, info
            assert code_of(lambda: c.infer("la", IDS[0])) == C.FAILED_PRECONDITION
            assert d.stored("la")[0] is not None
            upload_bytes(c, "base", weights_bytes(131))
        _assert_equal(d, "la", la_new)
    finally:
        d.stop()


@pytest.mark.parametrize("extra, message", [
    ({"la": {"base": "nobody"}}, "must be the id of another tenant"),
    ({"la": {"base": "la"}}, "must be the id of another tenant"),
    ({"la": {"base": "base"}, "lb": {"base": "la"}}, "is itself a LoRA tenant"),
])
def test_bad_bases_are_refused_by_the_config(tmp_path, extra, message):
    text = (f"server:\n  listen: 127.0.0.1:{free_port()}\n  data_dir: ./d\n"
            f"  admin_token_sha256: {hash_token('x')}\n"
            "backbone:\n  config: bert-tiny\ntenants:\n")
    for i, t in enumerate(("base", "la", "lb")):
        text += f"  - id: {t}\n    token_sha256: {hash_token(t + 'tok')}\n"
        for k, v in extra.get(t, {}).items():
            text += f"    {k}: {v}\n"
    with pytest.raises(InvalidConfig, match=message):
        parse_config(text, tmp_path)
