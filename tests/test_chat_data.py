"""Tools and template switches from data to template (issue 32): SFT samples in TRL's conversational format with a
`tools` column, tool-call turns and per-sample `chat_template_kwargs`, the recipe's --chat-template-kwargs, and
the generate CLI's --chat with --tools and --chat-template-kwargs, each giving the ids transformers'
apply_chat_template gives; malformed input refused in one line naming the file and line."""

import io
import json
import re

import pytest
import test_chat_render as cr
import torch

import zoo
from recipes.data.chat import SFTData, check_messages
from recipes.data.tokenizer_choice import ASSETS
from recipes.engine.config import parse
from recipes.sft import SFTConfig
from zoo.errors import ZooError
from zoo.io.tokenizer import Tokenizer

SAMPLES = [  # (the JSONL object, the tools and switches transformers is given)
    ({"messages": cr.TOOLS, "tools": [cr.WEATHER]}, [cr.WEATHER], {}),
    ({"messages": cr.TOOLS_NO_CONTENT, "tools": json.dumps([cr.WEATHER])}, [cr.WEATHER], {}),  # tools as text
    ({"messages": cr.THINKING}, None, {"enable_thinking": False}),  # the recipe's switch
    ({"messages": cr.THINKING, "chat_template_kwargs": {"enable_thinking": True}}, None, {"enable_thinking": True}),
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_samples_with_tools_and_switches_equal_transformers(tmp_path):
    from transformers import AutoTokenizer

    d = cr.family_dir(tmp_path, "qwen3")
    tok, hf = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    f = write_jsonl(tmp_path / "chat.jsonl", [obj for obj, _, _ in SAMPLES])
    data = SFTData(str(f), tok, 1024, seed=0, template_kwargs={"enable_thinking": False})
    assert data.stats["used"] == len(SAMPLES)
    for (ids_T, mask_T), (obj, tools, switches) in zip(data.samples, SAMPLES, strict=True):
        want = hf.apply_chat_template(obj["messages"], tools=tools, return_dict=True, **switches)["input_ids"]
        assert ids_T.tolist() == list(want)
        targets = tok.decode(ids_T[mask_T].tolist())
        assert targets.count("<|im_end|>") == sum(m["role"] == "assistant" for m in obj["messages"])
        if obj["messages"] is not cr.THINKING:  # the tool call is trained on like any answer
            assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in targets
        assert not any(m["content"] in targets for m in obj["messages"] if m["role"] in ("user", "tool"))


@pytest.mark.parametrize("row, match", [
    ({"messages": [{"role": "assistant", "content": None}]}, r"expected string content .* in message 0 \(assistant\)"),
    ({"messages": [{"role": "assistant"}]}, r"expected string content .* in message 0 \(assistant\)"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     r"expected tool_calls as .* in message 0 \(assistant\)"),
    ({"messages": [{"role": "assistant", "tool_calls": {"function": {"name": "f"}}}]}, "expected tool_calls as"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "expected tool_calls on assistant messages only"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]},
     "expected string reasoning_content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}}, "expected \"tools\" as a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "[{"}, "\"tools\" is a string but not JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
     "expected \"chat_template_kwargs\" as an object"),
])
def test_malformed_samples_are_refused_in_one_line(tmp_path, row, match):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"messages": cr.SIMPLE}, row])
    with pytest.raises(ZooError, match=r"bad\.jsonl:2: " + match) as e:
        SFTData(str(f), Tokenizer(ASSETS), 256, seed=0)
    assert "\n" not in str(e.value)


def test_tool_call_turns_without_content_are_accepted():
    assert check_messages("c.jsonl", 1, {"messages": cr.TOOLS_NO_CONTENT}) == cr.TOOLS_NO_CONTENT
    calls = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    assert check_messages("c.jsonl", 1, {"messages": calls}) == calls


def test_recipe_flag_takes_a_json_object():
    cfg = parse(SFTConfig, ["--chat-template-kwargs", '{"enable_thinking": false}'])
    assert json.loads(cfg.data.chat_template_kwargs) == {"enable_thinking": False}
    assert parse(SFTConfig, []).data.chat_template_kwargs == "{}"
    for bad in ("[1]", "{enable_thinking: false}"):
        with pytest.raises(ZooError, match="--chat-template-kwargs must be a JSON object, got"):
            parse(SFTConfig, ["--chat-template-kwargs", bad])


@pytest.fixture
def qwen3_checkpoint(tmp_path):
    """The debug model with the bundled tokenizer and the Qwen3-style template."""
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    zoo.save(zoo.load("debug"), ckpt, tokenizer_from=ASSETS)
    (ckpt / "chat_template.jinja").write_text((cr.TEMPLATES / "qwen3.jinja").read_text())
    return ckpt


def test_generate_chat_passes_tools_and_switches(qwen3_checkpoint, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from zoo.generate import cli

    prompts = []

    def fake_generate(model, prompts_T, **kwargs):  # the prompt is what is checked: no need to decode
        prompts.append(prompts_T[0].tolist())

    monkeypatch.setattr(cli, "generate", fake_generate)
    (tmp_path / "tools.json").write_text(json.dumps([cr.WEATHER]))
    argv = [str(qwen3_checkpoint), "--chat", "--tools", str(tmp_path / "tools.json"), "--chat-template-kwargs",
            '{"enable_thinking": false}', "--device", "cpu"]
    assert cli.main(argv, stdin=io.StringIO("Weather in Paris?\n"), stdout=io.StringIO()) == 0
    hf = AutoTokenizer.from_pretrained(str(qwen3_checkpoint))
    want = hf.apply_chat_template([cr.user("Weather in Paris?")], tools=[cr.WEATHER], add_generation_prompt=True,
                                  enable_thinking=False, return_dict=True)["input_ids"]
    assert prompts == [list(want)]
    text = Tokenizer(qwen3_checkpoint).decode(prompts[0])
    assert '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("flags, match", [
    (["--tools", "missing.json"], "--tools missing.json: cannot be read"),
    (["--tools", "tools.json"], r"--tools tools.json: expected a JSON list of tool schemas \(objects\)"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object"),
    (["--chat-template-kwargs", "{x"], "--chat-template-kwargs: expected a JSON object"),
])
def test_generate_chat_refuses_bad_tools_and_switches(tmp_path, monkeypatch, capsys, flags, match):
    from zoo.generate.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.json").write_text('{"name": "f"}')
    assert main([str(tmp_path), "--chat", *flags], stdin=io.StringIO("")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {match.split(':')[0]}")
    assert re.search(match, err[0])
    assert main([str(tmp_path), "--prompt", "x", *flags]) == 2
    assert "apply to --chat only" in capsys.readouterr().err
