"""Images into model inputs: `preprocess(model, images)`, the model's own preprocessing; CLIP's, LLaVA's
pad-to-square, and the `<image>` token expansion.

`clip_preprocess` (zoo.models.clip) reproduces transformers' `CLIPImageProcessor` (the PIL one): resize the
shortest side with bicubic resampling, center crop, scale to [0, 1], normalize with CLIP's mean and std. LLaVA-1.5
pads each image to a square of CLIP's mean color first (`pad_to_square`), so that nothing is cropped away.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from torch import Tensor

from zoo.core.contract import ZooModel
from zoo.errors import ZooError
from zoo.models.clip import CLIP_MEAN as CLIP_MEAN
from zoo.models.clip import CLIP_STD as CLIP_STD
from zoo.models.clip import clip_preprocess as clip_preprocess
from zoo.models.clip import pad_to_square as pad_to_square


@runtime_checkable
class ImageModel(Protocol):
    """A vision-language model's own image preprocessing, what `zoo.io.image.preprocess` dispatches to, so every
    vision-language family plugs in the same way (LLaVA: CLIP's; Gemma 3: its fast image processor's; Qwen2.5-VL:
    its patches at each image's own size)."""

    def preprocess_images(self, images: Any) -> Any:
        """PIL images as the checkpoint's image processor prepares them: what zoo.pack's `images` take."""
        ...


def preprocess(model: ZooModel, images: Sequence[Image.Image]) -> Any:
    """PIL `images` as `model`'s checkpoint prepares them, what zoo.pack(docs, images=...) takes: the model's own
    `preprocess_images` (`ImageModel`): [I, C, S, S] pixel values (LLaVA, Gemma 3), or Qwen2.5-VL's
    `ImagePatches`, each image at its own size."""
    if not isinstance(model, ImageModel):
        raise ZooError(f"a {model.family} model takes no images (preprocess needs a vision-language model: LLaVA, "
                       "Gemma 3, Qwen2.5-VL)")
    if isinstance(images, Image.Image) or not isinstance(images, (list, tuple)):
        raise ZooError(f"preprocess takes a list of PIL images, got {type(images).__name__}")
    return model.preprocess_images(list(images))


def open_image(path: str | Path, where: str) -> Image.Image:
    """The image file at `path`, decoded now (a truncated file fails here, not later); a missing file, a directory
    or a file that is no image Pillow reads is one ZooError naming `where` (a flag, a chat line)."""
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except FileNotFoundError:
        raise ZooError(f"{where}: no such file; expected an image file (PNG, JPEG, WebP, ...)") from None
    except IsADirectoryError:
        raise ZooError(f"{where}: is a directory; expected an image file (PNG, JPEG, WebP, ...)") from None
    except Image.DecompressionBombError as e:
        raise ZooError(f"{where}: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL.UnidentifiedImageError is an OSError
        raise ZooError(f"{where}: not an image Pillow can read ({' '.join(str(e).split())})") from None


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
