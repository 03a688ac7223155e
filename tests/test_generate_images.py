"""`python -m zoo.generate CKPT --image FILE --prompt TEXT` and `--chat` with `/image FILE`: the answer equals
transformers' greedy generate on the ids its own processor writes for the chat template's rendering of the same
message (images as `{"type": "image"}` items), with the pixel values zoo's preprocessing gives (tested equal to the
image processors' elsewhere), on tiny random Qwen2.5-VL, Gemma 3 and LLaVA checkpoints saved by transformers.
Bad input is one line and exit 2."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any, cast

import _tiny_qwen_vl as tiny_qwen
import _tiny_tokenizer
import pytest
import torch
from PIL import Image

from zoo.generate.cli import main
from zoo.io.tokenizer import Tokenizer

LLAVA = Path(__file__).parent / "fixtures" / "llava"
NEW = 6

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _qwen(root: Path) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = tiny_qwen.save(root)
    specials = {"<|image_pad|>": tiny_qwen.IMAGE, "<|video_pad|>": tiny_qwen.VIDEO,
                "<|vision_start|>": tiny_qwen.START, "<|vision_end|>": tiny_qwen.END, "<|im_start|>": 246,
                "<|im_end|>": 247}
    _tiny_tokenizer.save(root, specials, tiny_qwen.VOCAB, QWEN_TEMPLATE)
    ip = {k: v for k, v in cast(dict, tiny_qwen.PROCESSOR["image_processor"]).items() if k != "image_processor_type"}
    return hf, lambda t: Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(**ip), tokenizer=t)


def _gemma(root: Path) -> tuple[Any, Any]:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    text = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=24, sliding_window=3,
                            layer_types=["sliding_attention", "full_attention"], bos_token_id=None,
                            eos_token_id=None, pad_token_id=None)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127,
                          boi_token_index=125, eoi_token_index=126)
    hf = _randomised(Gemma3ForConditionalGeneration(config))
    hf.save_pretrained(root)
    specials = {"<start_of_image>": 125, "<end_of_image>": 126, "<image_soft_token>": 127, "<start_of_turn>": 123,
                "<end_of_turn>": 124}
    tok = {"extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                    "image_token": "<image_soft_token>"}}
    _tiny_tokenizer.save(root, specials, 128, GEMMA_TEMPLATE, tok)
    return hf, lambda t: Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                         tokenizer=t, image_seq_length=4)


def _llava(root: Path) -> tuple[Any, Any]:
    from transformers import LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    shutil.copytree(LLAVA, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("golden*", "README*"))
    hf = LlavaForConditionalGeneration.from_pretrained(root, attn_implementation="eager").eval()
    cfg = json.loads((root / "config.json").read_text())
    side, patch = cfg["vision_config"]["image_size"], cfg["vision_config"]["patch_size"]
    _tiny_tokenizer.save(root, {"<image>": cfg["image_token_index"]}, cfg["text_config"]["vocab_size"],
                         LLAVA_TEMPLATE)
    ip = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return hf, lambda t: LlavaProcessor(image_processor=ip, tokenizer=t, patch_size=patch,
                                        vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _randomised(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight off its init (Gemma's norms and projection start at 0)
        for n, p in model.named_parameters():
            p.copy_((0.3 if "norm" in n or n.endswith(".bias") else 0.2) * torch.randn(p.shape, generator=g))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(autouse=True)
def _no_video_processor_check(monkeypatch):
    """Qwen2_5_VLProcessor checks its (absent) video processor's class, whose module needs torchvision."""
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)


FAMILIES = {"qwen2_5_vl": _qwen, "gemma3_vision": _gemma, "llava": _llava}


def _image(path: Path, w: int, h: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    Image.frombytes("RGB", (w, h), bytes(torch.randint(0, 256, (h * w * 3,), generator=g,
                                                       dtype=torch.uint8).tolist())).save(path)
    return path


def _hf_answer(hf, processor, ckpt: Path, messages: list, images: list[Path]) -> str:
    """transformers' greedy answer: the processor's ids for the template's text, zoo's pixel values."""
    from transformers import AutoTokenizer

    import zoo
    from zoo.io.image import preprocess

    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(p).convert("RGB") for p in images]
    out = processor(tok)(text=text, images=pil)
    ids = torch.tensor(out["input_ids"][0])
    pixels = preprocess(zoo.load(ckpt), pil)
    kwargs: dict[str, Any] = {}
    if hf.config.model_type == "qwen2_5_vl":
        kwargs = dict(pixel_values=pixels.pixel_values, image_grid_thw=pixels.grid_thw,
                      mm_token_type_ids=(ids == tiny_qwen.IMAGE).long()[None])
    elif hf.config.model_type == "gemma3":
        kwargs = dict(pixel_values=pixels, token_type_ids=(ids == 127).long()[None])
    else:
        kwargs = dict(pixel_values=pixels)
    stop = Tokenizer(ckpt).stop_ids()
    new = hf.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=NEW,
                      do_sample=False, pad_token_id=0, eos_token_id=list(stop) or None, **kwargs)[0, len(ids):]
    new = [t for t in new.tolist() if t not in stop]
    assert len(new) > 1
    return Tokenizer(ckpt).decode(new)


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_image_prompt_and_chat_equal_transformers(family, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    hf, processor = FAMILIES[family](ckpt)
    a, b = _image(tmp_path / "a.png", 30, 40, 1), _image(tmp_path / "b.png", 52, 20, 2)
    flags = ["--max-new-tokens", str(NEW), "--device", "cpu"]
    # --prompt with two images: one user message, the images then the text
    assert main([str(ckpt), "--image", str(a), "--image", str(b), "--prompt", "what is here?", *flags]) == 0
    got = capsys.readouterr().out
    user = {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                        {"type": "text", "text": "what is here?"}]}
    assert got == _hf_answer(hf, processor, ckpt, [user], [a, b]) + "\n"
    # --chat: an image for the first message, a text-only turn, then /image for the third
    lines = f"say it\nand now?\n/image {b}\nthis one?\n"
    assert main([str(ckpt), "--chat", "--image", str(a), *flags], stdin=io.StringIO(lines)) == 0
    out = capsys.readouterr().out
    # transformers answers each turn after the conversation so far (answers may hold newlines: built up, compared whole)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "say it"}]}]
    first = _hf_answer(hf, processor, ckpt, conversation, [a])
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "and now?"}]
    second = _hf_answer(hf, processor, ckpt, conversation, [a])
    conversation += [{"role": "assistant", "content": second},
                     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "this one?"}]}]
    third = _hf_answer(hf, processor, ckpt, conversation, [a, b])
    assert out == f"{first}\n{second}\n(image {b} goes with the next message)\n{third}\n"


def test_cli_image_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _qwen(ckpt)
    good = _image(tmp_path / "a.png", 30, 40, 1)
    (tmp_path / "notes.png").write_text("not an image")
    text_only = tmp_path / "text"
    import zoo

    zoo.save(zoo.load("debug"), text_only, tokenizer_from=ckpt)
    cases = [([str(ckpt), "--image", str(tmp_path / "missing.png"), "--prompt", "hi"], "missing.png: no such file"),
             ([str(ckpt), "--image", str(tmp_path / "notes.png"), "--prompt", "hi"], "not an image Pillow can read"),
             ([str(ckpt), "--image", str(tmp_path), "--prompt", "hi"], "is a directory"),
             ([str(text_only), "--image", str(good), "--prompt", "hi"], "takes no images")]
    capsys.readouterr()
    for argv, want in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and want in err and err.count("\n") == 1, err
    # a template that drops the image: the count of placeholders and images differ
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main([str(ckpt), "--image", str(good), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds 0 image placeholder(s) '<|image_pad|>' but 1 image(s) came" in err and err.count("\n") == 1
    assert main([str(ckpt), "--chat", "--max-new-tokens", "2"], stdin=io.StringIO("/image\n")) == 2
    assert "expected `/image FILE`" in capsys.readouterr().err
