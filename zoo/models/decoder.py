"""The decoder every text family runs: embeddings, pre-norm blocks of attention + SwiGLU, a final norm, the head.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama, Qwen2, Qwen3, Mistral, InternLM2 and OpenELM differ only in what their config says of each layer (a
`LayerSpec`: head counts, biases, a norm over each q/k head, a sliding window) and in their rotary (plain, Llama 3's
scaling, InternLM2's dynamic NTK, OpenELM's fp32 rotation). Each family's file holds its config, its Hugging Face
names and its conversions; the module tree and the forward are this one, so a family is one file of knowledge, not
one more copy of the model. The contract's glue (`zoo.core.contract.ZooModel`) is written here once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops, get_attention
from zoo.core.contract import DecoderConfig, LayerSpec, PerLayerAttention
from zoo.core.layers import RMSNorm, SwiGLU, apply_rope
from zoo.core.loss import linear_cross_entropy
from zoo.core.packing import Packed, as_packed
from zoo.errors import ZooError


class Attention(nn.Module):
    """q/k/v projections, the rotary, the attention function installed in this layer (`attend`), the output
    projection. `layer` is the block's index in the decoder: a per-layer attention function is picked by it."""

    attend: AttentionFn  # installed by Decoder.set_attention

    def __init__(self, dim: int, spec: LayerSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        D, N, K, H = dim, spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.head_dim, self.window, self.layer = H, spec.window, layer
        self.q_proj = nn.Linear(D, N * H, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(D, K * H, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(D, K * H, bias=spec.qkv_bias)
        self.q_norm = RMSNorm(H, norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(H, norm_eps) if spec.qk_norm else None
        self.o_proj = nn.Linear(N * H, D, bias=spec.o_bias)

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        T, H = x_TD.shape[0], self.head_dim
        q_TNH = self.q_proj(x_TD).view(T, -1, H)
        k_TKH = self.k_proj(x_TD).view(T, -1, H)
        v_TKH = self.v_proj(x_TD).view(T, -1, H)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (LayerSpec.qk_norm)
            q_TNH, k_TKH = self.q_norm(q_TNH), self.k_norm(k_TKH)
        # rotated in the dtype of cos/sin (a no-op cast for all but OpenELM, which rotates in fp32), cast back
        q_TNH = apply_rope(q_TNH.to(cos_TH.dtype), cos_TH, sin_TH).to(x_TD.dtype)
        k_TKH = apply_rope(k_TKH.to(cos_TH.dtype), cos_TH, sin_TH).to(x_TD.dtype)
        if self.window is None:
            o_TNH = self.attend(q_TNH, k_TKH, v_TKH, packed)
        else:
            o_TNH = self.attend(q_TNH, k_TKH, v_TKH, packed, window=self.window)
        return self.o_proj(o_TNH.reshape(T, -1))


class Block(nn.Module):
    """Pre-norm attention + SwiGLU."""

    def __init__(self, dim: int, spec: LayerSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = Attention(dim, spec, norm_eps, layer)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = SwiGLU(dim, spec.ffn_dim, bias=spec.mlp_bias)

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        x_TD = x_TD + self.attn(self.attn_norm(x_TD), cos_TH, sin_TH, packed)
        return x_TD + self.mlp(self.mlp_norm(x_TD))


class Decoder(nn.Module):
    """A text family's model: what `zoo.load` returns for Llama, Qwen2, Qwen3, Mistral, InternLM2 and OpenELM."""

    def __init__(self, config: DecoderConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        # _weight skips nn.Embedding's normal_() init, which on meta drags in torch._refs (a second of imports)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg.dim, spec, cfg.norm_eps, i) for i, spec in enumerate(cfg.layer_specs()))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rotary = cfg.rotary()
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
        for attention in self._attentions():
            attention.attend = attend.for_layer(attention.layer) if isinstance(attend, PerLayerAttention) else attend

    def labels(self, packed: Packed) -> Tensor:
        """Which tokens are targets: the pack's next-token labels, every one (the contract's target rule)."""
        return packed.require_labels()

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules FSDP shards as units of their own besides the blocks in `layers`: none."""
        return []

    def encoder_flops(self, n_images: int) -> list[tuple[int, int, nn.Module]]:
        """No encoder below the decoder (see zoo.train.flops)."""
        return []

    def attention_flops(self, seqlens: Sequence[int]) -> int:
        """Forward FLOPs of every layer's attention over documents of these lengths (each layer's heads, window)."""
        return sum(attention_flops(seqlens, a.q_proj.out_features // a.head_dim, a.head_dim, window=a.window)
                   for a in self._attentions())

    def _attentions(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def hidden(self, packed: Packed, x_TD: Tensor | None = None) -> Tensor:
        """Final normed hidden states [T, D]; x_TD replaces the token embeddings (LLaVA writes images into it)."""
        if x_TD is None:
            if packed.pixel_values is not None:
                raise ZooError(f"a {self.family} model takes no images; this pack carries "
                               f"{packed.pixel_values.shape[0]} (a LLaVA checkpoint reads them)")
            packed.check_ids(self.config.vocab_size)
            x_TD = self.embed(packed.input_ids)
        cos_TH, sin_TH = self.rotary(packed, x_TD.dtype)
        for layer in self.layers:
            x_TD = layer(x_TD, cos_TH, sin_TH, packed)
        return self.norm(x_TD)

    def forward(self, input_ids: Tensor | Packed, cu_seqlens: Tensor | None = None,
                x_TD: Tensor | None = None) -> Tensor:
        """logits [T, V] for input_ids [T] with cu_seqlens [n+1] (or a Packed)."""
        h_TD = self.hidden(as_packed(input_ids, cu_seqlens), x_TD)
        return F.linear(h_TD, self.head_weight)

    def loss(self, packed: Packed, x_TD: Tensor | None = None, *, denominator: int | None = None) -> Tensor:
        """Next-token cross-entropy over the pack's labels != -100, the head applied in chunks: their mean, or their
        sum over `denominator` (see ZooModel.loss)."""
        labels_T = packed.targets(self.labels)  # before the forward: a pack without labels fails at once
        h_TD = self.hidden(packed, x_TD)
        n = packed.count_targets(self.labels) if denominator is None else denominator
        return linear_cross_entropy(h_TD, self.head_weight, labels_T, n)
