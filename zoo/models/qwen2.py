"""Qwen2 / Qwen2.5 over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama's block with a bias on q, k and v (never on o, hard-wired upstream), theta 1e6, and the head tied to the
embedding on the small models. With `use_sliding_window` the layers from `max_window_layers` on (or those
`layer_types` names "sliding_attention") attend within a window; the published Qwen2.5 checkpoints leave it off.
The model is the shared decoder (zoo.models.decoder); the tensor names are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import MRotary, Rotary
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import family, rename_plans
from zoo.models.llama import HF_NAMES, LLAMA_POSITIVE, check_window, finish_config, shape_from_hf, shape_to_hf

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types


@dataclass(frozen=True)
class Qwen2Config:
    family: ClassVar[str] = "qwen2"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"sliding_window"}
    dim: int = 3584
    n_layers: int = 28
    n_heads: int = 28
    n_kv_heads: int = 4
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 18944
    vocab_size: int = 152064
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    sliding_window: int | None = None  # None: every layer attends in full (use_sliding_window false)
    layer_types: tuple[str, ...] = ()  # per layer, FULL or SLIDING; () with a window: every layer slides
    # M-RoPE (Qwen2.5-VL's language model): the split of the rotary frequencies into (temporal, height, width)
    # sections, zoo.core.layers.MRotary; () is plain RoPE
    mrope_section: tuple[int, ...] = ()
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_config(self)
        check_windows(self)
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.mrope_section and self.rope_scaling:
            raise ZooError(f"M-RoPE (mrope_section) takes no further rope scaling, got {self.rope_scaling}")

    def decoder_spec(self) -> DecoderSpec:
        layers = tuple(LayerSpec(AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=True, window=w),
                                 MLPSpec(self.ffn_dim)) for w in windows(self))
        rotary = MRotary(self.head_dim, self.rope_theta, self.mrope_section) if self.mrope_section else \
            Rotary(self.head_dim, self.rope_theta, self.rope_scaling)
        return DecoderSpec(layers, {"default": rotary})


class Windowed(Protocol):
    """A config with Qwen's per-layer windows (Qwen2, Qwen3)."""

    @property
    def n_layers(self) -> int: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def layer_types(self) -> tuple[str, ...]: ...


def check_windows(cfg: Windowed) -> None:
    """The window a positive int or None; layer_types (a tuple, config.json has a list) one known type a layer."""
    object.__setattr__(cfg, "layer_types", tuple(cfg.layer_types))
    check_window(cfg.sliding_window)
    if cfg.layer_types and (len(cfg.layer_types) != cfg.n_layers or set(cfg.layer_types) - {FULL, SLIDING}):
        raise ZooError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of the {cfg.n_layers} layers, "
                       f"got {list(cfg.layer_types)}")


def windows(cfg: Windowed) -> list[int | None]:
    """Each layer's sliding window (None: full attention)."""
    types = cfg.layer_types or (SLIDING,) * cfg.n_layers
    return [cfg.sliding_window if t == SLIDING else None for t in types]


def window_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as transformers' Qwen2/Qwen3 configs decide them: a window only with
    use_sliding_window, on the layers layer_types names, else those from max_window_layers on."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if window is None:
        return {"sliding_window": None, "layer_types": ()}
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if i >= hf.get("max_window_layers", 28) else FULL for i in range(n)]
    return {"sliding_window": window, "layer_types": tuple(types)}


def window_to_hf(cfg: Windowed) -> dict[str, Any]:
    sliding = [i for i, w in enumerate(windows(cfg)) if w is not None]
    return {
        "use_sliding_window": bool(sliding),
        "sliding_window": cfg.sliding_window if sliding else None,
        "max_window_layers": sliding[0] if sliding else cfg.n_layers,
        "layer_types": [SLIDING if i in sliding else FULL for i in range(cfg.n_layers)],
    }


def config_from_hf(hf: dict[str, Any]) -> Qwen2Config:
    return Qwen2Config(**shape_from_hf(hf, "Qwen2", norm_eps=1e-6, kv_heads=32, max_positions=32768),
                       **window_from_hf(hf))


def config_to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    return {**shape_to_hf(cfg, "Qwen2ForCausalLM", "qwen2"), **window_to_hf(cfg)}


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT's default LoRA targets for Qwen2: q and v
FAMILY = family("qwen2", Qwen2Config, ("qwen2",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
