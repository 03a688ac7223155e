"""SFT data: JSONL chats rendered with a chat template, loss on assistant tokens only, samples packed whole into
--seq-len bins by first-fit decreasing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from recipes.data.jsonl import JSONObject, list_files, read_jsonl
from recipes.data.packs import PackedData, first_fit_decreasing
from recipes.tokenizer import ASSETS
from zoo import Packed, ZooError, pack
from zoo.io.tokenizer import Message, Tokenizer, encode_chat

# a role outside these ("gpt", "human", "asistant") would be rendered as its own header and never trained on,
# silently; tool results go by "tool", "ipython" (Llama 3.1) or "function", OpenAI's newer system by "developer"
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


def check_messages(f: Path, n: int, obj: JSONObject) -> list[Message]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise ZooError(f"{f}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with string "
                       f"role and content, got {json.dumps(obj)[:120]}")
    unknown = [m["role"] for m in msgs if m["role"] not in ROLES]
    if unknown:
        raise ZooError(f"{f}:{n}: expected roles {', '.join(ROLES)}, got {unknown[0][:40]!r}")
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
        for ids_T, mask_T in self.samples:
            h.update(ids_T.numpy().tobytes())
            h.update(mask_T.numpy().tobytes())
        self.fingerprint = f"sft:{seq_len}:{h.hexdigest()[:16]}"
        self.stats = {**stats, "used": len(self.samples), "packs": len(self.items),
                      "fill": round(sum(len(s[0]) for s in self.samples) / (len(self.items) * seq_len), 3)}

    def _build(self, i: int) -> Packed:
        docs = [self.samples[j] for j in self.items[i]]
        return pack([d[0] for d in docs], label_masks=[d[1] for d in docs])
