"""End to end against a real daemon subprocess on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

import itif
from itif.server._proto.itif.v1 import itif_pb2
from tests.daemon_harness import ADMIN, PORT_AND_INGRESS, Daemon, save_hf_tenants, serving
from tests.oracle import reference

TOKENS = {"acme": "acme-tok", "beta": "beta-tok", "gamma": "gamma-tok"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(models, files): tenant i has 2 + i labels."""
    return save_hf_tenants(tmp_path_factory.mktemp("weights"),
                           {tid: (2 + i, 200 + i) for i, tid in enumerate(TOKENS)})


@pytest.fixture(scope="module", **PORT_AND_INGRESS)
def daemon(request, tmp_path_factory, weights):
    """Every tenant uploaded; every test here must pass on the port and behind ingress."""
    with serving(tmp_path_factory.mktemp("daemon"), TOKENS, weights[1],
                 ingress=request.param) as d:
        yield d


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_three_tenants_equal_hf(daemon, weights):
    models, _ = weights
    for i, (tid, tok) in enumerate(TOKENS.items()):
        ids = _ids(5 + 7 * i, seed=i)
        with daemon.client(tok) as c:
            out = c.infer(tid, ids, outputs=("logits", "last_hidden_state"))
        ref = reference(models[tid], itif.Request(tid, ids))
        np.testing.assert_allclose(out["logits"], ref["logits"], atol=1e-4)
        np.testing.assert_allclose(out["last_hidden_state"], ref["last_hidden_state"], atol=1e-4)


def test_infer_batch_and_concurrent_tenants(daemon, weights):
    models, _ = weights
    from concurrent.futures import ThreadPoolExecutor

    def one(k):
        tid = list(TOKENS)[k % 3]
        ids = _ids(1 + k % 40, seed=k)
        with daemon.client(TOKENS[tid]) as c:
            got = c.infer(tid, ids)["logits"]
        want = reference(models[tid], itif.Request(tid, ids))["logits"]
        return float(np.abs(got - want).max())

    with ThreadPoolExecutor(16) as pool:
        assert max(pool.map(one, range(48))) <= 1e-4
    with daemon.client(TOKENS["beta"]) as c:
        inputs = [c.make_input(_ids(n, n)) for n in (3, 9, 30)]
        outs = c.infer_batch("beta", inputs)
    for n, out in zip((3, 9, 30), outs):
        want = reference(models["beta"], itif.Request("beta", _ids(n, n)))["logits"]
        np.testing.assert_allclose(out["logits"], want, atol=1e-4)


def test_auth_and_isolation(daemon, weights):
    _, files = weights
    with daemon.client("wrong") as c:
        assert _code(lambda: c.infer("acme", [1, 2])) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: c.upload("acme", files["acme"])) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: c.tenants()) == grpc.StatusCode.UNAUTHENTICATED
    no_auth = daemon.client("x")
    no_auth.metadata = ()
    assert _code(lambda: no_auth.infer("acme", [1])) == grpc.StatusCode.UNAUTHENTICATED
    no_auth.close()
    with daemon.client(TOKENS["acme"]) as c:
        other = _code(lambda: c.infer("beta", [1, 2]))
        unknown = _code(lambda: c.infer("nobody", [1, 2]))
        assert other == unknown == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: c.upload("beta", files["acme"])) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: c.get_tenant("beta")) == grpc.StatusCode.NOT_FOUND
        assert [t.id for t in c.tenants()] == ["acme"]
        assert _code(lambda: c.delete_weights("acme")) == grpc.StatusCode.PERMISSION_DENIED
        assert c.health_status("acme") == "SERVING"
        assert _code(lambda: c.health_status("beta")) == grpc.StatusCode.NOT_FOUND
    with daemon.client(ADMIN) as c:
        assert sorted(t.id for t in c.tenants()) == sorted(TOKENS)
        assert c.health_status() == "SERVING"


def test_bad_input_is_invalid_argument_and_daemon_keeps_serving(daemon):
    with daemon.client(TOKENS["acme"]) as c:
        for ids in ([1, 2, 1000], [-1], [5] * 129, []):
            assert _code(lambda: c.infer("acme", ids)) == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            _code(lambda: c.infer("acme", [1], outputs=("nope",)))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (
            _code(lambda: c.infer("acme", [1], text="hi")) == grpc.StatusCode.INVALID_ARGUMENT
        )  # no tokenizer
        assert c.infer("acme", [5] * 128)["logits"].shape == (2,)  # max length is fine


def test_cli_infer_json_and_error_line(daemon):
    run = lambda *a: subprocess.run([sys.executable, "-m", "itif", *a], capture_output=True,  # noqa: E731
                                     text=True, timeout=60)
    ok = run("infer", "--server", daemon.addr, "--tenant", "gamma", "--token", TOKENS["gamma"],
             "--ids", "1,2,3", "--json")
    assert ok.returncode == 0, ok.stderr
    import json

    assert len(json.loads(ok.stdout)["logits"]) == 4
    bad = run(
        "infer", "--server", daemon.addr, "--tenant", "gamma", "--token", "nope", "--ids", "1"
    )
    assert bad.returncode != 0 and bad.stderr.startswith("error: UNAUTHENTICATED: ")
    oov = run("infer", "--server", daemon.addr, "--tenant", "gamma", "--token", TOKENS["gamma"],
              "--ids", "99999")
    assert oov.returncode != 0 and oov.stderr.startswith("error: INVALID_ARGUMENT: ")
    ls = run("tenants", "--server", daemon.addr, "--token", ADMIN)
    assert ls.returncode == 0 and ls.stdout.count('"state": "READY"') == 3


def test_restart_restores_and_corruption_fails_one_tenant(tmp_path, weights):
    models, files = weights
    d = Daemon(tmp_path, dict(TOKENS)).start()
    ids = _ids(12, seed=5)
    before = {}
    for tid, tok in TOKENS.items():
        with d.client(tok) as c:
            if tid != "gamma":
                c.upload(tid, files[tid])
                before[tid] = c.infer(tid, ids)["logits"]
            else:
                assert _code(lambda: c.infer(tid, ids)) == grpc.StatusCode.FAILED_PRECONDITION
    assert d.stop() in (0, -15)
    d.start()
    for tid in before:
        with d.client(TOKENS[tid]) as c:
            np.testing.assert_array_equal(c.infer(tid, ids)["logits"], before[tid])
    d.stop()
    stored = next((tmp_path / "data").rglob("beta.safetensors"))
    raw = bytearray(stored.read_bytes())
    raw[-5] ^= 0xFF
    stored.write_bytes(bytes(raw))
    d.start()
    with d.client(TOKENS["beta"]) as c:
        assert _code(lambda: c.infer("beta", ids)) == grpc.StatusCode.FAILED_PRECONDITION
        info = c.get_tenant("beta")
        assert info.state == itif_pb2.TenantInfo.FAILED and "sha256" in info.error
        c.upload("beta", files["beta"])  # a fresh upload heals it
        np.testing.assert_array_equal(c.infer("beta", ids)["logits"], before["beta"])
    with d.client(TOKENS["acme"]) as c:
        np.testing.assert_array_equal(c.infer("acme", ids)["logits"], before["acme"])
    d.stop()


def test_live_config_add_tenant_and_bad_edit(tmp_path, weights):
    models, files = weights
    d = Daemon(tmp_path, {"acme": TOKENS["acme"]}).start()
    try:
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", files["acme"])
        d.tenants["delta"] = "delta-tok"
        d.write_config()
        end = time.monotonic() + 10
        with d.client("delta-tok") as c:
            while True:
                try:
                    c.upload("delta", files["beta"])
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < end
                    time.sleep(0.1)
            ids = _ids(9, seed=9)
            want = reference(models["beta"], itif.Request("delta", ids))["logits"]
            np.testing.assert_allclose(c.infer("delta", ids)["logits"], want, atol=1e-4)
        with d.client(TOKENS["acme"]) as c:
            acme_before = c.infer("acme", [1, 2, 3])["logits"]
        d.write_config("server: [this is not\n  valid yaml")
        time.sleep(1.5)
        assert "config reload refused" in d.logs()
        # the effect: the last good config (both tenants, same weights) still serves
        with d.client(TOKENS["acme"]) as c:
            np.testing.assert_array_equal(c.infer("acme", [1, 2, 3])["logits"], acme_before)
        with d.client("delta-tok") as c:
            want = reference(models["beta"], itif.Request("delta", [1, 2, 3]))["logits"]
            np.testing.assert_allclose(c.infer("delta", [1, 2, 3])["logits"], want, atol=1e-4)
    finally:
        d.stop()


@pytest.mark.parametrize("setting", ["listen", "metrics_listen"])
def test_a_taken_port_fails_the_start_in_one_line(tmp_path, setting):
    """A port another process holds fails the start naming the setting and the address, and the
    gRPC server it had started is closed: no traceback at exit (before: grpcio's RuntimeError
    "Failed to bind", or a bare "Address already in use" and "Exception ignored in
    Server.__del__ ... Event loop is closed")."""
    import socket  # noqa: PLC0415

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        kw = ({"port": holder.getsockname()[1]} if setting == "listen"
              else {"server_extra": {"metrics_listen": taken}})
        d = Daemon(tmp_path, {"acme": "acme-tok"}, **kw)
        d.start(wait=False)
        try:
            assert d.proc.wait(60) != 0
            logs = d.logs()
            assert f"cannot listen on {taken} (server.{setting})" in logs, logs[-2000:]
            assert "error: UNAVAILABLE: cannot listen on" in logs  # was UNKNOWN: OSError:
            assert "Traceback" not in logs and "Exception ignored" not in logs, logs[-2000:]
        finally:
            d.stop()
