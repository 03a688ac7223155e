"""Chat templates: a conversation rendered to text as transformers renders it, and the spans a model trains on.

The checkpoint's template (found by zoo.io.tokenizer) is rendered in jinja2's immutable sandbox with what
transformers gives templates (`raise_exception`, `strftime_now` with today's date, a `tojson` keeping non-ASCII
text, loop controls, `{% generation %}` blocks, the configured special tokens by name, `tools` and any template
switch such as `enable_thinking`), and the messages as given (nothing stripped; keys holding None dropped and
reasoning aliased as transformers does), so text and ids equal `apply_chat_template`'s. Built-in templates serve
tokenizers without one: "internlm2" (ChatML), "llama-2" and "llama-3", written here in Python.

For training, a chat is rendered to text, then tokenized in one piece (so the ids are what the model sees at
inference), and the loss mask is read off character spans: what the model writes in each assistant turn, through
its end-of-turn token; system, user and tool turns and role headers are not targets. A template's
`{% generation %}` blocks give the spans where it has them; otherwise each turn's span is what the conversation up
to it renders beyond its generation prompt, located again in the whole conversation's text (zoo.io.chat_spans),
or refused in one line where that cannot be done unambiguously.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from zoo.errors import ZooError
from zoo.io.chat_spans import Span, generation_spans, spans_from_prefixes, stop_pattern
from zoo.io.chat_template import has_generation_blocks, render_template

TEMPLATES = ("auto", "internlm2", "llama-2", "llama-3", "checkpoint")
Message = dict[str, Any]  # {"role": ..., "content": ...} (templates may read more keys)


class Tokenizer(Protocol):
    """What rendering reads of a tokenizer: zoo.io.tokenizer.Tokenizer's special tokens and chat templates (a
    Protocol, so that module can import this one)."""

    dir: Path
    bos_token: str | None
    eos_token: str | None
    special_tokens: list[str]
    chat_template: str | None
    chat_template_file: Path | None
    tool_use_template: str | None

    def token_to_id(self, token: str) -> int | None: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def template_tokens(self) -> dict[str, str]: ...

    def end_of_turn(self, template: str = "auto") -> str | None: ...


# ---- chat templates ----

RESERVED = ("messages", "tools", "documents", "add_generation_prompt")  # what render() itself gives a template
REASONING = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning goes by


class Chat:
    """A rendered conversation: its text, and the character spans that are loss targets (each assistant turn with
    its end-of-turn token). The spans of a checkpoint template without `{% generation %}` blocks take two renderings
    per assistant turn, so they are found when first asked for (generation never asks)."""

    def __init__(self, text: str, spans: list[Span] | Callable[[], list[Span]]) -> None:
        self.text = text
        self._spans = spans

    @property
    def spans(self) -> list[Span]:
        if callable(self._spans):
            self._spans = self._spans()
        return self._spans


def render(messages: Sequence[Message], template: str, tok: Tokenizer, add_generation_prompt: bool = False,
           tools: Sequence[dict[str, Any]] | None = None, **kwargs: Any) -> Chat:
    """The text of a conversation and the character spans of its assistant turns. add_generation_prompt: end with
    the header of an assistant turn to come (for generation). tools (JSON schemas) and any keyword (Qwen3's
    `enable_thinking=False`) go to a checkpoint's template as transformers' apply_chat_template passes them; the
    messages reach it as given (no stripping), so the text is transformers' to the character."""
    for i, m in enumerate(messages):  # a string or a dict without a role reached the builders' m["role"]
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            got = f"{type(m).__name__}" if not isinstance(m, dict) else f"keys {sorted(map(str, m))}"
            raise ZooError(f"message {i} must be an object with a string role, got {got}")
    if template == "auto":
        template = pick_template(tok)
    if template == "checkpoint":
        return _render_jinja(list(messages), tok, add_generation_prompt, tools, kwargs)
    builder = BUILTIN.get(template)
    if builder is None:
        raise ZooError(f"unknown chat template {template!r}; choose one of {', '.join(TEMPLATES)}")
    if tools is not None or kwargs:
        raise ZooError(f"the built-in {template} chat template takes no tools or template switches (got "
                       f"{', '.join(['tools'] * (tools is not None) + sorted(kwargs))}); use a checkpoint's own "
                       "template (--chat-template checkpoint) or leave them out")
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            raise ZooError(f"the built-in {template} chat template needs string content; message {i} "
                           f"({m.get('role')!r}) has {type(m.get('content')).__name__} (tool calls need the "
                           "checkpoint's own template)")
    text = ""
    spans: list[Span] = []
    for piece, is_target in builder(list(messages), tok):
        if is_target:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    if add_generation_prompt:
        text += GENERATION_PROMPT[template]
    return Chat(text, spans)


def builtin_bos(tok: Tokenizer, opener: str) -> str:
    """The bos a built-in template opens with: none where the bos is the token that opens each turn anyway
    (SmolLM2's bos is <|im_start|>: written before <|im_start|>user it would be doubled)."""
    return "" if tok.bos_token == opener else tok.bos_token or ""


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
    """ChatML as in internlm2-chat's tokenizer_config: bos (unless it is <|im_start|>), then
    <|im_start|>role\\ncontent<|im_end|>\\n."""
    yield builtin_bos(tok, "<|im_start|>"), False
    for m in messages:
        yield f"<|im_start|>{m['role']}\n", False
        if m["role"] == "assistant":
            yield m["content"] + "<|im_end|>", True
            yield "\n", False
        else:
            yield m["content"] + "<|im_end|>\n", False


def _llama3(messages: list[Message], tok: Tokenizer) -> Iterator[tuple[str, bool]]:
    """<|begin_of_text|>, then <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|> per message, the
    content trimmed (Meta-Llama-3-Instruct's `| trim`)."""
    yield tok.bos_token or "", False
    for m in messages:
        yield f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False
        yield m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"


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


def _template_message(m: Message) -> Message:
    """A message as transformers hands it to a template: keys holding None dropped (an API's `content: null` beside
    tool calls), and reasoning under every name templates read it by: `reasoning_content` (Qwen3, DeepSeek) from
    whichever name it came under, `thinking` (gpt-oss) unless the message has its own."""
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m}
        m["reasoning_content"] = reasoning
    return m


def _render_jinja(messages: list[Message], tok: Tokenizer, add_generation_prompt: bool,
                  tools: Sequence[dict[str, Any]] | None, kwargs: dict[str, Any]) -> Chat:
    """The checkpoint's own template, given the messages as they are. The targets are its `{% generation %}`
    blocks where it has them, else each assistant turn as the renderings of the conversation's prefixes show it."""
    template = tok.chat_template
    if template is None:
        raise ZooError(f"the tokenizer in {tok.dir} has no chat template (no chat_template.jinja, no chat_template in "
                       "tokenizer_config.json or chat_template.json); pick a built-in one: internlm2, llama-2, llama-3")
    if tools is not None and tok.tool_use_template is not None:  # named templates: transformers picks "tool_use"
        template = tok.tool_use_template
    clash = [k for k in RESERVED if k in kwargs]
    if clash:
        raise ZooError(f"template switch {clash[0]!r} is set by zoo itself; pass it as render()'s own argument")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ZooError(f"message {i} of the conversation is a {type(m).__name__}, not an object")
    if isinstance(tools, tuple):
        tools = list(tools)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ZooError(f"tools must be a list of JSON schemas (objects), got {str(tools)[:80]}")
    variables = {**tok.template_tokens(), **kwargs}  # a switch overrides a special token of the same name

    def text_of(msgs: list[Message], prompt: bool, generation: list[tuple[int, str]] | None = None) -> str:
        return render_template(template, tok.chat_template_file, dict(
            variables, messages=[_template_message(m) for m in msgs], tools=tools, documents=None,
            add_generation_prompt=prompt), generation)

    if has_generation_blocks(template):
        blocks: list[tuple[int, str]] = []
        text = text_of(messages, add_generation_prompt, blocks)
        return Chat(text, lambda: generation_spans(text, blocks, _stops(tok), tok.chat_template_file))
    text = text_of(messages, add_generation_prompt)
    return Chat(text, lambda: spans_from_prefixes(messages, text, text_of, _stops(tok), tok))


def _stops(tok: Tokenizer) -> re.Pattern[str]:
    """What ends an answer: the eos token and the template's end-of-turn token, one or more in a row."""
    return stop_pattern([tok.eos_token, tok.end_of_turn("checkpoint")])


def encode_chat(messages: Sequence[Message], template: str, tok: Tokenizer,
                image: tuple[str, int, int] | None = None, tools: Sequence[dict[str, Any]] | None = None,
                **kwargs: Any) -> tuple[list[int], list[bool]]:
    """(ids, is_target) of one conversation; is_target marks the tokens of assistant turns. tools and keywords go
    to the template (see render).

    image: (placeholder text, token id, tokens per image): each placeholder in the text becomes that many ids
    (LLaVA's <image>, already expanded), never a target.
    """
    chat = render(messages, template, tok, tools=tools, **kwargs)
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
