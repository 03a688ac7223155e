"""Gemma 2 over a packed batch: Gemma2ForCausalLM.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Gemma 3's block without its q/k norms: sandwich RMSNorms with weights offset from 1 multiplied in fp32, a GeGLU MLP,
the token embeddings times sqrt(dim) rounded to the weights' dtype, the softmax scale query_pre_attn_scalar ** -0.5
(27B: 144, not its head dim of 128). Layers alternate sliding (even indices, `sliding_window` keys) and full attention
(`layer_types`), all with one RoPE base. Two soft-caps bind: the attention scores, cap * tanh(scores / cap) with
`attn_logit_softcapping` (50) before the mask (zoo.core.score_mods), and the logits with `final_logit_softcapping`
(30) in the forward, the loss and generation (DecoderSpec.final_softcap). The model is the shared decoder
(zoo.models.decoder); this file holds the config, the Hugging Face names and conversions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, NormSpec, RotaryFn
from zoo.core.layers import Rotary, rope_kind
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import (
    as_tuple,
    check_hf_counts,
    family,
    number,
    rename_plans,
    token_ids_from_hf,
    token_ids_to_hf,
)
from zoo.models.gemma3 import GELU_TANH, HF_NAMES
from zoo.models.llama import LLAMA_POSITIVE, finish_config
from zoo.models.qwen2 import FULL, SLIDING, check_windows


def layer_types_of(n_layers: int) -> tuple[str, ...]:
    """transformers' Gemma2Config default: sliding at even layer indices, full at odd ones."""
    return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n_layers))


@dataclass(frozen=True)
class Gemma2Config:
    """Defaults are transformers' Gemma2Config's (the 2B shape), token ids aside (`config_from_hf` fills in
    transformers' 2/1/0 where a config.json leaves them out)."""

    family: ClassVar[str] = "gemma2"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"sliding_window", "query_pre_attn_scalar"}
    dim: int = 2304
    n_layers: int = 26
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 256
    ffn_dim: int = 9216
    vocab_size: int = 256000
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] = ()  # per layer, FULL or SLIDING; (): transformers' alternation
    query_pre_attn_scalar: int = 256
    attn_softcap: float | None = 50.0  # attn_logit_softcapping
    final_softcap: float | None = 30.0  # final_logit_softcapping
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    attention_bias: bool = False  # on q, k, v and o
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_config(self)
        layer_types = as_tuple(self.layer_types)
        object.__setattr__(self, "layer_types", layer_types or layer_types_of(self.n_layers))
        check_windows(self)
        for name in ("attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ZooError(f"Gemma 2's {name} must be a positive number or None (no capping), got {value!r}")

    def decoder_spec(self) -> DecoderSpec:
        norm = NormSpec(offset=1.0, cast_first=False)  # x * (1 + w), in fp32, cast after

        def layer(kind: str) -> LayerSpec:
            attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                                 o_bias=self.attention_bias, window=self.sliding_window if kind == SLIDING else None,
                                 scale=self.query_pre_attn_scalar ** -0.5, softcap=self.attn_softcap)
            return LayerSpec(attn, MLPSpec(self.ffn_dim, activation="gelu_tanh"), norm, "sandwich")

        rotaries: dict[str, RotaryFn] = {"default": Rotary(self.head_dim, self.rope_theta, self.rope_scaling)}
        return DecoderSpec(tuple(layer(t) for t in self.layer_types), rotaries, norm=norm,
                           embed_scale=self.dim ** 0.5, final_softcap=self.final_softcap)


# ---- Hugging Face config ----

# transformers' Gemma2Config defaults for what a config.json leaves out
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 10_000.0, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    if hf.get("use_bidirectional_attention"):
        raise ZooError("Gemma 2 with use_bidirectional_attention=true is not supported (expected false: causal)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH
    if act not in (GELU_TANH, "gelu_tanh"):
        raise ZooError(f"Gemma 2 with hidden_activation={act!r} is not supported (expected {GELU_TANH!r})")


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers 5's rope_parameters, else from rope_theta and rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    kind = rope_kind(params)
    scaling = None if kind == "default" else {"rope_type": kind, **{k: number(v) for k, v in params.items()
                                                                     if k not in ("rope_type", "type")}}
    return {"rope_theta": number(theta), "rope_scaling": scaling}


def config_from_hf(hf: dict[str, Any]) -> Gemma2Config:
    """A Gemma2ForCausalLM config.json; `layer_types` where it has them, else transformers' alternation."""
    _refuse_unsupported(hf)
    check_hf_counts(hf, "Gemma 2")
    hf = {**HF_DEFAULTS, **hf}
    layer_types = as_tuple(hf["layer_types"]) if hf.get("layer_types") is not None else ()
    return Gemma2Config(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], norm_eps=hf["rms_norm_eps"], **_rope_from_hf(hf),
        sliding_window=hf["sliding_window"], layer_types=layer_types,
        query_pre_attn_scalar=hf["query_pre_attn_scalar"],
        attn_softcap=None if hf["attn_logit_softcapping"] is None else number(hf["attn_logit_softcapping"]),
        final_softcap=None if hf["final_logit_softcapping"] is None else number(hf["final_logit_softcapping"]),
        max_seq_len=hf["max_position_embeddings"], tie_embeddings=hf["tie_word_embeddings"],
        attention_bias=hf["attention_bias"], **token_ids_from_hf(hf))


def config_to_hf(cfg: Gemma2Config) -> dict[str, Any]:
    """A Gemma2ForCausalLM config.json; a missing token id is written as null (transformers would read 2, 1 or 0)."""
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.final_softcap,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_activation": GELU_TANH,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **token_ids_to_hf(cfg),
    }


# ---- Hugging Face names: Gemma 3's (the same four norms around the same modules; Gemma 2 has no q/k norms) ----

plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT's default LoRA targets for gemma2: q and v
FAMILY = family("gemma2", Gemma2Config, ("gemma2",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
