"""DeepSeek-V3 (and its architecture's other checkpoints: DeepSeek-V3-Base, Moonlight, Kimi K2) over a packed batch
(transformers' DeepseekV3ForCausalLM).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N heads, F FFN dim, V vocab, E
experts.
Every layer's mixer is multi-head latent attention (zoo.core.mla: queries through a q_lora_rank latent or one
projection, keys and values through a kv_lora_rank latent, rope and no-rope dims of their own widths, a value width of
its own; the rotary interleaved where `rope_interleave`, YaRN with the mscale correction of the softmax scale). The
first `first_k_dense_replace` layers run a gated MLP of `intermediate_size`, the rest a Mixture-of-Experts block with
DeepSeek-V3's router (zoo.core.moe, scoring "sigmoid": each expert's sigmoid score, e_score_correction_bias added for
the choice, experts chosen within the `topk_group` best of `n_group` groups, weights renormalised and times
`routed_scaling_factor`) and `n_shared_experts` ungated shared experts (one MLP of their summed width).
Multi-token-prediction layers (`num_nextn_predict_layers`, numbered from num_hidden_layers on) are left out on load
in one line, as transformers leaves them out. Kimi K2's checkpoints name their model_type `kimi_k2` (transformers has
no class of that name; its architecture is DeepseekV3ForCausalLM): read as this family. The model is the shared
decoder (zoo.models.decoder); this file holds the config, the Hugging Face names and the conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import DecoderSpec, LayerSpec, MLASpec, MLPSpec, MoESpec
from zoo.core.layers import Rotary, rope_kind, yarn_softmax_scale
from zoo.core.router import check_groups
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import MAX_COUNT, as_tuple, check_hf_counts, family, token_ids_from_hf, token_ids_to_hf
from zoo.models.llama import HF_NAMES, check_silu, rope_from_hf
from zoo.models.qwen3_moe import moe_plans

ROPES = ("default", "yarn")


@dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek-V3's fields; the defaults are transformers' DeepseekV3Config's (the published V3 shape)."""

    family: ClassVar[str] = "deepseek_v3"
    positive: ClassVar[frozenset[str]] = frozenset({
        "dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "ffn_dim", "vocab_size", "max_seq_len", "norm_eps", "rope_theta", "q_lora_rank", "n_experts", "top_k",
        "expert_ffn_dim", "n_group", "topk_group", "routed_scaling_factor"})
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    q_lora_rank: int | None = 1536  # None: one q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    ffn_dim: int = 18432  # the dense layers' MLP
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # None or YaRN
    rope_interleave: bool = True
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False
    first_k_dense_replace: int = 3  # the first layers run a dense MLP
    n_experts: int = 256
    top_k: int = 8
    expert_ffn_dim: int = 2048
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    bos_token_id: int | None = field(default=0, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(1,), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", as_tuple(self.eos_token_ids))
        rope_kind(self.rope_scaling, ROPES)
        k = self.first_k_dense_replace
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ZooError(f"first_k_dense_replace must be an integer >= 0, got {k!r}")
        if any(self.sparse_layers()):  # with the config, not when the model is built
            check_groups(self.n_experts, self.top_k, self.n_group, self.topk_group)

    def sparse_layers(self) -> tuple[bool, ...]:
        return tuple(i >= self.first_k_dense_replace for i in range(self.n_layers))

    def softmax_scale(self) -> float:
        """(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
        return yarn_softmax_scale((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5, self.rope_scaling)

    def decoder_spec(self) -> DecoderSpec:
        mla = MLASpec(self.n_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                      self.v_head_dim, bias=self.attention_bias, scale=self.softmax_scale(),
                      rope_layout="interleaved" if self.rope_interleave else "half")
        shared = self.expert_ffn_dim * self.n_shared_experts or None  # one MLP of the shared experts' summed width
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=self.norm_topk_prob,
                      shared_ffn_dim=shared, router_bias=True, scoring="sigmoid", n_group=self.n_group,
                      topk_group=self.topk_group, routed_scaling=self.routed_scaling_factor, shared_gated=False)
        layers = tuple(LayerSpec(mla, moe if sparse else MLPSpec(self.ffn_dim)) for sparse in self.sparse_layers())
        return DecoderSpec(layers, {"default": Rotary(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)})


# ---- Hugging Face names and config ----

# the MLA's modules keep transformers' names under self_attn (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
# kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj): Llama's prefix renames cover them. The MoE layers' experts
# are stacked from and split into per-expert tensors, the router is mlp.gate (its bias for the choice
# mlp.gate.e_score_correction_bias), the shared experts one MLP under mlp.shared_experts
HF_NAMES_V3 = [("layers.{i}.mlp.shared_expert.", "model.layers.{i}.mlp.shared_experts."), *HF_NAMES]
plan_from_hf, plan_to_hf = moe_plans(HF_NAMES_V3)


def config_from_hf(hf: dict[str, Any]) -> DeepseekV3Config:
    check_hf_counts(hf, "DeepSeek-V3")
    n = hf.get("n_routed_experts")  # DeepSeek's spelling of the count check_hf_counts bounds for the other families
    if isinstance(n, int) and not isinstance(n, bool) and not 1 <= n <= MAX_COUNT:
        raise ZooError(f"DeepSeek-V3: n_routed_experts must be an integer in 1..{MAX_COUNT}, got {n!r}")
    check_silu(hf, "DeepSeek-V3")
    theta, scaling = rope_from_hf(hf)
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ZooError(f"DeepSeek-V3 with topk_method={hf.get('topk_method')!r} and scoring_func="
                       f"{hf.get('scoring_func')!r} is not supported (expected 'noaux_tc' and 'sigmoid', as "
                       f"transformers' DeepseekV3 routes)")
    n_experts = hf.get("n_routed_experts", 256)
    return DeepseekV3Config(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank", 1536), kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128), qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        v_head_dim=hf.get("v_head_dim", 128), ffn_dim=hf.get("intermediate_size", 18432),
        vocab_size=hf.get("vocab_size", 129280), norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, rope_interleave=hf.get("rope_interleave", True),
        max_seq_len=hf.get("max_position_embeddings", 4096), tie_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False), first_k_dense_replace=hf.get("first_k_dense_replace", 3),
        n_experts=n_experts, top_k=hf.get("num_experts_per_tok", 8),
        expert_ffn_dim=hf.get("moe_intermediate_size", 2048), n_shared_experts=hf.get("n_shared_experts", 1),
        n_group=hf.get("n_group", 8), topk_group=hf.get("topk_group", 4),
        norm_topk_prob=hf.get("norm_topk_prob", True), routed_scaling_factor=hf.get("routed_scaling_factor", 2.5),
        **{"bos_token_id": 0, "eos_token_ids": (1,), **token_ids_from_hf(hf)})


def config_to_hf(cfg: DeepseekV3Config) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "rope_interleave": cfg.rope_interleave,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu", "first_k_dense_replace": cfg.first_k_dense_replace,
        "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.expert_ffn_dim, "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_nextn_predict_layers": 0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        **token_ids_to_hf(cfg),
    }


def mtp_layers(cfg: DeepseekV3Config) -> tuple[str, ...]:
    """The prefixes of the multi-token-prediction layers a checkpoint may hold after the last layer (V3: layer 61);
    transformers leaves them out too (its _keys_to_ignore_on_load_unexpected)."""
    return tuple(f"model.layers.{cfg.n_layers + j}." for j in range(4))


FAMILY = family("deepseek_v3", DeepseekV3Config, ("deepseek_v3", "kimi_k2"), build=Decoder,
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, plan_from_hf=plan_from_hf,
                plan_to_hf=plan_to_hf,
                # PEFT has no default for deepseek_v3: the key/value latent's two projections (present whether or not
                # the query has a latent)
                lora_targets=("kv_a_proj_with_mqa", "kv_b_proj"),
                hf_left_out=mtp_layers,
                left_out_why="deepseek_v3: the checkpoint's multi-token-prediction layers (numbered after the last "
                             "layer, num_nextn_predict_layers) are left out, as transformers leaves them out")
