"""Generate through the daemon (issue 13 item 5): the itif.v1 ``Generate`` stream, ``itif
generate``, the generation settings, metrics, and freeing a call's work when it ends early.

The backbone is a tiny GPT-2 checkpoint directory written here (a Hugging Face config.json with
2048 positions, so a long generation lasts long enough to be cut off, and a word-level
tokenizer.json: text in and out). Tenants upload random-initialised ``GPT2LMHeadModel`` weights;
the GenEngine's own ``generate`` and Hugging Face ``generate()`` with the tenant's model are the
oracles. Most tests share one in-process daemon behind the real gRPC servicer, auth and
admission (``served``); the last one runs a real ``itif serve`` (upload, the documented
``itif generate`` commands, restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from itif.client import Client
from itif.config import hash_token, parse_config
from itif.daemon import Daemon as InProcess
from itif.daemon import Identity
from itif.errors import Unimplemented
from itif.generation.api import GenerateRequest
from itif.metrics import Metrics
from itif.safetensors_io import save_safetensors
from itif.server import kserve
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc
from itif.server.admission import Admission
from itif.server.service import AuthInterceptor, ItifService
from tests.daemon_harness import ADMIN, Daemon
from tests.reliability_util import error_of, wait_until

transformers = pytest.importorskip("transformers")

C = grpc.StatusCode
VOCAB, EOS, BOS = 96, 2, 1
TOKENS = {"acme": "acme-gen-token", "beta": "beta-gen-token", "empty": "empty-gen-token"}


# ---- the backbone, the tenants' models ---------------------------------------------------------
def hf_config() -> dict:
    from itif.generation.spec import PRESETS

    cfg = PRESETS["gpt2-tiny"].hf_config()
    cfg.update(n_positions=2048, vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS)
    return cfg


def write_backbone(root: Path) -> Path:
    """A GPT-2 checkpoint directory without weights: config.json and a word-level tokenizer
    (``t0`` .. ``t95``; text "t5 t17" is ids [5, 17])."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config()))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root


def hf_model(seed: int):
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config())).eval()
    with torch.no_grad():  # larger logits than the default init: varied, decisive choices
        model.lm_head.weight.mul_(8.0)
    return model


def weights_bytes(model, tmp: Path) -> bytes:
    path = tmp / "w.safetensors"
    save_safetensors({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                     path)
    return path.read_bytes()


def hf_generate(model, ids: list[int], **kw) -> tuple[list[list[int]], list[float] | None]:
    """Hugging Face generate(): the new tokens of each returned sequence, cut after its first
    end token (what follows is padding), and the beam scores."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pad_token_id=EOS,
            return_dict_in_generate=True,
            output_scores=True,
            **kw,
        )
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        seqs.append(row[:row.index(EOS) + 1] if EOS in row else row)
    scores = getattr(out, "sequences_scores", None)
    return seqs, None if scores is None else scores.tolist()


# ---- an in-process daemon behind the real servicer --------------------------------------------
@dataclasses.dataclass
class Served:
    daemon: InProcess
    port: int
    models: dict
    root: Path

    def client(self, tenant: str = "acme") -> Client:
        return Client(f"127.0.0.1:{self.port}", TOKENS[tenant])

    @property
    def gen(self):
        return self.daemon.generator


def config_text(backbone: Path, data: str = "./data", listen: str = "127.0.0.1:0",
                max_new_tokens: int = 2040, http: str | None = None,
                tokens: dict[str, str] = TOKENS) -> str:
    tenants = "".join(f"  - id: {t}\n    token_sha256: {hash_token(tok)}\n"
                      for t, tok in tokens.items())
    http_line = f"  http_listen: {http}\n" if http else ""
    return (f"server:\n  listen: {listen}\n{http_line}  data_dir: {data}\n"
            f"  admin_token_sha256: {hash_token(ADMIN)}\n  max_new_tokens: {max_new_tokens}\n"
            f"backbone:\n  config: {backbone}\n  device: cpu\n  dtype: float32\n"
            f"  kv_cache_bytes: 8MiB\ntenants:\n{tenants}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen-daemon")
    backbone = write_backbone(root / "backbone")
    d = InProcess(parse_config(config_text(backbone), root))
    d.metrics = Metrics(d, nvml=None)
    d.start()
    models = upload_models(d, root)
    with grpc_server(d) as port:
        yield Served(d, port, models, root)


def upload_models(d: InProcess, root: Path) -> dict:
    """Tenants acme and beta (distinct random models) uploaded to the started daemon ``d``."""
    models = {"acme": hf_model(1), "beta": hf_model(2)}
    admin = Identity(None, admin=True)
    for tenant, model in models.items():
        data = weights_bytes(model, root)
        d.upload(admin, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])
    return models


@contextlib.contextmanager
def grpc_server(d: InProcess):
    """The real itif.v1 servicer with its auth interceptor and admission over ``d`` on an
    in-process grpc.aio server; yields its port; stops the daemon at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        srv = grpc.aio.server(interceptors=[AuthInterceptor(d, Admission(d))])
        itif_pb2_grpc.add_ItifServicer_to_server(ItifService(d), srv)
        kserve.add_to_server(d, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        return srv, port

    srv, port = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(None), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        d.stop(0)


def idle(s: Served) -> bool:
    st = s.gen.cache_stats()
    return st["blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0 \
        and not s.daemon._generating


# ---- streaming and equality --------------------------------------------------------------------
CASES = [  # (tenant, ids, parameters)
    ("acme", [5, 17, 42], dict(max_new_tokens=12)),
    ("beta", [7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=20)),
    ("acme", [30], dict(max_new_tokens=10, no_repeat_ngram_size=3)),
    ("beta", [4, 40, 60], dict(max_new_tokens=9, num_beams=3, num_return_sequences=2)),
    ("acme", [11, 12], dict(max_new_tokens=8, num_beams=4, early_stopping="never",
                            length_penalty=0.5)),
    ("acme", [11, 12], dict(max_new_tokens=8, num_beams=2, early_stopping=True)),
    ("beta", [3, 9], dict(max_new_tokens=10, do_sample=True, seed=7, top_k=20, temperature=0.8)),
    ("acme", [3, 9, 27], dict(max_new_tokens=7, do_sample=True, seed=5, top_p=0.9,
                              num_return_sequences=3)),
]


def _request(tenant: str, ids: list[int], params: dict) -> GenerateRequest:
    """The engine's request for a Generate call of ``params`` (unset top_k when sampling:
    generate()'s 50, as the API gives it)."""
    if params.get("do_sample") and "top_k" not in params:
        params = {**params, "top_k": 50}
    return GenerateRequest(tenant, ids, **params)


def test_stream_equals_engine_generate_and_hugging_face(served):
    """Every case through one Generate stream each, all at once: token messages (greedy and
    sampling only) come first, in order, and add up to the final sequence; the result comes
    last, once; sequences and scores equal GenEngine.generate for the same requests, and greedy
    and beam search equal Hugging Face generate() with the tenant's model."""
    got: dict[int, list] = {}

    def call(i: int, tenant: str, ids: list[int], params: dict) -> None:
        with served.client(tenant) as c:
            got[i] = list(c.generate_stream(tenant, ids, timeout=120, **params))

    threads = [threading.Thread(target=call, args=(i, *case)) for i, case in enumerate(CASES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    want = served.gen.generate([_request(*case) for case in CASES])
    for i, (tenant, ids, params) in enumerate(CASES):
        msgs = got[i]
        kinds = [m.WhichOneof("event") for m in msgs]
        assert kinds.count("result") == 1 and kinds[-1] == "result", kinds
        result = msgs[-1].result
        seqs = [list(s.ids) for s in result.sequences]
        assert seqs == want[i].sequences, (i, seqs, want[i].sequences)
        if want[i].scores is None:
            assert not any(s.HasField("score") for s in result.sequences)
        else:
            assert [s.score for s in result.sequences] == pytest.approx(want[i].scores, abs=1e-6)
        assert [s.finish_reason for s in result.sequences] == want[i].finish_reasons
        assert result.weights_sha256 == served.daemon.status[tenant].sha256
        streamed = [m.tokens for m in msgs[:-1]]
        if params.get("num_beams", 1) > 1 or params.get("num_return_sequences", 1) > 1:
            assert streamed == [], i  # beams (and samples) of several sequences come at the end
            continue
        assert len(streamed) >= 2, i  # token by token, not all at once
        assert [t for m in streamed for t in m.ids] == seqs[0], i
        # the word-level tokenizer's text, piece by piece, is the final text
        assert "".join(m.text for m in streamed).strip() == result.sequences[0].text
        assert result.sequences[0].text == " ".join(f"t{t}" for t in seqs[0])
        if not params.get("do_sample"):
            hf = {k: v for k, v in params.items() if k != "seed"}
            assert seqs == hf_generate(served.models[tenant], ids, **hf)[0], i
    for i, (tenant, ids, params) in enumerate(CASES):
        if params.get("num_beams", 1) > 1:
            hseqs, hscores = hf_generate(served.models[tenant], ids, **params)
            assert [list(s.ids) for s in got[i][-1].result.sequences] == hseqs, i
            assert [s.score for s in got[i][-1].result.sequences] == pytest.approx(
                hscores, abs=1e-4
            )
    wait_until(lambda: idle(served), what="every sequence to leave the batch")


def test_text_in_and_out(served):
    """--text goes through the backbone's tokenizer; the sequences come back decoded."""
    with served.client() as c:
        by_text = c.generate("acme", text="t5 t17 t42", max_new_tokens=6, timeout=60)
        by_ids = c.generate("acme", [5, 17, 42], max_new_tokens=6, timeout=60)
    assert list(by_text.sequences[0].ids) == list(by_ids.sequences[0].ids)
    assert by_text.sequences[0].text == " ".join(f"t{t}" for t in by_ids.sequences[0].ids)
    # a text no tokenizer could fit in the 2048 positions: refused before it is tokenized
    from itif.requests import TEXT_CHARS_PER_POSITION

    with served.client() as c:
        code, msg = error_of(lambda: c.generate(
            "acme", text="t5 " * (TEXT_CHARS_PER_POSITION * 2048 // 3 + 1), timeout=60))
    assert code == C.INVALID_ARGUMENT and msg.startswith("text: ") and "characters" in msg, msg


def test_cli_generate_text_json_and_errors(served, capsys):
    """``itif generate --text``: one JSON line per token message, then the result; a bad
    parameter exits 1 with ``error: INVALID_ARGUMENT: <field>: ...``."""
    from itif.cli import main

    base = ["generate", "--server", f"127.0.0.1:{served.port}", "--token", TOKENS["acme"],
            "--tenant", "acme"]
    assert main(base + ["--text", "t5 t17 t42", "--max-new-tokens", "5", "--eos-token-id",
                        str(VOCAB - 1), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    *tokens, final = lines
    assert len(tokens) == 5 and all(len(t["ids"]) == 1 for t in tokens)
    (seq,) = final["sequences"]
    assert seq["ids"] == [t["ids"][0] for t in tokens] and seq["finish_reason"] == "length"
    assert seq["text"] == "".join(t["text"] for t in tokens).strip()
    with served.client() as c:
        assert list(c.generate("acme", [5, 17, 42], max_new_tokens=5, eos_token_id=VOCAB - 1,
                               timeout=60).sequences[0].ids) == seq["ids"]
    assert main(base + ["--ids", "5,6", "--num-beams", "0"]) == 1
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: num_beams:")


def test_sampling_is_reproducible_for_a_seed(served):
    with served.client("beta") as c:
        a = c.generate("beta", [3, 9], max_new_tokens=12, do_sample=True, seed=11, timeout=60)
        b = c.generate("beta", [3, 9], max_new_tokens=12, do_sample=True, seed=11, timeout=60)
        others = [c.generate("beta", [3, 9], max_new_tokens=12, do_sample=True, seed=s,
                             timeout=60) for s in (12, 13, 14)]
    assert list(a.sequences[0].ids) == list(b.sequences[0].ids)
    assert any(list(o.sequences[0].ids) != list(a.sequences[0].ids) for o in others)


def test_an_unset_top_k_samples_as_generate_does(served):
    """The proto promises generate()'s default for every unset field; generate() samples among
    the 50 likeliest tokens (top_k 50) when nothing sets top_k, itif sampled from the whole
    vocabulary (an audit: 116 of 300 first tokens ranked 50th or lower, HF 0). At temperature
    100 (a nearly flat distribution) an unset top_k keeps every first token in the top 50;
    top_k 0 turns it off."""
    from itif.server.generate import to_request

    msg = itif_pb2.GenerateRequest(tenant="beta", do_sample=True)
    msg.input_ids.ids.extend([3, 9])
    assert to_request(msg)[0].top_k == 50
    msg.top_k = 0
    assert to_request(msg)[0].top_k == 0
    with torch.no_grad():
        logits = served.models["beta"](torch.tensor([[3, 9]])).logits[0, -1]
    top50 = set(torch.topk(logits, 50).indices.tolist())
    firsts: dict[str, set] = {"unset": set(), "off": set()}
    with served.client("beta") as c:
        for seed in range(40):
            for kind, extra in (("unset", {}), ("off", {"top_k": 0})):
                r = c.generate("beta", [3, 9], max_new_tokens=1, do_sample=True, seed=seed,
                               temperature=100.0, timeout=60, **extra)
                firsts[kind].add(r.sequences[0].ids[0])
    assert firsts["unset"] <= top50, firsts["unset"] - top50
    assert firsts["off"] - top50  # off: tokens past the 50th are drawn too


def test_encoder_decoder_tenant_through_generate(tmp_path):
    """A BART daemon (a checkpoint directory whose config carries the generation settings:
    decoder start, eos, pad, forced eos): greedy and beam search through Generate equal
    GenEngine.generate and Hugging Face generate(); the sequences leave out the decoder start
    token."""
    from itif.generation.spec import PRESETS

    cfg = PRESETS["bart-tiny"].hf_config()
    cfg.update(bos_token_id=0, eos_token_id=EOS, pad_token_id=1, decoder_start_token_id=EOS,
               forced_eos_token_id=EOS)
    (tmp_path / "bart").mkdir()
    (tmp_path / "bart" / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(3)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(**cfg)).eval()
    d = InProcess(parse_config(config_text(tmp_path / "bart", max_new_tokens=32), tmp_path))
    d.start()
    data = weights_bytes(model, tmp_path)
    d.upload(Identity(None, admin=True), "acme", hashlib.sha256(data).hexdigest(), len(data),
             [data])
    # (a random BART repeats its start token, the eos: greedy ends at once unless eos is moved)
    cases = [dict(max_new_tokens=10, eos_token_id=VOCAB - 1),
             dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, no_repeat_ngram_size=2)]
    src = [0, 17, 42, 9, 2]
    with grpc_server(d) as port, Client(f"127.0.0.1:{port}", TOKENS["acme"]) as c:
        got = [c.generate("acme", src, timeout=60, **kw) for kw in cases]
        want = d.generator.generate([GenerateRequest("acme", src, **kw) for kw in cases])
    for g, w, kw in zip(got, want, cases):
        seqs = [list(s.ids) for s in g.sequences]
        assert seqs == w.sequences
        with torch.no_grad():
            out = model.generate(torch.tensor([src]), attention_mask=torch.ones(1, len(src),
                                 dtype=torch.long), **kw)
        hf = []
        for row in out[:, 1:].tolist():  # without the decoder start token and the padding
            while row and row[-1] == cfg["pad_token_id"]:
                row.pop()
            hf.append(row)
        assert seqs == hf, (kw, seqs, hf)
        assert all(len(s) >= 3 for s in seqs), seqs  # more than an immediate end


# ---- refusals ----------------------------------------------------------------------------------
BAD = [  # (what the request says, the field the refusal names)
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=17), "num_beams"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2041), "max_new_tokens"),  # over server.max_new_tokens (2040)
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=10**7), "max_new_tokens"),  # not a reply-size RESOURCE_EXHAUSTED
    (dict(num_return_sequences=10**6), "num_return_sequences"),  # greedy: likewise
    # more KV cache than the whole pool (8 MiB): never fits, so not a retryable overload
    (dict(do_sample=True, num_return_sequences=600, max_new_tokens=40), "num_return_sequences"),
    (dict(temperature=0.5), "temperature"),  # without do_sample
    (dict(top_k=5), "top_k"),
    (dict(top_p=0.9), "top_p"),
    (dict(seed=3), "seed"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(do_sample=True, top_p=-0.1), "top_p"),
    (dict(do_sample=True, top_k=-1), "top_k"),
    (dict(do_sample=True, num_beams=2), "num_beams"),  # beam sampling is not served
    (dict(num_return_sequences=2), "num_return_sequences"),  # greedy returns one
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(num_return_sequences=0), "num_return_sequences"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(length_penalty=math.inf), "length_penalty"),
    (dict(eos_token_id=VOCAB), "eos_token_id"),
    (dict(ids=[]), "input_ids"),
    (dict(ids=[5, VOCAB]), "input_ids"),
    (dict(ids=[-1]), "input_ids"),
    (dict(ids=list(range(1, 60)) * 34, max_new_tokens=50), "max_new_tokens"),  # past 2048 positions
    (dict(ids=list(range(1, 60)) * 35), "input_ids"),  # the prompt alone is past them
    # more samples than the whole KV cache holds: not RESOURCE_EXHAUSTED for the reply's size
    (dict(do_sample=True, num_return_sequences=100000, max_new_tokens=20), "num_return_sequences"),
]


def test_bad_parameters_are_invalid_argument_naming_the_field(served):
    with served.client() as c:
        for params, field in BAD:
            params = dict(params)
            ids = params.pop("ids", [5, 6])
            code, msg = error_of(lambda: c.generate("acme", ids, timeout=30, **params))
            assert code == C.INVALID_ARGUMENT, (params, code, msg)
            assert msg.startswith(f"{field}:"), (params, msg)
        bad_enum = itif_pb2.GenerateRequest(tenant="acme", early_stopping=7)
        bad_enum.input_ids.ids.extend([5, 6])
        code, msg = error_of(lambda: c.stub.Generate(bad_enum, metadata=c.metadata,
                                                     timeout=30).next())
        assert code == C.INVALID_ARGUMENT and msg.startswith("early_stopping:"), (code, msg)
        code, msg = error_of(lambda: c.stub.Generate(itif_pb2.GenerateRequest(tenant="acme"),
                                                     metadata=c.metadata, timeout=30).next())
        assert code == C.INVALID_ARGUMENT and msg.startswith("input:"), (code, msg)
    assert idle(served)


def test_tenants_auth_and_the_wrong_call(served):
    with served.client() as c:
        for tenant in ("nobody", "beta"):  # unknown, and another tenant's: the same answer
            code, msg = error_of(lambda: c.generate(tenant, [5], timeout=30))
            assert code == C.NOT_FOUND and "not found" in msg, (tenant, code, msg)
        code, msg = error_of(lambda: c.infer("acme", [5, 6], timeout=30))
        assert code == C.UNIMPLEMENTED and "Generate" in msg, (code, msg)
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        triton = service_pb2_grpc.GRPCInferenceServiceStub(c.channel)
        infer = service_pb2.ModelInferRequest(model_name="acme", inputs=[
            service_pb2.ModelInferRequest.InferInputTensor(
                name="input_ids", datatype="INT64", shape=[1, 2],
                contents=service_pb2.InferTensorContents(int64_contents=[5, 6]))])
        for call in (lambda: triton.ModelMetadata(service_pb2.ModelMetadataRequest(name="acme"),
                                                  metadata=c.metadata, timeout=30),
                     lambda: triton.ModelInfer(infer, metadata=c.metadata, timeout=30)):
            code, msg = error_of(call)
            assert code == C.UNIMPLEMENTED and "Generate" in msg, (code, msg)
    with served.client("empty") as c:
        code, _ = error_of(lambda: c.generate("empty", [5], timeout=30))
        assert code == C.FAILED_PRECONDITION
    with Client(f"127.0.0.1:{served.port}", "wrong-token") as c:
        assert error_of(lambda: c.generate("acme", [5], timeout=30))[0] == C.UNAUTHENTICATED


def test_generate_on_an_encoder_daemon_is_unimplemented(tmp_path):
    d = InProcess(parse_config(
        "server:\n  listen: 127.0.0.1:0\n  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token(ADMIN)}\n"
        "backbone:\n  config: bert-tiny\n  device: cpu\n"
        f"tenants:\n  - id: acme\n    token_sha256: {hash_token('t')}\n", tmp_path))
    d.start()
    try:
        with pytest.raises(Unimplemented, match="decoder backbone"):
            d.submit_generate(Identity("acme"), "acme", GenerateRequest("acme", [1, 2]),
                              lambda ev: None)
    finally:
        d.stop(0)


# ---- leaving early frees the work --------------------------------------------------------------
def test_cancel_and_disconnect_free_sequences_and_cache_blocks(served):
    """A long greedy generation holds KV cache blocks while it streams; cancelling the call
    (a client that goes away looks the same to the server) frees them, and so does a call
    whose deadline passes. Nothing else is running meanwhile."""
    wait_until(lambda: idle(served), what="an idle engine")
    with served.client() as c:
        call = c.generate_stream("acme", [5, 6, 7], max_new_tokens=2000, eos_token_id=VOCAB - 1,
                                 timeout=120)
        first = next(call)
        assert first.WhichOneof("event") == "tokens"
        held = served.gen.cache_stats()
        assert held["blocks_used"] > 0 and held["running"] == 1, held
        assert len(served.daemon._generating) == 1
        call.cancel()
        # freed at the engine's next step, long before the 2000 tokens could be made
        wait_until(lambda: idle(served), timeout=3, what="the cancelled call's blocks")

        t0 = time.monotonic()
        code, msg = error_of(lambda: c.generate("acme", [5, 6, 7], max_new_tokens=2000,
                                                eos_token_id=VOCAB - 1, timeout=0.3))
        assert code == C.DEADLINE_EXCEEDED, (code, msg)
        assert time.monotonic() - t0 < 10
        wait_until(lambda: idle(served), timeout=3, what="the expired call's blocks")
        # and the engine still serves
        assert len(c.generate("acme", [5, 6, 7], max_new_tokens=3, timeout=60).sequences) == 1


def test_a_tenant_whose_generation_runs_out_of_memory_fails_alone(served):
    """ITIF_FAULT_INJECT=oom:beta reaches a decoder daemon's GenEngine (``faults.install``):
    every prompt or decode forward holding beta's rows raises CUDA's out-of-memory error. Armed
    while acme's and beta's generations both stream, beta's call ends RESOURCE_EXHAUSTED, acme's
    finishes as Hugging Face generates (before, the failing decode step failed both); a new
    beta call fails at its prompt the same way; disarmed, beta is served again."""
    from itif import faults  # noqa: PLC0415

    wait_until(lambda: idle(served), what="an idle engine")
    long = dict(eos_token_id=VOCAB - 1, timeout=120)
    with served.client("acme") as ca, served.client("beta") as cb:
        a = ca.generate_stream("acme", [5, 6, 7], max_new_tokens=300, **long)
        b = cb.generate_stream("beta", [7, 8], max_new_tokens=2000, **long)
        first = [next(a), next(b)]
        assert [m.WhichOneof("event") for m in first] == ["tokens", "tokens"]
        assert served.gen.cache_stats()["running"] == 2
        faults.install(served.daemon.engine, {faults.ENV: "oom:beta"})
        try:
            code, msg = error_of(lambda: list(b))
            assert code == C.RESOURCE_EXHAUSTED and "out of memory" in msg, (code, msg)
            msgs = [first[0], *a]
            assert msgs[-1].WhichOneof("event") == "result"
            want = hf_generate(served.models["acme"], [5, 6, 7], max_new_tokens=300,
                               eos_token_id=VOCAB - 1)[0]
            assert [list(s.ids) for s in msgs[-1].result.sequences] == want
            assert [t for m in msgs[:-1] for t in m.tokens.ids] == want[0]
            code, msg = error_of(lambda: cb.generate("beta", [7, 8], max_new_tokens=3, timeout=60))
            assert code == C.RESOURCE_EXHAUSTED and "out of memory" in msg, (code, msg)
        finally:
            served.gen.before_forward = None
            vars(served.daemon.engine).pop("infer", None)
        assert len(cb.generate("beta", [7, 8], max_new_tokens=3, timeout=60).sequences) == 1
    wait_until(lambda: idle(served), what="every sequence to leave the batch")


_STREAMING_CLIENT = """
import sys
from itif.client import Client
c = Client(sys.argv[1], sys.argv[2])
for msg in c.generate_stream("acme", [5, 6, 7], max_new_tokens=2000, eos_token_id=95):
    print(msg.WhichOneof("event"), flush=True)
"""


def test_a_killed_client_frees_its_sequences(served):
    """A client process killed mid-stream (its connection drops, no cancel is sent): the
    server notices, and the call's sequences and cache blocks are freed."""
    wait_until(lambda: idle(served), what="an idle engine")
    proc = subprocess.Popen([sys.executable, "-c", _STREAMING_CLIENT, f"127.0.0.1:{served.port}",
                             TOKENS["acme"]], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout.readline().strip() == "tokens"
        assert served.gen.cache_stats()["blocks_used"] > 0
        proc.kill()
        proc.wait(10)
        wait_until(lambda: idle(served), timeout=3, what="the killed client's blocks")
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- settings and metrics ----------------------------------------------------------------------
def test_max_new_tokens_is_live(served):
    d = served.daemon
    before = d.config
    with served.client() as c:
        assert error_of(lambda: c.generate("acme", [5], max_new_tokens=7, timeout=60))[0] == C.OK
        d.apply_config(dataclasses.replace(before, server=dataclasses.replace(
            before.server, max_new_tokens=6)))
        try:
            code, msg = error_of(lambda: c.generate("acme", [5], max_new_tokens=7, timeout=30))
            assert code == C.INVALID_ARGUMENT and "over the limit 6" in msg, (code, msg)
            assert len(c.generate("acme", [5], max_new_tokens=6, timeout=60).sequences) == 1
            # no max_new_tokens: the default (20) is kept within the limit, not refused
            (seq,) = c.generate("acme", [5], timeout=60).sequences
            assert 1 <= len(seq.ids) <= 6
        finally:
            d.apply_config(before)
        assert error_of(lambda: c.generate("acme", [5], max_new_tokens=7, timeout=60))[0] == C.OK


def test_generation_metrics(served):
    reg = served.daemon.metrics.registry

    def value(name: str, tenant: str) -> float:
        return reg.get_sample_value(name, {"tenant": tenant}) or 0.0

    tokens0 = value("itif_generated_tokens_total", "beta")
    first0 = value("itif_generation_time_to_first_token_seconds_count", "beta")
    gaps0 = value("itif_generation_inter_token_seconds_count", "beta")
    with served.client("beta") as c:
        greedy = c.generate("beta", [7, 8], max_new_tokens=9, eos_token_id=VOCAB - 1, timeout=60)
        beam = c.generate("beta", [7, 8], max_new_tokens=5, num_beams=2, eos_token_id=VOCAB - 1,
                          timeout=60)
    made = len(greedy.sequences[0].ids) + len(beam.sequences[0].ids)
    assert value("itif_generated_tokens_total", "beta") - tokens0 == made
    assert value("itif_generation_time_to_first_token_seconds_count", "beta") - first0 == 2
    gaps = value("itif_generation_inter_token_seconds_count", "beta") - gaps0
    assert 1 <= gaps <= len(greedy.sequences[0].ids) - 1


def test_generation_presets_match_the_engine_registry():
    """itif.config names the decoder presets without loading torch; they are the engine's."""
    from itif.config.fields import GENERATION_PRESETS
    from itif.generation.spec import PRESETS

    assert set(GENERATION_PRESETS) == set(PRESETS)
    cfg = parse_config(config_text(Path("/nonexistent")).replace("/nonexistent", "gpt2-tiny"),
                       "/tmp")
    assert cfg.backbone.is_decoder and cfg.backbone.kv_cache_bytes == 8 << 20
    assert not dataclasses.replace(cfg.backbone, config="bert-tiny").is_decoder


def test_a_backbone_generation_setting_itif_does_not_apply_refuses_the_start(tmp_path):
    """A backbone checkpoint whose generation_config.json sets what generate() would apply to
    every request and itif does not (here repetition_penalty) stops the daemon's start naming
    the key (before: served, every answer differing from generate()'s)."""
    from itif.errors import InvalidConfig  # noqa: PLC0415

    backbone = write_backbone(tmp_path / "backbone")
    gc = backbone / "generation_config.json"
    saved = json.loads(gc.read_text()) if gc.exists() else {}
    gc.write_text(json.dumps({**saved, "repetition_penalty": 1.3}))
    d = InProcess(parse_config(config_text(backbone), tmp_path))
    try:
        with pytest.raises(InvalidConfig, match="repetition_penalty=1.3 is not applied"):
            d.start()
    finally:
        d.stop(0)


# ---- a real itif serve: upload, the documented commands, restart --------------------------------
def _documented_generate_commands():
    from tests.doc_blocks import shell_commands

    return [c for c in shell_commands() if c.argv[:2] == ("itif", "generate")]


def test_itif_generate_streams_drains_and_a_decoder_tenant_survives_restart(tmp_path):
    backbone = write_backbone(tmp_path / "backbone")
    d = Daemon(tmp_path / "d", {"acme": TOKENS["acme"]}, backbone=str(backbone),
               server_extra={"max_new_tokens": 64}, backbone_extra={"kv_cache_bytes": "8MiB"})
    d.start()
    try:
        model = hf_model(1)
        path = tmp_path / "model.safetensors"
        path.write_bytes(weights_bytes(model, tmp_path))
        with d.client(TOKENS["acme"]) as c:
            up = c.upload("acme", path, timeout=120)
            assert up.weight_bytes > 0
            before = c.generate("acme", [5, 17, 42], max_new_tokens=8, num_beams=4,
                                num_return_sequences=2, timeout=120)
        cmds = _documented_generate_commands()
        assert len(cmds) == 2, cmds
        env = dict(os.environ, TOKEN=TOKENS["acme"],
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        outs = []
        for cmd in cmds:
            r = subprocess.run(["bash", "-c", cmd.text.replace("HOST:50051", d.addr)], env=env,
                               capture_output=True, text=True, timeout=120, cwd=tmp_path)
            assert r.returncode == 0, (cmd.where, r.stderr)
            outs.append(r.stdout)
        greedy, _ = hf_generate(model, [5, 17, 42], max_new_tokens=8)
        words = " ".join(f"t{t}" for t in greedy[0])
        # streamed text first (the tokens' words as they came), then the final sequence
        lines = outs[0].splitlines()
        assert lines[0].strip() == words and lines[-1].startswith(f"[0] {words!r} ("), outs[0]
        final = json.loads(outs[1].strip().splitlines()[-1])
        assert [s["ids"] for s in final["sequences"]] == [list(s.ids) for s in before.sequences]
        assert all("score" in s for s in final["sequences"])

        # SIGTERM while a generation streams: it is finished and answered, then the daemon exits
        with d.client(TOKENS["acme"]) as c:
            it = iter(c.generate_stream("acme", [5, 17, 42], max_new_tokens=60,
                                        eos_token_id=VOCAB - 1, timeout=120))
            assert next(it).WhichOneof("event") == "tokens"
            d.proc.send_signal(signal.SIGTERM)
            rest = list(it)
        assert rest[-1].WhichOneof("event") == "result", rest[-1:]
        assert d.wait_exit(60) == 0
        d.start()  # the decoder tenant comes back from the data directory
        with d.client(TOKENS["acme"]) as c:
            assert c.get_tenant("acme").state == itif_pb2.TenantInfo.READY
            after = c.generate("acme", [5, 17, 42], max_new_tokens=8, num_beams=4,
                               num_return_sequences=2, timeout=120)
        assert [list(s.ids) for s in after.sequences] == [list(s.ids) for s in before.sequences]
        assert [s.score for s in after.sequences] == [s.score for s in before.sequences]
    finally:
        d.stop()


def test_decoder_config_takes_lora_tenants_and_weight_tiers_not_delta_tenants(tmp_path):
    """Issue 62: LoRA tenants and weight tiers are served on decoder daemons
    (tests/test_llama_lora_daemon.py); delta tenants are not (refused naming compress)."""
    from itif.errors import InvalidConfig

    text = config_text(write_backbone(tmp_path / "bb")) + "    base: acme\n"
    assert parse_config(text, tmp_path).tenant("empty").base == "acme"
    with pytest.raises(InvalidConfig, match=r"tenants\[2\]\.compress: delta tenants"):
        parse_config(text + "    compress: int8\n", tmp_path)
    tiers = config_text(tmp_path / "bb").replace("  kv_cache_bytes:",
                                                 "  device_weight_bytes: 1MiB\n  kv_cache_bytes:")
    assert parse_config(tiers, tmp_path).backbone.device_weight_bytes == 1 << 20


def test_streamed_text_of_byte_level_tokens_adds_up_to_the_decoded_text():
    """Token messages' text with a byte-level BPE (GPT-2's kind): characters split over several
    tokens (é, 日本語) are sent once complete, never as U+FFFD, and the pieces add up to the
    decoded sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from itif.server.generate import _Text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["héllo wörld, ça va? 日本語のテキスト hello world"] * 20,
                            trainers.BpeTrainer(vocab_size=280,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ids = tok.encode("héllo wörld, 日本語 ça va? hello").ids
    text = _Text(tok)
    pieces = [text.add(0, [i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == "héllo wörld, 日本語 ça va? hello"
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some token ended mid-character and waited for the next


def test_tenant_weights_reach_generation_admission_live(served):
    """tenants.yaml's ``weight`` sets a tenant's share of generation admissions (the GenEngine's
    fair queue) at start and on a live reload."""
    d, gen = served.daemon, served.gen
    assert gen._waiting.weight("acme") == 1.0
    backbone = Path(d.config.backbone.config)
    old = d.config
    text = config_text(backbone).replace("  - id: acme\n", "  - id: acme\n    weight: 4\n")
    d.apply_config(parse_config(text, served.root))
    try:
        assert gen._waiting.weight("acme") == 4.0 and gen._waiting.weight("beta") == 1.0
    finally:
        d.apply_config(old)
    assert gen._waiting.weight("acme") == 1.0


def test_a_tenant_removed_from_the_config_finishes_its_running_generation(tmp_path):
    """Its accepted Generate call runs to its end, then the tenant is retired (before: the
    retire counted Infer rows only, so the generation ended at once with NOT_FOUND)."""
    backbone = write_backbone(tmp_path / "backbone")
    d = InProcess(parse_config(config_text(backbone), tmp_path))
    d.start()
    try:
        upload_models(d, tmp_path)
        events, started, done = [], threading.Event(), threading.Event()

        def on(ev):
            events.append(ev)
            started.set()
            if ev.kind in ("done", "error"):
                done.set()

        d.submit_generate(Identity(None, admin=True), "acme",
                          GenerateRequest("acme", [5, 6, 7], max_new_tokens=1500,
                                          eos_token_id=VOCAB - 1), on)
        assert started.wait(30)
        d.apply_config(dataclasses.replace(
            d.config, tenants=[t for t in d.config.tenants if t.id != "acme"]))
        assert done.wait(120)
        assert events[-1].kind == "done", events[-1]
        assert len(events[-1].generation.sequences[0]) == 1500
        end = time.monotonic() + 10
        while "acme" in d.generator.tenants() and time.monotonic() < end:
            time.sleep(0.05)
        assert "acme" not in d.generator.tenants()
    finally:
        d.stop(0)
