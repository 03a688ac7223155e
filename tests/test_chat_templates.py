"""Chat templates: zoo's rendering and token ids against transformers' apply_chat_template of the same chat.

The transformers tokenizers are built locally from the bundled tokenizer.json (plus each family's special
tokens) and a tokenizer_config.json holding the upstream template string; no hub access.
"""

import json

import pytest

from recipes.tokenizer import ASSETS, Tokenizer, encode_chat, render
from zoo.errors import ZooError

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


def test_auto_picks_checkpoint_template_then_tokens(tmp_path):
    d = make_tokenizer_dir(tmp_path, "llama-3", with_template=False)
    tok = Tokenizer(d)
    assert render(CHATS[0], "auto", tok).text == render(CHATS[0], "llama-3", tok).text
    bundled = Tokenizer(ASSETS)  # ships its ChatML template in tokenizer_config.json
    assert render(CHATS[1], "auto", bundled).text == render(CHATS[1], "internlm2", bundled).text


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
