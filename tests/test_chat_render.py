"""Chat templates that look at the messages (issue 32): zoo renders the text transformers' apply_chat_template
renders, to the character and the token, for templates with the shapes published checkpoints use — Qwen3 and
Qwen3.5 (reasoning, tools, enable_thinking), DeepSeek-R1 (earlier reasoning dropped), Llama 3.1 (tools, ipython,
today's date), Mistral (system prompt in the last [INST]), Gemma (no system role, `model` turns) — and the spans it
trains on are each assistant turn as the model writes it, through its end-of-turn token.

zoo used to hand templates a marker instead of each answer and strip every message: 4 of 18 renderings of these
shapes equalled transformers'. The templates (tests/fixtures/chat_templates/) are written for these tests with the
logic of the published ones; transformers' side is a PreTrainedTokenizerFast over the bundled tokenizer.json.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import test_chat_templates as base

from recipes.data.tokenizer_choice import ASSETS
from zoo.errors import ZooError
from zoo.io.tokenizer import Tokenizer, encode_chat, render

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN_TOKENS = (["<|im_start|>", "<|im_end|>", "<|endoftext|>"],  # special, and added as plain text as in Qwen3
               ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
R1_TOKENS = (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
              "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
              "<｜tool▁sep｜>",
              "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
             ["<think>", "</think>"])
FAMILIES = {  # name -> (template file, special tokens, plain added tokens, tokenizer_config.json)
    "qwen3": ("qwen3.jinja", *QWEN_TOKENS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3.5": ("qwen35.jinja", *QWEN_TOKENS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "deepseek-r1": ("deepseek_r1.jinja", *R1_TOKENS,
                    {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "llama-3.1": ("llama31.jinja", [*base.LLAMA3_SPECIALS, "<|eom_id|>", "<|python_tag|>"], [],
                  {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "mistral": ("mistral.jinja", ["[INST]", "[/INST]"], [], {"bos_token": "<s>", "eos_token": "</s>"}),
    "gemma": ("gemma.jinja", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], [],
              {"bos_token": "<bos>", "eos_token": "<eos>"}),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **more):
    return {"role": "assistant", "content": text, **more}


SIMPLE = [user("What is 2 plus 3?"), assistant("2 plus 3 is 5."), user("  And 4 plus 4? "),
          assistant(" 8, as  8 = 4 + 4.\n")]  # spaces kept: transformers strips nothing
SYSTEM = [{"role": "system", "content": "You are brief."}, *SIMPLE]
THINKING = [user("Hi!"), assistant("<think>\nGreet back.\n</think>\n\nHello!"), user("Spell cat."),
            assistant("C-A-T.", reasoning_content="Three letters.")]
TOOLS = [user("Weather in Paris?"), assistant("", tool_calls=[CALL]),
         {"role": "tool", "content": '{"sky": "sunny"}'}, assistant("Sunny in Paris.")]
TOOLS_NO_CONTENT = [user("Weather in Paris?"), {"role": "assistant", "tool_calls": [CALL]},  # TRL: no content
                    {"role": "tool", "content": "sunny"}, assistant("Sunny."), user("Thanks!"), assistant("Welcome.")]
MULTI_STEP = [user("Weather in Paris?"), assistant("<think>\nNeed the tool.\n</think>\n\n", tool_calls=[CALL]),
              {"role": "tool", "content": "sunny"}, assistant("<think>\nGot it.\n</think>\n\nSunny."),
              user("And tomorrow?"), assistant("<think>\nNo tool for that.\n</think>\n\nNo idea.")]
LLAMA_TOOLS = [user("Weather in Paris?"), {"role": "assistant", "tool_calls": [CALL]},
               {"role": "ipython", "content": "sunny"}, assistant("Sunny in Paris.")]

# family -> [(chat, tools, template switches)]
CASES: dict[str, list[tuple[Any, Any, dict[str, Any]]]] = {
    "qwen3": [(SYSTEM, None, {}), (THINKING, None, {}), (THINKING, None, {"enable_thinking": False}),
              (TOOLS, [WEATHER], {}), (TOOLS_NO_CONTENT, [WEATHER], {}), (SIMPLE, None, {"enable_thinking": False}),
              (MULTI_STEP, [WEATHER], {})],
    "qwen3.5": [(SYSTEM, None, {}), (THINKING, None, {}), (THINKING, None, {"enable_thinking": False}),
                (TOOLS, [WEATHER], {}), (TOOLS_NO_CONTENT, [WEATHER], {}), (MULTI_STEP, [WEATHER], {})],
    "deepseek-r1": [(SYSTEM, None, {}), (THINKING, None, {}), (TOOLS, None, {}), (MULTI_STEP, None, {})],
    "llama-3.1": [(SYSTEM, None, {}), (LLAMA_TOOLS, [WEATHER], {}), (LLAMA_TOOLS, [WEATHER], {"builtin_tools":
                                                                                                ["get_weather"]}),
                  (SIMPLE, None, {"date_string": "26 Jul 2024"})],
    "mistral": [(SIMPLE, None, {}), (SYSTEM, None, {})],
    "gemma": [(SIMPLE, None, {})],
}
IDS = [f"{family}-{i}" for family, cases in CASES.items() for i in range(len(cases))]


def family_dir(tmp_path, family):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    jinja, specials, plain, config = FAMILIES[family]
    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    d = tmp_path / family
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    (d / "chat_template.jinja").write_text((TEMPLATES / jinja).read_text())
    return d


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (zoo's Tokenizer, transformers' tokenizer) over the same directory."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    return {f: (Tokenizer(d), AutoTokenizer.from_pretrained(str(d))) for f in FAMILIES if (d := family_dir(root, f))}


@pytest.mark.parametrize("family, case", [(f, i) for f, cases in CASES.items() for i in range(len(cases))], ids=IDS)
def test_text_and_ids_equal_transformers(tokenizers, family, case):
    tok, hf = tokenizers[family]
    chat, tools, switches = CASES[family][case]
    for msgs, prompt in ((chat, False), (chat[:-1], True)):
        want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=prompt, **switches)
        got = render(msgs, "auto", tok, add_generation_prompt=prompt, tools=tools, **switches)
        assert got.text == want
        want_ids = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=prompt, return_dict=True,
                                          **switches)["input_ids"]
        assert tok.encode(got.text, add_special_tokens=False) == list(want_ids)
    ids, mask = encode_chat(chat, "auto", tok, tools=tools, **switches)
    assert ids == list(hf.apply_chat_template(chat, tools=tools, return_dict=True, **switches)["input_ids"])
    # every assistant turn is trained on, each ending with its end-of-turn token, nothing else is
    rendered = render(chat, "auto", tok, tools=tools, **switches)
    text, spans = rendered.text, rendered.spans
    assert len(spans) == sum(m["role"] == "assistant" for m in chat)
    ends = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|eot_id|>", "<|eom_id|>", "</s>", "<end_of_turn>")
    assert all(text[a:b].endswith(ends) for a, b in spans)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]).replace(" ", "") == "".join(
        text[a:b] for a, b in spans).replace(" ", "")


# what each assistant turn trains on: what the model writes after the generation prompt, through its end of turn
EXPECTED = {
    # reasoning kept after the last user query only: the earlier turn trains on its final text, without it
    ("qwen3", 1): ["Hello!<|im_end|>", "<think>\nThree letters.\n</think>\n\nC-A-T.<|im_end|>"],
    # thinking off: the generation prompt holds the empty think block, so the answer alone is written
    ("qwen3", 2): ["Hello!<|im_end|>", "Three letters.\n</think>\n\nC-A-T.<|im_end|>"],
    ("qwen3", 5): ["2 plus 3 is 5.<|im_end|>", " 8, as  8 = 4 + 4.\n<|im_end|>"],
    # a tool-call turn with empty content: no newline before <tool_call> (zoo's marker used to put one there)
    ("qwen3", 3): ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   "</tool_call><|im_end|>", "<think>\n\n</think>\n\nSunny in Paris.<|im_end|>"],
    ("qwen3", 4): ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                   "Sunny.<|im_end|>", "<think>\n\n</think>\n\nWelcome.<|im_end|>"],
    # a tool call and its answer before a later query: both lose their reasoning in the final text
    ("qwen3", 6): ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                   "Sunny.<|im_end|>", "<think>\nNo tool for that.\n</think>\n\nNo idea.<|im_end|>"],
    ("qwen3.5", 1): ["Hello!<|im_end|>", "Three letters.\n</think>\n\nC-A-T.<|im_end|>"],
    ("qwen3.5", 2): ["Hello!<|im_end|>", "Three letters.\n</think>\n\nC-A-T.<|im_end|>"],
    ("qwen3.5", 3): ["\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "</function>\n</tool_call><|im_end|>", "\n</think>\n\nSunny in Paris.<|im_end|>"],
    # R1: earlier reasoning dropped and trimmed; the last turn keeps it after the prompt's "<think>\n"
    ("deepseek-r1", 1): ["Hello!<｜end▁of▁sentence｜>", "C-A-T.<｜end▁of▁sentence｜>"],
    ("deepseek-r1", 2): ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                         '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
                         "Sunny in Paris.<｜end▁of▁sentence｜>"],
    ("llama-3.1", 1): ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                       "Sunny in Paris.<|eot_id|>"],
    ("llama-3.1", 2): ['<|python_tag|>get_weather.call(city="Paris")<|eom_id|>', "Sunny in Paris.<|eot_id|>"],
    # the system prompt is printed in the last [INST] only (so not at all when an answer ends the conversation)
    ("mistral", 1): [" 2 plus 3 is 5.</s>", "  8, as  8 = 4 + 4.\n</s>"],
    ("gemma", 0): ["2 plus 3 is 5.<end_of_turn>", "8, as  8 = 4 + 4.<end_of_turn>"],
}


@pytest.mark.parametrize("family, case", sorted(EXPECTED), ids=[f"{f}-{i}" for f, i in sorted(EXPECTED)])
def test_each_turn_trains_on_what_the_model_writes(tokenizers, family, case):
    tok, _ = tokenizers[family]
    chat, tools, switches = CASES[family][case]
    rendered = render(chat, "auto", tok, tools=tools, **switches)
    assert [rendered.text[a:b] for a, b in rendered.spans] == EXPECTED[family, case]


def test_deepseek_r1_reasoning_of_the_last_turn_is_trained(tokenizers):
    """R1 keeps the last turn's reasoning: the model writes it after the prompt's `<think>\\n`."""
    tok, _ = tokenizers["deepseek-r1"]
    chat = [user("Hi!"), assistant("<think>\nGreet back.\n</think>\n\nHello!")]
    rendered = render(chat, "auto", tok)
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["Greet back.\n</think>\n\nHello!<｜end▁of▁sentence｜>"]


def plain_dir(tmp_path, name, template, specials=("<|im_start|>", "<|im_end|>")):
    return base.tokenizer_dir(tmp_path / name, list(specials), {"bos_token": "<s>", "eos_token": "<|im_end|>"},
                              jinja=template)


CONTENT_TESTS = (  # the template looks at the answer: truthiness, slicing, filters (the last point)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if not m.content %}(nothing){% else %}"
    "{{ m.content[0] | upper }}{{ m.content[1:] | replace('  ', ' ') }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_templates_that_look_at_the_content(tmp_path):
    from transformers import AutoTokenizer

    d = plain_dir(tmp_path, "content", CONTENT_TESTS)
    tok, hf = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    chat = [user("say  it"), assistant("yes  sir"), user("again"), assistant(""), user("last"), assistant("ok")]
    rendered = render(chat, "auto", tok)
    assert rendered.text == hf.apply_chat_template(chat, tokenize=False)
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["Yes sir<|im_end|>", "(nothing)<|im_end|>",
                                                               "Ok<|im_end|>"]


GENERATION = (  # SmolLM3's way: the answer and its end-of-turn token inside {% generation %}
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}\n{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_generation_blocks_give_transformers_assistant_mask(tmp_path):
    """A template with {% generation %} blocks: the targets are its blocks, token for token what transformers'
    return_assistant_tokens_mask marks."""
    from transformers import AutoTokenizer

    d = plain_dir(tmp_path, "generation", GENERATION)
    tok, hf = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    for chat in (SIMPLE, SYSTEM):
        out = hf.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = encode_chat(chat, "auto", tok)
        assert ids == list(out["input_ids"])
        assert [int(m) for m in mask] == list(out["assistant_masks"])


def test_generation_block_without_the_end_token_still_trains_it(tmp_path):
    """A block holding only the answer (the end-of-turn token printed after it): zoo adds that token to the span,
    so the model learns to stop."""
    d = plain_dir(tmp_path, "generation_out", GENERATION.replace("<|im_end|>{% endgeneration %}",
                                                                 "{% endgeneration %}<|im_end|>"))
    rendered = render(SIMPLE, "auto", Tokenizer(d))
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["2 plus 3 is 5.<|im_end|>",
                                                               " 8, as  8 = 4 + 4.\n<|im_end|>"]


def test_generation_block_in_a_macro_is_refused(tmp_path):
    """Printed from a macro, a block's place in the output cannot be told (transformers marks the wrong tokens)."""
    template = ("{% macro answer(m) %}Answer: {% generation %}{{ m.content }}{% endgeneration %}{% endmacro %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ answer(m) if m.role == 'assistant' else "
                "m.content }}<|im_end|>\n{% endfor %}")
    d = plain_dir(tmp_path, "macro", template)
    chat = render(SIMPLE, "auto", Tokenizer(d), add_generation_prompt=True)  # generation needs no spans
    assert chat.text.startswith("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\nAnswer: ")
    with pytest.raises(ZooError, match=r"generation %\} block from inside a macro") as e:
        encode_chat(SIMPLE, "auto", Tokenizer(d))
    assert "\n" not in str(e.value)


def test_a_turn_that_cannot_be_located_is_refused_in_one_line(tmp_path):
    """Earlier answers replaced by something else once later turns exist: which text is the answer cannot be
    told, so zoo names the turn and what to do instead of training on a guess."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
                "[earlier answer]{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    d = plain_dir(tmp_path, "hidden", template)
    with pytest.raises(ZooError, match=r"assistant turn 1 renders differently once later turns follow it .*"
                                       r"\{% generation %\} blocks, or split the conversation") as e:
        encode_chat(SIMPLE, "auto", Tokenizer(d))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, template, specials, config, chats, end", [
    ("bundled", None, [], None, base.CHATS, "<|im_end|>"),
    ("smollm2", base.SMOLLM2, [], {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, base.CHATS, "<|im_end|>"),
    ("llama32", base.LLAMA32, base.LLAMA3_SPECIALS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
     base.CHATS, "<|eot_id|>"),
    ("phi3", base.PHI3, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"],
     {"bos_token": "<s>", "eos_token": "<|endoftext|>"}, base.CHATS, "<|end|>"),
], ids=["bundled", "smollm2", "llama32", "phi3"])
def test_the_existing_templates_keep_their_spans(tmp_path, name, template, specials, config, chats, end):
    """The templates of tests/test_chat_templates.py and the bundled tokenizer's: each answer with its end of turn,
    the messages' spaces kept."""
    d = ASSETS if template is None else base.tokenizer_dir(tmp_path / name, specials, config, jinja=template)
    tok = Tokenizer(d)
    for chat in [*chats, SIMPLE]:
        rendered = render(chat, "checkpoint", tok)
        assert [rendered.text[a:b] for a, b in rendered.spans] == [
            (m["content"].strip() if name == "llama32" else m["content"]) + end
            for m in chat if m["role"] == "assistant"]


def test_builtin_templates_refuse_tools_and_switches():
    tok = Tokenizer(ASSETS)
    with pytest.raises(ZooError, match="built-in internlm2 chat template takes no tools or template switches "
                                       r"\(got tools, enable_thinking\)"):
        render(SIMPLE, "internlm2", tok, tools=[WEATHER], enable_thinking=False)
    with pytest.raises(ZooError, match="message 1 .'assistant'. has NoneType"):
        render(TOOLS_NO_CONTENT, "internlm2", tok)


def test_special_tokens_are_those_configured(tmp_path):
    """A template sees the special tokens tokenizer_config.json names (sep, cls and mask too), none guessed from the
    vocabulary: zoo used to pass bos_token <s> where the config named none."""
    from transformers import AutoTokenizer

    template = ("[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ sep_token }}|{{ cls_token }}|{{ mask_token }}]"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    d = base.tokenizer_dir(tmp_path / "specials", ["<sep>", "<cls>", "<mask>"],
                           {"eos_token": "</s>", "sep_token": "<sep>", "cls_token": "<cls>", "mask_token": "<mask>"},
                           jinja=template)
    want = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(SIMPLE, tokenize=False)
    assert render(SIMPLE, "auto", Tokenizer(d)).text == want
    assert want.startswith("[|</s>||<sep>|<cls>|<mask>]")


def test_named_templates_take_tool_use_when_tools_are_given(tmp_path):
    """tokenizer_config.json with named templates: "default", and "tool_use" when tools are given, as transformers
    picks them."""
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"},
             {"name": "tool_use", "template": "{{ tools | tojson }}{% for m in messages %}{{ m.content }}<|im_end|>"
                                              "{% endfor %}"}]
    d = base.tokenizer_dir(tmp_path / "named", ["<|im_end|>"], {"eos_token": "<|im_end|>", "chat_template": named})
    tok, hf = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    for tools in (None, [WEATHER]):
        assert render(SIMPLE, "auto", tok, tools=tools).text == hf.apply_chat_template(SIMPLE, tools=tools,
                                                                                       tokenize=False)
    assert render(SIMPLE, "auto", tok, tools=[WEATHER]).text.startswith('[{"type": "function"')


def test_an_end_of_turn_printed_only_once_more_turns_follow_is_trained(tmp_path):
    """A template closing a turn only when another follows: an earlier answer's span takes the token after it (the
    last, closed by nothing, ends where its text does, trailing whitespace left out)."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if not loop.last %}<|im_end|>\n"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rendered = render(SIMPLE, "auto", Tokenizer(plain_dir(tmp_path, "open_end", template)))
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["2 plus 3 is 5.<|im_end|>", " 8, as  8 = 4 + 4."]
