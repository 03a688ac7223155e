"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) over a packed batch; and what the MoE families share.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width.
Qwen3's attention (q/k norms per head, an explicit head dim) over a Mixture-of-Experts MLP (zoo.core.moe): a router
picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token, their weights renormalised when
`norm_topk_prob` (true in the published checkpoints). Layer i is sparse unless it is in `mlp_only_layers` or
(i + 1) % `decoder_sparse_step` != 0; a dense layer runs a gated MLP of `intermediate_size`. The model is the shared
decoder (zoo.models.decoder).

Tensor names: Hugging Face checkpoints hold one tensor per expert and projection (`mlp.experts.{j}.gate_proj.weight`
...); zoo holds them stacked per layer (`mlp.experts.gate_up_proj` [E, 2F, D], gate rows first, and
`mlp.experts.down_proj` [E, D, F]) and the router as `mlp.router` (Hugging Face's `mlp.gate`). The weight plans below
stack on the way in and split on the way out, one layer's experts at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, MoESpec
from zoo.core.layers import LLAMA_ROPES, Rotary, rope_kind
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import Plan, as_tuple, check_hf_counts, family, rename_plans
from zoo.models.llama import HF_NAMES, LLAMA_POSITIVE, finish_shape, shape_from_hf, shape_to_hf

MOE_POSITIVE = frozenset({"n_experts", "top_k", "expert_ffn_dim"})


class MoEShape(Protocol):
    """What the MoE weight plans read of a config."""

    @property
    def n_experts(self) -> int: ...

    @property
    def expert_ffn_dim(self) -> int: ...

    def sparse_layers(self) -> tuple[bool, ...]: ...


def sparse_layers_of(n_layers: int, n_experts: int, step: int, mlp_only: tuple[int, ...]) -> tuple[bool, ...]:
    """Which layers run experts, as transformers' Qwen2-MoE and Qwen3-MoE decide it."""
    return tuple(i not in mlp_only and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))


def finish_moe_config(cfg: Any, ropes: tuple[str, ...] = LLAMA_ROPES) -> None:
    """An MoE config's __post_init__: finish_shape's work, a RoPE scaling zoo knows where it has one (one of
    `ropes`), its dense layers as a tuple (config.json has a list), and the checks it adds: k experts of E,
    dense layers in range."""
    if hasattr(cfg, "mlp_only_layers"):
        object.__setattr__(cfg, "mlp_only_layers", as_tuple(cfg.mlp_only_layers))
    finish_shape(cfg)
    if hasattr(cfg, "rope_scaling"):  # Qwen3.5-MoE has no RoPE scaling
        rope_kind(cfg.rope_scaling, ropes)
    if isinstance(cfg.n_experts, bool) or not isinstance(cfg.n_experts, int):
        raise ZooError(f"num_experts must be an integer, got {cfg.n_experts!r}")
    if not isinstance(cfg.top_k, int) or not 0 < cfg.top_k <= cfg.n_experts:
        raise ZooError(f"num_experts_per_tok must be in 1..num_experts ({cfg.n_experts!r}), got {cfg.top_k!r}")
    only = getattr(cfg, "mlp_only_layers", ())
    if not isinstance(only, tuple):  # a number or string from config.json
        raise ZooError(f"mlp_only_layers must be a list of layer indices in 0..{cfg.n_layers - 1}, got {only!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.n_layers for i in only):
        raise ZooError(f"mlp_only_layers must be layer indices in 0..{cfg.n_layers - 1}, got {list(only)!r}")


def experts_from_hf(hf: dict[str, Any], what: str) -> dict[str, Any]:
    """The expert fields of a Hugging Face MoE config, under both spellings transformers accepts."""
    n = hf.get("num_experts", hf.get("num_local_experts"))
    if n is None or "num_experts_per_tok" not in hf:
        raise ZooError(f"{what}: config.json must give num_experts (or num_local_experts) and num_experts_per_tok")
    if hf.get("use_sliding_window"):
        raise ZooError(f"{what} with use_sliding_window=true is not supported (expected false, as every published "
                       "checkpoint has it)")
    return {"n_experts": n, "top_k": hf["num_experts_per_tok"]}


def mlp_only_from_hf(hf: dict[str, Any]) -> Any:
    """mlp_only_layers as transformers reads it: null is no layer; anything else is kept for finish_moe_config to
    name (a 0 must not pass as "no layer" by being falsy)."""
    only = hf.get("mlp_only_layers")
    return [] if only is None else only


def refuse_router_bias(cfg: Any, architecture: str) -> None:
    """A model trained with aux-loss-free balancing routes by its router biases, which `architecture` has no place
    for: exporting it there would route differently, so it is refused in one line."""
    if cfg.router_bias:
        raise ZooError(f"this model routes with per-expert router biases (aux-loss-free balancing, "
                       f"--router-bias-update-rate), which transformers' {architecture} cannot hold: keep zoo's "
                       "checkpoint (OUT/model), or train with --aux-loss-coef instead")


# ---- weight plans: per-expert Hugging Face tensors <-> stacked zoo tensors ----

_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"layers\.(\d+)\.mlp\.router\.weight")
_ROUTER_BIAS = re.compile(r"layers\.(\d+)\.mlp\.router_bias")  # DeepSeek-V3's e_score_correction_bias


def moe_plans(table: list[tuple[str, str]], block: str = "mlp",
              names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
              ) -> tuple[Callable[[Any, list[str]], Plan], Callable[[Any, list[str]], Plan]]:
    """plan_from_hf and plan_to_hf of an MoE family: `table`'s renames, plus the experts of layer i stacked from and
    split into Hugging Face's `model.layers.{i}.{block}.experts.{j}.{gate,up,down}.weight` (`names`), the router
    as `model.layers.{i}.{block}.gate.weight` and its bias for the choice (zoo's `router_bias`, where a layer has
    one) as DeepSeek-V3's `model.layers.{i}.{block}.gate.e_score_correction_bias`."""
    base_from, base_to = rename_plans(table)
    gate, up, down = names

    def hf_expert(i: str, j: int, name: str) -> str:
        return f"model.layers.{i}.{block}.experts.{j}.{name}.weight"

    def stack_halves(ts: list[Tensor]) -> Tensor:
        E = len(ts) // 2
        return torch.cat([torch.stack(ts[:E]), torch.stack(ts[E:])], dim=1)

    def stack(ts: list[Tensor]) -> Tensor:
        return torch.stack(ts)

    def plan_from_hf(cfg: MoEShape, zoo_names: list[str]) -> Plan:
        plan: Plan = {}
        E = cfg.n_experts
        for z in zoo_names:
            if m := _EXPERTS.fullmatch(z):
                i = m[1]
                if m[2] == "gate_up_proj":
                    srcs = tuple(hf_expert(i, j, gate) for j in range(E)) + tuple(hf_expert(i, j, up) for j in range(E))
                    plan[z] = (srcs, stack_halves)
                else:
                    plan[z] = (tuple(hf_expert(i, j, down) for j in range(E)), stack)
            elif m := _ROUTER.fullmatch(z):
                plan[z] = ((f"model.layers.{m[1]}.{block}.gate.weight",), None)
            elif m := _ROUTER_BIAS.fullmatch(z):
                plan[z] = ((f"model.layers.{m[1]}.{block}.gate.e_score_correction_bias",), None)
            else:
                plan.update(base_from(cfg, [z]))
        return plan

    def part(j: int, rows: slice | None) -> Callable[[list[Tensor]], Tensor]:
        def take(ts: list[Tensor]) -> Tensor:
            t = ts[0][j]
            return (t if rows is None else t[rows]).contiguous()
        return take

    def plan_to_hf(cfg: MoEShape, zoo_names: list[str]) -> Plan:
        plan: Plan = {}
        E, F = cfg.n_experts, cfg.expert_ffn_dim
        for z in zoo_names:
            if m := _EXPERTS.fullmatch(z):
                i = m[1]
                for j in range(E):
                    if m[2] == "gate_up_proj":
                        plan[hf_expert(i, j, gate)] = ((z,), part(j, slice(0, F)))
                        plan[hf_expert(i, j, up)] = ((z,), part(j, slice(F, 2 * F)))
                    else:
                        plan[hf_expert(i, j, down)] = ((z,), part(j, None))
            elif m := _ROUTER.fullmatch(z):
                plan[f"model.layers.{m[1]}.{block}.gate.weight"] = ((z,), None)
            elif m := _ROUTER_BIAS.fullmatch(z):
                plan[f"model.layers.{m[1]}.{block}.gate.e_score_correction_bias"] = ((z,), None)
            else:
                plan.update(base_to(cfg, [z]))
        return plan

    return plan_from_hf, plan_to_hf


# ---- Qwen3-MoE ----


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Defaults are transformers' Qwen3MoeConfig's (a 24-layer, 128-expert model), token ids aside."""

    family: ClassVar[str] = "qwen3_moe"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | MOE_POSITIVE | {"decoder_sparse_step"}
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    ffn_dim: int = 6144  # the dense layers' MLP (mlp_only_layers, decoder_sparse_step)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    attention_bias: bool = False
    n_experts: int = 128
    top_k: int = 8
    expert_ffn_dim: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the training default of the balancing loss's weight: not architecture, so not compared
    # zoo's own: a per-expert bias on the expert choice, moved by aux-loss-free balancing (recipes
    # --router-bias-update-rate); no Hugging Face class holds it, so a model with one is not exported there
    router_bias: bool = False
    router_aux_loss_coef: float = field(default=0.001, compare=False)
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_moe_config(self)

    def sparse_layers(self) -> tuple[bool, ...]:
        return sparse_layers_of(self.n_layers, self.n_experts, self.decoder_sparse_step, self.mlp_only_layers)

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                             o_bias=self.attention_bias, qk_norm="head")
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=self.norm_topk_prob,
                      router_bias=self.router_bias)
        layers = tuple(LayerSpec(attn, moe if sparse else MLPSpec(self.ffn_dim)) for sparse in self.sparse_layers())
        return DecoderSpec(layers, {"default": Rotary(self.head_dim, self.rope_theta, self.rope_scaling)})


def config_from_hf(hf: dict[str, Any]) -> Qwen3MoeConfig:
    check_hf_counts(hf, "Qwen3-MoE")
    return Qwen3MoeConfig(
        **shape_from_hf(hf, "Qwen3-MoE", norm_eps=1e-6, kv_heads=4, head_dim=128, max_positions=32768),
        attention_bias=hf.get("attention_bias", False), **experts_from_hf(hf, "Qwen3-MoE"),
        expert_ffn_dim=hf.get("moe_intermediate_size", 768), norm_topk_prob=hf.get("norm_topk_prob", False),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1), mlp_only_layers=as_tuple(mlp_only_from_hf(hf)),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    refuse_router_bias(cfg, "Qwen3MoeForCausalLM")
    return {**shape_to_hf(cfg, "Qwen3MoeForCausalLM", "qwen3_moe"), "attention_bias": cfg.attention_bias,
            "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_ffn_dim,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers), "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "use_sliding_window": False, "sliding_window": None}


plan_from_hf, plan_to_hf = moe_plans(HF_NAMES)

# PEFT has no default LoRA targets for qwen3_moe; zoo takes Qwen3's (q and v): the experts and router stay frozen
FAMILY = family("qwen3_moe", Qwen3MoeConfig, ("qwen3_moe",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
