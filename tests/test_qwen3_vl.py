"""Qwen3-VL (DeepStack), Qwen3.5 multimodal (the hybrid Gated DeltaNet language model) and Qwen3.5-MoE multimodal
against transformers' own Qwen3VLForConditionalGeneration, Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration, on tiny random checkpoints they save
(tests/_tiny_qwen3_vl.py): a packed forward of several documents (images of different sizes, two in one document, a
text-only one) equals each document alone upstream in logits, loss over the text targets and gradients; greedy
generation with images; the converters both ways; zoo's preprocessing against the fast image processor's output
(goldens from tests/fixtures/qwen_vl/make_qwen3_fixtures.py); and every Qwen vision-language family (Qwen2.5-VL's
too) under sequence parallelism at 2 and 4 ranks against one process.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import _tiny_qwen3_vl as tiny
import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from convert import hf_to_zoo, zoo_to_hf
from zoo.core.attention import available_backends
from zoo.core.packing import ImagePatches
from zoo.generate import generate
from zoo.io.image import preprocess
from zoo.models import FAMILIES, qwen_image

FIXTURES = Path(__file__).parent / "fixtures" / "qwen_vl"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402  (the synthetic images the goldens were made from)

NAMES = ["qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl"]
LOGITS_ATOL = {"qwen3_vl": 1e-4, "qwen3_5_vl": 2e-4, "qwen3_5_moe_vl": 2e-4}
# gradients' relative distance from transformers in fp64: 1e-5, 5e-5 through the MoE's routers as test_qwen3_5_moe
# allows; or as far as transformers' own fp32 gradients are, where that is more
GRAD_REL = {"qwen3_vl": 1e-5, "qwen3_5_vl": 1e-5, "qwen3_5_moe_vl": 5e-5}
# per document: ints are text runs, (h, w) image grids in patches; two images in one, a text-only one
DOCS = [[3, (4, 6), 5], [2, (10, 8), 4, (4, 4), 3], [7], [1, (6, 4), 2]]
BACKENDS = [b for b in available_backends("cpu") if b not in ("flex", "auto")]


def _inputs(specs: list, seed: int = 0) -> tuple[list[torch.Tensor], list[ImagePatches | None]]:
    docs, images = [], []
    for d, spec in enumerate(specs):
        docs.append(tiny.document(spec, seed + d))
        grids = [x for x in spec if isinstance(x, tuple)]
        images.append(ImagePatches(torch.cat([tiny.pixels(g, 100 + 10 * d + i) for i, g in enumerate(grids)]),
                                   torch.tensor([[1, *g] for g in grids])) if grids else None)
    return docs, images


def _hf_kwargs(doc: torch.Tensor, im: ImagePatches | None, dtype: torch.dtype = torch.float32) -> dict:
    if im is None:
        return {}
    return dict(pixel_values=im.pixel_values.to(dtype), image_grid_thw=im.grid_thw,
                mm_token_type_ids=(doc == tiny.IMAGE).long()[None])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, its root dir with hf/ (save_pretrained) and zoo/ (hf_to_zoo), zoo model)."""
    out = {}
    for i, name in enumerate(NAMES):
        tmp = tmp_path_factory.mktemp(name)
        ref = tiny.save(name, tmp / "hf", seed=i)
        assert hf_to_zoo.main([str(tmp / "hf"), str(tmp / "zoo"), "--quiet"]) is None
        out[name] = (ref, tmp, zoo.load(tmp / "hf", attn="eager"))
    return out


def _reference(ref, docs, images, dtype):
    """transformers per document: logits, the text-target loss over all documents, its gradients by name."""
    if dtype != torch.float32:
        ref = copy.deepcopy(ref).to(dtype)
        if hasattr(ref, "set_experts_implementation"):
            ref.set_experts_implementation("eager")  # its grouped_mm takes no fp64
    ref.zero_grad(set_to_none=True)
    logits, total, count = [], 0.0, 0
    for doc, im in zip(docs, images):
        labels = doc.masked_fill(doc == tiny.IMAGE, -100)[None]  # text targets only, as zoo trains
        out = ref(input_ids=doc[None], labels=labels, **_hf_kwargs(doc, im, dtype))
        n = int((labels[0, 1:] != -100).sum())
        total, count = total + out.loss * n, count + n
        logits.append(out.logits[0].detach())
    loss = total / count
    loss.backward()
    return logits, loss.detach(), {n: p.grad.double() for n, p in ref.named_parameters()}


def _in_memory_plan(model, name: str) -> dict:
    """{transformers' in-memory parameter name: (zoo names, combine)}: the converter's plan, but the MoE's experts
    stacked and its router `mlp.gate` as transformers holds them on load (zoo holds them so too)."""
    from zoo.models.qwen3_5 import hf_name
    from zoo.models.qwen3_vl import _in_vl

    zoo_names = [n for n, _ in model.named_parameters()]
    plan = FAMILIES[name].plan_to_hf(model.config, zoo_names)
    if name != "qwen3_5_moe_vl":
        return plan
    routed = [z for z in zoo_names if ".mlp.experts." in z or ".mlp.router." in z]
    plan = {h: v for h, v in plan.items() if not set(v[0]) & set(routed)}
    for z in routed:
        plan[_in_vl(hf_name(model.config.language, z.removeprefix("language_model.").replace(".mlp.router.",
                                                                                             ".mlp.gate.")))] = ((z,),
                                                                                                                 None)
    return plan


@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_each_document_alone(models, name):
    """One packed forward of the documents = each alone upstream: logits (every CPU backend but flex), the loss over
    the text targets within 1e-5 and every gradient within GRAD_REL relative of transformers in fp64, or as close
    as transformers' own fp32 gradients are where fp32 rounding (the chunked delta rule) puts those further."""
    ref, _, model = models[name]
    docs, images = _inputs(DOCS)
    packed = zoo.pack(docs, images=images)
    ref_logits, ref_loss, ref_grads32 = _reference(ref, docs, images, torch.float32)
    _, ref_loss64, ref_grads = _reference(ref, docs, images, torch.float64)
    cu = packed.cu_seqlens.tolist()
    plan = _in_memory_plan(model, name)
    for backend in BACKENDS:
        model.set_attention(backend)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            logits = model(packed)
        for d, want in enumerate(ref_logits):
            torch.testing.assert_close(logits[cu[d]:cu[d + 1]], want, atol=LOGITS_ATOL[name], rtol=0)
        loss = model.loss(packed)
        assert abs(loss.item() - ref_loss64.item()) < 1e-5 and abs(ref_loss.item() - ref_loss64.item()) < 1e-5
        loss.backward()
        grads = dict((n, p.grad) for n, p in model.named_parameters())
        assert set(plan) == set(ref_grads)
        for hf_name, (sources, combine) in plan.items():
            parts = [grads[s] for s in sources]
            ours = (parts[0] if combine is None else combine(parts)).double()
            want = ref_grads[hf_name]
            bound = max(GRAD_REL[name], ((ref_grads32[hf_name] - want).norm() / want.norm()).item())
            rel = ((ours - want).norm() / want.norm()).item()
            assert want.norm() > 0 and rel < bound, f"{name} {backend} {hf_name}: {rel:.2e} (bound {bound:.2e})"
    model.set_attention("eager")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(models, name):
    ref, _, model = models[name]
    docs, images = _inputs(DOCS[:3], seed=7)
    ours = generate(model, docs, images=images, max_new_tokens=8)
    for doc, im, got in zip(docs, images, ours):
        want = ref.generate(input_ids=doc[None], max_new_tokens=8, do_sample=False, **_hf_kwargs(doc, im))
        assert got.tolist() == want[0, len(doc):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_converters_round_trip_bit_exact_and_transformers_loads_the_export(models, name):
    import transformers

    ref, tmp, model = models[name]
    assert zoo.load(tmp / "zoo").config == model.config  # the processor's settings travel in zoo's config
    assert zoo_to_hf.main([str(tmp / "zoo"), str(tmp / "back"), "--quiet"]) is None
    before, after = load_file(tmp / "hf" / "model.safetensors"), load_file(tmp / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    processor = json.loads((tmp / "back" / "preprocessor_config.json").read_text())
    assert (processor["min_pixels"], processor["max_pixels"], processor["patch_size"]) == (64, 4096, 4)
    cls = type(ref)
    back = cls.from_pretrained(tmp / "back", attn_implementation="eager").eval()
    assert type(back) is getattr(transformers, cls.__name__)
    doc, im = (x[0] for x in _inputs(DOCS[:1]))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=doc[None], **_hf_kwargs(doc, im)).logits,
                                   ref(input_ids=doc[None], **_hf_kwargs(doc, im)).logits, atol=0, rtol=0)
    assert zoo.load(tmp / "back").config == model.config


def test_published_layouts(models, tmp_path):
    """Qwen3-VL's hub config.json (rope_scaling with mrope_interleaved, rope_theta beside it) with a
    preprocessor_config.json of size {shortest_edge, longest_edge} reads as transformers 5's; a Qwen3.5 checkpoint's
    multi-token-prediction head is left out with one line; a text-only Qwen3.5 checkpoint stays the text family."""
    _, tmp, model = models["qwen3_vl"]
    hub = json.loads((tmp / "hf" / "config.json").read_text())
    rope = hub["text_config"].pop("rope_parameters")
    hub["text_config"].update(rope_theta=rope["rope_theta"], rope_scaling={
        "rope_type": "default", "mrope_section": rope["mrope_section"], "mrope_interleaved": True})
    (tmp_path / "config.json").write_text(json.dumps(hub))
    shutil.copy(tmp / "hf" / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(tiny.PROCESSOR["image_processor"]))
    hub_model = zoo.load(tmp_path)
    assert hub_model.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(hub_model.state_dict().values(), model.state_dict().values()))

    _, tmp, model = models["qwen3_5_vl"]
    mtp = tmp_path / "mtp"
    shutil.copytree(tmp / "hf", mtp)
    tensors = load_file(mtp / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(2, 2)}, mtp / "model.safetensors", metadata={"format": "pt"})
    loaded = zoo.load(mtp).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    text = json.loads((tmp / "hf" / "config.json").read_text())["text_config"]
    assert FAMILIES["qwen3_5"].hf_model_types == ("qwen3_5_text",) and text["model_type"] == "qwen3_5_text"


def test_preprocess_equals_the_fast_image_processor(models):
    """zoo's preprocessing against transformers' fast Qwen2VLImageProcessor as Qwen3-VL and Qwen3.5 configure it
    (16-pixel patches, mean and std 0.5; goldens from make_qwen3_fixtures.py): the same grids, pixel values within
    1e-5; and through a model's own settings."""
    golden = load_file(FIXTURES / "golden_qwen3.safetensors")
    meta = json.loads((FIXTURES / "golden_qwen3.json").read_text())
    for setting, kwargs in meta.items():
        out = qwen_image.preprocess(make_fixtures.images(), **kwargs)
        assert out.grid_thw.tolist() == golden[f"{setting}.image_grid_thw"].tolist()
        if f"{setting}.pixel_values" in golden:  # the published setting's are kept as grids alone
            torch.testing.assert_close(out.pixel_values, golden[f"{setting}.pixel_values"], atol=1e-5, rtol=0)
    assert "small.pixel_values" in golden
    _, _, model = models["qwen3_5_vl"]
    imgs = preprocess(model, make_fixtures.images()[:2])
    want = qwen_image.preprocess(make_fixtures.images()[:2], min_pixels=64, max_pixels=4096, patch_size=4,
                                 mean=(0.5,) * 3, std=(0.5,) * 3)
    assert torch.equal(imgs.pixel_values, want.pixel_values) and torch.equal(imgs.grid_thw, want.grid_thw)


def test_text_only_video_and_deepstack_bounds(models):
    """A text-only pack of the multimodal model equals transformers' text logits; videos are refused in one line; a
    DeepStack deeper than the language model is refused."""
    ref, _, model = models["qwen3_5_vl"]
    docs, _ = _inputs([[9], [5]])
    with torch.no_grad():
        torch.testing.assert_close(model(zoo.pack(docs))[:9], ref(input_ids=docs[0][None]).logits[0], atol=2e-4,
                                   rtol=0)
    docs, images = _inputs(DOCS[:1])
    with pytest.raises(zoo.ZooError, match="video placeholders .* reads images only"):
        model(zoo.pack([torch.cat([docs[0], torch.tensor([tiny.VIDEO])])], images=images))
    import dataclasses

    cfg = models["qwen3_vl"][2].config
    with pytest.raises(zoo.ZooError, match="3 DeepStack levels for a language model of 2 layers"):
        dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, deepstack_layers=(0, 1, 2)),
                            language=dataclasses.replace(cfg.language, n_layers=2))


@pytest.mark.parametrize("name", NAMES)
def test_a_pack_without_images_gives_every_tower_weight_a_gradient(models, name):
    """A text-only pack runs the tower on no patches and writes its (empty) output into no rows: every weight of the
    tower, its merger and DeepStack's mergers gets a gradient (zero), as with images, so that ranks of a
    data-parallel step where one holds no image reduce the same tensors under FSDP."""
    model = models[name][2]
    tower = [(n, p) for n, p in model.named_parameters() if n.startswith("vision.")]
    assert tower and any("merger" in n for n, _ in tower)
    for specs in ([[9], [5]], DOCS[:1]):
        model.zero_grad(set_to_none=True)
        docs, images = _inputs(specs)
        model.loss(zoo.pack(docs, images=images)).backward()
        assert [n for n, p in tower if p.grad is None] == [], specs
    assert all(torch.isfinite(p.grad).all() for _, p in tower)
    model.zero_grad(set_to_none=True)


def test_moe_language_model_balancing_terms_equal_transformers(models):
    """Qwen3.5-MoE multimodal: the loss with aux_loss_coef adds the load-balancing loss over every token (image tokens
    included) as transformers' output_router_logits does; the parts hold the terms."""
    ref, _, model = models["qwen3_5_moe_vl"]
    docs, images = _inputs(DOCS[:1])
    coef = 0.37
    labels = docs[0].masked_fill(docs[0] == tiny.IMAGE, -100)[None]  # zoo never trains on placeholders
    before, ref.config.text_config.router_aux_loss_coef = ref.config.text_config.router_aux_loss_coef, coef
    try:
        with torch.no_grad():
            out = ref(input_ids=docs[0][None], labels=labels, output_router_logits=True,
                      **_hf_kwargs(docs[0], images[0]))
    finally:
        ref.config.text_config.router_aux_loss_coef = before
    parts: dict = {}
    with torch.no_grad():
        loss = model.loss(zoo.pack(docs, images=images), aux_loss_coef=coef, parts=parts)
    assert abs(parts["aux_loss"].item() - out.aux_loss.item()) < 1e-5
    assert abs(loss.item() - out.loss.item()) < 1e-5
    assert parts["expert_counts"].shape == (4, 4)  # [MoE layers, experts]


def test_sequence_parallel_equals_one_process(tmp_path):
    """gloo, one spawn of 4 ranks: Qwen2.5-VL, Qwen3-VL (DeepStack at the image rows of each shard), Qwen3.5 and
    Qwen3.5-MoE (the Gated DeltaNet's state passing between ranks) under ring and Ulysses over 2 ranks and ring,
    Ulysses and hybrid (2 x 2) over 4: loss and every gradient equal one process, with an image crossing a cut in
    each layout, two images in one document and a text-only one (tests/_qwen_vl_sp_worker.py); Ulysses that cannot
    split the DeltaNet's key heads refused in one line."""
    import _qwen_vl_sp_worker
    import _sp_worker

    out = tmp_path / "report.json"
    _sp_worker.launch(_qwen_vl_sp_worker.main, 4, out)
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"][1]
    assert sorted(report) == sorted(_qwen_vl_sp_worker.case_names()), report
    failures = [f"{case}: {detail}" for case, (ok, detail) in report.items() if not ok]
    assert not failures, "\n".join(failures)
