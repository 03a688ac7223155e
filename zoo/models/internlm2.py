"""InternLM2 / InternLM2.5 over a packed batch.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
With the fused `wqkv` declared in the name table (split into q/k/v on load, joined on export), the model is the
shared decoder (zoo.models.decoder); what differs is the rotary: theta 1e6 and, with `rope_scaling: {type:
dynamic}`, dynamic NTK scaling, which rescales the RoPE base from the length of the sequence when it exceeds
`max_position_embeddings`. Upstream measures that length on the whole forward; zoo measures it per document, so
every document of a pack gets exactly what it would get run alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import rope_cos_sin, rope_inv_freq
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import (
    Fused,
    NameTable,
    as_tuple,
    family,
    join_fused,
    number,
    rename_plans,
    split_fused,
    token_ids_from_hf,
    token_ids_to_hf,
)


@dataclass(frozen=True)
class InternLM2Config:
    family: ClassVar[str] = "internlm2"
    positive: ClassVar[frozenset[str]] = frozenset({"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                                    "norm_eps", "rope_theta", "max_seq_len", "head_dim"})
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    vocab_size: int = 92544
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # {"type": "dynamic" | "linear", "factor": f}
    max_seq_len: int = 32768  # max_position_embeddings: where dynamic NTK scaling starts
    attention_bias: bool = False  # the HF config's `bias`; it covers wqkv and wo, never the feed-forward
    head_dim: int = 0  # always dim // n_heads (upstream has no separate head_dim); filled in
    # the checkpoint's special-token ids (eos: where generation stops); not architecture, so not compared
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", as_tuple(self.eos_token_ids))  # a JSON list
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim * self.n_heads != self.dim:
            raise ZooError(f"InternLM2 needs dim ({self.dim}) = n_heads ({self.n_heads}) * head_dim "
                             f"({self.head_dim}); upstream derives head_dim as dim // n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ZooError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind not in ("dynamic", "linear") or "factor" not in self.rope_scaling:
                raise ZooError(f"InternLM2 rope_scaling must be {{'type': 'dynamic' | 'linear', 'factor': f}} "
                                 f"(what upstream supports), got {self.rope_scaling}")

    @property
    def tie_embeddings(self) -> bool:
        return False  # upstream's `output` is never tied to `tok_embeddings`

    def decoder_spec(self) -> DecoderSpec:
        # upstream's `bias` covers wqkv and wo only: the feed-forward never has one
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                             o_bias=self.attention_bias)
        return DecoderSpec((LayerSpec(attn, MLPSpec(self.ffn_dim)),) * self.n_layers,
                           {"default": InternLM2Rotary(self)})


class InternLM2Rotary:
    """cos/sin per token: plain RoPE, linear scaling (positions / factor), or dynamic NTK per document.

    Dynamic NTK (upstream `InternLM2DynamicNTKScalingRotaryEmbedding`): a sequence of length L >
    max_position_embeddings uses, at ALL its positions, the base
        theta * (factor * L / max_position_embeddings - (factor - 1)) ** (H / (H - 2)).
    Upstream takes L = max(position_ids) + 1 of the forward; here L is each token's own document length
    (`packed.doc_len_per_token()`, which sequence-parallel shards set to the global document length).
    """

    def __init__(self, cfg: InternLM2Config) -> None:
        self.head_dim, self.theta, self.max_len = cfg.head_dim, cfg.rope_theta, cfg.max_seq_len
        scaling = cfg.rope_scaling or {}
        self.kind = scaling.get("type", scaling.get("rope_type", "default"))
        self.factor = float(scaling.get("factor", 1.0))
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        """[H/2] the plain frequencies, computed once per device."""
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.head_dim, self.theta).to(device)
        return self._inv_freq[device]

    def ntk_inv_freq(self, doc_len_T: Tensor) -> Tensor:
        """[T, H/2] frequencies from the rescaled base of each token's document, in upstream's fp32 op order."""
        H = self.head_dim
        base_T = self.theta * ((self.factor * doc_len_T / self.max_len) - (self.factor - 1)) ** (H / (H - 2))
        exponent = torch.arange(0, H, 2, dtype=torch.int64, device=doc_len_T.device).float() / H
        return 1.0 / (base_T[:, None] ** exponent)

    def longest_doc(self, packed: Packed) -> int:
        """The longest (global) document of the pack, which decides whether dynamic NTK scaling starts."""
        return max(packed.seqlens()) if packed.doc_len is None else int(packed.doc_len.max())

    def __call__(self, packed: Packed, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        position_ids_T = packed.position_ids
        inv_freq = self.inv_freq(position_ids_T.device)
        if self.kind == "linear":
            return rope_cos_sin(position_ids_T.float() / self.factor, inv_freq, dtype)
        # only past max_position_embeddings is a per-token [T, H/2] table worth building; short documents keep the
        # plain frequencies. Compiled code builds it always: deciding would be a host sync (where() decides instead)
        if self.kind == "dynamic" and (torch.compiler.is_compiling() or self.longest_doc(packed) > self.max_len):
            doc_len_T = packed.doc_len_per_token()
            long_T = doc_len_T > self.max_len
            scaled = self.ntk_inv_freq(doc_len_T.clamp(min=self.max_len))
            inv_freq = torch.where(long_T[:, None], scaled, inv_freq)
        return rope_cos_sin(position_ids_T, inv_freq, dtype)


InternLM2 = Decoder  # an InternLM2 is the shared decoder built from an InternLM2Config


# ---- Hugging Face names, the fused wqkv, config ----

HF_NAMES: NameTable = [  # (zoo prefix, HF prefix); {i} is the layer index
    Fused("model.layers.{i}.attention.wqkv.", ("layers.{i}.attn.q_proj.", "layers.{i}.attn.k_proj.",
                                               "layers.{i}.attn.v_proj."), layout="kv_groups"),
    ("embed.", "model.tok_embeddings."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.attention_norm."),
    ("layers.{i}.attn.o_proj.", "model.layers.{i}.attention.wo."),
    ("layers.{i}.mlp_norm.", "model.layers.{i}.ffn_norm."),
    ("layers.{i}.mlp.gate_proj.", "model.layers.{i}.feed_forward.w1."),
    ("layers.{i}.mlp.up_proj.", "model.layers.{i}.feed_forward.w3."),
    ("layers.{i}.mlp.down_proj.", "model.layers.{i}.feed_forward.w2."),
    ("norm.", "model.norm."),
    ("lm_head.", "output."),
]


def split_wqkv(wqkv: Tensor, which: str, cfg: InternLM2Config) -> Tensor:
    """q, k or v rows of the fused wqkv (the "kv_groups" layout of zoo.models.family.Fused)."""
    return split_fused(wqkv, "kv_groups", "qkv".index(which), 3, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim))


def merge_wqkv(q: Tensor, k: Tensor, v: Tensor, cfg: InternLM2Config) -> Tensor:
    """Inverse of split_wqkv: q/k/v back into upstream's per-KV-group layout."""
    return join_fused([q, k, v], "kv_groups", (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim))


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)


def config_from_hf(hf: dict[str, Any]) -> InternLM2Config:
    if hf.get("hidden_act", "silu") != "silu":
        raise ZooError(f"InternLM2 with hidden_act={hf['hidden_act']!r} is not supported (expected 'silu')")
    if hf.get("tie_word_embeddings", False):
        raise ZooError("InternLM2 with tie_word_embeddings=true is not supported (no published checkpoint ties "
                         "`output` to `tok_embeddings`)")
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ZooError(f"InternLM2 rope_scaling must be {{'type': 'dynamic' | 'linear', 'factor': f}} or null, "
                       f"got {scaling!r}")
    if scaling is not None:
        scaling = {"type": scaling.get("type", scaling.get("rope_type")), "factor": number(scaling.get("factor"))}
    n_heads = hf["num_attention_heads"]
    return InternLM2Config(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=number(hf.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        attention_bias=hf.get("bias", True),  # upstream's default is True
        **token_ids_from_hf(hf),
    )


def config_to_hf(cfg: InternLM2Config) -> dict[str, Any]:
    """The keys of the published config.json, auto_map included, so the upstream remote code loads the output."""
    return {
        "architectures": ["InternLM2ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_internlm2.InternLM2Config",
            "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
            "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
        },
        "model_type": "internlm2",
        "attn_implementation": "eager",
        "bias": cfg.attention_bias,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": cfg.dim,
        "initializer_range": 0.02,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": cfg.norm_eps,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_theta": int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        **token_ids_to_hf(cfg),  # the published ids (above) unless the checkpoint knows its own
    }


# LoRA's "auto": the fused wqkv (PEFT has no default for InternLM2), so the adapter can be written in PEFT's layout
FAMILY = family("internlm2", InternLM2Config, ("internlm2",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf, lora_targets=("wqkv",))
