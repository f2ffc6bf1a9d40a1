"""What a hostile client found (issue 15), each against a real ``itif serve``.

1. Upload and DeleteWeights racing: whatever both answer, the state reported, the weights
   served and the file on disk agree, and a restart shows the same state.
2. A tenant removed from tenants.yaml while its upload streams: the upload answers NOT_FOUND,
   nothing is stored, the tenant stays gone (no INTERNAL on it).
7. Nothing a tenant is told depends on other tenants' weights: uploading a head that another
   tenant holds looks exactly like uploading a fresh one.
9. Weights that are finite on disk but overflow the serving dtype, or make the forward
   non-finite, are refused at upload, naming why; what served before keeps serving.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import torch

from itif.safetensors_io import save_safetensors
from itif.server._proto.itif.v1 import itif_pb2
from tests.reliability_util import (
    ADMIN,
    Daemon,
    code_of,
    error_of,
    infer_sha,
    make_tokens,
    promise,
    sha256,
    state_dict,
    upload_bytes,
    upload_messages,
    wait_until,
    weights_bytes,
)

C = grpc.StatusCode
READY, NO_WEIGHTS = itif_pb2.TenantInfo.READY, itif_pb2.TenantInfo.NO_WEIGHTS
IDS = [1, 7, 42, 3]


def _bytes_of(tensors: dict[str, torch.Tensor], tmp_path, name: str) -> bytes:
    p = tmp_path / f"{name}.safetensors"
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, p)
    return p.read_bytes()


def _consistent(d: Daemon, tenant: str) -> tuple[int, str]:
    """Assert that what the daemon reports, serves and stores for ``tenant`` agree; return
    (state, sha256)."""
    with d.client(ADMIN) as c:
        info = c.get_tenant(tenant)
        data, side = d.stored(tenant)
        if info.state == READY:
            assert data is not None and side == info.sha256 == sha256(data), (info, side)
            assert infer_sha(c, tenant, IDS)[1] == info.sha256
        else:
            assert info.state == NO_WEIGHTS, info
            assert data is None and side is None, "a file is on disk for a tenant with no weights"
            assert code_of(lambda: c.infer(tenant, IDS)) == C.FAILED_PRECONDITION
    return info.state, info.sha256


@promise(28)
def test_upload_racing_delete_leaves_reported_served_and_stored_in_agreement(tmp_path, rel):
    """Before the fix 14 of 40 rounds ended READY and serving with no file on disk (gone
    after a restart): the delete ran between the upload's commit and its swap-in. The daemon's
    ``commit_pause`` hook holds that window open for 300 ms; half the rounds aim the delete
    into it (sent once the new file is on disk), half at a random moment of the upload."""
    d = Daemon(tmp_path / "d", {"a": "a-token"}, faults="commit_pause:300")
    d.start()
    rng = random.Random(1501)
    blobs = [weights_bytes(seed) for seed in (150, 151)]
    aimed = 0
    try:
        with d.client(ADMIN) as c:
            for rnd in range(12):
                data = blobs[rnd % 2]
                got: dict[str, object] = {}

                def up() -> None:
                    got["up"] = code_of(lambda: upload_bytes(c, "a", data))

                t = threading.Thread(target=up)
                t.start()
                if rnd % 2:
                    time.sleep(rng.uniform(0.0, 0.6))
                else:  # the new file is committed; its weights are not swapped in yet
                    wait_until(lambda: d.stored("a")[1] == sha256(data) or "up" in got,
                               step=0.002, what="the commit")
                    aimed += "up" not in got
                got["del"] = code_of(lambda: c.delete_weights("a"))
                t.join()
                assert got["up"] is C.OK and got["del"] is C.OK, got
                state, sha = _consistent(d, "a")
                assert state == NO_WEIGHTS or sha == sha256(data)
        assert aimed >= 3, "the delete never landed between commit and swap-in"
        rel.inputs += 2 * 12
        rel.faults += 12
        rel.notes["deletes_aimed_between_commit_and_swap_in"] = aimed
        before = _consistent(d, "a")
        d.stop()
        d.start()
        assert _consistent(d, "a") == before  # acknowledged = durable
    finally:
        d.stop()


@promise(28)
def test_tenant_removed_from_config_while_its_upload_streams(tmp_path, rel):
    tokens = make_tokens(["a", "b"])
    d = Daemon(tmp_path / "d", tokens)
    d.start()
    try:
        data = weights_bytes(152)
        with d.client(tokens["a"]) as c:
            result: dict[str, tuple] = {}

            def up() -> None:  # ~40 chunks, 50 ms apart: two seconds of streaming
                result["a"] = error_of(lambda: c.stub.UploadWeights(
                    upload_messages("a", data, chunk=len(data) // 40 + 1, pace_s=0.05),
                    metadata=c.metadata, timeout=60))

            t = threading.Thread(target=up)
            t.start()
            wait_until(lambda: d.tmp_files(), what="the upload to start streaming")
            d.tenants = {"b": tokens["b"]}
            d.write_config()
            with d.client(ADMIN) as admin:
                wait_until(lambda: [x.id for x in admin.tenants()] == ["b"], what="the reload")
            t.join()
        code, msg = result["a"]
        rel.inputs += 1
        rel.saw(code)
        assert code == C.NOT_FOUND and "removed" in msg, (code, msg)
        assert d.stored("a") == (None, None) and d.tmp_files() == []
        with d.client(ADMIN) as admin:
            assert [x.id for x in admin.tenants()] == ["b"]
            assert code_of(lambda: admin.infer("a", IDS)) == C.NOT_FOUND  # was INTERNAL
            assert code_of(lambda: admin.get_tenant("a")) == C.NOT_FOUND
        d.tenants = tokens  # back in the config: it has nothing stored
        d.write_config()
        with d.client(ADMIN) as admin:
            wait_until(lambda: len(admin.tenants()) == 2, what="the reload")
            assert admin.get_tenant("a").state == NO_WEIGHTS
        assert "Traceback" not in d.logs()
    finally:
        d.stop()


@promise(29)
def test_a_tenant_learns_nothing_about_other_tenants_weights(tmp_path, rel):
    """``b`` uploads, in turn, weights whose head equals ``a``'s and weights with a head
    nobody holds: every figure ``b`` can see is the same for both (before the fix
    ``shared_bytes`` and ``exclusive_bytes`` told the first apart)."""
    tokens = make_tokens(["a", "b"])
    d = Daemon(tmp_path / "d", tokens)
    d.start()
    mine = state_dict(160)
    heads = [k for k in mine if k.startswith(("classifier.", "bert.pooler."))]
    assert heads
    theirs = {**mine, **{k: state_dict(161)[k] for k in heads}}  # a's head on b's body
    fresh = {**mine, **{k: state_dict(162)[k] for k in heads}}
    seen = []
    try:
        with d.client(tokens["a"]) as c:
            upload_bytes(c, "a", weights_bytes(161))
        with d.client(tokens["b"]) as c:
            for tensors, name in ((theirs, "theirs"), (fresh, "fresh")):
                r = upload_bytes(c, "b", _bytes_of(tensors, tmp_path, name))
                info = c.get_tenant("b")
                (listed,) = c.tenants()
                seen.append((r.weight_bytes, r.shared_bytes, info.weight_bytes,
                             info.exclusive_bytes, listed.weight_bytes, listed.exclusive_bytes))
        rel.inputs += 2
        assert seen[0] == seen[1], seen
        assert seen[0][1] == 0 and seen[0][3] == seen[0][2] > 0
        with d.client(ADMIN) as c:  # the operator sees the sharing
            upload_bytes(c, "b", _bytes_of(theirs, tmp_path, "theirs"))
            info = c.get_tenant("b")
            assert info.exclusive_bytes < info.weight_bytes
    finally:
        d.stop()


@promise(30)
def test_weights_that_overflow_the_forward_or_the_dtype_are_refused(tmp_path, rel):
    tokens = make_tokens(["a"])
    for dtype, scale, why in (("float32", 1e30, "non-finite"), ("float16", 1e5, "overflow")):
        d = Daemon(tmp_path / dtype, tokens, backbone_extra={"dtype": dtype})
        d.start()
        try:
            with d.client(tokens["a"]) as c:
                upload_bytes(c, "a", weights_bytes(170))
                before = infer_sha(c, "a", IDS)
                bad = dict(state_dict(171))
                name = "bert.encoder.layer.0.intermediate.dense.weight"
                bad[name] = bad[name].clone()
                bad[name][0, :8] = scale  # finite on disk
                assert torch.isfinite(bad[name]).all()
                code, msg = error_of(lambda: upload_bytes(c, "a", _bytes_of(bad, tmp_path, "bad")))
                rel.inputs += 1
                rel.saw(code)
                assert code == C.INVALID_ARGUMENT and why in msg, (dtype, code, msg)
                assert infer_sha(c, "a", IDS) == before  # the old weights still serve
                assert c.get_tenant("a").sha256 == before[1]
            assert d.stored("a")[1] == before[1] and d.tmp_files() == []
        finally:
            d.stop()
