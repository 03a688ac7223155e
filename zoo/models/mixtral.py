"""Mixtral (8x7B, 8x22B) over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width.
Mistral's attention (GQA, no biases, an optional sliding window on every layer) over a Mixture-of-Experts MLP
(zoo.core.moe) in every layer: `num_local_experts` SwiGLU experts of `intermediate_size`, top-k always renormalised,
the weights kept in fp32 into the sum (transformers' Mixtral never casts them back). Hugging Face names the block
`block_sparse_moe` and the experts' projections w1 (gate), w3 (up), w2 (down); zoo stacks them as every MoE family
(zoo.models.qwen3_moe).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MoESpec
from zoo.core.layers import Rotary
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import family
from zoo.models.llama import LLAMA_POSITIVE, check_window, shape_from_hf, shape_to_hf
from zoo.models.qwen3_moe import MOE_POSITIVE, experts_from_hf, finish_moe_config, moe_plans, refuse_router_bias

HF_NAMES = [  # (zoo prefix, HF prefix)
    ("embed.", "model.embed_tokens."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),
    ("layers.{i}.mlp_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]


@dataclass(frozen=True)
class MixtralConfig:
    """Defaults are transformers' MixtralConfig's (Mixtral-8x7B's shape), token ids aside."""

    family: ClassVar[str] = "mixtral"
    positive: ClassVar[frozenset[str]] = (LLAMA_POSITIVE - {"ffn_dim"}) | MOE_POSITIVE | {"sliding_window"}
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 0  # 0: dim // n_heads
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    sliding_window: int | None = None
    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 14336
    # zoo's own: a per-expert bias on the expert choice, moved by aux-loss-free balancing (recipes
    # --router-bias-update-rate); no Hugging Face class holds it, so a model with one is not exported there
    router_bias: bool = False
    router_aux_loss_coef: float = field(default=0.001, compare=False)
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_moe_config(self)
        check_window(self.sliding_window)

    @property
    def ffn_dim(self) -> int:  # what shape_to_hf writes as intermediate_size: the experts' width
        return self.expert_ffn_dim

    def sparse_layers(self) -> tuple[bool, ...]:
        return (True,) * self.n_layers

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, window=self.sliding_window)
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=True, weights_fp32=True,
                      router_bias=self.router_bias)
        return DecoderSpec((LayerSpec(attn, moe),) * self.n_layers,
                           {"default": Rotary(self.head_dim, self.rope_theta, self.rope_scaling)})


def config_from_hf(hf: dict[str, Any]) -> MixtralConfig:
    if hf.get("router_jitter_noise"):
        raise ZooError(f"Mixtral with router_jitter_noise={hf['router_jitter_noise']!r} is not supported (expected 0: "
                       "the published checkpoints route without noise)")
    shape = shape_from_hf(hf, "Mixtral", norm_eps=1e-5, kv_heads=8, max_positions=131072)
    expert_ffn_dim = shape.pop("ffn_dim")
    return MixtralConfig(**shape, **experts_from_hf(hf, "Mixtral"), expert_ffn_dim=expert_ffn_dim,
                         sliding_window=hf.get("sliding_window"),
                         router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: MixtralConfig) -> dict[str, Any]:
    refuse_router_bias(cfg, "MixtralForCausalLM")
    return {**shape_to_hf(cfg, "MixtralForCausalLM", "mixtral"), "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k, "sliding_window": cfg.sliding_window, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": cfg.router_aux_loss_coef}


plan_from_hf, plan_to_hf = moe_plans(HF_NAMES + [("layers.{i}.mlp.", "model.layers.{i}.block_sparse_moe.")],
                                     block="block_sparse_moe", names=("w1", "w3", "w2"))

# PEFT's default LoRA targets for Mixtral: q and v
FAMILY = family("mixtral", MixtralConfig, ("mixtral",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
