"""PEFT LoRA tenants on a llama decoder daemon (issue 62): ``base:`` in tenants.yaml, uploaded
with ``itif upload --adapter DIR`` over gRPC, generating exactly what ``GenEngine.generate`` and
PEFT's ``generate()`` generate; bad adapters are INVALID_ARGUMENT naming the field; deleting
the base leaves its adapters FAILED (files kept) and they serve again when it is back; a
restart restores them on their base.

The backbone is a tiny random ``LlamaForCausalLM`` checkpoint directory (GQA 4/2, untied head)
with tests/test_chat_completions.py's word-level tokenizer and a Llama-3-like chat template in
tokenizer_config.json; :func:`lora_daemon` (also used by that file) starts it in process
behind the real gRPC servicer and HTTP server.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from itif.config import hash_token, parse_config
from itif.daemon import Daemon as InProcess
from itif.daemon import Identity
from itif.generation.api import GenerateRequest
from itif.metrics import Metrics
from itif.server._proto.itif.v1 import itif_pb2
from tests.daemon_harness import ADMIN, free_port
from tests.reliability_util import code_of, error_of

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("uvicorn")

from tests.test_chat_completions import LLAMA3, SPECIALS, build_tokenizer  # noqa: E402 (imported after importorskip)
from tests.test_http_completions import servers  # noqa: E402 (imported after importorskip)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

C = grpc.StatusCode
READY, FAILED = itif_pb2.TenantInfo.READY, itif_pb2.TenantInfo.FAILED
VOCAB, BOS, EOS = 128, SPECIALS.index("<|begin_of_text|>"), SPECIALS.index("<|eot_id|>")
_CFG = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": BOS,
        "eos_token_id": EOS, "tie_word_embeddings": False, "initializer_range": 0.2}
TOKENS = {"base": "base-llama-token", "lora": "lora-llama-token", "full": "full-llama-token",
          "lora2": "lora2-llama-token"}
BASES = {"lora": "base", "lora2": "base"}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
PROMPTS = [[5, 17, 42], [BOS, 30, 31, 32, 33], [60]]


def base_model(seed: int):
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG)).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    return m


def peft_adapter(base, path: Path, seed: int, **kw):
    """A PEFT adapter of ``base`` (random, nonzero B: it changes the answers), saved in
    ``path``; returns the PeftModel (the oracle)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, init_lora_weights=False,
                          **{**LORA, **kw})
    m = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    m.eval().save_pretrained(str(path))
    return m


def write_backbone(root: Path, template: str = LLAMA3) -> Path:
    build_tokenizer(root, template, vocab=VOCAB)
    (root / "config.json").write_text(json.dumps(transformers.LlamaConfig(**_CFG).to_dict()))
    return root


def config_text(backbone: Path, http: str, backbone_extra: str = "") -> str:
    tenants = ""
    for t, tok in TOKENS.items():
        tenants += f"  - id: {t}\n    token_sha256: {hash_token(tok)}\n"
        if t in BASES:
            tenants += f"    base: {BASES[t]}\n"
    return (f"server:\n  listen: 127.0.0.1:0\n  http_listen: {http}\n  data_dir: ./data\n"
            f"  admin_token_sha256: {hash_token(ADMIN)}\n  max_new_tokens: 64\n"
            f"backbone:\n  config: {backbone}\n  device: cpu\n  dtype: float32\n"
            f"  kv_cache_bytes: 8MiB\n{backbone_extra}tenants:\n{tenants}")


def weights_bytes(model, tmp: Path) -> bytes:
    from itif.safetensors_io import save_safetensors

    path = tmp / "w.safetensors"
    save_safetensors({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                     path)
    return path.read_bytes()


def upload(d: InProcess, tenant: str, data: bytes):
    return d.upload(Identity(None, admin=True), tenant, hashlib.sha256(data).hexdigest(),
                    len(data), [data])


def packed(adapter_dir: Path) -> bytes:
    from itif.backbones.lora_tenants import pack_adapter

    return Path(pack_adapter(adapter_dir, adapter_dir / "packed.safetensors")).read_bytes()


def cli_upload(grpc_addr: str, tenant: str, adapter: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "itif", "upload", "--server", grpc_addr, "--token", ADMIN,
         "--tenant", tenant, "--adapter", str(adapter), "--quiet"],
        check=False, capture_output=True, text=True, timeout=180, env={**os.environ})


def hf_generate(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=EOS, attention_mask=torch.ones(1, len(ids),
                                                                         dtype=torch.long))
    s = out[0, len(ids):].tolist()
    return s[:s.index(EOS) + 1] if EOS in s else s


@dataclasses.dataclass
class Served:
    daemon: InProcess
    port: int  # gRPC
    http: str
    models: dict  # tenant -> its oracle (HF or PEFT model)
    root: Path

    @property
    def gen(self):
        return self.daemon.generator

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def lora_daemon(root: Path):
    """A llama daemon with ``base`` and ``full`` uploaded and ``lora`` (an adapter of base)
    uploaded with ``itif upload --adapter`` over gRPC, after the same upload was refused
    FAILED_PRECONDITION while the base had no weights."""
    backbone = write_backbone(root / "backbone")
    http = f"127.0.0.1:{free_port()}"
    d = InProcess(parse_config(config_text(backbone, http), root))
    d.metrics = Metrics(d, nvml=None)
    d.start()
    models = {"base": base_model(1), "full": base_model(2)}
    models["lora"] = peft_adapter(models["base"], root / "lora", 10)
    with servers(d) as port:
        s = Served(d, port, http, models, root)
        early = cli_upload(s.grpc, "lora", root / "lora")
        assert early.returncode == 1 and "FAILED_PRECONDITION" in early.stderr, early.stderr
        for t in ("base", "full"):
            upload(d, t, weights_bytes(models[t], root))
        out = cli_upload(s.grpc, "lora", root / "lora")
        assert out.returncode == 0, out.stderr
        yield s


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with lora_daemon(tmp_path_factory.mktemp("llama-lora-daemon")) as s:
        yield s


def _generate(s: Served, tenant: str, ids: list[int], n: int = 12) -> list[int]:
    from itif.client import Client

    with Client(s.grpc, TOKENS[tenant]) as c:
        got = c.generate(tenant, ids, max_new_tokens=n, timeout=60)
    return list(got.sequences[0].ids)


def test_lora_tenant_generates_as_the_engine_and_peft(served):
    s = served
    differs = 0
    for ids in PROMPTS:
        want = s.gen.generate([GenerateRequest(t, ids, max_new_tokens=12)
                               for t in ("lora", "base", "full")])
        for t, w in zip(("lora", "base", "full"), want):
            assert w.sequences[0] == hf_generate(s.models[t], ids, 12), (t, ids)
            assert _generate(s, t, ids) == w.sequences[0], (t, ids)
        differs += want[0].sequences != want[1].sequences
    assert differs >= 2  # the adapter changes its base's answers
    info = s.daemon.tenant_view("lora")
    assert info.state.name == "READY"
    total, own = s.gen.store.tenant_bytes("lora")
    assert own == 0 and total == s.gen.store.tenant_bytes("base")[0]


def _grpc_upload(s: Served, tenant: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    from itif.client import Client
    from tests.reliability_util import upload_bytes

    with Client(s.grpc, ADMIN) as c:
        return error_of(lambda: upload_bytes(c, tenant, data))


def test_bad_adapters_are_invalid_argument_naming_the_field(served, tmp_path):
    s = served
    base = s.models["base"]
    # a full checkpoint for a LoRA tenant; an adapter for a full tenant
    code, msg = _grpc_upload(s, "lora2", weights_bytes(base, tmp_path))
    assert code == C.INVALID_ARGUMENT and "LoRA adapter" in msg, msg
    peft_adapter(base, tmp_path / "good", 3)
    code, msg = _grpc_upload(s, "full", packed(tmp_path / "good"))
    assert code == C.INVALID_ARGUMENT, msg
    cases = [({"modules_to_save": ["lm_head"]}, "modules_to_save"),
             ({"target_modules": ["lm_head"]}, "lm_head"),
             ({"use_dora": True}, "use_dora")]
    for i, (kw, field) in enumerate(cases):
        peft_adapter(base, tmp_path / f"bad{i}", 4 + i, **kw)
        code, msg = _grpc_upload(s, "lora2", packed(tmp_path / f"bad{i}"))
        assert code == C.INVALID_ARGUMENT and field in msg, (kw, msg)
    assert s.daemon.status["lora2"].state.name != "READY"
    assert _generate(s, "full", PROMPTS[0]) == hf_generate(s.models["full"], PROMPTS[0], 12)


def test_deleting_the_base_fails_its_adapters_until_it_is_back(served):
    s = served
    from itif.client import Client

    with Client(s.grpc, ADMIN) as c:
        c.delete_weights("base")
        info = c.get_tenant("lora")
        assert info.state == FAILED and "base" in info.error, info
        assert s.daemon.blobs.exists("lora")  # its file is kept
    with Client(s.grpc, TOKENS["lora"]) as c:
        assert code_of(lambda: c.generate("lora", PROMPTS[0], max_new_tokens=4,
                                          timeout=30)) == C.FAILED_PRECONDITION
    upload(s.daemon, "base", weights_bytes(s.models["base"], s.root))
    with Client(s.grpc, ADMIN) as c:
        assert c.get_tenant("lora").state == READY
    assert _generate(s, "lora", PROMPTS[1]) == hf_generate(s.models["lora"], PROMPTS[1], 12)


def test_a_restart_restores_adapters_on_their_base(tmp_path):
    backbone = write_backbone(tmp_path / "backbone")
    text = config_text(backbone, f"127.0.0.1:{free_port()}")
    base = base_model(5)
    lora = peft_adapter(base, tmp_path / "a", 6)
    d = InProcess(parse_config(text, tmp_path))
    d.start()
    try:
        upload(d, "base", weights_bytes(base, tmp_path))
        upload(d, "lora", packed(tmp_path / "a"))
    finally:
        d.stop(0)
    d = InProcess(parse_config(text, tmp_path))
    d.start()
    try:
        assert d.status["lora"].state.name == "READY"
        got = d.generator.generate([GenerateRequest("lora", ids, max_new_tokens=10)
                                    for ids in PROMPTS])
        assert [g.sequences[0] for g in got] == [hf_generate(lora, ids, 10) for ids in PROMPTS]
    finally:
        d.stop(0)


def test_tiers_hold_decoder_tenants_full_and_lora(tmp_path):
    """Room on the device for one full tenant (and its adapters), on the host for one more:
    each Generate loads its tenant from the host tier or disk, evicting the idle others (a
    base stays while its LoRA tenant is resident), and the answers are unchanged."""
    backbone = write_backbone(tmp_path / "backbone")
    models = {"base": base_model(1), "full": base_model(2)}
    models["lora"] = peft_adapter(models["base"], tmp_path / "lora", 10)
    per = len(weights_bytes(models["base"], tmp_path))
    extra = (f"  device_weight_bytes: {int(per * 1.5)}\n"
             f"  host_weight_bytes: {int(per * 1.2)}\n")
    text = config_text(backbone, f"127.0.0.1:{free_port()}", extra)
    d = InProcess(parse_config(text, tmp_path))
    d.start()
    try:
        upload(d, "base", weights_bytes(models["base"], tmp_path))
        upload(d, "lora", packed(tmp_path / "lora"))
        upload(d, "full", weights_bytes(models["full"], tmp_path))  # base and lora evicted
        admin = Identity(None, admin=True)
        want = {(t, i): hf_generate(models[t], ids, 8)
                for t in models for i, ids in enumerate(PROMPTS)}
        order = ["lora", "full", "base", "full", "lora", "lora", "base", "full"]
        on_host = 0
        for step, t in enumerate(order):
            on_host = max(on_host, d.tiers.totals()["host_tenants"])
            i = step % len(PROMPTS)
            got = _submit(d, admin, t, PROMPTS[i])
            assert got == want[t, i], (step, t)
            assert t in d.engine.store
            resident = {u for u in models if u in d.engine.store}
            assert not {"base", "full"} <= resident  # never both: the budget holds one
        views = {t: d.tiers.view(t) for t in models}
        assert views["full"].evictions >= 2 and views["base"].evictions >= 2, views
        assert views["lora"].promotions >= 2, views
        assert on_host >= 1  # an evicted full tenant waited on the host tier
        assert d.engine.store.weight_bytes <= per * 1.5
        with servers(d):  # HTTP: an evicted tenant is loaded off the event loop's thread
            _chat_loads_off_the_loop(d, tmp_path / "backbone")
    finally:
        d.stop(0)


def _chat_loads_off_the_loop(d: InProcess, backbone: Path) -> None:
    import threading

    import httpx

    assert "lora" not in d.engine.store and "base" not in d.engine.store
    threads: list[str] = []
    promote = d.tiers.promote

    def recording(tenant: str) -> None:
        threads.append(threading.current_thread().name)
        promote(tenant)

    d.tiers.promote = recording
    messages = [{"role": "user", "content": "hello there"}]
    r = httpx.post(f"http://{d.config.server.http_listen}/v1/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {TOKENS['lora']}"},
                   json={"model": "lora", "messages": messages, "max_tokens": 8})
    assert r.status_code == 200, r.text
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(backbone))
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    want = d.generator.generate([GenerateRequest("lora", ids, max_new_tokens=8)])[0]
    assert r.json()["choices"][0]["token_ids"] == want.sequences[0]
    assert threads and all(n.startswith("asyncio_") for n in threads), threads


def _submit(d: InProcess, who, tenant: str, ids: list[int]) -> list[int]:
    """One Generate through the daemon's front door, waited for (tokens dropped)."""
    import threading

    box: dict = {}
    done = threading.Event()

    def on_event(ev) -> None:
        if ev.kind in ("done", "error"):
            box["ev"] = ev
            done.set()

    d.submit_generate(who, tenant, GenerateRequest(tenant, ids, max_new_tokens=8), on_event)
    assert done.wait(60)
    ev = box["ev"]
    assert ev.kind == "done", ev
    return ev.generation.sequences[0]
