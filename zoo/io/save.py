"""Saving a model as a zoo checkpoint: config.json, sharded safetensors and the tokenizer files, written
atomically."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torch import Tensor, nn

from zoo.io.atomic import atomic_dir
from zoo.io.config import default_token_ids, zoo_config_json
from zoo.io.paths import optional
from zoo.io.safetensors import DEFAULT_SHARD_BYTES, ShardWriter
from zoo.models import FAMILIES, Model

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "generation_config.json",
    "preprocessor_config.json", "processor_config.json",
)


def copy_tokenizer_files(src: str | os.PathLike[str], dst: Path) -> list[str]:
    """Copy the tokenizer and processor files of `src` that exist into `dst`; returns their names."""
    copied = []
    for fname in TOKENIZER_FILES:
        # regular files inside src only: a tokenizer.json linked to /etc/passwd is refused, not copied
        path = optional(Path(src), fname, "tokenizer file")
        if path is not None:
            shutil.copyfile(path, dst / fname)
            copied.append(fname)
    return copied


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """state_dict with sharded (DTensor) parameters gathered into plain tensors."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def save(model: Model, out: str | os.PathLike[str], *, force: bool = False,
         tokenizer_from: str | os.PathLike[str] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a zoo checkpoint: config.json + sharded safetensors (+ tokenizer files), atomically. Where the model's
    config names no eos id, config.json takes the special-token ids of the tokenizer (`default_token_ids`)."""
    family = FAMILIES[model.family]
    config = default_token_ids(model.config, tokenizer_from) if tokenizer_from else model.config
    with atomic_dir(out, force=force) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for name, t in full_state_dict(model).items():
            writer.add(name, t)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(zoo_config_json(family, config), indent=2) + "\n")
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, tmp)
    return Path(out)
