"""LoRA as PEFT defines it: W x + B A dropout(x) * scale, scale = alpha / r (alpha / sqrt(r) with rsLoRA).

`apply_lora` wraps the named nn.Linear modules of a model's blocks in `LoRALinear`, in place; the base weights are
frozen, only A and B train. The wrapped Linear stays where it was inside its block, so FSDP shards it with the
block, activation checkpointing recomputes it, and sequence parallelism (which only swaps the attention function)
never sees it. A is initialised as PEFT does (Kaiming-uniform, a=sqrt(5)), from a generator of its own, so the
same seed gives the same adapter on any device, in any process; B starts at zero, so the wrapped model begins
exactly as the base.

State-dict names: `<module>.base.weight` (the frozen base), `<module>.lora_A.weight` [r, in], `<module>.lora_B.weight`
[out, r] — PEFT's lora_A/lora_B, so the adapter is saved in PEFT's layout by a rename (`adapter_state`).
`merged_state` folds the adapters back into plain weights with `merge_weight`, the one merge rule zoo uses (also
for PEFT adapters read by convert/llava_layouts.py): fp32 W + (B @ A) * scale, cast back to W's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zoo.errors import ZooError

ALL_LINEAR = "all-linear"
PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha default (PEFT 0.21), used when a config leaves it out


@dataclass(frozen=True)
class LoRAConfig:
    """What PEFT's LoraConfig says about a LoRA: rank, alpha, dropout, rsLoRA and the targeted module names."""

    rank: int
    alpha: float = PEFT_DEFAULT_ALPHA
    dropout: float = 0.0
    rslora: bool = False
    targets: tuple[str, ...] = (ALL_LINEAR,)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ZooError(f"LoRA rank must be at least 1, got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ZooError(f"LoRA alpha must be a finite number above 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ZooError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ZooError(f"LoRA needs target modules: names such as q_proj,v_proj, or {ALL_LINEAR}")

    @property
    def scale(self) -> float:
        return lora_scale(self.rank, self.alpha, self.rslora)


def lora_scale(rank: int, alpha: float, rslora: bool = False) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with use_rslora."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def merge_weight(weight: Tensor, a_RI: Tensor, b_OR: Tensor, scale: float) -> Tensor:
    """W + (B @ A) * scale computed in fp32 and cast back to W's dtype: PEFT's merge_and_unload, bit for bit."""
    delta = b_OR.float() @ a_RI.float()
    return (weight.float() + delta * scale).to(weight.dtype)


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (fp32 A and B, whatever the base's dtype)."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.base = base
        self.scale = cfg.scale
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, cfg.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(cfg.rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        base.requires_grad_(False)
        self.reset_lora(generator)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """A as nn.Linear's default (PEFT's init_lora_weights=True), drawn on CPU; B zero."""
        if self.lora_A.weight.device.type == "meta":
            return
        a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        # PEFT's order: the base output, then the update on x cast to the adapter's dtype, added and cast back
        out = self.base(x)
        update = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype))))
        return (out + update * self.scale).to(out.dtype)


# a block list to wrap: its state-dict prefix ("layers", "language_model.layers") -> (its blocks, the target names)
Blocks = dict[str, tuple[nn.ModuleList, tuple[str, ...]]]


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0, blocks: Blocks | None = None) -> list[str]:
    """Wrap the nn.Linear modules of `model.layers` whose own name is in `cfg.targets` (every one with
    all-linear, as PEFT, which leaves the output head alone), freezing everything else. Returns the wrapped
    modules' names in state-dict order. A target name that matches nothing is an error, naming what exists.

    `blocks` wraps other block lists instead, each with its own targets (a LLaVA's language model and its vision
    tower, whose linear layers have other names); rank, alpha and dropout are `cfg`'s for all, as in one PEFT
    adapter. The whole model is frozen first either way: a caller that trains more (a projector) unfreezes it."""
    if blocks is None:
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ZooError("LoRA needs a zoo model (its blocks in .layers)")
        blocks = {"layers": (layers, cfg.targets)}
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    wrapped: list[str] = []
    for prefix, (layers, targets) in blocks.items():
        wrapped += _wrap_blocks(prefix, layers, targets, cfg, generator)
    return wrapped


def _wrap_blocks(prefix: str, layers: nn.ModuleList, targets: tuple[str, ...], cfg: LoRAConfig,
                 generator: torch.Generator) -> list[str]:
    every = ALL_LINEAR in targets
    found: set[str] = set()
    wrapped: list[str] = []
    leaves: set[str] = set()
    for i, block in enumerate(layers):
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            leaves.add(leaf)
            if not (every or leaf in targets):
                continue
            parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            setattr(parent, leaf, LoRALinear(module, cfg, generator))
            found.add(leaf)
            wrapped.append(f"{prefix}.{i}.{name}")
    missing = sorted(set(targets) - found - {ALL_LINEAR})
    if missing:
        what, where = ("--lora-targets", "the model's blocks") if prefix == "layers" else ("LoRA targets", prefix)
        raise ZooError(f"{what} {','.join(missing)}: no such linear layer in {where}; "
                       f"it has {','.join(sorted(leaves))} (or {ALL_LINEAR})")
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> LoRALinear of every wrapped module (empty for a model without LoRA)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merged_state(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """The plain model's state dict from a LoRA model's (full) one: every `X.base.weight` merged with X's A and
    B; every other tensor as it was, `X.base.bias` renamed `X.bias`."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if name.endswith(".base.weight"):
            stem = name[: -len(".base.weight")]
            out[f"{stem}.weight"] = merge_weight(t, state[f"{stem}.lora_A.weight"], state[f"{stem}.lora_B.weight"],
                                                 scale)
        else:
            out[name.replace(".base.", ".")] = t
    return out


def adapter_state(state: dict[str, Tensor], hf_name: dict[str, str]) -> dict[str, Tensor]:
    """The adapter tensors under PEFT's names: `base_model.model.<HF module>.lora_A.weight`, where `hf_name` maps
    a zoo weight name ("layers.0.attn.q_proj.weight") to its Hugging Face name. Raises KeyError for a wrapped
    weight with no 1:1 Hugging Face tensor (a fused one)."""
    out = {}
    for name, t in state.items():
        for part in ("lora_A", "lora_B"):
            if name.endswith(f".{part}.weight"):
                stem = name[: -len(f".{part}.weight")]
                hf = hf_name[f"{stem}.weight"].removesuffix(".weight")
                out[f"base_model.model.{hf}.{part}.weight"] = t.contiguous()
    return out


def adapter_config(cfg: LoRAConfig, targets: list[str], base: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a causal LM: `targets` are the Hugging Face module names."""
    alpha: float = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.rank,
            "lora_alpha": alpha, "lora_dropout": cfg.dropout, "use_rslora": cfg.rslora,
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True, "use_dora": False, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
