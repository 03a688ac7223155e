"""The tokenizer of an export reads in transformers to the ids zoo prompts with: `python -m zoo.generate --prompt`
puts the bos before the text, so transformers' AutoTokenizer on OUT/model-hf (and OUT/model) must too; a chat,
whose template writes its own bos, encodes alike through apply_chat_template. zoo's own encoding is unchanged."""

import pytest
from transformers import AutoTokenizer

from convert.common import with_bos
from recipes import pretrain
from recipes.tokenizer import ASSETS
from zoo.io.tokenizer import Tokenizer, render

TEXTS = ["Return the list", "hello world", " leading space", "Déjà vu <|im_end|> after", ""]
CHATS = [[{"role": "user", "content": "What is a tuple?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And a list?"}]]


def zoo_prompt(tok: Tokenizer, text: str) -> list[int]:
    """The ids zoo.generate.cli prompts with: the bos, then the text."""
    assert tok.bos_id is not None
    ids = tok.encode(text)
    return ids if ids[:1] == [tok.bos_id] else [tok.bos_id, *ids]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    pretrain.main(["--steps", "1", "--warmup", "1", "--seq-len", "64", "--batch-tokens", "128", "--no-progress",
                   "--device", "cpu", "--export-hf", "--out", str(out)])
    return out


@pytest.mark.parametrize("layout", ["model-hf", "model"])
def test_transformers_encodes_an_export_as_zoo_prompts(exported, layout):
    bundled = Tokenizer(ASSETS)
    assert bundled.bos_id == 0 and bundled.encode("hello world")[:1] != [0]  # the bundled tokenizer adds no bos
    hf = AutoTokenizer.from_pretrained(exported / layout)
    tok = Tokenizer(exported / layout)
    for text in TEXTS:
        assert tok.encode(text) == bundled.encode(text), text  # zoo's encoding: unchanged, nothing added
        want = zoo_prompt(tok, text)
        assert want[0] == 0
        assert hf(text).input_ids == want, text
        assert hf.encode(text) == want, text
        assert hf(text, add_special_tokens=False).input_ids == want[1:], text
    for chat in CHATS:  # the template writes the bos itself: once, in both
        text = render(chat, "auto", tok, add_generation_prompt=True).text
        ids = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert ids == tok.encode(text) and ids.count(0) == 1, chat
        assert hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text


def test_a_tokenizer_that_adds_the_bos_already_is_kept(tmp_path, exported):
    """with_bos writes nothing over a tokenizer.json whose post-processor adds the bos (the export's, Llama 3's):
    run twice, it adds the bos once; files given to it (zoo_to_hf's rewritten ones) are kept."""
    assert with_bos(exported / "model-hf") == {}
    assert with_bos(ASSETS, {"x.json": "{}"}).keys() == {"x.json", "tokenizer.json"}
    twice = tmp_path / "twice"
    twice.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (twice / name).write_text((ASSETS / name).read_text())
    (twice / "tokenizer.json").write_text(with_bos(twice)["tokenizer.json"])
    assert with_bos(twice) == {}
    assert AutoTokenizer.from_pretrained(twice)("hi").input_ids == [0, *Tokenizer(ASSETS).encode("hi")]
