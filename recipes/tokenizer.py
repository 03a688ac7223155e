"""Tokenizers (tokenizer.json via `tokenizers`, tokenizer.model via sentencepiece) and chat templates.

A chat is rendered to text by a template, then tokenized in one piece (so the ids are what the model sees at
inference, equal to transformers' `apply_chat_template(..., tokenize=True)`), and the loss mask is read off the
character spans of the assistant turns: an assistant's content and the end-of-turn token after it are targets,
everything else (system, user, role headers) is not.

Templates: "internlm2" (ChatML, also the bundled tokenizer's), "llama-2", "llama-3" written here in Python, and
"checkpoint": the `chat_template` of the tokenizer's own tokenizer_config.json, rendered with jinja2 when it is
installed (it is not a dependency; without it "auto" falls back to the built-in template the tokens suggest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from zoo.errors import ZooError

ASSETS = Path(__file__).resolve().parent / "assets"
TEMPLATES = ("auto", "internlm2", "llama-2", "llama-3", "checkpoint")


class Tokenizer:
    """Text <-> ids with character offsets, over a tokenizer.json or a sentencepiece tokenizer.model."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.dir = path if path.is_dir() else path.parent
        self.config = _read_json(self.dir / "tokenizer_config.json")
        json_file = path if path.suffix == ".json" else self.dir / "tokenizer.json"
        model_file = path if path.suffix == ".model" else self.dir / "tokenizer.model"
        if path.is_file() and path.suffix not in (".json", ".model"):
            raise ZooError(f"{path}: expected a tokenizer.json or tokenizer.model file, or a directory holding one")
        if json_file.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self._tok, self._sp = HFTokenizer.from_file(str(json_file)), None
            self.path = json_file
            self.vocab_size = self._tok.get_vocab_size()
        elif model_file.is_file():
            import sentencepiece

            self._tok, self._sp = None, sentencepiece.SentencePieceProcessor(model_file=str(model_file))
            self.path = model_file
            self.vocab_size = self._sp.get_piece_size()
            self._specials = sorted(self._special_strings(), key=len, reverse=True)
        else:
            raise ZooError(f"no tokenizer found: looked for {json_file} and {model_file}; pass --tokenizer DIR "
                           "(a directory with tokenizer.json or tokenizer.model)")
        self.bos_token = self._special("bos_token", ["<s>", "<|begin_of_text|>"])
        self.eos_token = self._special("eos_token", ["</s>", "<|end_of_text|>"])
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None

    def _special(self, key: str, fallbacks: list[str]) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):  # old configs write AddedToken dicts
            value = value.get("content")
        if value:
            return value
        return next((t for t in fallbacks if self.token_to_id(t) is not None), None)

    def _special_strings(self) -> list[str]:
        sp = self._sp
        found = {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        added = self.config.get("added_tokens_decoder") or {}
        found |= {v["content"] for v in added.values() if isinstance(v, dict) and "content" in v}
        return [s for s in found if s]

    def token_to_id(self, token: str) -> int | None:
        if self._tok is not None:
            return self._tok.token_to_id(token)
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special-token strings in it becoming their tokens; nothing is added."""
        if self._tok is None and not any(s in text for s in self._specials):
            return self._sp.encode(text)
        return self.encode_with_offsets(text)[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of many texts (in parallel threads for tokenizer.json)."""
        if self._tok is not None:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._tok is not None:
            enc = self._tok.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        ids, offsets, pos = [], [], 0
        while pos < len(text):  # sentencepiece knows no special tokens in text: cut them out first
            nxt = min(((text.find(s, pos), s) for s in self._specials if text.find(s, pos) >= 0), default=None)
            end = nxt[0] if nxt else len(text)
            if end > pos:
                chunk_ids = self._sp.encode(text[pos:end])
                # offsets from the decoded prefixes (sentencepiece gives offsets only through protobuf)
                a = 0
                for i in range(len(chunk_ids)):
                    b = max(a, min(end - pos, len(self._sp.decode(chunk_ids[: i + 1]))))
                    offsets.append((pos + a, pos + b))
                    a = b
                ids += chunk_ids
            if nxt:
                ids.append(self._sp.piece_to_id(nxt[1]))
                offsets.append((end, end + len(nxt[1])))
                pos = end + len(nxt[1])
            else:
                pos = end
        return ids, offsets

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False) if self._tok is not None else self._sp.decode(ids)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZooError(f"{path}: not valid JSON ({e})") from e


def find_tokenizer(tokenizer: str | None, model: str) -> Tokenizer:
    """--tokenizer if given, else the model's checkpoint directory, else the bundled one (for presets)."""
    if tokenizer:
        if not Path(tokenizer).exists():
            raise ZooError(f"tokenizer {tokenizer} does not exist: expected a directory with tokenizer.json or "
                           "tokenizer.model")
        return Tokenizer(tokenizer)
    if Path(model).is_dir():
        return Tokenizer(model)
    from zoo.presets import PRESETS

    if model in PRESETS and PRESETS[model].hf_source is not None:
        raise ZooError(f"no tokenizer for preset {model}: looked for --tokenizer (not given) and a checkpoint "
                       f"directory (--model is a preset name); pass --tokenizer DIR with the tokenizer of "
                       f"{PRESETS[model].hf_source}")
    return Tokenizer(ASSETS)  # zoo's own presets (debug) use the bundled tokenizer


# ---- chat templates ----


@dataclass
class Chat:
    text: str
    spans: list[tuple[int, int]]  # character spans that are loss targets (assistant turns)


def render(messages: list[dict], template: str, tok: Tokenizer) -> Chat:
    """The training text of a conversation and the character spans of its assistant turns."""
    messages = [{"role": m["role"], "content": m["content"].strip()} for m in messages]
    if template == "auto":
        template = pick_template(tok)
    if template == "checkpoint":
        return _render_jinja(messages, tok)
    builder = {"internlm2": _internlm2, "llama-2": _llama2, "llama-3": _llama3}.get(template)
    if builder is None:
        raise ZooError(f"unknown chat template {template!r}; choose one of {', '.join(TEMPLATES)}")
    text, spans = "", []
    for piece, is_target in builder(messages, tok):
        if is_target:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    return Chat(text, spans)


def pick_template(tok: Tokenizer) -> str:
    if tok.config.get("chat_template"):
        if _has_jinja():
            return "checkpoint"
        if not getattr(tok, "_warned", False):
            print(f"note: {tok.dir / 'tokenizer_config.json'} has a chat_template but jinja2 is not installed; "
                  "using the built-in template its tokens suggest (pip install jinja2 to use its own)")
            tok._warned = True
    if tok.token_to_id("<|start_header_id|>") is not None:
        return "llama-3"
    if tok.token_to_id("<|im_start|>") is not None:
        return "internlm2"
    return "llama-2"


def _has_jinja() -> bool:
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return False
    return True


def _internlm2(messages, tok):
    """ChatML as in internlm2-chat's tokenizer_config: bos, then <|im_start|>role\\ncontent<|im_end|>\\n."""
    yield tok.bos_token, False
    for m in messages:
        yield f"<|im_start|>{m['role']}\n", False
        if m["role"] == "assistant":
            yield m["content"] + "<|im_end|>", True
            yield "\n", False
        else:
            yield m["content"] + "<|im_end|>\n", False


def _llama3(messages, tok):
    """<|begin_of_text|>, then <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|> per message."""
    yield tok.bos_token, False
    for m in messages:
        yield f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False
        if m["role"] == "assistant":
            yield m["content"] + "<|eot_id|>", True
        else:
            yield m["content"] + "<|eot_id|>", False


def _llama2(messages, tok):
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
            yield f"{tok.bos_token}[INST] {content.strip()} [/INST]", False
        else:
            yield " ", False
            yield f"{content.strip()} {tok.eos_token}", True


def _render_jinja(messages: list[dict], tok: Tokenizer) -> Chat:
    """The checkpoint's own template: each assistant content goes in as a marker, found again after rendering."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    marked = [dict(m, content=f"\x00{i}\x00") if m["role"] == "assistant" else m for i, m in enumerate(messages)]
    try:
        text = env.from_string(tok.config["chat_template"]).render(
            messages=marked, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
            add_generation_prompt=False)
    except TemplateError as e:
        raise ZooError(f"{tok.dir / 'tokenizer_config.json'}: its chat_template fails on this sample: {e}") from e
    out, spans, pos = "", [], 0
    ends = [s for s in ("<|im_end|>", "<|eot_id|>", tok.eos_token) if s]
    while True:
        start = text.find("\x00", pos)
        if start < 0:
            return Chat(out + text[pos:], spans)
        stop = text.index("\x00", start + 1)
        content = messages[int(text[start + 1 : stop])]["content"]
        out += text[pos:start]
        pos = stop + 1
        gap = len(text[pos:]) - len(text[pos:].lstrip(" "))  # llama-2 puts " </s>" after the answer
        end_tok = next((text[pos : pos + gap + len(s)] for s in ends if text.startswith(s, pos + gap)), "")
        spans.append((len(out), len(out) + len(content) + len(end_tok)))
        out += content + end_tok
        pos += len(end_tok)


def encode_chat(messages: list[dict], template: str, tok: Tokenizer,
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
