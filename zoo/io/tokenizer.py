"""Tokenizers, for `python -m zoo.generate` and the recipes.

`Tokenizer` reads a tokenizer.json (the `tokenizers` library) or a sentencepiece tokenizer.model, and the special
tokens of tokenizer_config.json (special_tokens_map.json for what it lacks). One rule for special tokens, the
checkpoint's: `encode(text)` adds what transformers' tokenizer(text) adds — a tokenizer.json's post-processor (Llama 3,
Gemma, Mistral and zoo's bundled tokenizer open with their bos, Qwen adds nothing), or for a sentencepiece
tokenizer.model tokenizer_config.json's add_bos_token / add_eos_token (LlamaTokenizer's defaults: bos, no eos) —
and `encode(text, add_special_tokens=False)` adds nothing. `added_before` / `added_after` are those ids, for callers
that assemble a sequence from pieces (pretraining documents, DPO pairs). A rendered chat holds its own special tokens
(its template writes them), so it is encoded with nothing added, as transformers' apply_chat_template does. It finds the
checkpoint's chat template as transformers 5 does: `chat_template.jinja` beside the tokenizer wins over the
`chat_template` of tokenizer_config.json (a string, or named templates of which "default" is used, "tool_use" when
tools are given); a processor's `chat_template.json` (LLaVA) comes last. Rendering a conversation through it is
zoo.io.chat's, whose names are importable from here too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.errors import ZooError
from zoo.io.chat import TEMPLATES, Chat, Message, encode_chat, pick_template, render  # importable from here too
from zoo.io.paths import json_object, optional
from zoo.io.template_budget import REMEDY, ChatTemplateError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

__all__ = ["TEMPLATES", "Chat", "Message", "Tokenizer", "encode_chat", "pick_template", "render"]


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
        named = self.config.get("chat_template")
        named = {t.get("name"): t.get("template") for t in named if isinstance(t, dict)} if isinstance(
            named, list) and self.chat_template_file == self.dir / "tokenizer_config.json" else {}
        tool_use = named.get("tool_use")
        self.tool_use_template: str | None = tool_use if isinstance(tool_use, str) and tool_use else None
        self._end_of_turn: dict[str, str | None] = {}

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, special-token strings in it becoming their tokens, with the special tokens the
        checkpoint adds around a text (transformers' tokenizer(text).input_ids); `add_special_tokens=False`: with
        none (a rendered chat, a piece of a longer sequence)."""
        if self._tok is not None:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if not any(s in text for s in self.special_tokens):
            ids = list(self._sp.encode(text))
        else:
            ids = self.encode_with_offsets(text)[0]
        return self.added_before + ids + self.added_after if add_special_tokens else ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in parallel threads for a tokenizer.json."""
        if self._tok is not None:
            return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return [self.encode(t, add_special_tokens) for t in texts]

    @functools.cached_property
    def added_before(self) -> list[int]:
        """The ids the checkpoint's rule puts before a text (its bos for Llama, none for Qwen)."""
        return self._added()[0]

    @functools.cached_property
    def added_after(self) -> list[int]:
        """The ids the checkpoint's rule puts after a text (mostly none; an eos where add_eos_token says so)."""
        return self._added()[1]

    def _added(self) -> tuple[list[int], list[int]]:
        if self._tok is None:  # transformers' LlamaTokenizer: add_bos_token (default true), add_eos_token (false)
            bos = [self.bos_id] if self.config.get("add_bos_token", True) is True and self.bos_id is not None else []
            eos = [self.eos_id] if self.config.get("add_eos_token", False) is True and self.eos_id is not None else []
            return bos, eos
        # what the post-processor adds around a probe text, whatever its kind (a template, a Sequence, Roberta's)
        plain, full = self.encode("a", False), self.encode("a", True)
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if at is None:
            raise ZooError(f"{self.path}: the post-processor changes the text's own ids ({plain} became {full}); "
                           "expected it to add special tokens around them")
        return full[:at], full[at + len(plain) :]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` with nothing added, and each one's (start, end) characters (for chat masks)."""
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

    def template_tokens(self) -> dict[str, str]:
        """The special tokens a chat template sees by name (bos_token, eos_token, ...), as transformers gives them."""
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        found = {k: self._special(k, []) for k in names}  # as configured: transformers guesses none from the vocab
        if self._sp is not None:  # transformers' sentencepiece tokenizer classes default to <s> and </s>
            found.update(bos_token=self.bos_token, eos_token=self.eos_token)
        return {k: v for k, v in found.items() if v}

    def end_of_turn(self, template: str = "auto") -> str | None:
        """The special token that closes an assistant turn in a chat template (`<|im_end|>`, `<|eot_id|>`, `</s>`,
        ...; "auto": this tokenizer's): the first one rendered after an answer; where nothing follows an answer that
        ends the conversation (GLM-4.5), the one that opens the user's next message (`<|user|>`), which is where a
        turn ends and what zoo trains as its stop (zoo.io.chat_spans). None when no special token follows it."""
        if template not in self._end_of_turn:
            self._end_of_turn[template] = self._find_end_of_turn(template)
        return self._end_of_turn[template]

    def _find_end_of_turn(self, template: str) -> str | None:
        # a probe: an answer of one NUL, a character no template prints of its own
        chat = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "\x00"}]
        try:
            text = render(chat, template, self).text
            if not text[text.rfind("\x00") + 1 :].strip():
                text = render([*chat, {"role": "user", "content": "Hi."}], template, self).text
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
