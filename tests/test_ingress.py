"""``server.ingress_processes``: the gRPC port served by processes besides the daemon's.

The daemon's own e2e and KServe suites run against a daemon with two ingress processes too
(their ``daemon`` fixtures); this module holds what only the ingress has: the processes
themselves (a dead one is replaced, none outlives the daemon), the metrics of framed calls,
and the configuration it needs.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import signal
import struct
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

import itif
from itif.config import ServerConfig, hash_token, parse_config
from itif.errors import InvalidConfig
from itif.safetensors_io import save_safetensors
from itif.server.ingress import HOT, method_kinds, pack
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
        # calls are counted like any other: framed ones by the interceptors in the daemon,
        # column ones (itif.server.ingress_columns) within REPORT_S of their answer
        end = time.monotonic() + 5
        while _count(metrics, "Infer", "OK") < 12 and time.monotonic() < end:
            time.sleep(0.05)
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


def test_a_framed_call_ends_at_its_deadline(tmp_path, model_file):
    """With every forward taking 300 ms, a call with a 100 ms deadline ends in the daemon too
    (its own count: DEADLINE_EXCEEDED, or CANCELLED when the ingress's cancellation of the
    expired call crosses first), never waits for the forward to answer OK; the next call is
    answered."""
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

            def ended() -> float:
                return (_count(metrics, "Infer", "DEADLINE_EXCEEDED")
                        + _count(metrics, "Infer", "CANCELLED"))

            end = time.monotonic() + 5
            while ended() < 1 and time.monotonic() < end:
                time.sleep(0.05)
            assert ended() == 1 and _count(metrics, "Infer", "OK") == 0
            assert c.infer("acme", [5, 6, 7], timeout=30)["logits"].shape == (3,)
            end = time.monotonic() + 5  # a column call is counted within REPORT_S
            while _count(metrics, "Infer", "OK") < 1 and time.monotonic() < end:
                time.sleep(0.05)
            assert _count(metrics, "Infer", "OK") == 1
    finally:
        d.stop()


class _Writer:
    """A stream writer: the frames of every chunk written, and how many writes it took."""

    def __init__(self) -> None:
        self.frames: list = []
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        while data:
            (n,) = struct.unpack(">I", data[:4])
            self.frames.append(pickle.loads(data[4 : 4 + n]))
            data = data[4 + n :]


def test_frames_written_in_one_turn_go_out_in_one_write():
    from itif.server.ingress import FrameWriter  # noqa: PLC0415

    async def run() -> _Writer:
        w = _Writer()
        out = FrameWriter(w)
        for i in range(3):
            out.write((i, "x" * i))
        assert w.writes == 0  # nothing until the end of this turn of the loop
        await asyncio.sleep(0)
        assert w.writes == 1
        out.write((3,))
        await asyncio.sleep(0)
        assert w.writes == 2
        return w

    w = asyncio.run(run())
    assert w.frames == [(0, ""), (1, "x"), (2, "xx"), (3,)]


def test_frame_server_runs_the_handler_as_grpc_would():
    """The daemon's side alone: a framed call's handler sees the caller's metadata, peer,
    deadline and bytes; its reply, or its abort's status, goes back as one frame; done
    callbacks run once the ingress process says the caller's call ended (DONE), as gRPC runs
    them once the reply is sent; a cancelled call sends nothing and runs them at once."""
    from itif.server.ingress_host import FrameServer, _Answered  # noqa: PLC0415

    seen: dict = {}
    gate = asyncio.Event()

    async def behaviour(request, context):
        seen.update(request=request, metadata=context.invocation_metadata(),
                    peer=context.peer(), left=context.time_remaining())
        context.add_done_callback(lambda ctx: seen.setdefault("done", []).append(request))
        if request == b"refuse":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such tenant")
        if request == b"wait":
            await gate.wait()
        return b"answer to " + request

    class Handlers(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method == "/itif.v1.Itif/Infer":
                return grpc.unary_unary_rpc_method_handler(behaviour)
            return None

    async def run() -> list:
        from itif.server.ingress import FrameWriter  # noqa: PLC0415

        server, sink, answered = FrameServer([], [Handlers()]), _Writer(), _Answered()
        w = FrameWriter(sink)
        md = (("authorization", "Bearer x"),)
        await server._call(w, answered, 1, "/itif.v1.Itif/Infer", md, 5.0, "ipv4:10.0.0.1:4",
                           b"ok")
        assert seen["metadata"] == md and seen["peer"] == "ipv4:10.0.0.1:4"
        assert 4.5 < seen["left"] <= 5.0 and seen["request"] == b"ok"
        await server._call(w, answered, 2, "/itif.v1.Itif/Infer", md, None, "p", b"refuse")
        assert seen["left"] is None
        await server._call(w, answered, 3, "/itif.v1.Itif/Nope", md, None, "p", b"x")
        task = asyncio.create_task(server._call(w, answered, 4, "/itif.v1.Itif/Infer", md,
                                                None, "p", b"wait"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen["done"] == [b"wait"]  # the answered calls' wait for their DONE frames
        answered.finish(2)
        answered.finish(1)
        await asyncio.sleep(0)  # the last answer's write, at the end of its turn
        return sink.frames

    frames = asyncio.run(run())
    assert frames[0] == (1, 0, "", b"answer to ok", ())
    assert frames[1] == (2, grpc.StatusCode.NOT_FOUND.value[0], "no such tenant", None, ())
    assert frames[2][0] == 3 and frames[2][1] == grpc.StatusCode.UNKNOWN.value[0]
    assert len(frames) == 3  # the cancelled call answered nothing
    assert seen["done"] == [b"wait", b"refuse", b"ok"]


def test_an_answer_too_large_for_a_frame_goes_back_as_a_status(monkeypatch):
    """A reply whose frame cannot be written still answers its caller (RESOURCE_EXHAUSTED),
    rather than leaving it to wait for its deadline; the next call is answered as before."""
    import itif.server.ingress as ingress  # noqa: PLC0415
    from itif.server.ingress_host import FrameServer, _Answered  # noqa: PLC0415

    monkeypatch.setattr(ingress, "MAX_FRAME", 1000)

    async def behaviour(request, context):
        return request * 10

    class Handlers(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(behaviour)

    async def run() -> list:
        server, sink, answered = FrameServer([], [Handlers()]), _Writer(), _Answered()
        out = ingress.FrameWriter(sink)
        await server._call(out, answered, 1, "/itif.v1.Itif/Infer", (), None, "p", b"x" * 200)
        await server._call(out, answered, 2, "/itif.v1.Itif/Infer", (), None, "p", b"y")
        await asyncio.sleep(0)
        return sink.frames

    frames = asyncio.run(run())
    assert [f[:2] for f in frames] == [(1, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]), (2, 0)]
    assert "too large" in frames[0][2] and frames[0][3] is None
    assert frames[1][3] == b"y" * 10


def test_ingress_count_follows_the_cores():
    """``server.ingress_processes: auto`` is one process a four cores, 1 to 8, or none with an
    ephemeral port (each process would get its own); it is the default; a number is what it
    says (0: the daemon serves its port); anything else is refused naming the key."""
    auto = ServerConfig("127.0.0.1:50051", Path("/tmp"), hash_token("a"))
    assert auto.ingress_processes == "auto"
    assert replace(auto, ingress_processes=0).ingress_count(16) == 0
    assert [auto.ingress_count(c) for c in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 8]
    assert auto.ingress_count() >= 1  # this machine's cores
    assert replace(auto, ingress_processes=3).ingress_count(2) == 3
    assert replace(auto, listen="127.0.0.1:0").ingress_count(16) == 0
    for bad in ("many", -1, 65, 2.5):
        with pytest.raises(InvalidConfig, match="server.ingress_processes"):
            parse_config(f"server:\n  listen: 127.0.0.1:1\n  data_dir: ./d\n"
                         f"  admin_token_sha256: {hash_token('a')}\n"
                         f"  ingress_processes: {bad}\nbackbone:\n  config: bert-tiny\n",
                         Path("/tmp"))


def test_ingress_auto_serves_from_processes_as_many_as_the_cores_give(tmp_path, model_file):
    """``ingress_processes: auto``: the port is served from ingress processes (the column
    path), as many as the cores give, the log says so, and the answers equal HF's."""
    m, f = model_file
    d = Daemon(tmp_path, dict(TOKENS), server_extra={"ingress_processes": "auto"}).start()
    try:
        assert "(server.ingress_processes: auto, from the cores)" in d.logs(), d.logs()[-2000:]
        pids = _pids(d)
        auto = ServerConfig("127.0.0.1:1", tmp_path, "", ingress_processes="auto")
        assert len(pids) == auto.ingress_count()
        assert all(_alive(p) for p in pids)
        ids = list(range(3, 20))
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", f)
            got = c.infer("acme", ids)["logits"]
        np.testing.assert_allclose(got, reference(m, itif.Request("acme", ids))["logits"],
                                   atol=1e-4)
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


def test_unread_replies_behind_an_ingress_process_keep_their_budget(tmp_path, model_file):
    """Calls answered one at a time to connections that never read: each reply's bytes stay
    counted against max_pending_reply_bytes (8 MiB) until its caller's call ends, as without
    ingress processes, so the calls past the budget answer RESOURCE_EXHAUSTED (before: every
    call was freed as soon as its answer frame left the daemon, all 40 ran and the ingress
    process held every unread reply). Once the readers leave, the budget is free again."""
    from bench.hostile_load import SlowReader, big_batch_raw  # noqa: PLC0415
    from itif.server._proto.itif.v1 import itif_pb2  # noqa: PLC0415

    _, f = model_file
    metrics = free_port()
    d = Daemon(tmp_path, dict(TOKENS), tenant_extra={"acme": {"max_queue": 10000}},
               server_extra={"ingress_processes": 1, "metrics_listen": f"127.0.0.1:{metrics}",
                             "max_message_bytes": "1MiB", "max_pending_reply_bytes": "8MiB",
                             "max_streams_per_connection": 16}).start()
    raw = big_batch_raw("acme", 24)  # 0.75 MiB of last_hidden_state a reply
    budget = 8 * 2**20 // (24 * 128 * 64 * 4) + 1  # replies the budget holds, one over at most
    try:
        with d.client(TOKENS["acme"]) as c:
            c.upload("acme", f)
        readers = [SlowReader("127.0.0.1", d.port) for _ in range(4)]
        try:
            for _ in range(10):
                for r in readers:
                    r.call("/itif.v1.Itif/InferBatch", raw, TOKENS["acme"])
                    time.sleep(0.1)  # each answered before the next arrives
            end = time.monotonic() + 30
            while (_count(metrics, "InferBatch", "RESOURCE_EXHAUSTED") < 40 - budget
                   and time.monotonic() < end):
                time.sleep(0.2)
            refused = _count(metrics, "InferBatch", "RESOURCE_EXHAUSTED")
        finally:
            for r in readers:
                r.close()
        assert refused >= 40 - budget, refused
        with d.client(TOKENS["acme"]) as c:
            request = itif_pb2.InferBatchRequest.FromString(raw)
            end = time.monotonic() + 30
            while True:  # the readers' calls end as their connections close
                try:
                    c.stub.InferBatch(request, metadata=c.metadata, timeout=30)
                    break
                except grpc.RpcError as e:
                    assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    assert time.monotonic() < end, "the budget was not given back"
                    time.sleep(0.2)
    finally:
        d.stop()


def test_relayed_calls_keep_their_own_connections_reply_budget(tmp_path):
    """Behind an ingress process, calls relayed to the daemon's gRPC server (Generate among
    them) used to share one connection's reply budget (every one came from the same unix
    socket peer): tenant a's open generation, holding 64,512 reply bytes, made tenant b's
    Generate on its own connection RESOURCE_EXHAUSTED "this connection already has ..." with a
    64 KiB budget. The ingress now passes its caller's peer on: b's call is served, and a call
    on a's own connection still meets that connection's budget."""
    from itif.client import Client  # noqa: PLC0415
    from itif.server._proto.itif.v1 import itif_pb2_grpc  # noqa: PLC0415
    from tests.test_generate_daemon import VOCAB, hf_model, weights_bytes, write_backbone  # noqa: PLC0415

    toks = {"a": "tok-a-gen", "b": "tok-b-gen"}
    backbone = write_backbone(tmp_path / "backbone")
    d = Daemon(tmp_path / "d", toks, backbone=str(backbone),
               server_extra={"ingress_processes": 1, "max_new_tokens": 2000,
                             "max_pending_reply_bytes": "64KiB"},
               backbone_extra={"kv_cache_bytes": "32MiB"}).start()

    def own_connection(token: str) -> Client:  # not the channel pool's shared connection
        c = d.client(token)
        c.channel = grpc.insecure_channel(d.addr, options=[("grpc.use_local_subchannel_pool", 1)])
        c.stub = itif_pb2_grpc.ItifStub(c.channel)
        return c

    try:
        for i, t in enumerate(toks):
            p = tmp_path / f"{t}.safetensors"
            p.write_bytes(weights_bytes(hf_model(i + 1), tmp_path))
            with d.client(toks[t]) as c:
                c.upload(t, p, timeout=120)
        ca, cb = own_connection(toks["a"]), own_connection(toks["b"])
        held = ca.generate_stream("a", [5, 17, 42], max_new_tokens=1000, eos_token_id=VOCAB - 1,
                                  timeout=120)
        assert next(held).WhichOneof("event") == "tokens"
        try:
            assert len(cb.generate("b", [5, 17], max_new_tokens=16, timeout=60).sequences) == 1
            b_on_a = ca.stub.Generate(Client.generate_request("b", [5, 17], max_new_tokens=16),
                                      metadata=cb.metadata, timeout=60)
            with pytest.raises(grpc.RpcError) as e:
                list(b_on_a)
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "this connection already has" in e.value.details()
        finally:
            held.cancel()
            ca.close()
            cb.close()
    finally:
        d.stop()
