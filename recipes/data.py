"""Training data as a deterministic sequence of packs: pack g of the run is a pure function of (data, seed, g).

That makes resuming exact (the data position is one integer) and makes the losses independent of the process
count: step s uses packs s*P .. s*P+P-1 (P = batch_tokens / seq_len), and data-parallel rank r takes its
contiguous slice of them. Each epoch visits the packs in a new seeded permutation.

- PretrainData: JSONL {"text": ...}; documents get <s> ... </s>, are concatenated and cut into seq_len windows;
  the pieces of documents inside a window are packed as separate documents (positions restart, no cross-document
  attention or targets).
- SFTData: JSONL {"messages": [{"role", "content"}, ...]}; each sample rendered with a chat template, loss on
  assistant tokens only, samples packed whole into seq_len bins by first-fit decreasing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recipes.tokenizer import Tokenizer, encode_chat
from zoo import Packed, ZooError, pack

ASSETS = Path(__file__).resolve().parent / "assets"


def list_files(data: str | Path, suffixes: tuple[str, ...] = (".jsonl",)) -> list[Path]:
    """A file, or every *.jsonl under a directory (sorted, so the order is the same on every machine)."""
    p = Path(data)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        if not files:
            raise ZooError(f"no {'/'.join(suffixes)} files under {p}")
        return files
    raise ZooError(f"data {p} does not exist: expected a {'/'.join(suffixes)} file or a directory of them")


def read_jsonl(files: list[Path]) -> Iterator[tuple[Path, int, dict]]:
    """(file, line number, object) for every non-blank line; a malformed line is an error naming both."""
    for f in files:
        with f.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ZooError(f"{f}:{n}: malformed JSON line ({e.msg} at column {e.colno}); "
                                   "each line must be one JSON object") from e
                if not isinstance(obj, dict):
                    raise ZooError(f"{f}:{n}: expected a JSON object per line, got {type(obj).__name__}")
                yield f, n, obj


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass
class PackedData:
    """Packs by global index; subclasses fill `items` (what pack i holds) and implement `_build`."""

    seed: int
    items: list = field(default_factory=list)
    loss_tokens: list[int] = field(default_factory=list)  # targets in each pack
    fingerprint: str = ""
    stats: dict = field(default_factory=dict)
    _perms: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.items)

    def index(self, g: int) -> int:
        """Which pack the run's g-th pack is: epoch g // len, in that epoch's permutation."""
        epoch, i = divmod(g, len(self.items))
        if epoch not in self._perms:
            self._perms = {epoch: _permutation(len(self.items), self.seed, epoch)}
        return int(self._perms[epoch][i])

    def pack(self, g: int) -> Packed:
        return self._build(self.index(g))

    def num_loss_tokens(self, g: int) -> int:
        return self.loss_tokens[self.index(g)]

    def _build(self, i: int) -> Packed:
        raise NotImplementedError


class PretrainData(PackedData):
    def __init__(self, data: str | None, tok: Tokenizer, seq_len: int, seed: int):
        super().__init__(seed)
        files = list_files(data or ASSETS / "corpus.jsonl")
        stream, starts = [], []
        for f, n, obj in read_jsonl(files):
            text = obj.get("text")
            if not isinstance(text, str):
                raise ZooError(f"{f}:{n}: expected {{\"text\": \"...\"}}, got keys {sorted(obj)}")
            ids = tok.encode(text)
            if not ids:
                continue
            starts.append(len(stream))
            stream += ([tok.bos_id] if tok.bos_id is not None else []) + ids
            stream += [tok.eos_id] if tok.eos_id is not None else []
        n_windows = len(stream) // seq_len
        if n_windows == 0:
            raise ZooError(f"{data or 'the corpus'} holds {len(stream)} tokens, fewer than one --seq-len "
                           f"({seq_len}); lower --seq-len or add text")
        self.stream = torch.tensor(stream[: n_windows * seq_len], dtype=torch.int32)
        self.seq_len = seq_len
        doc_starts = torch.tensor(starts + [len(stream)], dtype=torch.int64)
        # cut points of window i: its start, the document starts inside it, its end
        self.items = []
        for i in range(n_windows):
            a, b = i * seq_len, (i + 1) * seq_len
            inner = doc_starts[(doc_starts > a) & (doc_starts < b)].tolist()
            self.items.append([a, *inner, b])
        self.loss_tokens = [seq_len - (len(cuts) - 1) for cuts in self.items]
        h = hashlib.sha256(self.stream.numpy().tobytes())
        self.fingerprint = f"pretrain:{seq_len}:{h.hexdigest()[:16]}"
        self.stats = {"files": len(files), "documents": len(starts), "tokens": len(stream), "packs": n_windows}

    def _build(self, i: int) -> Packed:
        cuts = self.items[i]
        ids = self.stream[cuts[0] : cuts[-1]].long()
        return pack(list(ids.split([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)])))


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: longest first, each into the first bin it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}")
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def check_messages(f: Path, n: int, obj: dict) -> list[dict]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise ZooError(f"{f}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with string "
                       f"role and content, got {json.dumps(obj)[:120]}")
    return msgs


class SFTData(PackedData):
    def __init__(self, data: str | None, tok: Tokenizer, seq_len: int, seed: int, template: str = "auto",
                 overlong: str = "truncate"):
        super().__init__(seed)
        if overlong not in ("truncate", "drop"):
            raise ZooError(f"--overlong must be 'truncate' or 'drop', got {overlong!r}")
        files = list_files(data or ASSETS / "chat.jsonl")
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        stats = {"files": len(files), "samples": 0, "no_assistant": 0, "truncated": 0, "dropped": 0}
        for f, n, obj in read_jsonl(files):
            msgs = check_messages(f, n, obj)
            stats["samples"] += 1
            if not any(m["role"] == "assistant" for m in msgs):
                stats["no_assistant"] += 1
                continue
            try:
                ids, mask = encode_chat(msgs, template, tok)
            except ZooError as e:
                raise ZooError(f"{f}:{n}: {e}") from e
            if len(ids) > seq_len:
                if overlong == "drop" or not any(mask[1:seq_len]):
                    stats["dropped"] += 1
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]
                stats["truncated"] += 1
            self.samples.append((torch.tensor(ids), torch.tensor(mask)))
        if not self.samples:
            raise ZooError(f"no usable chat samples in {data or 'the bundled chat set'} ({stats})")
        self.items = first_fit_decreasing([len(ids) for ids, _ in self.samples], seq_len)
        # a target is a token whose *next* token is an assistant token (zoo.pack shifts the mask)
        self.loss_tokens = [sum(int(self.samples[j][1][1:].sum()) for j in b) for b in self.items]
        h = hashlib.sha256()
        for ids, mask in self.samples:
            h.update(ids.numpy().tobytes())
            h.update(mask.numpy().tobytes())
        self.fingerprint = f"sft:{seq_len}:{h.hexdigest()[:16]}"
        stats.update(used=len(self.samples), packs=len(self.items),
                     fill=round(sum(len(s[0]) for s in self.samples) / (len(self.items) * seq_len), 3))
        self.stats = stats

    def _build(self, i: int) -> Packed:
        docs = [self.samples[j] for j in self.items[i]]
        return pack([d[0] for d in docs], label_masks=[d[1] for d in docs])
