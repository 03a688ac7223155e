"""GLM-4 against transformers' own Glm4ForCausalLM, on tiny random checkpoints it saved (save_pretrained):

- config.json reads as transformers reads it (partial rotary from rope_parameters or the hub's top-level key, 0.5
  where neither says; the eos list and pad transformers fills in); what zoo cannot run is refused in one line;
- one packed forward equals transformers on each document alone on every CPU backend, with the interleaved rotary over
  half of each head (and over all of it), biases on q/k/v and the sandwich norms moved off their init; loss and every
  gradient equal;
- hf -> zoo -> hf is bit-exact (the fused gate_up_proj split and joined); greedy generation equals transformers'
  generate, with decode's fused projections and without;
- LoRA (`auto`: q and v; and the fused gate_up_proj) and PEFT loads the exported adapter with zoo's logits;
- sequence parallel over 2 and 4 processes equals one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.core.attention import available_backends
from zoo.models import FAMILIES

sys.path.insert(0, str(Path(__file__).parent))
import _sp_worker
from helpers import (
    adamw_steps,
    assert_adapter_logits,
    assert_fused_parity,
    assert_refused_in_one_line,
    convert_round_trip,
    export_lora,
    hf_greedy,
    random_docs,
    save_randomized,
    tiny_checkpoints,
)

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
VARIANTS: dict[str, dict] = {
    "glm4": dict(),  # transformers' defaults: half rotary, q/k/v biases, untied head
    "glm4-full-tied": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
                           attention_bias=False, tie_word_embeddings=True),
}
LENGTHS = [9, 1, 12, 10, 3, 17]


def save_glm4(path: Path, seed: int, **options):
    """transformers' Glm4ForCausalLM, width 64, 4 heads of 16 over 2 KV heads, 2 layers, eos ids [5, 7], norm weights
    and biases moved off their init, saved to `path`; returned in eval mode."""
    from transformers import Glm4Config, Glm4ForCausalLM

    torch.manual_seed(seed)
    config = Glm4Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                        rms_norm_eps=1e-6, max_position_embeddings=64, bos_token_id=None, eos_token_id=[5, 7],
                        pad_token_id=None, **options)
    return save_randomized(Glm4ForCausalLM(config), path, seed + 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("glm4"), save_glm4, VARIANTS)


# ---- config ----


def test_config_reads_as_transformers_reads_it(tiny):
    cfg = zoo.load(tiny["glm4"][1], device="meta").config
    assert (cfg.head_dim, cfg.rotary_dim, cfg.attention_bias, cfg.tie_embeddings) == (16, 8, True, False)
    assert cfg.eos_token_ids == (5, 7) and cfg.pad_token_id is None
    full = zoo.load(tiny["glm4-full-tied"][1], device="meta").config
    assert (full.rotary_dim, full.rope_theta, full.attention_bias, full.tie_embeddings) == (16, 500.0, False, True)
    # the hub's spelling (THUDM/GLM-4-9B-0414): top-level partial_rotary_factor and rope_theta, no rope_parameters;
    # without the ids transformers' Glm4Config fills in GLM-4's, without the factor it takes 0.5
    from transformers import Glm4Config

    hub = {"model_type": "glm4", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 96, "vocab_size": 151552, "partial_rotary_factor": 0.25, "rope_theta": 2000.0}
    for change in ({}, {"partial_rotary_factor": None}):
        config = {k: v for k, v in {**hub, **change}.items() if v is not None}
        read, theirs = FAMILIES["glm4"].config_from_hf(config), Glm4Config.from_dict(config)
        assert read.rotary_dim == int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"])
        assert read.rope_theta == theirs.rope_parameters["rope_theta"] == 2000.0
        assert (read.head_dim, read.n_kv_heads, read.norm_eps) == (128, theirs.num_key_value_heads,
                                                                   theirs.rms_norm_eps)
        assert list(read.eos_token_ids) == theirs.eos_token_id and read.pad_token_id == theirs.pad_token_id
        assert FAMILIES["glm4"].config_from_hf(FAMILIES["glm4"].config_to_hf(read)) == read
    # head_dim 128 (transformers' default): a quarter of it, then half
    assert [FAMILIES["glm4"].config_from_hf(hub).rotary_dim, read.rotary_dim] == [32, 64]


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "GLM-4 with a 'yarn' RoPE scaling is not supported"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number in (0, 1]"),
    ({"partial_rotary_factor": 0.2}, "the rotary must turn an even number of dims up to head_dim (16); "
                                     "partial_rotary_factor gives 3"),
    ({"partial_rotary_factor": 0.05}, "partial_rotary_factor 0.05 turns 0 of head_dim (16); the rotary needs at"),
    ({"hidden_act": "gelu"}, "GLM-4 with hidden_act='gelu' is not supported"),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    hf = {"model_type": "glm4", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
          "intermediate_size": 96, "vocab_size": 151552, **change}
    assert_refused_in_one_line(FAMILIES["glm4"].config_from_hf, hf, words)


# ---- parity: one packed forward equals transformers per document; loss and gradients ----


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_equals_transformers_per_document(tiny, name):
    hf, path = tiny[name]
    # gradients: zoo's gate and up against their rows of transformers' fused gate_up_proj
    assert_fused_parity(hf, path, random_docs(LENGTHS), "glm4", CPU_BACKENDS, TRAIN_BACKENDS, name)


def test_the_layout_and_the_sandwich_matter(tiny):
    """The parity above could fail: the half-split layout, or the post-attention norm left out, moves the logits."""
    hf, path = tiny["glm4"]
    model = zoo.load(path, attn="eager")
    doc = random_docs([12], seed=3)[0]
    with torch.no_grad():
        ref = hf(doc[None]).logits[0]
        assert (model(zoo.pack([doc])) - ref).abs().max() < 1e-4
        for layer in model.layers:
            layer.attn.rope_layout = "half"
        assert (model(zoo.pack([doc])) - ref).abs().max() > 1e-3
        for layer in model.layers:
            layer.attn.rope_layout = "interleaved"
            layer.attn_post_norm.weight.fill_(1.0)
        assert (model(zoo.pack([doc])) - ref).abs().max() > 1e-3
    layers = model.config.decoder_spec().layers
    assert all(s.placement == "sandwich" and s.mixer.rope_layout == "interleaved" for s in layers)


# ---- converters and generation ----

MAX_NEW = 6


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_bit_exact_and_greedy_equals_transformers(tiny, tmp_path, name):
    """hf -> zoo -> hf: every tensor with its bits (gate_up_proj split, then joined), the config as transformers reads
    it; greedy tokens are transformers', decoding with fused projections (the rotary's layout in generation's own
    attention) and without."""
    from transformers import Glm4ForCausalLM

    from zoo.generate import generate

    hf, src = tiny[name]
    b, _ = convert_round_trip(src, tmp_path, "glm4", Glm4ForCausalLM, original=hf, keys=(
        "rope_parameters", "attention_bias", "tie_word_embeddings", "head_dim", "eos_token_id", "pad_token_id",
        "rms_norm_eps", "max_position_embeddings"))
    assert "model.layers.0.mlp.gate_up_proj.weight" in b

    model = zoo.load(src, attn="sdpa")
    prompts = random_docs([3, 12, 1], seed=6)
    for fuse in (False, True):
        for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[], fuse=fuse)):
            assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW, eos_token_id=None), (name, fuse, len(prompt))


# ---- LoRA with PEFT's names ----


@pytest.mark.parametrize("targets,modules", [
    (("auto",), ["q_proj", "v_proj"]),
    (("gate_up_proj",), ["gate_up_proj"]),
])
def test_lora_and_peft_loads_the_adapter(tiny, tmp_path, targets, modules):
    peft = pytest.importorskip("peft")
    from transformers import Glm4ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny["glm4"]
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=targets)
    wrapped = apply_lora(model, lora, seed=1)
    parts = ["attn.q_proj", "attn.v_proj"] if targets == ("auto",) else ["mlp.gate_proj", "mlp.up_proj"]
    assert wrapped == [f"layers.{i}.{p}" for i in range(2) for p in parts]
    docs = random_docs([20, 13, 7])
    packed = zoo.pack(docs)
    adamw_steps(model, packed)
    _, out = export_lora(model, lora, path, tmp_path)
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == modules
    hf = peft.PeftModel.from_pretrained(Glm4ForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    assert_adapter_logits(model, hf, ref, packed, docs, targets)


# ---- sequence parallel: 2 and 4 processes equal one ----


def _sp_model():
    """12 query heads over 2 KV heads, head_dim 16, the interleaved rotary over half of each head, q/k/v biases,
    sandwich norms."""
    from zoo.models.decoder import Decoder
    from zoo.models.glm4 import Glm4Config

    cfg = Glm4Config(dim=64, n_layers=2, n_heads=12, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                     max_seq_len=64, norm_eps=1e-6)
    return _sp_worker._build(Decoder, cfg)


def test_sequence_parallel_equals_one_process(tmp_path):
    _sp_worker.check_model(tmp_path, _sp_model)


# ---- presets ----


def test_presets_build_glm4_blocks_on_meta():
    """Parameter counts are tests/test_presets.py's; here the shapes the published configs give."""
    nine = zoo.load("glm-4-9b-0414", device="meta")
    attn = nine.layers[0].attn
    assert nine.config.rotary_dim == 64 and attn.rope_layout == "interleaved" and attn.q_proj.bias is not None
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.o_proj.bias) == (4096, 256, None)
    assert nine.layers[0].mlp.gate_proj.out_features == 13696 and nine.layers[0].mlp_post_norm is not None
    assert nine.config.eos_token_ids == (151329, 151336, 151338) and nine.config.max_seq_len == 32768
    big = zoo.load("glm-4-32b-0414", device="meta").config
    assert (big.dim, big.n_layers, big.n_heads, big.n_kv_heads, big.ffn_dim) == (6144, 61, 48, 2, 23040)
    assert not big.attention_bias and FAMILIES["glm4"].config_from_hf(FAMILIES["glm4"].config_to_hf(big)) == big
