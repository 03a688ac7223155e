"""Checkpoint tensor names as data: a family's name table of prefix renames and `Fused` entries, and the weight
plans made from it.

A weight plan maps each tensor name on one side to the names it is made from on the other side and how:
`{target: (sources, combine)}`, `combine(list_of_source_tensors) -> tensor`, None for a plain rename. Splits
(InternLM2's fused wqkv into q/k/v) are several targets reading one source; merges are one target reading
several. The converters and `zoo.load` stream one target at a time through these plans; `rename_plans` makes them
from a name table, so the one split and join rule here serves every fused checkpoint tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Combine = Callable[[list[Tensor]], Tensor] | None
Plan = dict[str, tuple[tuple[str, ...], Combine]]


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)"))


FUSED_LAYOUTS = ("equal", "qkv", "kv_groups")


@dataclass(frozen=True)
class Fused:
    """A name-table entry for one Hugging Face tensor that holds the rows (dim 0) of several zoo tensors: the zoo
    prefixes `parts`, in order, are the parts of the HF prefix `hf`; the rest of the name (weight, bias) is shared.
    `layout` says how the rows are laid out, with the head counts and head dim from the config (of layer `{i}` where
    they are per layer, OpenELM):
    "equal": the parts one after another, as many rows each (gate_up_proj, OpenELM's proj_1: [gate; up]);
    "qkv": [q; k; v] with N*H, K*H and K*H rows (Phi-3's qkv_proj, OpenELM's qkv_proj);
    "kv_groups": InternLM2's wqkv, grouped per KV head: each of the K groups holds its N/K query heads, then its key
    head, then its value head ([K, N/K + 2, H, ...]).
    The loader and the converters split and join by this one rule (`split_fused`, `join_fused`); no family writes
    its own."""

    hf: str
    parts: tuple[str, ...]
    layout: str = "equal"

    def __post_init__(self) -> None:
        if self.layout not in FUSED_LAYOUTS:
            raise ValueError(f"fused layout {self.layout!r} is not one of {', '.join(FUSED_LAYOUTS)}")


NameTable = list[tuple[str, str] | Fused]  # (zoo prefix, HF prefix) renames and fused tensors; {i}: a layer index
Names = Sequence[tuple[str, str] | Fused]  # what the functions below read: a NameTable or a list of renames alone


def _heads(config: Any, layer: int) -> tuple[int, int, int]:
    """(N, K, H) of a layer: the config's n_heads, n_kv_heads (per layer where they are tuples) and head_dim."""
    n, k = config.n_heads, config.n_kv_heads
    return (n[layer] if isinstance(n, tuple) else n), (k[layer] if isinstance(k, tuple) else k), config.head_dim


def split_fused(fused_t: Tensor, layout: str, part: int, n_parts: int, heads: tuple[int, int, int]) -> Tensor:
    """Part `part` of a fused tensor's rows (see `Fused`), contiguous."""
    N, K, H = heads
    rest = fused_t.shape[1:]
    if layout == "equal":
        return fused_t.chunk(n_parts)[part].contiguous()
    if layout == "qkv":
        return fused_t.split([N * H, K * H, K * H])[part].contiguous()
    G = N // K
    groups = fused_t.view(K, G + 2, H, *rest)
    chosen = groups[:, :G] if part == 0 else groups[:, G + part - 1]
    return chosen.reshape(-1, *rest).contiguous()


def join_fused(parts: list[Tensor], layout: str, heads: tuple[int, int, int]) -> Tensor:
    """The inverse of split_fused: the parts' rows in the fused layout."""
    if layout != "kv_groups":
        return torch.cat(parts)
    N, K, H = heads
    q, k, v = parts
    rest = q.shape[1:]
    groups = torch.cat([q.view(K, N // K, H, *rest), k.view(K, 1, H, *rest), v.view(K, 1, H, *rest)], dim=1)
    return groups.reshape(-1, *rest)


def rename(zoo_name: str, table: Names) -> str:
    """The HF name of a zoo tensor, by the first matching (zoo prefix, HF prefix) pair; `{i}` is a layer index.
    Fused entries are passed over: a part of a fused tensor has no name of its own."""
    for entry in table:
        if isinstance(entry, Fused):
            continue
        zoo_prefix, hf_prefix = entry
        m = _pattern(zoo_prefix).match(zoo_name)
        if m:
            return hf_prefix.replace("{i}", m.groupdict().get("i") or "") + zoo_name[m.end():]
    raise KeyError(f"no Hugging Face name for {zoo_name!r}")


def _fused_part(zoo_name: str, table: Names) -> tuple[Fused, int, int, str] | None:
    """(entry, part index, layer, name suffix) when zoo_name is a part of a fused tensor of `table`."""
    for entry in table:
        if isinstance(entry, Fused):
            for j, prefix in enumerate(entry.parts):
                m = _pattern(prefix).match(zoo_name)
                if m:
                    return entry, j, int(m.groupdict().get("i") or 0), zoo_name[m.end():]
    return None


def _layer_name(template: str, layer: int, suffix: str) -> str:
    return template.replace("{i}", str(layer)) + suffix


def rename_plans(table: Names) -> tuple[Callable[[object, list[str]], Plan], Callable[[object, list[str]], Plan]]:
    """plan_from_hf and plan_to_hf of a family's name table: renames by prefix, and the parts of each fused
    tensor split from it on the way in and joined into it on the way out by its declared layout."""

    def split(config: object, entry: Fused, part: int, layer: int) -> Combine:
        heads = _heads(config, layer) if entry.layout != "equal" else (0, 0, 0)
        return lambda ts: split_fused(ts[0], entry.layout, part, len(entry.parts), heads)

    def join(config: object, entry: Fused, layer: int) -> Combine:
        heads = _heads(config, layer) if entry.layout != "equal" else (0, 0, 0)
        return lambda ts: join_fused(ts, entry.layout, heads)

    def plan_from_hf(config: object, zoo_names: list[str]) -> Plan:
        plan: Plan = {}
        for z in zoo_names:
            fused = _fused_part(z, table)
            if fused is None:
                plan[z] = ((rename(z, table),), None)
            else:
                entry, part, layer, suffix = fused
                plan[z] = ((_layer_name(entry.hf, layer, suffix),), split(config, entry, part, layer))
        return plan

    def plan_to_hf(config: object, zoo_names: list[str]) -> Plan:
        plan: Plan = {}
        for z in zoo_names:
            fused = _fused_part(z, table)
            if fused is None:
                plan[rename(z, table)] = ((z,), None)
            else:
                entry, _, layer, suffix = fused
                hf_name = _layer_name(entry.hf, layer, suffix)
                if hf_name not in plan:  # at its first part: every part is among the model's names
                    sources = tuple(_layer_name(p, layer, suffix) for p in entry.parts)
                    plan[hf_name] = (sources, join(config, entry, layer))
        return plan

    return plan_from_hf, plan_to_hf


# ---- special-token ids ----
# Each family config carries its checkpoint's bos/eos/pad ids (fields bos_token_id, eos_token_ids, pad_token_id,
# left out of comparisons: they are not architecture). Hugging Face spells them as below, eos as an int or a list.
