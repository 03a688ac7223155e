"""GLM-4.5 (glm4_moe) against transformers' own Glm4MoeForCausalLM, on a tiny random checkpoint it saved
(save_pretrained: one tensor per expert, as the hub has them) with every feature active: a dense first layer, the
rotary over half of each head (rotate-half), q/k/v biases, q/k norms, the sigmoid router with a non-zero correction
bias, groups limiting the choice (4 groups of 2 experts, the best 2 kept), routed scaling 2.5, two shared experts:

- config.json reads as transformers reads it (its defaults, the hub's top-level spellings, nulls); what zoo cannot
  run is refused in one line; the multi-token-prediction layers of a checkpoint are left out on load, in one line;
- one packed forward equals transformers on each document alone on every CPU backend; the loss and every gradient
  equal upstream's; the bias, the groups and the scale each change the logits (the parity could fail);
- hf -> zoo -> hf is bit-exact, transformers loads the export with the original's logits; greedy generation equals
  transformers' generate;
- LoRA `auto` (q, v) trains and PEFT loads the exported adapter with zoo's logits;
- aux-loss-free balancing (--router-bias-update-rate) moves the checkpoint's own correction bias, and the export
  holds it where transformers reads it;
- the presets' shapes and parameter counts (355B / 32B and 106B / 12B published).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    adamw_steps,
    assert_adapter_logits,
    assert_packed_logits,
    assert_packed_loss_and_grads,
    assert_refused_in_one_line,
    convert_round_trip,
    export_lora,
    hf_greedy,
    random_docs,
    save_randomized,
    transformers_reference,
)

import zoo
from zoo.core.attention import available_backends
from zoo.core.moe import MoE
from zoo.models import FAMILIES

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
LENGTHS = [9, 1, 12, 10, 3, 17]
MAX_NEW = 6


def hf_config(vocab_size: int = 128, **extra):
    from transformers import Glm4MoeConfig

    options = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   first_k_dense_replace=1, n_shared_experts=2, use_qk_norm=True, attention_bias=True,
                   partial_rotary_factor=0.5, initializer_range=0.1, rms_norm_eps=1e-6,
                   max_position_embeddings=256, eos_token_id=[5, 7], bos_token_id=None, pad_token_id=None)
    return Glm4MoeConfig(**{**options, **extra})


def save_glm4_moe(path: Path, seed: int, **extra):
    """transformers' Glm4MoeForCausalLM: norms and biases off their init, routers wide enough that no two experts
    tie, the correction bias random in [0, 0.3) (the scores' own spread: it changes choices), saved to `path`."""
    from transformers import Glm4MoeForCausalLM

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(hf_config(**extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.3)
    return save_randomized(model, path, seed + 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4_moe") / "tiny"
    return save_glm4_moe(path, seed=0), path


def _in_memory_name(zoo_name: str) -> str:
    """transformers' name of a zoo tensor in memory (experts stacked as in zoo, the router `mlp.gate`)."""
    from zoo.models.family import rename
    from zoo.models.glm4_moe import HF_NAMES

    return rename(zoo_name.replace(".mlp.router.", ".mlp.gate."), HF_NAMES)


# ---- config ----

PUBLISHED_AIR = {  # zai-org/GLM-4.5-Air's config.json, as published (hub spelling: top-level rope keys)
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": False, "vocab_size": 151552}


def test_config_reads_as_transformers_reads_it(tiny):
    from transformers import Glm4MoeConfig

    hf, path = tiny
    model = zoo.load(path, device="meta")
    cfg = model.config
    assert (cfg.rotary_dim, cfg.n_group, cfg.topk_group, cfg.routed_scaling, cfg.first_dense) == (8, 4, 2, 2.5, 1)
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [False, True]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    family = FAMILIES["glm4_moe"]
    air = family.config_from_hf(PUBLISHED_AIR)
    assert air == zoo.get_preset("glm-4.5-air").config and air.mtp_layers == 1
    theirs = Glm4MoeConfig.from_dict(PUBLISHED_AIR)
    assert (air.rope_theta, air.rotary_dim) == (theirs.rope_parameters["rope_theta"],
                                                int(128 * theirs.rope_parameters["partial_rotary_factor"]))
    # transformers' defaults where config.json says nothing, or null
    bare = {k: PUBLISHED_AIR[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "intermediate_size", "vocab_size", "head_dim")}
    read, theirs = family.config_from_hf({**bare, "n_group": None}), Glm4MoeConfig.from_dict(bare)
    assert (read.n_kv_heads, read.norm_eps, read.n_experts, read.top_k, read.expert_ffn_dim, read.n_shared_experts,
            read.routed_scaling, read.n_group, read.topk_group, read.first_dense, read.norm_topk_prob, read.qk_norm,
            read.attention_bias, read.rotary_dim) == (
        theirs.num_key_value_heads, theirs.rms_norm_eps, theirs.n_routed_experts, theirs.num_experts_per_tok,
        theirs.moe_intermediate_size, theirs.n_shared_experts, theirs.routed_scaling_factor, theirs.n_group,
        theirs.topk_group, theirs.first_k_dense_replace, theirs.norm_topk_prob, theirs.use_qk_norm,
        theirs.attention_bias, int(read.head_dim * theirs.rope_parameters["partial_rotary_factor"]))
    for config in (air, cfg, read):
        assert family.config_from_hf(family.config_to_hf(config)) == config


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "GLM-4.5 with a 'yarn' RoPE scaling is not supported"),
    ({"n_group": 3}, "n_group must divide the 128 experts into groups of at least 2, got 3"),
    ({"n_group": 8, "topk_group": 9}, "topk_group must be in 1..n_group (8), got 9"),
    ({"first_k_dense_replace": 47}, "first_k_dense_replace must be in 0..46 (the layers), got 47"),
    ({"n_routed_experts": 0}, "num_experts must be an integer in 1..100000, got 0"),
    ({"hidden_act": "gelu"}, "GLM-4.5 with hidden_act='gelu' is not supported"),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    assert_refused_in_one_line(FAMILIES["glm4_moe"].config_from_hf, {**PUBLISHED_AIR, **change}, words)


def test_multi_token_prediction_layers_are_left_out_in_one_line(tiny, tmp_path, caplog):
    """A checkpoint with num_nextn_predict_layers 1 holds that layer as model.layers.2.* (past the last): zoo
    loads the model without it, saying so once; a stray layer beyond them is still unexpected."""
    from safetensors.torch import load_file, save_file

    _, path = tiny
    src = tmp_path / "mtp"
    shutil.copytree(path, src)
    tensors = load_file(src / "model.safetensors")
    extra = {k.replace("layers.1.", "layers.2.", 1): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.1.")}
    save_file({**tensors, **extra, "model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, src / "model.safetensors")
    with caplog.at_level("WARNING"):
        model = zoo.load(src, attn="eager")
    assert [r.message for r in caplog.records if "multi-token-prediction" in r.message] == [
        "glm4_moe: the checkpoint's multi-token-prediction layers (num_nextn_predict_layers, stored past the last "
        "layer) are left out"]
    assert len(model.layers) == 2 and model.config.mtp_layers == 1
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(zoo.ZooError, match=r"unexpected tensors: .*model\.layers\.2\."):
        zoo.load(src)


# ---- parity ----


def test_packed_equals_transformers_per_document(tiny):
    hf, path = tiny
    docs = random_docs(LENGTHS)
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    model = zoo.load(path, attn="eager")
    packed = zoo.pack(docs)
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, "glm4_moe")
    names = {z: _in_memory_name(z) for z, _ in model.named_parameters()}
    assert sorted(names.values()) == sorted(ref_grads)
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, names, TRAIN_BACKENDS, "glm4_moe")


def test_the_router_options_matter(tiny):
    """The parity above could fail: without the correction bias, without the groups, or unscaled, the logits move."""
    hf, path = tiny
    model = zoo.load(path, attn="eager")
    doc = random_docs([16], seed=3)[0]
    moe = model.layers[1].mlp
    assert moe.router_bias.dtype == torch.float32 and moe.router_bias.abs().sum() > 0
    with torch.no_grad():
        ref = hf(doc[None]).logits[0]
        assert (model(zoo.pack([doc])) - ref).abs().max() < 1e-4
        for attr, value in (("router_bias", torch.zeros(8)), ("n_group", 1), ("routed_scaling", 1.0)):
            kept = getattr(moe, attr)
            setattr(moe, attr, value)
            assert (model(zoo.pack([doc])) - ref).abs().max() > 1e-3, attr
            setattr(moe, attr, kept)


# ---- converters and generation ----


def test_round_trip_is_bit_exact_and_greedy_equals_transformers(tiny, tmp_path):
    from transformers import Glm4MoeForCausalLM

    from zoo.generate import generate

    hf, src = tiny
    b, again = convert_round_trip(src, tmp_path, "glm4_moe", Glm4MoeForCausalLM, original=hf, keys=(
        "rope_parameters", "attention_bias", "use_qk_norm", "n_group", "topk_group", "routed_scaling_factor",
        "first_k_dense_replace", "n_shared_experts", "n_routed_experts", "head_dim", "eos_token_id"))
    assert torch.equal(b["model.layers.1.mlp.gate.e_score_correction_bias"],
                       hf.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = random_docs([23])[0]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)

    model = zoo.load(src, attn="sdpa")
    prompts = random_docs([7, 1, 12], seed=5)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW, eos_token_id=None), len(prompt)


# ---- LoRA with PEFT's names ----


def test_lora_auto_and_peft_loads_the_adapter(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Glm4MoeForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    assert apply_lora(model, lora, seed=1) == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    docs = random_docs([20, 13, 7])
    packed = zoo.pack(docs)
    adamw_steps(model, packed)
    _, out = export_lora(model, lora, path, tmp_path)
    hf = peft.PeftModel.from_pretrained(Glm4MoeForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    assert_adapter_logits(model, hf.eval(), ref, packed, docs)


# ---- aux-loss-free balancing moves the checkpoint's own correction bias ----


def test_router_bias_update_moves_the_correction_bias_and_exports_it(tmp_path):
    """--router-bias-update-rate on glm4_moe: the checkpoint's e_score_correction_bias is the bias the recipe moves
    (each layer's by a multiple of the rate), and --export-hf (not refused: transformers' class holds it) writes
    it where Glm4MoeForCausalLM reads it, with OUT/model's logits."""
    from recipes import pretrain
    from recipes.data.tokenizer_choice import ASSETS

    base = tmp_path / "base"
    save_glm4_moe(base, seed=4, vocab_size=2048)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, base / f)
    pretrain.main(["--model", str(base), "--steps", "2", "--export-hf", "--seq-len", "64", "--batch-tokens", "128",
                   "--no-progress", "--device", "cpu", "--save-every", "0", "--out", str(tmp_path / "out"),
                   "--router-bias-update-rate", "0.01", "--aux-loss-coef", "0"])
    before, after = zoo.load(base), zoo.load(tmp_path / "out" / "model")
    moved = after.layers[1].mlp.router_bias - before.layers[1].mlp.router_bias
    steps = moved / 0.01
    assert moved.abs().sum() > 0 and torch.allclose(steps, steps.round(), atol=1e-3) and steps.round().abs().max() <= 2
    from transformers import Glm4MoeForCausalLM

    hf = Glm4MoeForCausalLM.from_pretrained(tmp_path / "out" / "model-hf", attn_implementation="eager").eval()
    torch.testing.assert_close(hf.model.layers[1].mlp.gate.e_score_correction_bias, after.layers[1].mlp.router_bias)
    doc = random_docs([15], vocab=2048)[0]
    with torch.no_grad():
        torch.testing.assert_close(after.eval()(zoo.pack([doc])), hf(doc[None]).logits[0], atol=1e-4, rtol=0)


# ---- presets ----


@pytest.mark.parametrize("name,total,active,dense", [
    ("glm-4.5", 355e9, 32e9, 3),
    ("glm-4.5-air", 106e9, 12e9, 1),
])
def test_presets_have_the_published_counts(name, total, active, dense):
    """The published figures are rounded and leave things out: zoo's total (without the multi-token-prediction
    layer the checkpoints hold beside the model) is within 1% of the published total, and its per-token count less
    the embedding and head rounds to the published active count; the first layers dense."""
    preset = zoo.get_preset(name)
    model = zoo.load(name, device="meta")
    embed_and_head = model.embed.weight.numel() + model.lm_head.weight.numel()
    assert abs(preset.params / total - 1) < 0.01
    assert round((preset.active_params - embed_and_head) / 1e9) == active / 1e9
    assert [isinstance(layer.mlp, MoE) for layer in model.layers[:dense + 1]] == [False] * dense + [True]
