"""The trained model, for use outside the recipes: OUT/model in zoo format with the tokenizer, and OUT/model-hf in
the Hugging Face layout with --export-hf. Both carry the special-token ids generation needs (see token_ids)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

import zoo
from recipes.config import TrainConfig
from recipes.processes import Dist
from zoo.checkpoint import atomic_dir, language_config, save_safetensors, with_token_ids
from zoo.lora import LoRAConfig, adapter_config, adapter_state, merged_state, shared_a
from zoo.models import FAMILIES, ModelConfig
from zoo.quant import dequantized
from zoo.tokenizer import Tokenizer


def export(cfg: TrainConfig, d: Dist, model: nn.Module, tok: Tokenizer, lora: LoRAConfig | None = None) -> Path:
    """OUT/model (and OUT/model-hf with --export-hf): every rank gathers the full weights, rank 0 writes them.
    With `lora`, OUT/model is the merged model and OUT/adapter the adapter in PEFT's layout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(cfg.out) / "model"
    # LoRA from a checkpoint directory gathers only the adapters: the base is merged as --model holds it (its
    # dtype, not the bf16 or 4-bit copy the run computed with)
    from_disk = lora is not None and Path(cfg.model).is_dir()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=from_disk))
    if d.main:
        with torch.device("meta"):  # a plain copy: FSDP has swapped the model's class for a sharded one
            config = token_ids(model.config, tok, getattr(cfg, "chat_template", "auto"))
            plain = FAMILIES[model.family].model_cls(config, attn="eager")
        if lora is not None:
            full = with_base(full, zoo.load(cfg.model).state_dict() if from_disk else None, list(model.state_dict()))
            a_from = shared_a(model)
            export_adapter(cfg, plain, full, lora, a_from)
            full = merged_state(full, lora.scale, a_from)
        plain.load_state_dict(full, assign=True)
        zoo.save(plain, out, force=True, tokenizer_from=str(tok.dir))
        if cfg.export_hf:
            from convert.zoo_to_hf import main as zoo_to_hf

            zoo_to_hf([str(out), str(Path(cfg.out) / "model-hf"), "--force", "--quiet"])
        print(f"saved {out}" + (f" and {Path(cfg.out) / 'model-hf'}" if cfg.export_hf else ""))
    d.barrier()
    return out


def with_base(state: dict[str, Tensor], base: dict[str, Tensor] | None, names: list[str]) -> dict[str, Tensor]:
    """A LoRA model's full state (`names`) from its gathered `state` and the `base` model's weights for what `state`
    lacks (a wrapped layer's `X.base.weight` is the base's `X.weight`); 4-bit weights of a run without a base on disk
    dequantized."""
    if base is None:
        return {n: dequantized(t) for n, t in state.items()}
    return {n: state[n] if n in state else base[n.replace(".base.", ".")] for n in names}


def token_ids(config: ModelConfig, tok: Tokenizer, template: str = "auto") -> ModelConfig:
    """The model's bos/eos/pad ids, completed by the tokenizer's; eos also gains the tokenizer's eos and the
    end-of-turn token of its chat template (an SFT run teaches the model to end its answers with it)."""
    lm = language_config(config)
    bos = lm.bos_token_id if lm.bos_token_id is not None else tok.bos_id
    pad = lm.pad_token_id if lm.pad_token_id is not None else tok.pad_id
    return with_token_ids(config, bos, tuple(dict.fromkeys([*lm.eos_token_ids, *tok.stop_ids(template)])), pad)


def export_adapter(cfg: TrainConfig, plain: nn.Module, full: dict[str, Tensor], lora: LoRAConfig,
                   a_from: dict[str, str] | None = None) -> Path | None:
    """OUT/adapter: adapter_config.json and adapter_model.safetensors as PEFT saves them for the Hugging Face layout
    of the model (`peft.PeftModel.from_pretrained` on the --export-hf output loads it); InternLM2's wqkv and
    OpenELM's qkv_proj / proj_1 carry the shared-A adapters of their parts. None, said, when an adapted layer is
    only part of such a fused tensor (PEFT cannot address it); the merged model is written either way."""
    family = FAMILIES[plain.family]
    plan = family.plan_to_hf(plain.config, list(plain.state_dict()))
    try:
        tensors = adapter_state(full, plan, a_from)
    except KeyError as e:
        print(f"note: no OUT/adapter: the adapted {e.args[0]} is only part of a fused tensor in the Hugging Face "
              f"layout of {plain.family}, which a PEFT adapter cannot address (adapt all its parts, or the fused "
              f"module by its Hugging Face name); OUT/model holds the merged weights")
        return None
    targets = sorted({n.split(".")[-3] for n in tensors})  # "...q_proj.lora_A.weight" -> q_proj
    out = Path(cfg.out) / "adapter"
    with atomic_dir(out, force=True) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(lora, targets, cfg.model), indent=2) + "\n")
        save_safetensors(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    print(f"saved {out} (PEFT LoRA adapter over the Hugging Face layout of {cfg.model})")
    return out
