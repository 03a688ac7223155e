"""What a model family tells the loader and the converters: its config, its module, and its weight plans.

A weight plan maps each tensor name on one side to the names it is made from on the other side and how:
`{target: (sources, combine)}`, `combine(list_of_source_tensors) -> tensor`, None for a plain rename. Splits
(InternLM2's fused wqkv into q/k/v) are several targets reading one source; merges are one target reading
several. The converters and `zoo.load` stream one target at a time through these plans.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from torch import Tensor

from zoo.errors import ZooError

if TYPE_CHECKING:
    from zoo.models import Model

Combine = Callable[[list[Tensor]], Tensor] | None
Plan = dict[str, tuple[tuple[str, ...], Combine]]
# (config, zoo names) -> plan. The config is Any: each family's functions take their own config class, and a
# registry of families can only name what they have in common.
PlanFn = Callable[[Any, list[str]], Plan]


class Family(NamedTuple):
    name: str  # key in zoo checkpoints' config.json ("llama")
    config_cls: type[Any]
    model_cls: Callable[..., Model]  # model_cls(config, attn=...)
    hf_model_types: tuple[str, ...]  # config.json model_type values this family reads
    config_from_hf: Callable[[dict[str, Any]], Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    plan_from_hf: PlanFn  # (config, zoo names) -> {zoo name: (hf names, combine)}
    plan_to_hf: PlanFn  # (config, zoo names) -> {hf name: (zoo names, combine)}


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)"))


def rename(zoo_name: str, table: list[tuple[str, str]]) -> str:
    """The HF name of a zoo tensor, by the first matching (zoo prefix, HF prefix) pair; `{i}` is a layer index."""
    for zoo_prefix, hf_prefix in table:
        m = _pattern(zoo_prefix).match(zoo_name)
        if m:
            return hf_prefix.replace("{i}", m.groupdict().get("i") or "") + zoo_name[m.end():]
    raise KeyError(f"no Hugging Face name for {zoo_name!r}")


def rename_plans(table: list[tuple[str, str]]) -> tuple[PlanFn, PlanFn]:
    """plan_from_hf and plan_to_hf for a family whose conversion is a pure rename by prefix `table`."""

    def plan_from_hf(config: Any, zoo_names: list[str]) -> Plan:
        return {z: ((rename(z, table),), None) for z in zoo_names}

    def plan_to_hf(config: Any, zoo_names: list[str]) -> Plan:
        return {rename(z, table): ((z,), None) for z in zoo_names}

    return plan_from_hf, plan_to_hf


# ---- special-token ids ----
# Each family config carries its checkpoint's bos/eos/pad ids (fields bos_token_id, eos_token_ids, pad_token_id,
# left out of comparisons: they are not architecture). Hugging Face spells them as below, eos as an int or a list.

HF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class HasTokenIds(Protocol):
    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def pad_token_id(self) -> int | None: ...


def token_ids_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The family-config fields of a Hugging Face config's special-token ids; absent (null) ones are left out."""
    out: dict[str, Any] = {}
    if hf.get("bos_token_id") is not None:
        out["bos_token_id"] = int(hf["bos_token_id"])
    eos = hf.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if hf.get("pad_token_id") is not None:
        out["pad_token_id"] = int(hf["pad_token_id"])
    return out


def token_ids_to_hf(cfg: HasTokenIds) -> dict[str, Any]:
    """The Hugging Face config keys of the ids a family config knows (eos_token_id an int when there is one)."""
    out: dict[str, Any] = {}
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        eos = cfg.eos_token_ids
        out["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out


# ---- checking a config before anything is built from it ----

POSITIVE_INTS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len",
                 "image_size", "patch_size", "n_channels")
POSITIVE_FLOATS = ("norm_eps", "rope_theta")
MAX_PARAMS = int(os.environ.get("ZOO_MAX_PARAMS", 2 * 10**12))  # above every published model; env to raise it


def check_config(config: Any, where: str) -> None:
    """Every size a positive integer (or a tuple of them), every eps and RoPE base a finite positive number, and
    an estimate of the parameter count under MAX_PARAMS: a ZooError naming the field, before a module exists (a
    `num_hidden_layers: 1e9` would otherwise grow memory without bound, a NaN rope_theta give NaN logits)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            check_config(value, where)
        elif f.name in POSITIVE_INTS:
            values = value if isinstance(value, tuple) else (value,)
            if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
                raise ZooError(f"{where}: {f.name} must be a positive integer, got {value!r}")
        elif f.name in POSITIVE_FLOATS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ZooError(f"{where}: {f.name} must be a finite number above 0, got {value!r}")
    params = estimated_params(config)
    if params > MAX_PARAMS:
        raise ZooError(f"{where}: this config describes about {params:.3g} parameters, above the {MAX_PARAMS:.3g} "
                       f"zoo builds (ZOO_MAX_PARAMS raises the limit); check n_layers, dim and vocab_size")


def estimated_params(config: Any) -> int:
    """A rough upper bound of a config's parameter count from its sizes alone (no module is built)."""
    def biggest(name: str) -> int:
        value = getattr(config, name, 0) or 0
        return max(value) if isinstance(value, tuple) else int(value)

    dim, layers, ffn, vocab = biggest("dim"), biggest("n_layers"), biggest("ffn_dim"), biggest("vocab_size")
    heads = max(biggest("n_heads"), 1) * max(biggest("head_dim"), dim // max(biggest("n_heads"), 1))
    own = layers * (4 * dim * heads + 3 * dim * ffn) + 2 * vocab * dim
    subs = sum(estimated_params(getattr(config, f.name)) for f in dataclasses.fields(config)
               if dataclasses.is_dataclass(getattr(config, f.name)))
    return own + subs
