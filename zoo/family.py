"""What a model family tells the loader and the converters: its config, its module, and its weight plans.

A weight plan maps each tensor name on one side to the names it is made from on the other side and how:
`{target: (sources, combine)}`, `combine(list_of_source_tensors) -> tensor`, None for a plain rename. Splits
(InternLM2's fused wqkv into q/k/v) are several targets reading one source; merges are one target reading
several. The converters and `zoo.load` stream one target at a time through these plans.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

Combine = Callable[[list[Tensor]], Tensor] | None
Plan = dict[str, tuple[tuple[str, ...], Combine]]


class Family(NamedTuple):
    name: str  # key in zoo checkpoints' config.json ("llama")
    config_cls: type
    model_cls: type
    hf_model_types: tuple[str, ...]  # config.json model_type values this family reads
    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[[Any], dict]
    plan_from_hf: Callable[[Any, list[str]], Plan]  # (config, zoo names) -> {zoo name: (hf names, combine)}
    plan_to_hf: Callable[[Any, list[str]], Plan]  # (config, zoo names) -> {hf name: (zoo names, combine)}


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)"))


def rename(zoo_name: str, table: list[tuple[str, str]]) -> str:
    """The HF name of a zoo tensor, by the first matching (zoo prefix, HF prefix) pair; `{i}` is a layer index."""
    for zoo_prefix, hf_prefix in table:
        m = _pattern(zoo_prefix).match(zoo_name)
        if m:
            return hf_prefix.replace("{i}", m.groupdict().get("i") or "") + zoo_name[m.end():]
    raise KeyError(f"no Hugging Face name for {zoo_name!r}")


def rename_plans(table: list[tuple[str, str]]) -> tuple[Callable, Callable]:
    """plan_from_hf and plan_to_hf for a family whose conversion is a pure rename by prefix `table`."""

    def plan_from_hf(config, zoo_names: list[str]) -> Plan:
        return {z: ((rename(z, table),), None) for z in zoo_names}

    def plan_to_hf(config, zoo_names: list[str]) -> Plan:
        return {rename(z, table): ((z,), None) for z in zoo_names}

    return plan_from_hf, plan_to_hf
