"""What a family's config gives the shared decoder (zoo.models.decoder): a `DecoderSpec` of per-layer `LayerSpec`s,
each naming its mixer (softmax attention, a Gated DeltaNet, multi-head latent attention), its MLP (gated or a
Mixture-of-Experts), its norm and where the norms sit, and the model's rotaries. Plain frozen dataclasses with no
behaviour: the modules of zoo.core read them. zoo.core.contract re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from zoo.core.packing import Packed

# (packed, activation dtype) -> (cos_TH, sin_TH): a family's rotary; the dtype of cos/sin is the one q and k are
# rotated in (OpenELM rotates in fp32 whatever the activations). The tables are [T, R] for the R leading dims of each
# head the rotary turns, each angle twice (the halves repeated) whatever the layout that pairs the dims
RotaryFn = Callable[[Packed, torch.dtype], tuple[Tensor, Tensor]]

# which dims a rotary turns together, over the leading R dims of a head (zoo.core.layers.apply_rope): "half" dim i
# with dim i + R/2 (rotate-half: Llama and most checkpoints), "interleaved" dims 2i and 2i + 1 (GLM-4). A checkpoint
# is kept in its own row order; the layout is the rotation's, never a permutation of q_proj and k_proj rows
RopeLayout = Literal["half", "interleaved"]
ROPE_LAYOUTS: tuple[RopeLayout, ...] = ("half", "interleaved")


# which of the model's rotaries (DecoderSpec.rotaries) turns a mixer's q and k: most families have one; Gemma 3 a
# local and a global base
Rope = Literal["default", "local", "global"]
# an RMSNorm on q and k before the rotary: over each head, or over the whole q and k projections
QKNorm = Literal["head", "full"]
# a gated MLP's activation: SwiGLU or GeGLU (zoo.core.layers.ACTIVATIONS)
Activation = Literal["silu", "gelu_tanh"]
# how a router scores the experts (zoo.core.moe.MoE): a softmax over all of them, each one's sigmoid
# (DeepSeek-V3), or a softmax over the top k logits alone (GPT-OSS)
Scoring = Literal["softmax", "sigmoid", "softmax_topk"]
# where a block's norms sit around its mixer and its MLP (f): "pre" x + f(norm(x)) (Llama and most), "post"
# x + norm(f(x)) (OLMo 2), "sandwich" x + norm(f(norm(x))) (Gemma 2/3)
Placement = Literal["pre", "post", "sandwich"]
PLACEMENTS: tuple[Placement, ...] = ("pre", "post", "sandwich")


@dataclass(frozen=True)
class NormSpec:
    """An RMSNorm as a family has it: x / rms(x) computed in fp32, times (offset + weight). `cast_first`: the normed
    x is cast to the activations' dtype before the weight multiplies it (Llama, Qwen, Mistral, InternLM2, OpenELM);
    else the product is formed in fp32 and cast after (OLMo 2; Gemma, whose weight is an offset from 1)."""

    offset: float = 0.0  # 1.0: (1 + weight), the weight initialised to zeros (Gemma)
    cast_first: bool = True


@dataclass(frozen=True)
class AttentionSpec:
    """Softmax attention as a layer's mixer: q/k/v projections, optional q/k norms, the rotary, the attention
    function the model installs, the output projection."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False  # Qwen2: bias on q, k and v, not on o
    o_bias: bool = False
    # an RMSNorm (the layer's NormSpec) on q and k before the rotary: "head" over each head (Qwen3, OpenELM,
    # Gemma 3), "full" over the whole q and k projections (OLMo 2), None for none
    qk_norm: QKNorm | None = None
    window: int | None = None  # sliding-window attention: a query sees this many keys of its document, itself included
    scale: float | None = None  # the softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    rope: Rope = "default"  # which of the model's rotaries (DecoderSpec.rotaries) turns q and k
    rope_layout: RopeLayout = "half"  # how it pairs the dims it turns (ROPE_LAYOUTS)
    # Qwen3.5: q_proj yields each head's query and then its gate ([N, 2H]), the attention output is multiplied by
    # sigmoid(gate) before o_proj
    output_gate: bool = False
    # GPT-OSS: a learned logit per query head (the parameter `sinks`, [n_heads]) that joins each query's softmax
    # denominator and attends to no value (zoo.core.score_mods)
    sinks: bool = False
    # Gemma 2's attn_logit_softcapping: scores = softcap * tanh(scores / softcap) after the scale, before the mask
    softcap: float | None = None


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """A Gated DeltaNet layer as a layer's mixer (zoo.core.deltanet): linear attention with a recurrent state per
    value head, a depthwise causal convolution of `conv_kernel` taps over q/k/v, run in chunks of `chunk` tokens."""

    n_key_heads: int
    n_value_heads: int  # a multiple of n_key_heads: grouped value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk: int = 64
    rope: Rope = "default"  # the rotary its block is handed, which it does not use (its recurrence orders tokens)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention as a layer's mixer (zoo.core.mla, DeepSeek-V2/V3, Kimi K2): queries through a
    low-rank latent of `q_rank` (None: one plain projection), keys and values through a shared latent of `kv_rank`
    and one rope key for all heads; each head's query and key are `nope_dim` dims without the rotary then `rope_dim`
    turned by it, its value `v_dim` wide. The softmax scale is (nope_dim + rope_dim) ** -0.5 unless `scale` says
    (YaRN's mscale correction)."""

    n_heads: int
    q_rank: int | None
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool = False  # on q_a_proj, kv_a_proj_with_mqa and o_proj (transformers' attention_bias)
    scale: float | None = None
    rope: Rope = "default"
    rope_layout: RopeLayout = "half"  # DeepSeek-V3's rope_interleave: "interleaved"


@dataclass(frozen=True)
class MLPSpec:
    """A gated MLP, down(act(gate(x)) * up(x)): act "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""

    ffn_dim: int
    bias: bool = False
    activation: Activation = "silu"


@dataclass(frozen=True)
class MoESpec:
    """A sparse Mixture-of-Experts MLP (zoo.core.moe.MoE): a linear router scores `n_experts` gated MLPs of width
    `ffn_dim` per token, softmax in fp32 over all of them, the `top_k` best run and are summed by their weights.

    norm_topk       the top-k weights renormalised to sum to 1 (Mixtral always; Qwen by `norm_topk_prob`)
    weights_fp32    the weights stay fp32 into the sum (Mixtral); else cast to the activations' dtype (Qwen)
    shared_ffn_dim  a shared expert of this width every token runs, times sigmoid(a linear gate) (Qwen2-MoE)
    router_bias     a per-expert bias added to the scores for the choice alone (aux-loss-free balancing): a
                    buffer `router_bias` a recipe moves; DeepSeek-V3 and GLM-4.5 checkpoints hold it as
                    `mlp.gate.e_score_correction_bias`, the softmax families' Hugging Face classes have no place for it
    scoring         "softmax" over all experts (Mixtral, Qwen), or "sigmoid": each expert's score on its own, from
                    router logits in fp32 (DeepSeek-V3, GLM-4.5; zoo.core.router), or "softmax_topk": the top k of
                    the raw logits, then a softmax over those k alone, in the logits' dtype (GPT-OSS)
    n_group         sigmoid: the experts split into this many groups; a token chooses among the experts of its
    topk_group      `topk_group` best groups (a group's worth: the sum of its two best bias-corrected scores)
    routed_scaling  the routed experts' weights times this (DeepSeek's routed_scaling_factor), after norm_topk
    shared_gated    the shared expert times sigmoid(a linear gate) (Qwen2-MoE); False: added as it is (DeepSeek-V3's
                    `n_shared_experts` experts, one MLP of their summed width)
    router_linear_bias  the router's own learned bias (an nn.Linear bias: GPT-OSS), not `router_bias`
    expert_bias     biases on each expert's gate/up and down projections (GPT-OSS)
    swiglu_limit    GPT-OSS's clamped SwiGLU in place of act(gate) * up: gate clamped above at the limit, up to
                    [-limit, limit], then (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: the plain gated MLP
    """

    n_experts: int
    top_k: int
    ffn_dim: int
    norm_topk: bool = True
    weights_fp32: bool = False
    shared_ffn_dim: int | None = None
    activation: Activation = "silu"
    router_bias: bool = False
    scoring: Scoring = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    shared_gated: bool = True
    router_linear_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


@dataclass(frozen=True)
class LayerSpec:
    """One block as its family's config describes it: its mixer, its MLP, its norm and where the norms sit."""

    mixer: AttentionSpec | GatedDeltaNetSpec | MLASpec
    mlp: MLPSpec | MoESpec
    norm: NormSpec = NormSpec()
    placement: Placement = "pre"


@dataclass(frozen=True)
class DecoderSpec:
    """A text model as its family's config describes it: the blocks, the rotaries their mixers name, the final norm
    and the scale of the token embeddings (Gemma: sqrt(dim), applied in the weights' dtype)."""

    layers: tuple[LayerSpec, ...]
    rotaries: dict[str, RotaryFn] = dataclasses.field(compare=False)
    norm: NormSpec = NormSpec()
    embed_scale: float | None = None
    # Gemma 2's final_logit_softcapping: logits = cap * tanh(logits / cap), in the forward, the loss and generation
    final_softcap: float | None = None
