"""Llama 2 / 3 / 3.1 / 3.2 over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama-2 is MHA with theta 1e4; Llama-3 adds GQA and theta 5e5; 3.1 the "llama3" RoPE scaling; 3.2 ties the
output head to the embedding. The model is the shared decoder (zoo.models.decoder); this file holds Llama's config,
its Hugging Face names and the config conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from zoo.core.contract import AttentionSpec, DecoderSpec, HasTokenIds, LayerSpec, MLPSpec
from zoo.core.layers import Rotary, rope_kind
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import as_tuple, family, number, rename_plans, token_ids_from_hf, token_ids_to_hf

# what a Llama-shaped config (Llama, Qwen2, Qwen3, Mistral) must have above 0; the families with a window add it
LLAMA_POSITIVE = frozenset({"dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                            "max_seq_len", "norm_eps", "rope_theta"})


@dataclass(frozen=True)
class LlamaConfig:
    family: ClassVar[str] = "llama"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 11008
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_scaling dict ("llama3"), or None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # on q, k, v and o (transformers' Llama)
    mlp_bias: bool = False
    # the checkpoint's special-token ids (eos: where generation stops); not architecture, so not compared
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_config(self)

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                             o_bias=self.attention_bias)
        layer = LayerSpec(attn, MLPSpec(self.ffn_dim, bias=self.mlp_bias))
        return DecoderSpec((layer,) * self.n_layers, {"default": Rotary(self.head_dim, self.rope_theta,
                                                                        self.rope_scaling)})


Llama = Decoder  # a Llama is the shared decoder built from a LlamaConfig


class Shaped(Protocol):
    """A config's head and KV sizes and eos ids: what `finish_shape` reads (every Llama-like config, Qwen3.5's)."""

    @property
    def dim(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class LlamaLike(Shaped, Protocol):
    """A config with Llama's fields (Llama, Qwen2, Qwen3, Mistral): what `finish_config` reads."""

    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...


def finish_shape(cfg: Shaped) -> None:
    """The derived fields and checks of a config's shape, in its __post_init__: eos ids a tuple (config.json has a
    list), head_dim from dim / heads when 0, whole query heads per KV head."""
    object.__setattr__(cfg, "eos_token_ids", as_tuple(cfg.eos_token_ids))
    if cfg.head_dim == 0:
        object.__setattr__(cfg, "head_dim", cfg.dim // cfg.n_heads)
    if cfg.n_heads % cfg.n_kv_heads:
        raise ZooError(f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})")


def finish_config(cfg: LlamaLike) -> None:
    """finish_shape, and a RoPE scaling zoo knows (an unsupported one fails with the config, not when the model is
    built)."""
    finish_shape(cfg)
    rope_kind(cfg.rope_scaling)


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ZooError(f"sliding_window must be a positive number of tokens or None, got {window!r}")


# ---- Hugging Face names and config ----

HF_NAMES = [  # (zoo prefix, HF prefix); {i} is the layer index
    ("embed.", "model.embed_tokens."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),
    ("layers.{i}.mlp_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.mlp.", "model.layers.{i}.mlp."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]


def check_silu(hf: dict[str, Any], what: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ZooError(f"{what} with hidden_act={hf['hidden_act']!r} is not supported (expected 'silu')")


def rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) of a Hugging Face config: transformers 5 writes both into one
    rope_parameters dict, hub configs keep them apart."""
    for key in ("rope_parameters", "rope_scaling"):  # a list or string would fail below with an AttributeError
        if not isinstance(hf.get(key) or {}, dict):
            raise ZooError(f"{key} must be an object such as {{'rope_type': 'linear', 'factor': 2.0}} or null, "
                           f"got {hf[key]!r}")
    rope = dict(hf.get("rope_parameters") or {})
    nested_theta: float = rope.pop("rope_theta", default_theta)  # popped either way: what stays is the scaling
    theta = hf.get("rope_theta", nested_theta)
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return number(theta), dict(scaling) if isinstance(scaling, dict) and scaling else scaling or None


def shape_from_hf(hf: dict[str, Any], what: str, *, norm_eps: float, kv_heads: int | None = None,
                  head_dim: int | None = None, max_positions: int = 4096) -> dict[str, Any]:
    """The config fields Llama, Qwen2, Qwen3 and Mistral read alike from a Hugging Face config; the keywords are the
    defaults transformers' config class of the family takes where config.json leaves a key out (norm_eps: its
    rms_norm_eps, which differs between families; KV heads: None means as many as query heads; head_dim: None means
    dim / heads)."""
    check_silu(hf, what)
    theta, scaling = rope_from_hf(hf)
    n_heads = hf["num_attention_heads"]
    return dict(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", kv_heads) or n_heads,
        head_dim=hf.get("head_dim", head_dim) or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        norm_eps=hf.get("rms_norm_eps", norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=hf.get("max_position_embeddings", max_positions),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        **token_ids_from_hf(hf),
    )


class LlamaShape(LlamaLike, HasTokenIds, Protocol):
    """What `shape_to_hf` writes."""

    @property
    def n_layers(self) -> int: ...

    @property
    def ffn_dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def norm_eps(self) -> float: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def tie_embeddings(self) -> bool: ...


def shape_to_hf(cfg: LlamaShape, architecture: str, model_type: str) -> dict[str, Any]:
    """The inverse of shape_from_hf, with the family's architectures and model_type as transformers writes them."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        **token_ids_to_hf(cfg),
    }


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(**shape_from_hf(hf, "Llama", norm_eps=1e-6), attention_bias=hf.get("attention_bias", False),
                       mlp_bias=hf.get("mlp_bias", False))


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    return {**shape_to_hf(cfg, "LlamaForCausalLM", "llama"), "attention_bias": cfg.attention_bias,
            "mlp_bias": cfg.mlp_bias}


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT's default LoRA targets for Llama: q and v
FAMILY = family("llama", LlamaConfig, ("llama",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
