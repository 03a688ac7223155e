"""SFT data: JSONL chats rendered with a chat template, loss on assistant tokens only, samples packed whole into
--seq-len bins by first-fit decreasing.

A sample is TRL's conversational format: {"messages": [...]} with, optionally, "tools" (JSON schemas, or a string
holding them, as the template's `tools`) and "chat_template_kwargs" (template switches such as
{"enable_thinking": false}, over those of --chat-template-kwargs). An assistant message may carry "tool_calls"
(then its content may be empty, null or absent) and its reasoning ("reasoning_content"); tool-call turns train like
any assistant turn."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from recipes.data.jsonl import JSONObject, list_files, read_jsonl
from recipes.data.packs import PackedData, describe_stats, first_fit_decreasing
from recipes.data.tokenizer_choice import ASSETS
from zoo import Packed, ZooError, pack
from zoo.io.json_input import check_switches, load_json_bounded
from zoo.io.tokenizer import Message, Tokenizer, encode_chat

# a role outside these ("gpt", "human", "asistant") would be rendered as its own header and never trained on,
# silently; tool results go by "tool", "ipython" (Llama 3.1) or "function", OpenAI's newer system by "developer"
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


def check_messages(f: Path, n: int, obj: JSONObject) -> list[Message]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        raise ZooError(f"{f}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with string "
                       f"role and content, got {json.dumps(obj)[:120]}")
    unknown = [m["role"] for m in msgs if m["role"] not in ROLES]
    if unknown:
        raise ZooError(f"{f}:{n}: expected roles {', '.join(ROLES)}, got {unknown[0][:40]!r}")
    for k, m in enumerate(msgs):
        problem = _message_problem(m)
        if problem:
            raise ZooError(f"{f}:{n}: expected {problem} in message {k} ({m['role']}), got {json.dumps(m)[:120]}")
    return msgs


def _message_problem(m: JSONObject) -> str | None:
    """What is wrong with one message, or None: content a string (or, beside tool calls, empty, null or absent),
    tool_calls a list of {"function": {"name": str, "arguments": object or JSON string}}, reasoning a string."""
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant":
            return "tool_calls on assistant messages only"
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            return ('tool_calls as [{"type": "function", "function": {"name": ..., "arguments": {...}}}, ...]')
    content = m.get("content")
    if not (isinstance(content, str) or (calls and content is None)):
        return "string content (null or absent only beside tool_calls)"
    if any(not isinstance(m.get(k), str | None) for k in ("reasoning_content", "thinking", "reasoning", "name")):
        return "string reasoning_content, thinking, reasoning and name"
    return None


def _is_call(call: object) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(
        function.get("arguments", {}), dict | str)


def check_template_input(f: Path | str, n: int, obj: JSONObject,
                         kwargs: dict[str, Any]) -> tuple[list[JSONObject] | None, dict[str, Any]]:
    """A sample's tools (a list of JSON schemas, or a string holding one) and its template switches (its
    chat_template_kwargs over `kwargs`, the recipe's)."""
    tools = obj.get("tools")
    if isinstance(tools, str):  # datasets often store the schemas as JSON text (Arrow cannot hold mixed types)
        try:
            tools = load_json_bounded(tools, f"{f}:{n}: \"tools\"")
        except json.JSONDecodeError as e:
            raise ZooError(f"{f}:{n}: \"tools\" is a string but not JSON ({e.msg})") from e
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ZooError(f"{f}:{n}: expected \"tools\" as a list of JSON schemas (objects), got "
                       f"{json.dumps(obj.get('tools'))[:120]}")
    own = obj.get("chat_template_kwargs") or {}
    if not isinstance(own, dict):
        raise ZooError(f"{f}:{n}: expected \"chat_template_kwargs\" as an object, got {json.dumps(own)[:120]}")
    check_switches(own, f"{f}:{n}: \"chat_template_kwargs\"")
    return tools, {**kwargs, **own}


class SFTData(PackedData):
    def __init__(self, data: str | None, tok: Tokenizer, seq_len: int, seed: int, template: str = "auto",
                 overlong: str = "truncate", template_kwargs: dict[str, Any] | None = None):
        super().__init__(seed)
        if overlong not in ("truncate", "drop"):
            raise ZooError(f"--overlong must be 'truncate' or 'drop', got {overlong!r}")
        files = list_files(data or ASSETS / "chat.jsonl")
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        stats = {"files": len(files), "samples": 0, "no_assistant": 0, "truncated": 0, "dropped": 0}
        for f, n, obj in read_jsonl(files):
            msgs = check_messages(f, n, obj)
            tools, switches = check_template_input(f, n, obj, template_kwargs or {})
            stats["samples"] += 1
            if not any(m["role"] == "assistant" for m in msgs):
                stats["no_assistant"] += 1
                continue
            try:
                ids, mask = encode_chat(msgs, template, tok, tools=tools, **switches)
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
            raise ZooError(f"no usable chat samples in {data or 'the bundled chat set'}: {describe_stats(stats)}")
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
