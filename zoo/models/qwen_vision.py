"""The Qwen-VL vision towers (Qwen2.5-VL's, and Qwen3-VL's and Qwen3.5's by configuration): a native-resolution ViT
over a packed stream of patches, and the 2x2 patch merger.

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

Qwen3-VL's tower (Qwen3.5's is the same without DeepStack) is another configuration of these parts: LayerNorms for
the RMSNorms (`norm`), a plain GELU-tanh MLP for the gated one (`mlp_act`), a bias on the patch embedding, no
windows (`window_size` 0: every block sees its whole image), a learned position table of `n_position_embeddings`
(a square) added to the patch embeddings, bilinearly resampled (align_corners) to each image's grid, and DeepStack:
the blocks in `deepstack_layers` each feed their output to a merger of their own (its norm over a unit's m^2
patches concatenated: post-shuffle), whose tokens the language model adds to its hidden states at the image tokens
after its first layers (zoo.models.qwen2_5_vl).
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
from zoo.models.clip import ACTIVATIONS

VISION_EPS = 1e-6  # transformers hard-wires the tower's and the merger's norm eps
NORMS = ("rms", "layer")


@dataclass(frozen=True)
class QwenVisionConfig:
    positive: ClassVar[frozenset[str]] = frozenset({"dim", "n_layers", "n_heads", "ffn_dim", "out_dim", "patch_size",
                                                    "temporal_patch_size", "merge_size",
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
    # Qwen3-VL's and Qwen3.5's tower: window_size 0 (no windows), and
    norm: str = "rms"  # "rms": RMSNorm (Qwen2.5-VL); "layer": LayerNorm with a bias (Qwen3-VL)
    mlp_act: str = "silu"  # "silu": the gated MLP (Qwen2.5-VL); else a plain MLP of that activation (Qwen3-VL)
    patch_bias: bool = False
    n_position_embeddings: int = 0  # a learned square table resampled to each grid; 0: none
    deepstack_layers: tuple[int, ...] = ()  # blocks whose output feeds a DeepStack merger, in order

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_layers", tuple(self.full_layers))
        object.__setattr__(self, "deepstack_layers", tuple(self.deepstack_layers))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ZooError(f"vision dim {self.dim} over {self.n_heads} heads must give a head dim divisible by 4")
        if self.norm not in NORMS or (self.mlp_act != "silu" and self.mlp_act not in ACTIVATIONS):
            raise ZooError(f"vision norm {self.norm!r} / activation {self.mlp_act!r}: expected one of {NORMS} and "
                           f"one of {['silu', *ACTIVATIONS]}")
        side = int(self.n_position_embeddings ** 0.5)
        if self.n_position_embeddings < 0 or side * side != self.n_position_embeddings:
            raise ZooError(f"num_position_embeddings must be a square (a side of positions squared), got "
                           f"{self.n_position_embeddings}")
        if not all(0 <= i < self.n_layers for i in (*self.deepstack_layers, *self.full_layers)):
            raise ZooError(f"deepstack_visual_indexes {list(self.deepstack_layers)} and fullatt_block_indexes "
                           f"{list(self.full_layers)} must be blocks of the {self.n_layers}")
        if not isinstance(self.window_size, int) or self.window_size < 0:
            raise ZooError(f"window_size must be a number of pixels (0: no windows), got {self.window_size!r}")
        if self.window_size and self.window_size < self.patch_size * self.merge_size:
            raise ZooError(f"window_size {self.window_size} is below one merged unit "
                           f"({self.patch_size * self.merge_size} pixels)")

    @property
    def windowed(self) -> bool:
        """Whether blocks outside `full_layers` attend within windows (Qwen2.5-VL) or all see the whole image."""
        return self.window_size > 0

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
        self.bias = nn.Parameter(torch.empty(cfg.dim)) if cfg.patch_bias else None

    def forward(self, pixels_PC: Tensor) -> Tensor:
        return F.linear(pixels_PC.to(self.weight.dtype), self.weight.flatten(1), self.bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def bilinear_taps(grid_thw: list[list[int]], merge: int, side: int) -> tuple[Tensor, Tensor]:
    """([P, 4] rows of a side x side table, [P, 4] weights): each patch's bilinear resampling of the table to its
    image's grid, corners aligned (F.interpolate's align_corners=True, as transformers' Qwen3-VL resamples it)."""
    hw_P2 = patch_positions(grid_thw, merge)
    size_P2 = torch.cat([torch.tensor([h, w]).expand(t * h * w, 2) for t, h, w in grid_thw]) if grid_thw else hw_P2
    src_P2 = hw_P2.float() * (side - 1) / (size_P2 - 1).clamp(min=1)
    lo_P2 = src_P2.floor()
    frac_P2 = src_P2 - lo_P2
    lo = lo_P2.long()
    hi = (lo + 1).clamp(max=side - 1)
    (r0, c0), (r1, c1) = lo.unbind(1), hi.unbind(1)
    index_P4 = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=1)
    (fr, fc) = frac_P2.unbind(1)
    weight_P4 = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=1)
    return index_P4, weight_P4


class MLP(nn.Module):
    """Linear -> activation -> Linear, with biases (Qwen3-VL's tower)."""

    def __init__(self, dim: int, ffn_dim: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, ffn_dim), nn.Linear(ffn_dim, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_norm(cfg: QwenVisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, VISION_EPS) if cfg.norm == "rms" else nn.LayerNorm(dim, eps=VISION_EPS)


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
        # no patches (a rank whose shard shows no image still runs the tower): nothing to attend, but q and k stay in
        # the graph, so their weights get (zero) gradients as on the ranks that encode images: FSDP reduce-scatters
        # the parameters that have gradients, and a rank without these would send a smaller reduction than the rest
        o_PNH = attend(q_PNH, k_PNH, v_PNH, packed, causal=False) if P else v_PNH + q_PNH + k_PNH
        return self.o_proj(o_PNH.reshape(P, N * H))


class Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.dim)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, bias=True) if cfg.mlp_act == "silu" else \
            MLP(cfg.dim, cfg.ffn_dim, cfg.mlp_act)

    def forward(self, x_PE: Tensor, cos_PH: Tensor, sin_PH: Tensor, packed: Packed, attend: AttentionFn) -> Tensor:
        x_PE = x_PE + self.attn(self.attn_norm(x_PE), cos_PH, sin_PH, packed, attend)
        return x_PE + self.mlp(self.mlp_norm(x_PE))


class Merger(nn.Module):
    """Norm each patch, concatenate a unit's m^2 patches, Linear -> GELU -> Linear to the language model's width; a
    DeepStack merger (`post_shuffle`) norms the concatenation instead."""

    def __init__(self, cfg: QwenVisionConfig, post_shuffle: bool = False) -> None:
        super().__init__()
        wide = cfg.dim * cfg.merge_size ** 2
        self.post_shuffle = post_shuffle
        self.norm = make_norm(cfg, wide if post_shuffle else cfg.dim)
        self.fc1 = nn.Linear(wide, wide)
        self.fc2 = nn.Linear(wide, cfg.out_dim)

    def forward(self, x_PE: Tensor) -> Tensor:
        wide = self.fc1.in_features
        x_UW = self.norm(x_PE.view(-1, wide)) if self.post_shuffle else self.norm(x_PE).view(-1, wide)
        return self.fc2(F.gelu(self.fc1(x_UW)))


class QwenVision(nn.Module):
    def __init__(self, config: QwenVisionConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.n_position_embeddings, cfg.dim) if cfg.n_position_embeddings else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.merger = Merger(cfg)
        self.deepstack = nn.ModuleList(Merger(cfg, post_shuffle=True) for _ in cfg.deepstack_layers)
        self.set_attention(attn)

    def set_attention(self, attn: str | AttentionFn) -> None:
        """A backend by name (the tower's attention is its own: sequence parallelism and the KV cache wrap the
        language model's alone)."""
        self.attend = get_attention(attn)

    def forward(self, pixels_PC: Tensor, grid_thw: Tensor) -> Tensor:
        """[U, (1 + L) D] the merged image tokens of every image in `grid_thw` ([I, 3]), in order, and beside them
        (along the last dim) each of the L DeepStack levels' tokens."""
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
        images = patch_pack([h * w for t, h, w in grids for _ in range(t)], device)  # each frame its own document
        x_PE = self.patch_embed(pixels_PC)
        if self.pos_embed is not None:
            index_P4, weight_P4 = bilinear_taps(grids, m, int(cfg.n_position_embeddings ** 0.5))
            pos_PE = (self.pos_embed(index_P4.to(device)) * weight_P4.to(device)[:, :, None]).sum(1)
            x_PE = x_PE + pos_PE.to(x_PE.dtype)
        hw_P2 = patch_positions(grids, m).to(device)
        if cfg.windowed:
            order_U, window_lens = window_order(grids, m, cfg.window_size // m // cfg.patch_size)
            order_U = order_U.to(device)
            windows = patch_pack(window_lens, device)

            def by_window(t_P: Tensor) -> Tensor:  # units permuted window by window, a unit's m^2 patches together
                return t_P.view(-1, m * m, *t_P.shape[1:])[order_U].flatten(0, 1)

            x_PE, hw_P2 = by_window(x_PE), by_window(hw_P2)
        inv_freq = rope_inv_freq(cfg.dim // cfg.n_heads // 2, cfg.rope_theta).to(device)
        freqs_PH2 = (hw_P2[:, :, None].float() * inv_freq).flatten(1)  # rows' angles, then columns'
        emb_PH = torch.cat((freqs_PH2, freqs_PH2), dim=-1)
        cos_PH, sin_PH = emb_PH.cos(), emb_PH.sin()
        levels = []
        for i, layer in enumerate(self.layers):
            x_PE = layer(x_PE, cos_PH, sin_PH, windows if cfg.windowed and i not in cfg.full_layers else images,
                         self.attend)
            if i in cfg.deepstack_layers:
                levels.append(self.deepstack[cfg.deepstack_layers.index(i)](x_PE))
        out_UD = torch.cat([self.merger(x_PE), *levels], dim=-1) if levels else self.merger(x_PE)
        return out_UD[torch.argsort(order_U)] if cfg.windowed else out_UD


# ---- Hugging Face names and config (transformers' Qwen2_5_VisionTransformerPretrainedModel, under "visual.") ----

def _block_names(z: str, h: str) -> list[Any]:
    """Both towers' blocks: the fused qkv, the output projection and the two norms."""
    from zoo.models.names import Fused

    return [
        Fused(f"{h}blocks.{{i}}.attn.qkv.", tuple(f"{z}layers.{{i}}.attn.{p}_proj." for p in "qkv")),
        (f"{z}layers.{{i}}.attn.o_proj.", f"{h}blocks.{{i}}.attn.proj."),
        (f"{z}layers.{{i}}.attn_norm.", f"{h}blocks.{{i}}.norm1."),
        (f"{z}layers.{{i}}.mlp_norm.", f"{h}blocks.{{i}}.norm2."),
    ]


def hf_names(zoo_prefix: str, hf_prefix: str) -> list[Any]:
    """The tower's name table (zoo.models.names) under the two prefixes."""
    z, h = zoo_prefix, hf_prefix
    return [
        (f"{z}patch_embed.", f"{h}patch_embed.proj."),
        *_block_names(z, h),
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


# ---- Qwen3-VL's and Qwen3.5's tower (transformers' Qwen3VLVisionModel / Qwen3_5VisionModel) ----

def hf_names_qwen3(zoo_prefix: str, hf_prefix: str) -> list[Any]:
    """Qwen3-VL's tower's name table (Qwen3.5's has no deepstack_merger_list)."""
    z, h = zoo_prefix, hf_prefix
    return [
        (f"{z}patch_embed.", f"{h}patch_embed.proj."),
        (f"{z}pos_embed.", f"{h}pos_embed."),
        *_block_names(z, h),
        (f"{z}layers.{{i}}.mlp.fc", f"{h}blocks.{{i}}.mlp.linear_fc"),
        (f"{z}merger.fc", f"{h}merger.linear_fc"),
        (f"{z}merger.", f"{h}merger."),
        (f"{z}deepstack.{{i}}.fc", f"{h}deepstack_merger_list.{{i}}.linear_fc"),
        (f"{z}deepstack.{{i}}.", f"{h}deepstack_merger_list.{{i}}."),
    ]


def config_from_hf_qwen3(hf: dict[str, Any], what: str) -> QwenVisionConfig:
    """A Qwen3-VL or Qwen3.5 vision_config as transformers reads it (its class defaults where a key is left out)."""
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ZooError(f"{what} vision hidden_act {act!r} is not supported (expected one of {sorted(ACTIVATIONS)})")
    rope = hf.get("rope_parameters") or {}
    return QwenVisionConfig(
        dim=hf.get("hidden_size", 1152), n_layers=hf.get("depth", 27), n_heads=hf.get("num_heads", 16),
        ffn_dim=hf.get("intermediate_size", 4304), out_dim=hf.get("out_hidden_size", 3584),
        patch_size=hf.get("patch_size", 16), temporal_patch_size=hf.get("temporal_patch_size", 2),
        merge_size=hf.get("spatial_merge_size", 2), window_size=0, full_layers=(),
        n_channels=hf.get("in_channels", 3), rope_theta=float(rope.get("rope_theta", 10000.0)), norm="layer",
        mlp_act=act, patch_bias=True, n_position_embeddings=hf.get("num_position_embeddings", 2304),
        deepstack_layers=tuple(hf.get("deepstack_visual_indexes", ()) or ()))


def config_to_hf_qwen3(cfg: QwenVisionConfig, model_type: str) -> dict[str, Any]:
    out = {"model_type": model_type, "depth": cfg.n_layers, "hidden_size": cfg.dim, "hidden_act": cfg.mlp_act,
           "intermediate_size": cfg.ffn_dim, "num_heads": cfg.n_heads, "in_channels": cfg.n_channels,
           "patch_size": cfg.patch_size, "spatial_merge_size": cfg.merge_size,
           "temporal_patch_size": cfg.temporal_patch_size, "out_hidden_size": cfg.out_dim,
           "num_position_embeddings": cfg.n_position_embeddings,
           "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "axial"}}
    if cfg.deepstack_layers:
        out["deepstack_visual_indexes"] = list(cfg.deepstack_layers)
    return out
