"""The decoder every text family runs: embeddings, blocks of a mixer and a gated MLP with their norms, a final norm,
the head.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
The families differ only in what their config says (`zoo.core.contract.DecoderSpec`): per layer, the mixer
(attention: head counts, biases, q/k norms per head or full width, a sliding window, the softmax scale, which
rotary), the MLP (its width and activation), the norm (plain or (1 + w), its cast order) and where the norms sit
(pre, post, sandwich); per model, the rotaries (plain, Llama 3's or linear scaling, InternLM2's dynamic NTK,
OpenELM's fp32 rotation; Gemma's local and global bases), the final norm and the embedding scale. Each family's file
holds its config, its Hugging Face names and its conversions; the module tree and the forward are this one, so a
family is one file of knowledge, not one more copy of the model. The contract's glue
(`zoo.core.contract.ZooModel`) is written here once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops, get_attention
from zoo.core.contract import (
    PLACEMENTS,
    ROPE_LAYOUTS,
    AttentionSpec,
    DecoderConfig,
    GatedDeltaNetSpec,
    LayerSpec,
    MLASpec,
    MLPSpec,
    MoESpec,
    NormSpec,
    PerLayerAttention,
)
from zoo.core.deltanet import GatedDeltaNet
from zoo.core.layers import GatedMLP, RMSNorm, apply_rope
from zoo.core.loss import linear_cross_entropy
from zoo.core.mixer import Mixer, MixerCache
from zoo.core.mla import MLA
from zoo.core.moe import MoE, balancing_terms, recording
from zoo.core.packing import Packed, as_packed
from zoo.core.score_mods import cap
from zoo.errors import ZooError


def make_norm(dim: int, eps: float, spec: NormSpec) -> RMSNorm:
    return RMSNorm(dim, eps, offset=spec.offset, cast_first=spec.cast_first)


class Attention(nn.Module):
    """q/k/v projections, the rotary, the attention function installed in this layer (`attend`), the output
    projection. `layer` is the block's index in the decoder: a per-layer attention function is picked by it.

    A `zoo.core.mixer.Mixer` whose state lives in the installed attention function: generation's KV cache and
    sequence parallelism's wrapper come in through `Decoder.set_attention`, so its state hooks have nothing to do."""

    attend: AttentionFn  # installed by Decoder.set_attention

    def __init__(self, dim: int, spec: AttentionSpec, norm: NormSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        D, N, K, H = dim, spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.head_dim, self.window, self.scale, self.layer = H, spec.window, spec.scale, layer
        self.n_heads, self.qk_norm, self.output_gate = N, spec.qk_norm, spec.output_gate
        if spec.rope_layout not in ROPE_LAYOUTS:
            raise ZooError(f"rope_layout must be one of {', '.join(ROPE_LAYOUTS)}, got {spec.rope_layout!r}")
        self.rope_layout = spec.rope_layout
        self.q_proj = nn.Linear(D, N * H * (2 if spec.output_gate else 1), bias=spec.qkv_bias)
        self.k_proj = nn.Linear(D, K * H, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(D, K * H, bias=spec.qkv_bias)
        widths = {None: None, "head": (H, H), "full": (N * H, K * H)}
        if spec.qk_norm not in widths:
            raise ZooError(f"qk_norm must be 'head', 'full' or None, got {spec.qk_norm!r}")
        width = widths[spec.qk_norm]
        self.q_norm = None if width is None else make_norm(width[0], norm_eps, norm)
        self.k_norm = None if width is None else make_norm(width[1], norm_eps, norm)
        self.o_proj = nn.Linear(N * H, D, bias=spec.o_bias)
        self.softcap = spec.softcap
        # GPT-OSS's per-head sink logits, named as its checkpoints name them (init_weights: N(0, std))
        self.sinks = nn.Parameter(torch.zeros(N)) if spec.sinks else None

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        return self.attend_projected(self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD), x_TD.dtype, cos_TH,
                                     sin_TH, packed)

    def attend_projected(self, q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype, cos_TH: Tensor, sin_TH: Tensor,
                         packed: Packed) -> Tensor:
        """The rest of forward from the q, k and v projections [T, *] (generation's fused decode computes them as
        one product, zoo.generate.fused); `dtype`: the activations'."""
        T, H = q.shape[0], self.head_dim
        gate_TNH = None
        if self.output_gate:  # each head's query, then its gate (Qwen3.5)
            q, gate_TNH = q.view(T, -1, 2 * H).chunk(2, dim=-1)
        if self.qk_norm == "full" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over the whole projection (OLMo 2)
        q_TNH, k_TKH, v_TKH = q.reshape(T, -1, H), k.reshape(T, -1, H), v.reshape(T, -1, H)
        if self.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            q_TNH, k_TKH = self.q_norm(q_TNH), self.k_norm(k_TKH)
        # rotated in the dtype of cos/sin (a no-op cast for all but OpenELM, which rotates in fp32), cast back
        q_TNH = apply_rope(q_TNH.to(cos_TH.dtype), cos_TH, sin_TH, self.rope_layout).to(dtype)
        k_TKH = apply_rope(k_TKH.to(cos_TH.dtype), cos_TH, sin_TH, self.rope_layout).to(dtype)
        options: dict[str, Any] = {}  # passed only where set, so wrappers see the same call as before either way
        if self.scale is not None:
            options["scale"] = self.scale
        if self.window is not None:
            options["window"] = self.window
        if self.sinks is not None:
            options["sinks"] = self.sinks
        if self.softcap is not None:
            options["softcap"] = self.softcap
        o_TNH = self.attend(q_TNH, k_TKH, v_TKH, packed, **options)
        if gate_TNH is not None:
            o_TNH = o_TNH * gate_TNH.sigmoid()
        return self.o_proj(o_TNH.reshape(T, -1))

    def generation_bytes(self, n: int, capacity: int, itemsize: int) -> int:
        """K and V rows of every sequence, `capacity` of them."""
        return n * capacity * 2 * self.k_proj.out_features * itemsize

    def use_cache(self, cache: MixerCache | None) -> None:
        """Nothing: the KV cache is the attention function generation installs (zoo.generate.cache)."""

    def sequence_parallel(self, exchange: Any, mode: str) -> None:
        """Nothing: the sequence-parallel attention function is installed around the backend (any mode)."""

    def kernel_choice(self, device: torch.device, dtype: torch.dtype) -> str:
        """The attention function the model installs (attn=, zoo.core.attention.describe says what each runs)."""
        return f"softmax attention through the installed function ({getattr(self.attend, '__name__', 'custom')})"

    def mixing_flops(self, seqlens: Sequence[int]) -> int:
        """0: the q.k and p.v products are the language model's attention_flops, counted from the specs."""
        return 0


# a mixer spec's class -> the module it builds from (dim, spec, the layer's norm, norm eps, layer index): a
# `zoo.core.mixer.Mixer` (a new mixer is a spec, a module and its entry here)
MixerFactory = Callable[[int, Any, NormSpec, float, int], nn.Module]
MIXERS: dict[type, MixerFactory] = {AttentionSpec: Attention, GatedDeltaNetSpec: GatedDeltaNet, MLASpec: MLA}
# the mixers that call the installed attention function (`attend`, set by Decoder.set_attention)
ATTENDING = (Attention, MLA)


def gated_mlp(dim: int, spec: MLPSpec) -> nn.Module:
    return GatedMLP(dim, spec.ffn_dim, bias=spec.bias, activation=spec.activation)


# an MLP spec's class -> what builds its module from (dim, spec)
MLPFactory = Callable[[int, Any], nn.Module]
MLPS: dict[type, MLPFactory] = {MLPSpec: gated_mlp, MoESpec: MoE}

# the type checker's proof that both mixers keep the contract (a new one adds its line)
_MIXERS_KEEP_THE_CONTRACT: tuple[type[Mixer], ...] = (Attention, GatedDeltaNet, MLA)


class Block(nn.Module):
    """A mixer and an MLP (gated, or a Mixture-of-Experts), each with its norms where the spec places them (pre,
    post or sandwich)."""

    def __init__(self, dim: int, spec: LayerSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        if spec.placement not in PLACEMENTS:
            raise ZooError(f"norm placement must be one of {', '.join(PLACEMENTS)}, got {spec.placement!r}")
        pre, post = spec.placement in ("pre", "sandwich"), spec.placement in ("post", "sandwich")

        def norm() -> RMSNorm:
            return make_norm(dim, norm_eps, spec.norm)

        self.attn_norm = norm() if pre else None
        # the mixer, under the name its weights have in every checkpoint (layers.i.attn.*), whichever it is
        self.attn = MIXERS[type(spec.mixer)](dim, spec.mixer, spec.norm, norm_eps, layer)
        self.attn_post_norm = norm() if post else None
        self.mlp_norm = norm() if pre else None
        self.mlp = MLPS[type(spec.mlp)](dim, spec.mlp)
        self.mlp_post_norm = norm() if post else None

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        return self.around(self.attn, self.mlp, x_TD, cos_TH, sin_TH, packed)

    def around(self, attn: nn.Module, mlp: nn.Module, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor,
               packed: Packed) -> Tensor:
        """The block's norms and residuals around `attn` and `mlp` (its own; generation's fused decode passes
        fused stand-ins, zoo.generate.fused)."""
        h_TD = attn(x_TD if self.attn_norm is None else self.attn_norm(x_TD), cos_TH, sin_TH, packed)
        x_TD = x_TD + (h_TD if self.attn_post_norm is None else self.attn_post_norm(h_TD))
        h_TD = mlp(x_TD if self.mlp_norm is None else self.mlp_norm(x_TD))
        return x_TD + (h_TD if self.mlp_post_norm is None else self.mlp_post_norm(h_TD))


class Embedding(nn.Embedding):
    """Token embeddings, times `scale` in the weights' dtype where the family scales them (Gemma: sqrt(dim))."""

    def __init__(self, vocab_size: int, dim: int, scale: float | None = None) -> None:
        # _weight skips nn.Embedding's normal_() init, which on meta drags in torch._refs (a second of imports)
        super().__init__(vocab_size, dim, _weight=torch.empty(vocab_size, dim))
        self.scale = scale

    def forward(self, input: Tensor) -> Tensor:
        x = super().forward(input)
        # the scale rounded to the weights' dtype first, as transformers' Gemma multiplies it
        return x if self.scale is None else x * torch.tensor(self.scale).to(self.weight.dtype)


class Decoder(nn.Module):
    """A text family's model: what `zoo.load` returns for every text family."""

    def __init__(self, config: DecoderConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        spec = cfg.decoder_spec()
        self.embed = Embedding(cfg.vocab_size, cfg.dim, spec.embed_scale)
        self.layers = nn.ModuleList(Block(cfg.dim, layer, cfg.norm_eps, i) for i, layer in enumerate(spec.layers))
        self.norm = make_norm(cfg.dim, cfg.norm_eps, spec.norm)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.final_softcap = spec.final_softcap
        self.rotaries = spec.rotaries
        self.rope_keys = [layer.mixer.rope for layer in spec.layers]  # each block's rotary
        missing = sorted(set(self.rope_keys) - set(self.rotaries))
        if missing:
            raise ZooError(f"{cfg.family}: layers name rotaries {missing} that the config does not define")
        self.set_attention(attn)

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def decoder(self) -> Decoder:
        """The language model (the contract's): this one."""
        return self

    @property
    def head_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def set_attention(self, attn: str | AttentionFn) -> None:
        """Swap the attention function of every layer (a backend name, or a wrapper from zoo.parallel); a
        per-layer one (generation's KV cache) gives each layer the function of its own index."""
        self.attend = attend = get_attention(attn)  # the attention function every layer calls
        for attention in (m for m in self.modules() if isinstance(m, ATTENDING)):
            attention.attend = attend.for_layer(attention.layer) if isinstance(attend, PerLayerAttention) else attend

    def labels(self, packed: Packed) -> Tensor:
        """Which tokens are targets: the pack's next-token labels, every one (the contract's target rule)."""
        return packed.require_labels()

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules FSDP shards as units of their own besides the blocks in `layers`: none."""
        return []

    def encoder_flops(self, n_images: int, grids: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, nn.Module]]:
        """No encoder below the decoder (see zoo.train.flops)."""
        return []

    def decode_offsets(self, packed: Packed) -> Tensor | None:
        """None: decoded tokens take their text positions (the contract's)."""
        return None

    def attention_flops(self, seqlens: Sequence[int]) -> int:
        """Forward FLOPs of every layer's attention over documents of these lengths (each layer's heads, window)."""
        return sum(attention_flops(seqlens, a.n_heads, a.head_dim, window=a.window)
                   for a in self._attentions())

    def _attentions(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def mixers(self) -> list[Mixer]:
        """Every block's token mixer, in layer order (the contract's seam for their state)."""
        mixers: list[Mixer] = []
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.attn, Mixer):
                raise ZooError(f"layer {i}'s mixer {type(layer.attn).__name__} does not keep zoo.core.mixer.Mixer")
            mixers.append(layer.attn)
        return mixers

    @contextmanager
    def recording_router(self, enabled: bool = True) -> Iterator[list[list[Tensor]]]:
        """While open, each forward appends every MoE layer's router logits [T, E] to that layer's list."""
        with recording(self, enabled) as records:
            yield records

    def hidden(self, packed: Packed, x_TD: Tensor | None = None,
               adds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Final normed hidden states [T, D]; x_TD replaces the token embeddings (LLaVA writes images into it);
        `adds` (rows_R, a_R(LD)): a_R(LD)'s l-th D columns are added to those rows after layer l (Qwen3-VL's
        DeepStack puts visual features into the first layers' outputs at the image tokens)."""
        if x_TD is None:
            if packed.pixel_values is not None:
                raise ZooError(f"a {self.family} model takes no images; this pack carries "
                               f"{packed.pixel_values.shape[0]} (a LLaVA checkpoint reads them)")
            packed.check_ids(self.config.vocab_size)
            x_TD = self.embed(packed.input_ids)
        # each rotary's tables once per pack, for the layers that name it
        tables = {key: self.rotaries[key](packed, x_TD.dtype) for key in dict.fromkeys(self.rope_keys)}
        levels = () if adds is None else adds[1].split(x_TD.shape[1], dim=1)
        for i, (layer, key) in enumerate(zip(self.layers, self.rope_keys)):
            x_TD = layer(x_TD, *tables[key], packed)
            if i < len(levels):
                x_TD = x_TD.index_add(0, adds[0], levels[i].to(x_TD.dtype))  # type: ignore[index]
        return self.norm(x_TD)

    def forward(self, input_ids: Tensor | Packed, cu_seqlens: Tensor | None = None,
                x_TD: Tensor | None = None) -> Tensor:
        """logits [T, V] for input_ids [T] with cu_seqlens [n+1] (or a Packed)."""
        h_TD = self.hidden(as_packed(input_ids, cu_seqlens), x_TD)
        return cap(F.linear(h_TD, self.head_weight), self.final_softcap)

    def loss(self, packed: Packed, x_TD: Tensor | None = None, *, denominator: int | None = None,
             aux_loss_coef: float = 0.0, aux_loss: str = "batch", z_loss_coef: float = 0.0,
             parts: dict[str, Tensor] | None = None) -> Tensor:
        """Next-token cross-entropy over the pack's labels != -100, the head applied in chunks: their mean, or their
        sum over `denominator` (see ZooModel.loss).

        A Mixture-of-Experts model adds, from the same forward, aux_loss_coef x the load-balancing loss over the
        pack's tokens (aux_loss "batch": transformers' `load_balancing_loss_func`, what its ForCausalLM adds with
        output_router_logits; "per-document": the same statistic within each document, averaged) and
        z_loss_coef x the router z-loss. With a `denominator` they are weighted by this pack's share of it (its
        targets over the denominator), so that the packs of a step add up to their target-weighted mean.
        `parts`, where given, receives the terms without their coefficients, detached (what a recipe logs): "ce",
        "aux_loss", "z_loss" (each weighted as the loss is), "expert_counts" ([MoE layers, E] top-k choices)."""
        return routed_loss(self, packed, lambda: self.hidden(packed, x_TD), self.labels, denominator=denominator,
                           aux_loss_coef=aux_loss_coef, aux_loss=aux_loss, z_loss_coef=z_loss_coef, parts=parts)


def routed_loss(decoder: Decoder, packed: Packed, hidden: Callable[[], Tensor], rule: Callable[[Packed], Tensor], *,
                denominator: int | None, aux_loss_coef: float, aux_loss: str, z_loss_coef: float,
                parts: dict[str, Tensor] | None) -> Tensor:
    """Decoder.loss of the final hidden states `hidden()` makes (a vision-language model's: its images written in)
    under the target `rule`, with the balancing terms of `decoder`'s MoE layers from the same forward."""
    labels_T = packed.targets(rule)  # before the forward: a pack without labels fails at once
    if aux_loss not in ("batch", "per-document"):
        raise ZooError(f"aux_loss must be 'batch' or 'per-document', got {aux_loss!r}")
    moes = [m for m in decoder.modules() if isinstance(m, MoE)]
    if not moes and (aux_loss_coef or z_loss_coef):
        raise ZooError(f"a load-balancing or router z-loss needs MoE layers; this {decoder.family} model has none")
    with decoder.recording_router(enabled=parts is not None or bool(aux_loss_coef or z_loss_coef)) as records:
        h_TD = hidden()
    n = packed.count_targets(rule) if denominator is None else denominator
    loss = ce = linear_cross_entropy(h_TD, decoder.head_weight, labels_T, n, softcap=decoder.final_softcap)
    if parts is not None:
        parts["ce"] = ce.detach()
    if not records:
        return loss
    # the balancing terms weigh as this pack's targets weigh in the denominator (a shard counts its whole pack's)
    share = 1.0 if denominator is None else packed.count_targets(rule) / denominator
    return loss + balancing_terms(moes, [r[0] for r in records], packed, share, aux_loss_coef, aux_loss, z_loss_coef,
                                  parts)
