"""Pretraining on JSONL text: documents encoded by the checkpoint's rule (its bos first for Llama and the bundled
tokenizer, as `python -m zoo.generate --prompt` encodes a prompt) and closed by the eos, concatenated and cut into
--seq-len windows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from recipes.data.jsonl import JSONObject, list_files, read_jsonl
from recipes.data.packs import PackedData
from recipes.data.tokenized import TokenData, is_dataset
from recipes.data.tokenizer_choice import ASSETS
from zoo import Packed, ZooError, pack
from zoo.io.tokenizer import Tokenizer


def text_of(f: Path, n: int, obj: JSONObject) -> str:
    """The document of a pretraining line: {"text": "..."}."""
    text = obj.get("text")
    if not isinstance(text, str):
        if isinstance(text, (list, dict)):
            value = "<an array>" if isinstance(text, list) else "<an object>"
        else:
            value = json.dumps(text)[:40]  # null, a number, true or false
        got = f"{{\"text\": {value}}}" if "text" in obj else f"keys {sorted(obj)[:10]}"
        raise ZooError(f"{f}:{n}: expected {{\"text\": \"...\"}}, got {got}")
    return text


def wrap(tok: Tokenizer, ids: list[int]) -> list[int]:
    """A pretraining document as it enters the stream: `ids` (encoded with nothing added) between the special tokens
    the checkpoint adds around a text (`Tokenizer.encode`'s rule), then the eos that ends a document (when the
    tokenizer has one and the rule did not put it there already)."""
    doc = tok.added_before + ids + tok.added_after
    return doc + [tok.eos_id] if tok.eos_id is not None and doc[-1:] != [tok.eos_id] else doc


class PretrainData(PackedData):
    def __init__(self, data: str | None, tok: Tokenizer, seq_len: int, seed: int):
        super().__init__(seed)
        files = list_files(data or ASSETS / "corpus.jsonl")
        texts = [text_of(f, n, obj) for f, n, obj in read_jsonl(files)]
        stream: list[int] = []
        starts: list[int] = []
        for ids in tok.encode_batch(texts, add_special_tokens=False):
            if not ids:  # an empty document adds nothing, not even <s> </s>
                continue
            starts.append(len(stream))
            stream += wrap(tok, ids)
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


def pretrain_data(data: str | None, tok: Tokenizer, seq_len: int, seed: int) -> PackedData:
    """--data as a tokenized dataset (a directory with manifest.json) or JSONL."""
    if data is not None and is_dataset(data):
        return TokenData(data, tok, seq_len, seed)
    return PretrainData(data, tok, seq_len, seed)
