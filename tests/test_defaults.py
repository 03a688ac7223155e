"""What the recipes choose and say on their own: the learning rate by what is trained, the warmup and --resume
checks, the chat template chosen for a tokenizer without one (and exported with the model), the messages in words."""

import json
import shutil

import pytest

from recipes import sft
from recipes.data import SFTData
from recipes.data.tokenizer_choice import ASSETS, Tokenizer
from zoo.errors import ZooError
from zoo.io.chat import builtin_jinja, render, template_choice
from zoo.io.chat_template import render_template


def test_no_usable_samples_in_words(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ZooError) as e:
        SFTData(str(f), Tokenizer(ASSETS), 64, 0)
    assert str(e.value) == f"no usable chat samples in {f}: 1 file, 1 sample, 1 without an assistant turn (skipped)"


def smollm2_tokenizer(path):
    """The bundled tokenizer as SmolLM2's base checkpoint configures its own: bos <|im_start|>, eos <|im_end|>, no
    chat template."""
    path.mkdir()
    shutil.copyfile(ASSETS / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
        {"role": "assistant", "content": "C-A-T."}]


def test_sft_names_its_template_and_exports_it(tmp_path, capsys):
    """A tokenizer without a chat template: SFT says which one it chose and why, renders no doubled start token,
    and OUT/model and OUT/model-hf carry the template, so transformers renders what the model was trained on."""
    from transformers import AutoTokenizer

    d = smollm2_tokenizer(tmp_path / "smollm2")
    tok = Tokenizer(d)
    trained = render(CHAT, "auto", tok).text
    assert trained.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "<|im_start|><|im_start|>" not in trained
    out = tmp_path / "sft"
    sft.main(["--model", "debug", "--tokenizer", str(d), "--steps", "1", "--out", str(out), "--export-hf",
              "--seq-len", "64", "--batch-tokens", "64", "--no-progress", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert ("chat template: internlm2 (built-in ChatML: the tokenizer has no chat template of its own, and has "
            "<|im_start|>); --chat-template to choose") in printed
    for exported in (out / "model", out / "model-hf"):
        assert (exported / "chat_template.jinja").is_file()
        hf = AutoTokenizer.from_pretrained(str(exported))
        assert hf.apply_chat_template(CHAT, tokenize=False) == trained
        assert hf.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True) == render(
            CHAT[:-1], "internlm2", tok, add_generation_prompt=True).text
        again = Tokenizer(exported)  # and zoo, reading the export, renders it with the same template
        assert template_choice(again).startswith("checkpoint") and render(CHAT, "auto", again).text == trained


@pytest.mark.parametrize("name", ["internlm2", "llama-2", "llama-3"])
def test_builtin_jinja_renders_as_the_builtin(name):
    tok = Tokenizer(ASSETS)
    chats = [CHAT, [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "hello "},
                    {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]]
    for chat in chats:
        jinja = render_jinja_text(builtin_jinja(name, tok), tok, chat)
        assert jinja == render(chat, name, tok).text


def render_jinja_text(template, tok, chat):
    return render_template(template, None, {**tok.template_tokens(), "messages": chat, "add_generation_prompt": False})
