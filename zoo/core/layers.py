"""What the families share exactly: RMSNorm and its variants, RoPE (half-split or interleaved) and its frequency
variants, the gated MLP (SwiGLU, GeGLU), init.

Shapes: T tokens, D model dim, H head dim, F FFN dim; `*_T?H` means any head count in the middle.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.errors import ZooError

if TYPE_CHECKING:
    from zoo.core.packing import Packed


class RMSNorm(nn.Module):
    """x / rms(x), computed in fp32, times (offset + weight). cast_first (Llama/HF's order): cast back to the input's
    dtype before the weight; else multiplied in fp32 and cast after (OLMo 2; Gemma, whose offset is 1)."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0, cast_first: bool = True) -> None:
        super().__init__()
        if cast_first and offset:
            raise ValueError("an RMSNorm with an offset weight multiplies in fp32 (cast_first=False)")
        self.eps, self.offset, self.cast_first = eps, offset, cast_first
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_first:
            return self.weight * x32.to(x.dtype)
        weight = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (x32 * weight).to(x.dtype)

    def reset_parameters(self) -> None:  # the identity: weight 1, or 0 under an offset of 1
        nn.init.constant_(self.weight, 1.0 - self.offset)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu,
                                                      "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (act silu), GeGLU (tanh gelu, Gemma)."""

    def __init__(self, dim: int, ffn_dim: int, bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ZooError(f"unknown MLP activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=bias)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=bias)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=bias)

    def forward(self, x_TD: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x_TD)) * self.up_proj(x_TD))


# (gate_RF, up_RF) -> the expert's hidden [R, F]: act(gate) * up, or GPT-OSS's clamped SwiGLU
Glu = Callable[[Tensor, Tensor], Tensor]


def gated(act: Callable[[Tensor], Tensor]) -> Glu:
    """act(gate) * up: SwiGLU (silu), GeGLU."""
    def glu(gate_RF: Tensor, up_RF: Tensor) -> Tensor:
        return act(gate_RF) * up_RF
    return glu


def clamped_swiglu(limit: float, alpha: float) -> Glu:
    """GPT-OSS's SwiGLU: gate clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate *
    sigmoid(alpha * gate), in transformers' order of operations (GptOssExperts._apply_gate)."""
    def glu(gate_RF: Tensor, up_RF: Tensor) -> Tensor:
        gate_RF = gate_RF.clamp(max=limit)
        up_RF = up_RF.clamp(min=-limit, max=limit)
        return (up_RF + 1) * (gate_RF * torch.sigmoid(gate_RF * alpha))
    return glu


# ---- rotary position embedding (rotate-half tables; the dims paired half-split or interleaved) ----


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """[H/2] the plain RoPE frequencies theta^(-2i/H), computed in fp32 like the upstream code."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> Tensor:
    """Llama 3.1's "llama3" scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    old_len = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_freq_factor) & (wavelen <= old_len / low_freq_factor)
    return torch.where(medium, smoothed, scaled)


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# each scaling and what it reads; "yarn" (DeepSeek-V3, Kimi K2) also reads beta_fast, beta_slow, mscale,
# mscale_all_dim, attention_factor and truncate where given
ROPE_KEYS = {"default": (), "llama3": LLAMA3_KEYS, "linear": ("factor",),
             "yarn": ("factor", "original_max_position_embeddings")}
# what the Llama-like families take (a family that has been tested with YaRN names it: rope_kind's `supported`)
LLAMA_ROPES = ("default", "llama3", "linear")


def rope_kind(scaling: dict[str, Any] | None, supported: tuple[str, ...] = LLAMA_ROPES) -> str:
    """"default", "llama3" or "linear" (positions divided by `factor`: Gemma 3's global layers), or another of
    `supported` ("yarn"), for an HF rope_scaling dict, else a ZooError naming what is supported."""
    scaling = scaling or {}
    if not isinstance(scaling, dict):
        raise ZooError(f"rope_scaling must be an object such as {{'rope_type': 'llama3', ...}} or null, "
                       f"got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in supported or kind not in ROPE_KEYS:
        raise ZooError(f"unsupported rope scaling {kind!r} for this model; supported: {', '.join(supported)}")
    missing = [k for k in ROPE_KEYS[kind] if k not in scaling]
    if missing:
        raise ZooError(f"rope scaling {kind} needs {', '.join(ROPE_KEYS[kind])}; missing {', '.join(missing)}")
    return str(kind)


class Rotary:
    """cos/sin tables for rotate-half RoPE at given positions; a plain object (no weights, nothing to load).

    `scaling` follows the HF config's `rope_scaling` dict: None, {"rope_type": "default"}, or
    {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}, or
    {"rope_type": "linear", factor}.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.head_dim = head_dim
        self.dtype = dtype  # what q and k are rotated in; None: the activations' dtype
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.kind = rope_kind(self.scaling, tuple(ROPE_KEYS))
        # YaRN multiplies cos and sin by its attention factor (transformers' `attention_scaling`); 1 for the others
        self.attention_factor = yarn_attention_factor(self.scaling) if self.kind == "yarn" else 1.0
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        """[H/2] the (scaled) frequencies, computed once per device."""
        if device not in self._inv_freq:
            inv = rope_inv_freq(self.head_dim, self.theta)
            s = self.scaling
            if self.kind == "llama3":
                inv = llama3_inv_freq(inv, s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                                      s["original_max_position_embeddings"])
            elif self.kind == "linear":
                inv = inv / s["factor"]
            elif self.kind == "yarn":
                inv = yarn_inv_freq(self.head_dim, self.theta, s)
            self._inv_freq[device] = inv.to(device)
        return self._inv_freq[device]

    def __call__(self, packed: Packed, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos_TH, sin_TH) at the pack's positions, computed in fp32, cast to `self.dtype` or the activations'."""
        position_ids_T = packed.position_ids
        return rope_cos_sin(position_ids_T, self.inv_freq(position_ids_T.device), self.dtype or dtype,
                            self.attention_factor)


class MRotary(Rotary):
    """Multimodal RoPE (Qwen2-VL on): each token has three positions (temporal, height, width), and each of the
    H/2 frequencies is turned by one of them. Qwen2-VL and Qwen2.5-VL split the frequencies in `sections` (of H/2,
    e.g. [16, 24, 24]), section i turned by position i % 3; Qwen3-VL and Qwen3.5 interleave them (`interleaved`):
    frequency j is turned by height where j % 3 == 1 and j < 3 * sections[1], by width where j % 3 == 2 and
    j < 3 * sections[2], by time elsewhere. Text tokens hold one position three times, which is plain RoPE. The
    positions are the pack's `position_ids_3T` (a Qwen-VL model fills them per document), else its position_ids."""

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, ...], interleaved: bool = False) -> None:
        super().__init__(head_dim, theta)
        if sum(sections) != head_dim // 2 or len(sections) != 3:
            raise ZooError(f"mrope_section {list(sections)} must be three sections adding up to half the rotated "
                           f"head dim ({head_dim // 2})")
        self.sections = tuple(sections)
        # each frequency's axis (a plain tuple: models are built on the meta device)
        if interleaved:
            self.axes = tuple(1 if j % 3 == 1 and j < 3 * sections[1] else 2 if j % 3 == 2 and j < 3 * sections[2]
                              else 0 for j in range(head_dim // 2))
        else:
            self.axes = tuple(i % 3 for i, n in enumerate(sections) for _ in range(n))

    def __call__(self, packed: Packed, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        pos_3T = packed.position_ids_3T
        if pos_3T is None:
            return rope_cos_sin(packed.position_ids, self.inv_freq(packed.position_ids.device), dtype)
        pos_TH2 = pos_3T[torch.tensor(self.axes, device=pos_3T.device)].T  # each frequency's position: its axis's
        freqs_TH2 = pos_TH2.float() * self.inv_freq(pos_3T.device).float()
        emb_TH = torch.cat((freqs_TH2, freqs_TH2), dim=-1)
        return emb_TH.cos().to(dtype), emb_TH.sin().to(dtype)


def rope_cos_sin(position_ids_T: Tensor, inv_freq: Tensor, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """inv_freq is [H/2] or per token [T, H/2]; returns (cos_TH, sin_TH) with the halves repeated, times `factor`
    in fp32 where it is not 1 (YaRN's attention factor)."""
    freqs_TH2 = position_ids_T.float()[:, None] * inv_freq.float()
    emb_TH = torch.cat((freqs_TH2, freqs_TH2), dim=-1)
    cos_TH, sin_TH = emb_TH.cos(), emb_TH.sin()
    if factor != 1.0:
        cos_TH, sin_TH = cos_TH * factor, sin_TH * factor
    return cos_TH.to(dtype), sin_TH.to(dtype)


# ---- YaRN (transformers' _compute_yarn_parameters, as DeepSeek-V3 and Kimi K2 configure it) ----


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 where the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: `attention_factor` where given, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) where both are given and non-zero (DeepSeek-V3: 1), else mscale(factor)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])


def yarn_softmax_scale(scale: float, s: dict[str, Any] | None) -> float:
    """The softmax scale under YaRN where `mscale_all_dim` is set: scale * mscale(factor, mscale_all_dim) ** 2
    (DeepSeek-V3's attention; transformers' yarn_apply_mscale). Unchanged otherwise."""
    s = s or {}
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        mscale = yarn_mscale(s["factor"], s["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> Tensor:
    """[H/2] YaRN's frequencies: the interpolated ones (theta^(-2i/H) / factor) for the long wavelengths, the
    original ones for the short, a linear ramp between the dims where beta_slow and beta_fast rotations fit in the
    original context (rounded out to whole dims unless `truncate` is false)."""
    factor, original = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: interpolated
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep


def apply_rope(x_TnH: Tensor, cos_TH: Tensor, sin_TH: Tensor, layout: str = "half") -> Tensor:
    """RoPE on [T, heads, H]; tables narrower than H turn the leading dims and pass the rest (partial rotary: Qwen3.5
    turns a quarter of each head, GLM-4 half). `layout` (zoo.core.contract.ROPE_LAYOUTS) pairs dim i with i + R/2
    ("half", rotate-half) or dim 2i with 2i + 1 ("interleaved"); either way pair i turns by the tables' angle i."""
    rotary = cos_TH.shape[-1]
    if rotary < x_TnH.shape[-1]:
        return torch.cat((apply_rope(x_TnH[..., :rotary], cos_TH, sin_TH, layout), x_TnH[..., rotary:]), dim=-1)
    if layout == "interleaved":
        return _apply_rope_interleaved(x_TnH, cos_TH, sin_TH)
    x1, x2 = x_TnH.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_TnH * cos_TH[:, None] + rotated * sin_TH[:, None]


def _apply_rope_interleaved(x_TnR: Tensor, cos_TR: Tensor, sin_TR: Tensor) -> Tensor:
    """Each pair (x[2i], x[2i+1]) turned by angle i (the first half of the tables), written back in place of the pair:
    (a cos - b sin, b cos + a sin): the products and sums transformers' GLM forms from its repeated tables, so equal
    to the bit."""
    cos_T1P, sin_T1P = cos_TR[:, None, : cos_TR.shape[-1] // 2], sin_TR[:, None, : sin_TR.shape[-1] // 2]
    a_TnP, b_TnP = x_TnR[..., 0::2], x_TnR[..., 1::2]
    return torch.stack((a_TnP * cos_T1P - b_TnP * sin_T1P, b_TnP * cos_T1P + a_TnP * sin_T1P), dim=-1).flatten(-2)


def linear_params(module: nn.Module) -> int:
    """in x out of every nn.Linear under `module`, from the modules' attributes, not weight.numel(): right on
    meta and under any sharding."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Random init for a model materialised from meta: N(0, std) matrices (stacked ones too) and attention sinks,
    zero biases, unit norms; a module's buffers by its own `init_buffers()` where it has one (an MoE's router bias:
    zeros)."""
    for m in module.modules():
        init_buffers = getattr(m, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()
        sinks = getattr(m, "sinks", None)  # attention sink logits (GPT-OSS), held by the attention module itself
        if isinstance(sinks, nn.Parameter):
            nn.init.normal_(sinks, mean=0.0, std=std)
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            bias = getattr(m, "bias", None)  # nn.Embedding has none, nn.Linear(bias=False) holds None
            if bias is not None:
                nn.init.zeros_(bias)
        elif not list(m.children()):  # leaves with their own init: RMSNorm, LayerNorm, CLIP's class token
            stacked = [p for p in m.parameters(recurse=False) if p.dim() == 3]  # matrices stacked (MoE experts)
            for p in stacked:
                nn.init.normal_(p, mean=0.0, std=std)
            reset = getattr(m, "reset_parameters", None)
            if not stacked and callable(reset):
                reset()
            for p in m.parameters(recurse=False) if stacked else ():  # beside stacked matrices: their biases, zero
                if p.dim() < 3:
                    nn.init.zeros_(p)
