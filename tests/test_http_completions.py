"""OpenAI-compatible ``/v1/completions`` (issue 16) against a real decoder daemon with HTTP on.

The daemon is the one of tests/test_generate_daemon.py (a tiny GPT-2 checkpoint directory with a
word-level tokenizer, tenants with random ``GPT2LMHeadModel`` weights), in process behind the
real gRPC servicer and the real HTTP server (uvicorn), both counted by one admission. Answers of
the official ``openai`` client, with and without ``stream=True``, and of plain httpx reading the
server-sent events, equal the gRPC Generate answer and ``GenEngine.generate`` for the same
request (greedy, beam search through ``extra_body``, sampling with a seed); bad requests get a
4xx naming the field; a client that disconnects, streaming or not, frees its cache blocks.
docs/ecosystem.md's completions snippet runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import threading
from pathlib import Path

import grpc
import pytest

from itif.client import Client
from itif.config import hash_token, parse_config
from itif.daemon import Daemon as InProcess
from itif.daemon import Identity
from itif.generation.api import GenerateRequest
from itif.metrics import Metrics
from itif.server._proto.itif.v1 import itif_pb2_grpc
from itif.server.admission import Admission
from itif.server.service import AuthInterceptor, ItifService
from tests.daemon_harness import ADMIN, free_port
from tests.doc_blocks import REPO, blocks
from tests.reliability_util import wait_until
from tests.test_generate_daemon import (
    VOCAB,
    hf_config,
    hf_model,
    upload_models,
    weights_bytes,
    write_backbone,
)
from tests.test_generate_daemon import config_text as gen_config_text

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

TOKENS = {"acme": "acme-secret-token", "beta": "beta-gen-token", "empty": "empty-gen-token"}
DOC_HTTP = "127.0.0.1:8000"


def config_text(backbone: str | Path, http: str, max_new_tokens: int = 2040,
                tenants: dict[str, str] = TOKENS) -> str:
    return gen_config_text(Path(backbone), http=http, max_new_tokens=max_new_tokens,
                           tokens=tenants)


@dataclasses.dataclass
class Served:
    daemon: InProcess
    port: int  # gRPC
    http: str  # host:port
    models: dict

    @property
    def gen(self):
        return self.daemon.generator

    def grpc(self, tenant: str = "acme") -> Client:
        return Client(f"127.0.0.1:{self.port}", TOKENS[tenant])

    def openai(self, tenant: str = "acme", token: str | None = None):
        return openai.OpenAI(base_url=f"http://{self.http}/v1", max_retries=0,
                             api_key=token or TOKENS[tenant])

    def post(self, body, token: str | None = TOKENS["acme"], timeout=60) -> httpx.Response:
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(f"http://{self.http}/v1/completions", content=content,
                          headers={**headers, "content-type": "application/json"},
                          timeout=timeout)


@contextlib.contextmanager
def servers(d: InProcess):
    """The real itif.v1 gRPC servicer (auth interceptor, admission) and the HTTP server
    (``server.http_listen``) over ``d``, on one event loop thread, sharing one admission;
    yields the gRPC port; stops the daemon at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        from itif.server.http import HttpServer

        admission = Admission(d)
        srv = grpc.aio.server(interceptors=[AuthInterceptor(d, admission)])
        itif_pb2_grpc.add_ItifServicer_to_server(ItifService(d), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        http = HttpServer(d, d.config, admission=admission)
        await http.start()
        return srv, port, http

    srv, port, http = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(5), loop).result(60)
        asyncio.run_coroutine_threadsafe(srv.stop(None), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        d.stop(0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("completions")
    backbone = write_backbone(root / "backbone")
    http = f"127.0.0.1:{free_port()}"
    d = InProcess(parse_config(config_text(backbone, http), root))
    d.metrics = Metrics(d, nvml=None)
    d.start()
    models = upload_models(d, root)
    with servers(d) as port:
        yield Served(d, port, http, models)


def idle(s: Served) -> bool:
    st = s.gen.cache_stats()
    return st["blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0 \
        and not s.daemon._generating


def _words(ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in ids)


# ---- answers equal Generate's -------------------------------------------------------------------
CASES = [  # (tenant, prompt, OpenAI arguments, the same request in Generate's words)
    ("acme", [5, 17, 42], dict(max_tokens=12), dict(max_new_tokens=12)),
    ("beta", "t7 t8 t9 t10", dict(max_tokens=9, temperature=0), dict(max_new_tokens=9)),
    ("acme", [[30]], dict(max_tokens=10, extra_body={"no_repeat_ngram_size": 3}),
     dict(max_new_tokens=10, no_repeat_ngram_size=3)),
    ("beta", [4, 40, 60], dict(max_tokens=9, n=2, extra_body={"num_beams": 3}),
     dict(max_new_tokens=9, num_beams=3, num_return_sequences=2)),
    ("acme", ["t11 t12"], dict(max_tokens=8, extra_body={"num_beams": 4, "early_stopping": "never",
                                                         "length_penalty": 0.5}),
     dict(max_new_tokens=8, num_beams=4, early_stopping="never", length_penalty=0.5)),
    ("beta", [3, 9], dict(max_tokens=10, temperature=0.8, seed=7, extra_body={"top_k": 20}),
     dict(max_new_tokens=10, do_sample=True, temperature=0.8, seed=7, top_k=20)),
    ("acme", [3, 9, 27], dict(max_tokens=7, top_p=0.9, seed=5, n=3,
                              extra_body={"do_sample": True}),
     dict(max_new_tokens=7, do_sample=True, top_p=0.9, seed=5, num_return_sequences=3)),
    ("acme", [5, 6, 7], dict(max_tokens=6, extra_body={"eos_token_id": VOCAB - 1}),
     dict(max_new_tokens=6, eos_token_id=VOCAB - 1)),
]


def _ids(prompt) -> list[int]:
    while isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [int(w[1:]) for w in prompt.split()]  # the word-level tokenizer: "t5" is 5
    return prompt


def _streamed(chunks) -> tuple[dict[int, dict], list]:
    """Per choice index: its chunks' text and token ids joined, its finish reasons; the chunks
    without choices (usage)."""
    out: dict[int, dict] = {}
    rest = []
    for chunk in chunks:
        if not chunk["choices"]:
            rest.append(chunk)
        for c in chunk["choices"]:
            o = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish": [],
                                            "chunks": 0})
            o["text"] += c["text"]
            o["token_ids"] += c["token_ids"]
            o["chunks"] += 1
            if c["finish_reason"] is not None:
                o["finish"].append(c["finish_reason"])
    return out, rest


def test_openai_client_equals_generate(served):
    """Every case through the openai client, plain and streamed, and through gRPC Generate:
    the choices are Generate's sequences (ids, text, finish reason, beam score) and those of
    GenEngine.generate; the streamed chunks add up to the plain answer; usage counts tokens."""
    # an absent top_k is off here (as OpenAI samples); Generate's unset top_k is generate()'s 50
    cases = [(t, p, kw, {**g, "top_k": 0} if g.get("do_sample") and "top_k" not in g else g)
             for t, p, kw, g in CASES]
    want = served.gen.generate([GenerateRequest(t, _ids(p), **g) for t, p, _, g in cases])
    for i, (tenant, prompt, kw, gen_kw) in enumerate(cases):
        oa = served.openai(tenant)
        plain = oa.completions.create(model=tenant, prompt=prompt, **kw).to_dict()
        with served.grpc(tenant) as c:
            result = c.generate(tenant, _ids(prompt), timeout=60, **gen_kw)
        seqs = [list(s.ids) for s in result.sequences]
        assert seqs == want[i].sequences, i
        assert plain["object"] == "text_completion" and plain["model"] == tenant
        assert plain["id"].startswith("cmpl-") and isinstance(plain["created"], int)
        choices = plain["choices"]
        assert [c["index"] for c in choices] == list(range(len(seqs)))
        assert [c["token_ids"] for c in choices] == seqs, i
        assert [c["text"] for c in choices] == [s.text for s in result.sequences], i
        assert [c["text"] for c in choices] == [_words(s) for s in seqs]
        assert [c["finish_reason"] for c in choices] == [
            {"eos": "stop", "length": "length"}[s.finish_reason] for s in result.sequences]
        assert all(c["logprobs"] is None for c in choices)
        if gen_kw.get("num_beams", 1) > 1:
            assert [c["score"] for c in choices] == pytest.approx(
                [s.score for s in result.sequences], abs=1e-6)
        else:
            assert all("score" not in c for c in choices)
        made = sum(len(s) for s in seqs)
        assert plain["usage"] == {"prompt_tokens": len(_ids(prompt)), "completion_tokens": made,
                                  "total_tokens": len(_ids(prompt)) + made}

        chunks = [c.to_dict() for c in oa.completions.create(
            model=tenant, prompt=prompt, stream=True, stream_options={"include_usage": True},
            **kw)]
        joined, rest = _streamed(chunks)
        assert sorted(joined) == list(range(len(seqs)))
        for j, c in enumerate(choices):
            assert joined[j]["text"] == c["text"] and joined[j]["token_ids"] == c["token_ids"]
            assert joined[j]["finish"] == [c["finish_reason"]]  # once, in the last chunk
        if len(seqs) == 1 and gen_kw.get("num_beams", 1) == 1:  # as decided, token by token
            assert joined[0]["chunks"] >= len(seqs[0]), (i, joined[0])
        else:  # beams (and several samples) at the end: one chunk each
            assert all(joined[j]["chunks"] == 1 for j in joined), i
        assert [r["usage"] for r in rest] == [plain["usage"]]
        assert all(ch["id"] == chunks[0]["id"] for ch in chunks)
    wait_until(lambda: idle(served), what="every sequence to leave the batch")


def test_plain_http_server_sent_events(served):
    """httpx reading the event stream: text/event-stream, one ``data:`` event per token, then
    the finish chunk and ``[DONE]``; the text adds up to the non-streamed answer."""
    body = {"model": "acme", "prompt": "t5 t17 t42", "max_tokens": 6,
            "eos_token_id": VOCAB - 1}
    plain = served.post(body).json()
    with httpx.stream("POST", f"http://{served.http}/v1/completions",
                      json={**body, "stream": True}, timeout=60,
                      headers={"authorization": f"Bearer {TOKENS['acme']}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert len(chunks) == 6 + 1  # six tokens, then the finish chunk
    assert all(len(c["choices"]) == 1 and c["object"] == "text_completion" for c in chunks)
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1] * 6 + [0]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert "usage" not in chunks[-1]  # without stream_options.include_usage


# ---- refusals ----------------------------------------------------------------------------------
BAD = [  # (body changes, HTTP status, how the message starts)
    (dict(model=None), 400, "model:"),
    (dict(model=5), 400, "model: must be a string"),
    (dict(model="nobody"), 404, "tenant 'nobody' not found"),
    (dict(model="beta"), 404, "tenant 'beta' not found"),  # another tenant's: the same answer
    (dict(prompt=None), 400, "prompt: is required"),
    (dict(prompt=[]), 400, "prompt: is empty"),
    (dict(prompt=""), 400, "prompt: is empty"),
    (dict(prompt=5), 400, "prompt: must be"),
    (dict(prompt=["t1", "t2"]), 400, "prompt: 2 prompts in one call are not supported"),
    (dict(prompt=[[1], [2]]), 400, "prompt: 2 prompts in one call are not supported"),
    (dict(prompt=[1, "t2"]), 400, "prompt: must be"),
    (dict(prompt=[5, VOCAB]), 400, "prompt: token id 96 outside the vocabulary"),
    (dict(prompt=[-1]), 400, "prompt: token id -1 outside the vocabulary"),
    (dict(prompt=[True]), 400, "prompt: must be"),
    (dict(max_tokens=0), 400, "max_tokens: must be at least 1"),
    (dict(max_tokens=2041), 400, "max_tokens: 2041 is over the limit 2040"),
    (dict(max_tokens="5"), 400, "max_tokens: must be an integer, got a string"),
    (dict(max_tokens=2.5), 400, "max_tokens: must be an integer"),
    (dict(temperature=-1), 400, "temperature: must be 0"),
    (dict(temperature="hot"), 400, "temperature: must be a number"),
    (dict(top_p=0.9), 400, "top_p: is set (0.9) but do_sample is false (temperature 0"),
    (dict(seed=3), 400, "seed: is set (3) but do_sample is false"),
    (dict(n=2), 400, "n: greedy search returns one sequence"),
    (dict(n=0), 400, "n: must be at least 1"),
    (dict(n=3, num_beams=2), 400, "n: 3 is more than num_beams 2"),
    (dict(num_beams=0), 400, "num_beams: must be in [1, 16]"),
    (dict(num_beams=17), 400, "num_beams: must be in [1, 16]"),
    (dict(temperature=0.7, num_beams=2), 400, "num_beams: sampling with num_beams > 1"),
    (dict(do_sample=True, temperature=0), 400, "temperature: must be in [1e-06, 1e+06]"),
    (dict(temperature=1e308), 400, "temperature: must be in [1e-06, 1e+06], got 1e+308"),
    (dict(num_beams=2, length_penalty=1e308), 400, "length_penalty: 1e+308 with max_new_tokens 3"),
    (dict(temperature=0.7, top_p=1.5), 400, "top_p: must be in [0, 1]"),
    (dict(temperature=0.7, top_k=-1), 400, "top_k: must be 0 (off) or more"),
    (dict(top_k=5), 400, "top_k: is set (5) but do_sample is false"),
    (dict(early_stopping="sometimes"), 400, "early_stopping: must be true, false or"),
    (dict(no_repeat_ngram_size=-1), 400, "no_repeat_ngram_size: must be 0"),
    (dict(eos_token_id=VOCAB), 400, "eos_token_id: 96 outside the vocabulary"),
    (dict(echo=True), 400, "echo: echoing the prompt is not supported"),
    (dict(logprobs=1), 400, "logprobs: log probabilities are not returned"),
    (dict(stop=["\n"]), 400, "stop: stop sequences are not supported"),
    (dict(suffix="x"), 400, "suffix: is not supported"),
    (dict(best_of=3), 400, "best_of: is not supported"),
    (dict(presence_penalty=0.5), 400, "presence_penalty: is not supported"),
    (dict(logit_bias={"5": 1}), 400, "logit_bias: is not supported"),
    (dict(stream="yes"), 400, "stream: must be a boolean"),
    (dict(stream_options={"include_usage": "x"}), 400, "stream_options: only include_usage"),
    (dict(temperatur=0.5), 400, "temperatur: unknown parameter"),
]


def test_bad_requests_get_4xx_naming_the_field(served):
    base = {"model": "acme", "prompt": [5, 6], "max_tokens": 3}
    for change, status, start in BAD:
        body = {k: v for k, v in {**base, **change}.items() if v is not None}
        for stream in (False, True):
            r = served.post({**body, "stream": stream} if "stream" not in change else body)
            assert r.status_code == status, (change, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"].startswith(start), (change, err)
            if status == 400:
                assert err["type"] == "invalid_request_error"
                assert err["param"] == start.split(":")[0], (change, err)
            else:
                assert err["code"] == "model_not_found" and err["param"] is None
    # neutral values of the unsupported parameters are accepted
    ok = {**base, "echo": False, "logprobs": None, "suffix": "", "stop": [], "best_of": 1,
          "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u",
          "stream_options": {"include_usage": False}}
    assert served.post(ok).status_code == 200
    for body, token, start in (
            (b"{not json", "acme", "the request body is not valid JSON"),
            (b"[1, 2]", "acme", "the request body must be a JSON object"),
            ({**base, "model": "empty"}, "empty", "tenant 'empty' has no ready weights")):
        r = served.post(body, token=TOKENS[token])
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(start), r.text
        assert r.json()["error"]["param"] is None
    assert served.post(base, token=None).status_code == 401
    assert served.post(base, token="wrong").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        served.openai(token="wrong").completions.create(model="acme", prompt=[5], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        served.openai().completions.create(model="beta", prompt=[5], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        served.openai().completions.create(model="acme", prompt=[5], max_tokens=2,
                                           extra_body={"num_beams": 0})
    assert e.value.body["param"] == "num_beams"
    assert idle(served)


# ---- leaving early frees the work --------------------------------------------------------------
LONG = {"model": "acme", "prompt": [5, 6, 7], "max_tokens": 2000, "eos_token_id": VOCAB - 1}


def test_hostile_bodies_get_400_and_never_hold_a_slot(served):
    """A review's reproductions. A lone surrogate in an unknown parameter's name made the error
    answer itself fail (500), which skipped the release of the call's admission slot: after
    128 such calls (the tenant's max_inflight) every call of the tenant, over HTTP and gRPC,
    answered 429 until a restart. A lone surrogate in a prompt was a 500; a 2**64 seed aliased
    another seed; a prompt of millions of ids was checked element by element on the event
    loop before it was refused."""
    from itif.server.http.common import MAX_LIST  # noqa: PLC0415

    bad = json.dumps({"model": "acme", "prompt": [5], "max_tokens": 2, "\ud800": 1})
    for _ in range(140):  # over max_inflight (2 x max_queue = 128)
        r = served.post(bad)
        assert r.status_code == 400 and "unknown parameter" in r.text, r.text
    assert served.post({"model": "acme", "prompt": [5, 6], "max_tokens": 2}).status_code == 200
    r = served.post(json.dumps({"model": "acme", "prompt": "w5 \ud800", "max_tokens": 2}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("prompt: not valid Unicode"), r.text
    for seed in (2**63, -2**63 - 1, 2**64):
        r = served.post({"model": "acme", "prompt": [5], "max_tokens": 2, "seed": seed})
        assert r.status_code == 400 and "seed: must be a 64-bit integer" in r.text, r.text
    r = served.post({"model": "acme", "prompt": [5] * (MAX_LIST + 1), "max_tokens": 2})
    assert r.status_code == 400 and f"over the {MAX_LIST}" in r.text, r.text[:200]
    # a text no tokenizer could fit in the positions is refused before it is tokenized
    from itif.requests import TEXT_CHARS_PER_POSITION  # noqa: PLC0415

    limit = TEXT_CHARS_PER_POSITION * served.daemon.generator.spec.max_position
    r = served.post({"model": "acme", "prompt": "t5 " * (limit // 3 + 1), "max_tokens": 2})
    assert r.status_code == 400, r.text[:200]
    assert r.json()["error"]["message"].startswith(f"prompt: {3 * (limit // 3 + 1)} characters, "
                                                   f"over the {limit}"), r.text[:200]


def test_a_disconnecting_client_frees_its_sequences_and_cache_blocks(served):
    """A long generation holds KV cache blocks while it streams; the client closing the
    connection mid-stream cancels it in the GenEngine (freed at its next step, long before the
    2000 tokens), and so does a client that gives up on a non-streamed answer."""
    wait_until(lambda: idle(served), what="an idle engine")
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"http://{served.http}/v1/completions", json={**LONG, "stream": True},
                      headers={"authorization": f"Bearer {TOKENS['acme']}"}) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["text"]
            held = served.gen.cache_stats()
            assert held["blocks_used"] > 0 and held["running"] == 1, held
        # the response closed before its end: httpx drops the connection
    wait_until(lambda: idle(served), timeout=3, what="the disconnected stream's blocks")

    with pytest.raises(httpx.ReadTimeout):  # non-streamed: the client gives up and hangs up
        served.post(LONG, timeout=httpx.Timeout(30, read=0.5))
    wait_until(lambda: idle(served), timeout=3, what="the abandoned call's blocks")
    # and the engine still serves
    assert served.post({**LONG, "max_tokens": 3}).json()["usage"]["completion_tokens"] == 3


# ---- metrics ------------------------------------------------------------------------------------
def test_completions_are_counted_like_generate(served):
    reg = served.daemon.metrics.registry

    def value(name: str, **labels) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    tokens0 = value("itif_generated_tokens_total", tenant="acme")
    first0 = value("itif_generation_time_to_first_token_seconds_count", tenant="acme")
    calls0 = value("itif_http_requests_total", tenant="acme", api="openai",
                   method="completions", code="200")
    made = 0
    for extra in ({}, {"num_beams": 2}, {"stream": True}):
        r = served.post({"model": "acme", "prompt": [7, 8], "max_tokens": 5,
                         "eos_token_id": VOCAB - 1, **extra})
        assert r.status_code == 200
        made += 5
    assert value("itif_generated_tokens_total", tenant="acme") - tokens0 == made
    assert value("itif_generation_time_to_first_token_seconds_count", tenant="acme") - first0 == 3
    assert value("itif_http_requests_total", tenant="acme", api="openai", method="completions",
                 code="200") - calls0 == 3


# ---- other backbones ---------------------------------------------------------------------------
def test_without_a_tokenizer_and_on_an_encoder_daemon(tmp_path):
    """A decoder tenant without a tokenizer: token-id prompts answer ``text: ""`` with the ids in
    ``token_ids``; a string prompt is 400. An encoder daemon answers 400, naming the decoder."""
    backbone = tmp_path / "bare"
    backbone.mkdir()
    (backbone / "config.json").write_text(json.dumps(hf_config()))  # no tokenizer.json
    http = f"127.0.0.1:{free_port()}"
    d = InProcess(parse_config(config_text(backbone, http, 64, {"acme": TOKENS["acme"]}),
                               tmp_path))
    d.start()
    data = weights_bytes(hf_model(1), tmp_path)
    d.upload(Identity(None, admin=True), "acme", hashlib.sha256(data).hexdigest(), len(data),
             [data])
    s = Served(d, 0, http, {})
    with servers(d) as port:
        s.port = port
        r = s.post({"model": "acme", "prompt": [5, 17, 42], "max_tokens": 5})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        with s.grpc() as c:
            want = c.generate("acme", [5, 17, 42], max_new_tokens=5, timeout=60).sequences[0]
        assert choice["text"] == "" and choice["token_ids"] == list(want.ids)
        r = s.post({"model": "acme", "prompt": "t5 t17", "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "prompt: model 'acme' ships no tokenizer"), r.text

    http = f"127.0.0.1:{free_port()}"
    enc = InProcess(parse_config(
        f"server:\n  listen: 127.0.0.1:0\n  http_listen: {http}\n  data_dir: ./enc\n"
        f"  admin_token_sha256: {hash_token(ADMIN)}\n"
        "backbone:\n  config: bert-tiny\n  device: cpu\n"
        f"tenants:\n  - id: acme\n    token_sha256: {hash_token(TOKENS['acme'])}\n", tmp_path))
    enc.start()
    with servers(enc):
        r = Served(enc, 0, http, {}).post({"model": "acme", "prompt": [5], "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "needs a decoder backbone" in r.json()["error"]["message"]
        r = Served(enc, 0, http, {}).post({"model": "nobody", "prompt": [5]})
        assert r.status_code == 404, r.text


# ---- the documented snippet ---------------------------------------------------------------------
def test_documented_completions_snippet(served, capsys):
    (text,) = [b.text for b in blocks(REPO / "docs/ecosystem.md")
               if b.lang == "python" and "completions.create" in b.text]
    assert "from openai import" not in text  # tests/test_http.py runs that one block
    exec(compile(text.replace(DOC_HTTP, served.http), "docs/ecosystem.md[completions]", "exec"),
         {})
    out = capsys.readouterr().out.splitlines()
    first = out[0].split()
    assert first[-2] in ("stop", "length") and int(first[-1]) >= 1
    assert out[1].startswith("t")  # the streamed words
    beams = eval(out[2])  # noqa: S307 - [(text, score), (text, score)]
    assert len(beams) == 2 and all(isinstance(score, float) for _, score in beams)
