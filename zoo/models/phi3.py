"""Phi-3 (mini, medium; 4k and 128k context) and Phi-4 over a packed batch (transformers' Phi3ForCausalLM).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama's block with two fused checkpoint tensors, declared in the name table (split on load, joined on export):
`qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up]); an optional sliding window; a rotary that may turn only
the leading `partial_rotary_factor` of each head; and LongRoPE ("longrope", hub configs' "su"), which divides each
frequency by a per-frequency factor, `short_factor` for a sequence up to `original_max_position_embeddings` tokens
and `long_factor` past it, and multiplies cos and sin by an attention factor. transformers decides short or long on
the whole forward (max position + 1); zoo decides per document by its own length, so a pack gets what each document
gets alone. The model is the shared decoder (zoo.models.decoder); this file holds the config, the rotary, the Hugging
Face names and the conversions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import rope_cos_sin
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import Fused, NameTable, as_tuple, family, number, rename_plans
from zoo.models.llama import HF_NAMES as LLAMA_NAMES
from zoo.models.llama import LLAMA_POSITIVE, check_window, shape_from_hf, shape_to_hf

LONGROPE_SPELLINGS = ("longrope", "su", "yarn")  # transformers' Phi3Config reads "su" and "yarn" as longrope


@dataclass(frozen=True)
class Phi3Config:
    """Phi-3's fields; the defaults are transformers' Phi3Config's (the presets hold the published shapes)."""

    family: ClassVar[str] = "phi3"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"sliding_window", "rotary_dim", "original_max_seq_len"}
    dim: int = 3072
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 0  # 0: n_heads (transformers' None)
    head_dim: int = 0  # 0: dim // n_heads (Phi3Config has none; its attention reads one config.json holds)
    ffn_dim: int = 8192
    vocab_size: int = 32064
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or LongRoPE: {"rope_type": "longrope", "short_factor": [...], "long_factor": [...]} and optionally
    # "factor" / "attention_factor" (both read from the sizes below when absent, as transformers does)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rotary_dim: int = 0  # the leading dims of each head the rotary turns (head_dim * partial_rotary_factor); 0: all
    max_seq_len: int = 4096
    original_max_seq_len: int = 4096  # original_max_position_embeddings: past it a document takes long_factor
    tie_embeddings: bool = False
    sliding_window: int | None = None  # every layer's window; None: full attention
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", as_tuple(self.eos_token_ids))
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise ZooError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ZooError(f"the rotary must turn an even number of dims up to head_dim ({self.head_dim}); "
                           f"partial_rotary_factor gives {self.rotary_dim}")
        check_window(self.sliding_window)
        check_longrope(self.rope_scaling, self.rotary_dim)

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, window=self.sliding_window)
        return DecoderSpec((LayerSpec(attn, MLPSpec(self.ffn_dim)),) * self.n_layers, {"default": Phi3Rotary(self)})

    def attention_factor(self) -> float:
        """What LongRoPE multiplies cos and sin by: the config's attention_factor, else sqrt(1 + ln s / ln L0) for
        the scale s = factor (else max positions / original ones) over L0 = the original positions, 1 when s <= 1."""
        s = self.rope_scaling
        if s is None:
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        scale = s.get("factor") or self.max_seq_len / self.original_max_seq_len
        return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(self.original_max_seq_len))


def check_longrope(scaling: dict[str, Any] | None, rotary_dim: int) -> None:
    """None, or a LongRoPE scaling with rotary_dim / 2 finite positive short and long factors."""
    if scaling is None:
        return
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "longrope":
        raise ZooError(f"Phi-3 rope_scaling must be null or {{'rope_type': 'longrope', 'short_factor': [...], "
                       f"'long_factor': [...]}}, got {scaling!r}")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        ok = isinstance(factors, (list, tuple)) and len(factors) == rotary_dim // 2 and all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < math.inf for f in factors)
        if not ok:
            raise ZooError(f"Phi-3 longrope {key} must be {rotary_dim // 2} finite numbers above 0 (rotary dims / 2), "
                           f"got {factors!r}")


class Phi3Rotary:
    """cos/sin per token: plain RoPE over the leading rotary_dim dims, or LongRoPE per document.

    LongRoPE (transformers' `_compute_longrope_parameters`): the frequencies 1 / (factor_i * theta^(2i/R)) with
    `short_factor` while a sequence is at most `original_max_position_embeddings` long and `long_factor` past it; cos
    and sin times the attention factor (in fp32, before the cast). Upstream's length is max(position_ids) + 1 of the
    forward; here it is each token's own document length (`packed.doc_len_per_token()`, the global length under
    sequence parallelism, the length so far plus the new token when generating)."""

    def __init__(self, cfg: Phi3Config) -> None:
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        self.original_max = cfg.original_max_seq_len
        self.scaling = cfg.rope_scaling
        self.attention_factor = cfg.attention_factor()
        self._inv_freq: dict[tuple[torch.device, str], Tensor] = {}

    def inv_freq(self, device: torch.device, which: str) -> Tensor:
        """[R/2] the frequencies, plain ("plain") or divided by the short or long factors, once per device."""
        if (device, which) not in self._inv_freq:
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            if which == "plain":
                inv = 1.0 / (self.theta ** exponent)
            else:
                assert self.scaling is not None
                factors = torch.tensor(self.scaling[f"{which}_factor"], dtype=torch.float32)
                inv = 1.0 / (factors * self.theta ** exponent)
            self._inv_freq[(device, which)] = inv.to(device)
        return self._inv_freq[(device, which)]

    def longest_doc(self, packed: Packed) -> int:
        return max(packed.seqlens()) if packed.doc_len is None else int(packed.doc_len.max())

    def __call__(self, packed: Packed, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        position_ids_T = packed.position_ids
        device = position_ids_T.device
        if self.scaling is None:
            return rope_cos_sin(position_ids_T, self.inv_freq(device, "plain"), dtype)
        inv_freq = self.inv_freq(device, "short")
        # the per-token [T, R/2] table only where a document is long; compiled code builds it always (no host sync)
        if torch.compiler.is_compiling() or self.longest_doc(packed) > self.original_max:
            long_T = packed.doc_len_per_token() > self.original_max
            inv_freq = torch.where(long_T[:, None], self.inv_freq(device, "long"), inv_freq)
        cos_TH, sin_TH = rope_cos_sin(position_ids_T, inv_freq, torch.float32)
        return (cos_TH * self.attention_factor).to(dtype), (sin_TH * self.attention_factor).to(dtype)


# ---- Hugging Face names and config ----

HF_NAMES: NameTable = [  # Llama's names, its attention and MLP projections each fused in the checkpoint
    Fused("model.layers.{i}.self_attn.qkv_proj.", ("layers.{i}.attn.q_proj.", "layers.{i}.attn.k_proj.",
                                                   "layers.{i}.attn.v_proj."), layout="qkv"),
    Fused("model.layers.{i}.mlp.gate_up_proj.", ("layers.{i}.mlp.gate_proj.", "layers.{i}.mlp.up_proj.")),
    *LLAMA_NAMES,
]


def _scaling_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float, int | None]:
    """(rope_theta, LongRoPE scaling or None, partial_rotary_factor, original_max_position_embeddings or None) as
    transformers reads them: rope_parameters (transformers 5) or the hub's rope_scaling and top-level keys."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(key) or {}, dict):
            raise ZooError(f"{key} must be an object or null, got {hf[key]!r}")
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = hf.get("rope_theta", params.pop("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ZooError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    original = params.pop("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return number(theta), None, float(partial), original
    if kind not in LONGROPE_SPELLINGS:
        raise ZooError(f"Phi-3 with a {kind!r} RoPE scaling is not supported (expected longrope, or none)")
    scaling = {"rope_type": "longrope", **{k: list(v) if isinstance(v, (list, tuple)) else v
                                            for k, v in params.items() if v is not None}}
    return number(theta), scaling, float(partial), original


def config_from_hf(hf: dict[str, Any]) -> Phi3Config:
    theta, scaling, partial, original = _scaling_from_hf(hf)
    # transformers' Phi3Config defaults: rms_norm_eps 1e-5, 4,096 positions (original ones too), no window
    shape = shape_from_hf({**hf, "rope_scaling": None, "rope_parameters": None}, "Phi-3", norm_eps=1e-5,
                          max_positions=4096)
    shape.update(rope_theta=theta, rope_scaling=scaling)
    return Phi3Config(**shape, rotary_dim=int(shape["head_dim"] * partial), original_max_seq_len=original or 4096,
                      sliding_window=hf.get("sliding_window"))


def config_to_hf(cfg: Phi3Config) -> dict[str, Any]:
    # ids zoo does not know are written null: transformers' Phi3Config would otherwise fill in Phi-3's (32000)
    out = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
           **shape_to_hf(cfg, "Phi3ForCausalLM", "phi3"), "original_max_position_embeddings": cfg.original_max_seq_len,
           "sliding_window": cfg.sliding_window}
    if cfg.rotary_dim != cfg.head_dim:
        out["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    return out


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT has no default LoRA targets for phi3: the fused qkv_proj (as Microsoft's fine-tuning examples adapt it), so the
# adapter is written in PEFT's layout
FAMILY = family("phi3", Phi3Config, ("phi3",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("qkv_proj",))
