"""What generic code knows of a model family: one `Family` record per family, all in `zoo.models.FAMILIES`.

A record holds the family's config class, its Hugging Face model types and weight plans, how to build its model,
its default LoRA targets, how its checkpoints spell tensor names, and how its config holds the language model's
(LLaVA's `language`). The loader, the converters, LoRA, the recipes and generation read a family only through
this record and the model contract (zoo.core.contract.ZooModel); they never name a family's classes.

Weight plans (how each tensor name on one side is made from the other's) are stated as data, a name table of
prefix renames and `Fused` entries: zoo.models.names.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from zoo.core.contract import DecoderConfig, FamilyConfig, HasTokenIds, ZooModel
from zoo.errors import ZooError

# re-exported: the families, the loader and the converters import these from here
from zoo.models.names import (
    Combine as Combine,
)
from zoo.models.names import (
    Fused as Fused,
)
from zoo.models.names import (
    NameTable as NameTable,
)
from zoo.models.names import (
    Plan as Plan,
)
from zoo.models.names import (
    join_fused as join_fused,
)
from zoo.models.names import (
    rename as rename,
)
from zoo.models.names import (
    rename_plans as rename_plans,
)
from zoo.models.names import (
    split_fused as split_fused,
)

if TYPE_CHECKING:
    from zoo.core.attention import AttentionFn

HFConfig = dict[str, Any]  # a config.json as json.load reads it


C = TypeVar("C")


@dataclass(frozen=True)
class Family:
    """What generic code needs to know about a family. Build one with `family(...)`, which checks that each
    function gets a config of the family's own class."""

    name: str  # key in zoo checkpoints' config.json and in zoo.models.FAMILIES ("llama")
    config_cls: type[FamilyConfig]  # config_cls(**d) reads a zoo checkpoint's "config"
    hf_model_types: tuple[str, ...]  # config.json model_type values this family reads; the first is written
    build: Callable[[FamilyConfig, str | AttentionFn], ZooModel]  # the model, on the current default device
    config_from_hf: Callable[[HFConfig], FamilyConfig]
    config_to_hf: Callable[[FamilyConfig], HFConfig]  # with model_type and architectures as transformers has them
    plan_from_hf: Callable[[FamilyConfig, list[str]], Plan]  # (config, zoo names) -> {zoo name: (hf names, combine)}
    plan_to_hf: Callable[[FamilyConfig, list[str]], Plan]  # (config, zoo names) -> {hf name: (zoo names, combine)}
    text_config: Callable[[FamilyConfig], DecoderConfig]  # the language model's config (LLaVA's `language`)
    with_text_config: Callable[[FamilyConfig, DecoderConfig], FamilyConfig]  # the config with another one
    lora_targets: tuple[str, ...]  # what LoRA's targets "auto" adapt (zoo or Hugging Face module names)
    hf_spellings: Callable[[str], list[str]]  # every spelling of a Hugging Face tensor name, the canonical first
    hf_tied: Callable[[FamilyConfig], frozenset[str]]  # Hugging Face names of a tied head a checkpoint may hold
    # prefixes of what a Hugging Face checkpoint of this config may hold beside the model, which is left out (Gemma 3:
    # the vision tower of a multimodal checkpoint; GLM-4.5: its multi-token-prediction layers past the last), and
    # the one line the loader says when it leaves some out
    hf_left_out: Callable[[FamilyConfig], tuple[str, ...]]
    left_out_why: str


def _as_is(name: str) -> list[str]:
    return [name]


def tied_head(config: DecoderConfig) -> frozenset[str]:
    """A text family's tied head: lm_head.weight, which some checkpoints save and zoo never reads."""
    return frozenset({"lm_head.weight"}) if config.tie_embeddings else frozenset()


def family(name: str, config_cls: type[C], hf_model_types: tuple[str, ...], *,
           build: Callable[[C, str | AttentionFn], ZooModel],
           config_from_hf: Callable[[HFConfig], C], config_to_hf: Callable[[C], HFConfig],
           plan_from_hf: Callable[[C, list[str]], Plan], plan_to_hf: Callable[[C, list[str]], Plan],
           lora_targets: tuple[str, ...],
           text_config: Callable[[C], DecoderConfig] | None = None,
           with_text_config: Callable[[C, DecoderConfig], C] | None = None,
           hf_spellings: Callable[[str], list[str]] = _as_is,
           hf_tied: Callable[[C], frozenset[str]] | None = None,
           hf_left_out: tuple[str, ...] | Callable[[C], tuple[str, ...]] = (), left_out_why: str = "") -> Family:
    """A family's record. Its functions are each family's own, typed on its config class; the record takes any
    family's config, so each call first checks the config is this family's (a TypeError names both). A text
    family leaves out text_config, with_text_config and hf_tied: its config is its own text config. hf_left_out:
    prefixes, or a function of the config giving them."""

    def own(config: object) -> C:
        if not isinstance(config, config_cls):
            raise TypeError(f"the {name} family takes a {config_cls.__name__}, got a {type(config).__name__}")
        return config

    def text(config: FamilyConfig) -> DecoderConfig:
        return text_config(own(config)) if text_config else cast("DecoderConfig", own(config))

    def with_text(config: FamilyConfig, lm: DecoderConfig) -> FamilyConfig:
        return cast(FamilyConfig, with_text_config(own(config), lm) if with_text_config else own(lm))

    return Family(
        name=name,
        config_cls=cast("type[FamilyConfig]", config_cls),
        hf_model_types=hf_model_types,
        build=lambda config, attn: build(own(config), attn),
        config_from_hf=lambda hf: cast(FamilyConfig, config_from_hf(hf)),
        config_to_hf=lambda config: config_to_hf(own(config)),
        plan_from_hf=lambda config, names: plan_from_hf(own(config), names),
        plan_to_hf=lambda config, names: plan_to_hf(own(config), names),
        text_config=text,
        with_text_config=with_text,
        lora_targets=lora_targets,
        hf_spellings=hf_spellings,
        hf_tied=lambda config: hf_tied(own(config)) if hf_tied else tied_head(text(config)),
        hf_left_out=lambda config: hf_left_out(own(config)) if callable(hf_left_out) else hf_left_out,
        left_out_why=left_out_why or (f"{name}: tensors beside the model are left out" if callable(hf_left_out)
                                      else f"{name}: tensors under {', '.join(hf_left_out)} are left out"),
    )


HF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The family-config fields of a Hugging Face config's special-token ids; absent (null) ones are left out."""
    out: dict[str, Any] = {}  # as written: check_config refuses "12", 1.5 or true for an id
    if hf.get("bos_token_id") is not None:
        out["bos_token_id"] = hf["bos_token_id"]
    eos = hf.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    if hf.get("pad_token_id") is not None:
        out["pad_token_id"] = hf["pad_token_id"]
    return out


def as_tuple(value: object) -> Any:  # JSON in, the config field out (checked later)
    """A JSON list (a zoo checkpoint's config) as the tuple a config field holds; anything else as it is, for
    check_config to name (tuple("12") would read a string as two ids)."""
    return tuple(value) if isinstance(value, list) else value


def number(value: object) -> Any:  # JSON in, the config field out (checked later)
    """A JSON number as a float (rope_theta: 1000000 is written as an integer); anything else as it is, for
    check_config to name (float("nan") or float(True) would pass)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


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

MAX_PARAMS = int(os.environ.get("ZOO_MAX_PARAMS", 2 * 10**12))  # above every published model; env to raise it


# Bounds on a Hugging Face config's counts, checked before a per-layer or per-expert tuple is built from them: the
# largest published models have 126 layers (Llama 3.1 405B), 512 experts (Qwen3-Next) and 128 heads, and 10^5
# leaves room for any to come while a tuple of 10^5 costs milliseconds. Without them `num_hidden_layers: 1e9` (no
# `layer_types`) or `num_experts: 2**40` allocates gigabytes, or seconds per 10^7, before check_config sees a field.
MAX_COUNT = 10**5
HF_COUNTS = ("num_hidden_layers", "num_experts", "num_local_experts", "num_attention_heads", "num_key_value_heads")


def check_hf_counts(hf: dict[str, Any], what: str) -> None:
    """A ZooError if a count of `hf` (layers, experts, heads) is an integer outside 1..MAX_COUNT: 0 heads would
    divide by zero, a billion layers or experts would allocate before any other check. Other types are left to
    check_config, which names the declared type."""
    for key in HF_COUNTS:
        value = hf.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_COUNT:
            raise ZooError(f"{what}: {key} must be an integer in 1..{MAX_COUNT}, got {value!r}")


def check_config(config: Any, where: str) -> None:
    """Every field of a family config (and of the configs inside it: LLaVA's tower and language model) of the type
    its dataclass declares and in its range, and an estimate of the parameter count under MAX_PARAMS: a ZooError
    naming `where` (the file it came from) and the field, before a module exists. Booleans must be booleans (a
    config.json's `"tie_word_embeddings": "yes"` would otherwise drop the checkpoint's lm_head), sizes positive
    integers (`num_hidden_layers: 1e9` would grow memory without bound), eps, RoPE bases and scaling factors finite
    and above 0 (NaN gives NaN logits), token ids integers inside the vocabulary (an eos past it never stops).
    Which fields must be above 0 each config class says itself (`positive`, next to its fields)."""
    hints = typing.get_type_hints(type(config))
    positive: frozenset[str] = type(config).positive
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            check_config(value, where)
            continue
        problem = _wrong_type(value, hints[f.name])
        if problem is not None and f.name in positive:
            problem = _positive(hints[f.name])
        if problem is None:
            problem = _out_of_range(f.name, value, config, positive, hints[f.name])
        if problem is not None:
            raise ZooError(f"{where}: {f.name} must be {problem}, got {value!r}")
    params = estimated_params(config)
    if params > MAX_PARAMS:
        raise ZooError(f"{where}: this config describes about {params:.3g} parameters, above the {MAX_PARAMS:.3g} "
                       f"zoo builds (ZOO_MAX_PARAMS raises the limit); check n_layers, dim and vocab_size")


def _wrong_type(value: object, hint: object) -> str | None:
    """What `value` should be, if it is not of the declared type `hint` (None when it is)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        wanted = [a for a in args if a is not type(None)]
        problems = [_wrong_type(value, a) for a in wanted]
        return None if None in problems else " or ".join(p for p in problems if p) + (
            " or null" if type(None) in args else "")
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if origin is tuple:
        if not isinstance(value, tuple):
            return "a list"
        item = args[0] if args else object
        bad = [_wrong_type(v, item) for v in value]
        return next((f"a list of which each is {p}" for p in bad if p), None)
    if origin is dict:
        return None if isinstance(value, dict) else "an object"
    return None  # a protocol or class (LLaVA's language config): checked by its own fields


def _positive(hint: object) -> str:
    """What a field that must be above 0 is: a positive integer, or a finite number above 0 (by its declared type)."""
    return "a finite number above 0" if _floats(hint) else "a positive integer"


def _floats(hint: object) -> bool:
    return "float" in str(hint)


SCALING_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
TOKEN_IDS = ("bos_token_id", "eos_token_ids", "pad_token_id")


def _out_of_range(name: str, value: object, config: object, positive: frozenset[str],
                  hint: object) -> str | None:
    values = value if isinstance(value, tuple) else (value,)
    if name in positive and value is not None:
        floats = _floats(hint)
        if not values or any(not 0 < v < math.inf if floats else v < 1 for v in values):
            return _positive(hint)
    elif name == "rope_scaling" and isinstance(value, dict):
        for key in SCALING_NUMBERS:
            x = value.get(key)
            if key in value and (isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < math.inf):
                return f"a scaling whose {key} is a finite number above 0"
    elif name in TOKEN_IDS:
        vocab = getattr(config, "vocab_size", None)
        ids = [v for v in values if v is not None]
        if any(v < 0 or (isinstance(vocab, int) and v >= vocab) for v in ids):
            return f"token ids inside the vocabulary (0..{vocab - 1})" if isinstance(vocab, int) else \
                "non-negative token ids"
    return None


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
