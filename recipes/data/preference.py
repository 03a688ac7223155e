"""Preference data: JSONL pairs {"prompt", "chosen", "rejected"}, tokenized as TRL's DPOTrainer does, packed whole.

Formats (TRL's): text, `{"prompt": str, "chosen": str, "rejected": str}`, each completion ending with the tokenizer's
eos text (appended where it does not); or conversations, `{"prompt": [messages], "chosen": [messages], "rejected":
[messages]}`, rendered through the chat template, or with the prompt implicit, `{"chosen": [...], "rejected": [...]}`
(the turns both share are the prompt). An optional `"system": str` opens a conversation's prompt.

Tokenization (DPOTrainer's): the prompt alone (with the generation prompt), prompt + chosen and prompt + rejected are
each encoded; the completion starts where the encoded prompt and prompt + completion first differ (a template may
render the prompt alone differently, tokens may merge across the boundary). Text is encoded as the tokenizer's
`__call__` would, with the special tokens its post-processor adds (a Llama 3 tokenizer's <|begin_of_text|>).

A pair is two documents of one pack, prompt + chosen then prompt + rejected, whose targets are the completion tokens
(with `full_chosen`, every token of prompt + chosen: ORPO's NLL term). Pairs are packed whole into --seq-len bins by
first-fit decreasing; a pack holds as many as fit. What cannot be trained is skipped and counted in `stats`: a pair
with an empty completion, chosen equal to rejected (its DPO loss is the constant log 2), and pairs longer than
--seq-len with --overlong drop (with truncate, both sequences keep their start, cut to fit, and the pair is skipped
only when the prompt leaves no completion token). A field missing or of the wrong type is an error naming file:line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recipes.data.chat import check_messages
from recipes.data.jsonl import JSONObject, list_files, read_jsonl
from recipes.data.packs import PackedData, first_fit_decreasing
from zoo import Packed, ZooError, pack
from zoo.io.tokenizer import Message, Tokenizer, render


@dataclass(frozen=True)
class Pair:
    """One preference pair as token ids: the shared prompt, the two completions (prompt excluded)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    @property
    def num_tokens(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def special_ends(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer's post-processor puts before and after a single text (what `tokenizer(text)` adds in
    transformers and `Tokenizer.encode` does not): tokenizer.json's TemplateProcessing, alone or in a Sequence; for
    a sentencepiece model, tokenizer_config.json's add_bos_token / add_eos_token."""
    if tok.path.suffix != ".json":
        bos = [tok.bos_id] if tok.config.get("add_bos_token", True) and tok.bos_id is not None else []
        eos = [tok.eos_id] if tok.config.get("add_eos_token", False) and tok.eos_id is not None else []
        return bos, eos
    post = json.loads(tok.path.read_text(encoding="utf-8")).get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    template = next((s for s in steps if isinstance(s, dict) and s.get("type") == "TemplateProcessing"), None)
    if template is None:
        return [], []
    before: list[int] = []
    after: list[int] = []
    seen = False
    for item in template.get("single", []):
        if "Sequence" in item:
            seen = True
            continue
        name = item.get("SpecialToken", {}).get("id")
        ids = template.get("special_tokens", {}).get(name, {}).get("ids", [])
        (after if seen else before).extend(int(i) for i in ids)
    return before, after


class Encoder:
    """Text or conversations to ids, as TRL's DPOTrainer tokenizes them."""

    def __init__(self, tok: Tokenizer, template: str):
        self.tok, self.template = tok, template
        self.before, self.after = special_ends(tok)

    def text(self, s: str) -> list[int]:
        return self.before + self.tok.encode(s) + self.after

    def chat(self, messages: list[Message], generation_prompt: bool = False) -> list[int]:
        return self.tok.encode(render(messages, self.template, self.tok, add_generation_prompt=generation_prompt).text)

    def pair(self, prompt: str | list[Message], chosen: str | list[Message], rejected: str | list[Message]) -> Pair:
        if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
            eos = self.tok.eos_token or ""
            chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
            p, pc, pr = self.text(prompt), self.text(prompt + chosen), self.text(prompt + rejected)
        else:
            assert isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list)
            p, pc, pr = self.chat(prompt, True), self.chat(prompt + chosen), self.chat(prompt + rejected)
        n = min(common_prefix(p, pc), common_prefix(p, pr))
        return Pair(p[:n], pc[n:], pr[n:])


def _field(f: Path, n: int, obj: JSONObject, key: str, conversational: bool) -> Any:
    value = obj.get(key)
    if conversational:
        if not isinstance(value, list):
            raise ZooError(f"{f}:{n}: expected \"{key}\" as a list of messages like the other fields, got "
                           f"{type(value).__name__ if key in obj else 'no such field'}")
        return check_messages(f, n, {"messages": value})
    if not isinstance(value, str):
        raise ZooError(f"{f}:{n}: expected \"{key}\" as a string like the other fields, got "
                       f"{type(value).__name__ if key in obj else 'no such field'}")
    return value


def read_pair(f: Path, n: int, obj: JSONObject) -> tuple[str | list[Message], str | list[Message], str | list[Message]]:
    """(prompt, chosen, rejected) of one line, checked; the implicit prompt of a conversation split off."""
    chosen = obj.get("chosen")
    if "chosen" not in obj or "rejected" not in obj:
        raise ZooError(f"{f}:{n}: expected {{\"prompt\", \"chosen\", \"rejected\"}} (or conversational \"chosen\" and "
                       f"\"rejected\"), got keys {sorted(obj)[:8]}")
    conversational = isinstance(chosen, list)
    c, r = _field(f, n, obj, "chosen", conversational), _field(f, n, obj, "rejected", conversational)
    system = obj.get("system")
    if system is not None and not (isinstance(system, str) and conversational):
        raise ZooError(f"{f}:{n}: \"system\" must be a string, and goes with conversational pairs only (a text "
                       "prompt holds its own)")
    if "prompt" in obj:
        p = _field(f, n, obj, "prompt", conversational)
    elif conversational:  # TRL's extract_prompt: the turns both conversations open with
        k = 0
        while k < min(len(c), len(r)) and c[k] == r[k]:
            k += 1
        p, c, r = c[:k], c[k:], r[k:]
    else:
        raise ZooError(f"{f}:{n}: expected a \"prompt\" string with text \"chosen\" and \"rejected\"")
    if system is not None:
        p = [{"role": "system", "content": system}, *p]
    return p, c, r


def fit(pair: Pair, seq_len: int) -> Pair | None:
    """The pair cut to `seq_len` tokens for both sequences: each keeps its start, the longer cut first (both to
    the same length L, the largest that fits); None when the prompt leaves no completion token."""
    a, b = len(pair.prompt) + len(pair.chosen), len(pair.prompt) + len(pair.rejected)
    short = min(a, b)
    L = seq_len - short if short <= seq_len // 2 else seq_len // 2
    if len(pair.prompt) >= L:
        return None
    keep = L - len(pair.prompt)
    return Pair(pair.prompt, pair.chosen[:keep], pair.rejected[:keep])


class PreferenceData(PackedData):
    """Pairs packed whole: pack i holds the pairs `items[i]`, each as two documents (chosen then rejected).

    `full_chosen`: the chosen document's targets are all its tokens (ORPO's NLL); its completion still starts at
    `prompt_len`, which tells the log-prob sums which targets are the completion's."""

    def __init__(self, data: str, tok: Tokenizer, seq_len: int, seed: int, template: str = "auto",
                 overlong: str = "truncate", full_chosen: bool = False):
        super().__init__(seed)
        if overlong not in ("truncate", "drop"):
            raise ZooError(f"--overlong must be 'truncate' or 'drop', got {overlong!r}")
        files = list_files(data)
        encode = Encoder(tok, template)
        self.full_chosen = full_chosen
        self.pairs: list[Pair] = []
        self.where: list[str] = []  # file:line of each pair
        stats: dict[str, int] = {"files": len(files), "pairs": 0, "empty": 0, "identical": 0, "truncated": 0,
                                 "dropped": 0}
        for f, n, obj in read_jsonl(files):
            prompt, chosen, rejected = read_pair(f, n, obj)
            stats["pairs"] += 1
            if not chosen or not rejected:  # "" or no message: nothing to prefer
                stats["empty"] += 1
                continue
            if chosen == rejected:
                stats["identical"] += 1
                continue
            try:
                pair = encode.pair(prompt, chosen, rejected)
            except ZooError as e:
                raise ZooError(f"{f}:{n}: {e}") from e
            if not pair.chosen or not pair.rejected or not pair.prompt and (len(pair.chosen) < 2
                                                                              or len(pair.rejected) < 2):
                stats["empty"] += 1  # no completion token with a token before it to predict it
                continue
            if pair.num_tokens > seq_len:
                cut = fit(pair, seq_len) if overlong == "truncate" else None
                if cut is None:
                    stats["dropped"] += 1
                    continue
                pair = cut
                stats["truncated"] += 1
            self.pairs.append(pair)
            self.where.append(f"{f}:{n}")
        if not self.pairs:
            raise ZooError(f"no usable preference pairs in {data} ({stats})")
        self.seq_len = seq_len
        self.items = first_fit_decreasing([p.num_tokens for p in self.pairs], seq_len)
        self.completion = [(len(p.chosen), len(p.rejected)) for p in self.pairs]
        self.loss_tokens = [sum(sum(self.completion[j]) for j in b) for b in self.items]
        h = hashlib.sha256()
        for p in self.pairs:
            h.update(json.dumps([p.prompt, p.chosen, p.rejected]).encode())
        self.fingerprint = f"preference:{seq_len}:{int(full_chosen)}:{h.hexdigest()[:16]}"
        self.stats = {**stats, "used": len(self.pairs), "packs": len(self.items),
                      "fill": round(sum(p.num_tokens for p in self.pairs) / (len(self.items) * seq_len), 3)}

    def spread(self, packs: int) -> None:
        """At least `packs` packs where there are that many pairs (one optimizer step's worth: with --batch-tokens
        past the data, a step then holds every pair once): the fullest packs are halved until there are."""
        while len(self.items) < packs:
            largest = max(range(len(self.items)), key=lambda i: (len(self.items[i]), -i))
            if len(self.items[largest]) < 2:
                break
            b = self.items[largest]
            self.items[largest:largest + 1] = [b[0::2], b[1::2]]
        self.loss_tokens = [sum(sum(self.completion[j]) for j in b) for b in self.items]
        self._perms.clear()
        self.stats["packs"] = len(self.items)

    def pairs_in(self, i: int) -> list[int]:
        """The pairs of pack i (its documents 2k and 2k+1 are pair k's chosen and rejected)."""
        return self.items[i]

    def prompt_lens(self, i: int) -> list[int]:
        """Per document of pack i, where its completion starts."""
        return [len(self.pairs[j].prompt) for j in self.items[i] for _ in range(2)]

    def _build(self, i: int) -> Packed:
        docs, masks = [], []
        for j in self.items[i]:
            p = self.pairs[j]
            for completion, whole in ((p.chosen, self.full_chosen), (p.rejected, False)):
                docs.append(torch.tensor(p.prompt + completion))
                masks.append(torch.tensor([whole] * len(p.prompt) + [True] * len(completion)))
        return pack(docs, label_masks=masks)
