"""Qwen3-Next over a packed batch: Qwen3NextForCausalLM (Qwen3-Next-80B-A3B).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, E experts, F an expert's width;
Hk / Hv the Gated DeltaNet's key / value heads, Dk / Dv their dims, r = Hv / Hk.
Qwen3.5's hybrid (zoo.models.qwen3_5: of every `full_attention_interval` layers the last is gated attention and the
others Gated DeltaNet, by `layer_types`; zero-centred (1 + w) norms in fp32; the partial rotary, here plain RoPE
over the first quarter of each head) over Qwen3.5-MoE's block (zoo.models.qwen3_5_moe: a router over
`num_experts` SwiGLU experts and a shared expert times sigmoid of its gate), with what Qwen3-Next's config adds:
`norm_topk_prob` (renormalising the top-k weights or not), and Qwen3-MoE's `mlp_only_layers` /
`decoder_sparse_step`, whose dense layers run a gated MLP of `intermediate_size`. The model is the shared decoder.

Tensor names: Qwen3.5's, but for two fused projections of each Gated DeltaNet layer, which zoo holds as Qwen3.5's
plain ones: `in_proj_qkvz` holds per key head [q (Dk rows), k (Dk), v (r Dv), z (r Dv)] ([Hk, 2 Dk + 2 r Dv, D]),
zoo's `in_proj_qkv` ([q; k; v], heads in order: value head j of key head j // r) and `in_proj_z`; `in_proj_ba`
holds per key head [b (r rows), a (r)], zoo's `in_proj_b` and `in_proj_a`. Split on load and joined on export by
`split_qkvz` / `join_qkvz` (rows only: bit-exact both ways). The experts and routers: Qwen3.5-MoE's plans. The
published checkpoints also hold the multi-token-prediction head (`mtp.*`), which zoo leaves out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from zoo.core.contract import DecoderSpec, MLPSpec, MoESpec
from zoo.models import qwen3_5
from zoo.models.decoder import Decoder
from zoo.models.family import Plan, family
from zoo.models.qwen3_5_moe import plan_from_hf as moe_plan_from_hf
from zoo.models.qwen3_5_moe import plan_to_hf as moe_plan_to_hf
from zoo.models.qwen3_moe import (
    MOE_POSITIVE,
    experts_from_hf,
    finish_moe_config,
    mlp_only_from_hf,
    refuse_router_bias,
    sparse_layers_of,
)


@dataclass(frozen=True)
class Qwen3NextConfig:
    """Defaults are transformers' Qwen3NextConfig's, token ids aside (rope_theta: its default RoPE base)."""

    family: ClassVar[str] = "qwen3_next"
    positive: ClassVar[frozenset[str]] = qwen3_5.Qwen3_5Config.positive | MOE_POSITIVE | {
        "shared_expert_ffn_dim", "decoder_sparse_step"}
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    ffn_dim: int = 5632  # the dense layers' MLP (mlp_only_layers, decoder_sparse_step)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int = 64  # head_dim * partial_rotary_factor
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()  # per layer, FULL or LINEAR; (): transformers' interval of 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    n_experts: int = 512
    top_k: int = 10
    expert_ffn_dim: int = 512
    shared_expert_ffn_dim: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_bias: bool = False  # zoo's own (aux-loss-free balancing); not exported to transformers
    router_aux_loss_coef: float = field(default=0.001, compare=False)
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_moe_config(self)
        qwen3_5.finish_hybrid(self)

    def sparse_layers(self) -> tuple[bool, ...]:
        return sparse_layers_of(self.n_layers, self.n_experts, self.decoder_sparse_step, self.mlp_only_layers)

    def decoder_spec(self) -> DecoderSpec:
        moe = MoESpec(self.n_experts, self.top_k, self.expert_ffn_dim, norm_topk=self.norm_topk_prob,
                      shared_ffn_dim=self.shared_expert_ffn_dim, router_bias=self.router_bias)
        spec = qwen3_5.hybrid_spec(self, moe)
        dense = MLPSpec(self.ffn_dim)
        layers = tuple(layer if sparse else replace(layer, mlp=dense)
                       for layer, sparse in zip(spec.layers, self.sparse_layers()))
        return replace(spec, layers=layers)


def config_from_hf(hf: dict[str, Any]) -> Qwen3NextConfig:
    """A Qwen3NextForCausalLM config.json ("qwen3_next")."""
    return Qwen3NextConfig(
        **qwen3_5.hybrid_fields_from_hf(hf, "Qwen3-Next"), **experts_from_hf(hf, "Qwen3-Next"),
        ffn_dim=hf.get("intermediate_size", 5632), expert_ffn_dim=hf.get("moe_intermediate_size", 512),
        shared_expert_ffn_dim=hf.get("shared_expert_intermediate_size", 512),
        norm_topk_prob=hf.get("norm_topk_prob", True), decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=mlp_only_from_hf(hf), router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(cfg: Qwen3NextConfig) -> dict[str, Any]:
    """A Qwen3NextForCausalLM config.json."""
    refuse_router_bias(cfg, "Qwen3NextForCausalLM")
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            **qwen3_5.hybrid_fields_to_hf(cfg), "intermediate_size": cfg.ffn_dim, "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_ffn_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
            "router_aux_loss_coef": cfg.router_aux_loss_coef}


# ---- Hugging Face names: the fused in_proj_qkvz / in_proj_ba, the rest as Qwen3.5-MoE names it ----

_FUSED = re.compile(r"layers\.(\d+)\.attn\.in_proj_(qkv|z|b|a)\.weight")


def _widths(cfg: Qwen3NextConfig) -> tuple[int, int, int]:
    """(Hk, Dk, r Dv): per key head, q and k rows each, then v and z rows each."""
    Hk = cfg.linear_key_heads
    return Hk, cfg.linear_key_head_dim, cfg.linear_value_heads // Hk * cfg.linear_value_head_dim


def split_qkvz(cfg: Qwen3NextConfig, which: str, fused: Tensor) -> Tensor:
    """zoo's in_proj_qkv, _z, _b or _a rows (`which`) of transformers' in_proj_qkvz or in_proj_ba (the module
    docstring), contiguous; any trailing shape (a weight's [.., D], a LoRA B's [.., rank])."""
    Hk, Dk, rDv = _widths(cfg)
    rest = fused.shape[1:]
    if which in ("b", "a"):
        per = fused.view(Hk, 2, -1, *rest)
        return per[:, "ba".index(which)].reshape(-1, *rest).contiguous()
    per = fused.view(Hk, 2 * Dk + 2 * rDv, *rest)
    if which == "z":
        return per[:, 2 * Dk + rDv:].reshape(-1, *rest).contiguous()
    q, k, v = per[:, :Dk], per[:, Dk:2 * Dk], per[:, 2 * Dk:2 * Dk + rDv]
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v)])


def join_qkvz(cfg: Qwen3NextConfig, parts: list[Tensor]) -> Tensor:
    """The inverse of split_qkvz: [in_proj_qkv, in_proj_z] -> in_proj_qkvz, [in_proj_b, in_proj_a] -> in_proj_ba."""
    Hk, Dk, rDv = _widths(cfg)
    first, second = parts
    rest = first.shape[1:]
    if first.shape[0] == second.shape[0]:  # b and a: r rows each per key head
        return torch.stack([first.view(Hk, -1, *rest), second.view(Hk, -1, *rest)], dim=1).reshape(-1, *rest)
    q, k, v = first.split([Hk * Dk, Hk * Dk, Hk * rDv])
    per = [q.view(Hk, Dk, *rest), k.view(Hk, Dk, *rest), v.view(Hk, rDv, *rest), second.view(Hk, rDv, *rest)]
    return torch.cat(per, dim=1).reshape(-1, *rest)


def _hf_fused(layer: str, which: str) -> str:
    fused = "qkvz" if which in ("qkv", "z") else "ba"
    return f"model.layers.{layer}.linear_attn.in_proj_{fused}.weight"


def plan_from_hf(cfg: Qwen3NextConfig, zoo_names: list[str]) -> Plan:
    plan = moe_plan_from_hf(cfg, [z for z in zoo_names if not _FUSED.fullmatch(z)])  # type: ignore[arg-type]
    for z in zoo_names:
        if m := _FUSED.fullmatch(z):
            plan[z] = ((_hf_fused(m[1], m[2]),), _splitter(cfg, m[2]))
    return plan


def _splitter(cfg: Qwen3NextConfig, which: str) -> Callable[[list[Tensor]], Tensor]:
    return lambda ts: split_qkvz(cfg, which, ts[0])


def plan_to_hf(cfg: Qwen3NextConfig, zoo_names: list[str]) -> Plan:
    plan = moe_plan_to_hf(cfg, [z for z in zoo_names if not _FUSED.fullmatch(z)])  # type: ignore[arg-type]
    for z in zoo_names:
        if (m := _FUSED.fullmatch(z)) and m[2] in ("qkv", "b"):
            second = "z" if m[2] == "qkv" else "a"
            plan[_hf_fused(m[1], m[2])] = ((z, z.replace(f"in_proj_{m[2]}.", f"in_proj_{second}.")),
                                          lambda ts: join_qkvz(cfg, ts))
    return plan


# LoRA `auto` (PEFT has no default for qwen3_next): the attention's q and v and the Gated DeltaNet's fused
# in_proj_qkvz by its Hugging Face name (zoo's in_proj_qkv and in_proj_z sharing one A, as PEFT's adapter on the fused
# module), so the adapter is written in PEFT's layout; experts and routers stay frozen
FAMILY = family("qwen3_next", Qwen3NextConfig, ("qwen3_next",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj", "in_proj_qkvz"), hf_left_out=("mtp.",),
                left_out_why="qwen3_next: its multi-token-prediction head (mtp.*) is left out")
