"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight) over a packed batch, as a decoder block's
mixer.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N heads, Q the query latent
(q_lora_rank), L the key/value latent (kv_lora_rank), P a head's no-rope dims (qk_nope_head_dim), R its rope dims
(qk_rope_head_dim), V its value dims (v_head_dim), C the generation cache's capacity, n sequences.

Queries: x -> q_a_proj [Q] -> RMSNorm -> q_b_proj [N, P + R] (or one q_proj where q_lora_rank is null). Keys and
values: x -> kv_a_proj_with_mqa [L + R], the latent normed (kv_a_layernorm) and expanded by kv_b_proj to each head's
no-rope key [P] and value [V]; the R rope dims of the key are one for all heads. The rotary turns the R rope dims of
q and k (interleaved pairs where the config says `rope_interleave`), the softmax scale is (P + R) ** -0.5 times
YaRN's mscale correction where the config has one. The latent RMSNorms use eps 1e-6 whatever rms_norm_eps says, as
transformers builds them.

Attention runs through the installed attention function (`attend`, zoo.core.attention's signature), so every
backend, sequence parallelism (Ulysses, ring, hybrid: their wrappers around `attend`) and activation checkpointing
see an ordinary attention call. Keys are P + R wide and values V: each value head is zero-padded to P + R before the
call and the output cut back to V, so every backend and wrapper takes one head width (the padded columns add
(P + R - V) / V to the p.v product, nothing to the result).

Generation (zoo.generate, through `use_cache`): the cache holds per token the normed latent [L] and the turned rope
key [R] (`generation_bytes`), not keys and values of N heads (N (P + R + V) per token: 71x the latent's at
DeepSeek-V3's shape). The prefill attends over its prompts as in training (zoo.core.attention.auto, on whole
documents) and writes their latents; a decode step absorbs kv_b_proj into the query and the output: the query's
no-rope part times each head's key block of kv_b_proj is a query in latent space, scored against the cached latents
(plus the rope dims against the cached rope keys), and the probabilities times the latents, times each head's value
block, are the output. kv_b_proj's weight is used as it is; a LoRA or quantised kv_b_proj is read once per generation
through the module itself (its product with the identity, a copy of the weight's size), so it decodes with what it
computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops, auto
from zoo.core.contract import ROPE_LAYOUTS, MLASpec, NormSpec
from zoo.core.layers import RMSNorm, apply_rope
from zoo.core.mixer import HeadExchange, MixerCache
from zoo.core.packing import Packed
from zoo.errors import ZooError

LATENT_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm are built with


def mla_cache_bytes(kv_rank: int, rope_dim: int, itemsize: int) -> int:
    """Bytes per token and layer of MLA's generation cache: the latent and the rope key."""
    return (kv_rank + rope_dim) * itemsize


def expanded_cache_bytes(n_heads: int, nope_dim: int, rope_dim: int, v_dim: int, itemsize: int) -> int:
    """Bytes per token and layer of a cache of expanded keys and values (what transformers' static cache of an
    ordinary attention layer of these widths would hold)."""
    return n_heads * (nope_dim + rope_dim + v_dim) * itemsize


class MLA(nn.Module):
    """Multi-head latent attention (the module names are transformers' DeepseekV3Attention's); a
    `zoo.core.mixer.Mixer` whose training state lives in the installed attention function and whose generation
    state is its own latent cache (`use_cache`)."""

    attend: AttentionFn  # installed by Decoder.set_attention

    def __init__(self, dim: int, spec: MLASpec, norm: NormSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        N, P, R, V, L = spec.n_heads, spec.nope_dim, spec.rope_dim, spec.v_dim, spec.kv_rank
        if spec.rope_layout not in ROPE_LAYOUTS:
            raise ZooError(f"rope_layout must be one of {', '.join(ROPE_LAYOUTS)}, got {spec.rope_layout!r}")
        if R % 2:
            raise ZooError(f"qk_rope_head_dim must be even (the rotary turns pairs of dims), got {R}")
        self.layer, self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = layer, N, P, R, V, L
        self.rope_layout = spec.rope_layout
        self.scale = (P + R) ** -0.5 if spec.scale is None else spec.scale
        if spec.q_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(dim, N * (P + R), bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(dim, spec.q_rank, bias=spec.bias)
            self.q_a_layernorm = RMSNorm(spec.q_rank, LATENT_EPS)
            self.q_b_proj = nn.Linear(spec.q_rank, N * (P + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, L + R, bias=spec.bias)
        self.kv_a_layernorm = RMSNorm(L, LATENT_EPS)
        self.kv_b_proj = nn.Linear(L, N * (P + V), bias=False)
        self.o_proj = nn.Linear(N * V, dim, bias=spec.bias)
        self.cache: MixerCache | None = None  # generation's (use_cache)
        self._absorbed: Tensor | None = None  # kv_b_proj's weight [N, P + V, L] during a generation

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        T, N, P, R, V = x_TD.shape[0], self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        if self.q_proj is not None:
            q = self.q_proj(x_TD)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        q_nope_TNP, q_pe_TNR = q.view(T, N, P + R).split([P, R], dim=-1)
        latent_TL, k_pe_TR = self.kv_a_proj_with_mqa(x_TD).split([self.kv_rank, R], dim=-1)
        latent_TL = self.kv_a_layernorm(latent_TL)
        q_pe_TNR = apply_rope(q_pe_TNR.to(cos_TH.dtype), cos_TH, sin_TH, self.rope_layout).to(x_TD.dtype)
        k_pe_T1R = apply_rope(k_pe_TR[:, None].to(cos_TH.dtype), cos_TH, sin_TH, self.rope_layout).to(x_TD.dtype)
        if self.cache is not None and packed.doc_len is not None:  # a decode step: one token a sequence
            o_TNV = self._decode(self.cache, q_nope_TNP, q_pe_TNR, latent_TL, k_pe_T1R[:, 0], packed)
            return self.o_proj(o_TNV.reshape(T, N * V))
        attend = self.attend
        if self.cache is not None:  # the prefill: whole prompts, their latents kept
            self._prefill(self.cache, latent_TL, k_pe_T1R[:, 0], packed)
            attend = auto
        k_nope_TNP, v_TNV = self.kv_b_proj(latent_TL).view(T, N, P + V).split([P, V], dim=-1)
        q_TNH = torch.cat([q_nope_TNP, q_pe_TNR], dim=-1)
        k_TNH = torch.cat([k_nope_TNP, k_pe_T1R.expand(T, N, R)], dim=-1)
        H = max(P + R, V)  # one head width for q, k and v: the narrower zero-padded (exact; see the module doc)
        q_TNH, k_TNH, v_TNH = (F.pad(t, (0, H - t.shape[-1])) if t.shape[-1] < H else t
                               for t in (q_TNH, k_TNH, v_TNV))
        o_TNH = attend(q_TNH, k_TNH, v_TNH, packed, scale=self.scale)
        return self.o_proj(o_TNH[..., :V].reshape(T, N * V))

    # ---- generation: the latent cache ----

    def _prefill(self, cache: MixerCache, latent_TL: Tensor, k_pe_TR: Tensor, packed: Packed) -> None:
        """Each prompt's latents and rope keys into rows 0.. of its sequence's [C, L] and [C, R] buffers, and
        kv_b_proj's weight as this generation decodes with it."""
        n, C = packed.num_docs, cache.capacity
        lens = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
        doc_T = torch.repeat_interleave(torch.arange(n, device=latent_TL.device), lens.long())
        pos_T = packed.position_ids.long()
        latent_nCL = latent_TL.new_zeros(n, C, self.kv_rank)
        k_pe_nCR = k_pe_TR.new_zeros(n, C, self.rope_dim)
        latent_nCL[doc_T, pos_T] = latent_TL
        k_pe_nCR[doc_T, pos_T] = k_pe_TR
        cache.keep(self.layer, "latent", latent_nCL)
        cache.keep(self.layer, "rope_key", k_pe_nCR)
        shape = (self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        if type(self.kv_b_proj) is nn.Linear:  # its weight as it is (a view: no copy)
            self._absorbed = self.kv_b_proj.weight.view(shape)
        else:  # a LoRA or quantised kv_b_proj: its own product with the identity, [L, N (P + V)], transposed
            eye_LL = torch.eye(self.kv_rank, dtype=latent_TL.dtype, device=latent_TL.device)
            self._absorbed = self.kv_b_proj(eye_LL).T.reshape(shape)

    def _decode(self, cache: MixerCache, q_nope_nNP: Tensor, q_pe_nNR: Tensor, latent_nL: Tensor, k_pe_nR: Tensor,
                packed: Packed) -> Tensor:
        """[n, N, V] one token a sequence at row position_ids, attending in latent space over the rows up to it
        (the whole capacity with a mask: the same shapes every step, no host sync, so a compiled step captures it)."""
        if self._absorbed is None:
            raise ZooError("an MLA decode step needs the prefill first (the latent cache is empty)")
        latent_nCL, k_pe_nCR = cache.kept(self.layer, "latent"), cache.kept(self.layer, "rope_key")
        n, P = q_nope_nNP.shape[0], self.nope_dim
        position_n = packed.position_ids.long()
        rows_n = torch.arange(n, device=position_n.device)
        latent_nCL[rows_n, position_n] = latent_nL
        k_pe_nCR[rows_n, position_n] = k_pe_nR
        w_k_NPL, w_v_NVL = self._absorbed[:, :P], self._absorbed[:, P:]
        q_lat_nNL = torch.einsum("bhp,hpl->bhl", q_nope_nNP, w_k_NPL)
        scores_nNC = (q_lat_nNL @ latent_nCL.transpose(1, 2) + q_pe_nNR @ k_pe_nCR.transpose(1, 2)) * self.scale
        visible_n1C = (torch.arange(latent_nCL.shape[1], device=position_n.device) <= position_n[:, None])[:, None]
        scores_nNC = scores_nNC.masked_fill(~visible_n1C, float("-inf"))
        probs_nNC = torch.softmax(scores_nNC, dim=-1, dtype=torch.float32).to(q_nope_nNP.dtype)
        return torch.einsum("bhl,hvl->bhv", probs_nNC @ latent_nCL, w_v_NVL)

    # ---- the Mixer contract ----

    def generation_bytes(self, n: int, capacity: int, itemsize: int) -> int:
        """The latent and the rope key of every row of every sequence (not N heads of keys and values)."""
        return n * capacity * mla_cache_bytes(self.kv_rank, self.rope_dim, itemsize)

    def use_cache(self, cache: MixerCache | None) -> None:
        self.cache = cache
        self._absorbed = None

    def sequence_parallel(self, exchange: HeadExchange | None, mode: str) -> None:
        """Nothing: attention goes through the installed function, which sequence parallelism wraps (any mode); the
        latents are per token."""

    def kernel_choice(self, device: torch.device, dtype: torch.dtype) -> str:
        H, V = max(self.nope_dim + self.rope_dim, self.v_dim), self.v_dim
        pad = f", values zero-padded from {V} to {H} dims" if V < H else ""
        return (f"multi-head latent attention through the installed function "
                f"({getattr(self.attend, '__name__', 'custom')}): q/k heads of {self.nope_dim}+{self.rope_dim} "
                f"dims{pad}; generation: a latent cache, kv_b_proj absorbed into query and output")

    def mixing_flops(self, seqlens: Sequence[int]) -> int:
        """q.k over P + R dims and p.v over V, on each document's causal pairs (the language model's
        attention_flops counts softmax-attention layers only)."""
        pairs = attention_flops(seqlens, 1, 1) // 4
        return 2 * self.n_heads * (self.nope_dim + self.rope_dim + self.v_dim) * pairs
