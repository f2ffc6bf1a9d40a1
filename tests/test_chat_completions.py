"""Chat templates and ``/v1/chat/completions`` (issue 62).

Rendering (``itif.generation.chat_template``) equals Hugging Face's
``apply_chat_template`` text and token ids for three templates (a Llama-3-like one, a
ChatML/Qwen-like one that adds a default system prompt, a Mistral-like one written over several
lines that refuses bad roles with ``raise_exception``) and several message lists, with the
template read from tokenizer_config.json or chat_template.jinja of a tokenizer built here
(a ``tokenizers`` WordLevel model wrapped in ``PreTrainedTokenizerFast``; nothing downloaded).

Against a daemon (tests/test_llama_lora_daemon.py's: a tiny random Llama base, a PEFT LoRA
tenant uploaded over gRPC with ``itif upload --adapter``, a full tenant): the ``openai``
client's ``chat.completions.create``, streamed and not, equals ``GenEngine.generate`` of the
rendered prompt and PEFT's ``generate()``; bad requests are 400 naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from itif.errors import InvalidRequest
from itif.generation import chat_template as ct

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MISTRAL = """{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in messages if message['role'] != 'system' %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and ns.system %}
[INST] {{ ns.system + '\\n\\n' + message['content'] }} [/INST]
        {%- else %}
[INST] {{ message['content'] }} [/INST]
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}
    {%- else %}
        {{- raise_exception('Only user, system and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}
  {{ {"turns": messages | length, "note": "<ok> & fine"} | tojson }}
{% endif %}
"""
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL}
SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "[INST]",
            "[/INST]"]
WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", ".", "hello", "there",
         "what", "is", "two", "plus", "?", "it", "four", "!", "tell", "me", "joke", ",", "why",
         "not", ":", "the", "answer", "{", "}", "turns", "note", "ok", "&", "fine", "<", ">",
         "1", "2", "3", "4", "5", "be", "brief", "please", '"']
MESSAGES = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "be brief"},
     {"role": "user", "content": "what is two plus two ?"},
     {"role": "assistant", "content": "it is four !"},
     {"role": "user", "content": "  tell me a joke , please  "}],
    [{"role": "user", "content": "why not ?"}, {"role": "assistant", "content": "the answer"},
     {"role": "user", "content": "hello"}],
]


def build_tokenizer(root: Path, template: str, layout: str = "config", vocab: int = 128):
    """A word-level tokenizer (SPECIALS as special added tokens, then WORDS) saved in ``root``
    with ``template``: in tokenizer_config.json (``layout`` "config") or as transformers 5 saves
    it (``"jinja"``: chat_template.jinja); returns the loaded PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ids = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    ids.update({f"w{i}": i for i in range(len(ids), vocab)})
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        unk_token="<unk>")
    hf.chat_template = template
    root.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(root))
    cfg_path, jinja = root / "tokenizer_config.json", root / "chat_template.jinja"
    cfg = json.loads(cfg_path.read_text())
    if layout == "config":
        cfg["chat_template"] = template
        jinja.unlink(missing_ok=True)
    else:
        cfg.pop("chat_template", None)
        jinja.write_text(template)
    cfg_path.write_text(json.dumps(cfg))
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(root))


@pytest.mark.parametrize("layout", ["config", "jinja"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_equals_apply_chat_template(tmp_path, name, layout):
    from tokenizers import Tokenizer

    hf = build_tokenizer(tmp_path / "tok", TEMPLATES[name], layout)
    template, specials = ct.read_chat_config(tmp_path / "tok")
    assert template == TEMPLATES[name]
    assert specials["bos_token"] == "<|begin_of_text|>" and specials["eos_token"] == "<|eot_id|>"
    fast = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    for messages in MESSAGES:
        for prompt in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            got = ct.render(template, ct.check_messages(messages), special_tokens=specials,
                            add_generation_prompt=prompt)
            assert got == want, (name, messages)
            want_ids = hf.apply_chat_template(messages, add_generation_prompt=prompt,
                                              return_dict=False)
            assert ct.template_ids(fast, got) == want_ids
            assert SPECIALS.index("<unk>") not in want_ids[:3]  # the specials are real tokens


def test_a_named_template_list_takes_default(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    (root / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "chat_template": [{"name": "tool_use", "template": "x"},
                          {"name": "default", "template": CHATML}]}))
    assert ct.read_chat_config(root) == (CHATML, {"eos_token": "</s>"})
    assert ct.read_chat_config(tmp_path / "none") == (None, {})


def test_templates_refuse_bad_roles_and_bad_messages_name_the_field():
    with pytest.raises(InvalidRequest, match="^messages: .*roles must alternate"):
        ct.render(MISTRAL, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(InvalidRequest, match="^messages: .*Only user, system and assistant"):
        ct.render(MISTRAL, [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(InvalidRequest, match="^chat_template: .*does not parse"):
        ct.render("{% for %}", [{"role": "user", "content": "a"}])
    cases = [
        ("hi", "^messages: must be an array"),
        ([], "^messages: is empty"),
        (["hi"], r"^messages\[0\]: must be an object"),
        ([{"content": "x"}], r"^messages\[0\]\.role: is required"),
        ([{"role": 3, "content": "x"}], r"^messages\[0\]\.role: must be a non-empty string"),
        ([{"role": "user"}], r"^messages\[0\]\.content: is required"),
        ([{"role": "user", "content": 5}], r"^messages\[0\]\.content: must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}],
         r"^messages\[0\]\.content\[0\]\.type: 'image_url' is not supported"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
         r"^messages\[0\]\.content\[0\]\.text: must be a string"),
        ([{"role": "user", "content": "x", "tool_calls": []}],
         r"^messages\[0\]\.tool_calls: is not supported"),
        ([{"role": "user", "content": "x", "name": 2}], r"^messages\[0\]\.name: must be"),
    ]
    for messages, pattern in cases:
        with pytest.raises(InvalidRequest, match=pattern):
            ct.check_messages(messages)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None}]
    assert ct.check_messages(parts) == [{"role": "user", "content": "a\nb"},
                                        {"role": "assistant"}]


def test_the_sandbox_holds():
    templates = ("{{ ''.__class__.__mro__ }}",
                 "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
                 "{{ messages.append(1) }}")
    for template in templates:
        with pytest.raises(InvalidRequest, match="^messages: "):
            ct.render(template, [{"role": "user", "content": "a"}])


# ---- /v1/chat/completions against a llama daemon with a LoRA tenant ----------------------------
def test_streamed_text_keeps_the_space_after_a_skipped_special_token(tmp_path):
    """``itif.server.generate``'s incremental detokenizer, on ids with special tokens among the
    words (one, and several in a row; the tokenizer has no decoder: words are joined with a
    space): the token messages' pieces add up to the non-streamed text exactly. A window that
    started at a skipped special token used to decode its next word without the separating
    space ("hello there" streamed as "hellothere")."""
    from tokenizers import Tokenizer

    from itif.server.generate import _Text

    build_tokenizer(tmp_path / "tok", LLAMA3)
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    sentence = "hello there what is two plus two ? it is four ! tell me a joke"
    ids = tok.encode(sentence).ids
    specials = [tok.token_to_id(t) for t in ("<|eot_id|>", "<|im_start|>", "<|end_header_id|>")]
    assert None not in specials and not set(specials) & set(ids)
    cases = [ids[:1] + specials[:1] + ids[1:],  # hello <eot> there ...
             ids[:3] + specials + ids[3:6] + specials[1:2] + ids[6:],
             specials[:1] + ids + specials[2:]]  # first and last
    for case in cases:
        want = tok.decode(case, skip_special_tokens=True)
        assert want == sentence
        for step in (1, 2, 3):  # one id a message, or several
            text = _Text(tok)
            pieces = [text.add(0, case[i:i + step]) for i in range(0, len(case), step)]
            assert "".join(pieces) == want, (case, step, pieces)
    two, out = _Text(tok), ["", ""]  # two sequences interleaved: each its own window
    for i in range(max(len(cases[0]), len(cases[1]))):
        for s in (0, 1):
            out[s] += two.add(s, cases[s][i:i + 1])
    assert out == [sentence] * 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("peft")
    pytest.importorskip("uvicorn")
    from tests.test_llama_lora_daemon import lora_daemon

    with lora_daemon(tmp_path_factory.mktemp("chat-daemon")) as s:
        yield s


def _openai(s, tenant: str):
    openai = pytest.importorskip("openai")
    from tests.test_llama_lora_daemon import TOKENS

    return openai.OpenAI(base_url=f"http://{s.http}/v1", api_key=TOKENS[tenant], max_retries=0)


def test_streamed_chat_of_a_lora_tenant_equals_the_engine_and_peft(served):
    from tokenizers import Tokenizer

    from itif.generation.api import GenerateRequest
    from tests.test_llama_lora_daemon import hf_generate

    s = served
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(s.root / "backbone"))
    words = Tokenizer.from_file(str(s.root / "backbone" / "tokenizer.json"))
    differs = 0
    for messages in MESSAGES:
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        want = s.gen.generate([GenerateRequest(t, ids, max_new_tokens=12)
                               for t in ("lora", "base", "full")])
        for tenant, w in zip(("lora", "base", "full"), want):
            assert w.sequences[0] == hf_generate(s.models[tenant], ids, 12), tenant
        differs += want[0].sequences != want[1].sequences
        text = words.decode(want[0].sequences[0], skip_special_tokens=True)
        oa = _openai(s, "lora")
        chunks = list(oa.chat.completions.create(
            model="lora", messages=messages, max_tokens=12, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"
        deltas = [c.choices[0] for c in chunks if c.choices]
        streamed = "".join(d.delta.content or "" for d in deltas)
        assert streamed == text  # and the ids exactly
        assert [t for d in deltas for t in d.token_ids] == want[0].sequences[0]
        assert deltas[-1].finish_reason in ("stop", "length")
        assert chunks[-1].usage.prompt_tokens == len(ids)
        assert chunks[-1].usage.completion_tokens == len(want[0].sequences[0])
        plain = oa.chat.completions.create(model="lora", messages=messages,
                                           max_completion_tokens=12)
        assert plain.object == "chat.completion"
        assert plain.choices[0].message.role == "assistant"
        assert plain.choices[0].message.content == text
        assert plain.choices[0].token_ids == want[0].sequences[0]
        full = _openai(s, "full").chat.completions.create(model="full", messages=messages,
                                                          max_tokens=12)
        assert full.choices[0].token_ids == want[2].sequences[0]
    assert differs >= 2  # the adapter's answers are its own
    st = s.gen.cache_stats()
    assert st["running"] == 0 and st["waiting"] == 0


def _post(s, body, tenant: str = "lora"):
    import httpx

    from tests.test_llama_lora_daemon import TOKENS

    return httpx.post(f"http://{s.http}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {TOKENS[tenant]}"})


def test_bad_chat_requests_are_400_naming_the_field(served):
    s = served
    hi = [{"role": "user", "content": "hello"}]
    cases = [
        ({"model": "lora"}, "messages"),
        ({"model": "lora", "messages": "hello"}, "messages"),
        ({"model": "lora", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "lora", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "lora", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"model": "lora", "messages": hi, "prompt": "x"}, "prompt"),
        ({"model": "lora", "messages": hi, "tools": [{"type": "function"}]}, "tools"),
        ({"model": "lora", "messages": hi, "logprobs": True}, "logprobs"),
        ({"model": "lora", "messages": hi, "max_tokens": "x"}, "max_tokens"),
        ({"model": "lora", "messages": hi, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": "lora", "messages": hi, "add_generation_prompt": 1}, "add_generation_prompt"),
        ({"model": "lora", "messages": hi, "temperature": -1}, "temperature"),
        ({"model": "lora", "messages": hi, "bogus": 1}, "bogus"),
    ]
    for body, param in cases:
        r = _post(s, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
    assert _post(s, {"model": "base", "messages": hi}).status_code == 404  # another's model
    assert _post(s, {"model": "nobody", "messages": hi}).status_code == 404
    engine = s.daemon.engine
    kept = engine.chat_template_of("lora")
    try:  # the template's own refusal; no template at all
        engine._chat = (MISTRAL, kept[1])
        r = _post(s, {"model": "lora", "messages": hi + hi})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "alternate" in r.json()["error"]["message"]
        engine._chat = (None, {})
        r = _post(s, {"model": "lora", "messages": hi})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    finally:
        engine._chat = kept
    ok = _post(s, {"model": "lora", "messages": hi, "max_tokens": 3, "logprobs": False,
                   "tools": None, "tool_choice": "none"})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) <= 3, ok.text
