"""Qwen-VL's image preprocessing, as transformers' default (fast, tensor-based) Qwen2VLImageProcessor runs it.

Each image keeps its own size: `smart_resize` picks the nearest height and width that are multiples of
patch_size * merge_size with a pixel count within [min_pixels, max_pixels] (aspect ratio kept as closely as it can
be); the uint8 image is resized there (bicubic, antialiased, on the uint8 values: torchvision's CPU path), scaled
and normalised in float32 in one step (x - 255 mean) / (255 std), repeated `temporal_patch_size` times in time (an
image is a video of one frame), and cut into patches [t*h*w, C*t*p*p] in merge-block order: the m x m patches of
each merged unit consecutive. torch and Pillow only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from zoo.core.packing import ImagePatches
from zoo.errors import ZooError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / STD, Qwen's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of `factor`, their product within [min_pixels, max_pixels], the aspect ratio kept
    as closely as they allow (Qwen2-VL's rule, rounding as transformers rounds)."""
    if min(height, width) < 1:
        raise ZooError(f"an image of {width}x{height} pixels: expected at least 1x1")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ZooError(f"an image of {width}x{height} pixels: its aspect ratio must be below {MAX_ASPECT}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def patchify(x_CHW: Tensor, patch: int, merge: int, temporal: int) -> Tensor:
    """[h*w, C*t*p*p] patches of one normalised image, merge-block order, each repeated `temporal` times in time."""
    C, H, W = x_CHW.shape
    gh, gw = H // patch, W // patch
    x = x_CHW.reshape(C, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (unit row, unit col, row in unit, col in unit, C, p, p)
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, temporal, -1, -1)
    return x.reshape(gh * gw, C * temporal * patch * patch)


def preprocess(images: Sequence[Image.Image], *, min_pixels: int, max_pixels: int, patch_size: int = 14,
               merge_size: int = 2, temporal_patch_size: int = 2, mean: Sequence[float] = CLIP_MEAN,
               std: Sequence[float] = CLIP_STD) -> ImagePatches:
    """The images' patches and grids (`ImagePatches`), equal to the fast Qwen2VLImageProcessor's pixel_values and
    image_grid_thw."""
    if isinstance(images, Image.Image) or not all(isinstance(im, Image.Image) for im in images):
        raise ZooError(f"preprocess expects a list of PIL images, got {type(images).__name__}"
                       + ("" if isinstance(images, Image.Image) else
                          f" of {sorted({type(im).__name__ for im in images})}"))
    factor = patch_size * merge_size
    # mean and std in float32, times 255 (transformers fuses the 1/255 rescale into them)
    mean_C11 = (torch.tensor(list(mean)) * (1.0 / (1 / 255)))[:, None, None]
    std_C11 = (torch.tensor(list(std)) * (1.0 / (1 / 255)))[:, None, None]
    patches, grids = [], []
    for image in images:
        rgb = to_rgb(image)
        w, h = rgb.size
        x_CHW = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
        nh, nw = smart_resize(h, w, factor, min_pixels, max_pixels)
        if (nh, nw) != (h, w):
            x_CHW = F.interpolate(x_CHW.contiguous()[None], size=[nh, nw], mode="bicubic", align_corners=False,
                                  antialias=True)[0]
        x_CHW = (x_CHW.float() - mean_C11) / std_C11
        patches.append(patchify(x_CHW, patch_size, merge_size, temporal_patch_size))
        grids.append([1, nh // patch_size, nw // patch_size])
    if not patches:
        raise ZooError("preprocess got no images")
    return ImagePatches(torch.cat(patches), torch.tensor(grids, dtype=torch.int64))
