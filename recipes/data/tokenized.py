"""The packs of pretraining text over a dataset written by `python -m recipes.tokenize` (token shards, document
index, manifest), read by memory map: nothing in proportion to the corpus is read or held at start."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recipes.data.packs import PackedData
from zoo import Packed, ZooError, pack
from zoo.io.paths import inside
from zoo.io.tokenizer import Tokenizer

FORMAT, VERSION, MANIFEST, DOCUMENTS = "zoo-tokens", 1, "manifest.json", "documents.npy"


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_hash(tok: Tokenizer) -> str:
    """What decides a dataset's tokens: the tokenizer file and the ids that wrap each document."""
    h = hashlib.sha256(tok.path.read_bytes())
    h.update(json.dumps({"bos_id": tok.bos_id, "eos_id": tok.eos_id, "vocab_size": tok.vocab_size}).encode())
    return h.hexdigest()


def is_dataset(data: str | Path | None) -> bool:
    return data is not None and Path(data).is_dir() and (Path(data) / MANIFEST).is_file()


def read_manifest(root: Path) -> dict[str, Any]:
    """OUT/manifest.json of a tokenized dataset, its format and version checked."""
    path = inside(root, MANIFEST, "dataset manifest")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZooError(f"{path}: not a valid manifest ({e}); re-create it with python -m recipes.tokenize") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else type(m).__name__
        raise ZooError(f"{path}: expected a {FORMAT} manifest version {VERSION}, got {got}; re-create the dataset "
                       "with python -m recipes.tokenize")
    return m


class TokenData(PackedData):
    """The packs of PretrainData over a tokenized dataset, read by memory map: start-up reads the manifest and
    stats the shards (nothing in proportion to the corpus), and a pack reads only its own window's tokens and the
    few document offsets around it. Pack i is the same window, cut at the same document starts, as PretrainData
    builds from the JSONL the dataset was made from."""

    def __init__(self, data: str | Path, tok: Tokenizer, seq_len: int, seed: int):
        super().__init__(seed)
        self.root = Path(data)
        m = read_manifest(self.root)
        want = tokenizer_hash(tok)
        if m["tokenizer"]["sha256"] != want:
            raise ZooError(f"{self.root}: tokenized with another tokenizer (manifest {m['tokenizer']['sha256'][:16]}, "
                           f"the model's {tok.path} is {want[:16]}); re-run python -m recipes.tokenize with "
                           "--tokenizer of this model")
        self.dtype = np.dtype(m["dtype"])
        self.shards = []
        for s in m["shards"]:
            path = inside(self.root, s["file"], "token shard")
            if path.stat().st_size != s["tokens"] * self.dtype.itemsize:
                raise ZooError(f"{path}: {path.stat().st_size} bytes, the manifest says {s['tokens']} {self.dtype} "
                               "tokens; the dataset is damaged: re-create it")
            self.shards.append(path)
        self.shard_starts = np.cumsum([0] + [s["tokens"] for s in m["shards"]])
        self.doc_starts = np.load(inside(self.root, DOCUMENTS, "document index"), mmap_mode="r")
        if self.doc_starts.shape != (m["documents"] + 1,) or int(self.shard_starts[-1]) != m["tokens"]:
            raise ZooError(f"{self.root}: the document index or the shards disagree with the manifest; re-create it")
        self.seq_len = seq_len
        self.n_windows = m["tokens"] // seq_len
        if self.n_windows == 0:
            raise ZooError(f"{data} holds {m['tokens']} tokens, fewer than one --seq-len ({seq_len}); lower "
                           "--seq-len or add text")
        # the manifest names every source by hash and the tokenizer: its hash identifies the tokens
        digest = hashlib.sha256(inside(self.root, MANIFEST).read_bytes()).hexdigest()
        self.fingerprint = f"pretrain:{seq_len}:{digest[:16]}"
        self.stats = {"files": len(m["sources"]), "documents": m["documents"], "tokens": m["tokens"],
                      "packs": self.n_windows, "dataset": str(self.root)}

    def __len__(self) -> int:
        return self.n_windows

    def cuts(self, i: int) -> list[int]:
        """Window i's start, the document starts strictly inside it, its end (PretrainData.items[i])."""
        a, b = i * self.seq_len, (i + 1) * self.seq_len
        lo, hi = np.searchsorted(self.doc_starts, [a, b], side="right")
        inner = [int(x) for x in self.doc_starts[lo:hi] if x < b]
        return [a, *inner, b]

    def _loss_tokens(self, i: int) -> int:
        return self.seq_len - (len(self.cuts(i)) - 1)

    def tokens(self, a: int, b: int) -> np.ndarray:
        """Stream positions a..b-1, across shard boundaries."""
        parts = []
        k = int(np.searchsorted(self.shard_starts, a, side="right")) - 1
        while a < b:
            start, end = int(self.shard_starts[k]), int(self.shard_starts[k + 1])
            take = min(b, end)
            # a map of just these tokens, copied and unmapped: a map of the whole shard would keep every page the
            # run touched resident (the kernel maps page-cache folios of up to 2 MB per fault), so the resident set
            # would grow with the corpus over a run
            window = np.memmap(self.shards[k], dtype=self.dtype, mode="r", offset=(a - start) * self.dtype.itemsize,
                               shape=(take - a,))
            parts.append(np.array(window))
            del window
            a, k = take, k + 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _build(self, i: int) -> Packed:
        cuts = self.cuts(i)
        ids = torch.from_numpy(self.tokens(cuts[0], cuts[-1]).astype(np.int64))
        return pack(list(ids.split([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)])))
