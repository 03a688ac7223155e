"""GLM-4.5 (GLM-4.5, GLM-4.5-Air and their bases) over a packed batch (transformers' Glm4MoeForCausalLM).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width.
Llama's pre-norm blocks with GQA attention: biases on q, k and v (`attention_bias`), optional q/k RMSNorms over each
head before the rotary (`use_qk_norm`: GLM-4.5 has them, Air not), and a rotary over the leading
`partial_rotary_factor` of each head (half) in rotate-half layout (not GLM-4's interleaved pairs). The first
`first_k_dense_replace` layers run a dense SwiGLU MLP of `intermediate_size`; every later one a Mixture-of-Experts
MLP with DeepSeek-V3's router (zoo.core.router: sigmoid scores, the `e_score_correction_bias` for the choice,
`n_group` / `topk_group` group-limited choice, `norm_topk_prob`, `routed_scaling_factor`) and `n_shared_experts`
shared experts as one ungated SwiGLU of their summed width. The model is the shared decoder (zoo.models.decoder).

Tensor names: the experts stacked from and split into the checkpoint's one tensor per expert (zoo.models.qwen3_moe's
plans), the router `mlp.gate` as `mlp.router`, its correction bias as zoo's `mlp.router_bias` buffer (kept in fp32,
moved by the recipes' --router-bias-update-rate), `mlp.shared_experts` as `mlp.shared_expert`. The checkpoints'
multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers past the last) are left out on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, MoESpec
from zoo.core.layers import Rotary
from zoo.core.router import check_groups
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import check_hf_counts, family, number
from zoo.models.glm4 import rotary_from_hf
from zoo.models.llama import HF_NAMES as LLAMA_NAMES
from zoo.models.llama import LLAMA_POSITIVE, shape_from_hf, shape_to_hf
from zoo.models.qwen3_moe import MOE_POSITIVE, finish_moe_config, moe_plans


@dataclass(frozen=True)
class Glm4MoeConfig:
    """GLM-4.5's fields; the defaults are transformers' Glm4MoeConfig's (the presets hold the published shapes)."""

    family: ClassVar[str] = "glm4_moe"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | MOE_POSITIVE | {"rotary_dim", "n_group", "topk_group",
                                                                         "routed_scaling"}
    dim: int = 4096
    n_layers: int = 46
    n_heads: int = 96
    n_kv_heads: int = 8
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 10944  # the dense layers' MLP
    vocab_size: int = 151552
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # the leading dims of each head the rotary turns (head_dim * partial_rotary_factor); 0: half
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    attention_bias: bool = False  # on q, k and v; o has none
    qk_norm: bool = False
    n_experts: int = 128
    top_k: int = 8
    expert_ffn_dim: int = 1408
    n_shared_experts: int = 1  # shared experts, run as one MLP of n_shared_experts x expert_ffn_dim
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_dense: int = 1  # first_k_dense_replace: the first layers run a dense MLP
    # the multi-token-prediction layers a checkpoint holds past the last layer (left out on load): not architecture
    mtp_layers: int = field(default=0, compare=False)
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_moe_config(self)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim // 2)
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ZooError(f"the rotary must turn an even number of dims up to head_dim ({self.head_dim}); "
                           f"partial_rotary_factor gives {self.rotary_dim}")
        if not 0 <= self.first_dense <= self.n_layers:
            raise ZooError(f"first_k_dense_replace must be in 0..{self.n_layers} (the layers), got {self.first_dense}")
        if self.n_shared_experts < 0:
            raise ZooError(f"n_shared_experts must be at least 0, got {self.n_shared_experts}")
        check_groups(self.n_experts, self.top_k, self.n_group, self.topk_group)

    @property
    def rope_scaling(self) -> None:
        """None: no RoPE scaling (config_from_hf refuses one); what shape_to_hf writes."""
        return None

    def sparse_layers(self) -> tuple[bool, ...]:
        return tuple(i >= self.first_dense for i in range(self.n_layers))

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                             qk_norm="head" if self.qk_norm else None)
        shared = self.n_shared_experts * self.expert_ffn_dim or None
        # transformers' experts multiply their outputs by the fp32 weights and cast before the sum (weights_fp32)
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=self.norm_topk_prob,
                      weights_fp32=True, shared_ffn_dim=shared, router_bias=True, scoring="sigmoid",
                      n_group=self.n_group, topk_group=self.topk_group, routed_scaling=self.routed_scaling,
                      shared_gated=False)
        layers = tuple(LayerSpec(attn, moe if sparse else MLPSpec(self.ffn_dim)) for sparse in self.sparse_layers())
        return DecoderSpec(layers, {"default": Rotary(self.rotary_dim, self.rope_theta)})


# ---- Hugging Face names and config ----

HF_NAMES: list[tuple[str, str]] = [  # (zoo prefix, HF prefix), before Llama's; the experts and router: moe_plans
    ("layers.{i}.mlp.shared_expert.", "model.layers.{i}.mlp.shared_experts."),
    *LLAMA_NAMES,
]


def config_from_hf(hf: dict[str, Any]) -> Glm4MoeConfig:
    check_hf_counts({**hf, "num_experts": hf.get("n_routed_experts")}, "GLM-4.5")
    theta, partial = rotary_from_hf(hf, "GLM-4.5")
    # transformers' Glm4MoeConfig defaults: 8 KV heads, rms_norm_eps 1e-5, 131,072 positions
    shape = shape_from_hf({**hf, "rope_scaling": None, "rope_parameters": None}, "GLM-4.5", norm_eps=1e-5,
                          kv_heads=8, max_positions=131072)
    shape.update(rope_theta=theta)
    shape.pop("rope_scaling")
    rotary_dim = int(shape["head_dim"] * partial)  # as transformers rounds it
    if rotary_dim < 2:  # 0 would read as the field's default (half)
        raise ZooError(f"partial_rotary_factor {partial} turns {rotary_dim} of head_dim ({shape['head_dim']}); "
                       f"the rotary needs at least 2")

    def count(key: str, default: int) -> Any:  # DeepSeek-V3's configs may write null for "the default"
        value = hf.get(key)
        return default if value is None else value

    return Glm4MoeConfig(
        **shape, rotary_dim=rotary_dim, attention_bias=hf.get("attention_bias", False),
        qk_norm=hf.get("use_qk_norm", False), n_experts=count("n_routed_experts", 128),
        top_k=count("num_experts_per_tok", 8), expert_ffn_dim=count("moe_intermediate_size", 1408),
        n_shared_experts=count("n_shared_experts", 1), norm_topk_prob=hf.get("norm_topk_prob", True),
        routed_scaling=number(hf.get("routed_scaling_factor", 1.0)), n_group=count("n_group", 1),
        topk_group=count("topk_group", 1), first_dense=count("first_k_dense_replace", 1),
        mtp_layers=count("num_nextn_predict_layers", 0))


def config_to_hf(cfg: Glm4MoeConfig) -> dict[str, Any]:
    shape = shape_to_hf(cfg, "Glm4MoeForCausalLM", "glm4_moe")
    shape.pop("rope_theta")
    shape.pop("rope_scaling")
    return {**shape, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                         "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
            "attention_bias": cfg.attention_bias, "use_qk_norm": cfg.qk_norm, "n_routed_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_ffn_dim,
            "n_shared_experts": cfg.n_shared_experts, "norm_topk_prob": cfg.norm_topk_prob,
            "routed_scaling_factor": cfg.routed_scaling, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "first_k_dense_replace": cfg.first_dense,
            # an export holds no multi-token-prediction layers
            "num_nextn_predict_layers": 0}


def mtp_prefixes(cfg: Glm4MoeConfig) -> tuple[str, ...]:
    """The checkpoint's multi-token-prediction layers: `model.layers.{n}.*` for n past the last layer."""
    return tuple(f"model.layers.{cfg.n_layers + j}." for j in range(cfg.mtp_layers))


plan_from_hf, plan_to_hf = moe_plans(HF_NAMES)

# PEFT has no default LoRA targets for glm4_moe: q and v, as for GLM-4; the experts and router stay frozen
FAMILY = family("glm4_moe", Glm4MoeConfig, ("glm4_moe",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"), hf_left_out=mtp_prefixes,
                left_out_why="glm4_moe: the checkpoint's multi-token-prediction layers (num_nextn_predict_layers, "
                             "stored past the last layer) are left out")
