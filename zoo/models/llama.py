"""Llama 2 / 3 / 3.1 / 3.2 over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama-2 is MHA with theta 1e4; Llama-3 adds GQA and theta 5e5; 3.1 the "llama3" RoPE scaling; 3.2 ties the
output head to the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.attention import AttentionFn, get_attention
from zoo.errors import ZooError
from zoo.family import Family, rename_plans, token_ids_from_hf, token_ids_to_hf
from zoo.layers import RMSNorm, Rotary, SwiGLU, apply_rope, rope_kind
from zoo.loss import linear_cross_entropy
from zoo.packing import Packed, as_packed


@dataclass(frozen=True)
class LlamaConfig:
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
    attention_bias: bool = False
    mlp_bias: bool = False
    # the checkpoint's special-token ids (eos: where generation stops); not architecture, so not compared
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))  # a JSON list
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        rope_kind(self.rope_scaling)  # an unsupported scaling fails with the config, not when the model is built
        if self.n_heads % self.n_kv_heads:
            raise ZooError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool,
                 attend: AttentionFn) -> None:
        super().__init__()
        D, N, K, H = dim, n_heads, n_kv_heads, head_dim
        self.head_dim = H
        self.q_proj = nn.Linear(D, N * H, bias=bias)
        self.k_proj = nn.Linear(D, K * H, bias=bias)
        self.v_proj = nn.Linear(D, K * H, bias=bias)
        self.o_proj = nn.Linear(N * H, D, bias=bias)
        self.attend = attend

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        T, H = x_TD.shape[0], self.head_dim
        q_TNH = apply_rope(self.q_proj(x_TD).view(T, -1, H), cos_TH, sin_TH)
        k_TKH = apply_rope(self.k_proj(x_TD).view(T, -1, H), cos_TH, sin_TH)
        v_TKH = self.v_proj(x_TD).view(T, -1, H)
        o_TNH = self.attend(q_TNH, k_TKH, v_TKH, packed)
        return self.o_proj(o_TNH.reshape(T, -1))


class Block(nn.Module):
    """Pre-norm attention + SwiGLU. InternLM2 builds the same block (its config has no mlp_bias: it passes False)."""

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int, norm_eps: float,
                 attention_bias: bool, mlp_bias: bool, attend: AttentionFn) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = Attention(dim, n_heads, n_kv_heads, head_dim, attention_bias, attend)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = SwiGLU(dim, ffn_dim, bias=mlp_bias)

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        x_TD = x_TD + self.attn(self.attn_norm(x_TD), cos_TH, sin_TH, packed)
        return x_TD + self.mlp(self.mlp_norm(x_TD))


class Llama(nn.Module):
    family = "llama"

    def __init__(self, config: LlamaConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.attend = attend = get_attention(attn)  # the attention function every layer calls; see set_attention
        # _weight skips nn.Embedding's normal_() init, which on meta drags in torch._refs (a second of imports)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(
            Block(dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  ffn_dim=cfg.ffn_dim, norm_eps=cfg.norm_eps, attention_bias=cfg.attention_bias,
                  mlp_bias=cfg.mlp_bias, attend=attend)
            for _ in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @property
    def head_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    # the contract's glue (zoo.contract.ZooModel), repeated in each family on purpose: a family file reads alone
    def set_attention(self, attn: str | AttentionFn) -> None:
        """Swap the attention function of every layer (a backend name, or a wrapper from zoo.parallel)."""
        self.attend = attend = get_attention(attn)
        for m in self.modules():
            if isinstance(m, Attention):
                m.attend = attend

    def labels(self, packed: Packed) -> Tensor:
        """Which tokens are targets: the pack's next-token labels, every one (the contract's target rule)."""
        return packed.require_labels()

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules FSDP shards as units of their own besides the blocks in `layers`: none."""
        return []

    def hidden(self, packed: Packed, x_TD: Tensor | None = None) -> Tensor:
        """Final normed hidden states [T, D]; x_TD replaces the token embeddings (LLaVA writes images into it)."""
        if x_TD is None:
            packed.check_ids(self.config.vocab_size)
            x_TD = self.embed(packed.input_ids)
        cos_TH, sin_TH = self.rotary(packed.position_ids, x_TD.dtype)
        for layer in self.layers:
            x_TD = layer(x_TD, cos_TH, sin_TH, packed)
        return self.norm(x_TD)

    def forward(self, input_ids: Tensor | Packed, cu_seqlens: Tensor | None = None,
                x_TD: Tensor | None = None) -> Tensor:
        """logits [T, V] for input_ids [T] with cu_seqlens [n+1] (or a Packed)."""
        h_TD = self.hidden(as_packed(input_ids, cu_seqlens), x_TD)
        return F.linear(h_TD, self.head_weight)

    def loss(self, packed: Packed, x_TD: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy over packed.labels != -100, the head applied in chunks."""
        labels_T = packed.require_labels()  # before the forward: a pack without labels fails at once
        return linear_cross_entropy(self.hidden(packed, x_TD), self.head_weight, labels_T, packed.loss_denominator())


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


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ZooError(f"Llama with hidden_act={hf['hidden_act']!r} is not supported (expected 'silu')")
    # transformers 5 writes rope_theta/rope_scaling into one rope_parameters dict; hub configs keep them apart
    rope = dict(hf.get("rope_parameters") or {})
    nested_theta: float = rope.pop("rope_theta", 10000.0)  # popped either way: what stays in `rope` is the scaling
    theta = hf.get("rope_theta", nested_theta)
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    n_heads = hf["num_attention_heads"]
    return LlamaConfig(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=dict(scaling) if scaling else None,
        max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        **token_ids_from_hf(hf),
    )


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": "silu",
        **token_ids_to_hf(cfg),
    }


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

FAMILY = Family("llama", LlamaConfig, Llama, ("llama",), config_from_hf, config_to_hf, plan_from_hf, plan_to_hf)
