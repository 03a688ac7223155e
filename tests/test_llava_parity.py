"""LLaVA against transformers' LlavaForConditionalGeneration and the llava fixture, all from ONE packed forward.

Tiny random configs go through the real converter CLIs (transformers' save -> convert.hf_to_zoo -> zoo.load, and
zoo -> convert.zoo_to_hf -> transformers). Every document's logits, every document's loss and the gradients of
every parameter must equal the upstream ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import fixture_dir
from safetensors.torch import load_file, save_file

import zoo
from convert import hf_to_zoo, zoo_to_hf
from zoo.core.attention import available_backends
from zoo.core.layers import init_weights
from zoo.io.config import config_to_dict
from zoo.models import clip
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llava import Llava, LlavaConfig, hf_spellings, plan_to_hf

IMAGE_TOKEN = 60
PAD = 61
# every backend that runs here, at the other families' tolerances; flex runs forward only on CPU
BACKENDS = available_backends("cpu")


def _hf_config():
    from transformers import CLIPVisionConfig as HFVision
    from transformers import LlamaConfig as HFLlama
    from transformers import LlavaConfig as HFLlava

    text = HFLlama(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
                   rope_theta=10000.0, initializer_range=0.1)
    vision = HFVision(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
                      image_size=16, patch_size=4, hidden_act="quick_gelu", initializer_range=0.1)
    return HFLlava(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN, pad_token_id=PAD,
                   vision_feature_layer=-2, vision_feature_select_strategy="default")


@pytest.fixture(scope="module")
def hf_and_zoo(tmp_path_factory):
    """(transformers model, zoo model converted from its save_pretrained output by the CLI)."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(0)
    ref = LlavaForConditionalGeneration(_hf_config()).eval()
    with torch.no_grad():  # lift the norms and biases off their 1/0 init so that every weight matters
        for p in ref.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    ref.config._attn_implementation = "eager"
    tmp = tmp_path_factory.mktemp("llava")
    ref.save_pretrained(tmp / "hf")
    assert hf_to_zoo.main([str(tmp / "hf"), str(tmp / "zoo"), "--quiet"]) is None
    return ref, zoo.load(tmp / "zoo", attn="eager"), tmp


def _docs(image_tokens: int, seed: int = 1):
    """Three documents with 1, 0 and 2 images (placeholders already expanded) and their pixel values."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(2, 60, (n,), generator=g)

    img = torch.full((image_tokens,), IMAGE_TOKEN)
    docs = [torch.cat([text(3), img, text(6)]), text(9), torch.cat([text(2), img, text(4), img, text(3)])]
    images = [torch.randn(3, 16, 16, generator=g), None, torch.randn(2, 3, 16, 16, generator=g)]
    return docs, images


def _docs_with_equal_length_neighbours(image_tokens: int):
    """_docs' three documents, the first two each followed by a different document of the same length (one with an
    image of its own, one text only): neighbours that sdpa runs as one batched call."""
    docs, images = _docs(image_tokens)
    g = torch.Generator().manual_seed(7)
    img = torch.full((image_tokens,), IMAGE_TOKEN)
    twin_0 = torch.cat([torch.randint(2, 60, (5,), generator=g), img, torch.randint(2, 60, (4,), generator=g)])
    twin_1 = torch.randint(2, 60, (9,), generator=g)
    assert (len(twin_0), len(twin_1)) == (len(docs[0]), len(docs[1]))
    return ([docs[0], twin_0, docs[1], twin_1, docs[2]],
            [images[0], torch.randn(3, 16, 16, generator=g), None, None, images[2]])


def _per_doc_losses(logits_TV, labels_T, cu):
    out = []
    for a, b in itertools.pairwise(cu):
        out.append(F.cross_entropy(logits_TV[a:b].float(), labels_T[a:b], ignore_index=-100))
    return out


def _hf_labels(ids):
    return ids.masked_fill(ids == IMAGE_TOKEN, -100)


def test_config_and_names(hf_and_zoo):
    ref, model, _ = hf_and_zoo
    cfg = model.config
    assert (cfg.image_tokens, cfg.feature_layer, cfg.feature_select, cfg.image_token_id) == (16, -2, "default", 60)
    assert cfg.vision == CLIPVisionConfig(dim=24, n_layers=3, n_heads=2, ffn_dim=40, image_size=16, patch_size=4)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


@pytest.fixture(scope="module")
def hf_reference(hf_and_zoo):
    """transformers on the pack with equal-length neighbours: each document's logits and loss alone, and the loss
    and parameter gradients of the padded batch (one mean over all targets, as the pack's)."""
    ref, model, _ = hf_and_zoo
    docs, images = _docs_with_equal_length_neighbours(model.config.image_tokens)
    alone = []
    with torch.no_grad():
        for ids, im in zip(docs, images, strict=True):
            pv = None if im is None else (im if im.dim() == 4 else im[None])
            out = ref(input_ids=ids[None], pixel_values=pv, labels=_hf_labels(ids)[None])
            alone.append((out.logits[0], out.loss))
    L = max(len(d) for d in docs)
    ids = torch.full((len(docs), L), PAD)
    mask = torch.zeros(len(docs), L, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)] = d, 1
    hf_labels = _hf_labels(ids).masked_fill(mask == 0, -100)
    pixels = torch.cat([im if im.dim() == 4 else im[None] for im in images if im is not None])
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=hf_labels)
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    return docs, images, alone, out.loss.detach(), grads


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_loss_and_grads_equal_transformers(hf_and_zoo, hf_reference, backend):
    """One packed forward on each backend: every document's logits and loss equal transformers' on it alone, and
    (backends that train here) the pack's loss and every parameter's gradient equal transformers' on the padded
    batch."""
    ref, model, _ = hf_and_zoo
    docs, images, alone, hf_loss, hf_grads = hf_reference
    packed = zoo.pack(docs, images=images)
    assert packed.pixel_values.shape[0] == 4
    cu = packed.cu_seqlens.tolist()
    trains = backend != "flex"  # flex: forward only on CPU
    model.set_attention(backend)
    try:
        assert model.attend is zoo.get_attention(backend)  # the language model's attention really is this backend
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(trains):
            logits = model(packed)
            loss = model.loss(packed)
        if trains:
            loss.backward()
    finally:
        model.set_attention("eager")
    labels = model.labels(packed)
    doc_losses = _per_doc_losses(logits.detach(), labels, cu)
    for i, (want_logits, want_loss) in enumerate(alone):
        torch.testing.assert_close(logits[cu[i]:cu[i + 1]].detach(), want_logits, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, i=i: f"{backend} doc {i}: {m}")
        torch.testing.assert_close(doc_losses[i], want_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss.detach(), hf_loss, atol=1e-5, rtol=0)
    if not trains:
        return

    hf_params = dict(ref.named_parameters())
    plan = plan_to_hf(model.config, [n for n, _ in model.named_parameters()])
    compared = 0
    for hf_name, ((zoo_name,), _) in plan.items():
        hf_name = next(c for c in hf_spellings(hf_name) if c in hf_params)
        ours, theirs = model.get_parameter(zoo_name).grad, hf_grads[hf_name]
        if theirs is None:  # the tower's last layer and post-norm: present, never used (feature layer -2)
            assert ours is None or not ours.any(), zoo_name
            continue
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=lambda m, n=zoo_name: f"{backend} {n}: {m}")
        compared += 1
    assert compared > 40
    model.zero_grad(set_to_none=True)


def _fixture_pack(golden: dict):
    """The fixture's documents (1, 2 and 0 images) after the 23-token prefixes of the first two, each holding one
    whole image: two different equal-length neighbours with images. Returns docs, images, golden logits, losses."""
    from conftest import prefix_golden

    image_id = json.loads((fixture_dir("llava") / "config.json").read_text())["image_token_index"]
    docs = [golden[f"doc{i}.input_ids"][0] for i in range(3)]
    images = [golden.get(f"doc{i}.pixel_values") for i in range(3)]
    assert [0 if im is None else im.shape[0] for im in images] == [1, 2, 0]
    prefixes = [prefix_golden(golden, i, 23, ignore_id=image_id) for i in (0, 1)]
    assert all(int((ids == image_id).sum()) == 16 for ids, _, _ in prefixes)  # one whole image each
    second = images[1]
    assert second is not None
    return ([ids for ids, _, _ in prefixes] + docs, [images[0], second[:1]] + images,
            [logits for _, logits, _ in prefixes] + [golden[f"doc{i}.logits"] for i in range(3)],
            [loss for _, _, loss in prefixes] + [golden[f"doc{i}.loss"] for i in range(3)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixture_one_packed_forward(backend):
    path = fixture_dir("llava")
    docs, images, want_logits, want_losses = _fixture_pack(load_file(path / "golden.safetensors"))
    model = zoo.load(path, attn=backend)
    assert model.attend is zoo.get_attention(backend)
    packed = zoo.pack(docs, images=images)
    with torch.no_grad():
        logits = model(packed)
        loss = model.loss(packed)
    cu = packed.cu_seqlens.tolist()
    labels = model.labels(packed)
    doc_losses = _per_doc_losses(logits, labels, cu)
    counts = []
    for i in range(len(docs)):
        torch.testing.assert_close(logits[cu[i]:cu[i + 1]], want_logits[i][0], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, i=i: f"{backend} doc {i}: {m}")
        torch.testing.assert_close(doc_losses[i], want_losses[i], atol=1e-5, rtol=0)
        counts.append(int((labels[cu[i]:cu[i + 1]] != -100).sum()))
    expected = sum(c * want_losses[i] for i, c in enumerate(counts)) / sum(counts)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


def test_zoo_to_hf_loads_in_transformers(hf_and_zoo):
    from transformers import LlavaForConditionalGeneration

    ref, model, tmp = hf_and_zoo
    assert zoo_to_hf.main([str(tmp / "zoo"), str(tmp / "back"), "--quiet"]) is None
    names = set(load_file(tmp / "back" / "model.safetensors"))
    assert "multi_modal_projector.linear_1.weight" in names and "language_model.lm_head.weight" in names
    assert any(n.startswith("vision_tower.vision_model.encoder.") for n in names)  # the llava-hf spelling
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp / "back", output_loading_info=True,
                                                               attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    docs, images = _docs(model.config.image_tokens)
    with torch.no_grad():
        a = back(input_ids=docs[2][None], pixel_values=images[2]).logits
        b = ref(input_ids=docs[2][None], pixel_values=images[2]).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_transformers_in_memory_names(hf_and_zoo, tmp_path):
    """A state_dict of transformers 5's LlavaForConditionalGeneration as it sits in memory (`model.language_model.*`,
    `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.weight`) converts too."""
    ref, model, tmp = hf_and_zoo
    src = tmp_path / "in_memory"
    src.mkdir()
    names = list(ref.state_dict())
    assert "lm_head.weight" in names and any(n.startswith("model.vision_tower.encoder.") for n in names)
    save_file({n: t.contiguous() for n, t in ref.state_dict().items()}, src / "model.safetensors")
    (src / "config.json").write_text((tmp / "hf" / "config.json").read_text())
    assert hf_to_zoo.main([str(src), str(tmp_path / "zoo"), "--quiet"]) is None
    converted = load_file(tmp_path / "zoo" / "model.safetensors")
    assert converted.keys() == model.state_dict().keys()
    assert all(torch.equal(converted[n], t) for n, t in model.state_dict().items())


def test_original_llava_layout(hf_and_zoo, tmp_path, monkeypatch):
    """The original LLaVA repository's names and mm_* config (its tower named by mm_vision_tower) into zoo."""
    _, model, tmp = hf_and_zoo
    monkeypatch.setitem(clip.OPENAI_TOWERS, "test/tiny-clip", model.config.vision)
    hf = load_file(tmp / "hf" / "model.safetensors")
    renames = [("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower.vision_tower.vision_model."),
               ("multi_modal_projector.linear_1.", "model.mm_projector.0."),
               ("multi_modal_projector.linear_2.", "model.mm_projector.2.")]
    orig = {}
    for name, t in hf.items():
        prefix, new = next((p, n) for p, n in renames if name.startswith(p))
        orig[new + name[len(prefix):]] = t
    src = tmp_path / "orig"
    src.mkdir()
    save_file(orig, src / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((tmp / "hf" / "config.json").read_text())["text_config"]
    config = {**text, "model_type": "llava", "architectures": ["LlavaLlamaForCausalLM"],
              "mm_vision_tower": "test/tiny-clip", "mm_projector_type": "mlp2x_gelu", "mm_hidden_size": 24,
              "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch", "mm_use_im_start_end": False}
    (src / "config.json").write_text(json.dumps(config))
    assert hf_to_zoo.main([str(src), str(tmp_path / "zoo"), "--quiet"]) is None
    converted = zoo.load(tmp_path / "zoo", attn="eager")
    assert converted.config.image_token_id == -200  # the original code's IMAGE_TOKEN_INDEX
    for (n, a), (_, b) in zip(converted.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    docs, images = _docs(16)
    docs = [d.masked_fill(d == IMAGE_TOKEN, -200) for d in docs]
    with torch.no_grad():
        torch.testing.assert_close(converted(zoo.pack(docs, images=images)),
                                   model(zoo.pack(_docs(16)[0], images=images)), atol=0, rtol=0)


def test_placeholder_mismatch_names_the_document(hf_and_zoo):
    _, model, _ = hf_and_zoo
    docs, images = _docs(model.config.image_tokens)
    with pytest.raises(zoo.ZooError, match="document 2 has 32 image placeholder tokens .* but 1 image"):
        model(zoo.pack(docs, images=[images[0], None, images[2][:1]]))
    with pytest.raises(zoo.ZooError, match="document 0 has 16 .* but 0 image"):
        model(zoo.pack(docs, images=[None, None, images[2]]))
    packed = zoo.pack(docs, images=images)
    packed = dataclasses.replace(packed, pixel_values=packed.pixel_values[:2], images_per_doc=None)
    with pytest.raises(zoo.ZooError, match="the pack has 48 image placeholder tokens .* but 2 image"):
        model(packed)


def test_text_only_pack(hf_and_zoo):
    """No images at all: the logits are the language model's own; the tower still runs once, on no image."""
    _, model, _ = hf_and_zoo
    docs = [torch.tensor([1, 5, 9, 4]), torch.tensor([3, 8, 2])]
    packed = zoo.pack(docs)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(model(packed), model.language_model(packed), atol=0, rtol=0)
    model.loss(packed).backward()
    assert not model.vision.patch_embed.weight.grad.any()  # zeros, not None: every rank has the same grads
    with pytest.raises(zoo.ZooError, match="document 1 has 16 image placeholder tokens .* but 0 image"):
        model(zoo.pack([docs[0], torch.full((16,), IMAGE_TOKEN)]))


def test_freeze_parts(hf_and_zoo):
    _, model, _ = hf_and_zoo
    docs, images = _docs(model.config.image_tokens)
    try:
        model.freeze(vision=True, projector=False, language=True)  # LLaVA's stage 1
        model.zero_grad(set_to_none=True)
        model.loss(zoo.pack(docs, images=images)).backward()
        with_grad = {n.split(".")[0] for n, p in model.named_parameters() if p.grad is not None}
        assert with_grad == {"projector"}
        model.freeze(language=False)  # stage 2
        assert all(p.requires_grad for p in model.language_model.parameters())
        assert not any(p.requires_grad for p in model.vision.parameters())
    finally:
        model.freeze(vision=False, projector=False, language=False)


def _other_lm(family: str):
    if family == "internlm2":
        from zoo.models.internlm2 import InternLM2Config

        return InternLM2Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    from zoo.models.openelm import OpenELMConfig

    return OpenELMConfig(dim=32, n_layers=2, head_dim=8, n_heads=(4, 2), n_kv_heads=(2, 1), ffn_dim=(48, 64),
                         qkv_multipliers=(), ffn_multipliers=(), vocab_size=64)


@pytest.mark.parametrize("family", ["internlm2", "openelm"])
def test_other_language_models_packed_equals_alone(family):
    cfg = LlavaConfig(vision=CLIPVisionConfig(dim=24, n_layers=2, n_heads=2, ffn_dim=40, image_size=16,
                                              patch_size=4),
                      language_family=family, language=_other_lm(family), image_token_id=IMAGE_TOKEN)
    with torch.device("meta"):
        model = Llava(cfg, attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    docs, images = _docs(cfg.image_tokens)
    packed = zoo.pack(docs, images=images)
    with torch.no_grad():
        logits = model(packed)
        cu = packed.cu_seqlens.tolist()
        for i, (d, im) in enumerate(zip(docs, images, strict=True)):
            alone = model(zoo.pack([d], images=[im]))
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], alone, atol=1e-5, rtol=1e-5)
        # the zoo checkpoint round trip keeps the nested language config
        assert LlavaConfig(**json.loads(json.dumps(config_to_dict(cfg)))) == cfg


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_one_process(world, tmp_path):
    """gloo ranks: ring, ulysses (and hybrid at 4): loss and gradients equal one process; images on several ranks,
    one split across a shard boundary, and no rank encodes every image."""

    import _llava_sp_worker
    import _sp_worker

    out = tmp_path / "report.json"
    _sp_worker.launch(_llava_sp_worker.main, world, out)
    report = json.loads(out.read_text())
    assert len(report) == (4 if world == 4 else 3), report
    failures = [f"{case}: {detail}" for case, (ok, detail) in report.items() if not ok]
    assert not failures, "\n".join(failures)


def test_xtuner_layout_with_lora_adapters(hf_and_zoo, tmp_path):
    """XTuner's save (llm_adapter/, visual_encoder_adapter/, projector/ over base LLM and CLIP directories) into
    zoo: the LoRA deltas merged, the parts renamed, the result equal to the model with merged weights."""
    from convert import llava_layouts

    _, model, tmp = hf_and_zoo
    hf = load_file(tmp / "hf" / "model.safetensors")
    cfg = json.loads((tmp / "hf" / "config.json").read_text())

    def write(d, tensors, config):
        d.mkdir(parents=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config))

    llm = {n.replace("language_model.", "", 1): t for n, t in hf.items() if n.startswith("language_model.")}
    write(tmp_path / "base_llm", llm, cfg["text_config"])
    clip_model = {"vision_model." + n.removeprefix("vision_tower."): t for n, t in hf.items()
                  if n.startswith("vision_tower.")}
    clip_model["text_model.embeddings.token_embedding.weight"] = torch.zeros(3, 2)  # a CLIPModel's other half
    write(tmp_path / "base_clip", clip_model, {"model_type": "clip", "vision_config": cfg["vision_config"]})
    save = tmp_path / "xtuner"
    projector = {"model.0.weight": hf["multi_modal_projector.linear_1.weight"],
                 "model.0.bias": hf["multi_modal_projector.linear_1.bias"],
                 "model.2.weight": hf["multi_modal_projector.linear_2.weight"],
                 "model.2.bias": hf["multi_modal_projector.linear_2.bias"]}
    write(save / "projector", projector, {"model_type": "projector", "visual_hidden_size": 24, "llm_hidden_size": 32,
                                          "depth": 2, "hidden_act": "gelu", "bias": True})
    g = torch.Generator().manual_seed(5)
    expected = {}
    for part, base, targets, r, alpha in [
        ("llm_adapter", llm, ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"], 4, 8),
        # no lora_alpha in its config: PEFT's default, 8 (not r)
        ("visual_encoder_adapter", clip_model, ["vision_model.encoder.layers.0.self_attn.v_proj.weight"], 2, None),
    ]:
        lora = {}
        for name in targets:
            out_f, in_f = base[name].shape
            a, b = torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g)
            stem = "base_model.model." + name.removesuffix(".weight")
            lora[f"{stem}.lora_A.weight"], lora[f"{stem}.lora_B.weight"] = a, b
            expected[name] = base[name] + (b @ a) * (alpha or 8) / r
        (save / part).mkdir()
        save_file(lora, save / part / "adapter_model.safetensors")
        config = {"r": r, "peft_type": "LORA"} | ({"lora_alpha": alpha} if alpha else {})
        (save / part / "adapter_config.json").write_text(json.dumps(config))
    argv = [str(save), str(tmp_path / "zoo"), "--llm", str(tmp_path / "base_llm"),
            "--visual-encoder", str(tmp_path / "base_clip"), "--quiet"]
    assert llava_layouts.main(argv) is None
    converted = zoo.load(tmp_path / "zoo", attn="eager")
    assert converted.config.image_token_id == -200 and converted.config.vision == model.config.vision
    merged = {"language_model.layers.1.attn.q_proj.weight": expected["model.layers.1.self_attn.q_proj.weight"],
              "language_model.layers.0.mlp.down_proj.weight": expected["model.layers.0.mlp.down_proj.weight"],
              "vision.layers.0.attn.v_proj.weight": expected["vision_model.encoder.layers.0.self_attn.v_proj.weight"]}
    for name, want in model.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], merged.get(name, want), atol=1e-6, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(merged["vision.layers.0.attn.v_proj.weight"], model.state_dict()[
        "vision.layers.0.attn.v_proj.weight"])
    with pytest.raises(zoo.ZooError, match="pass its base language model with --llm"):
        llava_layouts.main([str(save), str(tmp_path / "zoo2"), "--quiet"])


def test_xtuner_full_llm_at_the_root_and_an_unprefixed_clip(hf_and_zoo, tmp_path):
    """to_xtuner_llava's save of a fully fine-tuned LLM (the LLM at the save root) over a CLIP tower saved by
    transformers 5 (tensor names without "vision_model."): converted, equal to the model."""
    from convert import llava_layouts

    _, model, tmp = hf_and_zoo
    hf = load_file(tmp / "hf" / "model.safetensors")
    cfg = json.loads((tmp / "hf" / "config.json").read_text())
    save, tower = tmp_path / "xtuner", tmp_path / "clip"
    for d, tensors, config in [
        (save, {n.replace("language_model.", "", 1): t for n, t in hf.items() if n.startswith("language_model.")},
         cfg["text_config"]),
        (tower, {n.removeprefix("vision_tower.").removeprefix("vision_model."): t for n, t in hf.items()
                 if n.startswith("vision_tower.")}, {"model_type": "clip_vision_model", **cfg["vision_config"]}),
        (save / "projector", {f"model.{i}.{p}": hf[f"multi_modal_projector.linear_{j}.{p}"]
                              for i, j in ((0, 1), (2, 2)) for p in ("weight", "bias")},
         {"depth": 2, "hidden_act": "gelu", "bias": True}),
    ]:
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config))
    assert not any(n.startswith("vision_model.") for n in load_file(tower / "model.safetensors"))
    argv = [str(save), str(tmp_path / "zoo"), "--visual-encoder", str(tower), "--quiet"]
    assert llava_layouts.main(argv) is None
    converted = zoo.load(tmp_path / "zoo", attn="eager").state_dict()
    for name, want in model.state_dict().items():
        assert torch.equal(converted[name], want), name


def test_greedy_generation_with_images_equals_transformers(hf_and_zoo):
    """zoo.generate over the three prompts at once (1, 0 and 2 images) equals transformers' greedy generate of
    each prompt alone, token for token."""
    from zoo.generate import generate

    ref, model, _ = hf_and_zoo
    docs, images = _docs(model.config.image_tokens)
    got = generate(model, docs, max_new_tokens=10, images=images)
    for ids, im, tokens in zip(docs, images, got, strict=True):
        extra = {} if im is None else {"pixel_values": im if im.dim() == 4 else im[None]}
        out = ref.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD, **extra)
        assert tokens.tolist() == out[0, len(ids):].tolist()


def test_decode_steps_skip_the_vision_tower_and_compile(hf_and_zoo, monkeypatch):
    """The tower runs once, in the prefill: a decode step's tokens are text, so it never runs on zero images. The
    compiled decode step (aot_eager here: the same whole graph without inductor's build) gives the same tokens."""
    import importlib

    from zoo.generate import generate

    _, model, _ = hf_and_zoo
    docs, images = _docs(model.config.image_tokens)
    calls = []
    hook = model.vision.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        eager = generate(model, docs, max_new_tokens=6, images=images, compile=False)
        assert calls == [3]  # the prefill's three images in one call, and no call a step
        monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
        compiled = generate(model, docs, max_new_tokens=6, images=images, compile=True)
    finally:
        hook.remove()
    assert calls == [3, 3]
    assert [t.tolist() for t in compiled] == [t.tolist() for t in eager]
