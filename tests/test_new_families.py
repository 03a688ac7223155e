"""Qwen2, Qwen3 and Mistral get what the older families have, against transformers' own classes (tiny random
checkpoints saved by Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM and LlavaForConditionalGeneration):

- LoRA's `auto` targets are PEFT's defaults for the model type, and the exported adapter, loaded by PEFT onto
  transformers' model, gives zoo's LoRA logits and (merge_and_unload) zoo's merged weights bit for bit;
- the recipes train them from a Hugging Face directory (SFT with LoRA on a tied Qwen2, pretraining on a Mistral
  whose window cuts the documents) and their exports load in zoo and transformers;
- a LLaVA over a Qwen2 (tied head, as Qwen2.5-0.5B) or Mistral (as BakLLaVA) language model equals transformers' on a
  packed multimodal batch on every CPU backend, and converts to zoo and back bit for bit.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import _tiny_families as tiny
import pytest
import torch
import torch.nn.functional as F
from helpers import adamw_steps, assert_adapter_logits, assert_near_uniform, export_lora
from safetensors.torch import load_file

import zoo
from zoo.core.attention import available_backends
from zoo.models import FAMILIES, Model
from zoo.train.lora import LoRAConfig, apply_lora, lora_modules, merged_state

BACKENDS = available_backends("cpu")  # eager, sdpa, flex (forward only on CPU), auto


def _docs(vocab: int, lengths=(20, 13, 27), seed: int = 3) -> list[torch.Tensor]:
    """Documents longer than Mistral's window of 8 (it cuts every one of them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _hf_state(model: Model, state: dict | None = None) -> dict[str, torch.Tensor]:
    """A zoo model's weights (or `state`, its plain state dict) under their Hugging Face names."""
    state = model.state_dict() if state is None else state
    plan = FAMILIES[model.family].plan_to_hf(model.config, list(state))
    return {hf: state[srcs[0]] for hf, (srcs, fn) in plan.items() if fn is None and len(srcs) == 1}


@pytest.fixture(scope="session")
def hf_lms(tmp_path_factory):
    """family -> (transformers model, its save_pretrained directory); Qwen2's head tied to its embedding, as the small
    Qwen2.5 models have it."""
    root = tmp_path_factory.mktemp("new_families")
    return {f: (m, root / f) for f in tiny.TEXT_FAMILIES
            for m in [tiny.save_causal_lm(f, root / f, seed=tiny.TEXT_FAMILIES.index(f), tie=f == "qwen2")]}


# ---- LoRA with PEFT's names ----


@pytest.mark.parametrize("family", tiny.TEXT_FAMILIES)
def test_lora_auto_is_peft_s_default_and_peft_loads_the_trained_adapter(hf_lms, family, tmp_path):
    """LoRA `auto` wraps exactly what PEFT adapts by default for the model type (q_proj, v_proj); after three AdamW
    steps the adapter export_adapter writes loads in PEFT over transformers' model (the same modules adapted) with
    zoo's LoRA logits, and PEFT's merge_and_unload gives zoo's merged weights bit for bit."""
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    ref, path = hf_lms[family]
    assert FAMILIES[family].lora_targets == tuple(PEFT_DEFAULTS[ref.config.model_type])
    model = zoo.load(path, attn="eager")
    base = {n: t.clone() for n, t in model.state_dict().items()}
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    wrapped = apply_lora(model, lora, seed=1)
    assert wrapped == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{w}.lora_{x}.weight" for w in wrapped for x in "AB"}

    docs = _docs(model.config.vocab_size)
    packed = zoo.pack(docs)
    losses = adamw_steps(model, packed)
    assert losses[-1] < losses[0], losses
    assert all(m.lora_B.weight.abs().min() > 0 for m in lora_modules(model).values())  # every B moved off zero
    for name, t in model.state_dict().items():  # the base is frozen: Qwen2's q/v biases too
        if ".lora_" not in name:
            assert torch.equal(t, base[name.replace(".base.", ".")]), name

    plain, out = export_lora(model, lora, path, tmp_path)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["target_modules"], config["r"], config["lora_alpha"]) == (["q_proj", "v_proj"], 4, 8)

    hf = tiny.causal_lm_class(family).from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, out).eval()
    adapted = {n for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{p}" for i in range(2)
                       for p in ("q_proj", "v_proj")}
    assert_adapter_logits(model, hf, ref, packed, docs, family)  # the adapter changes the model: the check can fail

    merged = hf.merge_and_unload().state_dict()
    ours = _hf_state(plain, merged_state(model.state_dict(), lora.scale))
    tied = {"lm_head.weight"} if model.config.tie_embeddings else set()
    assert set(merged) == set(ours) | tied
    before = _hf_state(plain, base)
    changed = 0
    for name, t in ours.items():
        assert torch.equal(merged[name], t), name
        changed += not torch.equal(t, before[name])
    assert changed == 4  # the q and v weights of both layers, nothing else


# ---- the recipes ----

RUN = ["--no-progress", "--device", "cpu", "--save-every", "0"]
TINY = ["--seq-len", "64", "--batch-tokens", "128", *RUN]


def _with_tokenizer(path):
    """`path` with the bundled 2048-token tokenizer (and its chat template) saved beside its weights."""
    from recipes.data.tokenizer_choice import ASSETS

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, path / f)
    return path


def _export_matches_transformers(out, family: str, docs: list[torch.Tensor]) -> dict:
    """OUT/model-hf: config.json of `family`, loaded by transformers with no missing or unexpected keys, with the
    logits of OUT/model in zoo. Returns its config.json."""
    from transformers import AutoModelForCausalLM

    hf_config = json.loads((out / "model-hf" / "config.json").read_text())
    assert hf_config["model_type"] == family
    hf, info = AutoModelForCausalLM.from_pretrained(out / "model-hf", dtype=torch.float32, output_loading_info=True,
                                                    attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(hf) is tiny.causal_lm_class(family)
    model = zoo.load(out / "model", attn="sdpa")
    assert model.family == family
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        ours = model(packed)
        for i, doc in enumerate(docs):
            assert (ours[cu[i]:cu[i + 1]] - hf(input_ids=doc[None]).logits[0]).abs().max() < 1e-5, (family, i)
    return hf_config


def test_lora_sft_on_a_tied_qwen2_checkpoint_exports_what_zoo_transformers_and_peft_load(tmp_path):
    """recipes.sft --lora-rank (auto targets) from a Hugging Face Qwen2 directory with a tied head: OUT/model differs
    from the base in the q/v weights alone (biases and the tied embedding kept), OUT/model-hf is a Qwen2 that
    transformers loads with OUT/model's logits, and PEFT's merge of OUT/adapter over the base directory equals it."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from recipes import sft

    tiny.save_causal_lm("qwen2", tmp_path / "base", seed=7, vocab_size=2048, tie=True)
    base = _with_tokenizer(tmp_path / "base")
    out = tmp_path / "sft"
    got = sft.main(["--model", str(base), "--lora-rank", "4", "--lora-alpha", "8", "--steps", "3", "--lr", "1e-2",
                    "--warmup", "1", "--export-hf", *TINY, "--out", str(out)])
    assert len(got) == 3, got
    assert_near_uniform(got, 2048)

    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["target_modules"], adapter["base_model_name_or_path"]) == (["q_proj", "v_proj"], str(base))
    before, after = zoo.load(base).state_dict(), zoo.load(out / "model").state_dict()
    assert set(before) == set(after) and "lm_head.weight" not in after  # still tied
    for name, t in before.items():
        assert torch.equal(t, after[name]) != name.endswith(("q_proj.weight", "v_proj.weight")), name

    hf_config = _export_matches_transformers(out, "qwen2", _docs(2048))
    assert hf_config["tie_word_embeddings"] is True and hf_config["use_sliding_window"] is False
    merged = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(merged, out / "adapter").merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(out / "model-hf", dtype=torch.float32).state_dict()
    assert set(merged) == set(exported)
    for name, t in exported.items():
        assert torch.equal(merged[name], t), name


def test_pretrain_from_a_mistral_checkpoint_keeps_its_window(tmp_path):
    """recipes.pretrain from a Hugging Face Mistral directory (window 8, packs of 64 tokens): every weight
    trains, OUT/model keeps the architecture (the window too) and OUT/model-hf loads in transformers with its
    logits on documents the window cuts."""
    from recipes import pretrain

    tiny.save_causal_lm("mistral", tmp_path / "base", seed=8, vocab_size=2048)
    base = _with_tokenizer(tmp_path / "base")
    out = tmp_path / "pt"
    got = pretrain.main(["--model", str(base), "--steps", "2", "--export-hf", *TINY, "--out", str(out)])
    assert len(got) == 2, got
    assert_near_uniform(got, 2048)
    before, after = zoo.load(base), zoo.load(out / "model")
    assert after.config == before.config and after.config.sliding_window == tiny.WINDOW
    for (name, a), b in zip(before.state_dict().items(), after.state_dict().values(), strict=True):
        assert not torch.equal(a, b), name
    hf_config = _export_matches_transformers(out, "mistral", _docs(2048, lengths=(40, 9, 30)))
    assert hf_config["sliding_window"] == tiny.WINDOW


def test_llava_recipe_lora_on_a_tied_qwen2_language_model(tmp_path):
    """recipes.llava stage 2 with --lora-rank (auto: Qwen2's q_proj and v_proj, not the tower's namesakes) from a
    llava-hf directory over a tied Qwen2: OUT/model differs from the base in the projector and the language model's
    q/v weights alone, and PEFT's merge of OUT/adapter over the base directory is OUT/model-hf bit for bit."""
    peft = pytest.importorskip("peft")
    from transformers import LlavaForConditionalGeneration

    from recipes import llava as llava_recipe

    # the placeholder, 2048, lies past the tokenizer's 2048 tokens and inside the model's vocabulary
    tiny.save_llava("qwen2", tmp_path / "base", tie=True, seed=9, vocab_size=2050, image_token=2048)
    base = _with_tokenizer(tmp_path / "base")
    out = tmp_path / "llava"
    got = llava_recipe.main(["--model", str(base), "--stage", "2", "--lora-rank", "4", "--steps", "2", "--seq-len",
                             "128", "--batch-tokens", "256", "--export-hf", *RUN, "--out", str(out)])
    assert len(got) == 2, got
    assert_near_uniform(got, 2050, tol=1.0)  # the random projector and tower put it 0.4 to 0.7 above

    before, after = zoo.load(base).state_dict(), zoo.load(out / "model").state_dict()
    assert set(before) == set(after) and "language_model.lm_head.weight" not in after
    for name, t in before.items():
        trained = name.startswith("projector.") or (
            name.startswith("language_model.") and name.endswith(("q_proj.weight", "v_proj.weight")))
        assert torch.equal(t, after[name]) != trained, name

    hf = peft.PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32),
                                        out / "adapter")
    adapted = {n for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert adapted == {f"base_model.model.model.language_model.layers.{i}.self_attn.{p}" for i in range(2)
                       for p in ("q_proj", "v_proj")}
    merged = hf.merge_and_unload().state_dict()
    exported, info = LlavaForConditionalGeneration.from_pretrained(out / "model-hf", dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    text = json.loads((out / "model-hf" / "config.json").read_text())["text_config"]
    assert (text["model_type"], text["tie_word_embeddings"]) == ("qwen2", True)
    exported = exported.state_dict()
    assert set(merged) == set(exported)
    for name, t in exported.items():
        assert torch.equal(merged[name], t), name


# ---- LLaVA over a Qwen2 or Mistral language model ----

LLAVAS = [("qwen2", True), ("mistral", False)]  # Qwen2-0.5B-sized models tie the head; BakLLaVA is a Mistral


@pytest.fixture(scope="module", params=LLAVAS, ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def llava(request, tmp_path_factory):
    """(transformers' LlavaForConditionalGeneration, zoo.load of its save_pretrained directory, the directory),
    and transformers' reference on the pack: each document's logits and loss alone, the padded batch's loss and
    parameter gradients (one mean over all targets, as the pack's)."""
    family, tie = request.param
    path = tmp_path_factory.mktemp(f"llava_{family}") / "hf"
    ref = tiny.save_llava(family, path, tie=tie, seed=11)
    model = zoo.load(path, attn="eager")
    docs, images = tiny.llava_docs(model.config.image_tokens)

    def labels(ids):
        return ids.masked_fill(ids == tiny.IMAGE_TOKEN, -100)

    alone = []
    with torch.no_grad():
        for ids, im in zip(docs, images, strict=True):
            pixels = None if im is None else (im if im.dim() == 4 else im[None])
            out = ref(input_ids=ids[None], pixel_values=pixels, labels=labels(ids)[None])
            alone.append((out.logits[0], out.loss))
    L = max(len(d) for d in docs)
    ids, mask = torch.full((len(docs), L), tiny.PAD), torch.zeros(len(docs), L, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)] = d, 1
    pixels = torch.cat([im if im.dim() == 4 else im[None] for im in images if im is not None])
    out = ref(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=labels(ids).masked_fill(mask == 0, -100))
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    return SimpleNamespace(family=family, tie=tie, ref=ref, model=model, path=path, docs=docs, images=images,
                           alone=alone, loss=out.loss.detach(), grads=grads)


def test_llava_config_and_tied_head(llava):
    cfg = llava.model.config
    assert (cfg.language_family, cfg.image_tokens, cfg.image_token_id) == (llava.family, 16, tiny.IMAGE_TOKEN)
    assert cfg.language.tie_embeddings is llava.tie and (llava.model.language_model.lm_head is None) is llava.tie
    if llava.family == "mistral":
        assert cfg.language.sliding_window == tiny.WINDOW
    assert sum(p.numel() for p in llava.model.parameters()) == sum(p.numel() for p in llava.ref.parameters())
    lm = cfg.language
    head_dim = 24 if llava.family == "mistral" else 16  # Mistral's explicit head_dim, Qwen2's width / heads
    assert (lm.dim, lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.vocab_size) == (64, 2, 4, 2, head_dim, 128)


@pytest.mark.parametrize("backend", BACKENDS)
def test_llava_packed_equals_transformers(llava, backend):
    """One packed forward of five documents (1, 1, 0, 0 and 2 images; equal-length neighbours; every one longer
    than Mistral's window): each document's logits and loss equal transformers' on it alone, the pack's loss the
    padded batch's, and (backends that train here) every parameter's gradient transformers'."""
    from zoo.models.llava import hf_spellings, plan_to_hf

    model = llava.model
    packed = zoo.pack(llava.docs, images=llava.images)
    cu = packed.cu_seqlens.tolist()
    trains = backend != "flex"
    model.set_attention(backend)
    try:
        assert model.attend is zoo.get_attention(backend)
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(trains):
            logits = model(packed)
            loss = model.loss(packed)
        if trains:
            loss.backward()
    finally:
        model.set_attention("eager")
    labels = model.labels(packed)
    for i, (want_logits, want_loss) in enumerate(llava.alone):
        a, b = cu[i], cu[i + 1]
        torch.testing.assert_close(logits[a:b].detach(), want_logits, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, i=i: f"{backend} doc {i}: {m}")
        doc_loss = F.cross_entropy(logits[a:b].detach(), labels[a:b], ignore_index=-100)
        torch.testing.assert_close(doc_loss, want_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss.detach(), llava.loss, atol=1e-5, rtol=0)
    if not trains:
        return
    hf_params = dict(llava.ref.named_parameters())
    compared = 0
    for hf_name, ((zoo_name,), _) in plan_to_hf(model.config, [n for n, _ in model.named_parameters()]).items():
        hf_name = next(c for c in hf_spellings(hf_name) if c in hf_params)
        ours, theirs = model.get_parameter(zoo_name).grad, llava.grads[hf_name]
        if theirs is None:  # the tower's last layer and post-norm: never used (feature layer -2)
            assert ours is None or not ours.any(), zoo_name
            continue
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=lambda m, n=zoo_name: f"{backend} {n}: {m}")
        compared += 1
    assert compared > 40
    model.zero_grad(set_to_none=True)


def test_llava_converts_to_zoo_and_back_bit_for_bit(llava, tmp_path):
    """convert.hf_to_zoo then convert.zoo_to_hf: every tensor of transformers' save comes back with its bits and
    dtype (under the llava-hf spelling of its name), none more (no untied head for a tied model); transformers loads
    the result with no missing or unexpected keys and the original's logits exactly; zoo.load of the HF directory
    and of the converted one hold the same tensors."""
    from transformers import LlavaForConditionalGeneration

    from convert import hf_to_zoo, zoo_to_hf
    from zoo.models.llava import hf_spellings

    assert hf_to_zoo.main([str(llava.path), str(tmp_path / "zoo"), "--quiet"]) is None
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "back"), "--quiet"]) is None
    original, back = load_file(llava.path / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert ("language_model.lm_head.weight" in back) is not llava.tie
    sources = {name: next(s for s in hf_spellings(name) if s in original) for name in back}
    assert sorted(sources.values()) == sorted(original)  # one to one
    for name, t in back.items():
        assert t.dtype == original[sources[name]].dtype and torch.equal(t, original[sources[name]]), name

    converted = zoo.load(tmp_path / "zoo").state_dict()
    assert all(torch.equal(converted[n], t) for n, t in llava.model.state_dict().items())
    again, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True,
                                                                attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    text = json.loads((tmp_path / "back" / "config.json").read_text())["text_config"]
    assert (text["model_type"], text["tie_word_embeddings"]) == (llava.family, llava.tie)
    ids, pixels = llava.docs[4], llava.images[4]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(input_ids=ids[None], pixel_values=pixels).logits,
                                   llava.ref(input_ids=ids[None], pixel_values=pixels).logits, atol=0, rtol=0)


def test_llava_head_tied_by_the_top_level_config(tmp_path):
    """transformers 5 ties a LLaVA's head when its config.json says tie_word_embeddings at the top, whatever the
    text config says (a tied checkpoint then holds no head): zoo reads the same model."""
    from transformers import LlavaForConditionalGeneration

    path = tmp_path / "hf"
    tiny.save_llava("qwen2", path, tie=True, seed=5)
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]["tie_word_embeddings"]
    assert config["tie_word_embeddings"] is True
    (path / "config.json").write_text(json.dumps(config))
    ref = LlavaForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    assert ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    model = zoo.load(path, attn="sdpa")
    assert model.config.language.tie_embeddings
    docs, images = tiny.llava_docs(model.config.image_tokens, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model(zoo.pack(docs[4:], images=images[4:])),
                                   ref(input_ids=docs[4][None], pixel_values=images[4]).logits[0], atol=1e-4,
                                   rtol=1e-4)


def _as_transformers_4_wrote_it(text) -> dict:
    """A text config as transformers 4 saved it inside a LLaVA's config.json: its difference from the default
    LlavaConfig's text config (a LlamaConfig), every value equal to both that Llama default and its own class's
    default left out (configuration_utils.recursive_diff_dict), RoPE's base as rope_theta."""
    from transformers import LlamaConfig

    def flat(d: dict) -> dict:
        d = {k: v for k, v in d.items() if k != "layer_types"}  # transformers 5's, not written by 4
        d["rope_theta"] = d.pop("rope_parameters")["rope_theta"]
        return d

    full, llama, own = flat(text.to_dict()), flat(LlamaConfig().to_dict()), flat(type(text)().to_dict())
    return {k: v for k, v in full.items() if not (k in llama and k in own and v == llama[k] == own[k])}


@pytest.mark.parametrize("family,sizes,left_out", [
    # BakLLaVA's language model, Mistral-7B: its width, depth and heads are Llama-7B's, so transformers 4 left them out
    ("mistral", dict(vocab_size=32064, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
                     sliding_window=4096), {"hidden_size", "num_hidden_layers", "num_attention_heads", "rope_theta"}),
    # a Qwen2 with the default RoPE base (transformers' 10,000, not Qwen's 1,000,000)
    ("qwen2", dict(vocab_size=152000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768, rope_theta=10000.0),
     {"rope_theta", "rms_norm_eps"}),
    ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=10000.0),
     {"rope_theta", "head_dim"}),
])
def test_llava_reads_a_text_config_transformers_4_wrote(family, sizes, left_out):
    """zoo reads a llava-hf config.json whose text config leaves out what transformers 4 left out as transformers 5
    reads it: the text model's own defaults fill the gaps."""
    from transformers import LlavaConfig as HFLlava

    from zoo.models.llava import config_from_hf

    text = _as_transformers_4_wrote_it(type(tiny.text_config(family))(**sizes))
    assert not left_out & set(text), text  # the gaps this case is about
    hub = {"model_type": "llava", "text_config": text, "image_token_index": 32000, "vision_feature_layer": -2}
    want = FAMILIES[family].config_from_hf(HFLlava(**hub).text_config.to_dict())
    have = config_from_hf(json.loads(json.dumps(hub))).language
    assert have == want, (have, want)
    assert (have.dim, have.n_layers, have.n_heads) == (sizes["hidden_size"], sizes["num_hidden_layers"],
                                                       sizes["num_attention_heads"])
    assert have.rope_theta == sizes.get("rope_theta", 10000.0)

