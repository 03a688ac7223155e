"""zoo.io.image against transformers' CLIPImageProcessorPil / LlavaImageProcessorPil (the PIL processors LLaVA used,
whether or not torchvision is installed) on generated images."""

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.errors import ZooError
from zoo.io.image import CLIP_MEAN, clip_preprocess, expand_image_tokens, pad_to_square


def _images():
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (61, 97, 3), dtype=np.uint8))  # wide
    yy, xx = np.mgrid[0:120, 0:45]
    ramp = np.stack([xx * 5 % 256, yy * 2 % 256, (xx + yy) % 256], -1).astype(np.uint8)
    tall = Image.fromarray(ramp)  # tall, smooth
    gray = Image.fromarray(rng.integers(0, 256, (50, 50), dtype=np.uint8), mode="L")  # square, one channel
    return [noise, tall, gray]


@pytest.mark.parametrize("size,crop", [(32, 32), (40, 28)])
def test_clip_preprocess_equals_clip_image_processor(size, crop):
    # the PIL processor, as LLaVA was trained with: from transformers 5 on, CLIPImageProcessor is the torchvision
    # one when torchvision is installed (use_fast=False no longer changes the class), and its bicubic resize lands
    # one 8-bit level off PIL's on some pixels
    from transformers import CLIPImageProcessorPil

    proc = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop})
    for image in _images():
        ref = torch.as_tensor(np.asarray(proc(images=image, return_tensors="np")["pixel_values"][0]))
        ours = clip_preprocess(image, size=size, crop=crop)
        assert ours.shape == (3, crop, crop) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_pad_to_square_equals_llava_image_processor():
    from transformers import LlavaImageProcessorPil

    proc = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_pad=True)
    for image in _images():
        ref = torch.as_tensor(np.asarray(proc(images=image, return_tensors="np")["pixel_values"][0]))
        torch.testing.assert_close(clip_preprocess(image, size=32, pad=True), ref, atol=1e-6, rtol=0)
    wide = pad_to_square(_images()[0])
    assert wide.size == (97, 97)
    assert wide.getpixel((0, 0)) == tuple(int(m * 255) for m in CLIP_MEAN)  # the band is CLIP's mean color


def test_expand_image_tokens():
    ids = torch.tensor([1, 9, 5, 9, 7])
    out = expand_image_tokens(ids, 9, 3)
    assert out.tolist() == [1, 9, 9, 9, 5, 9, 9, 9, 7]
    with pytest.raises(ZooError, match="only once"):
        expand_image_tokens(out, 9, 3)
