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
(with `full_chosen`, every token of prompt + chosen: ORPO's NLL term); with `share_prompt`, one segment prompt +
chosen + rejected (a `PairPack`, its targets in a `TargetPlan`). Pairs are packed whole into --seq-len bins by
first-fit decreasing; a pack holds as many as fit. What cannot be trained is skipped and counted in `stats`: a pair
with an empty completion, chosen equal to rejected (its DPO loss is the constant log 2), and pairs longer than
--seq-len with --overlong drop (with truncate, both sequences keep their start, cut to fit, and the pair is skipped
only when the prompt leaves no completion token; a pair is measured as two documents in either layout, so both
layouts train the same tokens). A field missing or of the wrong type is an error naming file:line.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recipes.data.chat import check_messages
from recipes.data.jsonl import JSONObject, list_files, read_jsonl
from recipes.data.packs import PackedData, describe_stats, first_fit_decreasing
from zoo import Packed, ZooError, pack
from zoo.core.forks import Forks
from zoo.core.packing import with_seqlens
from zoo.io.tokenizer import Message, Tokenizer, render


@dataclass(frozen=True)
class Pair:
    """One preference pair as token ids: the shared prompt, the two completions (prompt excluded)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens of the two documents, prompt + chosen and prompt + rejected."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)

    @property
    def shared_tokens(self) -> int:
        """Tokens of the shared-prompt layout, prompt + chosen + rejected."""
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass(eq=False, kw_only=True)
class PairPack(Packed):
    """Pairs laid out prompt + chosen + rejected, one segment per pair (cu_seqlens), the rejected tokens' positions
    restarting after the prompt, so the prompt runs through the model once. Attention alone runs on the two-document
    layout (`expanded`: prompt + chosen, prompt + rejected per pair, as the model would see two documents):
    `expand_E` gathers each segment's queries, keys and values into it (the prompt's twice) and `take_T` says where
    each token's output sits there (a prompt token's, in prompt + chosen). A model sees a Packed whose documents
    fork (`forks()`, zoo.core.forks: the prompt, then each answer continuing from it): the attention wrapper of
    recipes.dpo (`SharedPromptAttention`) does the gathering, a recurrent mixer (Gated DeltaNet) starts both answers
    from the prompt's final state."""

    expanded: Packed
    expand_E: torch.Tensor
    take_T: torch.Tensor
    pieces: Forks  # prompt, then chosen and rejected each continuing from it: what a recurrent mixer follows

    def forks(self) -> Forks:
        return self.pieces

    def to(self, device: torch.device | str) -> PairPack:
        moved = super().to(device)
        assert isinstance(moved, PairPack)  # dataclasses.replace keeps the class
        moved.expanded = self.expanded.to(device)
        moved.expand_E, moved.take_T = self.expand_E.to(device), self.take_T.to(device)
        return moved


@dataclass(frozen=True)
class TargetPlan:
    """What a shared-prompt pack's log-prob sums count, per target M: the row whose hidden state predicts it, the
    token, its document (2k: pair k's chosen, 2k+1: its rejected) and whether it is a completion token."""

    rows_M: torch.Tensor
    targets_M: torch.Tensor
    doc_M: torch.Tensor
    completion_M: torch.Tensor

    def to(self, device: torch.device | str) -> TargetPlan:
        return TargetPlan(*(t.to(device) for t in (self.rows_M, self.targets_M, self.doc_M, self.completion_M)))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Encoder:
    """Text or conversations to ids, as TRL's DPOTrainer tokenizes them."""

    def __init__(self, tok: Tokenizer, template: str):
        self.tok, self.template = tok, template

    def text(self, s: str) -> list[int]:
        """TRL tokenizes a prompt, and prompt + answer, as transformers' tokenizer(text): the checkpoint's rule."""
        return self.tok.encode(s)

    def chat(self, messages: list[Message], generation_prompt: bool = False) -> list[int]:
        text = render(messages, self.template, self.tok, add_generation_prompt=generation_prompt).text
        return self.tok.encode(text, add_special_tokens=False)  # the template writes its special tokens

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
                 overlong: str = "truncate", full_chosen: bool = False, share_prompt: bool = False):
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
            raise ZooError(f"no usable preference pairs in {data} ({describe_stats(dict(stats))})")
        self.seq_len, self.share_prompt = seq_len, share_prompt
        lengths = [p.shared_tokens if share_prompt else p.num_tokens for p in self.pairs]
        self.items = first_fit_decreasing(lengths, seq_len)
        self.completion = [(len(p.chosen), len(p.rejected)) for p in self.pairs]
        self.loss_tokens = [sum(sum(self.completion[j]) for j in b) for b in self.items]
        h = hashlib.sha256()
        for p in self.pairs:
            h.update(json.dumps([p.prompt, p.chosen, p.rejected]).encode())
        self.fingerprint = f"preference:{seq_len}:{int(full_chosen)}:{int(share_prompt)}:{h.hexdigest()[:16]}"
        self.stats = {**stats, "used": len(self.pairs), "packs": len(self.items),
                      "fill": round(sum(lengths) / (len(self.items) * seq_len), 3)}

    def spread(self, packs: int) -> None:
        """At least `packs` packs where there are that many pairs (one per data-parallel rank: with --batch-tokens
        past the data, a step holds every pack once, and each rank then has one of its own): the fullest packs are
        halved until there are."""
        while len(self.items) < packs:
            largest = max(range(len(self.items)), key=lambda i: (len(self.items[i]), -i))
            if len(self.items[largest]) < 2:
                break
            b = self.items[largest]
            self.items[largest:largest + 1] = [b[0::2], b[1::2]]
        self.loss_tokens = [sum(sum(self.completion[j]) for j in b) for b in self.items]
        self._perms.clear()
        self.stats["packs"] = len(self.items)

    def seqlens(self, i: int) -> list[int]:
        """The lengths of pack i's documents (of its pairs' segments, with a shared prompt), without building it."""
        if self.share_prompt:
            return [self.pairs[j].shared_tokens for j in self.items[i]]
        return [n for j in self.items[i] for n in (len(self.pairs[j].prompt) + len(self.pairs[j].chosen),
                                                   len(self.pairs[j].prompt) + len(self.pairs[j].rejected))]

    def pairs_in(self, i: int) -> list[int]:
        """The pairs of pack i (its documents 2k and 2k+1 are pair k's chosen and rejected)."""
        return self.items[i]

    def prompt_lens(self, i: int) -> list[int]:
        """Per document of pack i, where its completion starts."""
        return [len(self.pairs[j].prompt) for j in self.items[i] for _ in range(2)]

    def _build(self, i: int) -> Packed:
        if self.share_prompt:
            return self._build_shared(i)
        docs, masks = [], []
        for j in self.items[i]:
            p = self.pairs[j]
            for completion, whole in ((p.chosen, self.full_chosen), (p.rejected, False)):
                docs.append(torch.tensor(p.prompt + completion))
                masks.append(torch.tensor([whole] * len(p.prompt) + [True] * len(completion)))
        return pack(docs, label_masks=masks)

    def _build_shared(self, i: int) -> PairPack:
        ids: list[int] = []
        pos: list[int] = []
        doc_len: list[int] = []
        expand: list[int] = []
        take: list[int] = []
        halves: list[torch.Tensor] = []
        lens: list[int] = []
        parents: list[int] = []
        for j in self.items[i]:
            p = self.pairs[j]
            P, C, R = len(p.prompt), len(p.chosen), len(p.rejected)
            at, e_at = len(ids), len(expand)
            prompt = [len(lens)] if P else [-1]  # no prompt: each answer starts the segment
            lens += [P, C, R] if P else [C, R]
            parents += [-1, *prompt * 2] if P else prompt * 2
            ids += p.prompt + p.chosen + p.rejected
            pos += [*range(P + C), *range(P, P + R)]
            # a prompt token's length is its chosen document's (only RoPE scaled by the document's length reads it)
            doc_len += [P + C] * (P + C) + [P + R] * R
            expand += [*range(at, at + P + C), *range(at, at + P), *range(at + P + C, at + P + C + R)]
            take += [*range(e_at, e_at + P + C), *range(e_at + 2 * P + C, e_at + 2 * P + C + R)]
            halves += [torch.tensor(p.prompt + p.chosen), torch.tensor(p.prompt + p.rejected)]
        segments = [self.pairs[j].shared_tokens for j in self.items[i]]
        cu = torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.int32)
        packed = PairPack(input_ids=torch.tensor(ids), cu_seqlens=cu, position_ids=torch.tensor(pos),
                          max_seqlen=max(segments), doc_len=torch.tensor(doc_len), expanded=pack(halves),
                          expand_E=torch.tensor(expand), take_T=torch.tensor(take),
                          pieces=Forks(tuple(lens), tuple(parents)))
        return with_seqlens(packed, segments)

    def target_plan(self, i: int) -> TargetPlan:
        """The targets of pack i in the shared-prompt layout (see TargetPlan): chosen's as in its own document (every
        token's with `full_chosen`, else the completion's); rejected's first token predicted by the prompt's last
        row, the rest by the rejected rows before them."""
        rows: list[int] = []
        targets: list[int] = []
        docs: list[int] = []
        completion: list[bool] = []
        at = 0
        for k, j in enumerate(self.items[i]):
            p = self.pairs[j]
            P, C, R = len(p.prompt), len(p.chosen), len(p.rejected)
            seq = p.prompt + p.chosen
            for u in range(1 if self.full_chosen else max(P, 1), P + C):  # token u of prompt + chosen
                rows.append(at + u - 1)
                targets.append(seq[u])
                docs.append(2 * k)
                completion.append(u >= P)
            for u in range(max(P, 1), P + R):  # token u of prompt + rejected: rejected[u - P]
                rows.append(at + u - 1 if u - 1 < P else at + C + u - 1)
                targets.append(p.rejected[u - P])
                docs.append(2 * k + 1)
                completion.append(True)
            at += P + C + R
        return TargetPlan(torch.tensor(rows), torch.tensor(targets), torch.tensor(docs), torch.tensor(completion))
