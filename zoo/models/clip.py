"""The CLIP vision transformer (ViT), as LLaVA uses it: an image encoder whose hidden states become image tokens;
and SigLIP's (Gemma 3's tower), the same stack configured otherwise.

Shapes: I images, C channels, S image side (pixels), P positions per image (patches + the class token),
D width, N heads, H head dim, F MLP width.
Images are a batch of equal-size squares, so unlike the language models this tower keeps a batch dimension:
every image attends to all of its own positions (no causal mask) and to nothing else.
SigLIP differs from CLIP by configuration only: no class token (`class_token=False`), no layer norm before the
blocks (`pre_norm=False`), a bias on the patch convolution, GELU's tanh approximation, and its output is the last
block's passed through `post_norm` (`CLIPVision.last_hidden`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from zoo.errors import ZooError
from zoo.models.family import rename


@dataclass(frozen=True)
class CLIPVisionConfig:
    positive: ClassVar[frozenset[str]] = frozenset({"dim", "n_layers", "n_heads", "ffn_dim", "image_size",
                                                    "patch_size", "n_channels", "norm_eps"})
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    ffn_dim: int = 4096
    image_size: int = 336
    patch_size: int = 14
    n_channels: int = 3
    norm_eps: float = 1e-5
    act: str = "quick_gelu"
    class_token: bool = True  # CLIP prepends a learned class embedding; SigLIP has none
    pre_norm: bool = True  # CLIP's layer norm on the embeddings ("pre_layrnorm"); SigLIP has none
    patch_bias: bool = False  # SigLIP's patch convolution has a bias, CLIP's none
    n_patches: int = 0  # derived: (image_size // patch_size) ** 2

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ZooError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.act not in ACTIVATIONS:
            raise ZooError(f"unsupported CLIP activation {self.act!r}; supported: {', '.join(ACTIVATIONS)}")
        object.__setattr__(self, "n_patches", (self.image_size // self.patch_size) ** 2)


def quick_gelu(x: Tensor) -> Tensor:
    """OpenAI CLIP's sigmoid approximation of GELU (the released weights were trained with it)."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"quick_gelu": quick_gelu, "gelu": F.gelu,
                                                      "gelu_pytorch_tanh": gelu_tanh}


class Attention(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig) -> None:
        super().__init__()
        D = cfg.dim
        self.n_heads, self.head_dim = cfg.n_heads, D // cfg.n_heads
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D)

    def forward(self, x_IPD: Tensor) -> Tensor:
        I, P, D = x_IPD.shape

        def heads(t: Tensor) -> Tensor:  # heads named, not -1: an empty batch (I = 0) must reshape too
            return t.view(I, P, self.n_heads, self.head_dim).transpose(1, 2)

        q_INPH, k_INPH, v_INPH = heads(self.q_proj(x_IPD)), heads(self.k_proj(x_IPD)), heads(self.v_proj(x_IPD))
        o_INPH = F.scaled_dot_product_attention(q_INPH, k_INPH, v_INPH)
        return self.o_proj(o_INPH.transpose(1, 2).reshape(I, P, D))


class MLP(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)
        self.act = ACTIVATIONS[cfg.act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x_IPD: Tensor) -> Tensor:
        x_IPD = x_IPD + self.attn(self.attn_norm(x_IPD))
        return x_IPD + self.mlp(self.mlp_norm(x_IPD))


class ClassToken(nn.Module):
    """The learned class embedding, prepended to every image's patches (a module so that init finds it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CLIPVision(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.patch_embed = nn.Conv2d(cfg.n_channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size,
                                     bias=cfg.patch_bias)
        self.class_embed = ClassToken(cfg.dim) if cfg.class_token else None
        P = cfg.n_patches + cfg.class_token
        self.pos_embed = nn.Embedding(P, cfg.dim, _weight=torch.empty(P, cfg.dim))
        self.pre_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) if cfg.pre_norm else None  # HF: "pre_layrnorm" (sic)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.post_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, pixel_values_ICSS: Tensor, layer: int = -1) -> Tensor:
        """[I, P, D] hidden state number `layer`, counted like HF's `hidden_states` tuple.

        Entry 0 is the embeddings after `pre_norm`, entry k the output of block k; negative indices count from the
        end (LLaVA's -2 is the second-to-last block's output). Blocks past `layer` are not run. `post_norm` is
        never applied: it belongs to CLIP's pooled output, which LLaVA does not use; it is kept so that checkpoints
        round-trip. An empty batch (I = 0) is fine and runs every module once, so ranks stay in step under FSDP.
        """
        cfg = self.config
        n_states = cfg.n_layers + 1
        if not -n_states <= layer < n_states:
            raise ZooError(f"CLIP hidden state {layer} does not exist: the tower has {cfg.n_layers} layers")
        expected = (cfg.n_channels, cfg.image_size, cfg.image_size)
        if pixel_values_ICSS.dim() != 4 or tuple(pixel_values_ICSS.shape[1:]) != expected:
            raise ZooError(f"expected pixel values [images, {', '.join(map(str, expected))}], "
                             f"got {list(pixel_values_ICSS.shape)} (preprocess images with zoo.io.image)")
        dtype = self.patch_embed.weight.dtype
        x_IDpp = self.patch_embed(pixel_values_ICSS.to(dtype))
        x_IPD = x_IDpp.flatten(2).transpose(1, 2)  # patches in row-major order
        if self.class_embed is not None:
            cls_I1D = self.class_embed.weight.to(dtype).expand(x_IPD.shape[0], 1, -1)
            x_IPD = torch.cat([cls_I1D, x_IPD], dim=1)
        x_IPD = x_IPD + self.pos_embed.weight
        if self.pre_norm is not None:
            x_IPD = self.pre_norm(x_IPD)
        for block in self.layers[: layer % n_states]:
            x_IPD = block(x_IPD)
        return x_IPD

    def last_hidden(self, pixel_values_ICSS: Tensor) -> Tensor:
        """[I, P, D] the last block's output through `post_norm`: SigLIP's last_hidden_state (what Gemma 3 reads)."""
        return self.post_norm(self(pixel_values_ICSS))


# ---- Hugging Face names and config (CLIPVisionModel, under a prefix such as "vision_tower.vision_model.") ----

HF_NAMES = [  # (zoo prefix, HF prefix); {i} is the layer index
    ("patch_embed.", "embeddings.patch_embedding."),
    ("class_embed.weight", "embeddings.class_embedding"),
    ("pos_embed.", "embeddings.position_embedding."),
    ("pre_norm.", "pre_layrnorm."),
    ("layers.{i}.attn_norm.", "encoder.layers.{i}.layer_norm1."),
    ("layers.{i}.attn.o_proj.", "encoder.layers.{i}.self_attn.out_proj."),
    ("layers.{i}.attn.", "encoder.layers.{i}.self_attn."),
    ("layers.{i}.mlp_norm.", "encoder.layers.{i}.layer_norm2."),
    ("layers.{i}.mlp.", "encoder.layers.{i}.mlp."),
    ("post_norm.", "post_layernorm."),
]


def hf_name(zoo_name: str) -> str:
    """The CLIPVisionModel name (without "vision_model.") of a zoo vision-tower tensor."""
    return rename(zoo_name, HF_NAMES)


# transformers' CLIPVisionConfig defaults: hub configs (llava-hf's) leave out the keys that equal them
HF_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
               "layer_norm_eps": 1e-5}


def config_from_hf(hf: dict[str, Any]) -> CLIPVisionConfig:
    hf = {**HF_DEFAULTS, **hf}
    return CLIPVisionConfig(dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                            ffn_dim=hf["intermediate_size"], image_size=hf["image_size"], patch_size=hf["patch_size"],
                            n_channels=hf["num_channels"], norm_eps=hf["layer_norm_eps"], act=hf["hidden_act"])


def config_to_hf(cfg: CLIPVisionConfig) -> dict[str, Any]:
    return {"model_type": "clip_vision_model", "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_channels": cfg.n_channels,
            "image_size": cfg.image_size, "patch_size": cfg.patch_size, "hidden_act": cfg.act,
            "layer_norm_eps": cfg.norm_eps}


# ---- SigLIP (SiglipVisionModel): the same names but the class token and the pre-norm, which it has not ----

SIGLIP_HF_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                      "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def siglip_config_from_hf(hf: dict[str, Any]) -> CLIPVisionConfig:
    """A SiglipVisionConfig as the tower of a model that reads its last hidden state (Gemma 3): the keys a config
    leaves out are transformers' SiglipVisionConfig defaults; the attention-pooling head (`vision_use_head`) is not
    part of it, as nothing reads it (the loader leaves its tensors out)."""
    hf = {**SIGLIP_HF_DEFAULTS, **hf}
    if hf.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ZooError(f"vision tower {hf['model_type']!r} is not supported (expected siglip_vision_model)")
    return CLIPVisionConfig(dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                            ffn_dim=hf["intermediate_size"], image_size=hf["image_size"], patch_size=hf["patch_size"],
                            n_channels=hf["num_channels"], norm_eps=hf["layer_norm_eps"], act=hf["hidden_act"],
                            class_token=False, pre_norm=False, patch_bias=True)


def siglip_config_to_hf(cfg: CLIPVisionConfig) -> dict[str, Any]:
    return {**config_to_hf(cfg), "model_type": "siglip_vision_model", "vision_use_head": False}


# the OpenAI towers LLaVA names in its config (mm_vision_tower)
OPENAI_TOWERS = {
    "openai/clip-vit-large-patch14-336": CLIPVisionConfig(),
    "openai/clip-vit-large-patch14": CLIPVisionConfig(image_size=224),
}


# ---- CLIP's image preprocessing (LLaVA's) ----

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pad_to_square(image: Image.Image, mean: tuple[float, ...] = CLIP_MEAN) -> Image.Image:
    """The image centered on a square of side max(width, height) filled with the mean color (LLaVA-1.5's pad)."""
    image = image.convert("RGB")
    w, h = image.size
    if w == h:
        return image
    side = max(w, h)
    square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    square.paste(image, ((side - w) // 2, (side - h) // 2))
    return square


def clip_preprocess(image: Image.Image, size: int = 336, crop: int | None = None,
                    mean: tuple[float, ...] = CLIP_MEAN, std: tuple[float, ...] = CLIP_STD,
                    pad: bool = False) -> Tensor:
    """[3, crop, crop] float32 pixel values for a CLIP tower (crop defaults to size).

    pad=True first pads to a square of the mean color (LLaVA-1.5's image_aspect_ratio="pad").
    """
    crop = size if crop is None else crop
    image = pad_to_square(image, mean) if pad else image.convert("RGB")
    w, h = image.size
    # shortest side to `size`; the long side truncated like transformers' int(size * long / short)
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    top, left = (new_h - crop) // 2, (new_w - crop) // 2
    if top < 0 or left < 0:
        raise ZooError(f"center crop {crop} is larger than the resized image {new_w}x{new_h}; use crop <= size")
    image = image.crop((left, top, left + crop, top + crop))
    pixels_HWC = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(crop, crop, 3)
    # rescale in float64 then cast, normalize in float32: the order and precision of CLIPImageProcessor
    x_CHW = (pixels_HWC.double() * (1 / 255)).float().permute(2, 0, 1)
    mean_C = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    std_C = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return ((x_CHW - mean_C) / std_C).contiguous()
