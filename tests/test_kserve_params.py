"""The KServe v2 parameters itif reads, held to the types the protocol (with Triton's schedule
policy, sequence, binary data and classification extensions) gives them, on REST and gRPC
(issue 63, a hostile client's finding: ``"parameters": {"timeout": "5000000"}`` answered 200,
the call run without a timeout).

Before: a parameter of the wrong type was ignored (``timeout`` or ``priority`` as a string, a
negative or fractional ``timeout``, ``binary_data_output`` as a string: 200), or read by its
truthiness (``sequence_start: "false"`` refused as a sequence, ``classification: "2"`` as the
classification extension). Now: 400 / INVALID_ARGUMENT naming the parameter and the type it
takes (on gRPC, the InferParameter fields that may carry it); well-typed values work as before.

One real daemon (bert-tiny, CPU, HTTP on) with tenant ``acme`` (a 3-label head).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.daemon_harness import http_daemon
from tests.reliability_util import promise, rel  # noqa: F401 - rel: the fixture

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc  # noqa: E402

TOKEN = "acme-tok"
INFER = "/v2/models/acme/infer"
UINT, BOOL = "a non-negative integer", "a boolean"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = http_daemon(tmp_path_factory.mktemp("kserve-params"), {"acme": TOKEN}, seed=7)
    yield d
    d.stop()


def _rest(d, parameters=None, outputs=None) -> httpx.Response:
    body: dict = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 3],
                              "data": [5, 6, 7]}]}
    if parameters is not None:
        body["parameters"] = parameters
    if outputs is not None:
        body["outputs"] = outputs
    return httpx.post(f"http://{d.http}{INFER}", json=body, timeout=30,
                      headers={"authorization": f"Bearer {TOKEN}"})


@pytest.mark.parametrize(("parameters", "outputs", "name", "kind"), [
    ({"timeout": "5000000"}, None, "timeout", UINT),  # the review's: answered 200
    ({"timeout": 1.5e6}, None, "timeout", UINT),
    ({"timeout": -1}, None, "timeout", UINT),
    ({"timeout": True}, None, "timeout", UINT),
    ({"priority": "1"}, None, "priority", UINT),
    ({"priority": 2**64}, None, "priority", UINT),
    ({"binary_data_output": "true"}, None, "binary_data_output", BOOL),
    ({"sequence_start": "false"}, None, "sequence_start", BOOL),
    ({"sequence_end": 0}, None, "sequence_end", BOOL),
    ({"sequence_id": 1.5}, None, "sequence_id", "a non-negative integer or a string"),
    (None, [{"name": "logits", "parameters": {"classification": "2"}}], "classification", UINT),
], ids=lambda v: repr(v)[:40] if not isinstance(v, str) else v)
@promise(38)
def test_rest_parameters_of_the_wrong_type_are_400(daemon, parameters, outputs, name, kind, rel):
    r = _rest(daemon, parameters, outputs)
    rel.inputs += 1
    assert r.status_code == 400, (r.status_code, r.text)
    msg = r.json()["error"]
    assert f"parameter {name!r} must be {kind}" in msg, msg


def test_rest_parameters_of_their_type_still_work(daemon):
    """Well-typed values (0 where the protocol means "none": no timeout, default priority, no
    sequence) answer as they did, and so do parameters itif does not read (a client's own);
    binary_data_output true answers binary data."""
    for params in ({"timeout": 0}, {"timeout": 60_000_000, "priority": 0},
                   {"sequence_id": 0, "sequence_start": False, "sequence_end": False},
                   {"sequence_id": ""}, {"my_own": "anything"}):
        r = _rest(daemon, params)
        assert r.status_code == 200, (params, r.text)
    r = _rest(daemon, {"binary_data_output": True})
    assert r.status_code == 200 and "inference-header-content-length" in r.headers, r.headers
    r = _rest(daemon, None, [{"name": "logits", "parameters": {"classification": 0,
                                                               "binary_data": False}}])
    assert r.status_code == 200 and r.json()["outputs"][0]["data"], r.text


# ---- gRPC ---------------------------------------------------------------------------------------
def _param(**value) -> pb.InferParameter:
    return pb.InferParameter(**value)


def _grpc(d, parameters=None, output_parameters=None):
    ids = np.array([[5, 6, 7]], np.int64)
    req = pb.ModelInferRequest(
        model_name="acme",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64",
                                                      shape=[1, 3])],
        raw_input_contents=[ids.tobytes()],
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(
            name="logits", parameters=output_parameters or {})],
        parameters=parameters or {})
    with grpc.insecure_channel(d.addr) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelInfer(req, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)


@pytest.mark.parametrize(("parameters", "outputs", "name", "fields"), [
    ({"timeout": _param(string_param="5000000")}, None, "timeout",
     "int64_param or uint64_param"),
    ({"timeout": _param(double_param=5e6)}, None, "timeout", "int64_param or uint64_param"),
    ({"timeout": _param(bool_param=True)}, None, "timeout", "int64_param or uint64_param"),
    ({"timeout": _param(int64_param=-5)}, None, "timeout", "non-negative"),
    ({"priority": _param(string_param="1")}, None, "priority", "int64_param or uint64_param"),
    ({"sequence_start": _param(string_param="false")}, None, "sequence_start", "bool_param"),
    ({"sequence_id": _param(double_param=1.0)}, None, "sequence_id",
     "int64_param or uint64_param or string_param"),
    (None, {"classification": _param(bool_param=True)}, "classification",
     "int64_param or uint64_param"),
], ids=lambda v: str(v).replace("\n", " ")[:40])
@promise(38)
def test_grpc_parameters_of_the_wrong_type_are_invalid_argument(daemon, parameters, outputs,
                                                                 name, fields, rel):
    rel.inputs += 1
    with pytest.raises(grpc.RpcError) as e:
        _grpc(daemon, parameters, outputs)
    rel.saw(e.value.code())
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
    msg = e.value.details()
    assert f"parameter {name!r} must be" in msg and fields in msg, msg


def test_grpc_parameters_of_their_type_still_work(daemon):
    for params in ({"timeout": _param(int64_param=60_000_000)},
                   {"timeout": _param(uint64_param=0), "priority": _param(uint64_param=0)},
                   {"sequence_id": _param(string_param=""),
                    "sequence_start": _param(bool_param=False)},
                   {"my_own": _param(double_param=0.5)}):
        reply = _grpc(daemon, params)
        assert np.frombuffer(reply.raw_output_contents[0], "<f4").shape == (3,), params
    with pytest.raises(grpc.RpcError) as e:  # a 1 µs timeout is still a timeout
        _grpc(daemon, {"timeout": _param(int64_param=1)})
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, e.value
