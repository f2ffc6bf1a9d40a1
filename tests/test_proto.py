"""The itif.v1 proto: committed stubs are fresh, messages round-trip, the stub talks to a server."""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from itif.server import gen
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
PROTO = "itif/v1/itif.proto"


def _compile_descriptor(include_source_info: bool) -> descriptor_pb2.FileDescriptorProto:
    protoc = pytest.importorskip("grpc_tools.protoc")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{gen.DEFAULT_PROTO_ROOT}", f"--descriptor_set_out={out}", PROTO]
        if include_source_info:
            args.insert(1, "--include_source_info")
        assert protoc.main(args) == 0
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = [f for f in fds.file if f.name == PROTO]
    return fd


def _clear_json_names(messages) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _clear_json_names(m.nested_type)


# --------------------------------------------------------------------------------------------
# Freshness
# --------------------------------------------------------------------------------------------


def test_committed_descriptor_matches_proto():
    """Version-independent: the schema compiled into itif_pb2 is the one in the .proto."""
    fresh = _compile_descriptor(include_source_info=False)
    committed = descriptor_pb2.FileDescriptorProto.FromString(itif_pb2.DESCRIPTOR.serialized_pb)
    for fd in (fresh, committed):
        fd.ClearField("source_code_info")
        _clear_json_names(fd.message_type)  # protoc's descriptor sets add them, gencode does not
    assert committed == fresh, "stale stubs: run `python -m itif.server.gen`"


def test_committed_stubs_are_fresh():
    """Byte-for-byte: regenerate into a temp dir and diff (needs the recorded grpcio-tools)."""
    pytest.importorskip("grpc_tools")
    from grpc_tools import grpc_version

    pb2 = gen.DEFAULT_OUT_DIR / "itif" / "v1" / "itif_pb2.py"
    recorded = gen.generator_version(pb2)
    assert recorded, f"{pb2} lacks the itif.server.gen header"
    if recorded != grpc_version.VERSION:
        pytest.skip(f"stubs generated with grpcio-tools {recorded}, {grpc_version.VERSION} installed")
    stale = gen.stale_files()
    assert not stale, "stale stubs, run `python -m itif.server.gen`:\n" + "\n".join(stale.values())


def test_gen_check_cli():
    pytest.importorskip("grpc_tools")
    r = subprocess.run(
        [sys.executable, "-m", "itif.server.gen", "--check"], capture_output=True, text=True, cwd=REPO
    )
    from grpc_tools import grpc_version

    if gen.generator_version(gen.DEFAULT_OUT_DIR / "itif/v1/itif_pb2.py") == grpc_version.VERSION:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode in (0, 1)


def test_generate_into_fresh_dir_is_importable_as_package(tmp_path):
    pytest.importorskip("grpc_tools")
    paths = gen.generate(tmp_path / "_proto")
    rel = sorted(str(p.relative_to(tmp_path / "_proto")) for p in paths)
    assert rel == [
        "__init__.py",
        "itif/__init__.py",
        "itif/v1/__init__.py",
        "itif/v1/itif_pb2.py",
        "itif/v1/itif_pb2.pyi",
        "itif/v1/itif_pb2_grpc.py",
    ]
    grpc_src = (tmp_path / "_proto/itif/v1/itif_pb2_grpc.py").read_text()
    assert "from itif.server._proto.itif.v1 import itif_pb2 as" in grpc_src
    assert "\nfrom itif.v1 " not in grpc_src and "\nimport itif.v1" not in grpc_src
    assert "'/itif.v1.Itif/Infer'" in grpc_src  # method paths untouched


def test_rewrite_handles_both_import_styles():
    mods = gen._module_names((PROTO,))
    src = (
        "import itif.v1.itif_pb2 as itif_dot_v1_dot_itif__pb2\n"
        "from itif.v1 import itif_pb2 as x\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'itif.v1.itif_pb2', _globals)\n"
        "path = '/itif.v1.Itif/Infer'\n"
    )
    out = gen._rewrite(src, mods, "pkg._proto")
    assert out == (
        "from pkg._proto.itif.v1 import itif_pb2 as itif_dot_v1_dot_itif__pb2\n"
        "from pkg._proto.itif.v1 import itif_pb2 as x\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'pkg._proto.itif.v1.itif_pb2', _globals)\n"
        "path = '/itif.v1.Itif/Infer'\n"
    )
    with pytest.raises(RuntimeError, match="could not rewrite"):
        gen._rewrite("import itif.v1.itif_pb2\n", mods, "pkg._proto")


def test_generated_classes_report_real_module():
    assert itif_pb2.InferRequest.__module__ == "itif.server._proto.itif.v1.itif_pb2"


# --------------------------------------------------------------------------------------------
# Schema shape and documentation
# --------------------------------------------------------------------------------------------


def test_every_rpc_message_field_and_enum_value_is_commented():
    fd = _compile_descriptor(include_source_info=True)
    comments = {
        tuple(loc.path): loc.leading_comments.strip()
        for loc in fd.source_code_info.location
        if loc.leading_comments.strip()
    }
    missing: list[str] = []

    def need(path: tuple[int, ...], what: str) -> None:
        if path not in comments:
            missing.append(what)

    # FileDescriptorProto: message_type=4, enum_type=5, service=6
    # DescriptorProto: field=2, nested_type=3, enum_type=4, oneof_decl=8
    # EnumDescriptorProto: value=2; ServiceDescriptorProto: method=2
    def enum(path, e, prefix):
        need(path, f"enum {prefix}{e.name}")
        for k, v in enumerate(e.value):
            need((*path, 2, k), f"enum value {prefix}{e.name}.{v.name}")

    def message(path, m, prefix=""):
        name = f"{prefix}{m.name}"
        need(path, f"message {name}")
        for k, f in enumerate(m.field):
            need((*path, 2, k), f"field {name}.{f.name}")
        for k, o in enumerate(m.oneof_decl):
            if not o.name.startswith("_"):  # synthetic oneofs of proto3 `optional`
                need((*path, 8, k), f"oneof {name}.{o.name}")
        for k, n in enumerate(m.nested_type):
            message((*path, 3, k), n, name + ".")
        for k, e in enumerate(m.enum_type):
            enum((*path, 4, k), e, name + ".")

    for i, m in enumerate(fd.message_type):
        message((4, i), m)
    for i, e in enumerate(fd.enum_type):
        enum((5, i), e, "")
    for i, s in enumerate(fd.service):
        need((6, i), f"service {s.name}")
        for k, meth in enumerate(s.method):
            need((6, i, 2, k), f"rpc {s.name}.{meth.name}")
    assert not missing, "uncommented: " + ", ".join(missing)
    assert "deadline" in (REPO / "protos" / PROTO).read_text().lower()


def test_service_shape():
    svc = itif_pb2.DESCRIPTOR.services_by_name["Itif"]
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"UploadWeights", "Infer", "InferBatch", "GetTenant", "ListTenants", "DeleteWeights"}
    assert methods["UploadWeights"].client_streaming and not methods["UploadWeights"].server_streaming
    assert methods["Infer"].input_type.name == "InferRequest"
    assert methods["GetTenant"].output_type.name == "TenantInfo"
    assert itif_pb2.DESCRIPTOR.package == "itif.v1"
    assert [v.name for v in itif_pb2.TenantInfo.State.DESCRIPTOR.values] == [
        "NO_WEIGHTS", "LOADING", "READY", "FAILED"
    ]


# --------------------------------------------------------------------------------------------
# Message round trips
# --------------------------------------------------------------------------------------------


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_round_trip_messages():
    req = itif_pb2.InferRequest(
        tenant="acme",
        input=itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(ids=[101, 2023, 102], token_type_ids=[0, 0, 0])),
        outputs=["logits", "pooled"],
        priority=3,
    )
    back = itif_pb2.InferRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.input.WhichOneof("input") == "input_ids"
    assert list(back.input.input_ids.ids) == [101, 2023, 102]
    assert back.HasField("priority") and back.priority == 3
    assert not itif_pb2.InferRequest(tenant="a").HasField("priority")

    img = itif_pb2.InferInput(pixel_values=itif_pb2.Tensor(shape=[3, 2, 2], data=f32(*range(12))))
    text = itif_pb2.InferInput(text="hello world")
    batch = itif_pb2.InferBatchRequest(tenant="acme", inputs=[img, text], outputs=["logits"])
    back = itif_pb2.InferBatchRequest.FromString(batch.SerializeToString())
    assert [i.WhichOneof("input") for i in back.inputs] == ["pixel_values", "text"]
    t = back.inputs[0].pixel_values
    assert struct.unpack(f"<{len(t.data) // 4}f", t.data) == tuple(float(x) for x in range(12))

    resp = itif_pb2.InferBatchResponse(
        results=[
            itif_pb2.InferResponse(
                outputs=[itif_pb2.Tensor(name="logits", shape=[1, 2], data=f32(0.5, -1.25))],
                weights_sha256="ab" * 32,
            )
        ]
    )
    assert itif_pb2.InferBatchResponse.FromString(resp.SerializeToString()) == resp

    header = itif_pb2.UploadWeightsRequest(header=itif_pb2.UploadHeader(tenant="acme", sha256="0" * 64, total_size=10))
    chunk = itif_pb2.UploadWeightsRequest(chunk=b"\x00\x01")
    assert itif_pb2.UploadWeightsRequest.FromString(header.SerializeToString()).WhichOneof("payload") == "header"
    assert itif_pb2.UploadWeightsRequest.FromString(chunk.SerializeToString()).chunk == b"\x00\x01"

    info = itif_pb2.TenantInfo(
        id="acme", state=itif_pb2.TenantInfo.READY, sha256="1" * 64, weight_bytes=10, exclusive_bytes=4,
        num_labels=2, queue_depth=1, error="",
    )
    lst = itif_pb2.ListTenantsResponse(tenants=[info])
    assert itif_pb2.ListTenantsResponse.FromString(lst.SerializeToString()).tenants[0].state == itif_pb2.TenantInfo.READY
    assert itif_pb2.TenantInfo().state == itif_pb2.TenantInfo.NO_WEIGHTS
    for msg in (
        itif_pb2.UploadWeightsResponse(tenant="a", sha256="s", bytes=5, weight_bytes=4, shared_bytes=1),
        itif_pb2.DeleteWeightsResponse(tenant="a", deleted=True, freed_bytes=7),
        itif_pb2.GetTenantRequest(tenant="a"),
        itif_pb2.DeleteWeightsRequest(tenant="a"),
        itif_pb2.ListTenantsRequest(),
    ):
        assert type(msg).FromString(msg.SerializeToString()) == msg


# --------------------------------------------------------------------------------------------
# In-process server through the generated stub
# --------------------------------------------------------------------------------------------


class DummyServicer(itif_pb2_grpc.ItifServicer):
    def __init__(self) -> None:
        self.seen_deadline: list[float | None] = []
        self.seen_metadata: list[dict[str, str]] = []

    def Infer(self, request, context):
        self.seen_deadline.append(context.time_remaining())
        self.seen_metadata.append(dict(context.invocation_metadata()))
        if request.tenant != "acme":
            context.abort(grpc.StatusCode.NOT_FOUND, f"tenant {request.tenant!r} not found")
        n = len(request.input.input_ids.ids)
        names = list(request.outputs) or ["logits"]
        return itif_pb2.InferResponse(
            outputs=[itif_pb2.Tensor(name=name, shape=[1, n], data=f32(*([float(n)] * n))) for name in names],
            weights_sha256="cd" * 32,
        )

    def UploadWeights(self, request_iterator, context):
        first = next(request_iterator)
        assert first.WhichOneof("payload") == "header"
        size = sum(len(m.chunk) for m in request_iterator)
        return itif_pb2.UploadWeightsResponse(
            tenant=first.header.tenant, sha256=first.header.sha256, bytes=size, weight_bytes=size
        )


@pytest.fixture
def server():
    servicer = DummyServicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    itif_pb2_grpc.add_ItifServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    assert port > 0
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield itif_pb2_grpc.ItifStub(channel), servicer
    finally:
        channel.close()
        srv.stop(grace=None)


def test_infer_through_generated_stub(server):
    stub, servicer = server
    req = itif_pb2.InferRequest(
        tenant="acme",
        input=itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(ids=[1, 2, 3])),
        outputs=["logits", "pooled"],
    )
    resp = stub.Infer(req, timeout=10, metadata=[("authorization", "Bearer acme-token")])
    assert [t.name for t in resp.outputs] == ["logits", "pooled"]
    assert list(resp.outputs[0].shape) == [1, 3]
    assert struct.unpack("<3f", resp.outputs[0].data) == (3.0, 3.0, 3.0)
    assert resp.weights_sha256 == "cd" * 32
    # the gRPC deadline is what reaches the server
    # the server's reading of time left can exceed the 10 s sent slightly (10.099 s seen in CI)
    assert servicer.seen_deadline[-1] is not None and 0 < servicer.seen_deadline[-1] <= 10.5
    assert servicer.seen_metadata[-1]["authorization"] == "Bearer acme-token"

    with pytest.raises(grpc.RpcError) as ei:
        stub.Infer(itif_pb2.InferRequest(tenant="nobody"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as ei:
        stub.GetTenant(itif_pb2.GetTenantRequest(tenant="acme"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_upload_stream_through_generated_stub(server):
    stub, _ = server

    def messages():
        yield itif_pb2.UploadWeightsRequest(header=itif_pb2.UploadHeader(tenant="acme", sha256="e" * 64, total_size=6))
        yield itif_pb2.UploadWeightsRequest(chunk=b"abc")
        yield itif_pb2.UploadWeightsRequest(chunk=b"def")

    resp = stub.UploadWeights(messages(), timeout=10)
    assert (resp.tenant, resp.sha256, resp.bytes) == ("acme", "e" * 64, 6)
