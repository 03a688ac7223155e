"""Gemma 2 against transformers' own Gemma2ForCausalLM, on tiny random checkpoints it saved with save_pretrained:

- config.json is read as transformers reads it (layer types, both soft-caps, its defaults);
- one packed forward (documents longer than the sliding window of 8, a 1-token one, equal-length neighbours) equals
  transformers on each document alone on every CPU backend; the loss and every gradient equal upstream's; both caps
  bind (0.5 on the attention scores, 1.5 on the logits): a model without either differs;
- hf -> zoo -> hf is bit-exact and transformers loads the export and generates with it what zoo generates;
- greedy generation equals transformers' generate past the window (eager, sdpa, the compiled static step);
- LoRA's `auto` is PEFT's default and PEFT loads the trained adapter with zoo's logits;
- sequence parallel over 2 processes (ring, Ulysses) equals one process: the `gemma2-*` cases of
  tests/_sp_worker.py (tests/test_parallel.py's spawn of 2 ranks).
"""

from __future__ import annotations

import json

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
    transformers_reference,
)

import zoo
from zoo.core.attention import available_backends
from zoo.generate import generate
from zoo.models import FAMILIES

WINDOW = 8
ATTN_CAP, FINAL_CAP = 0.5, 1.5
LENGTHS = [9, 1, 12, 12, 3, 3, 20]  # a 1-token document, equal-length neighbours, documents the window cuts
CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=256, sliding_window=WINDOW,
              query_pre_attn_scalar=20, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
              attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no id: neither generate stops early


def _save(path, seed: int = 0, **extra):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**{**CONFIG, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms (1 + w) off their init of w = 0; q/k large enough that the attention cap binds
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.3 * noise if "norm" in n or n.endswith(".bias") else (0.1 if "embed" in n else 0.3) * noise)
    model.eval().save_pretrained(path)
    return model


def _docs(lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in lens]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """transformers' tied Gemma2ForCausalLM and its directory, and an untied one with attention biases."""
    root = tmp_path_factory.mktemp("gemma2")
    return {"tied": (_save(root / "tied"), root / "tied"),
            "untied": (_save(root / "untied", seed=3, tie_word_embeddings=False, attention_bias=True),
                       root / "untied")}


def test_config_reads_what_transformers_reads(tiny):
    from transformers import Gemma2Config

    hf, path = tiny["tied"]
    cfg = zoo.load(path, device="meta").config
    assert cfg.layer_types == ("sliding_attention", "full_attention") == tuple(hf.config.layer_types)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim, cfg.rope_theta) == (WINDOW, 20, 24, 100.0)
    assert (cfg.attn_softcap, cfg.final_softcap) == (ATTN_CAP, FINAL_CAP)
    read = FAMILIES["gemma2"].config_from_hf
    default, ours = Gemma2Config(), read({"model_type": "gemma2"})
    assert list(ours.layer_types) == default.layer_types
    assert (ours.attn_softcap, ours.final_softcap, ours.rope_theta) == (
        default.attn_logit_softcapping, default.final_logit_softcapping, default.rope_parameters["rope_theta"])
    assert ours == FAMILIES["gemma2"].config_cls() == zoo.get_preset("gemma-2-2b").config
    none = read({"model_type": "gemma2", "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (none.attn_softcap, none.final_softcap) == (None, None)
    with pytest.raises(zoo.ZooError, match="use_bidirectional_attention=true"):
        read({"model_type": "gemma2", "use_bidirectional_attention": True})


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_packed_equals_transformers_per_document(tiny, which):
    hf, path = tiny[which]
    docs = _docs()
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    packed = zoo.pack(docs)
    model = zoo.load(path, attn="eager")
    assert [layer.attn.window for layer in model.layers] == [WINDOW, None]
    assert [layer.attn.softcap for layer in model.layers] == [ATTN_CAP] * 2 and model.final_softcap == FINAL_CAP
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, which)
    to_hf = hf_names(model)
    assert sorted(to_hf.values()) == sorted(ref_grads)
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, to_hf, TRAIN_BACKENDS, which)

    # the checks above can fail: without either cap, or without the window, the model differs
    model.set_attention("eager")
    s, e = packed.cu_seqlens[-2:].tolist()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.softcap = None
        assert (model(packed)[s:e] - ref_logits[-1]).abs().max() > 1e-2
        for layer in model.layers:
            layer.attn.softcap = ATTN_CAP
        model.final_softcap = None
        assert (model(packed)[s:e] - ref_logits[-1]).abs().max() > 1e-2
        model.final_softcap = FINAL_CAP
        model.layers[0].attn.window = None
        assert (model(packed)[s:e] - ref_logits[-1]).abs().max() > 1e-2
        model.layers[0].attn.window = WINDOW
    assert_packed_logits(model, packed, ref_logits, ["eager"], f"{which} again")


PROMPT_LENS = [7, 1, 12]  # batched in one call; with 12 new tokens every sequence runs past the window of 8
MAX_NEW = 12


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_round_trip_is_bit_exact_and_transformers_generates_with_the_export(tiny, tmp_path, which):
    from transformers import Gemma2ForCausalLM

    hf, src = tiny[which]
    b, back = convert_round_trip(src, tmp_path, "gemma2", Gemma2ForCausalLM, original=hf, keys=(
        "layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "attn_logit_softcapping",
        "final_logit_softcapping", "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id",
        "pad_token_id"))
    assert ("lm_head.weight" in b) == (which == "untied")
    model = zoo.load(tmp_path / "zoo", attn="sdpa")
    prompts = _docs(PROMPT_LENS, seed=5)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(back, prompt, MAX_NEW), len(prompt)


def test_greedy_equals_transformers(tiny, monkeypatch):
    """zoo's KV cache (both caps in the decode step) against transformers' generate, eager and sdpa backends and the
    compiled static step (traced whole, run by aot_eager: no C++ build)."""
    import importlib

    hf, path = tiny["tied"]
    prompts = _docs(PROMPT_LENS, seed=6)
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    for backend in ("eager", "sdpa"):
        model = zoo.load(path, attn=backend)
        got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])
        assert [t.tolist() for t in got] == want, backend
    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[], compile=True)
    assert [t.tolist() for t in got] == want, "compiled"


def test_lora_auto_is_peft_s_default_and_peft_loads_the_trained_adapter(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
    from transformers import Gemma2ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny["tied"]
    assert FAMILIES["gemma2"].lora_targets == tuple(PEFT_DEFAULTS["gemma2"])
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    assert apply_lora(model, lora, seed=1) == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    docs = _docs()
    packed = zoo.pack(docs)
    losses = adamw_steps(model, packed)
    assert losses[-1] < losses[0], losses
    _, out = export_lora(model, lora, path, tmp_path)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    hf = Gemma2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    assert_adapter_logits(model, peft.PeftModel.from_pretrained(hf, out).eval(), ref, packed, docs)
