"""The packs of pretraining text over a dataset written by `python -m recipes.pretokenize` (token shards, document
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
DTYPES = ("uint16", "uint32")
NPY_MAGIC = b"\x93NUMPY"
DAMAGED = "the dataset is damaged: re-create it with python -m recipes.pretokenize"


def token_dtype(n_ids: int) -> str:
    """The smallest unsigned dtype that holds ids 0 .. n_ids - 1 (n_ids: the tokenizer's id_bound)."""
    return "uint16" if n_ids <= 1 << 16 else "uint32"


def tokenizer_hash(tok: Tokenizer) -> str:
    """What decides a dataset's tokens: the tokenizer file and the ids that wrap each document (recipes/data/text.py's
    wrap: the checkpoint's rule, then the eos)."""
    h = hashlib.sha256(tok.path.read_bytes())
    h.update(json.dumps({"added": [tok.added_before, tok.added_after], "eos_id": tok.eos_id,
                         "vocab_size": tok.vocab_size}).encode())
    return h.hexdigest()


def is_dataset(data: str | Path | None) -> bool:
    return data is not None and Path(data).is_dir() and (Path(data) / MANIFEST).is_file()


def read_manifest(root: Path) -> dict[str, Any]:
    """OUT/manifest.json of a tokenized dataset: its format and version, and every field TokenData and
    recipes.pretokenize read, of its type and in its range (a hand-edited manifest fails here, in one line naming the
    field, not as a KeyError or TypeError later)."""
    path = inside(root, MANIFEST, "dataset manifest")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an integer of 5,000 digits
        raise ZooError(f"{path}: not a valid manifest ({str(e)[:200]}); re-create it with python -m "
                       "recipes.pretokenize") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else type(m).__name__
        raise ZooError(f"{path}: expected a {FORMAT} manifest version {VERSION}, got {got}; re-create the dataset "
                       "with python -m recipes.pretokenize")
    problem = _manifest_problem(m)
    if problem is not None:
        raise ZooError(f"{path}: {problem}; {DAMAGED}")
    return m


def _show(obj: dict[str, Any], key: str) -> str:
    """obj[key] as the manifest writes it, for a message (one line, short), or that it is missing."""
    return json.dumps(obj[key])[:60] if key in obj else "nothing (no such key)"


def _count(value: object, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _manifest_problem(m: dict[str, Any]) -> str | None:
    """What is wrong with a manifest of the right format and version, if anything: "FIELD must be ..., got ..."."""
    if m.get("dtype") not in DTYPES:
        return f"dtype must be one of {', '.join(DTYPES)}, got {_show(m, 'dtype')}"
    for key in ("tokens", "documents"):
        if not _count(m.get(key)):
            return f"{key} must be an integer of at least 0, got {_show(m, key)}"
    if not isinstance(m.get("shards"), list):
        return f"shards must be a list, got {_show(m, 'shards')}"
    for k, s in enumerate(m["shards"]):
        if not isinstance(s, dict):
            return f'shards[{k}] must be an object {{"file": ..., "tokens": ...}}, got {json.dumps(s)[:60]}'
        if not isinstance(s.get("file"), str):
            return f"shards[{k}].file must be a file name, got {_show(s, 'file')}"
        if not _count(s.get("tokens"), 1):
            return f"shards[{k}].tokens must be an integer of at least 1, got {_show(s, 'tokens')}"
    held = sum(s["tokens"] for s in m["shards"])
    if held != m["tokens"]:
        return f"tokens must be what the shards hold ({held}), got {m['tokens']}"
    if not isinstance(m.get("tokenizer"), dict) or not isinstance(m["tokenizer"].get("sha256"), str):
        return f'tokenizer must be an object {{"sha256": "...", ...}}, got {_show(m, "tokenizer")}'
    if not isinstance(m.get("sources"), list) or not all(isinstance(x, dict) for x in m["sources"]):
        return f"sources must be a list of objects, got {_show(m, 'sources')}"
    return None


def read_index(path: Path, documents: int, tokens: int) -> np.ndarray:
    """documents.npy mapped (never unpickled): integers, `documents` + 1 of them, from 0 to `tokens`; that they
    increase is checked where a window reads them (TokenData.cuts)."""
    with path.open("rb") as fh:
        head = fh.read(len(NPY_MAGIC))
    if head != NPY_MAGIC:  # a pickle or an .npz archive is never handed to np.load
        raise ZooError(f"{path}: expected a .npy array of document starts (a file starting {NPY_MAGIC!r}), got one "
                       f"starting {head!r}; {DAMAGED}")
    try:
        starts = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # object dtype, a truncated file, a header that does not parse
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ZooError(f"{path}: expected a .npy array of document starts, got a file numpy cannot map ({first}); "
                       f"{DAMAGED}") from e
    if starts.dtype.kind not in "iu" or starts.shape != (documents + 1,):
        raise ZooError(f"{path}: expected {documents + 1} integers (the manifest's documents + 1), got "
                       f"{starts.dtype} {list(starts.shape)}; {DAMAGED}")
    if int(starts[0]) != 0 or int(starts[-1]) != tokens:
        raise ZooError(f"{path}: expected document starts from 0 up to the manifest's {tokens} tokens, got "
                       f"{int(starts[0])} .. {int(starts[-1])}; {DAMAGED}")
    return starts


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
                           f"the model's {tok.path} is {want[:16]}); re-run python -m recipes.pretokenize with "
                           "--tokenizer of this model")
        self.dtype = np.dtype(m["dtype"])
        self.id_bound = tok.id_bound
        if self.id_bound - 1 > np.iinfo(self.dtype).max:  # recipes.pretokenize once picked the dtype by vocab_size
            raise ZooError(f"{self.root}: expected token ids up to {self.id_bound - 1} (the tokenizer {tok.path}'s), "
                           f"got a dataset of {self.dtype}, which cannot hold them: its ids were wrapped around; "
                           "re-create it with python -m recipes.pretokenize")
        self.shards = []
        for s in m["shards"]:
            path = inside(self.root, s["file"], "token shard")
            if path.stat().st_size != s["tokens"] * self.dtype.itemsize:
                raise ZooError(f"{path}: {path.stat().st_size} bytes, the manifest says {s['tokens']} {self.dtype} "
                               f"tokens; {DAMAGED}")
            self.shards.append(path)
        self.shard_starts = np.cumsum([0] + [s["tokens"] for s in m["shards"]])
        self.index_path = inside(self.root, DOCUMENTS, "document index")
        self.doc_starts = read_index(self.index_path, m["documents"], m["tokens"])
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
        lo, hi = (int(x) for x in np.searchsorted(self.doc_starts, [a, b], side="right"))
        # the starts read, and their neighbours, are checked as they are read (checking the whole index at start
        # would read it all): increasing, and bracketing a and b as a search of a sorted index leaves them
        n = len(self.doc_starts)
        near = np.array(self.doc_starts[max(lo - 1, 0) : hi + 1], dtype=np.int64)
        if not (1 <= lo <= hi and (near[1:] > near[:-1]).all() and near[0] <= a
                and (lo == n or self.doc_starts[lo] > a) and (hi == n or self.doc_starts[hi] > b)):
            raise ZooError(f"{self.index_path}: expected increasing document starts, got {near[:8].tolist()} from "
                           f"entry {max(lo - 1, 0)}; {DAMAGED}")
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
        window = self.tokens(cuts[0], cuts[-1])
        if int(window.max()) >= self.id_bound:  # an id no embedding row answers: fail here, not in the model
            raise ZooError(f"{self.root}: expected token ids below {self.id_bound} (the tokenizer's), got "
                           f"{int(window.max())} in tokens {cuts[0]}..{cuts[-1]}; {DAMAGED}")
        ids = torch.from_numpy(window.astype(np.int64))
        return pack(list(ids.split([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)])))
