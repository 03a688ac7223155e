"""The trained model, for use outside the recipes: OUT/model in zoo format with the tokenizer, and OUT/model-hf in
the Hugging Face layout with --export-hf. Both carry the special-token ids generation needs (see token_ids)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import zoo
from recipes.config import TrainConfig
from recipes.processes import Dist
from zoo.checkpoint import language_config, with_token_ids
from zoo.models import FAMILIES, ModelConfig
from zoo.tokenizer import Tokenizer


def export(cfg: TrainConfig, d: Dist, model: nn.Module, tok: Tokenizer) -> Path:
    """OUT/model (and OUT/model-hf with --export-hf): every rank gathers the full weights, rank 0 writes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(cfg.out) / "model"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d.main:
        with torch.device("meta"):  # a plain copy: FSDP has swapped the model's class for a sharded one
            config = token_ids(model.config, tok, getattr(cfg, "chat_template", "auto"))
            plain = FAMILIES[model.family].model_cls(config, attn="eager")
        plain.load_state_dict(full, assign=True)
        zoo.save(plain, out, force=True, tokenizer_from=str(tok.dir))
        if cfg.export_hf:
            from convert.zoo_to_hf import main as zoo_to_hf

            zoo_to_hf([str(out), str(Path(cfg.out) / "model-hf"), "--force", "--quiet"])
        print(f"saved {out}" + (f" and {Path(cfg.out) / 'model-hf'}" if cfg.export_hf else ""))
    d.barrier()
    return out


def token_ids(config: ModelConfig, tok: Tokenizer, template: str = "auto") -> ModelConfig:
    """The model's bos/eos/pad ids, completed by the tokenizer's; eos also gains the tokenizer's eos and the
    end-of-turn token of its chat template (an SFT run teaches the model to end its answers with it)."""
    lm = language_config(config)
    bos = lm.bos_token_id if lm.bos_token_id is not None else tok.bos_id
    pad = lm.pad_token_id if lm.pad_token_id is not None else tok.pad_id
    return with_token_ids(config, bos, tuple(dict.fromkeys([*lm.eos_token_ids, *tok.stop_ids(template)])), pad)
