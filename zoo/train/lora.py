"""LoRA as PEFT defines it: W x + B A dropout(x) * scale, scale = alpha / r (alpha / sqrt(r) with rsLoRA).

`apply_lora` wraps the named nn.Linear modules of a model's blocks in `LoRALinear`, in place; the base weights are
frozen, only A and B train. The wrapped Linear stays where it was inside its block, so FSDP shards it with the
block, activation checkpointing recomputes it, and sequence parallelism (which only swaps the attention function)
never sees it. A is initialised as PEFT does (Kaiming-uniform, a=sqrt(5)), from a generator of its own, so the
same seed gives the same adapter on any device, in any process; B starts at zero, so the wrapped model begins
exactly as the base.

State-dict names: `<module>.base.weight` (the frozen base), `<module>.lora_A.weight` [r, in], `<module>.lora_B.weight`
[out, r] — PEFT's lora_A/lora_B, so the adapter is saved in PEFT's layout by a rename (`adapter_state`).

Fused Hugging Face tensors. InternLM2's `wqkv` and OpenELM's `qkv_proj` / `proj_1` are one nn.Linear upstream and
plain q/k/v (gate/up) projections in zoo. PEFT's LoRA on `wqkv` is one A [r, D] and one B over all its rows. When every
part of such a tensor is targeted (or the tensor by its Hugging Face name, `wqkv`), the parts share that one A — it
lives in the first part, the others hold a reference — and each keeps its rows of B: the same function and the same
gradients as PEFT's adapter on the fused module, written to its layout by the family's own fusing rule. Targeting
only some parts gives each its own adapter, which only a merged model can carry.
`merged_state` folds the adapters back into plain weights with `merge_weight`, the one merge rule zoo uses (also
for PEFT adapters read by convert/llava_layouts.py): fp32 W + (B @ A) * scale, cast back to W's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zoo.core.contract import is_zoo_model
from zoo.core.moe import Router
from zoo.errors import ZooError
from zoo.models.family import Plan
from zoo.train.quant import dequantized

ALL_LINEAR = "all-linear"
AUTO = "auto"
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
    """W + (B @ A) * scale computed in fp32 and cast back to W's dtype: PEFT's merge_and_unload, bit for bit (a 4-bit
    W is dequantized first)."""
    delta = b_OR.float() @ a_RI.float()
    return (dequantized(weight).float() + delta * scale).to(weight.dtype)


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (fp32 A and B, whatever the base's dtype). With
    `a_from`, the A of that module is used (the parts of a fused Hugging Face tensor, see the module docstring)."""

    a_from: LoRALinear | None

    def __init__(self, base: nn.Linear, cfg: LoRAConfig, generator: torch.Generator | None = None,
                 a_from: LoRALinear | None = None):
        super().__init__()
        self.base = base
        self.scale = cfg.scale
        device = base.weight.device
        # a plain attribute, not a submodule: the shared A is a parameter of its owner only (state dict, optimizer,
        # FSDP), and read from there at call time, so it is the owner's unsharded copy inside the block's forward
        self.__dict__["a_from"] = a_from
        if a_from is None:
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

    @property
    def a(self) -> nn.Linear:
        """The A projection: this module's own, or the one it shares."""
        return self.a_from.a if self.a_from is not None else self.lora_A

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """A as nn.Linear's default (PEFT's init_lora_weights=True), drawn on CPU; B zero."""
        if self.lora_B.weight.device.type == "meta":
            return
        with torch.no_grad():
            if self.a_from is None:
                a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
                self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        # PEFT's order: the base output, then the update on x cast to the adapter's dtype, added and cast back
        out = self.base(x)
        a = self.a
        update = self.lora_B(a(self.dropout(x.to(a.weight.dtype))))
        return (out + update * self.scale).to(out.dtype)


def hf_modules(model: nn.Module) -> tuple[dict[str, str], list[tuple[str, ...]]]:
    """From the model family's conversion plan: the Hugging Face module name (its last part, "wqkv") of every
    linear weight's module ("layers.0.attn.q_proj"), and the groups of modules fused into one Hugging Face tensor."""
    from zoo.models import FAMILIES  # the families import nothing of LoRA; this keeps zoo.train.lora light to import

    if not is_zoo_model(model):
        return {}, []
    family = FAMILIES[model.family]
    names = [n for n in model.state_dict() if n.endswith(".weight")]
    leaf: dict[str, str] = {}
    groups: list[tuple[str, ...]] = []
    for hf, (sources, _) in family.plan_to_hf(model.config, names).items():
        if not (hf.endswith(".weight") and all(s.endswith(".weight") for s in sources)):
            continue
        stems = tuple(s.removesuffix(".weight") for s in sources)
        for stem in stems:
            leaf[stem] = hf.removesuffix(".weight").rsplit(".", 1)[-1]
        if len(stems) > 1:
            groups.append(stems)
    return leaf, groups


# a block list to wrap: its state-dict prefix ("layers", "language_model.layers") -> (its blocks, the target names)
Blocks = dict[str, tuple[nn.ModuleList, tuple[str, ...]]]


def resolve_targets(targets: tuple[str, ...], family: str) -> tuple[str, ...]:
    """`targets`, with ("auto",) replaced by the family's default (its record's `lora_targets`: PEFT's q and v for
    Llama; where q/k/v are one tensor upstream, InternLM2's and OpenELM's, that tensor, so the adapter can be
    written in PEFT's layout)."""
    from zoo.models import FAMILIES

    if targets != (AUTO,):
        return targets
    default = FAMILIES[family].lora_targets if family in FAMILIES else ()
    if not default:
        raise ZooError(f"LoRA targets auto: no default for a {family} model; name the linear layers to adapt")
    return default


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0, blocks: Blocks | None = None) -> list[str]:
    """Wrap the nn.Linear modules of `model.layers` whose own name (zoo's "q_proj", or the Hugging Face module's,
    "wqkv") is in `cfg.targets` (every one with all-linear, as PEFT, which leaves the output head alone; "auto": the
    family's default, `resolve_targets`), freezing everything else. The parts of a fused Hugging Face tensor that are
    all targeted share one A (module docstring). Returns the wrapped modules' names in state-dict order. A target
    name that matches nothing is an error (`UnknownTargets`), naming what exists.

    `blocks` wraps other block lists instead, each with its own targets (a LLaVA's language model and its vision
    tower, whose linear layers have other names); rank, alpha and dropout are `cfg`'s for all, as in one PEFT
    adapter. The whole model is frozen first either way: a caller that trains more (a projector) unfreezes it."""
    if blocks is None:
        if not is_zoo_model(model):
            raise ZooError(f"LoRA needs a zoo model (its blocks in .layers), got a {type(model).__name__}")
        layers = model.layers
        targets = resolve_targets(cfg.targets, model.family)
        blocks = {next((n for n, m in model.named_modules() if m is layers), "layers"): (layers, targets)}
    hf_leaf, groups = hf_modules(model)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    chosen: dict[str, nn.Linear] = {}
    for prefix, (layers, targets) in blocks.items():
        chosen.update(_choose(prefix, layers, targets, hf_leaf, cfg.rank))
    for stem, module in chosen.items():  # before allocating: a rank of 10**9 would ask for terabytes
        if cfg.rank > min(module.in_features, module.out_features):
            raise ZooError(f"LoRA rank {cfg.rank} is above {stem}'s smaller dimension ({module.in_features} in, "
                           f"{module.out_features} out): a rank past it adds parameters, not capacity; use "
                           f"rank {min(module.in_features, module.out_features)} or less")
    owner = {stem: group[0] for group in groups if all(s in chosen for s in group) for stem in group[1:]}
    wrapped: dict[str, LoRALinear] = {}
    for stem in sorted(chosen, key=lambda s: s in owner):  # the owners of shared A's first
        module, (parent_name, leaf) = chosen[stem], stem.rsplit(".", 1)
        lora = LoRALinear(module, cfg, generator, a_from=wrapped[owner[stem]] if stem in owner else None)
        setattr(model.get_submodule(parent_name), leaf, lora)
        wrapped[stem] = lora
    return list(chosen)


def _choose(prefix: str, layers: nn.ModuleList, targets: tuple[str, ...],
            hf_leaf: dict[str, str], rank: int) -> dict[str, nn.Linear]:
    """The linear layers of `layers` (state-dict names under `prefix`) that `targets` name. all-linear leaves out
    a layer narrower than the rank that no target names (Qwen2-MoE's shared-expert gate, 1 output): an adapter
    there would add parameters, not capacity."""
    every = ALL_LINEAR in targets
    found: set[str] = set()
    leaves: set[str] = set()
    chosen: dict[str, nn.Linear] = {}
    for i, block in enumerate(layers):
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear) or isinstance(module, (LoRALinear, Router)):
                continue
            stem, leaf = f"{prefix}.{i}.{name}", name.rsplit(".", 1)[-1]
            names = {leaf, hf_leaf.get(stem, leaf)}
            leaves |= names
            named = names & set(targets)
            if named or (every and rank <= min(module.in_features, module.out_features)):
                chosen[stem] = module
                found |= named
    missing = sorted(set(targets) - found - {ALL_LINEAR})
    if missing:
        raise UnknownTargets(missing, prefix, sorted(leaves))
    return chosen


class UnknownTargets(ZooError):
    """LoRA target names that match no linear layer of the blocks under `blocks` (a state-dict prefix: "layers",
    "vision.layers"); `available` are the names there are. A caller with its own words for the targets (a flag)
    can say it with these."""

    def __init__(self, missing: list[str], blocks: str, available: list[str]):
        self.missing, self.blocks, self.available = missing, blocks, available
        super().__init__(f"LoRA targets {','.join(missing)}: no such linear layer in the blocks of {blocks}; they "
                         f"have {','.join(available)} (or {ALL_LINEAR})")


def shared_a(model: nn.Module) -> dict[str, str]:
    """module -> the module whose A it uses, for every LoRA module sharing another's (the parts of a fused tensor)."""
    names = {id(m): n for n, m in model.named_modules()}
    return {n: names[id(m.a_from)] for n, m in lora_modules(model).items() if m.a_from is not None}


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> LoRALinear of every wrapped module (empty for a model without LoRA)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merged_state(state: dict[str, Tensor], scale: float, a_from: dict[str, str] | None = None) -> dict[str, Tensor]:
    """The plain model's state dict from a LoRA model's (full) one: every `X.base.weight` merged with X's A (or
    that of `a_from[X]`, see `shared_a`) and B; every other tensor as it was, `X.base.bias` renamed `X.bias`."""
    a_from = a_from or {}
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if name.endswith(".base.weight"):
            stem = name[: -len(".base.weight")]
            a = state[f"{a_from.get(stem, stem)}.lora_A.weight"]
            out[f"{stem}.weight"] = merge_weight(t, a, state[f"{stem}.lora_B.weight"], scale)
        else:
            out[name.replace(".base.", ".")] = t
    return out


def adapter_state(state: dict[str, Tensor], plan_to_hf: Plan,
                  a_from: dict[str, str] | None = None) -> dict[str, Tensor]:
    """The adapter tensors under PEFT's names, `base_model.model.<HF module>.lora_A.weight`, by the family's
    `plan_to_hf` ({HF name: (zoo names, combine)}): a Hugging Face module made of one zoo module takes its A and B;
    one fused from several (`wqkv`) takes their shared A and their B rows fused by the same rule as the weights.
    Raises KeyError naming a wrapped module that PEFT cannot address: part of a fused tensor with its own A, or
    whose fused tensor has parts without LoRA."""
    a_from = a_from or {}
    wrapped = {n.removesuffix(".lora_B.weight") for n in state if n.endswith(".lora_B.weight")}
    out: dict[str, Tensor] = {}
    for hf, (sources, combine) in plan_to_hf.items():
        stems = [s.removesuffix(".weight") for s in sources if s.endswith(".weight")]
        if not hf.endswith(".weight") or not set(stems) & wrapped:
            continue
        owners = {a_from.get(s, s) for s in stems}
        if len(stems) != len(sources) or not set(stems) <= wrapped or len(owners) != 1:
            raise KeyError(next(s for s in stems if s in wrapped))
        a = state[f"{owners.pop()}.lora_A.weight"]
        bs = [state[f"{s}.lora_B.weight"] for s in stems]
        b = bs[0] if combine is None else combine(bs)
        module = hf.removesuffix(".weight")
        out[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    return out


def adapter_config(cfg: LoRAConfig, targets: list[str], base: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a causal LM: `targets` are the Hugging Face module names."""
    alpha: float = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.rank,
            "lora_alpha": alpha, "lora_dropout": cfg.dropout, "use_rslora": cfg.rslora,
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True, "use_dora": False, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
