"""OLMo 2 over a packed batch (allenai/OLMo-2-*: 1B, 7B, 13B and their instruct models).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama's parts in another order: no norm before the mixer or the MLP, one after each (x + norm(f(x)), placement
"post"); an RMSNorm over the whole q and k projections (N*H and K*H wide) before the heads are split and rotated;
every RMSNorm multiplies its weight in fp32 and casts after (Olmo2RMSNorm), and the rotary's cos/sin stay fp32, so
q and k are rotated in fp32 and cast back (Olmo2RotaryEmbedding returns them uncast). transformers' Olmo2Config has
no head_dim (dim / heads) but its attention reads one when config.json has it; zoo does the same. The model is the
shared decoder (zoo.models.decoder); this file holds the config, the Hugging Face names and the conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, NormSpec
from zoo.core.layers import Rotary
from zoo.models.decoder import Decoder
from zoo.models.family import check_hf_counts, family, rename_plans
from zoo.models.llama import LLAMA_POSITIVE, finish_config, shape_from_hf, shape_to_hf


@dataclass(frozen=True)
class Olmo2Config:
    """OLMo 2's fields; the defaults are transformers' Olmo2Config's (the presets hold the published shapes)."""

    family: ClassVar[str] = "olmo2"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 0  # 0: n_heads (transformers' None)
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 11008
    vocab_size: int = 50304
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False  # on q, k, v and o; the MLP never has one
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        finish_config(self)

    def decoder_spec(self) -> DecoderSpec:
        norm = NormSpec(cast_first=False)  # Olmo2RMSNorm: (weight * normed x) in fp32, then the cast
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                             o_bias=self.attention_bias, qk_norm="full")
        layer = LayerSpec(attn, MLPSpec(self.ffn_dim), norm=norm, placement="post")
        rotary = Rotary(self.head_dim, self.rope_theta, self.rope_scaling, dtype=torch.float32)
        return DecoderSpec((layer,) * self.n_layers, {"default": rotary}, norm=norm)


# ---- Hugging Face names and config ----

HF_NAMES = [  # (zoo prefix, HF prefix); {i} is the layer index
    ("embed.", "model.embed_tokens."),
    ("layers.{i}.attn_post_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),  # q_norm / k_norm included
    ("layers.{i}.mlp_post_norm.", "model.layers.{i}.post_feedforward_layernorm."),
    ("layers.{i}.mlp.", "model.layers.{i}.mlp."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]


def config_from_hf(hf: dict[str, Any]) -> Olmo2Config:
    check_hf_counts(hf, "OLMo 2")
    # transformers' Olmo2Config defaults: rms_norm_eps 1e-5, KV heads = heads, 2,048 positions, RoPE base 10,000
    return Olmo2Config(**shape_from_hf(hf, "OLMo 2", norm_eps=1e-5, max_positions=2048),
                       attention_bias=hf.get("attention_bias", False))


def config_to_hf(cfg: Olmo2Config) -> dict[str, Any]:
    return {**shape_to_hf(cfg, "Olmo2ForCausalLM", "olmo2"), "attention_bias": cfg.attention_bias}


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT has no default LoRA targets for olmo2 (its mapping lacks the model type): q and v, as for Llama
FAMILY = family("olmo2", Olmo2Config, ("olmo2",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
