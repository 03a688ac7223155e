"""GPT-OSS (gpt-oss-20b, gpt-oss-120b) over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width, G
groups of 32 values (MXFP4), N query heads.
Attention with biases on q, k, v and o and a learned sink logit per head (joins each query's softmax, attends to no
value), sliding (a window of `sliding_window` keys) and full layers as `layer_types` says (alternating, sliding
first), YaRN rotary (its attention factor on cos and sin); every layer's MLP a Mixture of Experts (zoo.core.moe):
a router with its own bias, the top `num_experts_per_tok` logits chosen and a softmax over those alone weighing them,
experts with biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate clamped above at 7, up to
[-7, 7]). The model is the shared decoder (zoo.models.decoder).

Tensor names: transformers holds each layer's experts stacked and transposed (`mlp.experts.gate_up_proj` [E, D, 2F]
with gate and up in alternating columns, `down_proj` [E, F, D], biases [E, 2F] (alternating) and [E, D]); zoo keeps
[E, 2F, D] gate rows then up rows and [E, D, F]: the weight plans transpose and (de)interleave, bit-exact both ways.
The hub's checkpoints hold the expert matrices in MXFP4 (config.json's `quantization_config`): `*_blocks` [E, R, G,
16] bytes (two 4-bit E2M1 values each, the low nibble first) and `*_scales` [E, R, G] (a power of two, biased by
127, per 32 values) of the [E, R, 32 G] matrix as zoo lays it out (rows the outputs); they are dequantised on load,
one expert at a time, exactly as transformers' `convert_moe_packed_tensors` does. zoo writes float tensors back.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MoESpec, NormSpec
from zoo.core.layers import LLAMA_ROPES, Rotary
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import Plan, as_tuple, check_hf_counts, family, rename_plans
from zoo.models.llama import HF_NAMES, LLAMA_POSITIVE, check_window, shape_from_hf, shape_to_hf
from zoo.models.qwen3_moe import MOE_POSITIVE, experts_from_hf, finish_moe_config, refuse_router_bias

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig default and every published checkpoint's rotary
YARN: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}


def alternating(n_layers: int) -> tuple[str, ...]:
    """transformers' default layer_types: sliding, full, sliding, ..."""
    return tuple(LAYER_TYPES[i % 2] for i in range(n_layers))


@dataclass(frozen=True)
class GptOssConfig:
    """Defaults are transformers' GptOssConfig's (gpt-oss-120b's shape), token ids aside."""

    family: ClassVar[str] = "gpt_oss"
    positive: ClassVar[frozenset[str]] = ((LLAMA_POSITIVE - {"ffn_dim"}) | MOE_POSITIVE
                                          | {"sliding_window", "swiglu_limit", "swiglu_alpha"})
    dim: int = 2880
    n_layers: int = 36
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(YARN), hash=False)
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    attention_bias: bool = True
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] = ()  # () : alternating, sliding first (transformers' default)
    n_experts: int = 128
    top_k: int = 4
    expert_ffn_dim: int = 2880
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # zoo's own: a per-expert bias on the expert choice, moved by aux-loss-free balancing (recipes
    # --router-bias-update-rate); no Hugging Face class holds it, so a model with one is not exported there
    router_bias: bool = False
    router_aux_loss_coef: float = field(default=0.001, compare=False)
    # how the Hugging Face checkpoint this config was read from holds its expert matrices: MXFP4 blocks and scales
    # (config.json's quantization_config, as the hub's), dequantised on load; zoo itself holds and writes floats
    mxfp4_experts: bool = field(default=False, compare=False)
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", as_tuple(self.layer_types) or alternating(self.n_layers))
        finish_moe_config(self, (*LLAMA_ROPES, "yarn"))
        check_window(self.sliding_window)
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ZooError(f"layer_types must be {self.n_layers} of {', '.join(LAYER_TYPES)} (one per layer), got "
                           f"{list(self.layer_types)!r}")

    @property
    def ffn_dim(self) -> int:  # what shape_to_hf writes as intermediate_size: the experts' width
        return self.expert_ffn_dim

    def sparse_layers(self) -> tuple[bool, ...]:
        return (True,) * self.n_layers

    def expert_params(self) -> int:
        """One expert's parameters: gate, up and down, and their biases."""
        return 3 * self.dim * self.expert_ffn_dim + 2 * self.expert_ffn_dim + self.dim

    def decoder_spec(self) -> DecoderSpec:
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=False, scoring="softmax_topk",
                      router_linear_bias=True, expert_bias=True, swiglu_limit=self.swiglu_limit,
                      swiglu_alpha=self.swiglu_alpha, router_bias=self.router_bias)
        norm = NormSpec(cast_first=False)  # (weight * x).to(dtype), as GptOssRMSNorm

        def layer(kind: str) -> LayerSpec:
            window = self.sliding_window if kind == "sliding_attention" else None
            attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                                 o_bias=self.attention_bias, window=window, sinks=True)
            return LayerSpec(attn, moe, norm)

        return DecoderSpec(tuple(layer(kind) for kind in self.layer_types),
                           {"default": Rotary(self.head_dim, self.rope_theta, self.rope_scaling)}, norm=norm)


def config_from_hf(hf: dict[str, Any]) -> GptOssConfig:
    check_hf_counts(hf, "GPT-OSS")
    quant = hf.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant is not None and method != "mxfp4":
        raise ZooError(f"GPT-OSS with quantization_config {method!r} is not supported (expected none, or 'mxfp4' "
                       "as the published checkpoints)")
    shape = shape_from_hf(hf, "GPT-OSS", norm_eps=1e-5, kv_heads=8, head_dim=64, max_positions=131072)
    rope = hf.get("rope_parameters")
    nested: dict[str, Any] = rope if isinstance(rope, dict) else {}
    if "rope_theta" not in hf and "rope_theta" not in nested:
        shape["rope_theta"] = 150000.0  # transformers' GptOssConfig.default_theta
    if not hf.get("rope_scaling") and not nested:
        shape["rope_scaling"] = dict(YARN)  # transformers' default when the config names none
    expert_ffn_dim = shape.pop("ffn_dim")
    return GptOssConfig(**shape, **experts_from_hf(hf, "GPT-OSS"), expert_ffn_dim=expert_ffn_dim,
                        attention_bias=hf.get("attention_bias", True), sliding_window=hf.get("sliding_window", 128),
                        layer_types=as_tuple(hf.get("layer_types") or ()), swiglu_alpha=hf.get("swiglu_alpha", 1.702),
                        swiglu_limit=hf.get("swiglu_limit", 7.0), mxfp4_experts=quant is not None,
                        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: GptOssConfig) -> dict[str, Any]:
    refuse_router_bias(cfg, "GptOssForCausalLM")
    return {**shape_to_hf(cfg, "GptOssForCausalLM", "gpt_oss"), "attention_bias": cfg.attention_bias,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
            "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit,
            "router_aux_loss_coef": cfg.router_aux_loss_coef}


# ---- MXFP4: the hub's expert matrices ----

# the 16 values of a 4-bit E2M1 code (sign bit 3): what transformers' FP4_VALUES lists
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks_ERG16: Tensor, scales_ERG: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """[E, R, 32 G] in `dtype` of MXFP4 blocks (uint8, two codes a byte, the low nibble the earlier value) and scales
    (uint8 exponents biased by 127), one expert at a time (its indices, not the whole layer's, in memory): each code's
    value in `dtype`, times 2^(scale - 127) by ldexp, as transformers' convert_moe_packed_tensors."""
    if blocks_ERG16.dtype != torch.uint8 or scales_ERG.dtype != torch.uint8 or \
            blocks_ERG16.shape[:-1] != scales_ERG.shape or blocks_ERG16.dim() != 4:
        raise ZooError(f"MXFP4 blocks must be uint8 [E, R, G, B] and scales uint8 [E, R, G], got {blocks_ERG16.dtype} "
                       f"{list(blocks_ERG16.shape)} and {scales_ERG.dtype} {list(scales_ERG.shape)}")
    E, R, G, B = blocks_ERG16.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(E, R, G, 2 * B, dtype=dtype)
    for e in range(E):
        blocks_RGB = blocks_ERG16[e]
        out[e, ..., 0::2] = lut[(blocks_RGB & 0x0F).long()]
        out[e, ..., 1::2] = lut[(blocks_RGB >> 4).long()]
        exp_RG1 = scales_ERG[e].to(torch.int32).sub(127).unsqueeze(-1)
        torch.ldexp(out[e], exp_RG1, out=out[e])
    return out.view(E, R, G * 2 * B)


# ---- weight plans: transformers' stacked [E, D, 2F] interleaved experts <-> zoo's [E, 2F, D] halves ----

_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def halves(x_E2F: Tensor) -> Tensor:
    """Alternating gate/up entries on dim 1 ([E, 2F, ...]: gate at even, up at odd) as gate then up."""
    return torch.cat((x_E2F[:, 0::2], x_E2F[:, 1::2]), dim=1).contiguous()


def alternate(x_E2F: Tensor) -> Tensor:
    """The inverse of `halves`: gate then up on dim 1 as alternating entries."""
    E, F2 = x_E2F.shape[:2]
    gate, up = x_E2F.split(F2 // 2, dim=1)
    return torch.stack((gate, up), dim=2).reshape(E, F2, *x_E2F.shape[2:]).contiguous()


def _transposed(t: Tensor) -> Tensor:
    return t.transpose(1, 2).contiguous()


def _mxfp4(rows: Callable[[Tensor], Tensor]) -> Callable[[list[Tensor]], Tensor]:
    def combine(ts: list[Tensor]) -> Tensor:
        return rows(dequantize_mxfp4(ts[0], ts[1]))
    combine.quantized = True  # type: ignore[attr-defined]  # its sources are bytes: zoo.io.load.stream lets them in
    return combine


FROM_HF: dict[str, Callable[[list[Tensor]], Tensor] | None] = {
    "gate_up_proj": lambda ts: halves(ts[0].transpose(1, 2)),
    "gate_up_proj_bias": lambda ts: halves(ts[0]),
    "down_proj": lambda ts: _transposed(ts[0]),
    "down_proj_bias": None,
}
FROM_MXFP4 = {"gate_up_proj": _mxfp4(halves), "down_proj": _mxfp4(lambda t: t)}
TO_HF: dict[str, Callable[[list[Tensor]], Tensor] | None] = {
    "gate_up_proj": lambda ts: _transposed(alternate(ts[0])),
    "gate_up_proj_bias": lambda ts: alternate(ts[0]),
    "down_proj": lambda ts: _transposed(ts[0]),
    "down_proj_bias": None,
}

_base_from, _base_to = rename_plans(HF_NAMES)


def plan_from_hf(cfg: GptOssConfig, zoo_names: list[str]) -> Plan:
    plan = _base_from(cfg, zoo_names)
    for z in zoo_names:
        if m := _EXPERTS.fullmatch(z):
            kind, hf = m[2] + (m[3] or ""), f"model.layers.{m[1]}.mlp.experts.{m[2]}{m[3] or ''}"
            if cfg.mxfp4_experts and kind in FROM_MXFP4:
                plan[z] = ((hf + "_blocks", hf + "_scales"), FROM_MXFP4[kind])
            else:
                plan[z] = ((hf,), FROM_HF[kind])
    return plan


def plan_to_hf(cfg: GptOssConfig, zoo_names: list[str]) -> Plan:
    plan = _base_to(cfg, zoo_names)
    for z in zoo_names:
        if m := _EXPERTS.fullmatch(z):
            kind = m[2] + (m[3] or "")
            plan[f"model.layers.{m[1]}.mlp.experts.{kind}"] = ((z,), TO_HF[kind])
    return plan


# PEFT names no default LoRA targets for gpt_oss; zoo takes q and v (as Llama's): the experts (stacked parameters,
# no nn.Linear) and the router stay frozen
FAMILY = family("gpt_oss", GptOssConfig, ("gpt_oss",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
