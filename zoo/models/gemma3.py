"""Gemma 3 (text) over a packed batch: Gemma3ForCausalLM, and the language model of Gemma3ForConditionalGeneration.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Every block is a sandwich: an RMSNorm before and after the attention and before and after the GeGLU MLP, each
norm's weight an offset from 1 multiplied in fp32 (as are the per-head q/k norms and the final norm). Layers alternate
local and global attention (`layer_types`; by default five sliding layers then one full): a local layer attends within
`sliding_window` keys and turns q/k with the local RoPE base (10,000), a global one attends in full with its own base
(1,000,000) and, from 4B up, linear scaling (factor 8). The softmax scale is query_pre_attn_scalar ** -0.5 (27B: 168,
not its head dim of 128), and the token embeddings are multiplied by sqrt(dim) rounded to the weights' dtype. The model
is the shared decoder (zoo.models.decoder); this file holds the config, the Hugging Face names and conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, NormSpec, RotaryFn
from zoo.core.layers import Rotary, rope_kind
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import (
    HF_TOKEN_ID_KEYS,
    as_tuple,
    check_hf_counts,
    family,
    number,
    rename_plans,
    token_ids_from_hf,
    token_ids_to_hf,
)
from zoo.models.llama import LLAMA_POSITIVE, finish_config
from zoo.models.qwen2 import FULL, SLIDING, check_windows

PATTERN = 6  # transformers' sliding_window_pattern default: layer i is global when (i + 1) % 6 == 0


def layer_types_of(n_layers: int, pattern: int = PATTERN) -> tuple[str, ...]:
    """Each layer's type as transformers' Gemma3TextConfig derives it from a sliding_window_pattern."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n_layers))


@dataclass(frozen=True)
class Gemma3Config:
    """Defaults are transformers' Gemma3TextConfig's (its 2B-wide default model), token ids aside (not architecture:
    `config_from_hf` fills in transformers' 2/1/0 where a config.json leaves them out)."""

    family: ClassVar[str] = "gemma3"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"rope_local_theta", "sliding_window",
                                                           "query_pre_attn_scalar"}
    dim: int = 2304
    n_layers: int = 26
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 256
    ffn_dim: int = 9216
    vocab_size: int = 262208
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # the global layers' base
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # the global layers' ("linear", factor 8)
    rope_local_theta: float = 10_000.0  # the sliding layers' base (rope_local_base_freq)
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] = ()  # per layer, FULL or SLIDING; (): transformers' pattern of 6
    query_pre_attn_scalar: int = 256  # softmax scale query_pre_attn_scalar ** -0.5
    max_seq_len: int = 131072
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

    def decoder_spec(self) -> DecoderSpec:
        norm = NormSpec(offset=1.0, cast_first=False)  # x * (1 + w), in fp32, cast after

        def layer(kind: str) -> LayerSpec:
            local = kind == SLIDING
            attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                                 o_bias=self.attention_bias, qk_norm="head",
                                 window=self.sliding_window if local else None,
                                 scale=self.query_pre_attn_scalar ** -0.5, rope="local" if local else "global")
            return LayerSpec(attn, MLPSpec(self.ffn_dim, activation="gelu_tanh"), norm, "sandwich")

        rotaries: dict[str, RotaryFn] = {"global": Rotary(self.head_dim, self.rope_theta, self.rope_scaling),
                                         "local": Rotary(self.head_dim, self.rope_local_theta)}
        return DecoderSpec(tuple(layer(t) for t in self.layer_types), rotaries, norm=norm, embed_scale=self.dim ** 0.5)


# ---- Hugging Face config ----

# transformers' Gemma3TextConfig defaults for what a config.json leaves out (the hub's multimodal configs hold only
# their text config's difference from these; a model's own config.json may leave the token ids out)
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
GELU_TANH = "gelu_pytorch_tanh"


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ZooError(f"Gemma 3 with {key}={hf[key]!r} is not supported (expected null: no soft-capping)")
    if hf.get("use_bidirectional_attention"):
        raise ZooError("Gemma 3 with use_bidirectional_attention=true is not supported (expected false: causal)")
    if hf.get("hidden_activation", GELU_TANH) != GELU_TANH:
        raise ZooError(f"Gemma 3 with hidden_activation={hf['hidden_activation']!r} is not supported "
                       f"(expected {GELU_TANH!r})")


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, rope_scaling and rope_local_theta as transformers reads them: from transformers 5's rope_parameters
    (one dict per layer type), else from rope_theta, rope_scaling (the global layers') and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {FULL, SLIDING}:
        raise ZooError(f"Gemma 3's rope_parameters must be keyed by {FULL!r} and {SLIDING!r}, got {params!r}")
    full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    full.update(hf.get("rope_scaling") or {})  # transformers applies rope_scaling to the global layers
    theta = full.pop("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    local_theta = local.pop("rope_theta", hf.get("rope_local_base_freq", HF_DEFAULTS["rope_local_base_freq"]))
    if rope_kind(local) != "default":
        raise ZooError(f"Gemma 3 with a {rope_kind(local)} RoPE scaling on its sliding layers is not supported "
                       "(expected the default RoPE there)")
    kind = rope_kind(full)
    scaling = None if kind == "default" else {"rope_type": kind, **{k: number(v) for k, v in full.items()
                                                                     if k not in ("rope_type", "type")}}
    return {"rope_theta": number(theta), "rope_scaling": scaling, "rope_local_theta": number(local_theta)}


def _layer_types_from_hf(hf: dict[str, Any]) -> tuple[str, ...]:
    if hf.get("layer_types") is not None:
        return as_tuple(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", PATTERN)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ZooError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return layer_types_of(hf["num_hidden_layers"], pattern)


def config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    """A Gemma3ForCausalLM config ("gemma3_text"), or a Gemma3ForConditionalGeneration one ("gemma3"), whose text
    config describes its language model: transformers ties its head by the top-level config, and the top-level token
    ids (with generation_config.json's, which read_config puts there) win over the text config's."""
    if hf.get("model_type") == "gemma3":
        top = hf
        hf = {**(hf.get("text_config") or {}), "tie_word_embeddings": top.get("tie_word_embeddings", True)}
        hf.update({k: top[k] for k in HF_TOKEN_ID_KEYS if top.get(k) is not None})
    _refuse_unsupported(hf)
    check_hf_counts(hf, "Gemma 3")
    hf = {**HF_DEFAULTS, **hf}
    return Gemma3Config(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], norm_eps=hf["rms_norm_eps"], **_rope_from_hf(hf),
        sliding_window=hf["sliding_window"], layer_types=_layer_types_from_hf(hf),
        query_pre_attn_scalar=hf["query_pre_attn_scalar"], max_seq_len=hf["max_position_embeddings"],
        tie_embeddings=hf["tie_word_embeddings"], attention_bias=hf["attention_bias"], **token_ids_from_hf(hf))


def config_to_hf(cfg: Gemma3Config) -> dict[str, Any]:
    """A Gemma3ForCausalLM config.json; a missing token id is written as null (transformers would read 2, 1 or 0)."""
    rope = {FULL: {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
            SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_activation": GELU_TANH,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **token_ids_to_hf(cfg),
    }


# ---- Hugging Face names ----

HF_NAMES = [  # (zoo prefix, HF prefix) of Gemma3ForCausalLM; {i} is the layer index
    ("embed.", "model.embed_tokens."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.attn_post_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),
    ("layers.{i}.mlp_norm.", "model.layers.{i}.pre_feedforward_layernorm."),
    ("layers.{i}.mlp_post_norm.", "model.layers.{i}.post_feedforward_layernorm."),
    ("layers.{i}.mlp.", "model.layers.{i}.mlp."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]

plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# A Gemma3ForConditionalGeneration checkpoint holds the language model under `language_model.model.*` (what
# save_pretrained writes, transformers 4 and 5 alike) or `model.language_model.*` (transformers 5's module names),
# an untied head as `language_model.lm_head.*` or `lm_head.*` (the whole model: zoo.models.gemma3_vision).
MULTIMODAL_LM = ("language_model.model.", "model.language_model.")


def hf_spellings(name: str) -> list[str]:
    """Every spelling of a Gemma3ForCausalLM tensor name in the checkpoints zoo reads, that one first."""
    if name.startswith("model."):
        return [name, *(prefix + name[len("model."):] for prefix in MULTIMODAL_LM)]
    return [name, "language_model." + name]


def hf_tied(cfg: Gemma3Config) -> frozenset[str]:
    """A tied head as a checkpoint may save it, in each spelling (zoo never reads it)."""
    return frozenset(hf_spellings("lm_head.weight")) if cfg.tie_embeddings else frozenset()


# PEFT's default LoRA targets for gemma3_text: q and v
# a Gemma3ForConditionalGeneration checkpoint ("gemma3") is the gemma3_vision family's, which reads its language
# model with config_from_hf and the plans here
FAMILY = family("gemma3", Gemma3Config, ("gemma3_text",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"), hf_spellings=hf_spellings, hf_tied=hf_tied)
