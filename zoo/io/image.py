"""Images into LLaVA inputs: CLIP's preprocessing, LLaVA's pad-to-square, and the `<image>` token expansion.

`clip_preprocess` reproduces transformers' `CLIPImageProcessor` (the PIL one): resize the shortest side with
bicubic resampling, center crop, scale to [0, 1], normalize with CLIP's mean and std. LLaVA-1.5 pads each
image to a square of CLIP's mean color first (`pad_to_square`), so that nothing is cropped away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from zoo.errors import ZooError

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


def expand_image_tokens(input_ids: Tensor, image_token_id: int, image_tokens: int) -> Tensor:
    """input_ids [L] with each single `<image>` token repeated `image_tokens` times (the llava-hf convention).

    `image_tokens` is `LlavaConfig.image_tokens` (576 for CLIP ViT-L/14-336 without the class token).
    """
    if input_ids.dim() != 1:
        raise ZooError(f"expand_image_tokens expects one document's input_ids [L], got shape {list(input_ids.shape)}")
    is_image = input_ids == image_token_id
    if is_image[1:].logical_and(is_image[:-1]).any():
        raise ZooError("input_ids already hold consecutive image tokens: expand each <image> token only once")
    repeats = torch.where(is_image, image_tokens, 1)
    return torch.repeat_interleave(input_ids, repeats)


def preprocess(model: Any, images: Sequence[Image.Image]) -> Any:
    """The images as `model`'s checkpoint prepares them, for zoo.pack(docs, images=[...]): the model's own
    `preprocess_images` (Qwen2.5-VL: `ImagePatches`, each image at its own size)."""
    run = getattr(model, "preprocess_images", None)
    if run is None:
        raise ZooError(f"a {type(model).__name__} has no image preprocessing of its own (LLaVA: "
                       "zoo.io.image.clip_preprocess)")
    return run(images)
