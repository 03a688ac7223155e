"""The tokenizer of an export reads in transformers to the ids zoo prompts with: `python -m zoo.generate --prompt`
encodes by the checkpoint's rule (the bundled tokenizer's: the bos before the text), so transformers' AutoTokenizer
on OUT/model-hf (and OUT/model) must too; a chat, whose template writes its own bos, encodes alike through
apply_chat_template."""

import pytest
from transformers import AutoTokenizer

from recipes import pretrain
from recipes.data.tokenizer_choice import ASSETS
from zoo.io.tokenizer import Tokenizer, render

TEXTS = ["Return the list", "hello world", " leading space", "Déjà vu <|im_end|> after", ""]
CHATS = [[{"role": "user", "content": "What is a tuple?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And a list?"}]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    pretrain.main(["--steps", "1", "--warmup", "1", "--seq-len", "64", "--batch-tokens", "128", "--no-progress",
                   "--device", "cpu", "--export-hf", "--out", str(out)])
    return out


@pytest.mark.parametrize("layout", ["model-hf", "model"])
def test_transformers_encodes_an_export_as_zoo_prompts(exported, layout):
    bundled = Tokenizer(ASSETS)
    assert bundled.bos_id == 0 and bundled.encode("hello world")[:1] == [0]  # the bundled tokenizer adds its bos
    hf = AutoTokenizer.from_pretrained(exported / layout)
    tok = Tokenizer(exported / layout)
    for text in TEXTS:
        want = tok.encode(text)  # what zoo.generate.cli prompts with
        assert want == bundled.encode(text) and want[0] == 0, text
        assert hf(text).input_ids == want, text
        assert hf.encode(text) == want, text
        assert hf(text, add_special_tokens=False).input_ids == want[1:], text
    for chat in CHATS:  # the template writes the bos itself: once, in both
        text = render(chat, "auto", tok, add_generation_prompt=True).text
        ids = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert ids == tok.encode(text, add_special_tokens=False) and ids.count(0) == 1, chat
        assert hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
