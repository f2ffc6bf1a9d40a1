"""``server.ingress_processes``: the gRPC port served by processes besides the daemon's.

The daemon's own e2e and KServe suites run against a daemon with two ingress processes too
(their ``daemon`` fixtures); this module holds what only the ingress has: the processes
themselves (a dead one is replaced, none outlives the daemon), the metrics of framed calls,
and the configuration it needs.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest

import itif
from itif.server.ingress import HOT, method_kinds, pack
from itif.weights.safetensors_io import save_safetensors
from tests.daemon_harness import Daemon, free_port
from tests.oracle import make_hf_model, reference

TOKENS = {"acme": "acme-tok"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not serving
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _pids(d: Daemon) -> list[int]:
    found = re.findall(r"ingress processes serve the port \(pids \[([\d, ]+)\]\)", d.logs())
    assert found, d.logs()[-2000:]
    return [int(p) for p in found[-1].split(",")]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    m = make_hf_model("bert-tiny", 3, seed=41)
    f = tmp_path_factory.mktemp("ingress-weights") / "acme.safetensors"
    save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, f)
    return m, f


def test_every_method_has_a_route():
    """HOT methods come by frame; every other method of the four services is relayed with
    its own streaming kind (uploads are client-streaming, reflection bidirectional)."""
    kinds = method_kinds()
    assert HOT <= set(kinds) and all(kinds[m] == (False, False) for m in HOT)
    assert kinds["/itif.v1.Itif/UploadWeights"] == (True, False)
    assert kinds["/grpc.health.v1.Health/Watch"] == (False, True)
    assert kinds["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"] == (True, True)
    assert kinds["/inference.GRPCInferenceService/RepositoryModelLoad"] == (False, False)
    frame = pack((1, "/itif.v1.Itif/Infer", (("a", "b"),), None, "peer", b"xyz"))
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4


def test_a_dead_ingress_process_is_replaced_and_none_outlives_the_daemon(tmp_path, model_file):
    m, f = model_file
    metrics = free_port()
    d = Daemon(tmp_path, dict(TOKENS), server_extra={
        "ingress_processes": 2, "metrics_listen": f"127.0.0.1:{metrics}"}).start()
    try:
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", f)  # client-streaming: relayed to the daemon's own server
        first = _pids(d)
        assert len(first) == 2 and all(_alive(p) for p in first)
        os.kill(first[0], signal.SIGKILL)
        end = time.monotonic() + 20
        while "starting another" not in d.logs() and time.monotonic() < end:
            time.sleep(0.1)
        assert "starting another" in d.logs(), d.logs()[-2000:]
        ids = list(range(3, 20))
        want = reference(m, itif.Request("acme", ids))["logits"]
        for _ in range(12):  # new connections: the kernel spreads them over the live processes
            with d.client(TOKENS["acme"]) as c:
                got = c.infer("acme", ids)["logits"]
            np.testing.assert_allclose(got, want, atol=1e-4)
        # framed calls are counted like any other (the interceptors ran in the daemon)
        assert _count(metrics, "Infer", "OK") == 12
        gone = re.findall(r"ingress process \d \(pid (\d+)\) exited", d.logs())
        assert [int(p) for p in gone] == [first[0]]
    finally:
        d.stop()
    for p in first:
        assert not _alive(p)
    # the replacement too: nothing listens on the port once the daemon has stopped
    with pytest.raises(grpc.RpcError) as e, d.client(TOKENS["acme"]) as c:
        c.infer("acme", [1, 2, 3], timeout=2.0)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def _count(port: int, method: str, code: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    for line in body.decode().splitlines():
        if (line.startswith("itif_requests_total") and f'method="{method}"' in line
                and f'code="{code}"' in line and 'tenant="acme"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_framed_call_keeps_its_deadline(tmp_path, model_file):
    """The client's deadline crosses to the daemon: with every forward taking 300 ms, a call
    with a 100 ms deadline ends DEADLINE_EXCEEDED in the daemon itself (its own count says so;
    without the deadline it would have waited for the forward and counted OK)."""
    _, f = model_file
    metrics = free_port()
    d = Daemon(tmp_path, dict(TOKENS), faults="slow:300", server_extra={
        "ingress_processes": 1, "metrics_listen": f"127.0.0.1:{metrics}"}).start()
    try:
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", f)
            with pytest.raises(grpc.RpcError) as e:
                c.infer("acme", [5, 6, 7], timeout=0.1)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            end = time.monotonic() + 5
            while _count(metrics, "Infer", "DEADLINE_EXCEEDED") < 1 and time.monotonic() < end:
                time.sleep(0.05)
            assert _count(metrics, "Infer", "DEADLINE_EXCEEDED") == 1
            assert c.infer("acme", [5, 6, 7], timeout=30)["logits"].shape == (3,)
            assert _count(metrics, "Infer", "OK") == 1
    finally:
        d.stop()


def test_ingress_needs_a_fixed_port(tmp_path):
    """Every ingress process binds the one port: port 0 (a different one each) is refused at
    start with the key named."""
    d = Daemon(tmp_path, dict(TOKENS), server_extra={"ingress_processes": 2})
    d.root.mkdir(parents=True, exist_ok=True)
    d.write_config(d.yaml().replace(f"listen: {d.addr}", "listen: 127.0.0.1:0"))
    d.start(wait=False)  # the config exists: start() leaves it as it is
    try:
        assert d.proc.wait(60) != 0
        assert "server.ingress_processes: needs a fixed port" in d.logs()
    finally:
        d.stop()


def test_ingress_processes_leave_with_a_killed_daemon(tmp_path):
    """SIGKILL gives the daemon no chance to stop them: each sees its link to the daemon close
    and exits on its own."""
    d = Daemon(tmp_path, dict(TOKENS), server_extra={"ingress_processes": 2}).start()
    pids = _pids(d)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(30)
    end = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    d.stop()


def test_a_taken_port_fails_the_start(tmp_path):
    """The ingress binds with SO_REUSEPORT, which another listener's port would not refuse:
    the daemon checks first and fails to start, naming the port."""
    import socket  # noqa: PLC0415

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        d = Daemon(tmp_path, dict(TOKENS), port=holder.getsockname()[1],
                   server_extra={"ingress_processes": 1})
        d.start(wait=False)
        try:
            assert d.proc.wait(60) != 0
            assert f"cannot listen on 127.0.0.1:{d.port}" in d.logs()
        finally:
            d.stop()
