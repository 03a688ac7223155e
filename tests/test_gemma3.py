"""Gemma 3 (text) against transformers' own Gemma3ForCausalLM and Gemma3ForConditionalGeneration, on tiny random
checkpoints those classes saved with save_pretrained:

- config.json is read as transformers reads it: layer types from `layer_types` or `sliding_window_pattern`, both RoPE
  bases and the global layers' linear scaling in transformers 4's keys or 5's rope_parameters, a hub-style
  multimodal config whose text config lists only its difference from the defaults; soft-capping, bidirectional
  attention and other activations are refused in one line;
- one packed forward (documents longer than the sliding window of 8, a 1-token one, equal-length neighbours) equals
  transformers on each document alone on every CPU backend; the loss and every gradient equal upstream's; a model
  ignoring its window, or swapping its two rotary bases, would not;
- hf -> zoo -> hf is bit-exact and transformers loads and generates with the result; a
  Gemma3ForConditionalGeneration is read whole in both spellings (the model: tests/test_gemma3_vision.py);
- greedy generation equals transformers' generate past the window; LoRA's `auto` is PEFT's default and PEFT loads the
  trained adapter; sequence parallel over 2 and 4 processes equals one process.

The tiny model: width 64, 2 layers (sliding_window_pattern 2: one local layer, then one global), 4 query heads over 2
KV heads of 24 (not 64 / 4), softmax scale 20 ** -0.5 (not 24 ** -0.5), local base 100, global base 10,000 with
linear scaling 4; every norm weight (an offset from 1, initialised to 0 upstream) moved off its init.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import _sp_worker
import pytest
import torch
from helpers import (
    adamw_steps,
    assert_adapter_logits,
    assert_packed_logits,
    assert_packed_loss_and_grads,
    convert_round_trip,
    export_lora,
    hf_greedy,
    hf_names,
    pretrain_exports_what_transformers_loads,
    transformers_reference,
)
from safetensors.torch import load_file, save_file

import zoo
from zoo.core.attention import available_backends
from zoo.generate import generate
from zoo.models import FAMILIES

WINDOW = 8
LENGTHS = [9, 1, 12, 12, 3, 3, 20]  # a 1-token document, equal-length neighbours, documents the window cuts
CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=256, sliding_window=WINDOW,
            sliding_window_pattern=2, query_pre_attn_scalar=20, rope_parameters=ROPE,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no id: neither generate stops early


def _randomize(model, seed: int):
    """Every parameter random: norms (1 + w) with w around 0, not at its init of 0; biases around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.3 * noise if "norm" in n or n.endswith(".bias") else (0.1 if "embed" in n else 0.2) * noise)
    return model.eval()


def _save_causal_lm(path: Path, seed: int = 0, **extra):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**TEXT, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _randomize(Gemma3ForCausalLM(config), seed + 1)
    model.save_pretrained(path)
    return model


def _docs(lens=LENGTHS, seed: int = 2, vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """transformers' tied Gemma3ForCausalLM and its directory, and an untied one with attention biases."""
    root = tmp_path_factory.mktemp("gemma3")
    return {"tied": (_save_causal_lm(root / "tied"), root / "tied"),
            "untied": (_save_causal_lm(root / "untied", seed=3, tie_word_embeddings=False, attention_bias=True),
                       root / "untied")}


# ---- config.json as transformers reads it ----


def test_config_reads_what_transformers_reads(tiny):
    from transformers import Gemma3TextConfig

    hf, path = tiny["tied"]
    cfg = zoo.load(path, device="meta").config
    assert cfg.layer_types == ("sliding_attention", "full_attention") == tuple(hf.config.layer_types)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim) == (WINDOW, 20, 24)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e4, 100.0, {"rope_type": "linear",
                                                                                    "factor": 4.0})
    assert cfg.tie_embeddings and (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (None, (), None)
    read = FAMILIES["gemma3"].config_from_hf
    # transformers 4's keys, layer types from the pattern (7 layers, pattern 3: global at 3 and 6), ids left out
    old = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=7,
               num_attention_heads=4, num_key_value_heads=2, sliding_window_pattern=3, rope_theta=5e5,
               rope_local_base_freq=2e3, rope_scaling={"type": "linear", "factor": 8.0})
    theirs, ours = Gemma3TextConfig(**old), read(old)
    assert list(ours.layer_types) == theirs.layer_types and ours.layer_types.count("full_attention") == 2
    assert (ours.rope_theta, ours.rope_local_theta) == (theirs.rope_parameters["full_attention"]["rope_theta"],
                                                        theirs.rope_parameters["sliding_attention"]["rope_theta"])
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert theirs.rope_parameters["full_attention"]["factor"] == 8.0
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (2, (1,), 0)  # transformers' defaults
    # nothing at all: transformers' defaults, layer types from its pattern of 6
    default = Gemma3TextConfig()
    ours = read({"model_type": "gemma3_text"})
    assert list(ours.layer_types) == default.layer_types
    assert (ours.dim, ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.head_dim, ours.ffn_dim, ours.vocab_size,
            ours.sliding_window, ours.query_pre_attn_scalar, ours.max_seq_len, ours.tie_embeddings) == (
        default.hidden_size, default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
        default.head_dim, default.intermediate_size, default.vocab_size, default.sliding_window,
        default.query_pre_attn_scalar, default.max_position_embeddings, default.tie_word_embeddings)
    assert ours == FAMILIES["gemma3"].config_cls() and ours.rope_scaling is None


def test_a_hub_multimodal_config_reads_as_transformers_reads_it():
    """google/gemma-3-27b-it's config.json (transformers 4.50): the text config holds only what differs from
    Gemma3TextConfig's defaults; the eos ids sit at the top. Its language model is the gemma-3-27b-it-text preset,
    the whole of it (tower and projector too) the gemma-3-27b-it one."""
    from transformers import Gemma3Config as HFGemma3Config

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
           "mm_tokens_per_image": 256,
           "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                           "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                           "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    ours = FAMILIES["gemma3"].config_from_hf(json.loads(json.dumps(hub)))
    text = HFGemma3Config(**hub).text_config
    assert ours == zoo.get_preset("gemma-3-27b-it-text").config
    assert FAMILIES["gemma3_vision"].config_from_hf(json.loads(json.dumps(hub))) == \
        zoo.get_preset("gemma-3-27b-it").config
    assert list(ours.layer_types) == text.layer_types and ours.layer_types.count("full_attention") == 10
    assert (ours.vocab_size, ours.max_seq_len, ours.rope_theta, ours.rope_local_theta) == (
        text.vocab_size, text.max_position_embeddings, text.rope_parameters["full_attention"]["rope_theta"],
        text.rope_parameters["sliding_attention"]["rope_theta"])
    assert ours.eos_token_ids == (1, 106) and (ours.bos_token_id, ours.pad_token_id) == (2, 0)


@pytest.mark.parametrize("key,value,words", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("hidden_activation", "gelu", "hidden_activation='gelu'"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}, "sliding layers"),
])
def test_unsupported_options_are_refused_in_one_line(key, value, words):
    hf = {"model_type": "gemma3_text", "num_hidden_layers": 2, key: value}
    with pytest.raises(zoo.ZooError) as e:
        FAMILIES["gemma3"].config_from_hf(hf)
    assert words in str(e.value) and "expected" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(zoo.ZooError, match=words.split("=")[0]):  # inside a multimodal config's text config too
        FAMILIES["gemma3"].config_from_hf({"model_type": "gemma3", "text_config": {key: value}})


# ---- parity: one packed forward equals transformers per document; loss and gradients ----


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_packed_equals_transformers_per_document(tiny, which):
    hf, path = tiny[which]
    docs = _docs()
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    packed = zoo.pack(docs)
    model = zoo.load(path, attn="eager")
    assert [layer.attn.window for layer in model.layers] == [WINDOW, None]
    assert model.rope_keys == ["local", "global"] and (model.lm_head is None) == (which == "tied")
    assert all(p.abs().min() > 0 for n, p in model.named_parameters() if "norm" in n)  # off the (1 + w) init
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, which)

    to_hf = hf_names(model)
    assert sorted(to_hf.values()) == sorted(ref_grads)  # every upstream parameter, the tied head once
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, to_hf, TRAIN_BACKENDS, which)

    # the checks above can fail: without its window, or with its two rotaries swapped, the model differs
    model.set_attention("eager")
    s, e = packed.cu_seqlens[-2:].tolist()
    with torch.no_grad():
        model.layers[0].attn.window = None
        assert (model(packed)[s:e] - ref_logits[-1]).abs().max() > 1e-2
        model.layers[0].attn.window = WINDOW
        model.rope_keys = ["global", "local"]
        assert (model(packed)[s:e] - ref_logits[-1]).abs().max() > 1e-2
        model.rope_keys = ["local", "global"]
    assert_packed_logits(model, packed, ref_logits, ["eager"], f"{which} again")


# ---- converters, the export in transformers, a Gemma3ForConditionalGeneration checkpoint ----

PROMPT_LENS = [7, 1, 12]  # batched in one call; with 14 new tokens every sequence runs past the window of 8
MAX_NEW = 14


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_round_trip_is_bit_exact_and_transformers_generates_with_the_export(tiny, tmp_path, which):
    from transformers import Gemma3ForCausalLM


    hf, src = tiny[which]
    b, back = convert_round_trip(src, tmp_path, "gemma3_text", Gemma3ForCausalLM, original=hf, keys=(
        "layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "head_dim",
        "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id"))
    assert ("lm_head.weight" in b) == (which == "untied")
    ids = _docs([23], seed=4)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)
    # transformers generates with the export what zoo generates with the zoo checkpoint, past the window
    model = zoo.load(tmp_path / "zoo", attn="sdpa")
    prompts = _docs(PROMPT_LENS, seed=5)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(back, prompt, MAX_NEW), len(prompt)


def test_greedy_equals_transformers(tiny, monkeypatch):
    """zoo's KV cache against transformers' generate, on the eager and sdpa backends and in the compiled step (its
    static cache masks the local layer's rows outside the window; traced whole, run by aot_eager: no C++ build)."""
    import importlib

    from torch._dynamo.utils import counters

    hf, path = tiny["tied"]
    assert hf.generation_config.eos_token_id is None  # neither side can stop early
    prompts = _docs(PROMPT_LENS, seed=6)
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    for backend in ("eager", "sdpa"):
        model = zoo.load(path, attn=backend)
        got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])
        assert [t.tolist() for t in got] == want, backend
        assert model.attend is zoo.get_attention(backend)
    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[], compile=True)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not left to eager
    assert [t.tolist() for t in got] == want, "compiled"


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """transformers' Gemma3ForConditionalGeneration (a SigLIP tower of 2 layers, the tiny text model), saved by
    save_pretrained (`language_model.model.*`, `vision_tower.*`) and, as its modules name the tensors in
    transformers 5 (`model.language_model.*`, `model.vision_tower.*`), by safetensors from its state dict."""
    from transformers import Gemma3Config as HFGemma3Config
    from transformers import Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    root = tmp_path_factory.mktemp("gemma3_mm")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                image_size=16, patch_size=4)
    config = HFGemma3Config(text_config=Gemma3TextConfig(**TEXT), vision_config=vision, mm_tokens_per_image=4,
                            image_token_index=127, boi_token_index=125, eoi_token_index=126)
    config._attn_implementation = "eager"
    torch.manual_seed(7)
    hf = _randomize(Gemma3ForConditionalGeneration(config), 8)
    hf.save_pretrained(root / "saved")
    (root / "modules").mkdir()
    (root / "modules" / "config.json").write_text((root / "saved" / "config.json").read_text())
    state = {n: t.contiguous() for n, t in hf.state_dict().items() if n != "lm_head.weight"}  # tied: the embedding
    save_file(state, root / "modules" / "model.safetensors")
    return SimpleNamespace(hf=hf, root=root, saved=load_file(root / "saved" / "model.safetensors"))


@pytest.mark.parametrize("layout", ["saved", "modules"])
def test_a_multimodal_checkpoint_loads_whole(multimodal, layout, caplog):
    """zoo.load reads a Gemma3ForConditionalGeneration in either spelling as the whole model (gemma3_vision, tested
    in tests/test_gemma3_vision.py), saying in one line that SigLIP's pooling head, which Gemma 3 never reads, is
    left out; its text logits are transformers'."""
    path = multimodal.root / layout
    with caplog.at_level(logging.WARNING, logger="zoo.io.load"):
        model = zoo.load(path, attn="sdpa")
    said = [r.getMessage() for r in caplog.records if r.name == "zoo.io.load"]
    assert len(said) == 1 and "pooling head" in said[0], said
    assert model.family == "gemma3_vision"
    assert model.config.language.layer_types == ("sliding_attention", "full_attention")
    docs = _docs([20, 5], seed=9, vocab=120)
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        ours = model(packed)
        for i, d in enumerate(docs):
            torch.testing.assert_close(ours[cu[i]:cu[i + 1]], multimodal.hf(input_ids=d[None]).logits[0], atol=1e-4,
                                       rtol=1e-4)


def test_a_text_checkpoint_says_nothing_of_a_tower(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo.io.load"):
        zoo.load(tiny["tied"][1])
    assert not [r for r in caplog.records if r.name == "zoo.io.load"]


# ---- LoRA with PEFT's names ----


def test_lora_auto_is_peft_s_default_and_peft_loads_the_trained_adapter(tiny, tmp_path):
    """LoRA `auto` wraps exactly what PEFT adapts by default for gemma3_text; after three AdamW steps the adapter
    export_adapter writes loads in PEFT over transformers' model with zoo's LoRA logits, and PEFT's merge_and_unload
    gives zoo's merged weights bit for bit."""
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
    from transformers import Gemma3ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora, lora_modules, merged_state

    ref, path = tiny["tied"]
    assert FAMILIES["gemma3"].lora_targets == tuple(PEFT_DEFAULTS["gemma3_text"])
    model = zoo.load(path, attn="eager")
    base = {n: t.clone() for n, t in model.state_dict().items()}
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    wrapped = apply_lora(model, lora, seed=1)
    assert wrapped == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    docs = _docs()
    packed = zoo.pack(docs)
    losses = adamw_steps(model, packed)
    assert losses[-1] < losses[0], losses
    assert all(m.lora_B.weight.abs().min() > 0 for m in lora_modules(model).values())

    plain, out = export_lora(model, lora, path, tmp_path)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["target_modules"], config["r"], config["lora_alpha"]) == (["q_proj", "v_proj"], 4, 8)
    hf = Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, out).eval()
    adapted = {n for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{p}" for i in range(2)
                       for p in ("q_proj", "v_proj")}
    assert_adapter_logits(model, hf, ref, packed, docs)

    merged = hf.merge_and_unload().state_dict()
    state = merged_state(model.state_dict(), lora.scale)
    plan = FAMILIES["gemma3"].plan_to_hf(plain.config, list(state))
    ours = {hf_name: state[srcs[0]] for hf_name, (srcs, _) in plan.items()}
    assert set(merged) == set(ours) | {"lm_head.weight"}  # transformers lists the tied head too
    changed = 0
    for name, t in ours.items():
        assert torch.equal(merged[name], t), name
        changed += not torch.equal(t, base[plan[name][0][0]])
    assert changed == 4  # the q and v weights of both layers, nothing else


# ---- sequence parallel: 2 and 4 processes equal one (one spawn of 4 ranks) ----



def _sp_model():
    """The tiny model's shape with 8 query heads over 2 KV heads (Ulysses splits them over 2 or 4 ranks), a window
    of 4 (shorter than the pack's documents of 23 and 30, which cross the shards), every norm off its init."""
    from zoo.models.decoder import Decoder
    from zoo.models.gemma3 import Gemma3Config

    cfg = Gemma3Config(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                       rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_theta=100.0,
                       sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                       query_pre_attn_scalar=20, max_seq_len=256)
    model = _sp_worker._build(Decoder, cfg)
    g = torch.Generator().manual_seed(100)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def test_sequence_parallel_equals_one_process(tmp_path):
    _sp_worker.check_model(tmp_path, _sp_model)


# ---- presets ----


def test_pretrain_from_a_gemma3_checkpoint_exports_what_transformers_loads(tmp_path):
    """recipes.pretrain from a Hugging Face Gemma 3 directory (a window shorter than the packs' documents): every
    weight trains, OUT/model keeps the architecture, and OUT/model-hf loads in transformers with OUT/model's
    logits."""
    from transformers import Gemma3ForCausalLM

    _save_causal_lm(tmp_path / "base", seed=8, vocab_size=2048)
    pretrain_exports_what_transformers_loads(tmp_path / "base", tmp_path / "pt", Gemma3ForCausalLM,
                                             _docs([40, 9, 30], vocab=2048), atol=1e-5)


@pytest.mark.parametrize("name,head_dim,scalar,n_global,scaled", [
    ("gemma-3-270m", 256, 256, 3, False), ("gemma-3-1b-it", 256, 256, 4, False),
    ("gemma-3-4b-it-text", 256, 256, 5, True), ("gemma-3-27b-text", 128, 168, 10, True)])
def test_presets_build_on_meta(name, head_dim, scalar, n_global, scaled):
    """Counts are tests/test_presets.py's; here the shape: tied, the heads, the scale, one global layer in six."""
    model = zoo.load(name, device="meta")
    cfg, attn = model.config, model.layers[0].attn
    assert model.lm_head is None and attn.head_dim == head_dim and attn.scale == scalar ** -0.5
    assert [layer.attn.window is None for layer in model.layers].count(True) == n_global
    assert all(model.layers[i].attn.window is None for i in range(5, cfg.n_layers, 6))
    assert (cfg.rope_scaling is not None) == scaled and model.embed.scale == cfg.dim ** 0.5
