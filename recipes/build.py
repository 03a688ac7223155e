"""The model and its optimizer: checked against tokenizer and --seq-len, built, parallelized, AdamW + schedule.

The model is set up in torchtitan's order: built (on meta for a sharded load) -> the recipe's own changes (load
parts, freeze) -> sequence parallel -> activation checkpointing -> compile -> FSDP -> weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn

import zoo
from recipes.config import TrainConfig
from recipes.processes import Dist
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.io.checkpoint import language_config, read_config
from zoo.io.tokenizer import Tokenizer
from zoo.models import FAMILIES
from zoo.parallel import parallelize
from zoo.train.lora import LoRAConfig, apply_lora
from zoo.train.quant import quantize_nf4, to_device


def model_config(cfg: TrainConfig):
    """The config of --model: a checkpoint directory's, or a preset's."""
    return read_config(cfg.model)[1] if Path(cfg.model).is_dir() else zoo.get_preset(cfg.model).config


def check_model(cfg: TrainConfig, tok: Tokenizer, config=None) -> None:
    """Fail before any data is read when model (`config`, else --model), tokenizer and --seq-len do not fit
    together."""
    config = config or model_config(cfg)
    tcfg = language_config(config)  # LLaVA's language model
    if tok.vocab_size > tcfg.vocab_size:
        raise ZooError(f"the tokenizer {tok.path} has {tok.vocab_size} tokens but the model's vocabulary is "
                       f"{tcfg.vocab_size}; use the model's own tokenizer (--tokenizer)")
    max_len = tcfg.max_seq_len
    if max_len is not None and cfg.seq_len > max_len:
        raise ZooError(f"--seq-len {cfg.seq_len} is above what {cfg.model} supports ({max_len} positions); "
                       f"use --seq-len {max_len} or less")


def param_dtype(cfg: TrainConfig, d: Dist) -> torch.dtype | None:
    """bf16 with --dtype bfloat16, and by default on GPU; None: fp32."""
    if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and d.device.type == "cuda"):
        return torch.bfloat16
    return None


def autocast(cfg: TrainConfig, d: Dist) -> AbstractContextManager:
    """What the forward runs in: bf16 without FSDP is autocast; under FSDP its mixed precision casts instead."""
    dtype = param_dtype(cfg, d)
    if dtype is None or d.fsdp_mesh is not None:
        return nullcontext()
    return torch.autocast(d.device.type, dtype=dtype)


def build_model(cfg: TrainConfig, d: Dist, config=None, adapt: Callable[[nn.Module], None] | None = None,
                lora: LoRAConfig | None = None, add_lora: Callable[[nn.Module], list[str]] | None = None) -> nn.Module:
    """Load --model (or build `config` with random weights, the same on every rank), let `adapt(model)` load or
    freeze parts, wrap the `lora` targets in adapters (freezing the rest; `add_lora(model)` instead, where a model
    adapts other blocks than .layers, returning the wrapped names), then parallelize."""
    def wrap(model: nn.Module, lora: LoRAConfig) -> list[str]:
        return add_lora(model) if add_lora is not None else apply_lora(model, lora, seed=cfg.seed)

    torch.manual_seed(cfg.seed)
    qlora = lora is not None and getattr(cfg, "qlora", False)
    # a LoRA run keeps its frozen base in the compute dtype (bf16 on GPU): the adapters alone train, in fp32
    base_dtype = param_dtype(cfg, d) if lora is not None else None
    # a checkpoint under FSDP: built on meta and sharded first, then rank 0 reads the weights and scatters them,
    # so no rank ever holds a second full copy on the device. QLoRA quantizes real weights: every rank loads them
    # (on CPU, then each quantized layer goes to the device), and FSDP shards the 4-bit tensors.
    sharded_load = d.fsdp_mesh is not None and config is None and Path(cfg.model).is_dir() and not qlora
    if sharded_load:
        family, ck_config, _ = read_config(cfg.model)
        with torch.device("meta"):
            model = family.build(ck_config, cfg.attn)
    elif config is None:
        model = zoo.load(cfg.model, attn=cfg.attn, device="cpu" if qlora else d.device, dtype=base_dtype)
    else:
        with torch.device("meta"):
            family = next(f for f in FAMILIES.values() if isinstance(config, f.config_cls))
            model = family.build(config, cfg.attn)
        model.to_empty(device=d.device)
        init_weights(model)
    if adapt is not None:
        adapt(model)
    if lora is not None:
        wrapped = wrap(model, lora)
        if d.main:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            print(f"LoRA r={lora.rank} alpha={lora.alpha:g}{' (rsLoRA)' if lora.rslora else ''} on {len(wrapped)} "
                  f"linear layers: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)")
        if base_dtype is not None:
            frozen_to(model, base_dtype)
        if qlora:
            done, linears = quantize_nf4(model, d.device)
            if d.main:
                kept = str(base_dtype or torch.float32).removeprefix("torch.")
                left = f"; {linears - done} too small for NF4's 64x256 blocks stay {kept}" if done < linears else ""
                print(f"QLoRA: {done} of {linears} linear layers of the blocks hold 4-bit NF4 weights{left}")
            to_device(model, d.device)
    parallelize(model, d.fsdp_mesh, sp=d.sequence_parallel, activation_checkpointing=cfg.activation_checkpointing,
                compile=cfg.compile, param_dtype=param_dtype(cfg, d))
    if sharded_load:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=d.device)
        full = {}
        if d.main:  # the same names as the sharded model: with LoRA, its wrapped layers and fresh adapters
            plain = zoo.load(cfg.model)
            if lora is not None:
                wrap(plain, lora)
            full = plain.state_dict()
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def frozen_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters stored in `dtype` (on meta too: a sharded load fills them later)."""
    cast: dict[int, nn.Parameter] = {}  # a tied weight stays one parameter
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                setattr(module, name, cast[id(p)])


def build_optimizer(cfg: TrainConfig, model: nn.Module):
    """AdamW over the parameters that train (weight decay on matrices and embeddings, not on norms and biases),
    linear warmup then cosine decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ZooError("nothing to train: every parameter is frozen")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)

    def schedule(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)
