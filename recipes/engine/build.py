"""The model and its optimizer: checked against tokenizer and --seq-len, built, LoRA, parallelized, loaded, AdamW +
schedule.

A recipe's `main` calls these in torchtitan's order: `build_model` (on meta for a sharded load) -> the recipe's own
changes (load parts, freeze) -> `add_adapters` -> `parallelize_model` (sequence parallel -> activation checkpointing ->
compile -> FSDP) -> `load_sharded` (the weights of a model built on meta).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import zoo
from recipes.engine.processes import Dist
from recipes.engine.sections import LoRASection, ModelSection, OptimSection, ParallelSection
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.io.config import language_config, read_config
from zoo.io.hub import cached, is_hub_id, missing, offline, resolve
from zoo.io.tokenizer import Tokenizer
from zoo.models import FAMILIES, Model, ModelConfig
from zoo.parallel import parallelize
from zoo.train.fp8 import convert_fp8
from zoo.train.lora import ALL_LINEAR, LoRAConfig, UnknownTargets
from zoo.train.params import swap_parameters
from zoo.train.quant import quantize_nf4, to_device

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

# a recipe's LoRA: wraps the targeted layers of a model in adapters, freezing the rest; returns the wrapped names
Wrap = Callable[[Model], list[str]]


def resolve_model(cfg: ModelSection) -> ModelSection:
    """--model as the rest of a run reads it: a checkpoint directory as given; a preset in its registered spelling
    (any case: `Qwen3-0.6B` is `qwen3-0.6b`, tokenizer check and all); a Hugging Face hub id, its snapshot in the local
    cache (--revision; fetched first with --download). Else one ZooError: no such directory (and the nearest
    directory name and presets), an adapter rather than a model, a hub id not in the cache and what to run."""
    name = cfg.name
    if Path(name).is_dir() or (is_hub_id(name) and not Path(name).exists()):
        if not Path(name).is_dir() and cached(name, cfg.revision) is None and (offline() or not cfg.download):
            raise ZooError(f"--model {name}: no such directory{near_directory(name)}; "
                           + missing(name, cfg.revision, "--download"))
        return replace(cfg, name=str(resolve(name, cfg.revision, cfg.download, "--download", "--model")), revision=None)
    if name.lower() in zoo.PRESETS:
        return replace(cfg, name=name.lower())
    if Path(name).exists():
        raise ZooError(f"--model {name}: a file, not a directory (expected a checkpoint directory, a preset name or a "
                       "Hugging Face hub id ORG/NAME)")
    presets = difflib.get_close_matches(name.lower(), zoo.PRESETS, n=3, cutoff=0.5)
    near = f"; nor a preset (closest: {', '.join(presets)})" if presets else "; nor a preset (python -m zoo presets)"
    raise ZooError(f"--model {name}: no such directory{near_directory(name)}{near}")


def near_directory(name: str) -> str:
    """` (did you mean DIR?)` for the directory beside `name` spelled most like it, or ""."""
    path = Path(name)
    parent = path.parent if path.parent.is_dir() else None
    if parent is None:
        return ""
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f" (did you mean {parent / close[0]}?)" if close else ""


def model_config(cfg: ModelSection) -> ModelConfig:
    """The config of --model (`resolve_model`): a checkpoint directory's, or a preset's."""
    cfg = resolve_model(cfg)
    if Path(cfg.name).is_dir():
        return read_config(cfg.name)[1]
    return zoo.get_preset(cfg.name).config


def check_model(cfg: ModelSection, seq_len: int, tok: Tokenizer, config: ModelConfig | None = None, *,
                device: torch.device | None = None, lora: LoRASection | None = None) -> None:
    """Fail before any data is read when model (`config`, else --model), tokenizer and --seq-len do not fit
    together, or (on a CPU `device`) the run would not fit in this machine's memory (`check_memory`)."""
    config = config or model_config(cfg)
    if device is not None and device.type == "cpu":
        check_memory(cfg, config, seq_len, lora)
    tcfg = language_config(config)  # LLaVA's language model
    if tok.id_bound > tcfg.vocab_size:  # its ids, not its token count: a vocabulary may skip ids
        raise ZooError(f"the tokenizer {tok.path} gives ids up to {tok.id_bound - 1} but the model's vocabulary is "
                       f"{tcfg.vocab_size}; use the model's own tokenizer (--tokenizer)")
    max_len = tcfg.max_seq_len
    if max_len is not None and seq_len > max_len:
        raise ZooError(f"--seq-len {seq_len} is above what {cfg.name} supports ({max_len} positions); "
                       f"use --seq-len {max_len} or less")


ACTIVATION_BYTES = 70  # per token, model dim and layer, fp32: a block's saved inputs of norms, q/k/v, MLP (rough)
MEMINFO = Path("/proc/meminfo")


def available_memory() -> int | None:
    """Bytes this machine can still give a process: /proc/meminfo's MemAvailable, else psutil's; None if neither."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_memory(cfg: ModelSection, config: ModelConfig, seq_len: int, lora: LoRASection | None) -> None:
    """Refuse, in one line, a CPU run whose estimate is over the memory available, rather than be killed by the
    kernel: weights (fp32, or bf16 with --dtype bfloat16), and for what trains its gradients and AdamW's two states
    (everything, or with LoRA about 1% of the weights), plus activations (tokens x dim x layers x a constant).
    ZOO_IGNORE_MEMORY=1 runs anyway."""
    available = available_memory()
    if available is None or os.environ.get("ZOO_IGNORE_MEMORY", "") not in ("", "0"):
        return
    with torch.device("meta"):
        params = sum(p.numel() for p in cast(nn.Module, FAMILIES[config.family].build(config, "eager")).parameters())
    width = 2 if cfg.dtype == "bfloat16" else 4
    tuned = lora is not None and lora.rank > 0
    trains = params // 100 if tuned else params
    weights = params * (0.5 if tuned and lora is not None and lora.qlora else width) + trains * 3 * width
    tcfg = language_config(config)
    activations = seq_len * tcfg.dim * len(tcfg.decoder_spec().layers) * ACTIVATION_BYTES
    if weights + activations <= available:
        return
    lower = "a smaller --seq-len" + (", a smaller --lora-rank" if tuned else ", LoRA (--lora-rank 16)")
    raise ZooError(f"--model {cfg.name} needs about {gib(weights)} for its weights{' and adapters' if tuned else ''}, "
                   f"gradients and AdamW states and {gib(activations)} for activations at --seq-len {seq_len}, "
                   f"{gib(weights + activations)} in all, but this machine has {gib(available)} available; use "
                   f"{lower} or a smaller model (ZOO_IGNORE_MEMORY=1 runs anyway)")


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def param_dtype(cfg: ModelSection, d: Dist) -> torch.dtype | None:
    """bf16 with --dtype bfloat16, and by default on GPU; None: fp32."""
    if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and d.device.type == "cuda"):
        return torch.bfloat16
    return None


def autocast(cfg: ModelSection, d: Dist) -> AbstractContextManager[object]:
    """What the forward runs in: bf16 without FSDP is autocast; under FSDP its mixed precision casts instead."""
    dtype = param_dtype(cfg, d)
    if dtype is None or d.fsdp_mesh is not None:
        return nullcontext()
    return torch.autocast(d.device.type, dtype=dtype)


def build_model(cfg: ModelSection, d: Dist, seed: int, config: ModelConfig | None = None,
                lora: LoRASection | None = None) -> tuple[Model, bool]:
    """--model loaded (or `config` built with random weights, the same on every rank); and whether it was built on
    meta instead, for `load_sharded` to fill once parallelized. A LoRA run (`lora` with a rank) loads its frozen
    base in the compute dtype; QLoRA loads it on CPU, to be quantized onto the device layer by layer."""
    torch.manual_seed(seed)
    qlora = lora is not None and lora.rank > 0 and lora.qlora
    base_dtype = param_dtype(cfg, d) if lora is not None and lora.rank > 0 else None
    # a checkpoint under FSDP: built on meta and sharded first, then rank 0 reads the weights and scatters them,
    # so no rank ever holds a second full copy on the device. QLoRA quantizes real weights: every rank loads them
    # (on CPU, then each quantized layer goes to the device), and FSDP shards the 4-bit tensors.
    if d.fsdp_mesh is not None and config is None and Path(cfg.name).is_dir() and not qlora:
        family, ck_config, _ = read_config(cfg.name)
        with torch.device("meta"):
            return cast(Model, family.build(ck_config, cfg.attn)), True
    if config is None:
        return zoo.load(cfg.name, attn=cfg.attn, device="cpu" if qlora else d.device, dtype=base_dtype), False
    with torch.device("meta"):
        model = cast(Model, FAMILIES[config.family].build(config, cfg.attn))
    model.to_empty(device=d.device)
    init_weights(model)
    return model, False


def add_adapters(model: Model, d: Dist, cfg: ModelSection, lora: LoRAConfig, qlora: bool, wrap: Wrap) -> None:
    """Adapters on the layers `wrap` targets, everything else frozen; the frozen base stored in the compute dtype
    (bf16 on GPU: the adapters alone train, in fp32), and with `qlora` its block linear layers in 4-bit NF4."""
    try:
        wrapped = wrap(model)
    except UnknownTargets as e:  # zoo names the targets; the recipe says which flag gave them
        flag, where = (("--lora-vision-targets", e.blocks) if e.blocks.startswith("vision")
                       else ("--lora-targets", "the model's blocks"))
        raise ZooError(f"{flag} {','.join(e.missing)}: no such linear layer in {where}; it has "
                       f"{','.join(e.available)} (or {ALL_LINEAR})") from None
    if d.main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"LoRA r={lora.rank} alpha={lora.alpha:g}{' (rsLoRA)' if lora.rslora else ''} on {len(wrapped)} "
              f"linear layers: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)")
    base_dtype = param_dtype(cfg, d)
    if base_dtype is not None:
        frozen_to(model, base_dtype)
    if qlora:
        done, linears = quantize_nf4(model, d.device)
        if d.main:
            kept = str(base_dtype or torch.float32).removeprefix("torch.")
            left = f"; {linears - done} too small for NF4's 64x256 blocks stay {kept}" if done < linears else ""
            print(f"QLoRA: {done} of {linears} linear layers of the blocks hold 4-bit NF4 weights{left}")
        to_device(model, d.device)


def parallelize_model(model: Model, d: Dist, model_cfg: ModelSection, cfg: ParallelSection) -> None:
    """Sequence parallel, expert parallel, activation checkpointing, compile and FSDP (zoo.parallel), in that
    order; --fp8's float8 linears before all of them, as torchtitan converts."""
    if cfg.fp8 != "off":
        done, linears = convert_fp8(model, cfg.fp8, d.device, param_dtype(model_cfg, d))
        if d.main:
            print(f"fp8 ({cfg.fp8} scaling): {done} of {linears} linear layers")
    parallelize(model, d.fsdp_mesh, sp=d.sequence_parallel, ep=d.expert_parallel,
                activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                param_dtype=param_dtype(model_cfg, d))


def load_sharded(model: Model, d: Dist, cfg: ModelSection, wrap: Wrap | None = None) -> None:
    """The weights of --model into a model built on meta and sharded: rank 0 reads them and scatters them. With
    LoRA (`wrap`), rank 0's copy is wrapped alike, so the names match and the fresh adapters are the same."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=d.device)
    full: dict[str, ValueType] = {}
    if d.main:
        plain = zoo.load(cfg.name)
        if wrap is not None:
            wrap(plain)
        full = plain.state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def frozen_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters stored in `dtype` (on meta too: a sharded load fills them later)."""
    def cast_frozen(p: nn.Parameter) -> nn.Parameter | None:
        if p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
            return None
        return nn.Parameter(p.detach().to(dtype), requires_grad=False)

    swap_parameters(model, cast_frozen)


def build_optimizer(cfg: OptimSection, steps: int, model: nn.Module) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over the parameters that train (weight decay on matrices and embeddings, not on norms and biases),
    linear warmup then cosine decay over `steps`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ZooError("nothing to train: every parameter is frozen")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)

    def schedule(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, LambdaLR(opt, schedule)
