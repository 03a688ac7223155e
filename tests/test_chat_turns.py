"""Every assistant turn trains right under templates whose turns end by position or at the next role (issue 39):
gpt-oss (harmony: `<|end|>` closes earlier turns, `<|call|>` tool calls, `<|return|>` the last; reasoning dropped
once a final answer follows), GLM-4.5 (no end-of-turn token: the next role's token is the stop) and Command R7B
(`<|END_RESPONSE|><|END_OF_TURN_TOKEN|>` inside the span). zoo used to refuse multi-turn gpt-oss and GLM
conversations ("renders differently once later turns follow it") and cut Command R7B's answers before
<|END_OF_TURN_TOKEN|>.

The templates are the published ones (tests/fixtures/chat_templates/README.md). The reference is each template's
`{% generation %}` variant, written here by editing the published text (the edits are checked to render the same
text): transformers' `return_assistant_tokens_mask` of the variant equals zoo's mask of the published template,
token for token. The tokenizers are the bundled tokenizer.json plus each family's special tokens.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from recipes.data.tokenizer_choice import ASSETS
from zoo.io.tokenizer import Tokenizer, encode_chat, render

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
GPT_OSS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
           "<|call|>", "<|constrain|>"]
GLM = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"]
GLM_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
             "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]  # added, not special, as in GLM-4.5
COHERE = ["<BOS_TOKEN>", "<PAD>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
          "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>",
          "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]

# the {% generation %} variants: (published text, variant text), each found exactly once
GPT_OSS_EDITS = [  # a turn starts after <|start|>assistant and runs through <|end|>, <|call|> or <|return|>
    ('{%- if message.content and message.thinking %}',
     '{{- "<|start|>assistant" }}{% generation %}{%- if message.content and message.thinking %}'),
    ('"<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>"',
     '"<|channel|>analysis<|message|>" + message.content + "<|end|><|start|>assistant"'),
    ('"<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}\n            {%- endif %}\n'
     '            {{- "<|start|>assistant to=" }}',
     '"<|channel|>analysis<|message|>" + message.thinking + "<|end|><|start|>assistant" }}\n            {%- endif %}\n'
     '            {{- " to=" }}'),
    ('{{- "<|call|>" }}', '{{- "<|call|>" }}{% endgeneration %}'),
    ('{%- if "thinking" in message %}\n                {{- "<|start|>assistant<|channel|>analysis<|message|>"',
     '{{- "<|start|>assistant" }}{% generation %}{%- if "thinking" in message %}\n'
     '                {{- "<|channel|>analysis<|message|>"'),
    ('+ message.thinking + "<|end|>" }}\n            {%- endif %}\n            {#- <|return|>',
     '+ message.thinking + "<|end|><|start|>assistant" }}\n            {%- endif %}\n            {#- <|return|>'),
    ('{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}',
     '{{- "<|channel|>final<|message|>" + message.content + "<|return|>" }}{% endgeneration %}'),
    ('{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}',
     '{{- "<|start|>assistant" }}{% generation %}{{- "<|channel|>final<|message|>" + message.content + "<|end|>" }}'
     '{% endgeneration %}'),
]
GLM_EDITS = [  # a turn starts after <|assistant|> and runs through the next role's token
    ("<|assistant|>\n{%- set reasoning_content = '' %}", "<|assistant|>{% generation %}\n{%- set reasoning_content = ''"
     " %}"),
    ("</tool_call>{% endfor %}\n{% endif %}\n", "</tool_call>{% endfor %}\n{% endif %}{% endgeneration %}\n"),
    ("{%- if m.role == 'user' -%}<|user|>\n", "{%- if m.role == 'user' -%}{% if not loop.first and "
     "messages[loop.index0 - 1].role == 'assistant' %}{% generation %}<|user|>{% endgeneration %}{% else %}<|user|>"
     "{% endif %}{{ '' }}\n"),
    ("    {{- '<|observation|>' }}", "{% if not loop.first and messages[loop.index0 - 1].role == 'assistant' %}"
     "{% generation %}{{- '<|observation|>' }}{% endgeneration %}{% else %}{{- '<|observation|>' }}{% endif %}"),
]
COHERE_EDITS = [  # a turn starts after <|CHATBOT_TOKEN|> (<|START_RESPONSE|> without tools) through its end tokens
    ("{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>'  + content.strip() + "
     "'<|END_RESPONSE|><|END_OF_TURN_TOKEN|>' }}",
     "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>' }}{% generation %}{{ content.strip() + "
     "'<|END_RESPONSE|><|END_OF_TURN_TOKEN|>' }}{% endgeneration %}"),
]
COHERE_TOOL_EDITS = [
    ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% if message.tool_calls %}",
     "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% generation %}{% if message.tool_calls %}"),
    ("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>{% endif %}", "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>{% endif %}"
     "{% endgeneration %}"),
]


def edited(text, edits):
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def templates(name, variant):
    """The published template(s) of `name` as tokenizer_config.json's chat_template, or their generation variant."""
    def pick(file, edits):
        text = (TEMPLATES / file).read_text()
        return edited(text, edits) if variant else text
    if name == "gpt-oss":
        return pick("gpt_oss.jinja", GPT_OSS_EDITS)
    if name == "glm-4.5":
        return pick("glm45.jinja", GLM_EDITS)
    return [{"name": "default", "template": pick("command_r7b.jinja", COHERE_EDITS)},
            {"name": "tool_use", "template": pick("command_r7b_tool_use.jinja", COHERE_TOOL_EDITS)}]


FAMILIES = {  # name -> (special tokens, plain added tokens, tokenizer_config.json), as the checkpoints have them
    "gpt-oss": (GPT_OSS, [], {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}),
    "glm-4.5": (GLM, GLM_PLAIN, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "command-r7b": (COHERE, [], {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>",
                                 "pad_token": "<PAD>"}),
}


def family_dir(root, name, variant):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    specials, plain, config = FAMILIES[name]
    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    d = root / f"{name}-{variant}"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config, "chat_template": templates(name, variant)}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


def call(city, i=0):
    return {"id": f"call{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **more):
    return {"role": "assistant", "content": text, **more}


def tool(text, i=0):
    return {"role": "tool", "content": text, "tool_call_id": f"call{i}"}


# reasoning under the name each template reads (transformers passes messages as given)
TOOL_ROUND = [user("Weather in Paris?"), assistant("", thinking="Need the tool.", tool_calls=[call("Paris")]),
              tool("sunny")]
HARMONY = [{"role": "system", "content": "You are brief."}, user("Hi!"),
           assistant("Hello!", thinking="Greet back."), *TOOL_ROUND,
           assistant("", thinking="And Rome.", tool_calls=[call("Rome", 1)]), tool("rainy", 1),
           assistant("Sunny in Paris, rainy in Rome.", thinking="Both known.")]
GLM_CHAT = [user("Hi!"), assistant("Hello!", reasoning_content="Greet back."), user("Weather in Paris?"),
            assistant("", reasoning_content="Need the tool.", tool_calls=[call("Paris")]), tool("sunny"),
            assistant("Sunny.", reasoning_content="Got it."), user("Thanks!"), assistant("<think>Polite.</think>Bye.")]
GLM_TWO_CALLS = [{"role": "system", "content": "Be brief."}, user("Paris and Rome?"),
                 assistant("Checking.", reasoning_content="Two cities.", tool_calls=[call("Paris"), call("Rome", 1)]),
                 tool("sunny"), tool("rainy", 1), assistant("Sunny, rainy."), assistant("Anything else?")]
COHERE_TOOLS = [user("Weather in Paris?"), assistant("", tool_plan="Call the tool.", tool_calls=[call("Paris")]),
                tool("sunny"), assistant("Sunny in Paris."), user("Thanks!"), assistant("Welcome.")]
COHERE_CHAT = [{"role": "system", "content": "Be brief."}, user("Hi!"), assistant("Hello!"), user("Spell cat."),
               assistant(" C-A-T. ")]
CASES: dict[str, list[tuple[Any, Any, dict[str, Any]]]] = {  # family -> [(chat, tools, template switches)]
    "gpt-oss": [(HARMONY, [WEATHER], {}), (TOOL_ROUND, [WEATHER], {"reasoning_effort": "low"})],
    "glm-4.5": [(GLM_CHAT, [WEATHER], {}), (GLM_TWO_CALLS, [WEATHER], {})],
    "command-r7b": [(COHERE_CHAT, None, {}), (COHERE_TOOLS, [WEATHER], {})],
}
IDS = [f"{family}-{i}" for family, cases in CASES.items() for i in range(len(cases))]

# what each assistant turn trains on, as the whole conversation renders it
EXPECTED = {
    ("gpt-oss", 0): [
        "<|channel|>final<|message|>Hello!<|end|>",  # earlier reasoning dropped, <|end|> where more follows
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',  # analysis dropped
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>',
        "<|channel|>analysis<|message|>Both known.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Sunny in Paris, rainy in Rome.<|return|>"],
    ("gpt-oss", 1): [  # no final answer follows: the tool call keeps its analysis
        '<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather<|channel|>'
        'commentary json<|message|>{"city": "Paris"}<|call|>'],
    ("glm-4.5", 0): [
        "\n<think></think>\nHello!<|user|>",  # reasoning before the last user query emptied, as GLM-4.5 renders it
        "\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call><|observation|>",
        "\n<think></think>\nSunny.<|user|>",
        "\n<think>Polite.</think>\nBye."],  # nothing follows the last turn
    ("glm-4.5", 1): [  # two calls in one turn, their two results under one <|observation|>, two answers in a row
        "\n<think>Two cities.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
        "</tool_call><|observation|>",
        "\n<think></think>\nSunny, rainy.",  # another assistant turn follows: its <|assistant|> is a header
        "\n<think></think>\nAnything else?"],
    ("command-r7b", 0): ["Hello!<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "C-A-T.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"],
    ("command-r7b", 1): [
        '<|START_THINKING|>Call the tool.<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": '
        '"get_weather", "parameters": {"city": "Paris"}}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>',
        "<|START_RESPONSE|>Sunny in Paris.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
        "<|START_RESPONSE|>Welcome.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"],
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (zoo's Tokenizer of the published template, transformers' of it, transformers' of the variant,
    zoo's of the variant)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("turns")
    out = {}
    for name in FAMILIES:
        published, variant = family_dir(root, name, False), family_dir(root, name, True)
        out[name] = (Tokenizer(published), AutoTokenizer.from_pretrained(str(published)),
                     AutoTokenizer.from_pretrained(str(variant)), Tokenizer(variant))
    return out


@pytest.mark.parametrize("family, case", [(f, i) for f, cases in CASES.items() for i in range(len(cases))], ids=IDS)
def test_every_turn_equals_the_generation_variants_mask(tokenizers, family, case):
    tok, hf, variant, zoo_variant = tokenizers[family]
    chat, tools, switches = CASES[family][case]
    kwargs = dict(tools=tools, **switches)
    want = hf.apply_chat_template(chat, tokenize=False, **kwargs)
    assert variant.apply_chat_template(chat, tokenize=False, **kwargs) == want  # the variant renders the same text
    rendered = render(chat, "auto", tok, **kwargs)
    assert rendered.text == want
    assert [rendered.text[a:b] for a, b in rendered.spans] == EXPECTED[family, case]
    ids, mask = encode_chat(chat, "auto", tok, **kwargs)
    out = variant.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True, **kwargs)
    assert ids == list(out["input_ids"])
    assert [int(m) for m in mask] == list(out["assistant_masks"])
    assert encode_chat(chat, "auto", zoo_variant, **kwargs) == (ids, mask)  # zoo's reading of the blocks agrees


def test_generation_stops_where_a_turn_is_trained_to_end(tokenizers):
    """GLM-4.5 prints nothing after an answer that ends the conversation: its end of turn (a stop id of generation)
    is the token that opens the user's next message, the one its turns are trained to end with (zoo found none)."""
    assert {f: tokenizers[f][0].end_of_turn() for f in FAMILIES} == {
        "gpt-oss": "<|return|>", "glm-4.5": "<|user|>", "command-r7b": "<|END_RESPONSE|>"}
    tok = tokenizers["glm-4.5"][0]
    assert tok.stop_ids() == (tok.eos_id, tok.token_to_id("<|user|>"))
