"""Tokenizers and chat templates, for `python -m zoo.generate` and the recipes.

`Tokenizer` reads a tokenizer.json (the `tokenizers` library) or a sentencepiece tokenizer.model, and the special
tokens of tokenizer_config.json (special_tokens_map.json for what it lacks). It encodes text with character offsets
and adds nothing to it (no bos): a chat template writes its own.

The chat template is found as transformers 5 finds it: `chat_template.jinja` beside the tokenizer wins over the
`chat_template` of tokenizer_config.json (a string, or named templates of which "default" is used); a processor's
`chat_template.json` (LLaVA) comes last. It is rendered in jinja2's immutable sandbox with what transformers gives
templates (`raise_exception`, `strftime_now` with today's date, a `tojson` keeping non-ASCII text, loop controls,
`{% generation %}` blocks, the special tokens by name), so text and ids equal `apply_chat_template`'s. Built-in
templates serve tokenizers without one: "internlm2" (ChatML), "llama-2" and "llama-3", written here in Python.

For training, a chat is rendered to text, then tokenized in one piece (so the ids are what the model sees at
inference), and the loss mask is read off the character spans of the assistant turns: an assistant's content and
the end-of-turn token after it are targets, everything else (system, user, role headers) is not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.errors import ZooError
from zoo.io.chat_template import render_template
from zoo.io.paths import json_object, optional
from zoo.io.template_budget import REMEDY, ChatTemplateError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

TEMPLATES = ("auto", "internlm2", "llama-2", "llama-3", "checkpoint")
Message = dict[str, Any]  # {"role": ..., "content": ...} (templates may read more keys)


class Tokenizer:
    """Text <-> ids with character offsets, over a tokenizer.json or a sentencepiece tokenizer.model; the special
    tokens and the chat template of its directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        self.dir = path if path.is_dir() else path.parent
        self.config = _read_json(self.dir / "tokenizer_config.json")
        for key, value in _read_json(self.dir / "special_tokens_map.json").items():
            self.config.setdefault(key, value)
        json_file = path if path.suffix == ".json" else self.dir / "tokenizer.json"
        model_file = path if path.suffix == ".model" else self.dir / "tokenizer.model"
        if path.is_file() and path.suffix not in (".json", ".model"):
            raise ZooError(f"{path}: expected a tokenizer.json or tokenizer.model file, or a directory holding one")
        for f in (json_file, model_file):  # regular files inside the directory only (no link out of it, no FIFO)
            optional(self.dir, f.name, "tokenizer file")
        self._tok: HFTokenizer | None = None
        self._sp: Any = None  # sentencepiece.SentencePieceProcessor (untyped)
        if json_file.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tok = HFTokenizer.from_file(str(json_file))
            except Exception as e:  # tokenizers raises a bare Exception on a malformed file
                raise ZooError(f"{json_file}: not a valid tokenizer.json ({e})") from e
            self.path = json_file
            self.vocab_size: int = self._tok.get_vocab_size()
            # vocab_size counts tokens, not ids: a vocabulary that skips ids (hand-edited, merged) gives ids past it
            self.id_bound: int = max(self.vocab_size, max(self._tok.get_vocab(with_added_tokens=True).values(),
                                                     default=-1) + 1)
            added = self._tok.get_added_tokens_decoder().values()
            specials = {t.content for t in added if t.special}
        elif model_file.is_file():
            import sentencepiece

            try:
                self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
            except (OSError, RuntimeError) as e:
                raise ZooError(f"{model_file}: not a valid sentencepiece model ({e})") from e
            self.path = model_file
            self.vocab_size = self._sp.get_piece_size()
            self.id_bound = self.vocab_size  # one past the largest id it gives: pieces are 0 .. count - 1
            sp = self._sp
            specials = {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
            added_tokens = self.config.get("added_tokens_decoder") or {}
            specials |= {v["content"] for v in added_tokens.values() if isinstance(v, dict) and "content" in v}
        else:
            raise ZooError(f"no tokenizer found: looked for {json_file} and {model_file} (a directory with "
                           "tokenizer.json or tokenizer.model)")
        self.special_tokens = sorted((s for s in specials if s), key=len, reverse=True)  # longest first
        self.bos_token = self._special("bos_token", ["<s>", "<|begin_of_text|>"])
        self.eos_token = self._special("eos_token", ["</s>", "<|end_of_text|>"])
        self.pad_token = self._special("pad_token", [])
        self.unk_token = self._special("unk_token", [])
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_id = self.token_to_id(self.pad_token) if self.pad_token else None
        self.chat_template, self.chat_template_file = _find_chat_template(self.dir, self.config)

    def _special(self, key: str, fallbacks: list[str]) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):  # old configs write AddedToken dicts
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
        return next((t for t in fallbacks if self.token_to_id(t) is not None), None)

    def token_to_id(self, token: str) -> int | None:
        if self._tok is not None:
            i: int | None = self._tok.token_to_id(token)
            return i
        i = int(self._sp.piece_to_id(token))
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special-token strings in it becoming their tokens; nothing is added."""
        if self._tok is None and not any(s in text for s in self.special_tokens):
            return list(self._sp.encode(text))
        return self.encode_with_offsets(text)[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of many texts (in parallel threads for tokenizer.json)."""
        if self._tok is not None:
            return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._tok is not None:
            enc = self._tok.encode(text, add_special_tokens=False)
            return list(enc.ids), list(enc.offsets)
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pos = 0
        while pos < len(text):  # sentencepiece knows no special tokens in text: cut them out first
            found = [(text.find(s, pos), s) for s in self.special_tokens if text.find(s, pos) >= 0]
            nxt = min(found, default=None)
            end = nxt[0] if nxt else len(text)
            if end > pos:
                chunk_ids: list[int] = self._sp.encode(text[pos:end])
                # offsets from the decoded prefixes (sentencepiece gives offsets only through protobuf)
                a = 0
                for i in range(len(chunk_ids)):
                    b = max(a, min(end - pos, len(self._sp.decode(chunk_ids[: i + 1]))))
                    offsets.append((pos + a, pos + b))
                    a = b
                ids += chunk_ids
            if nxt:
                ids.append(int(self._sp.piece_to_id(nxt[1])))
                offsets.append((end, end + len(nxt[1])))
                pos = end + len(nxt[1])
            else:
                pos = end
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        if self._tok is not None:
            text: str = self._tok.decode(list(ids), skip_special_tokens=False)
            return text
        return str(self._sp.decode(list(ids)))

    def end_of_turn(self, template: str = "auto") -> str | None:
        """The special token that closes an assistant turn in a chat template (`<|im_end|>`, `<|eot_id|>`, `</s>`,
        ...; "auto": this tokenizer's): the first one rendered after an answer. None when none follows it."""
        try:
            text = render([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "\x00"}],
                          template, self).text
        except ChatTemplateError:
            raise  # a template that cannot render at all is an error, not a template without an end-of-turn token
        except ZooError:
            return None
        after = text[text.rfind("\x00") + 1 :].lstrip()
        return next((s for s in self.special_tokens if after.startswith(s)), None)

    def stop_ids(self, template: str = "auto") -> tuple[int, ...]:
        """Where generation ends: the eos token and the chat template's end-of-turn token (when they have ids)."""
        eot = self.end_of_turn(template)
        ids = [self.eos_id, self.token_to_id(eot) if eot else None]
        return tuple(dict.fromkeys(i for i in ids if i is not None))


def _read_json(path: Path) -> dict[str, Any]:
    found = optional(path.parent, path.name, "tokenizer file")
    return {} if found is None else json_object(found)


def _find_chat_template(directory: Path, config: dict[str, Any]) -> tuple[str | None, Path | None]:
    """(template, the file it came from): chat_template.jinja, tokenizer_config.json, chat_template.json."""
    jinja_file = optional(directory, "chat_template.jinja", "chat template")
    if jinja_file is not None:
        data = jinja_file.read_bytes()
        try:
            return data.decode(), jinja_file
        except UnicodeDecodeError as e:
            raise ChatTemplateError(f"{jinja_file}: the chat template is not UTF-8 text (byte {e.start} is "
                                    f"{data[e.start]:#04x}); {REMEDY}") from e
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template, directory / "tokenizer_config.json"
    processor = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(processor, str) and processor:
        return processor, directory / "chat_template.json"
    return None, None


# ---- chat templates ----


@dataclass
class Chat:
    text: str
    spans: list[tuple[int, int]]  # character spans that are loss targets (assistant turns)


def render(messages: Sequence[Message], template: str, tok: Tokenizer, add_generation_prompt: bool = False) -> Chat:
    """The text of a conversation and the character spans of its assistant turns. add_generation_prompt: end with
    the header of an assistant turn to come (for generation)."""
    messages = [{**m, "content": m["content"].strip() if isinstance(m["content"], str) else m["content"]}
                for m in messages]
    if template == "auto":
        template = pick_template(tok)
    if template == "checkpoint":
        return _render_jinja(messages, tok, add_generation_prompt)
    builder = BUILTIN.get(template)
    if builder is None:
        raise ZooError(f"unknown chat template {template!r}; choose one of {', '.join(TEMPLATES)}")
    text = ""
    spans: list[tuple[int, int]] = []
    for piece, is_target in builder(messages, tok):
        if is_target:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    if add_generation_prompt:
        text += GENERATION_PROMPT[template]
    return Chat(text, spans)


def pick_template(tok: Tokenizer) -> str:
    """"checkpoint" when the tokenizer has a chat template, else the built-in one its special tokens suggest."""
    if tok.chat_template:
        return "checkpoint"
    if tok.token_to_id("<|start_header_id|>") is not None:
        return "llama-3"
    if tok.token_to_id("<|im_start|>") is not None:
        return "internlm2"
    return "llama-2"


def _internlm2(messages: list[Message], tok: Tokenizer) -> Iterator[tuple[str, bool]]:
    """ChatML as in internlm2-chat's tokenizer_config: bos, then <|im_start|>role\\ncontent<|im_end|>\\n."""
    yield tok.bos_token or "", False
    for m in messages:
        yield f"<|im_start|>{m['role']}\n", False
        if m["role"] == "assistant":
            yield m["content"] + "<|im_end|>", True
            yield "\n", False
        else:
            yield m["content"] + "<|im_end|>\n", False


def _llama3(messages: list[Message], tok: Tokenizer) -> Iterator[tuple[str, bool]]:
    """<|begin_of_text|>, then <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|> per message."""
    yield tok.bos_token or "", False
    for m in messages:
        yield f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False
        yield m["content"] + "<|eot_id|>", m["role"] == "assistant"


def _llama2(messages: list[Message], tok: Tokenizer) -> Iterator[tuple[str, bool]]:
    """<s>[INST] <<SYS>>\\nsys\\n<</SYS>>\\n\\nuser [/INST] answer </s> per exchange; roles must alternate."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    for i, m in enumerate(messages):
        if (m["role"] == "user") != (i % 2 == 0):
            raise ZooError("the llama-2 chat template needs turns alternating user/assistant/user/..., after an "
                           f"optional system message; turn {i} is {m['role']!r}")
        content = m["content"]
        if i == 0 and system is not None:
            content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
        if m["role"] == "user":
            yield f"{tok.bos_token or ''}[INST] {content.strip()} [/INST]", False
        else:
            yield " ", False
            yield f"{content.strip()} {tok.eos_token or ''}", True


BUILTIN: dict[str, Callable[[list[Message], Tokenizer], Iterator[tuple[str, bool]]]] = {
    "internlm2": _internlm2, "llama-2": _llama2, "llama-3": _llama3}
GENERATION_PROMPT = {  # what ends a built-in template's text with add_generation_prompt (llama-2 adds nothing)
    "internlm2": "<|im_start|>assistant\n", "llama-2": "",
    "llama-3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def _render_jinja(messages: list[Message], tok: Tokenizer, add_generation_prompt: bool) -> Chat:
    """The checkpoint's own template: each assistant content goes in as a marker, found again after rendering."""
    if tok.chat_template is None:
        raise ZooError(f"the tokenizer in {tok.dir} has no chat template (no chat_template.jinja, no chat_template in "
                       "tokenizer_config.json or chat_template.json); pick a built-in one: internlm2, llama-2, llama-3")
    specials = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token),
                                  ("pad_token", tok.pad_token), ("unk_token", tok.unk_token)) if v}
    marked = [dict(m, content=f"\x00{i}\x00") if m["role"] == "assistant" else m for i, m in enumerate(messages)]
    text = render_template(tok.chat_template, tok.chat_template_file, dict(
        messages=marked, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **specials))
    out, pos = "", 0
    spans: list[tuple[int, int]] = []
    # what closes an answer is the special token right after it, whichever the template uses (<|im_end|>,
    # <|eot_id|>, </s>, <end_of_turn>, <|end|>...): the model must learn to write it
    ends = tok.special_tokens
    while True:
        start = text.find("\x00", pos)
        if start < 0:
            return Chat(out + text[pos:], spans)
        stop = text.find("\x00", start + 1)
        index = text[start + 1 : stop]
        if stop < 0 or not (index.isdecimal() and len(index) < 10 and int(index) < len(messages)):
            raise ZooError(f"{tok.chat_template_file}: its chat template cut or altered an assistant's content (zoo "
                           "passes it as a marker, \\x00<n>\\x00, to find it in the text), or printed a NUL of its own")
        content = messages[int(index)]["content"]
        out += text[pos:start]
        pos = stop + 1
        gap = len(text[pos:]) - len(text[pos:].lstrip(" "))  # llama-2 puts " </s>" after the answer
        end_tok = next((text[pos : pos + gap + len(s)] for s in ends if text.startswith(s, pos + gap)), "")
        spans.append((len(out), len(out) + len(content) + len(end_tok)))
        out += content + end_tok
        pos += len(end_tok)


def encode_chat(messages: Sequence[Message], template: str, tok: Tokenizer,
                image: tuple[str, int, int] | None = None) -> tuple[list[int], list[bool]]:
    """(ids, is_target) of one conversation; is_target marks the tokens of assistant turns.

    image: (placeholder text, token id, tokens per image): each placeholder in the text becomes that many ids
    (LLaVA's <image>, already expanded), never a target.
    """
    chat = render(messages, template, tok)
    if image is None:
        ids, offsets = tok.encode_with_offsets(chat.text)
    else:
        text, image_id, n = image
        ids, offsets, start = [], [], 0
        for k, part in enumerate(chat.text.split(text)):
            if k:
                ids += [image_id] * n
                offsets += [(start - len(text), start - len(text))] * n
            part_ids, part_offsets = tok.encode_with_offsets(part)
            ids += part_ids
            offsets += [(start + a, start + b) for a, b in part_offsets]
            start += len(part) + len(text)
    mask, j = [], 0
    for a, b in offsets:
        while j < len(chat.spans) and chat.spans[j][1] <= a:
            j += 1
        # overlap, not containment: a byte-level BPE token may carry the space before an answer ("ĠThe")
        mask.append(j < len(chat.spans) and chat.spans[j][0] < b and a < chat.spans[j][1])
    return ids, mask
