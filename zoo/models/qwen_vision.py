"""Qwen2.5-VL's vision tower: a native-resolution ViT over a packed stream of patches, and the 2x2 patch merger.

Shapes: P patches of all images (no batch dimension, no padding), E tower width, N heads, H head dim, U merged
units (P / m^2 with merge size m), D the language model's width, I images.
An image of h x w patches (`grid_thw` row (t, h, w); t = 1 for images, each frame twice in time: the temporal
patch of 2) is t*h*w patches in merge-block order: the m x m patches of a merged unit are consecutive (the
processor's layout, zoo.models.qwen_image). The tower embeds each patch (the Conv3d of kernel = stride as one
matrix product), turns q and k with a 2-D rotary (height positions in the first half of the rotated dims, width
in the second), and runs blocks whose attention sees, for most, a window of window_size pixels square (units
reordered window by window, as transformers does) and, for `full_layers`, the whole image. Every image or window
is a document of a `Packed` of patches, attended with zoo's backend functions without the causal mask: images of
different sizes run in one call, none sees another. The merger concatenates each unit's m^2 patches and maps them
to the language model's width; the output is in the images' own unit order again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, get_attention
from zoo.core.layers import GatedMLP, RMSNorm, apply_rope, rope_inv_freq
from zoo.core.packing import Packed, with_seqlens
from zoo.errors import ZooError

VISION_EPS = 1e-6  # transformers hard-wires the tower's and the merger's RMSNorm eps


@dataclass(frozen=True)
class QwenVisionConfig:
    positive: ClassVar[frozenset[str]] = frozenset({"dim", "n_layers", "n_heads", "ffn_dim", "out_dim", "patch_size",
                                                    "temporal_patch_size", "merge_size", "window_size",
                                                    "n_channels", "rope_theta"})
    dim: int = 1280
    n_layers: int = 32
    n_heads: int = 16
    ffn_dim: int = 3420
    out_dim: int = 3584  # the language model's width
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    window_size: int = 112  # pixels: a window is window_size / patch_size / merge_size units square
    full_layers: tuple[int, ...] = (7, 15, 23, 31)  # fullatt_block_indexes: blocks that see the whole image
    n_channels: int = 3
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_layers", tuple(self.full_layers))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ZooError(f"vision dim {self.dim} over {self.n_heads} heads must give a head dim divisible by 4")
        if self.window_size < self.patch_size * self.merge_size:
            raise ZooError(f"window_size {self.window_size} is below one merged unit "
                           f"({self.patch_size * self.merge_size} pixels)")

    @property
    def patch_dim(self) -> int:
        """Values in one patch: channels x temporal patch x patch x patch."""
        return self.n_channels * self.temporal_patch_size * self.patch_size ** 2


def patch_pack(lens: list[int], device: torch.device) -> Packed:
    """A pack of patches whose documents are `lens` (images, or windows): what the attention functions read."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    T = sum(lens)
    zeros = torch.zeros(T, dtype=torch.int64, device=device)
    return with_seqlens(Packed(zeros, cu.to(device), zeros, max(lens, default=1)), lens)


def window_order(grid_thw: list[list[int]], merge: int, window_units: int) -> tuple[Tensor, list[int]]:
    """(order_U, window lengths in patches): the merged units of every image, window by window (windows of
    `window_units` units square, row-major over each frame; units row-major within a window), as transformers'
    get_vision_window_index orders them; windows cut short at the image's edge, none empty."""
    order, lens, offset = [], [], 0
    for t, h, w in grid_thw:
        lh, lw = h // merge, w // merge
        r = torch.arange(lh).repeat_interleave(lw)
        c = torch.arange(lw).repeat(lh)
        nwh, nww = -(-lh // window_units), -(-lw // window_units)
        window = (r // window_units) * nww + c // window_units  # a frame's units, row-major: their window
        for frame in range(t):
            # a stable sort keeps the row-major order inside each window
            order.append(torch.sort(window, stable=True).indices + offset + frame * lh * lw)
            counts = torch.bincount(window, minlength=nwh * nww)
            lens += [n * merge * merge for n in counts.tolist() if n]
        offset += t * lh * lw
    return (torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)), lens


def patch_positions(grid_thw: list[list[int]], merge: int) -> Tensor:
    """[P, 2] each patch's (row, column) in its image, in the processor's merge-block order."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        hw = torch.stack([x.reshape(block).transpose(1, 2).flatten() for x in (rows, cols)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.int64)


class PatchEmbed(nn.Module):
    """The Conv3d of kernel = stride over a patch as one matrix product; the weight keeps the Conv3d's shape
    [E, C, t, p, p], so a checkpoint's tensor loads and exports as it is."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.weight = nn.Parameter(torch.empty(cfg.dim, cfg.n_channels, cfg.temporal_patch_size, p, p))

    def forward(self, pixels_PC: Tensor) -> Tensor:
        return F.linear(pixels_PC.to(self.weight.dtype), self.weight.flatten(1))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Attention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        E = cfg.dim
        self.n_heads, self.head_dim = cfg.n_heads, E // cfg.n_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.o_proj = nn.Linear(E, E)

    def forward(self, x_PE: Tensor, cos_PH: Tensor, sin_PH: Tensor, packed: Packed, attend: AttentionFn) -> Tensor:
        P, N, H = x_PE.shape[0], self.n_heads, self.head_dim  # heads named: no patches (P = 0) must reshape too
        q_PNH, k_PNH = self.q_proj(x_PE).view(P, N, H), self.k_proj(x_PE).view(P, N, H)
        # rotated in fp32, as transformers' apply_rotary_pos_emb_vision
        q_PNH = apply_rope(q_PNH.float(), cos_PH, sin_PH).to(x_PE.dtype)
        k_PNH = apply_rope(k_PNH.float(), cos_PH, sin_PH).to(x_PE.dtype)
        v_PNH = self.v_proj(x_PE).view(P, N, H)
        # no patches (a rank whose shard shows no image still runs the tower): nothing to attend
        o_PNH = attend(q_PNH, k_PNH, v_PNH, packed, causal=False) if P else v_PNH
        return self.o_proj(o_PNH.reshape(P, N * H))


class Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, VISION_EPS)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, VISION_EPS)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, bias=True)

    def forward(self, x_PE: Tensor, cos_PH: Tensor, sin_PH: Tensor, packed: Packed, attend: AttentionFn) -> Tensor:
        x_PE = x_PE + self.attn(self.attn_norm(x_PE), cos_PH, sin_PH, packed, attend)
        return x_PE + self.mlp(self.mlp_norm(x_PE))


class Merger(nn.Module):
    """RMSNorm each patch, concatenate a unit's m^2 patches, Linear -> GELU -> Linear to the language model's width."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        wide = cfg.dim * cfg.merge_size ** 2
        self.norm = RMSNorm(cfg.dim, VISION_EPS)
        self.fc1 = nn.Linear(wide, wide)
        self.fc2 = nn.Linear(wide, cfg.out_dim)

    def forward(self, x_PE: Tensor) -> Tensor:
        x_UW = self.norm(x_PE).view(-1, self.fc1.in_features)
        return self.fc2(F.gelu(self.fc1(x_UW)))


class QwenVision(nn.Module):
    def __init__(self, config: QwenVisionConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.patch_embed = PatchEmbed(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.merger = Merger(cfg)
        self.set_attention(attn)

    def set_attention(self, attn: str | AttentionFn) -> None:
        """A backend by name (the tower's attention is its own: sequence parallelism and the KV cache wrap the
        language model's alone)."""
        self.attend = get_attention(attn)

    def forward(self, pixels_PC: Tensor, grid_thw: Tensor) -> Tensor:
        """[U, D] the merged image tokens of every image in `grid_thw` ([I, 3]), in order."""
        cfg = self.config
        m = cfg.merge_size
        grids: list[list[int]] = grid_thw.tolist()
        n = sum(t * h * w for t, h, w in grids)
        if pixels_PC.dim() != 2 or pixels_PC.shape != (n, cfg.patch_dim):
            raise ZooError(f"expected pixel patches [{n}, {cfg.patch_dim}] for grids {grids}, got "
                           f"{list(pixels_PC.shape)} (preprocess images with zoo.io.image.preprocess)")
        if any(h % m or w % m for _, h, w in grids):
            raise ZooError(f"image grids {grids} must be multiples of the merge size {m} in height and width")
        device = pixels_PC.device
        order_U, window_lens = window_order(grids, m, cfg.window_size // m // cfg.patch_size)
        order_U = order_U.to(device)

        def by_window(t_P: Tensor) -> Tensor:  # units permuted window by window, a unit's m^2 patches together
            return t_P.view(-1, m * m, *t_P.shape[1:])[order_U].flatten(0, 1)

        x_PE = by_window(self.patch_embed(pixels_PC))
        hw_P2 = by_window(patch_positions(grids, m).to(device))
        inv_freq = rope_inv_freq(cfg.dim // cfg.n_heads // 2, cfg.rope_theta).to(device)
        freqs_PH2 = (hw_P2[:, :, None].float() * inv_freq).flatten(1)  # rows' angles, then columns'
        emb_PH = torch.cat((freqs_PH2, freqs_PH2), dim=-1)
        cos_PH, sin_PH = emb_PH.cos(), emb_PH.sin()
        images = patch_pack([h * w for t, h, w in grids for _ in range(t)], device)  # each frame its own document
        windows = patch_pack(window_lens, device)
        for i, layer in enumerate(self.layers):
            x_PE = layer(x_PE, cos_PH, sin_PH, images if i in cfg.full_layers else windows, self.attend)
        return self.merger(x_PE)[torch.argsort(order_U)]


# ---- Hugging Face names and config (transformers' Qwen2_5_VisionTransformerPretrainedModel, under "visual.") ----

def hf_names(zoo_prefix: str, hf_prefix: str) -> list[Any]:
    """The tower's name table (zoo.models.names) under the two prefixes."""
    from zoo.models.names import Fused

    z, h = zoo_prefix, hf_prefix
    return [
        (f"{z}patch_embed.", f"{h}patch_embed.proj."),
        Fused(f"{h}blocks.{{i}}.attn.qkv.", tuple(f"{z}layers.{{i}}.attn.{p}_proj." for p in "qkv")),
        (f"{z}layers.{{i}}.attn.o_proj.", f"{h}blocks.{{i}}.attn.proj."),
        (f"{z}layers.{{i}}.attn_norm.", f"{h}blocks.{{i}}.norm1."),
        (f"{z}layers.{{i}}.mlp_norm.", f"{h}blocks.{{i}}.norm2."),
        (f"{z}layers.{{i}}.mlp.", f"{h}blocks.{{i}}.mlp."),
        (f"{z}merger.norm.", f"{h}merger.ln_q."),
        (f"{z}merger.fc1.", f"{h}merger.mlp.0."),
        (f"{z}merger.fc2.", f"{h}merger.mlp.2."),
    ]


def config_from_hf(hf: dict[str, Any]) -> QwenVisionConfig:
    """A vision_config as transformers reads it: its class defaults where a key is left out (the published configs
    spell in_channels `in_chans`, which transformers ignores for its default of 3)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ZooError(f"Qwen2.5-VL vision hidden_act {hf['hidden_act']!r} is not supported (expected 'silu')")
    rope = hf.get("rope_parameters") or {}
    d = QwenVisionConfig()
    return QwenVisionConfig(
        dim=hf.get("hidden_size", 3584), n_layers=hf.get("depth", d.n_layers), n_heads=hf.get("num_heads", d.n_heads),
        ffn_dim=hf.get("intermediate_size", d.ffn_dim), out_dim=hf.get("out_hidden_size", 3584),
        patch_size=hf.get("patch_size", d.patch_size), temporal_patch_size=hf.get("temporal_patch_size", 2),
        merge_size=hf.get("spatial_merge_size", d.merge_size), window_size=hf.get("window_size", d.window_size),
        full_layers=tuple(hf.get("fullatt_block_indexes", d.full_layers)), n_channels=hf.get("in_channels", 3),
        rope_theta=float(rope.get("rope_theta", 10000.0)))


def config_to_hf(cfg: QwenVisionConfig) -> dict[str, Any]:
    return {"model_type": "qwen2_5_vl_vision", "depth": cfg.n_layers, "hidden_size": cfg.dim, "hidden_act": "silu",
            "intermediate_size": cfg.ffn_dim, "num_heads": cfg.n_heads, "in_channels": cfg.n_channels,
            "patch_size": cfg.patch_size, "spatial_merge_size": cfg.merge_size,
            "temporal_patch_size": cfg.temporal_patch_size, "window_size": cfg.window_size,
            "out_hidden_size": cfg.out_dim, "fullatt_block_indexes": list(cfg.full_layers),
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "axial"}}
