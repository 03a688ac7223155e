"""OpenELM over a packed batch: layer-wise scaling of heads and FFN widths.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab. N, K and F differ from layer to layer.
The model is the shared decoder (zoo.models.decoder): pre-norm attention + SwiGLU, here with RMSNorm over each q
and k head before the rotary, the rotary applied in fp32, every norm at eps 1e-6, and the output head shared with
the token embedding. The per-layer counts are derived from the HF config's multipliers exactly as upstream's
OpenELMConfig derives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import Rotary
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import (
    Fused,
    NameTable,
    as_tuple,
    family,
    number,
    rename_plans,
    token_ids_from_hf,
    token_ids_to_hf,
)

# ---- layer-wise scaling, as upstream's OpenELMConfig computes it ----


def make_divisible(v: float, divisor: int) -> int:
    """Round v to a multiple of divisor (at least divisor), never going more than 10% below v."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def per_layer_multipliers(multipliers: tuple[float, ...], n_layers: int) -> tuple[float, ...]:
    """One value per layer: a single value repeated, or (first, last) spread linearly and rounded to 2 decimals.

    Reproduces `[round(v, 2) for v in np.linspace(a, b, n)]` bit for bit without numpy: linspace computes
    i * step + a (the last point set to b), and numpy's round(v, 2) is rint(v * 100) / 100.
    """
    if len(multipliers) == 1:
        return tuple(multipliers) * n_layers
    if len(multipliers) == 2:  # upstream checks this before the per-layer case, also when n_layers == 2
        a, b = multipliers
        step = (b - a) / (n_layers - 1) if n_layers > 1 else 0.0
        points = [i * step + a for i in range(n_layers)]
        if n_layers > 1:
            points[-1] = b
        return tuple(round(p * 100.0) / 100.0 for p in points)
    if len(multipliers) == n_layers:
        return tuple(multipliers)
    raise ZooError(f"expected one multiplier, (first, last), or one per layer ({n_layers}); got {multipliers}")


@dataclass(frozen=True)
class OpenELMConfig:
    family: ClassVar[str] = "openelm"
    positive: ClassVar[frozenset[str]] = frozenset({
        "dim", "n_layers", "head_dim", "vocab_size", "qkv_multipliers", "num_gqa_groups", "ffn_multipliers",
        "ffn_dim_divisor", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "rope_theta", "rope_max_length",
        "max_context_length"})
    dim: int = 1280
    n_layers: int = 16
    head_dim: int = 64
    vocab_size: int = 32000
    # layer-wise scaling as in the HF config; empty qkv/ffn multipliers mean "n_heads etc. given directly"
    qkv_multipliers: tuple[float, ...] = (0.5, 1.0)  # one value or (first layer, last layer)
    num_gqa_groups: int = 4  # query heads per KV head
    ffn_multipliers: tuple[float, ...] = (0.5, 4.0)  # one value, (first, last) or one per layer; stored per layer
    ffn_dim_divisor: int = 256
    # per layer, derived from the above in __post_init__ (given ones are checked against the derivation)
    n_heads: tuple[int, ...] = ()
    n_kv_heads: tuple[int, ...] = ()
    ffn_dim: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # rope_freq_constant
    rope_max_length: int = 4096  # upstream's initial cos/sin cache; longer documents extend it (same values)
    max_context_length: int = 2048  # upstream's initial causal-mask size; no limit here (docs/families.md)
    qk_norm: bool = True  # normalize_qk_projections
    tie_embeddings: bool = True  # share_input_output_layers
    # the checkpoint's special-token ids (eos: where generation stops); not architecture, so not compared
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("eos_token_ids", as_tuple(self.eos_token_ids))  # a JSON list in config.json

        for name in ("qkv_multipliers", "ffn_multipliers"):
            value = getattr(self, name)
            put(name, tuple(float(v) for v in (value if isinstance(value, (list, tuple)) else [value])))
        for name in ("n_heads", "n_kv_heads", "ffn_dim"):
            put(name, tuple(int(v) for v in getattr(self, name)))
        # the derivation below divides by these and rounds dim * multiplier: a 0 or 1e308 must be named, not raise
        # ZeroDivisionError or OverflowError
        for name in ("dim", "n_layers", "head_dim", "num_gqa_groups", "ffn_dim_divisor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ZooError(f"OpenELM {name} must be a positive integer, got {value!r}")
        for name in ("qkv_multipliers", "ffn_multipliers"):
            if not all(0 < m and math.isfinite(m * self.dim) for m in getattr(self, name)):
                raise ZooError(f"OpenELM {name} must be finite numbers above 0, got {list(getattr(self, name))}")
        L = self.n_layers
        derived: dict[str, tuple[int, ...]] = {}
        if self.qkv_multipliers:
            if len(self.qkv_multipliers) not in (1, 2):
                raise ZooError(f"qkv_multipliers must be one value or (first, last), got {self.qkv_multipliers}")
            # upstream: q dims rounded to multiples of head_dim * num_gqa_groups, so every layer's KV heads divide
            q_dims = [make_divisible(self.dim * m, self.head_dim * self.num_gqa_groups)
                      for m in per_layer_multipliers(self.qkv_multipliers, L)]
            derived["n_heads"] = tuple(q // self.head_dim for q in q_dims)
            derived["n_kv_heads"] = tuple(q // self.head_dim // self.num_gqa_groups for q in q_dims)
        if self.ffn_multipliers:
            put("ffn_multipliers", per_layer_multipliers(self.ffn_multipliers, L))
            derived["ffn_dim"] = tuple(make_divisible(m * self.dim, self.ffn_dim_divisor)
                                       for m in self.ffn_multipliers)
        for name in ("n_heads", "n_kv_heads", "ffn_dim"):
            given = getattr(self, name)
            if name in derived and given and given != derived[name]:
                raise ZooError(f"OpenELM {name}={list(given)} disagrees with what the multipliers derive "
                                 f"({list(derived[name])}); give one or the other")
            if not given:
                if name not in derived:
                    raise ZooError(f"OpenELM needs {name} per layer, or the multipliers to derive it from")
                put(name, derived[name])
            if len(getattr(self, name)) != L:
                raise ZooError(f"{name} has {len(getattr(self, name))} entries for {L} layers")
        for i, (n, k) in enumerate(zip(self.n_heads, self.n_kv_heads, strict=True)):
            if k < 1 or n % k:
                raise ZooError(f"layer {i}: {n} query heads are not a multiple of {k} KV heads")

    @property
    def max_seq_len(self) -> int | None:
        return None  # upstream's cos/sin cache and causal mask grow with the input: no limit

    def decoder_spec(self) -> DecoderSpec:
        layers = tuple(LayerSpec(AttentionSpec(n, k, self.head_dim, qk_norm="head" if self.qk_norm else None),
                                 MLPSpec(f))
                       for n, k, f in zip(self.n_heads, self.n_kv_heads, self.ffn_dim, strict=True))
        # plain RoPE at every length: upstream's cos/sin cache (rope_max_length) is recomputed for longer documents
        # with the same formula, so the values at each position never change. Upstream rotates q and k in fp32.
        return DecoderSpec(layers, {"default": Rotary(self.head_dim, self.rope_theta, dtype=torch.float32)})


OpenELM = Decoder  # an OpenELM is the shared decoder built from an OpenELMConfig


# ---- Hugging Face names, the fused qkv_proj and proj_1, config ----

HF_NAMES: NameTable = [  # (zoo prefix, HF prefix); {i} is the layer index
    Fused("transformer.layers.{i}.attn.qkv_proj.", ("layers.{i}.attn.q_proj.", "layers.{i}.attn.k_proj.",
                                                    "layers.{i}.attn.v_proj."), layout="qkv"),
    Fused("transformer.layers.{i}.ffn.proj_1.", ("layers.{i}.mlp.gate_proj.", "layers.{i}.mlp.up_proj.")),  # [gate; up]
    ("embed.", "transformer.token_embeddings."),
    ("layers.{i}.attn_norm.", "transformer.layers.{i}.attn_norm."),
    ("layers.{i}.attn.q_norm.", "transformer.layers.{i}.attn.q_norm."),
    ("layers.{i}.attn.k_norm.", "transformer.layers.{i}.attn.k_norm."),
    ("layers.{i}.attn.o_proj.", "transformer.layers.{i}.attn.out_proj."),
    ("layers.{i}.mlp_norm.", "transformer.layers.{i}.ffn_norm."),
    ("layers.{i}.mlp.down_proj.", "transformer.layers.{i}.ffn.proj_2."),
    ("norm.", "transformer.norm."),
    ("lm_head.", "lm_head."),
]

plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)


def config_from_hf(hf: dict[str, Any]) -> OpenELMConfig:
    """Derive the per-layer counts from the multipliers as upstream does, and check them against the lists
    config.json also carries (upstream ignores those lists and re-derives; a mismatch means a broken config)."""
    unsupported = {
        "ffn_with_glu": (hf.get("ffn_with_glu", True), True),
        "activation_fn_name": (hf.get("activation_fn_name", "swish"), "swish"),
        "normalization_layer_name": (hf.get("normalization_layer_name", "rms_norm"), "rms_norm"),
    }
    for key, (got, want) in unsupported.items():
        if got != want and not (key == "activation_fn_name" and got == "silu"):
            raise ZooError(f"OpenELM with {key}={got!r} is not supported (every published model has {want!r})")
    if hf.get("num_gqa_groups") is None:
        raise ZooError("OpenELM config needs num_gqa_groups (upstream divides the query heads by it)")
    cfg = OpenELMConfig(
        dim=hf["model_dim"],
        n_layers=hf["num_transformer_layers"],
        head_dim=hf["head_dim"],
        vocab_size=hf["vocab_size"],
        qkv_multipliers=hf.get("qkv_multipliers", 1.0),
        num_gqa_groups=hf["num_gqa_groups"],
        ffn_multipliers=hf.get("ffn_multipliers", 4.0),
        ffn_dim_divisor=hf.get("ffn_dim_divisor", 256),
        rope_theta=number(hf.get("rope_freq_constant", 10000)),
        rope_max_length=hf.get("rope_max_length", 4096),
        max_context_length=hf.get("max_context_length", 2048),
        qk_norm=hf.get("normalize_qk_projections", False),
        tie_embeddings=hf.get("share_input_output_layers", False),
        **token_ids_from_hf(hf),
    )
    for key, ours in (("num_query_heads", cfg.n_heads), ("num_kv_heads", cfg.n_kv_heads)):
        if hf.get(key) is not None and tuple(hf[key]) != ours:
            raise ZooError(f"config.json lists {key}={list(hf[key])}, but its qkv_multipliers/num_gqa_groups/"
                             f"head_dim derive {list(ours)} (what upstream's OpenELMConfig would use); "
                             "fix the config so both agree")
    return cfg


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def config_to_hf(cfg: OpenELMConfig) -> dict[str, Any]:
    """The keys of the published config.json, auto_map included, so the upstream remote code loads the output."""
    if not cfg.qkv_multipliers or not cfg.ffn_multipliers:
        raise ZooError("this OpenELM config gives its per-layer heads/FFN widths directly; upstream's "
                       "OpenELMConfig re-derives them from qkv_multipliers/ffn_multipliers, so it cannot be "
                       "written as a Hugging Face OpenELM checkpoint. Keep it in zoo's format.")
    qkv = list(cfg.qkv_multipliers)
    return {
        "activation_fn_name": "swish",
        "architectures": ["OpenELMForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_openelm.OpenELMConfig",
            "AutoModelForCausalLM": "modeling_openelm.OpenELMForCausalLM",
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
        "ffn_dim_divisor": cfg.ffn_dim_divisor,
        "ffn_multipliers": list(cfg.ffn_multipliers),
        "ffn_with_glu": True,
        "head_dim": cfg.head_dim,
        "initializer_range": 0.02,
        "max_context_length": cfg.max_context_length,
        "model_dim": cfg.dim,
        "model_type": "openelm",
        "normalization_layer_name": "rms_norm",
        "normalize_qk_projections": cfg.qk_norm,
        "num_gqa_groups": cfg.num_gqa_groups,
        "num_kv_heads": list(cfg.n_kv_heads),
        "num_query_heads": list(cfg.n_heads),
        "num_transformer_layers": cfg.n_layers,
        "qkv_multipliers": qkv[0] if len(qkv) == 1 else qkv,
        "rope_freq_constant": _number(cfg.rope_theta),
        "rope_max_length": cfg.rope_max_length,
        "share_input_output_layers": cfg.tie_embeddings,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        **token_ids_to_hf(cfg),  # the published ids (above) unless the checkpoint knows its own
    }


# LoRA's "auto": the fused qkv_proj (PEFT has no default for OpenELM), so the adapter can be written in PEFT's layout
FAMILY = family("openelm", OpenELMConfig, ("openelm",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("qkv_proj",))
