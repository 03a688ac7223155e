"""Gemma 3 with its eyes against transformers' own Gemma3ForConditionalGeneration, on a tiny random checkpoint it
saved (save_pretrained: transformers 5's `vision_tower.*` names, SigLIP's unused pooling head included) and the same
tensors in the published layout (`vision_tower.vision_model.*`, no head, as google/gemma-3-* hold them):

- one packed forward of three documents (two images in one, a text-only one, one that opens with an image) equals
  each document alone in transformers with the processor's token_type_ids, on every CPU backend; the loss over the
  text targets and every gradient equal upstream's on the backends that train here. The sliding window (3) is
  shorter than an image (4 tokens), so the AND of window and block is checked; a causal-only model would differ;
- flex's BlockMask with blocks covers every allowed pair in partial or full tiles, full tiles are all allowed
  (small tiles, so that blocks cross them); flash_varlen with blocks runs flex;
- zoo's preprocessing equals transformers' fast Gemma3ImageProcessor (golden fixtures made once with torchvision);
- greedy generation with images equals transformers' token for token; hf -> zoo -> hf is bit-exact and
  transformers loads the export as Gemma3ForConditionalGeneration with nothing missing;
- Ulysses sequence parallel over 2 processes, image tokens crossing the shard cut, equals one process; the ring
  refuses blocks in one line.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES
from helpers import hf_greedy
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import zoo
from zoo.core import blocks as bidi
from zoo.core.attention import available_backends, document_block_mask, eager
from zoo.core.packing import runs_of
from zoo.errors import ZooError
from zoo.generate import generate
from zoo.io.image import clip_preprocess, preprocess
from zoo.models.gemma3_vision import hf_spellings, plan_to_hf

IMG, BOI, EOI, NL = 127, 125, 126, 10
CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def image_run() -> list[int]:
    """An image as Gemma3Processor writes it: "\\n\\n<start_of_image>" + 4 soft tokens + "<end_of_image>\\n\\n"."""
    return [NL, NL, BOI, *[IMG] * 4, EOI, NL, NL]


DOCS = [torch.tensor([2, 5, 6, *image_run(), 7, 8, 9, *image_run(), 11, 12]), torch.tensor([2, 30, 31, 32, 33, 34]),
        torch.tensor([*image_run(), 40, 41, 42])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    root = tmp_path_factory.mktemp("gemma3_vision")
    text = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                            sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                            query_pre_attn_scalar=20, rope_parameters=ROPE, bos_token_id=None, eos_token_id=None,
                            pad_token_id=None)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)  # 4 x 4 patches, pooled 2 x 2 to 4 soft tokens
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMG,
                          boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight off its init (the norms' 0, the projection's 0)
        for n, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.3 * noise if "norm" in n or n.endswith(".bias") else (0.1 if "embed" in n else 0.2) * noise)
    hf.eval().config._attn_implementation = "eager"
    hf.save_pretrained(root / "saved")
    # the published layout: vision_tower.vision_model.*, no pooling head, vision_use_head false
    saved = load_file(root / "saved" / "model.safetensors")
    published = {(f"vision_tower.vision_model.{n[len('vision_tower.'):]}" if n.startswith("vision_tower.") else n): t
                 for n, t in saved.items() if not n.startswith("vision_tower.head.")}
    (root / "published").mkdir()
    save_file(published, root / "published" / "model.safetensors")
    cfg = json.loads((root / "saved" / "config.json").read_text())
    cfg["vision_config"]["vision_use_head"] = False
    (root / "published" / "config.json").write_text(json.dumps(cfg))
    pixels = [torch.randn(2, 3, 56, 56, generator=g), None, torch.randn(1, 3, 56, 56, generator=g)]
    return SimpleNamespace(hf=hf, root=root, pixels=pixels, published=published)


def hf_alone(hf, doc, pixels, **kw):
    """transformers on one document, with the processor's token_type_ids (1 on the image tokens)."""
    extra = {} if pixels is None else {"pixel_values": pixels, "token_type_ids": (doc == IMG).long()[None]}
    return hf(input_ids=doc[None], **extra, **kw).logits[0]


def test_packed_equals_each_document_alone(tiny, caplog):
    """Logits per CPU backend; loss over text targets and every gradient per training backend."""
    hf = tiny.hf
    with caplog.at_level(logging.WARNING, logger="zoo.io.load"):
        model = zoo.load(tiny.root / "saved", attn="eager")
    said = [r.getMessage() for r in caplog.records if r.name == "zoo.io.load"]
    assert len(said) == 1 and "pooling head" in said[0], said
    assert model.family == "gemma3_vision"
    packed = zoo.pack(DOCS, images=tiny.pixels)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        ref = [hf_alone(hf, d, p) for d, p in zip(DOCS, tiny.pixels)]
        causal = hf(input_ids=DOCS[0][None], pixel_values=tiny.pixels[0]).logits[0]
    assert (ref[0] - causal).abs().max() > 1e-2  # the bidirectional block matters
    for backend in CPU_BACKENDS:
        model.set_attention(backend)
        with torch.no_grad():
            ours = model(packed)
        for i, r in enumerate(ref):
            torch.testing.assert_close(ours[cu[i]:cu[i + 1]], r, atol=1e-4, rtol=1e-4, msg=f"{backend} doc {i}")

    hf.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for d, p in zip(DOCS, tiny.pixels):
        target = d[1:].masked_fill(d[1:] == IMG, -100)  # image tokens are never targets
        total = total + F.cross_entropy(hf_alone(hf, d, p)[:-1], target, reduction="sum")
        count += int((target != -100).sum())
    ref_loss = total / count
    ref_loss.backward()
    hf_params = dict(hf.named_parameters())
    for backend in TRAIN_BACKENDS:
        model.set_attention(backend)
        model.zero_grad(set_to_none=True)
        loss = model.loss(packed)
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-5, (backend, loss.item(), ref_loss.item())
        plan = plan_to_hf(model.config, [n for n, _ in model.named_parameters()])
        for hf_name, ((zoo_name,), _) in plan.items():
            theirs = hf_params[next(c for c in hf_spellings(hf_name) if c in hf_params)].grad
            torch.testing.assert_close(model.get_parameter(zoo_name).grad, theirs, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=zoo_name, b=backend: f"{b} {n}: {m}")
    hf.zero_grad(set_to_none=True)


def test_flex_tiles_cover_blocks_and_varlen_runs_flex():
    """document_block_mask with blocks, in 16-token tiles over 3 documents whose image blocks cross tiles: every
    allowed pair lies in a computed tile, every full tile is allowed throughout; flash_varlen (a stand-in kernel
    that must not be called) runs flex, equal to eager."""
    from zoo.core.attention import _varlen
    from zoo.core.kernels import VarlenKernel

    lens, B = [40, 9, 47], 16
    cu = torch.tensor([0, 40, 49, 96], dtype=torch.int32)
    ids = torch.zeros(96, dtype=torch.long)
    for a, b in [(5, 25), (30, 38), (49, 52), (60, 61), (70, 95)]:
        ids[a:b] = IMG
    blocks = runs_of(ids == IMG, cu)
    for window in (None, 6):
        allowed = torch.block_diag(*[bidi.document_mask(b, window) for b in blocks.split(lens)])
        mask = document_block_mask(cu, 96, block=B, window=window, blocks=blocks)
        computed = mask.to_dense()[0, 0].bool().repeat_interleave(B, 0).repeat_interleave(B, 1)[:96, :96]
        assert not (allowed & ~computed).any(), window
        full = torch.zeros(6, 6, dtype=torch.bool)
        for q in range(6):
            full[q, mask.full_kv_indices[0, 0, q, :mask.full_kv_num_blocks[0, 0, q]]] = True
        full = full.repeat_interleave(B, 0).repeat_interleave(B, 1)[:96, :96]
        assert not (full & ~allowed).any(), window
        assert (computed & ~allowed).any()  # partial tiles hold masked pairs: the mask_mod decides them
        tiles = mask.to_dense()[0, 0].bool()  # past the diagonal, only tiles that hold a pair of a block
        holds = F.pad(allowed, (0, 6 * B - 96, 0, 6 * B - 96)).view(6, B, 6, B).any(3).any(1)
        assert not (tiles & ~holds).triu(1).any(), window
    packed = zoo.pack([ids[:40], ids[40:49], ids[49:]]).with_blocks(lambda p: runs_of(p.input_ids == IMG,
                                                                                       p.cu_seqlens))
    q, k, v = torch.randn(96, 4, 8), torch.randn(96, 2, 8), torch.randn(96, 2, 8)

    def never(*args):
        raise AssertionError("a varlen kernel got bidirectional blocks")

    got = _varlen(VarlenKernel("stand-in", "native", never, window=True), q, k, v, packed, None, 6)
    torch.testing.assert_close(got, eager(q, k, v, packed, window=6), atol=1e-5, rtol=1e-5)


def test_preprocess_equals_the_fast_image_processor():
    """zoo.io.image.preprocess = Gemma3ImageProcessor (torchvision) on RGB images larger, smaller and equal to the
    tower's side, a grey-scale and an RGBA one, at two sides (fixtures made by make_fixtures.py)."""
    from zoo.models.clip import CLIPVisionConfig
    from zoo.models.gemma3_vision import Gemma3Vision, Gemma3VisionConfig

    path = FIXTURES / "gemma3_vision" / "pixels.safetensors"
    tensors = load_file(path)
    modes = json.loads(safe_open(path, "pt").metadata()["modes"])
    images = [Image.fromarray(tensors[f"image{i}"].numpy()[..., 0] if m == "L" else tensors[f"image{i}"].numpy(),
                              mode=m) for i, m in enumerate(modes)]
    for side in (56, 70):
        tower = CLIPVisionConfig(dim=8, n_layers=1, n_heads=2, ffn_dim=8, image_size=side, patch_size=14,
                                 class_token=False, pre_norm=False, patch_bias=True)
        with torch.device("meta"):
            model = Gemma3Vision(Gemma3VisionConfig(vision=tower, mm_tokens_per_image=1))
        torch.testing.assert_close(preprocess(model, images), tensors[f"pixel_values_{side}"], atol=1e-5, rtol=0)
    with pytest.raises(ZooError, match="takes no images"):
        preprocess(zoo.load("qwen3-0.6b", device="meta"), images)
    llava = zoo.load("llava-openelm-270m", device="meta")  # LLaVA dispatches the same way: CLIP's, no pad
    want = torch.stack([clip_preprocess(im, size=336) for im in images[:2]])
    assert torch.equal(preprocess(llava, images[:2]), want)


def test_generate_with_images_equals_transformers(tiny):
    model = zoo.load(tiny.root / "published", attn="sdpa")
    prompts, pixels = [DOCS[0], DOCS[2]], [tiny.pixels[0], tiny.pixels[2]]
    got = generate(model, prompts, images=pixels, max_new_tokens=8, stop=[], repetition_penalty=1.5)
    for prompt, p, ours in zip(prompts, pixels, got):
        want = hf_greedy(tiny.hf, prompt, 8, pixel_values=p, token_type_ids=(prompt == IMG).long()[None],
                         repetition_penalty=1.5)
        assert ours.tolist() == want
    assert len({t for o in got for t in o.tolist()}) > 4  # not one repeated token


def test_converters_round_trip_and_errors(tiny, tmp_path):
    """Published layout -> zoo -> hf: bit-exact, and transformers loads the export as its own class with nothing
    missing and the same logits. A wrong image count is one line; the ring refuses blocks (see the SP worker)."""
    from transformers import AutoModelForImageTextToText

    from convert import hf_to_zoo, zoo_to_hf

    assert hf_to_zoo.main([str(tiny.root / "published"), str(tmp_path / "zoo"), "--quiet"]) is None
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"]) is None
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.keys() == tiny.published.keys()
    for n, t in out.items():
        assert t.dtype == tiny.published[n].dtype and torch.equal(t, tiny.published[n]), n
    back, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                             attn_implementation="eager")
    assert not any(info.values()), info
    assert type(back).__name__ == "Gemma3ForConditionalGeneration"
    with torch.no_grad():
        torch.testing.assert_close(hf_alone(back, DOCS[0], tiny.pixels[0]), hf_alone(tiny.hf, DOCS[0], tiny.pixels[0]),
                                   atol=1e-6, rtol=1e-6)
    model = zoo.load(tmp_path / "zoo")
    with pytest.raises(ZooError, match="document 0 has 8 image placeholder tokens .* but 1 image"):
        model.embed_inputs(zoo.pack(DOCS[:1], images=[tiny.pixels[2]]))


def test_ulysses_equals_one_process_and_the_ring_refuses(tmp_path):
    """2 gloo ranks: Ulysses with an image split by the shard cut equals one process; ring refuses in one line."""
    import _gemma3_vision_sp_worker
    import _sp_worker

    out = tmp_path / "report.json"
    _sp_worker.launch(_gemma3_vision_sp_worker.main, 2, out)
    report = json.loads(out.read_text())
    assert sorted(report) == ["ring refuses", "ulysses"], report
    failures = [f"{case}: {detail}" for case, (ok, detail) in report.items() if not ok]
    assert not failures, "\n".join(failures)


def test_reads_both_processor_layouts(tiny, tmp_path):
    """The published preprocessor_config.json and transformers 5's processor_config.json (the image processor
    nested, image_seq_length beside it) give the same config; its mean and std reach zoo's preprocessing, equal to
    transformers' Gemma3ImageProcessor (the PIL one: on an image of the tower's size no resize differs); zoo_to_hf
    writes the published layout back, which transformers reads; what zoo cannot run is refused in one line."""
    import shutil

    from transformers import AutoImageProcessor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from convert import hf_to_zoo, zoo_to_hf

    ip = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56}, "resample": 2,
          "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25], "do_pan_and_scan": None}
    layouts = {"preprocessor_config.json": {**ip, "image_seq_length": 4, "processor_class": "Gemma3Processor"},
               "processor_config.json": {"image_processor": ip, "image_seq_length": 4,
                                         "processor_class": "Gemma3Processor"}}
    configs = []
    for name, content in layouts.items():
        d = tmp_path / name.split(".")[0]
        shutil.copytree(tiny.root / "published", d)
        (d / name).write_text(json.dumps(content))
        configs.append(zoo.load(d, device="meta").config)
    assert configs[0] == configs[1]
    assert (configs[0].image_mean, configs[0].image_std) == ((0.4, 0.5, 0.6), (0.2, 0.3, 0.25))
    model = zoo.load(tmp_path / "preprocessor_config")
    g = torch.Generator().manual_seed(5)
    image = Image.frombytes("RGB", (56, 56), bytes(torch.randint(0, 256, (56 * 56 * 3,), generator=g,
                                                                  dtype=torch.uint8).tolist()))
    want = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=ip["image_mean"],
                                   image_std=ip["image_std"])([image], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(preprocess(model, [image]), want, atol=1e-5, rtol=0)
    assert hf_to_zoo.main([str(tmp_path / "processor_config"), str(tmp_path / "zoo"), "--quiet"]) is None
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "back"), "--quiet"]) is None
    back = AutoImageProcessor.from_pretrained(tmp_path / "back", backend="pil")
    assert (list(back.image_mean), list(back.image_std)) == (ip["image_mean"], ip["image_std"])
    assert zoo.load(tmp_path / "back", device="meta").config == configs[0]
    for bad, want_error in (({"size": {"height": 64, "width": 64}}, "resizes to .* takes 56 x 56"),
                            ({"do_pan_and_scan": True}, "pan-and-scan"),
                            ({"image_seq_length": 16}, "image_seq_length 16 differs .* mm_tokens_per_image 4")):
        (tmp_path / "preprocessor_config" / "preprocessor_config.json").write_text(json.dumps({**ip, **bad}))
        with pytest.raises(ZooError, match=want_error) as e:
            zoo.load(tmp_path / "preprocessor_config", device="meta")
        assert "\n" not in str(e.value)
