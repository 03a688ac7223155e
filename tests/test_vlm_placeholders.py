"""`model.expand_placeholders(text, images)`: a prompt's image placeholders expanded at the text level as the
checkpoint's processor expands them; tokenized, the text gives exactly the input_ids transformers' own processor
(Qwen2_5_VLProcessor, Qwen3VLProcessor (Qwen3-VL's, and Qwen3.5's: transformers 5.23 has no processor class of its
own for it), Gemma3Processor, LlavaProcessor, each over its PIL image processor: no torchvision here) writes for the
same prompt and images. A count of placeholders that differs from the images' is one ZooError. `image_tokens(h, w)`,
an image's token count from its size alone, equals what preprocessing the image gives."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

import _tiny_qwen3_vl as tiny_qwen3
import _tiny_qwen_vl as tiny_qwen
import _tiny_tokenizer
import pytest
import torch
from PIL import Image

from zoo.errors import ZooError
from zoo.io.image import preprocess
from zoo.io.tokenizer import Tokenizer
from zoo.models import gemma3_vision, llava, qwen2_5_vl, qwen3_5_vl, qwen3_vl

LLAVA_CONFIG = Path(__file__).parent / "fixtures" / "llava" / "config.json"


def _images() -> list[Image.Image]:
    g = torch.Generator().manual_seed(3)
    return [Image.frombytes("RGB", (w, h), bytes(torch.randint(0, 256, (h * w * 3,), generator=g,
                                                               dtype=torch.uint8).tolist()))
            for w, h in ((30, 40), (60, 20), (17, 17))]


def _qwen(tmp: Path, name: str = "qwen2_5_vl"):
    """Qwen2.5-VL with Qwen2_5_VLProcessor, or (`name`) Qwen3-VL or Qwen3.5 with Qwen3VLProcessor."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tiny = tiny_qwen if name == "qwen2_5_vl" else tiny_qwen3
    if name == "qwen2_5_vl":
        hf, module, processor_cls = tiny_qwen.hf_config().to_dict(), qwen2_5_vl, transformers.Qwen2_5_VLProcessor
    else:
        with torch.device("meta"):
            hf = tiny_qwen3.build(name).config.to_dict()
        module, processor_cls = (qwen3_vl if name == "qwen3_vl" else qwen3_5_vl), transformers.Qwen3VLProcessor
    cfg = module.FAMILY.config_from_hf({**hf, "image_processor": tiny.PROCESSOR["image_processor"]})
    with torch.device("meta"):
        model = qwen2_5_vl.QwenVL(cast(qwen2_5_vl.QwenVLConfig, cfg))
    specials = {"<|image_pad|>": tiny.IMAGE, "<|video_pad|>": tiny.VIDEO, "<|vision_start|>": tiny.START,
                "<|vision_end|>": tiny.END}
    path = _tiny_tokenizer.save(tmp, specials, tiny.VOCAB)
    ip = {k: v for k, v in cast(dict, tiny.PROCESSOR["image_processor"]).items() if k != "image_processor_type"}
    processor = processor_cls(image_processor=Qwen2VLImageProcessorPil(**ip),
                              tokenizer=AutoTokenizer.from_pretrained(path))
    return model, path, processor, "look <|vision_start|><|image_pad|><|vision_end|> and<|vision_start|><|image_pad|>" \
        "<|vision_end|>, then <|vision_start|><|image_pad|><|vision_end|>?"


def _gemma(tmp: Path):
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    vision = gemma3_vision.clip.CLIPVisionConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=48, image_size=56,
                                                 patch_size=14, class_token=False, pre_norm=False, patch_bias=True)
    cfg = gemma3_vision.Gemma3VisionConfig(vision=vision, mm_tokens_per_image=4, image_token_id=127,
                                           boi_token_id=125, eoi_token_id=126)
    with torch.device("meta"):  # the language model at its default size: on meta, it costs nothing
        model = gemma3_vision.Gemma3Vision(cfg)
    boi, soft, eoi = gemma3_vision.BOI, gemma3_vision.IMAGE_SOFT_TOKEN, gemma3_vision.EOI
    path = _tiny_tokenizer.save(tmp, {boi: 125, eoi: 126, soft: 127}, 128, config={
        "extra_special_tokens": {"boi_token": boi, "eoi_token": eoi, "image_token": soft}})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=AutoTokenizer.from_pretrained(path), image_seq_length=4)
    return model, path, processor, f"describe {boi} and{boi}\n\nthen {boi}"


def _llava(tmp: Path, select: str):
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    cfg = dataclasses.replace(llava.config_from_hf(json.loads(LLAVA_CONFIG.read_text())), feature_select=select)
    with torch.device("meta"):
        model = llava.Llava(cfg)
    path = _tiny_tokenizer.save(tmp, {"<image>": cfg.image_token_id}, cfg.language.vocab_size)
    side = cfg.vision.image_size
    # llava-hf's processors count the class token (num_additional_image_tokens 1); "default" drops it again
    processor = LlavaProcessor(image_processor=LlavaImageProcessorPil(size={"shortest_edge": side},
                                                                      crop_size={"height": side, "width": side}),
                               tokenizer=AutoTokenizer.from_pretrained(path), patch_size=cfg.vision.patch_size,
                               vision_feature_select_strategy=select, num_additional_image_tokens=1)
    return model, path, processor, "USER: <image>\nwhat is it? <image> and<image>ASSISTANT:"


CASES = {"qwen2_5_vl": _qwen, "qwen3_vl": lambda p: _qwen(p, "qwen3_vl"),
         "qwen3_5_vl": lambda p: _qwen(p, "qwen3_5_vl"), "gemma3_vision": _gemma,
         "llava_default": lambda p: _llava(p, "default"), "llava_full": lambda p: _llava(p, "full")}


@pytest.mark.parametrize("case", CASES)
def test_expanded_text_tokenizes_to_the_processors_ids(case, tmp_path, monkeypatch):
    from transformers.processing_utils import ProcessorMixin

    # Qwen2_5_VLProcessor checks its (absent) video processor's class, whose module needs torchvision
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    model, path, processor, text = CASES[case](tmp_path)
    images = preprocess(model, _images())
    expanded = model.expand_placeholders(text, images)
    ours = Tokenizer(path).encode(expanded, add_special_tokens=False)
    theirs = processor(text=text, images=_images())["input_ids"]
    theirs = theirs[0] if isinstance(theirs[0], list) else theirs[0].tolist()
    assert ours == list(theirs)
    tok = model.config.image_token_id
    assert ours.count(tok) > 3 * 2  # the images' tokens are there, not just their placeholders
    if case.startswith("qwen"):  # each image's units: its grid t*h*w / merge^2, the sizes differ
        assert ours.count(tok) == int(images.grid_thw.prod(-1).sum()) // 4


@pytest.mark.parametrize("case", ["qwen2_5_vl", "llava_default"])
def test_placeholders_and_images_must_agree(case, tmp_path, monkeypatch):
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    model, _, _, text = CASES[case](tmp_path)
    images = preprocess(model, _images()[:2])
    with pytest.raises(ZooError, match=r"holds 3 image placeholder\(s\) .* but 2 image\(s\) came") as e:
        model.expand_placeholders(text, images)
    assert "\n" not in str(e.value)
    with pytest.raises(ZooError, match=r"holds 0 image placeholder\(s\) .* but 2 image"):
        model.expand_placeholders("no image here", images)
    assert model.expand_placeholders("no image here", None) == "no image here"


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl", "gemma3_vision", "llava_default"])
def test_image_tokens_from_the_size_equal_preprocessings(case, tmp_path, monkeypatch):
    """Sizes that round down and up, grow to min_pixels and shrink to max_pixels (Qwen's), of any aspect: the count
    from (height, width) alone is the preprocessed image's, and the text expanded from sizes is the same."""
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    model, _, _, text = CASES[case](tmp_path)
    sizes = [(1, 1), (17, 17), (40, 30), (20, 61), (9, 150), (100, 70), (333, 500), (64, 64)]  # (height, width)
    images = [Image.new("RGB", (w, h)) for h, w in sizes]
    counts = [model.token_counts(preprocess(model, [im]))[0] for im in images]
    assert [model.image_tokens(h, w) for h, w in sizes] == counts
    if case.startswith("qwen"):  # the sizes give different counts, smallest min_pixels' and largest max_pixels'
        cfg, unit = model.config, (model.config.vision.patch_size * model.config.vision.merge_size) ** 2
        assert len(set(counts)) >= 5 and min(counts) * unit >= cfg.min_pixels and max(counts) * unit <= cfg.max_pixels
    picked = sizes[2:5]
    assert model.expand_for_sizes(text, picked) == model.expand_placeholders(
        text, preprocess(model, [Image.new("RGB", (w, h)) for h, w in picked]))
    with pytest.raises(ZooError, match=r"image sizes are \(height, width\) in pixels, each at least 1: got \(0, 61\)"):
        model.expand_for_sizes(text, [sizes[2], (0, 61), sizes[4]])
    if case.startswith("qwen"):
        with pytest.raises(ZooError, match=r"an image of 5x0 pixels: expected at least 1x1"):
            model.image_tokens(0, 5)
