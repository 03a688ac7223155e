"""The contract between zoo's models, the packed batch and parallelism: what every model exposes, and nothing more.

`zoo.parallel` (sequence parallel, FSDP, activation checkpointing, compile), the recipes, the converters and
`zoo.train.flops` touch a model only through `ZooModel`; they never ask which family it is or probe its attributes.
A model, in turn, reads the fields of `zoo.Packed` and asks it the rest through its methods (`targets`,
`count_targets`, `doc_len_per_token`, `part_of`): a sequence-parallel shard is a Packed (its own tokens) that
answers them from the whole pack, so a model never learns how a pack was cut, and never imports torch.distributed.
Per-layer state goes through declared seams only: attention's through `set_attention` (`PerLayerAttention`), every
other mixer's through `LanguageModel.mixers()` and the `zoo.core.mixer.Mixer` protocol each keeps.

Every text family runs `zoo.models.decoder.Decoder`; it and LLaVA satisfy this, which `zoo.models` checks with the
type checker. What generic code needs to know about a family beyond its model (names, conversions, LoRA defaults)
is its `zoo.models.family.Family` record, found by `model.family` in `zoo.models.FAMILIES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from typing_extensions import TypeIs  # torch depends on it; in typing from Python 3.13

from zoo.core.attention import AttentionFn
from zoo.core.mixer import Mixer
from zoo.core.packing import Packed


@runtime_checkable
class PerLayerAttention(Protocol):
    """An attention function that keeps state per layer (generation's KV cache). `set_attention` installs
    `for_layer(i)` in layer i, so each layer's own index, never the order of the calls, picks its state."""

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
                 window: int | None = None, *, layer: int, sinks: Tensor | None = None,
                 softcap: float | None = None) -> Tensor: ...

    def for_layer(self, layer: int) -> AttentionFn:
        """The attention function of layer `layer` (indexed as in `ZooModel.layers`)."""
        ...


class FamilyConfig(Protocol):
    """Every family's config: a frozen dataclass whose class names its family and the fields that must be above 0
    (sizes positive integers, eps and RoPE bases finite and positive), which `zoo.models.family.check_config`
    checks with each field's declared type before anything is built."""

    family: ClassVar[str]
    positive: ClassVar[frozenset[str]]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


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


class HasTokenIds(Protocol):
    """The checkpoint's special-token ids a config carries (eos: where generation stops)."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def pad_token_id(self) -> int | None: ...


class DecoderConfig(FamilyConfig, HasTokenIds, Protocol):
    """What a text family's config tells the decoder (and generic code: the vocabulary, the token ids)."""

    @property
    def dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def norm_eps(self) -> float: ...

    @property
    def tie_embeddings(self) -> bool: ...

    @property
    def max_seq_len(self) -> int | None: ...  # the longest document the family supports, None: no limit

    def decoder_spec(self) -> DecoderSpec:
        """The blocks, rotaries, final norm and embedding scale the decoder is built from."""
        ...


class TextModel(Protocol):
    """A language model as generation and the FLOP counter use it (`ZooModel.decoder`): zoo.models.decoder.Decoder."""

    @property
    def config(self) -> DecoderConfig: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def head_weight(self) -> Tensor: ...

    @property
    def embed(self) -> nn.Embedding: ...

    @property
    def final_softcap(self) -> float | None:
        """The soft-cap of the logits h @ head_weight^T (DecoderSpec.final_softcap), None for none."""
        ...

    def hidden(self, packed: Packed, x_TD: Tensor | None = None) -> Tensor:
        """[T, D] final normed hidden states; x_TD replaces the token embeddings."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def attention_flops(self, seqlens: Sequence[int]) -> int:
        """Forward FLOPs of every layer's attention over documents of these lengths."""
        ...


class LanguageModel(TextModel, Protocol):
    """A text model as the rest of zoo uses it (`ZooModel.decoder`, zoo.models.decoder.Decoder): a TextModel, its
    mixers (their per-layer state, zoo.core.mixer.Mixer), its loss with the Mixture-of-Experts terms and the
    router logits it records. A decode step's stand-in (zoo.generate.fused) is a TextModel only."""

    def mixers(self) -> list[Mixer]:
        """Every block's token mixer, in layer order."""
        ...

    def loss(self, packed: Packed, x_TD: Tensor | None = None, *, denominator: int | None = None,
             aux_loss_coef: float = 0.0, aux_loss: str = "batch", z_loss_coef: float = 0.0,
             parts: dict[str, Tensor] | None = None) -> Tensor:
        """ZooModel.loss, plus a Mixture-of-Experts model's balancing terms from the same forward (zoo.models.decoder
        .Decoder.loss says how they are weighted) and, in `parts`, the terms without their coefficients."""
        ...

    def recording_router(self) -> AbstractContextManager[list[list[Tensor]]]:
        """While open, each forward appends every MoE layer's router logits [T, E] to that layer's list (one list a
        MoE layer, in order; none for a dense model)."""
        ...


class ZooModel(Protocol):
    """What a zoo model is to the rest of zoo.

    Attention: every layer calls one attention function, `attend(q_TNH, k_TKH, v_TKH, packed) -> o_TNH`
    (zoo.core.attention's signature). `set_attention` installs another (a backend name, or a wrapper such as the
    sequence-parallel one, or a `PerLayerAttention`, one function per layer); models never edit it themselves.

    Targets: `labels(packed)` is the target rule, the labels the loss counts (-100 elsewhere). Text models count
    every next-token label of the pack; LLaVA never counts an image placeholder. The loss asks the pack for its
    targets under the rule (`packed.targets(self.labels)`, `packed.count_targets(self.labels)`): a sequence-
    parallel shard applies it to the whole pack before keeping its own tokens, so shards and the global target
    count agree with one process.

    Units: `layers` are the blocks, each its own unit for activation checkpointing, compile and FSDP;
    `fsdp_units()` names the other submodules FSDP shards on their own (LLaVA's tower and projector). The root
    holds the rest (embeddings, final norm, head).
    """

    @property
    def family(self) -> str:
        """The family's name: its key in zoo.models.FAMILIES and in zoo checkpoints' config.json."""
        ...

    @property
    def config(self) -> FamilyConfig:
        """The config the model was built from."""
        ...

    @property
    def decoder(self) -> LanguageModel:
        """The language model: the model itself for a text family, LLaVA's language model. Generation decodes
        with it alone (the images went in with the prefill) and the FLOP counter counts its layers."""
        ...

    @property
    def layers(self) -> nn.ModuleList:
        """The blocks, in order."""
        ...

    @property
    def attend(self) -> AttentionFn:
        """The attention function every layer calls now."""
        ...

    @property
    def head_weight(self) -> Tensor:
        """[V, D] the output head (the embedding matrix when tied)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's end-of-sequence ids (its config's; a LLaVA's language model's): where generation stops
        by default. Empty when the checkpoint does not say."""
        ...

    def set_attention(self, attn: str | AttentionFn) -> None:
        """Install an attention function in every layer: a backend name (zoo.core.attention.BACKENDS) or a function
        (a `PerLayerAttention` gives layer i its `for_layer(i)`)."""
        ...

    def hidden(self, packed: Packed) -> Tensor:
        """[T, D] final normed hidden states of the pack."""
        ...

    def forward(self, input_ids: Tensor | Packed, cu_seqlens: Tensor | None = None, /) -> Tensor:
        """[T, V] logits of a Packed (or of input_ids [T] with cu_seqlens [n+1])."""
        ...

    def loss(self, packed: Packed, *, denominator: int | None = None) -> Tensor:
        """Next-token cross-entropy summed over `packed.targets(self.labels)` and divided by `denominator` (a
        recipe's count over its whole step), by default `packed.count_targets(self.labels)`: the pack's mean, or
        for a sequence-parallel shard its share of the whole pack's mean."""
        ...

    def labels(self, packed: Packed) -> Tensor:
        """[T] the targets the loss counts: the model's target rule applied to packed.labels."""
        ...

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules FSDP shards as units of their own, besides the blocks in `layers`."""
        ...

    def encoder_flops(self, n_images: int, grids: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, nn.Module]]:
        """What runs below the decoder for `n_images` images, bottom up (LLaVA's tower, then its projector): each
        part's forward FLOPs in matrix products with weights, in attention, and the module (whose parameters say
        whether it trains). `grids`: each image's (t, h, w) patch grid, for a tower whose cost depends on the
        image's size (Qwen2.5-VL's needs them; towers at one resolution ignore them). Empty for a text model. See
        zoo.train.flops."""
        ...

    def decode_offsets(self, packed: Packed) -> Tensor | None:
        """[n] what each document of a prefilled pack adds to its decoded tokens' text positions in the rotary
        (Qwen2.5-VL's M-RoPE rope deltas: generation passes position + offset as `position_ids_3T`); None for a
        model whose rotary reads the text positions alone."""
        ...


# every member of the contract, read off the Protocol's body (its properties and methods)
_ZOO_MEMBERS = tuple(sorted(n for n in vars(ZooModel) if not n.startswith("_")))


def is_zoo_model(obj: object) -> TypeIs[ZooModel]:
    """Does `obj` have every member of `ZooModel`? Asked with getattr, as nn.Module answers it: from Python 3.12 on
    `isinstance` against a runtime-checkable Protocol looks attributes up statically and so misses a module's
    submodules and parameters (`layers`), which is why ZooModel is not runtime-checkable."""
    return all(hasattr(obj, name) for name in _ZOO_MEMBERS)
