"""Reliability, bad inputs (promises 17-22 of shared/reference/reliability.md), against a real
daemon subprocess on loopback.

Tenant ``acme`` runs under the ``oom:acme`` fault hook: every forward that holds one of its
requests fails with RESOURCE_EXHAUSTED. A bad input of acme's that answers INVALID_ARGUMENT
therefore proves the request was refused before it reached the engine. ``beta`` is the target of
every hostile upload; its weights, outputs and stored file must come through unchanged.
"""

from __future__ import annotations

import io
import pickle
import struct

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from itif.server._proto.itif.v1 import itif_pb2
from itif.server.kserve import PROBES as KSERVE_PROBES
from tests.reliability_util import (
    ADMIN,
    OK,
    Daemon,
    code_of,
    error_of,
    infer_sha,
    make_tokens,
    promise,
    sha256,
    state_dict,
    upload_bytes,
    wait_until,
    weights_bytes,
)

C = grpc.StatusCode
TOKENS = make_tokens(["acme", "beta", "gamma"])
MAX_MESSAGE = 1 << 20  # server.max_message_bytes
MAX_UPLOAD = 16 << 20  # server.max_upload_bytes
VOCAB, MAX_LEN, GAMMA_LEN = 1000, 128, 16  # bert-tiny; gamma's own max_seq_len
PROBES = [[1, 2, 3], list(range(40)), [7] * MAX_LEN]
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("input"), dict(TOKENS), faults="oom:acme",
                server_extra={"max_message_bytes": MAX_MESSAGE, "max_upload_bytes": MAX_UPLOAD},
                tenant_extra={"gamma": {"max_seq_len": GAMMA_LEN}})
    d.start()
    for i, (tid, tok) in enumerate(TOKENS.items()):
        with d.client(tok) as c:
            upload_bytes(c, tid, weights_bytes(10 + i))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def beta_before(daemon):
    """beta's answers (exact bytes and weights sha) and stored file before any hostile input."""
    with daemon.client(TOKENS["beta"]) as c:
        answers = [infer_sha(c, "beta", ids) for ids in PROBES]
    return answers, daemon.stored("beta")


def assert_beta_unchanged(daemon, beta_before) -> None:
    answers, stored = beta_before
    with daemon.client(TOKENS["beta"]) as c:
        assert [infer_sha(c, "beta", ids) for ids in PROBES] == answers
        assert c.health_status() == "SERVING"
    assert daemon.stored("beta") == stored
    assert daemon.tmp_files() == []


def _infer(c, tenant, inp: itif_pb2.InferInput, outputs=()):
    return lambda: c.stub.Infer(itif_pb2.InferRequest(tenant=tenant, input=inp,
                                                      outputs=list(outputs)),
                                metadata=c.metadata, timeout=30)


def _ids(ids, types=None) -> itif_pb2.InferInput:
    return itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(ids=ids, token_type_ids=types or []))


def _pixels(shape, data: bytes) -> itif_pb2.InferInput:
    return itif_pb2.InferInput(pixel_values=itif_pb2.Tensor(shape=shape, data=data))


# ---- 17: wrong shapes, empty inputs, mismatched mask --------------------------------------
@promise(17)
def test_malformed_inputs_are_invalid_argument_naming_the_field(daemon, beta_before, rel):
    """Wrong shapes / empty inputs / mismatched token types: INVALID_ARGUMENT naming the field,
    and nothing reaches the engine (acme's forwards would all fail RESOURCE_EXHAUSTED)."""
    cases = [  # (input, outputs, word the message must contain)
        (itif_pb2.InferInput(), (), "input_ids"),
        (_ids([]), (), "input_ids"),
        (_ids([1, 2, 3], [0, 1]), (), "token_type_ids"),
        (_ids([1, 2, 3], [0, 1, 0, 1]), (), "token_type_ids"),
        (_ids([1, 2, 3], [0, 2, 0]), (), "token_type_ids"),
        (_ids([1, 2, 3], [-1, 0, 0]), (), "token_type_ids"),
        (_ids([1, 2, 3]), ("logits", "nope"), "output"),
        (_ids([1, 2, 3]), ("",), "output"),
        (itif_pb2.InferInput(text="hello"), (), "input_ids"),  # bert-tiny ships no tokenizer
        (_pixels([3, 32, 32], bytes(3 * 32 * 32 * 4)), (), "pixel_values"),
        (_pixels([3, 32, 32], b"\0" * 7), (), "pixel_values"),
        (_pixels([-1, 4], b""), (), "pixel_values"),
        (_pixels([2**32, 2**32], b""), (), "pixel_values"),  # numel overflows int64
        (_pixels([2**62, 4], b""), (), "pixel_values"),
        (_pixels([2**62, 2**62, 0], b""), (), "pixel_values"),  # no elements, yet no array
        (_pixels([0], b""), (), "pixel_values"),
    ]
    with daemon.client(TOKENS["acme"]) as c:
        for inp, outs, word in cases:
            for call in (_infer(c, "acme", inp, outs),
                         lambda: c.stub.InferBatch(itif_pb2.InferBatchRequest(
                             tenant="acme", inputs=[_ids([5, 6]), inp], outputs=list(outs)),
                             metadata=c.metadata, timeout=30)):
                code, msg = error_of(call)
                rel.inputs += 1
                rel.saw(code)
                assert code == C.INVALID_ARGUMENT, (inp, outs, code, msg)
                assert word in msg, (inp, msg)
        code, msg = error_of(lambda: c.stub.InferBatch(
            itif_pb2.InferBatchRequest(tenant="acme"), metadata=c.metadata, timeout=30))
        rel.inputs += 1
        assert code == C.INVALID_ARGUMENT and "input" in msg
        # acme's valid input does reach the engine, which fails it: the hook is live.
        assert code_of(_infer(c, "acme", _ids([1, 2, 3]))) == C.RESOURCE_EXHAUSTED
    assert_beta_unchanged(daemon, beta_before)


# ---- 18: token ids out of vocabulary, negative, huge ------------------------------------------
@promise(18)
def test_token_ids_out_of_range_are_invalid_argument(daemon, rel):
    """Out-of-vocabulary, negative and huge ids -> INVALID_ARGUMENT; before the engine."""
    bad = [VOCAB, VOCAB + 1, -1, -(2**63), 2**63 - 1, 2**31, 2**32 + 5]
    with daemon.client(TOKENS["acme"]) as c:
        for b in bad:
            for ids in ([b], [1, 2, b], [b] + [3] * 50):
                code, msg = error_of(_infer(c, "acme", _ids(ids)))
                rel.inputs += 1
                rel.saw(code)
                assert code == C.INVALID_ARGUMENT and "input_ids" in msg, (ids[:4], code, msg)


@promise(18)
@FUZZ
@given(ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**63), 2**63 - 1)),
                    min_size=0, max_size=MAX_LEN + 8),
       types=st.none() | st.lists(st.integers(-3, 3), max_size=MAX_LEN + 8))
def test_token_ids_property_never_unknown_or_internal(daemon, ids, types):
    """Property: any int64 ids (and token types) -> OK exactly when valid, else
    INVALID_ARGUMENT; never UNKNOWN or INTERNAL, and the engine survives."""
    valid = (1 <= len(ids) <= MAX_LEN and all(0 <= i < VOCAB for i in ids)
             and (not types or (len(types) == len(ids) and all(0 <= t < 2 for t in types))))
    with daemon.client(TOKENS["beta"]) as c:
        code = code_of(_infer(c, "beta", _ids(ids, types)))
    _PROPERTY_CODES[code.name] = _PROPERTY_CODES.get(code.name, 0) + 1
    assert code == (OK if valid else C.INVALID_ARGUMENT), (ids[:8], types and types[:8], code)


_PROPERTY_CODES: dict[str, int] = {}


@promise(18)
def test_token_ids_property_tally(daemon, rel):
    """Books the property test's inputs (hypothesis examples) for the report."""
    rel.inputs = sum(_PROPERTY_CODES.values())
    rel.codes.update(_PROPERTY_CODES)
    assert rel.inputs >= 100 and set(_PROPERTY_CODES) <= {"OK", "INVALID_ARGUMENT"}


# ---- 19: length boundaries --------------------------------------------------------------------
@promise(19)
def test_length_max_ok_and_max_plus_one_invalid(daemon, rel):
    """Length = max OK, max+1 INVALID_ARGUMENT: the backbone's maximum and a tenant's own
    max_seq_len, alone and inside an InferBatch (which then fails as a whole)."""
    for tenant, limit in (("beta", MAX_LEN), ("gamma", GAMMA_LEN)):
        with daemon.client(TOKENS[tenant]) as c:
            assert code_of(_infer(c, tenant, _ids([5] * limit))) == OK
            code, msg = error_of(_infer(c, tenant, _ids([5] * (limit + 1))))
            assert code == C.INVALID_ARGUMENT and str(limit + 1) in msg, msg
            batch = itif_pb2.InferBatchRequest(
                tenant=tenant, inputs=[_ids([5] * limit), _ids([5] * (limit + 1)), _ids([1])])
            code = code_of(lambda: c.stub.InferBatch(batch, metadata=c.metadata, timeout=30))
            assert code == C.INVALID_ARGUMENT
            rel.inputs += 3


# ---- 20: oversized messages and uploads -------------------------------------------------------
@promise(20)
def test_oversized_message_and_upload_refused(daemon, beta_before, rel):
    """A message over server.max_message_bytes -> RESOURCE_EXHAUSTED before the handler; an
    upload over server.max_upload_bytes (declared, or sent beyond its declared size, or one
    chunk over the message limit) is aborted with its temp file gone and its lock released."""
    big = [VOCAB - 1] * (MAX_MESSAGE // 2 + 4096)  # 2-byte varints: over 1 MiB
    with daemon.client(TOKENS["acme"]) as c:  # acme: reaching the engine would be RESOURCE_EXH.
        code, msg = error_of(_infer(c, "acme", _ids(big)))
        assert code == C.RESOURCE_EXHAUSTED and "message" in msg.lower(), msg
    good = weights_bytes(11)
    with daemon.client(TOKENS["beta"]) as c:
        cases = [
            dict(size=MAX_UPLOAD + 1),  # declared over the cap
            dict(size=100),  # chunks run past the declared size
            dict(chunk=MAX_MESSAGE + 1024),  # one chunk over the message limit
        ]
        for kw in cases:
            data = good if "chunk" not in kw else good + bytes(MAX_MESSAGE + 2048 - len(good))
            code, msg = error_of(lambda: upload_bytes(c, "beta", data, **kw))
            rel.inputs += 1
            rel.saw(code)
            assert code == C.RESOURCE_EXHAUSTED, (kw, code, msg)
            wait_until(lambda: daemon.tmp_files() == [], 10, what="temp file removed")
        # the upload lock of beta is free again: the same file uploads fine (same sha, no-op)
        assert upload_bytes(c, "beta", good).sha256 == beta_before[1][1]
    assert_beta_unchanged(daemon, beta_before)


# ---- 21: hostile weights ----------------------------------------------------------------------
class Payload:
    """Unpickling this creates the file ``marker``: the side effect that must never happen."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _st(tensors: dict[str, torch.Tensor]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})


def _raw(header: bytes | str, data: bytes = b"", length: int | None = None) -> bytes:
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def _hostile_files(marker: str) -> dict[str, bytes]:
    sd = state_dict(11)
    name = "bert.encoder.layer.0.intermediate.dense.weight"
    assert name in sd, sorted(sd)[:5]

    def edit(fn) -> bytes:
        d = {k: v.clone() for k, v in sd.items()}
        fn(d)
        return _st(d)

    def nan(d):
        d[name][3, 4] = float("nan")

    def inf(d):
        d[name][0, 0] = float("inf")

    def neg_inf_f16(d):
        for k in d:
            d[k] = d[k].half()
        d[name][1, 1] = float("-inf")

    def overflow_f64(d):
        d[name] = d[name].double()
        d[name][2, 2] = 1e300  # finite in F64, +inf once cast to the store's float32

    def rename(d):
        d[name.replace("intermediate", "intermediat")] = d.pop(name)

    def drop(d):
        del d[name]

    def extra(d):
        d["bert.encoder.layer.9.evil.weight"] = torch.zeros(4, 4)

    def transpose(d):
        d[name] = d[name].t().contiguous()

    def cut_row(d):
        d[name] = d[name][:-1].contiguous()

    def int_dtype(d):
        d[name] = d[name].to(torch.int32)

    def bool_dtype(d):
        d[name] = d[name] > 0

    buf = io.BytesIO()
    torch.save({"w": Payload(marker)}, buf)
    valid = weights_bytes(11)
    (hlen,) = struct.unpack("<Q", valid[:8])
    header = valid[8:8 + hlen]
    t = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    many = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
                    for i in range(100_000))
    return {
        "pickle (raw, protocol 5)": pickle.dumps({"w": Payload(marker)}, protocol=5),
        "pickle (protocol 0)": pickle.dumps(Payload(marker), protocol=0),
        "torch.save zip": buf.getvalue(),
        "safetensors header + pickle body": _raw('{"w":' + t + "}", pickle.dumps(Payload(marker))),
        "NaN": edit(nan),
        "+Inf": edit(inf),
        "-Inf (F16)": edit(neg_inf_f16),
        "F64 overflowing float32": edit(overflow_f64),
        "wrong name": edit(rename),
        "missing tensor": edit(drop),
        "unknown extra tensor": edit(extra),
        "wrong shape (transposed)": edit(transpose),
        "wrong shape (one row short)": edit(cut_row),
        "wrong dtype (I32)": edit(int_dtype),
        "wrong dtype (BOOL)": edit(bool_dtype),
        "another backbone's weights (albert-tiny)": _st(state_dict(5, 2, "albert-tiny")),
        "duplicate key": _raw('{"a":' + t + ',"a":' + t + "}", bytes(4)),
        "duplicate nested key": _raw('{"a":{"dtype":"F32","dtype":"F32","shape":[1],'
                                     '"data_offsets":[0,4]}}', bytes(4)),
        "absurd header length 2**63": _raw(b"{}", length=2**63),
        "absurd header length 2**40": _raw(header, valid[8 + hlen:], length=2**40),
        "header length past the end": _raw(header, b"", length=hlen + 10),
        "truncated file (half)": valid[: len(valid) // 2],
        "truncated file (header only)": valid[: 8 + hlen],
        "truncated file (7 bytes)": valid[:7],
        "100k tiny tensors": _raw("{" + many + "}"),
        "no tensors": _raw("{}"),
        "metadata not str->str": _raw('{"__metadata__":{"a":1}}'),
        "deeply nested header": _raw("{" + '"a":' * 1 + "[" * 5000 + "]" * 5000 + "}"),
        "not JSON": _raw(b"\xff\xfe" * 10),
        "random bytes": bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)),
    }


@promise(21)
def test_hostile_weights_rejected_nothing_executed_previous_weights_served(
        daemon, beta_before, tmp_path, rel):
    """Pickles (with a live side effect), NaN/Inf, wrong names/shapes/dtypes, duplicate keys,
    absurd header lengths, truncated files, 100k tiny tensors, wrong sha256 / size: each upload
    INVALID_ARGUMENT, the side effect never happens, the previous weights still serve."""
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Payload(str(probe)))).close()  # the payload is live
    assert probe.exists()
    files = _hostile_files(str(marker))
    valid = weights_bytes(12)
    lies = {
        "wrong sha256": dict(data=valid, sha=sha256(valid + b"x")),
        "sha256 not hex": dict(data=valid, sha="z" * 64),
        "sha256 upper case": dict(data=valid, sha=sha256(valid).upper()),
        "declared size larger than sent": dict(data=valid, size=len(valid) + 1),
        "declared size 0": dict(data=valid, size=0),
    }
    with daemon.client(TOKENS["beta"]) as c:
        for what, blob in files.items():
            code, msg = error_of(lambda: upload_bytes(c, "beta", blob))
            rel.inputs += 1
            rel.saw(code)
            assert code == C.INVALID_ARGUMENT, (what, code, msg)
            assert daemon.tmp_files() == [], what
        for what, kw in lies.items():
            data = kw.pop("data")
            code, msg = error_of(lambda: upload_bytes(c, "beta", data, **kw))
            rel.inputs += 1
            rel.saw(code)
            assert code == C.INVALID_ARGUMENT, (what, code, msg)
    assert not marker.exists()
    rel.notes["pickle side effects"] = 0
    assert_beta_unchanged(daemon, beta_before)


# ---- 22: fuzzed bytes to every method ---------------------------------------------------------
KNOWN = {  # path -> codes a fuzzed message may get besides INVALID_ARGUMENT (does not parse)
    "/itif.v1.Itif/Infer": {OK, C.NOT_FOUND, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION},
    "/itif.v1.Itif/InferBatch": {OK, C.NOT_FOUND, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION},
    "/itif.v1.Itif/GetTenant": {OK, C.NOT_FOUND},
    # this daemon serves an encoder backbone: Generate answers UNIMPLEMENTED by design
    "/itif.v1.Itif/Generate": {C.UNIMPLEMENTED, C.NOT_FOUND, C.RESOURCE_EXHAUSTED,
                               C.FAILED_PRECONDITION},
    "/itif.v1.Itif/ListTenants": {OK},
    "/itif.v1.Itif/DeleteWeights": {OK, C.NOT_FOUND, C.PERMISSION_DENIED},
    "/itif.v1.Itif/UploadWeights": {C.NOT_FOUND, C.RESOURCE_EXHAUSTED},
    "/grpc.health.v1.Health/Check": {OK, C.NOT_FOUND, C.UNAUTHENTICATED},
    "/grpc.health.v1.Health/Watch": {OK, C.NOT_FOUND, C.UNAUTHENTICATED, C.DEADLINE_EXCEEDED},
    "/grpc.health.v1.Health/List": {OK},
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": {OK},
}
_KS = "/inference.GRPCInferenceService/"
#: KServe v2 methods that itif declares but does not offer: UNIMPLEMENTED, and only these.
NOT_OFFERED = {_KS + m for m in ("ModelStreamInfer", "SystemSharedMemoryRegister",
                                 "CudaSharedMemoryRegister", "TraceSetting", "LogSettings")}
_MODEL = {OK, C.NOT_FOUND, C.FAILED_PRECONDITION}  # a fuzzed model name: unknown, or not loaded
KNOWN.update({
    _KS + "ServerLive": {OK},
    _KS + "ServerReady": {OK},
    _KS + "ServerMetadata": {OK},
    _KS + "ModelReady": {OK},  # an unknown model answers ready=false
    _KS + "ModelMetadata": _MODEL,
    _KS + "ModelConfig": _MODEL,
    _KS + "ModelStatistics": {OK, C.NOT_FOUND},
    _KS + "RepositoryIndex": {OK},
    _KS + "RepositoryModelLoad": _MODEL | {C.RESOURCE_EXHAUSTED},
    _KS + "RepositoryModelUnload": {C.NOT_FOUND, C.PERMISSION_DENIED},
    _KS + "ModelInfer": _MODEL | {C.RESOURCE_EXHAUSTED},
    _KS + "SystemSharedMemoryStatus": {OK},
    _KS + "CudaSharedMemoryStatus": {OK},
    _KS + "SystemSharedMemoryUnregister": {OK},
    _KS + "CudaSharedMemoryUnregister": {OK},
    **{m: {C.UNIMPLEMENTED} for m in NOT_OFFERED},
})
PUBLIC = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_FUZZ_COUNTS: dict[str, int] = {}
_FUZZ_METHODS: set[str] = set()
_UNIMPLEMENTED: set[str] = set()


@pytest.fixture(scope="module")
def every_method(daemon) -> list[tuple[str, str]]:
    """(path, kind) of every method of every service the daemon exposes, read through its own
    reflection: itif.v1, health, reflection, and whatever else is registered (KServe v2)."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    out = []
    with grpc.insecure_channel(daemon.addr) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        def ask(**kw):
            req = reflection_pb2.ServerReflectionRequest(**kw)
            return next(iter(stub.ServerReflectionInfo(iter([req]), timeout=10)))

        names = [s.name for s in ask(list_services="").list_services_response.service]
        for name in names:
            for raw in ask(file_containing_symbol=name).file_descriptor_response \
                    .file_descriptor_proto:
                fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
                for svc in fd.service:
                    full = f"{fd.package}.{svc.name}" if fd.package else svc.name
                    if full != name:
                        continue
                    for m in svc.method:
                        kind = ("s" if m.client_streaming else "u") + (
                            "s" if m.server_streaming else "u")
                        out.append((f"/{full}/{m.name}", kind))
    assert set(KNOWN) <= {p for p, _ in out}, out
    return sorted(set(out))


def _public(path: str) -> bool:
    return path.startswith(PUBLIC) or path in KSERVE_PROBES


def _call_raw(channel, path: str, kind: str, msgs: list[bytes], token: str | None):
    md = (("authorization", f"Bearer {token}"),) if token else ()
    ident = {"request_serializer": None, "response_deserializer": None}
    if kind == "uu":
        return channel.unary_unary(path, **ident)(msgs[0], metadata=md, timeout=10)
    if kind == "su":
        return channel.stream_unary(path, **ident)(iter(msgs), metadata=md, timeout=10)
    if kind == "us":
        return list(channel.unary_stream(path, **ident)(msgs[0], metadata=md, timeout=0.3))
    return list(channel.stream_stream(path, **ident)(iter(msgs), metadata=md, timeout=10))


@pytest.fixture(scope="module")
def raw_channel(daemon):
    ch = grpc.insecure_channel(daemon.addr, options=[
        ("grpc.max_send_message_length", 8 << 20)])
    yield ch
    ch.close()


def _prefixed(data: st.DataObject) -> bytes:
    """Random bytes, half of the time behind a plausible field tag so that the parser gets
    further (protobuf accepts a lot: unknown fields are skipped)."""
    body = data.draw(st.binary(max_size=300))
    tag = data.draw(st.sampled_from([b"", b"\x0a", b"\x12", b"\x1a", b"\x20", b"\x08"]))
    if tag and tag != b"\x20" and tag != b"\x08":
        return tag + bytes([min(len(body), 127)]) + body
    return tag + body


def _fuzz_one(channel, path: str, kind: str, msgs: list[bytes], token: str | None) -> None:
    """Send ``msgs`` to ``path`` and check the code against the method's list."""
    if token == ADMIN and path.rsplit("/", 1)[1] in ("DeleteWeights", "RepositoryModelUnload"):
        token = TOKENS["acme"]  # the admin may legitimately delete a fuzzed tenant's weights
    code = code_of(lambda: _call_raw(channel, path, kind, msgs, token))
    _FUZZ_COUNTS[code.name] = _FUZZ_COUNTS.get(code.name, 0) + 1
    _FUZZ_METHODS.add(path)
    if code == C.UNIMPLEMENTED:
        _UNIMPLEMENTED.add(path)
    if not _public(path) and token in (None, "wrong"):  # refused before the message is parsed
        assert code == C.UNAUTHENTICATED, (path, token, msgs, code)
    else:  # every method the daemon exposes has its list: a new one must be added to KNOWN
        assert path in KNOWN, f"{path}: which codes may it answer? add it to KNOWN"
        assert code in KNOWN[path] | {C.INVALID_ARGUMENT}, (path, token, msgs, code)


FUZZ_TOKENS = [TOKENS["acme"], TOKENS["beta"], ADMIN, None, "wrong"]


@promise(22)
def test_garbage_to_every_method_every_token(daemon, raw_channel, every_method):
    """Every method (all of them, not a random subset), with every kind of token, gets a few
    fixed malformed or odd messages: only the method's expected codes."""
    garbage = [b"", b"\xff", b"\x0a\x05hello", b"\x12\x7f" + b"x" * 5, b"\x08" + b"\xff" * 11]
    for path, kind in every_method:
        for token in FUZZ_TOKENS:
            for g in garbage:
                _fuzz_one(raw_channel, path, kind, [g], token)
    assert {p for p, _ in every_method} <= _FUZZ_METHODS


@promise(22)
@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_fuzzed_bytes_to_every_method(daemon, raw_channel, every_method, data):
    """Random bytes to every method of every service (itif.v1, health, reflection, KServe),
    with a tenant token, the admin token, a wrong one and none: only the expected codes."""
    path, kind = data.draw(st.sampled_from(every_method))
    token = data.draw(st.sampled_from(FUZZ_TOKENS))
    msgs = [_prefixed(data) for _ in range(data.draw(st.integers(1, 3)))]
    _fuzz_one(raw_channel, path, kind, msgs, token)


_FIELD_FUZZ: dict[str, int] = {}


@promise(22)
@FUZZ
@given(tenant=st.sampled_from(["acme", "beta", "gamma", "", "nobody", "../beta", "/abs",
                               "beta\x00", "BETA", "beta "]) | st.text(max_size=70),
       kind=st.sampled_from(["ids", "text", "pixels", "none"]),
       ids=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, VOCAB - 1), max_size=140),
       text=st.text(max_size=50),
       shape=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 40), max_size=5),
       pix=st.binary(max_size=64),
       outputs=st.lists(st.sampled_from(["logits", "pooled", "last_hidden_state", "x", ""]),
                        max_size=4),
       priority=st.none() | st.integers(0, 2**32 - 1),
       batch=st.integers(0, 3))
def test_fuzzed_fields_of_infer(daemon, tenant, kind, ids, text, shape, pix, outputs, priority,
                                batch):
    """Well-formed messages with fuzzed field values (tenant ids, token ids, text, tensor
    shapes and data, outputs, priorities) to Infer and InferBatch."""
    inp = {"ids": _ids(ids), "text": itif_pb2.InferInput(text=text),
           "pixels": _pixels(shape, pix), "none": itif_pb2.InferInput()}[kind]
    with daemon.client(TOKENS["beta"]) as c:
        if batch:
            req = itif_pb2.InferBatchRequest(tenant=tenant, inputs=[inp] * batch,
                                             outputs=outputs, priority=priority)
            code = code_of(lambda: c.stub.InferBatch(req, metadata=c.metadata, timeout=30))
        else:
            req = itif_pb2.InferRequest(tenant=tenant, input=inp, outputs=outputs,
                                        priority=priority)
            code = code_of(lambda: c.stub.Infer(req, metadata=c.metadata, timeout=30))
    _FIELD_FUZZ[code.name] = _FIELD_FUZZ.get(code.name, 0) + 1
    assert code in {OK, C.INVALID_ARGUMENT, C.NOT_FOUND}, (tenant, kind, code)


@promise(22)
def test_fuzz_tally_and_daemon_healthy_afterwards(daemon, beta_before, rel):
    """After all fuzzing: health SERVING, previous weights still served, no temp files, and the
    fuzzers really ran (their inputs are booked here for the report)."""
    rel.inputs = sum(_FUZZ_COUNTS.values()) + sum(_FIELD_FUZZ.values())
    rel.codes.update(_FUZZ_COUNTS)
    rel.codes.update(_FIELD_FUZZ)
    rel.notes["methods fuzzed"] = len(_FUZZ_METHODS)
    rel.notes["methods answering UNIMPLEMENTED"] = sorted(_UNIMPLEMENTED)
    assert sum(_FUZZ_COUNTS.values()) >= 100 and sum(_FIELD_FUZZ.values()) >= 100
    assert set(KNOWN) <= _FUZZ_METHODS, set(KNOWN) - _FUZZ_METHODS
    assert _UNIMPLEMENTED <= NOT_OFFERED | {"/itif.v1.Itif/Generate"}, _UNIMPLEMENTED - NOT_OFFERED
    assert not {"UNKNOWN", "INTERNAL", "DATA_LOSS"} & set(rel.codes)
    with daemon.client(ADMIN) as c:
        assert c.health_status() == "SERVING"
        assert {t.id: t.state for t in c.tenants()} == {
            t: itif_pb2.TenantInfo.READY for t in TOKENS}
    assert_beta_unchanged(daemon, beta_before)
    assert "Traceback" not in daemon.logs()
