"""Qwen3.5-MoE (text) over a packed batch: Qwen3_5MoeForCausalLM, and the language model of
Qwen3_5MoeForConditionalGeneration (Qwen3.5-35B-A3B and its larger siblings).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width.
Qwen3.5's hybrid layers (zoo.models.qwen3_5: three Gated DeltaNet layers to one gated-attention layer, the (1 + w)
norms, the partial rotary) with every layer's MLP a Mixture of Experts (zoo.core.moe): there is no dense layer and no
`intermediate_size`, `mlp_only_layers` or `decoder_sparse_step`. The block is Qwen2-MoE's: a router picks
`num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`, softmax in fp32, the top-k
weights always renormalised (the config has no `norm_topk_prob`: transformers' router divides unconditionally) and
cast to the activations' dtype; beside them a shared expert of `shared_expert_intermediate_size` every token runs,
times sigmoid of a linear gate (`shared_expert_gate`).

Tensor names: the published checkpoints and transformers' save_pretrained hold one tensor per expert and projection
(`mlp.experts.{j}.gate_proj.weight` ...; transformers fuses them on load and splits them on save), the router as
`mlp.gate`; zoo holds the experts stacked per layer as the other MoE families do (zoo.models.qwen3_moe.moe_plans).
The rest is named as in Qwen3.5, including the `model.language_model.*` spelling of the multimodal checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import DecoderSpec, MoESpec
from zoo.errors import ZooError
from zoo.models import qwen3_5
from zoo.models.decoder import Decoder
from zoo.models.family import Plan, family
from zoo.models.qwen3_moe import MOE_POSITIVE, experts_from_hf, finish_moe_config, moe_plans, refuse_router_bias


@dataclass(frozen=True)
class Qwen3_5MoeConfig:
    """Defaults are transformers' Qwen3_5MoeTextConfig's (Qwen3.5-35B-A3B's shape), token ids aside."""

    family: ClassVar[str] = "qwen3_5_moe"
    positive: ClassVar[frozenset[str]] = qwen3_5.Qwen3_5Config.positive - {"ffn_dim"} | MOE_POSITIVE | {
        "shared_expert_ffn_dim"}
    dim: int = 2048
    n_layers: int = 40
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int = 64  # head_dim * partial_rotary_factor
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()  # per layer, FULL or LINEAR; (): transformers' interval of 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    n_experts: int = 256
    top_k: int = 8
    expert_ffn_dim: int = 512
    shared_expert_ffn_dim: int = 512
    # zoo's own: a per-expert bias on the expert choice (aux-loss-free balancing); not exported to transformers
    router_bias: bool = False
    mrope_section: tuple[int, ...] = ()  # the multimodal model's interleaved M-RoPE (zoo.models.qwen3_5)
    router_aux_loss_coef: float = field(default=0.001, compare=False)  # the training default, not architecture
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_moe_config(self)
        qwen3_5.finish_hybrid(self)

    def sparse_layers(self) -> tuple[bool, ...]:
        return (True,) * self.n_layers

    def decoder_spec(self) -> DecoderSpec:
        return qwen3_5.hybrid_spec(self, MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=True,
                                                 shared_ffn_dim=self.shared_expert_ffn_dim,
                                                 router_bias=self.router_bias))

def config_from_hf(hf: dict[str, Any]) -> Qwen3_5MoeConfig:
    """A Qwen3_5MoeForCausalLM config ("qwen3_5_moe_text"), or a Qwen3_5MoeForConditionalGeneration one
    ("qwen3_5_moe"), whose text config describes its language model."""
    hf = qwen3_5.text_config_of(hf, "qwen3_5_moe")
    if "mlp_only_layers" in hf or hf.get("decoder_sparse_step", 1) != 1:
        raise ZooError("Qwen3.5-MoE runs experts in every layer (transformers' Qwen3_5MoeSparseMoeBlock), got "
                       f"mlp_only_layers={hf.get('mlp_only_layers')!r}, "
                       f"decoder_sparse_step={hf.get('decoder_sparse_step')!r}")
    return Qwen3_5MoeConfig(
        **qwen3_5.hybrid_fields_from_hf(hf, "Qwen3.5-MoE"), **experts_from_hf(hf, "Qwen3.5-MoE"),
        expert_ffn_dim=hf.get("moe_intermediate_size", 512),
        shared_expert_ffn_dim=hf.get("shared_expert_intermediate_size", 512),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: Qwen3_5MoeConfig) -> dict[str, Any]:
    """A Qwen3_5MoeForCausalLM config.json."""
    refuse_router_bias(cfg, "Qwen3_5MoeForCausalLM")
    return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            **qwen3_5.hybrid_fields_to_hf(cfg), "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "moe_intermediate_size": cfg.expert_ffn_dim, "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim,
            "router_aux_loss_coef": cfg.router_aux_loss_coef}


# ---- Hugging Face names: the experts and routers by the MoE plans, the rest as Qwen3.5 names it ----

_experts_from_hf, _experts_to_hf = moe_plans([])


def _is_routed(zoo_name: str) -> bool:
    return ".mlp.experts." in zoo_name or ".mlp.router." in zoo_name


def plan_from_hf(cfg: Qwen3_5MoeConfig, zoo_names: list[str]) -> Plan:
    plan = _experts_from_hf(cfg, [z for z in zoo_names if _is_routed(z)])
    plan.update({z: ((qwen3_5.hf_name(cfg, z),), None) for z in zoo_names if not _is_routed(z)})
    return plan


def plan_to_hf(cfg: Qwen3_5MoeConfig, zoo_names: list[str]) -> Plan:
    plan = _experts_to_hf(cfg, [z for z in zoo_names if _is_routed(z)])
    plan.update({qwen3_5.hf_name(cfg, z): ((z,), None) for z in zoo_names if not _is_routed(z)})
    return plan


# LoRA `auto` as Qwen3.5's (the attention's q and v, the DeltaNet's in_proj_qkv): experts and routers stay frozen
FAMILY = family("qwen3_5_moe", Qwen3_5MoeConfig, ("qwen3_5_moe_text",), build=Decoder,
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, plan_from_hf=plan_from_hf,
                plan_to_hf=plan_to_hf, lora_targets=("q_proj", "v_proj", "in_proj_qkv"),
                hf_spellings=qwen3_5.hf_spellings, hf_left_out=qwen3_5.LEFT_OUT,
                left_out_why="qwen3_5_moe: reading the language model of a Qwen3_5MoeForConditionalGeneration "
                             "checkpoint; its vision tower (model.visual.*) and multi-token-prediction head (mtp.*) "
                             "are left out")
