"""Phi-3 against transformers' own Phi3ForCausalLM, on tiny random checkpoints it saved (save_pretrained):

- config.json reads as transformers reads it (LongRoPE from rope_parameters, the hub's "su" spelling, partial rotary);
  what zoo cannot run is refused in one line;
- one packed forward equals transformers on each document alone on every CPU backend, with LongRoPE documents on
  both sides of original_max_position_embeddings in one pack, and a sliding window; loss and every gradient equal;
- hf -> zoo -> hf is bit-exact (the fused qkv_proj and gate_up_proj split and joined); greedy generation equals
  transformers' generate;
- LoRA `auto` adapts the fused qkv_proj and PEFT loads the exported adapter with zoo's logits;
- sequence parallel over 2 and 4 processes equals one process, LongRoPE's long factors included.
"""

from __future__ import annotations

import json
from pathlib import Path

import _sp_worker
import pytest
import torch
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

import zoo
from zoo.core.attention import available_backends
from zoo.models import FAMILIES

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
ORIGINAL = 10  # original_max_position_embeddings of the LongRoPE checkpoint: documents of 12 and 17 take long_factor
VARIANTS: dict[str, dict] = {
    "phi3-window": dict(sliding_window=5),
    "phi3-longrope": dict(
        max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 4.0, 9.0, 17.0]}),
}
LENGTHS = [9, 1, 12, 10, 3, 17]  # around ORIGINAL: 9 and 10 short, 12 and 17 long


def save_phi3(path: Path, seed: int, **options):
    """transformers' Phi3ForCausalLM, width 64, 4 heads over 2 KV heads, 2 layers, norm weights moved off their
    init, saved to `path`; returned in eval mode."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    options = {"max_position_embeddings": 64, "original_max_position_embeddings": 64, **options}
    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, rms_norm_eps=1e-6,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None, **options)
    return save_randomized(Phi3ForCausalLM(config), path, seed + 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("phi3"), save_phi3, VARIANTS)


# ---- config ----


def test_config_reads_as_transformers_reads_it(tiny):
    cfg = zoo.load(tiny["phi3-longrope"][1], device="meta").config
    assert (cfg.head_dim, cfg.rotary_dim, cfg.original_max_seq_len, cfg.max_seq_len) == (16, 8, ORIGINAL, 64)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["long_factor"] == [1.5, 4.0, 9.0, 17.0]
    hf = tiny["phi3-longrope"][0]
    assert cfg.attention_factor() == hf.model.rotary_emb.attention_scaling != 1.0
    # the hub's spelling (microsoft/Phi-3-mini-128k-instruct): rope_scaling {"type": "su"}, top-level original
    hub = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 64,
           "original_max_position_embeddings": ORIGINAL, "sliding_window": 2047,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    read = FAMILIES["phi3"].config_from_hf(hub)
    assert read.rope_scaling["rope_type"] == "longrope" and read.sliding_window == 2047 and read.rotary_dim == 16
    assert FAMILIES["phi3"].config_from_hf(FAMILIES["phi3"].config_to_hf(read)) == read


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' RoPE scaling is not supported"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0] * 8}}, "short_factor must be 8"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number in (0, 1]"),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    hf = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 96, "vocab_size": 128, **change}
    assert_refused_in_one_line(FAMILIES["phi3"].config_from_hf, hf, words)


# ---- parity: one packed forward equals transformers per document; loss and gradients ----


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_equals_transformers_per_document(tiny, name):
    hf, path = tiny[name]
    # gradients: zoo's q/k/v and gate/up against their rows of transformers' fused qkv_proj and gate_up_proj
    assert_fused_parity(hf, path, random_docs(LENGTHS), "phi3", CPU_BACKENDS, TRAIN_BACKENDS, name)


def test_longrope_decides_per_document(tiny):
    """A pack with short and long documents: each document's logits are its own alone in transformers, which they
    would not be if the pack's total length (48 > 10) picked long_factor for all; the short ones differ from what
    long factors give (the check can fail)."""
    hf, path = tiny["phi3-longrope"]
    model = zoo.load(path, attn="eager")
    short = random_docs([9], seed=4)[0]
    with torch.no_grad():
        alone = hf(short[None]).logits[0]
        as_long = hf(torch.cat([short, short[:3]])[None]).logits[0, :9]  # 12 tokens: upstream takes long_factor
        packed = zoo.pack([short, *random_docs([30], seed=5)])
        ours = model(packed)[:9]
    torch.testing.assert_close(ours, alone, atol=1e-4, rtol=1e-4)
    assert (as_long - alone).abs().max() > 1e-3


# ---- converters and generation ----

MAX_NEW = 6


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_bit_exact_and_greedy_equals_transformers(tiny, tmp_path, name):
    """hf -> zoo -> hf: every tensor with its bits (qkv_proj and gate_up_proj split, then joined), the config as
    transformers reads it; greedy tokens are transformers'. The prompts stay on one side of original_max_position_
    embeddings (3 + 6 tokens short, 12 long): crossing it, transformers recomputes its whole cache with the long
    factors, which zoo's cache does not."""
    from transformers import Phi3ForCausalLM

    from zoo.generate import generate

    hf, src = tiny[name]
    b, _ = convert_round_trip(src, tmp_path, "phi3", Phi3ForCausalLM, original=hf, keys=(
        "rope_parameters", "sliding_window", "original_max_position_embeddings", "max_position_embeddings"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in b

    model = zoo.load(src, attn="sdpa")
    prompts = random_docs([3, 12, 1], seed=6)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW), (name, len(prompt))


# ---- LoRA with PEFT's names ----


def test_lora_auto_adapts_the_fused_qkv_and_peft_loads_the_adapter(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Phi3ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny["phi3-longrope"]
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    wrapped = apply_lora(model, lora, seed=1)
    assert wrapped == [f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkv"]
    docs = random_docs([20, 13, 7])
    packed = zoo.pack(docs)
    adamw_steps(model, packed)
    _, out = export_lora(model, lora, path, tmp_path)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["qkv_proj"]
    hf = peft.PeftModel.from_pretrained(Phi3ForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    assert_adapter_logits(model, hf, ref, packed, docs)


# ---- sequence parallel: 2 and 4 processes equal one ----


def _sp_model():
    """12 query heads over 2 KV heads, head_dim 16, a half rotary with LongRoPE whose original length (8) is below
    the longest documents of the SP cases (23, 30), so long and short factors meet in one pack across shards."""
    from zoo.models.decoder import Decoder
    from zoo.models.phi3 import Phi3Config

    scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.9, 3.1], "long_factor": [2.0, 3.5, 8.0, 12.0]}
    cfg = Phi3Config(dim=64, n_layers=2, n_heads=12, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                     rotary_dim=8, rope_scaling=scaling, max_seq_len=64, original_max_seq_len=8, norm_eps=1e-6)
    return _sp_worker._build(Decoder, cfg)


def test_sequence_parallel_equals_one_process(tmp_path):
    _sp_worker.check_model(tmp_path, _sp_model)


# ---- presets ----


def test_presets_build_phi3_blocks_on_meta():
    """Parameter counts are tests/test_presets.py's; here the shapes the published configs give."""
    mini = zoo.load("phi-3-mini-4k-instruct", device="meta")
    assert mini.config.sliding_window == 2047 and mini.config.rotary_dim == 96 and mini.config.rope_scaling is None
    assert mini.layers[0].attn.q_proj.out_features == mini.layers[0].attn.k_proj.out_features == 3072
    phi4 = zoo.load("phi-4", device="meta").config
    assert (phi4.dim, phi4.n_layers, phi4.n_heads, phi4.n_kv_heads, phi4.vocab_size) == (5120, 40, 40, 10, 100352)
    assert phi4.sliding_window is None and FAMILIES["phi3"].config_from_hf(FAMILIES["phi3"].config_to_hf(phi4)) == phi4
