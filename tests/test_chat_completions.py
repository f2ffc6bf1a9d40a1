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
