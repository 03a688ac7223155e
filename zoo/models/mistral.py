"""Mistral over a packed batch: Mistral-7B v0.1 / v0.3, Mistral-Nemo.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama's block (no biases) where every layer attends within a sliding window when the config has one (v0.1: 4,096
tokens; v0.3 and Nemo: none), and an explicit head dim (Nemo: 32 heads of 128 on a width of 5,120). transformers'
MistralConfig defaults `sliding_window` to 4,096 when a config.json leaves it out; so does zoo. The model is the
shared decoder (zoo.models.decoder); the tensor names are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import Rotary
from zoo.models.decoder import Decoder
from zoo.models.family import family, rename_plans
from zoo.models.llama import HF_NAMES, LLAMA_POSITIVE, check_window, finish_config, shape_from_hf, shape_to_hf


@dataclass(frozen=True)
class MistralConfig:
    family: ClassVar[str] = "mistral"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"sliding_window"}
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 14336
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    sliding_window: int | None = 4096  # every layer's window; None: full attention
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_config(self)
        check_window(self.sliding_window)

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, window=self.sliding_window)
        return DecoderSpec((LayerSpec(attn, MLPSpec(self.ffn_dim)),) * self.n_layers,
                           {"default": Rotary(self.head_dim, self.rope_theta, self.rope_scaling)})


def config_from_hf(hf: dict[str, Any]) -> MistralConfig:
    return MistralConfig(**shape_from_hf(hf, "Mistral", norm_eps=1e-6, kv_heads=8, max_positions=4096 * 32),
                         sliding_window=hf.get("sliding_window", 4096))  # transformers' MistralConfig default


def config_to_hf(cfg: MistralConfig) -> dict[str, Any]:
    return {**shape_to_hf(cfg, "MistralForCausalLM", "mistral"), "sliding_window": cfg.sliding_window}


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT's default LoRA targets for Mistral: q and v
FAMILY = family("mistral", MistralConfig, ("mistral",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
