"""Chat templates: zoo's rendering and token ids against transformers' apply_chat_template of the same chat.

The transformers tokenizers are built locally from the bundled tokenizer.json (plus each family's special
tokens) and a tokenizer_config.json or chat_template.jinja holding the upstream template string; no hub access.
"""

import json
from datetime import datetime

import pytest

from recipes.data.tokenizer_choice import ASSETS
from zoo.errors import ZooError
from zoo.io.tokenizer import Tokenizer, encode_chat, render

# the chat_template strings of the published tokenizer_config.json files
UPSTREAM = {
    "internlm2": (  # internlm/internlm2-chat-7b
        "{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama-2": (  # meta-llama/Llama-2-7b-chat-hf
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "llama-3": (  # meta-llama/Meta-Llama-3-8B-Instruct
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"
    ),
}
SPECIALS = {
    "internlm2": ("<s>", "</s>", []),
    "llama-2": ("<s>", "</s>", []),
    "llama-3": ("<|begin_of_text|>", "<|eot_id|>", ["<|begin_of_text|>", "<|start_header_id|>",
                                                   "<|end_header_id|>", "<|eot_id|>"]),
}
CHATS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Spell cat."},
     {"role": "assistant", "content": "C-A-T."}, {"role": "user", "content": "And dog?"},
     {"role": "assistant", "content": "D-O-G, that is all."}],
]


def make_tokenizer_dir(tmp_path, family, with_template=True):
    from tokenizers import Tokenizer as HFTokenizer

    bos, eos, extra = SPECIALS[family]
    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(extra)
    d = tmp_path / family
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if with_template:
        config["chat_template"] = UPSTREAM[family]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("family", sorted(UPSTREAM))
@pytest.mark.parametrize("template", ["builtin", "checkpoint"])
def test_matches_transformers(tmp_path, family, template):
    from transformers import AutoTokenizer

    d = make_tokenizer_dir(tmp_path, family)
    hf = AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer(d)
    name = family if template == "builtin" else "checkpoint"
    for chat in CHATS:
        want_text = hf.apply_chat_template(chat, tokenize=False)
        assert render(chat, name, tok).text == want_text
        want_ids = hf.apply_chat_template(chat, tokenize=True)
        want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
        ids, mask = encode_chat(chat, name, tok)
        assert ids == list(want_ids)
        # targets: exactly the assistant contents with their end-of-turn token
        targets = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        end = {"internlm2": "<|im_end|>", "llama-2": " </s>", "llama-3": "<|eot_id|>"}[family]
        assert targets.replace(" ", "") == "".join(a + end for a in answers).replace(" ", "")
        # the prompt of a turn to come, as generation renders it
        assert render(chat[:-1], name, tok, add_generation_prompt=True).text == hf.apply_chat_template(
            chat[:-1], tokenize=False, add_generation_prompt=True)
    assert tok.end_of_turn(name) == end.strip()
    assert tok.stop_ids(name) == tuple(dict.fromkeys([tok.eos_id, tok.token_to_id(end.strip())]))


def test_auto_picks_checkpoint_template_then_tokens(tmp_path):
    d = make_tokenizer_dir(tmp_path, "llama-3", with_template=False)
    tok = Tokenizer(d)
    assert render(CHATS[0], "auto", tok).text == render(CHATS[0], "llama-3", tok).text
    bundled = Tokenizer(ASSETS)  # ships its ChatML template in tokenizer_config.json
    assert render(CHATS[1], "auto", bundled).text == render(CHATS[1], "internlm2", bundled).text


def test_checkpoint_template_without_one_is_a_clear_error(tmp_path):
    d = make_tokenizer_dir(tmp_path, "llama-3", with_template=False)
    with pytest.raises(ZooError, match="has no chat template.*llama-3"):
        render(CHATS[0], "checkpoint", Tokenizer(d))


def test_llama2_roles_must_alternate():
    tok = Tokenizer(ASSETS)
    with pytest.raises(ZooError, match="alternating"):
        render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "llama-2", tok)


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    text = [json.loads(line)["text"][:2000] for line in open(ASSETS / "corpus.jsonl")][:40]
    (tmp_path / "c.txt").write_text("\n".join(text))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=300, model_type="bpe", bos_id=1, eos_id=2, unk_id=0,
                                   minloglevel=2)
    tok = Tokenizer(tmp_path)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    chat = render(CHATS[0], "llama-2", tok)
    ids, mask = encode_chat(CHATS[0], "llama-2", tok)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids.count(tok.bos_id) == 1
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]).strip() == "2 plus 3 is 5."
    assert chat.text.startswith("<s>[INST] ")


def test_missing_tokenizer_says_where_it_looked(tmp_path):
    with pytest.raises(ZooError, match="tokenizer.json.*tokenizer.model"):
        Tokenizer(tmp_path)


# ---- templates as transformers 5 saves them: chat_template.jinja ----

# HuggingFaceTB/SmolLM2-1.7B-Instruct: ChatML with a default system message, bos_token <|im_start|>
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# meta-llama/Llama-3.2-1B-Instruct (3.1 has the same shape): today's date from strftime_now, tools optional
LLAMA32 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (the upstream template's lines)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tokenizer_dir(path, specials, config, jinja=None):
    """The bundled tokenizer.json plus `specials`, this tokenizer_config.json, and chat_template.jinja if given."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(specials)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def assert_same_as_transformers(d, chats, expect_end):
    """Text and ids, with and without the generation prompt, equal transformers'; the targets are the answers
    with their end-of-turn token, and that token is a stop id."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer(d)
    for chat in chats:
        for prompt in (False, True):
            msgs = chat[:-1] if prompt else chat
            want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
            assert render(msgs, "auto", tok, add_generation_prompt=prompt).text == want
            want_ids = hf.apply_chat_template(msgs, add_generation_prompt=prompt, return_dict=True)["input_ids"]
            assert tok.encode(want, add_special_tokens=False) == list(want_ids)
        ids, mask = encode_chat(chat, "auto", tok)
        answers = "".join(m["content"] + expect_end for m in chat if m["role"] == "assistant")
        targets = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert targets.replace(" ", "") == answers.replace(" ", "")  # a target token may carry the space before
    assert tok.end_of_turn() == expect_end
    assert tok.token_to_id(expect_end) in tok.stop_ids()
    return tok


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    """A SmolLM2-style checkpoint saved by transformers 5: the template in chat_template.jinja, bos_token
    <|im_start|>. zoo used to read tokenizer_config.json only and fall back to its built-in ChatML, rendering
    `<|im_start|><|im_start|>user...` without the default system message."""
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
              "chat_template": UPSTREAM["internlm2"]}  # a stale one: the .jinja file wins, as in transformers
    d = tokenizer_dir(tmp_path / "smollm2", [], config, jinja=SMOLLM2)
    tok = assert_same_as_transformers(d, CHATS, "<|im_end|>")
    text = render(CHATS[0], "auto", tok).text
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.stop_ids() == (tok.token_to_id("<|im_end|>"),)


def test_llama32_template_with_todays_date(tmp_path):
    """Llama 3.1/3.2 templates call strftime_now for the system header's date: today's, as in transformers (zoo
    used to leave it undefined, so the template printed its fixed fallback date)."""
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    d = tokenizer_dir(tmp_path / "llama32", LLAMA3_SPECIALS, config, jinja=LLAMA32)
    tok = assert_same_as_transformers(d, CHATS, "<|eot_id|>")
    text = render(CHATS[0], "auto", tok).text
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n\n" in text and "26 Jul 2024" not in text
    assert tok.stop_ids() == (tok.token_to_id("<|eot_id|>"),)


def test_transformers_template_helpers(tmp_path):
    """{% generation %} blocks, loop controls and transformers' tojson (non-ASCII kept) render as transformers
    renders them."""
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "{{ m['role'] | tojson }}: {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                "{% endgeneration %}{{ eos_token }}{% else %}{{ m['content'] | tojson }}{% endif %}\n{% endfor %}")
    d = tokenizer_dir(tmp_path / "helpers", [], {"bos_token": "<s>", "eos_token": "</s>"}, jinja=template)
    chats = [*CHATS, [{"role": "user", "content": "Ça va ? «oui»"}, {"role": "assistant", "content": "Très bien."}]]
    assert_same_as_transformers(d, chats, "</s>")


PHI3 = """{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"""  # noqa: E501 (Phi-3's template)


def test_any_end_of_turn_token_is_learned(tmp_path):
    """A template whose answers end with a special token zoo has no name for (Phi-3's <|end|>): the token after each
    answer is a target all the same, so the fine-tuned model learns to stop."""
    config = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    d = tokenizer_dir(tmp_path / "phi3", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"],
                      config, jinja=PHI3)
    assert_same_as_transformers(d, CHATS, "<|end|>")
