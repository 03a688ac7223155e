"""Qwen3 (dense) over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Qwen2's decoder without the q/k/v bias (`attention_bias`, off in every published checkpoint, covers q, k, v and o),
with an RMSNorm over each q and k head before the rotary and an explicit head dim (128, not dim / heads: Qwen3-0.6B
has 16 heads of 128 on a width of 1,024). Sliding windows as Qwen2's. The model is the shared decoder
(zoo.models.decoder); the tensor names are Llama's, plus `self_attn.q_norm` / `k_norm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import MRotary, Rotary
from zoo.models.decoder import Decoder
from zoo.models.family import family, rename_plans
from zoo.models.llama import HF_NAMES, LLAMA_POSITIVE, finish_config, shape_from_hf, shape_to_hf
from zoo.models.qwen2 import check_windows, window_from_hf, window_to_hf, windows


@dataclass(frozen=True)
class Qwen3Config:
    family: ClassVar[str] = "qwen3"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"sliding_window"}
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 12288
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Qwen3-VL's language model: interleaved M-RoPE over these (temporal, height, width) sections of the frequencies
    # (zoo.core.layers.MRotary); () is plain RoPE
    mrope_section: tuple[int, ...] = ()
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_config(self)
        check_windows(self)
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))

    def decoder_spec(self) -> DecoderSpec:
        layers = tuple(LayerSpec(AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim,
                                               qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                                               qk_norm="head", window=w), MLPSpec(self.ffn_dim))
                       for w in windows(self))
        rotary = MRotary(self.head_dim, self.rope_theta, self.mrope_section, interleaved=True) if self.mrope_section \
            else Rotary(self.head_dim, self.rope_theta, self.rope_scaling)
        return DecoderSpec(layers, {"default": rotary})


def config_from_hf(hf: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(**shape_from_hf(hf, "Qwen3", norm_eps=1e-6, kv_heads=32, head_dim=128, max_positions=32768),
                       attention_bias=hf.get("attention_bias", False), **window_from_hf(hf))


def config_to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    return {**shape_to_hf(cfg, "Qwen3ForCausalLM", "qwen3"), "attention_bias": cfg.attention_bias, **window_to_hf(cfg)}


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)  # self_attn.q_norm / k_norm ride on Llama's attention prefix

# PEFT's default LoRA targets for Qwen3: q and v
FAMILY = family("qwen3", Qwen3Config, ("qwen3",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
