"""Qwen3.5 (text) over a packed batch: Qwen3_5ForCausalLM, and the language model of Qwen3_5ForConditionalGeneration.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
A hybrid: of every `full_attention_interval` (4) layers the last is gated softmax attention and the others are Gated
DeltaNet (zoo.core.deltanet), by `layer_types`. The attention layers are Qwen3's with three changes: q_proj yields
each head's query and a gate, and sigmoid(gate) multiplies the attention output before o_proj; the q/k norms, like
every norm of the model but the DeltaNet's gated one, are (1 + w) multiplied in fp32; and the rotary turns only the
first `partial_rotary_factor` (a quarter) of each head. transformers computes that rotary as M-RoPE (temporal,
height and width sections of the frequencies); for text the three position axes are the same token position, so it
is plain RoPE over the rotated part, which is what zoo runs. The model is the shared decoder (zoo.models.decoder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from zoo.core.contract import AttentionSpec, DecoderSpec, GatedDeltaNetSpec, LayerSpec, MLPSpec, MoESpec, NormSpec
from zoo.core.layers import MRotary, Rotary
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import (
    HF_TOKEN_ID_KEYS,
    Plan,
    as_tuple,
    check_hf_counts,
    family,
    number,
    rename,
    token_ids_from_hf,
    token_ids_to_hf,
)
from zoo.models.llama import LLAMA_POSITIVE, check_silu, finish_shape

FULL, LINEAR = "full_attention", "linear_attention"
INTERVAL = 4  # transformers' full_attention_interval default: layer i is full attention when (i + 1) % 4 == 0


def layer_types_of(n_layers: int, interval: int = INTERVAL) -> tuple[str, ...]:
    """Each layer's type as transformers' Qwen3_5TextConfig derives it from full_attention_interval."""
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layers))


@dataclass(frozen=True)
class Qwen3_5Config:
    """Defaults are transformers' Qwen3_5TextConfig's (a 32-layer, 4096-wide model), token ids aside."""

    family: ClassVar[str] = "qwen3_5"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {
        "rotary_dim", "linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel"}
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 256
    ffn_dim: int = 12288
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int = 64  # the leading dims of each head the rotary turns: head_dim * partial_rotary_factor
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    attention_bias: bool = False  # on q, k, v and o
    layer_types: tuple[str, ...] = ()  # per layer, FULL or LINEAR; (): transformers' interval of 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    # the multimodal model's (zoo.models.qwen3_5_vl): interleaved M-RoPE over these sections of the rotated
    # frequencies; () is plain RoPE over the rotated part, what text gives
    mrope_section: tuple[int, ...] = ()
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_shape(self)
        finish_hybrid(self)

    def decoder_spec(self) -> DecoderSpec:
        return hybrid_spec(self, MLPSpec(self.ffn_dim))


# ---- what Qwen3.5 and Qwen3.5-MoE share: the layer types, their checks, the mixers ----


def finish_hybrid(cfg: Any) -> None:
    """A Qwen3.5 config (dense or MoE) after its family's own finishing: layer_types from transformers' interval
    where none are given, then the hybrid's checks. Sizes of the wrong type or below 1 are left to check_config,
    which names the field and what came."""
    layer_types = as_tuple(cfg.layer_types)
    object.__setattr__(cfg, "layer_types", layer_types or layer_types_of(cfg.n_layers))
    if hasattr(cfg, "mrope_section"):  # Qwen3.5's (Qwen3-Next has none)
        object.__setattr__(cfg, "mrope_section", tuple(cfg.mrope_section))
    if len(cfg.layer_types) != cfg.n_layers or set(cfg.layer_types) - {FULL, LINEAR}:
        raise ZooError(f"layer_types must give each of the {cfg.n_layers} layers {FULL!r} or {LINEAR!r}, "
                       f"got {list(cfg.layer_types)!r}")
    sizes = (cfg.rotary_dim, cfg.head_dim, cfg.linear_key_heads, cfg.linear_value_heads)
    if not all(isinstance(n, int) and n > 0 for n in sizes):
        return
    if cfg.rotary_dim > cfg.head_dim or cfg.rotary_dim % 2:
        raise ZooError(f"the rotary must turn an even number of dims up to head_dim ({cfg.head_dim}); "
                       f"partial_rotary_factor gives {cfg.rotary_dim}")
    if cfg.linear_value_heads % cfg.linear_key_heads:
        raise ZooError(f"linear_num_value_heads ({cfg.linear_value_heads}) must be a multiple of "
                       f"linear_num_key_heads ({cfg.linear_key_heads})")


def hybrid_spec(cfg: Any, mlp: MLPSpec | MoESpec) -> DecoderSpec:
    """Gated attention where layer_types says full, Gated DeltaNet elsewhere, each over `mlp` (a gated MLP or an
    MoE block), (1 + w) norms in fp32 and a partial rotary."""
    norm = NormSpec(offset=1.0, cast_first=False)  # x * (1 + w), in fp32, cast after
    attn = AttentionSpec(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, qkv_bias=cfg.attention_bias,
                         o_bias=cfg.attention_bias, qk_norm="head", output_gate=True)
    delta = GatedDeltaNetSpec(cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, cfg.linear_conv_kernel)
    layers = tuple(LayerSpec(attn if kind == FULL else delta, mlp, norm) for kind in cfg.layer_types)
    section = getattr(cfg, "mrope_section", ())
    rotary = MRotary(cfg.rotary_dim, cfg.rope_theta, section, interleaved=True) if section \
        else Rotary(cfg.rotary_dim, cfg.rope_theta)
    return DecoderSpec(layers, {"default": rotary}, norm=norm)


# ---- Hugging Face config ----

PARTIAL_ROTARY = 0.25  # transformers' default partial_rotary_factor


def _rope_from_hf(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """rope_theta and rotary_dim as transformers reads them: rope_parameters first, then the top-level keys."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ZooError(f"rope_parameters must be an object such as {{'rope_theta': 10000000, "
                       f"'partial_rotary_factor': 0.25}} or null, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" or hf.get("rope_scaling"):
        raise ZooError(f"Qwen3.5 with a {kind!r} RoPE scaling is not supported (expected the default RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ZooError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    return {"rope_theta": number(theta), "rotary_dim": int(head_dim * factor)}


def _layer_types_from_hf(hf: dict[str, Any]) -> tuple[str, ...]:
    if hf.get("layer_types") is not None:
        return as_tuple(hf["layer_types"])
    interval = hf.get("full_attention_interval", INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ZooError(f"full_attention_interval must be a positive integer, got {interval!r}")
    return layer_types_of(hf["num_hidden_layers"], interval)


def text_config_of(hf: dict[str, Any], multimodal_type: str) -> dict[str, Any]:
    """The text config of a multimodal config.json (model_type `multimodal_type`), else `hf` itself: transformers
    ties the head by the top-level config, and the top-level token ids win over the text config's."""
    if hf.get("model_type") != multimodal_type:
        return hf
    text = {**(hf.get("text_config") or {}), "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
    text.update({k: hf[k] for k in HF_TOKEN_ID_KEYS if hf.get(k) is not None})
    return text


def hybrid_fields_from_hf(hf: dict[str, Any], what: str) -> dict[str, Any]:
    """The config fields of a Qwen3.5 text config.json that its dense and MoE variants share: all but the MLP's."""
    check_silu(hf, what)
    check_hf_counts(hf, what)
    if hf.get("attn_output_gate", True) is not True:
        raise ZooError(f"{what} with attn_output_gate={hf['attn_output_gate']!r} is not supported (expected true)")
    head_dim = hf.get("head_dim", 256)
    return dict(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads", 4), head_dim=head_dim,
        vocab_size=hf.get("vocab_size", 248320), norm_eps=hf.get("rms_norm_eps", 1e-6), **_rope_from_hf(hf, head_dim),
        max_seq_len=hf.get("max_position_embeddings", 32768), tie_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False), layer_types=_layer_types_from_hf(hf),
        linear_key_heads=hf.get("linear_num_key_heads", 16), linear_value_heads=hf.get("linear_num_value_heads", 32),
        linear_key_head_dim=hf.get("linear_key_head_dim", 128),
        linear_value_head_dim=hf.get("linear_value_head_dim", 128),
        linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4), **token_ids_from_hf(hf))


def config_from_hf(hf: dict[str, Any]) -> Qwen3_5Config:
    """A Qwen3_5ForCausalLM config ("qwen3_5_text"), or a Qwen3_5ForConditionalGeneration one ("qwen3_5"), whose
    text config describes its language model."""
    hf = text_config_of(hf, "qwen3_5")
    return Qwen3_5Config(**hybrid_fields_from_hf(hf, "Qwen3.5"), ffn_dim=hf["intermediate_size"])


def hybrid_fields_to_hf(cfg: Any) -> dict[str, Any]:
    """The config.json keys of a Qwen3.5 dense or MoE config that both share: all but the MLP's and the class's."""
    return {
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "layer_types": list(cfg.layer_types),
        "linear_num_key_heads": cfg.linear_key_heads,
        "linear_num_value_heads": cfg.linear_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "hidden_act": "silu",
        **token_ids_to_hf(cfg),
    }


def config_to_hf(cfg: Qwen3_5Config) -> dict[str, Any]:
    """A Qwen3_5ForCausalLM config.json."""
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **hybrid_fields_to_hf(cfg),
            "intermediate_size": cfg.ffn_dim}


# ---- Hugging Face names ----

HF_NAMES = [  # (zoo prefix, HF prefix) of Qwen3_5ForCausalLM; {i} is the layer index; {mixer} its type's module
    ("embed.", "model.embed_tokens."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.attn.decay.", "model.layers.{i}.linear_attn."),  # A_log, dt_bias sit on the layer in transformers
    ("layers.{i}.attn.", "model.layers.{i}.{mixer}."),
    ("layers.{i}.mlp_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.mlp.", "model.layers.{i}.mlp."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]
MIXER_MODULES = {FULL: "self_attn", LINEAR: "linear_attn"}
_LAYER = re.compile(r"layers\.(\d+)\.")


class Hybrid(Protocol):
    """What the Hugging Face names read of a Qwen3.5 config, dense or MoE."""

    @property
    def layer_types(self) -> tuple[str, ...]: ...


def hf_name(cfg: Hybrid, zoo_name: str) -> str:
    """The Hugging Face name of a zoo tensor: a layer's mixer is `self_attn` or `linear_attn` by its type."""
    m = _LAYER.match(zoo_name)
    mixer = MIXER_MODULES[cfg.layer_types[int(m[1])]] if m else ""
    return rename(zoo_name, HF_NAMES).replace("{mixer}", mixer)


def plan_from_hf(cfg: Qwen3_5Config, zoo_names: list[str]) -> Plan:
    return {z: ((hf_name(cfg, z),), None) for z in zoo_names}


def plan_to_hf(cfg: Qwen3_5Config, zoo_names: list[str]) -> Plan:
    return {hf_name(cfg, z): ((z,), None) for z in zoo_names}


# A Qwen3_5ForConditionalGeneration checkpoint (every published Qwen3.5) holds the language model under
# `model.language_model.*` and its head as `lm_head.*`; beside it the vision tower (`model.visual.*`) and the
# multi-token-prediction head (`mtp.*`), which zoo leaves out (transformers' Qwen3_5ForCausalLM ignores them too).
MULTIMODAL_LM = "model.language_model."
LEFT_OUT = ("model.visual.", "mtp.")


def hf_spellings(name: str) -> list[str]:
    """Every spelling of a Qwen3_5ForCausalLM tensor name in the checkpoints zoo reads, that one first."""
    if name.startswith("model."):
        return [name, MULTIMODAL_LM + name[len("model."):]]
    return [name]


# PEFT has no default LoRA targets for qwen3_5 (peft.utils.constants; Qwen3's are q_proj, v_proj). zoo's `auto`
# takes those of the attention layers and, so that the three Gated DeltaNet layers of every four are adapted too,
# their q/k/v projection in_proj_qkv (one tensor upstream as in zoo: PEFT addresses it by that name)
FAMILY = family("qwen3_5", Qwen3_5Config, ("qwen3_5_text",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj", "in_proj_qkv"), hf_spellings=hf_spellings, hf_left_out=LEFT_OUT,
                left_out_why="qwen3_5: reading the language model of a Qwen3_5ForConditionalGeneration checkpoint; "
                             "its vision tower (model.visual.*) and multi-token-prediction head (mtp.*) are left out")
