"""Checkpoint configs: which family and config a directory holds, the config as zoo checkpoints store it, and the
special-token ids that travel with it (read from Hugging Face's config.json and generation_config.json, completed
from a tokenizer).

A checkpoint directory is either zoo's own (config.json with `"format": "zoo"`, zoo tensor names) or a Hugging
Face one (config.json with `model_type`, HF tensor names).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from zoo.core.contract import DecoderConfig
from zoo.errors import ZooError
from zoo.io.fp8 import block_size
from zoo.io.paths import json_object, optional
from zoo.models import FAMILIES, HF_MODEL_TYPES, ModelConfig
from zoo.models.family import HF_TOKEN_ID_KEYS, Family, check_config

if TYPE_CHECKING:
    from zoo.io.tokenizer import Tokenizer

Format = Literal["zoo", "hf"]  # a checkpoint directory's layout: zoo's names and config, or Hugging Face's


def read_config(path: str | os.PathLike[str]) -> tuple[Family, ModelConfig, Format]:
    """(family, config, "zoo" or "hf") of a checkpoint directory."""
    path = Path(path)
    cfg_file = path / "config.json"
    found = optional(path, cfg_file.name, "config")
    if found is None:
        raise ZooError(f"{cfg_file} not found: expected a zoo or Hugging Face checkpoint directory "
                       "(config.json + *.safetensors)")
    raw = json_object(found)
    if raw.get("format") == "zoo":
        name = raw.get("family")
        family = FAMILIES.get(name) if isinstance(name, str) else None  # a list or number is no family either
        if family is None:
            raise ZooError(f"{cfg_file}: unknown zoo family {raw.get('family')!r}; known: {', '.join(FAMILIES)}")
        try:
            config = config_from_dict(family, raw["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise ZooError(f"{cfg_file}: cannot read the {family.name} config ({type(e).__name__}: {e})") from e
        check_config(config, str(cfg_file))
        return family, config, "zoo"
    model_type = raw.get("model_type")
    family = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ZooError(f"{cfg_file}: unknown model_type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}")
    block_size(raw, cfg_file)  # a quantisation zoo cannot read is refused before anything is built
    processor = image_processor_config(path)
    if processor:  # a vision-language family reads its image processor's settings with its config
        raw = {**raw, "image_processor": processor}
    config = _hf_config(family, raw, cfg_file)
    gen_ids = generation_token_ids(path)
    if gen_ids:  # checked again with them, so that a bad id is named in the file it came from
        config = _hf_config(family, {**raw, **gen_ids}, path / "generation_config.json")
    return family, config, "hf"


def _hf_config(family: Family, raw: dict[str, Any], source: Path) -> ModelConfig:
    """The config of a Hugging Face config dict, checked; errors name `source`."""
    try:
        config = family.config_from_hf(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ZooError(f"{source}: cannot read the {raw.get('model_type')} config ({type(e).__name__}: {e})") from e
    check_config(config, str(source))
    return config


def image_processor_config(path: Path) -> dict[str, Any]:
    """The image processor's settings of a Hugging Face checkpoint: transformers 5's processor_config.json
    ("image_processor", with the processor's own settings beside it, such as Gemma 3's image_seq_length), else the
    published preprocessor_config.json; {} without either."""
    found = optional(path, "processor_config.json", "processor config")
    if found is not None:
        processor = json_object(found)
        nested = processor.get("image_processor")
        if isinstance(nested, dict):
            return {**{k: v for k, v in processor.items() if k != "image_processor"}, **nested}
    found = optional(path, "preprocessor_config.json", "image processor config")
    return {} if found is None else json_object(found)


def generation_token_ids(path: Path) -> dict[str, Any]:
    """The special-token ids of a Hugging Face checkpoint's generation_config.json, if it has one. They win over
    config.json's, as in transformers' generate: Llama-3-8B-Instruct's config.json names only <|end_of_text|>,
    its generation_config.json also <|eot_id|>, where each answer ends."""
    gen_file = optional(path, "generation_config.json", "generation config")
    if gen_file is None:
        return {}
    gen = json_object(gen_file)
    return {k: gen[k] for k in HF_TOKEN_ID_KEYS if gen.get(k) is not None}


SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def generation_sampling(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The decoding settings of a checkpoint's generation_config.json (do_sample, temperature, top_k, top_p,
    repetition_penalty: those it names, null being unnamed), checked: instruct models ship them (Qwen2.5's
    repetition_penalty 1.05, say) and transformers' generate applies them."""
    gen_file = optional(Path(path), "generation_config.json", "generation config")
    if gen_file is None:
        return {}
    gen = {k: v for k, v in json_object(gen_file).items() if k in SAMPLING_KEYS and v is not None}

    def bad(key: str, expected: str) -> ZooError:
        return ZooError(f"{gen_file}: {key} must be {expected}, got {gen[key]!r}")

    def number(key: str) -> bool:
        value = gen.get(key)
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

    if "do_sample" in gen and not isinstance(gen["do_sample"], bool):
        raise bad("do_sample", "true or false")
    if "temperature" in gen and not (number("temperature") and gen["temperature"] >= 0):
        raise bad("temperature", "a finite number >= 0")
    if gen.get("do_sample") and gen.get("temperature", 1.0) <= 0:  # transformers refuses it too
        raise bad("temperature", "above 0 where do_sample is true")
    if "top_k" in gen and (isinstance(gen["top_k"], bool) or not isinstance(gen["top_k"], int) or gen["top_k"] < 0):
        raise bad("top_k", "an integer >= 0 (0: no top-k filtering)")
    if "top_p" in gen and not (number("top_p") and 0 < gen["top_p"] <= 1):
        raise bad("top_p", "a number in (0, 1]")
    if "repetition_penalty" in gen and not (number("repetition_penalty") and gen["repetition_penalty"] > 0):
        raise bad("repetition_penalty", "a finite number above 0 (1: none)")
    return gen


# ---- special-token ids ----


def language_config(config: ModelConfig) -> DecoderConfig:
    """The config of the language model: the config itself, or a LLaVA's `language` (it holds the token ids)."""
    return FAMILIES[config.family].text_config(config)


def with_token_ids(config: ModelConfig, bos: int | None, eos: Sequence[int], pad: int | None) -> ModelConfig:
    """`config` with these special-token ids (in a LLaVA's language config)."""
    family = FAMILIES[config.family]
    lm = dataclasses.replace(family.text_config(config), bos_token_id=bos, eos_token_ids=tuple(eos), pad_token_id=pad)
    return family.with_text_config(config, lm)


def complete_token_ids(config: ModelConfig, tok: Tokenizer, template: str = "auto") -> ModelConfig:
    """`config` with its bos/eos/pad ids completed by the tokenizer's: its bos and pad where the config has none,
    and as eos the config's followed by the tokenizer's eos token and the end-of-turn token of its chat template
    `template` (<|im_end|>, <|eot_id|>: where a chat model's answer ends; an SFT run teaches the model to end its
    answers with it)."""
    lm = language_config(config)
    bos = lm.bos_token_id if lm.bos_token_id is not None else tok.bos_id
    pad = lm.pad_token_id if lm.pad_token_id is not None else tok.pad_id
    return with_token_ids(config, bos, tuple(dict.fromkeys([*lm.eos_token_ids, *tok.stop_ids(template)])), pad)


def default_token_ids(config: ModelConfig, tokenizer_dir: str | os.PathLike[str]) -> ModelConfig:
    """`config`, or where it names no eos id, `complete_token_ids` by the tokenizer in `tokenizer_dir` (when there
    is one): what a checkpoint saved with its tokenizer names (zoo.save(tokenizer_from=...), convert.zoo_to_hf)."""
    if language_config(config).eos_token_ids:
        return config
    tok = tokenizer_in(tokenizer_dir)
    return config if tok is None else complete_token_ids(config, tok)


def tokenizer_in(directory: str | os.PathLike[str]) -> Tokenizer | None:
    """The tokenizer saved in `directory` (tokenizer.json or tokenizer.model), if there is one."""
    if not any((Path(directory) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from zoo.io.tokenizer import Tokenizer  # jinja2 and tokenizers: only where a tokenizer is read

    return Tokenizer(directory)


# ---- zoo's config.json ----


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """A family config (a dataclass) as the plain dict zoo checkpoints store under "config"."""
    return dataclasses.asdict(config)


def config_from_dict(family: Family, d: dict[str, Any]) -> ModelConfig:
    """Inverse of config_to_dict for a config of `family`."""
    return family.config_cls(**d)


def zoo_config_json(family: Family, config: ModelConfig) -> dict[str, Any]:
    """The config.json of a zoo checkpoint."""
    return {"format": "zoo", "family": family.name, "config": config_to_dict(config)}


def config_diff(a: ModelConfig, b: ModelConfig) -> str:
    """The fields in which two configs of one family differ, with both values ("nothing" when none)."""
    da, db = config_to_dict(a), config_to_dict(b)
    return ", ".join(f"{k}: {da[k]!r} vs {db.get(k)!r}" for k in da if da[k] != db.get(k)) or "nothing"
