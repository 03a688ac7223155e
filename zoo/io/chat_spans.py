"""Which characters of a rendered chat a model trains on: each assistant turn as the model writes it, through what
ends it. zoo.io.chat renders; this module reads the spans off its renderings.

A template with `{% generation %}` blocks names them (`generation_spans`). Otherwise each assistant turn `i` is what
the conversation up to it renders beyond its generation prompt (`spans_from_prefixes`), and it ends in one of three
ways:

- an end token the model writes, the same wherever the turn stands (ChatML's `<|im_end|>`, Llama's `<|eot_id|>`,
  Command R7B's `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`: a run of end tokens is trained whole);
- an end marker that depends on the turn's place (gpt-oss: `<|return|>` when the conversation ends with the turn,
  `<|end|>` when more follows, `<|call|>` after a tool call): the marker the whole conversation prints, as many
  special tokens as close the turn when it is last;
- nothing (GLM-4.5: a turn runs until the next role's marker): the special token that opens the next message
  (`<|user|>`, `<|observation|>`), which is where generation stops; not where that opens another assistant turn
  (`<|assistant|>` is a header, never trained).

Where the whole conversation renders the turn otherwise than the conversation up to it does (earlier reasoning
dropped or emptied, a tool call's analysis dropped once a final answer follows, another end marker), the turn is
found in the whole conversation's text by rendering it again with the turn's own strings marked: what changes lies
inside the turn; the turn starts after its header (the generation prompt's tail) before that and ends at the first
special tokens after it. It is trained as the whole conversation renders it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from zoo.errors import ZooError
from zoo.io.template_budget import ChatTemplateError

Span = tuple[int, int]
Message = dict[str, Any]
MARK = "\x00"  # appended to a turn's strings to find where the turn lands (no template prints one of its own)
UNMARKED = ("role", "name", "id", "tool_call_id", "type")  # keys that link messages or pick a branch: kept


class Tokens(Protocol):
    """What span finding reads of a tokenizer (zoo.io.tokenizer.Tokenizer has it)."""

    special_tokens: list[str]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


def stop_pattern(stops: Sequence[str | None]) -> re.Pattern[str]:
    """One or more of `stops` in a row (Command R7B ends an answer with <|END_RESPONSE|><|END_OF_TURN_TOKEN|>)."""
    names = sorted({s for s in stops if s}, key=len, reverse=True)
    return re.compile(f"(?:{'|'.join(map(re.escape, names))})+" if names else "(?!)")


def special_pattern(tok: Tokens) -> re.Pattern[str]:
    """Any one special token (longest first)."""
    return re.compile("|".join(map(re.escape, tok.special_tokens)) or "(?!)")


def generation_spans(text: str, blocks: list[tuple[int, str]], stops: re.Pattern[str],
                     source: Path | None) -> list[Span]:
    """The spans of `{% generation %}` blocks, each extended over an end-of-turn token printed right after it (a
    template that leaves it outside its block would otherwise train a model that never stops)."""
    spans = []
    for a, block in blocks:
        b = a + len(block)
        if text[a:b] != block:
            raise ZooError(f"{source}: its chat template prints a {{% generation %}} block from inside a macro, "
                           "filter or {% set %} block, so where its text lands cannot be told; move the block to "
                           "the template's top level")
        end = stops.match(text, b)
        spans.append((a, end.end() if end and not stops.search(text, a, b) else b))
    return spans


def _common_prefix(x: str, y: str) -> int:
    """The length of the longest common prefix of x and y (by halving: slices compare in C)."""
    lo, hi = 0, min(len(x), len(y))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def spans_from_prefixes(messages: list[Message], text: str, text_of: Callable[[list[Message], bool], str],
                        stops: re.Pattern[str], tok: Tokens) -> list[Span]:
    """Each assistant turn's span in `text` (the whole conversation): what the conversation up to it renders as with
    the turn (`turn`), past what it renders as with a generation prompt instead (`prompt`), through the end tokens
    that close it or, where none does, the special token that follows it (see the module's docstring). Where the
    whole conversation renders the turn otherwise, it is located there (`_locate`); what cannot be located is
    refused, naming the turn."""
    specials = special_pattern(tok)
    spans: list[Span] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            prompt, turn = text_of(messages[:i], True), text_of(messages[: i + 1], False)
        except ChatTemplateError:
            raise
        except ZooError as err:
            raise ZooError(f"assistant turn {i}: zoo renders the conversation up to each assistant turn to find what "
                           f"is trained on, and that rendering failed: {err}") from err
        a, header = _turn_start(prompt, turn, tok, specials, i)
        stop = stops.search(turn, a)
        e = stop.end() if stop else a + len(turn[a:].rstrip())
        lo = spans[-1][1] if spans else 0
        if text.startswith(turn[:e]):
            # closed by nothing of its own: the next message's opening token (GLM-4.5's <|user|>) is its stop, unless
            # it opens another assistant turn (its header, never trained)
            after = None if _closing(turn[a:e], tok.special_tokens) else specials.match(text, e)
            span = (a, after.end() if after and not header.startswith(after.group()) else e)
        else:
            span = _locate(text, turn[a:e], header, _anchor(messages, i, text, text_of), lo, specials, tok, i)
        if span[0] < lo:
            raise ZooError(f"assistant turn {i} overlaps the turn before it in the rendered conversation; mark "
                           "assistant text in the template with {% generation %} blocks")
        if span[1] > span[0]:
            spans.append(span)
    return spans


def _turn_start(prompt: str, turn: str, tok: Tokens, specials: re.Pattern[str], i: int) -> tuple[int, str]:
    """Where the text of assistant turn `i` starts in `turn` (the conversation rendered up to it), and its header
    (the generation prompt from its last special token on: "<|im_start|>assistant\\n", "<|start|>assistant"). The
    turn starts where `turn` parts from `prompt` (the same with a generation prompt instead). Where they part before
    the prompt's last special token, the context itself renders otherwise once the answer follows (Mistral prints
    the system prompt in the last [INST] only; gpt-oss drops a tool call's analysis once an answer follows it): the
    turn starts after the longest tail of the prompt, from one of its special tokens on, that `turn` holds."""
    a = _token_start(turn, _common_prefix(prompt, turn), tok)
    last = max((prompt.rfind(t) for t in tok.special_tokens), default=-1)
    header = prompt[last:] if last >= 0 else ""
    if last < a:
        return a, header
    for j in (s.start() for s in specials.finditer(prompt, a)):
        found = turn.find(prompt[j:], a)
        if found >= 0:
            return found + len(prompt) - j, header
    raise ZooError(f"assistant turn {i}: the conversation up to it renders differently with a generation prompt and "
                   f"with the answer ({header[:40]!r} is not found before it), so where the answer starts is "
                   "unknown; mark assistant text in the template with {% generation %} blocks")


def _token_start(text: str, pos: int, tok: Tokens) -> int:
    """`pos`, moved back to the start of the token it falls inside (where a generation prompt and an answer share
    characters, not tokens: "<think>" and "<tool_call>" share "<", "<|im_start|>" and "<|im_end|>" "<|im_")."""
    first = max((text.rfind(t, 0, pos) for t in tok.special_tokens), default=-1)  # tokens never cross one
    first = max(first, 0)
    _, offsets = tok.encode_with_offsets(text[first : pos + 256])
    return next((first + a for a, b in offsets if first + a < pos < first + b), pos)


def _closing(own: str, tokens: Sequence[str]) -> list[str]:
    """The special tokens `own` (a turn as the model writes it) ends with, in order: what closes it."""
    closing: list[str] = []
    while (t := next((t for t in tokens if own.endswith(t)), None)) is not None:
        closing.insert(0, t)
        own = own[: -len(t)]
    return closing


def _marked(value: Any, key: str | None = None) -> Any:
    """`value` (a message) with MARK after each of its non-empty strings, save names, ids and roles."""
    if key in UNMARKED:
        return value
    if isinstance(value, str):
        return value + MARK if value else value
    if isinstance(value, dict):
        return {k: _marked(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v) for v in value]
    return value


def _anchor(messages: list[Message], i: int, text: str,
            text_of: Callable[[list[Message], bool], str]) -> tuple[int, int] | None:
    """(first, last) place in `text` where rendering the conversation with turn `i`'s strings marked changes it:
    the turn's own text as the whole conversation prints it lies around them. None when nothing changes (the
    turn's text is not printed at all) or the marked conversation does not render."""
    marked = [*messages[:i], _marked(messages[i]), *messages[i + 1 :]]
    try:
        other = text_of(marked, False)
    except ZooError:
        return None
    if other == text:
        return None
    p = _common_prefix(text, other)
    s = _common_prefix(text[p:][::-1], other[p:][::-1])
    return p, len(text) - s


def _locate(text: str, own: str, header: str, anchor: tuple[int, int] | None, lo: int, specials: re.Pattern[str],
            tok: Tokens, i: int) -> Span:
    """Where assistant turn `i` (`own` when the conversation ends with it) lies in the whole conversation's
    `text`, after `lo` (the previous span): from after its header, the last one before the first change `anchor`
    shows, to the special tokens after the last change, as many as close `own` (or the one that opens the next
    message where nothing closes `own`)."""
    def refuse(why: str) -> ZooError:
        return ZooError(f"assistant turn {i} renders differently once later turns follow it ({why}), so what to "
                        "train on is ambiguous; mark assistant text in the template with {% generation %} blocks, "
                        "or split the conversation so that it ends at this turn")

    if anchor is None:
        raise refuse("none of its text is in the whole conversation")
    p, q = anchor
    closing = _closing(own, tok.special_tokens)
    body = own[: len(own) - sum(map(len, closing))]
    first = specials.search(text, q)
    if first is None:
        raise refuse("no special token follows it")
    if not body.endswith(text[q : first.start()]):
        raise refuse(f"it ends as {text[q : first.start()][-40:]!r}, not as {body[-40:]!r}")
    mark = specials.match(header)
    if mark is None:
        raise refuse("its generation prompt has no special token to find its header by")
    # nothing of its own closes it: the next message's opening token, unless that is another assistant turn's header
    end = first.start() if not closing and header.startswith(first.group()) else first.end()
    for _ in closing[1:]:
        more = specials.match(text, end)
        if more is None:
            break
        end = more.end()
    need = re.compile(re.escape(mark.group()) + r"\w*").match(header)
    pos = text.rfind(mark.group(), lo, p)
    while pos >= 0 and _common_prefix(text[pos:p], header) < (need.end() if need else len(mark.group())):
        pos = text.rfind(mark.group(), lo, pos)  # another role's message ("<|start|>user" is not "<|start|>assistant")
    if pos < 0:
        raise refuse(f"its header {header[:40]!r} is not found before it")
    return _token_start(text, pos + _common_prefix(text[pos:p], header), tok), end
