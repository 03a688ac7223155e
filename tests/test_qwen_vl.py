"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration (tests/_tiny_qwen_vl.py): one packed forward
of several documents (images of different sizes, two images in one document, a text-only document) equals each
document alone upstream, on every backend; losses and gradients; greedy generation; converters both ways; the
published config layout; zoo's preprocessing against the fast image processor's golden outputs. Its sequence
parallel runs with the other Qwen vision-language families' in test_qwen3_vl.py (one spawn of 4 ranks)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import _tiny_qwen_vl as tiny
import pytest
import torch
from safetensors.torch import load_file

import zoo
from convert import hf_to_zoo, zoo_to_hf
from zoo.core.attention import available_backends
from zoo.core.packing import ImagePatches
from zoo.generate import generate
from zoo.io.image import preprocess
from zoo.models import qwen_image
from zoo.models.qwen2_5_vl import HF_NAMES, plan_to_hf

FIXTURES = Path(__file__).parent / "fixtures" / "qwen_vl"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402  (the synthetic images the goldens were made from)

# per document: ints are text runs, (h, w) image grids in patches; two images in one, a text-only one, an image
# whose units do not fill its windows, one that is a single window
DOCS = [[3, (4, 6), 5], [2, (10, 8), 4, (4, 4), 3], [7], [1, (6, 4), 2]]


def _inputs(specs: list, seed: int = 0) -> tuple[list[torch.Tensor], list[ImagePatches | None]]:
    docs, images = [], []
    for d, spec in enumerate(specs):
        docs.append(tiny.document(spec, seed + d))
        grids = [x for x in spec if isinstance(x, tuple)]
        images.append(ImagePatches(torch.cat([tiny.pixels(g, 100 + 10 * d + i) for i, g in enumerate(grids)]),
                                   torch.tensor([[1, *g] for g in grids])) if grids else None)
    return docs, images


def _hf_kwargs(doc: torch.Tensor, im: ImagePatches | None) -> dict:
    if im is None:
        return {}
    return dict(pixel_values=im.pixel_values, image_grid_thw=im.grid_thw,
                mm_token_type_ids=(doc == tiny.IMAGE).long()[None])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, its checkpoint dir, zoo model loaded from that dir, zoo checkpoint dir from hf_to_zoo)."""
    tmp = tmp_path_factory.mktemp("qwen_vl")
    ref = tiny.save(tmp / "hf")
    assert hf_to_zoo.main([str(tmp / "hf"), str(tmp / "zoo"), "--quiet"]) is None
    return ref, tmp, zoo.load(tmp / "hf", attn="eager")


# flex compiles a kernel per shape on CPU (half a minute each, cold): its non-causal mask is checked on its own below
@pytest.mark.parametrize("backend", [b for b in available_backends("cpu") if b not in ("flex", "auto")])
def test_packed_equals_each_document_alone(models, backend):
    """logits within 1e-4 of each document alone upstream; the loss over the text targets within 1e-5 and its
    gradients equal."""
    ref, _, model = models
    model.set_attention(backend)
    docs, images = _inputs(DOCS)
    packed = zoo.pack(docs, images=images)
    train = True
    model.zero_grad()
    with torch.set_grad_enabled(train):
        logits = model(packed)
        loss = model.loss(packed) if train else None
    ref.zero_grad()
    total, count = 0.0, 0
    cu = packed.cu_seqlens.tolist()
    for d, (doc, im) in enumerate(zip(docs, images)):
        labels = doc.masked_fill(doc == tiny.IMAGE, -100)[None]  # text targets only, as zoo trains
        with torch.set_grad_enabled(train):
            out = ref(input_ids=doc[None], labels=labels, **_hf_kwargs(doc, im))
        torch.testing.assert_close(logits[cu[d]:cu[d + 1]], out.logits[0], atol=1e-4, rtol=0)
        n = int((labels[0, 1:] != -100).sum())
        total, count = total + out.loss * n, count + n
    if not train:
        return
    ref_loss = total / count
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    loss.backward()
    ref_loss.backward()
    hf_grads = {n.replace("model.language_model.", "model.").replace("model.visual.", "visual."): p.grad
                for n, p in ref.named_parameters()}
    zoo_grads = dict((n, p.grad) for n, p in model.named_parameters())
    for hf_name, (sources, combine) in plan_to_hf(model.config, list(zoo_grads)).items():
        grads = [zoo_grads[s] for s in sources]
        ours = grads[0] if combine is None else combine(grads)
        torch.testing.assert_close(ours, hf_grads[hf_name], atol=1e-5, rtol=1e-4, msg=hf_name)
    model.set_attention("eager")


def test_flex_full_attention_mask(monkeypatch):
    """The tower's attention on flex (causal=False): each token sees its whole document, documents across and
    inside 128-token tiles, equal to eager. FlexAttention runs uncompiled here (its CPU compile costs half a minute
    a shape); the block mask is zoo's and the same either way."""
    from torch.nn.attention.flex_attention import flex_attention

    from zoo.core import attention
    from zoo.models.qwen_vision import patch_pack

    monkeypatch.setattr(attention, "_compiled_flex", lambda device_type, shape=(): flex_attention)
    for lens in ([24, 80, 16, 24], [127, 2, 127]):  # documents crossing the 128-token tiles
        packed = patch_pack(lens, torch.device("cpu"))
        q, k, v = torch.randn(3, sum(lens), 2, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
        with torch.no_grad():
            torch.testing.assert_close(attention.flex(q, k, v, packed, causal=False),
                                       attention.eager(q, k, v, packed, causal=False), atol=1e-6, rtol=0)


def test_greedy_generation_equals_transformers(models):
    ref, _, model = models
    docs, images = _inputs(DOCS[:3], seed=7)
    ours = generate(model, docs, images=images, max_new_tokens=10)
    for doc, im, got in zip(docs, images, ours):
        want = ref.generate(input_ids=doc[None], max_new_tokens=10, do_sample=False, **_hf_kwargs(doc, im))
        assert got.tolist() == want[0, len(doc):].tolist()
    # the fused decode step (zoo.generate.fused) reads the same M-RoPE positions
    fused = generate(model, docs, images=images, max_new_tokens=10, fuse=True)
    assert [t.tolist() for t in fused] == [t.tolist() for t in ours]


def test_converters_round_trip_bit_exact_and_transformers_loads_the_export(models):
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref, tmp, model = models
    assert zoo.load(tmp / "zoo").config == model.config  # the processor's settings travel in zoo's config
    assert zoo_to_hf.main([str(tmp / "zoo"), str(tmp / "back"), "--quiet"]) is None
    before, after = load_file(tmp / "hf" / "model.safetensors"), load_file(tmp / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    processor = json.loads((tmp / "back" / "preprocessor_config.json").read_text())
    assert (processor["min_pixels"], processor["max_pixels"]) == (64, 4096)
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp / "back", attn_implementation="eager").eval()
    doc, im = (x[0] for x in _inputs(DOCS[:1]))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=doc[None], **_hf_kwargs(doc, im)).logits,
                                   ref(input_ids=doc[None], **_hf_kwargs(doc, im)).logits, atol=0, rtol=0)
    assert zoo.load(tmp / "back").config == model.config


def test_published_flat_layout(models, tmp_path):
    """The hub's config.json (text keys at the top, rope_scaling {type: mrope}, in_chans) with a
    preprocessor_config.json of min/max pixels reads as transformers 5's nested one."""
    _, tmp, model = models
    nested = json.loads((tmp / "hf" / "config.json").read_text())
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**nested, **text, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    flat["vision_config"] = {**flat["vision_config"], "in_chans": 3}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    shutil.copy(tmp / "hf" / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**tiny.PROCESSOR["image_processor"], "size": None, "min_pixels": 64, "max_pixels": 4096}))
    flat_model = zoo.load(tmp_path)
    assert flat_model.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(flat_model.state_dict().values(), model.state_dict().values()))


def test_transformers_in_memory_names(models, tmp_path):
    """A state dict as transformers holds it (model.language_model.*, model.visual.*) loads as the saved names do."""
    from safetensors.torch import save_file

    ref, tmp, model = models
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    shutil.copy(tmp / "hf" / "config.json", tmp_path / "config.json")
    loaded = zoo.load(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_preprocess_equals_the_fast_image_processor(models):
    """zoo's preprocessing against transformers' fast Qwen2VLImageProcessor (golden outputs, make_fixtures.py):
    the same grids, pixel values within 1e-5, for both processor settings; and through the model's own settings."""
    golden = load_file(FIXTURES / "golden.safetensors")
    for name, setting in make_fixtures.SETTINGS.items():
        out = qwen_image.preprocess(make_fixtures.images(), **setting)
        assert out.grid_thw.tolist() == golden[f"{name}.image_grid_thw"].tolist()
        torch.testing.assert_close(out.pixel_values, golden[f"{name}.pixel_values"], atol=1e-5, rtol=0)
    _, _, model = models
    imgs = preprocess(model, make_fixtures.images()[:2])
    # the tiny checkpoint's processor: patch 4, merge 2, at most 4096 pixels, its own mean and std
    want = qwen_image.preprocess(make_fixtures.images()[:2], min_pixels=64, max_pixels=4096, patch_size=4,
                                 mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    assert torch.equal(imgs.pixel_values, want.pixel_values) and torch.equal(imgs.grid_thw, want.grid_thw)
    docs = [tiny.document([2, (int(h), int(w)), 3], i) for i, (_, h, w) in enumerate(imgs.grid_thw.tolist())]
    per_doc = [ImagePatches(p, g[None]) for p, g in zip(imgs.pixel_values.split(
        imgs.grid_thw.prod(-1).tolist()), imgs.grid_thw)]
    assert model(zoo.pack(docs, images=per_doc)).shape == (sum(len(d) for d in docs), tiny.VOCAB)


def test_text_only_pack(models):
    """No images at all: plain positions, the tower run once on no patches (every rank calls it under FSDP)."""
    ref, _, model = models
    docs, _ = _inputs([[9], [5]])
    calls = []
    hook = model.vision.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
    try:
        with torch.no_grad():
            logits = model(zoo.pack(docs))
    finally:
        hook.remove()
    assert calls == [0]
    with torch.no_grad():
        torch.testing.assert_close(logits[:9], ref(input_ids=docs[0][None]).logits[0], atol=1e-4, rtol=0)


def test_bad_inputs_are_named(models):
    _, _, model = models
    docs, images = _inputs(DOCS[:2])
    first = int((docs[0] == tiny.IMAGE).nonzero()[0])
    one_short = torch.cat([docs[0][:first], docs[0][first + 1:]])
    with pytest.raises(zoo.ZooError, match="document 0: image 0 of a document has 5 placeholder"):
        model(zoo.pack([one_short, docs[1]], images=images))
    with pytest.raises(zoo.ZooError, match="placeholders but 0 image grids"):
        model(zoo.pack(docs[:1]))
    with pytest.raises(zoo.ZooError, match="video placeholders"):
        model(zoo.pack([torch.cat([docs[0], torch.tensor([tiny.VIDEO])])], images=images[:1]))
    with pytest.raises(zoo.ZooError, match="not a mix"):
        zoo.pack(docs[:2], images=[images[0], torch.zeros(3, 8, 8)])
    assert HF_NAMES  # the name table is the one the converters read
