"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width.
Qwen2's attention (bias on q, k and v, not o; no q/k norms) over a Mixture-of-Experts MLP (zoo.core.moe) with a shared
expert of its own width (`shared_expert_intermediate_size`) that every token runs, times sigmoid of a linear gate.
The top-k weights are not renormalised in the published checkpoints (`norm_topk_prob` false). Sparse and dense layers
as Qwen3-MoE decides them (zoo.models.qwen3_moe, which also holds the stacked-expert weight plans). The shared
expert's names are Hugging Face's (`mlp.shared_expert.*`, `mlp.shared_expert_gate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, MoESpec
from zoo.core.layers import Rotary
from zoo.models.decoder import Decoder
from zoo.models.family import as_tuple, family
from zoo.models.llama import HF_NAMES, LLAMA_POSITIVE, shape_from_hf, shape_to_hf
from zoo.models.qwen3_moe import (
    MOE_POSITIVE,
    experts_from_hf,
    finish_moe_config,
    mlp_only_from_hf,
    moe_plans,
    refuse_router_bias,
    sparse_layers_of,
)


@dataclass(frozen=True)
class Qwen2MoeConfig:
    """Defaults are transformers' Qwen2MoeConfig's (Qwen1.5-MoE-A2.7B's shape), token ids aside."""

    family: ClassVar[str] = "qwen2_moe"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | MOE_POSITIVE | {"decoder_sparse_step",
                                                                         "shared_expert_ffn_dim"}
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    n_kv_heads: int = 16
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 5632  # the dense layers' MLP
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    qkv_bias: bool = True
    n_experts: int = 60
    top_k: int = 4
    expert_ffn_dim: int = 1408
    shared_expert_ffn_dim: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
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
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.qkv_bias)
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=self.norm_topk_prob,
                      shared_ffn_dim=self.shared_expert_ffn_dim,
                      router_bias=self.router_bias)
        layers = tuple(LayerSpec(attn, moe if sparse else MLPSpec(self.ffn_dim)) for sparse in self.sparse_layers())
        return DecoderSpec(layers, {"default": Rotary(self.head_dim, self.rope_theta, self.rope_scaling)})


def config_from_hf(hf: dict[str, Any]) -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        **shape_from_hf(hf, "Qwen2-MoE", norm_eps=1e-6, kv_heads=16, max_positions=32768),
        qkv_bias=hf.get("qkv_bias", True), **experts_from_hf(hf, "Qwen2-MoE"),
        expert_ffn_dim=hf.get("moe_intermediate_size", 1408),
        shared_expert_ffn_dim=hf.get("shared_expert_intermediate_size", 5632),
        norm_topk_prob=hf.get("norm_topk_prob", False), decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=as_tuple(mlp_only_from_hf(hf)),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: Qwen2MoeConfig) -> dict[str, Any]:
    refuse_router_bias(cfg, "Qwen2MoeForCausalLM")
    return {**shape_to_hf(cfg, "Qwen2MoeForCausalLM", "qwen2_moe"), "qkv_bias": cfg.qkv_bias,
            "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_ffn_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "use_sliding_window": False}


plan_from_hf, plan_to_hf = moe_plans(HF_NAMES)  # shared_expert.* and shared_expert_gate ride on the mlp prefix

# PEFT has no default LoRA targets for qwen2_moe; zoo takes Qwen2's (q and v)
FAMILY = family("qwen2_moe", Qwen2MoeConfig, ("qwen2_moe",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
