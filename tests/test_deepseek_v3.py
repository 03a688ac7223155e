"""DeepSeek-V3 (multi-head latent attention, the sigmoid group-limited router) against transformers' own
DeepseekV3ForCausalLM, on tiny random checkpoints it saved (save_pretrained), every feature on: a query latent (and,
in a second variant, a plain q_proj), rope and no-rope widths that differ, a value width of its own, YaRN with the
mscale correction of the softmax scale, the interleaved rotary (and rotate-half), latent norms whose eps is not
rms_norm_eps; a dense first layer, then MoE layers whose correction bias is non-zero, whose groups limit the choice
(2 of 4 groups), routed_scaling_factor != 1 and two ungated shared experts:

- config.json reads as transformers reads it; kimi_k2 reads as this family; what zoo cannot run is refused in one line;
- one packed forward equals transformers on each document alone on every CPU backend; loss and every gradient equal;
- hf -> zoo -> hf is bit-exact, transformers loads the export, and a checkpoint's multi-token-prediction layer is left
  out on load; greedy generation (eager and compiled, the latent cache) equals transformers' generate, and the cache
  holds latents, not keys and values;
- LoRA on the MLA projections and PEFT loads the exported adapter with zoo's logits;
- sequence parallel (ring, Ulysses, hybrid) over 2 and 4 processes equals one process.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.core.attention import available_backends
from zoo.core.mla import MLA
from zoo.models import FAMILIES, HF_MODEL_TYPES

sys.path.insert(0, str(Path(__file__).parent))
import _sp_worker
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
    tiny_checkpoints,
    transformers_reference,
)

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
VARIANTS: dict[str, dict] = {
    # a query latent, YaRN (mscale_all_dim != mscale: the attention factor on cos/sin is not 1), interleaved rotary
    "mla": dict(rope_scaling=YARN),
    # a plain q_proj, rotate-half, no scaling, biases on q_a/kv_a/o
    "mla-plain-q": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True),
}
LENGTHS = [9, 1, 12, 10, 3, 17]


def save_deepseek_v3(path: Path, seed: int, **options):
    """transformers' DeepseekV3ForCausalLM, width 64, 4 heads (no-rope 12, rope 8, value 10 dims), q latent 24, kv
    latent 16, a dense layer then 2 MoE layers (8 experts of 32 in 4 groups, 2 groups kept, 3 per token, scaling 1.7,
    2 shared experts, correction bias N(0, 0.3), router weights N(0, 0.5) so that no two experts tie),
    rms_norm_eps 1e-5 (the latent norms keep 1e-6), eos ids [5, 7], norm weights and biases moved off their init,
    saved to `path`; returned in eval mode."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{
        **dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
               qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, n_routed_experts=8,
               num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=1.7, n_shared_experts=2,
               initializer_range=0.1, rms_norm_eps=1e-5, max_position_embeddings=64, rope_theta=1000.0,
               bos_token_id=None, eos_token_id=[5, 7], pad_token_id=None),
        **options})
    model = DeepseekV3ForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5, generator=g)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    return save_randomized(model, path, seed + 1)


def in_memory_name(zoo_name: str) -> str:
    """The name transformers 5 gives a zoo tensor in memory: its experts stacked as zoo's (mlp.experts.gate_up_proj
    [E, 2F, D], down_proj [E, D, F]), the router mlp.gate, the shared experts mlp.shared_experts."""
    from zoo.models.deepseek_v3 import HF_NAMES_V3
    from zoo.models.family import rename

    return rename(zoo_name.replace(".mlp.router.", ".mlp.gate."), HF_NAMES_V3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("deepseek_v3"), save_deepseek_v3, VARIANTS)


# ---- config ----


def test_config_reads_as_transformers_reads_it(tiny):
    cfg = zoo.load(tiny["mla"][1], device="meta").config
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (24, 16, 12, 8, 10)
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.rope_interleave and cfg.eos_token_ids == (5, 7)
    hf = tiny["mla"][0]
    assert cfg.softmax_scale() == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12) != 20 ** -0.5
    attn = zoo.load(tiny["mla"][1], device="meta").layers[0].attn
    assert isinstance(attn, MLA) and attn.q_proj is None and attn.rope_layout == "interleaved"
    plain = zoo.load(tiny["mla-plain-q"][1], device="meta")
    assert plain.layers[0].attn.q_a_proj is None and plain.layers[0].attn.rope_layout == "half"
    assert plain.layers[0].attn.o_proj.bias is not None
    assert HF_MODEL_TYPES["kimi_k2"] is HF_MODEL_TYPES["deepseek_v3"] is FAMILIES["deepseek_v3"]
    read = FAMILIES["deepseek_v3"]
    assert read.config_from_hf(read.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, ["unsupported rope scaling 'longrope'",
                                                                   "default, yarn"]),
    ({"scoring_func": "softmax"}, "expected 'noaux_tc' and 'sigmoid'"),
    ({"hidden_act": "gelu"}, "DeepSeek-V3 with hidden_act='gelu' is not supported"),
    ({"n_group": 3}, "n_group must divide the 8 experts into groups of at least 2, got 3"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) must be at most the experts of the topk_group kept groups"),
    ({"n_routed_experts": 2**40}, "n_routed_experts must be an integer in 1..100000, got 1099511627776"),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    hf = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
          **change}
    assert_refused_in_one_line(FAMILIES["deepseek_v3"].config_from_hf, hf, words)


# ---- parity: one packed forward equals transformers per document; loss and gradients ----


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_equals_transformers_per_document(tiny, name):
    """Logits per backend; loss and every gradient (the experts' against transformers' stacked ones, the router's
    too) on the backends that train; the router bias is the checkpoint's."""
    hf, path = tiny[name]
    docs = random_docs(LENGTHS)
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    model = zoo.load(path, attn="eager")
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["GatedMLP", "MoE", "MoE"]
    assert torch.equal(model.layers[1].mlp.router_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    packed = zoo.pack(docs)
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, name)
    names = {n: in_memory_name(n) for n, _ in model.named_parameters()}
    assert set(names.values()) == set(ref_grads)
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, names, TRAIN_BACKENDS, name)


def test_the_rotary_layout_and_the_yarn_scale_matter(tiny):
    """The parity above could fail: the other rotary layout, or the softmax scale without YaRN's mscale, moves the
    logits."""
    hf, path = tiny["mla"]
    model = zoo.load(path, attn="eager")
    doc = random_docs([16], seed=3)[0]
    with torch.no_grad():
        ref = hf(doc[None]).logits[0]
        assert (model(zoo.pack([doc])) - ref).abs().max() < 1e-4
        for layer in model.layers:
            layer.attn.rope_layout = "half"
        assert (model(zoo.pack([doc])) - ref).abs().max() > 1e-3
        for layer in model.layers:
            layer.attn.rope_layout, layer.attn.scale = "interleaved", 20 ** -0.5
        assert (model(zoo.pack([doc])) - ref).abs().max() > 1e-3


# ---- converters and generation ----

MAX_NEW = 6


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_bit_exact_and_greedy_equals_transformers(tiny, tmp_path, monkeypatch, name):
    """hf -> zoo -> hf: every tensor with its bits, the config as transformers reads it; greedy tokens are
    transformers', decoding eagerly and compiled (aot_eager on CPU) from the latent cache."""
    from transformers import DeepseekV3ForCausalLM

    from zoo.generate import generate

    hf, src = tiny[name]
    convert_round_trip(src, tmp_path, "deepseek_v3", DeepseekV3ForCausalLM, original=hf, keys=(
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_parameters",
        "rope_interleave", "attention_bias", "first_k_dense_replace", "eos_token_id", "rms_norm_eps",
        "n_routed_experts", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts"))
    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    model = zoo.load(src, attn="sdpa")
    prompts = random_docs([3, 12, 1], seed=6)
    expected = [hf_greedy(hf, p, MAX_NEW, eos_token_id=None) for p in prompts]
    for compiled in (False, True) if name == "mla" else (False,):  # one compiled variant: it costs seconds
        got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[], compile=compiled, fuse=True)
        assert [t.tolist() for t in got] == expected, (name, compiled)


def test_the_cache_holds_latents_not_keys_and_values(tiny):
    """Generation keeps per token the kv latent and the rope key of each layer (generation_bytes says so), no K/V
    rows; the decode step reads them (a latent cache emptied after the prefill changes the next token's logits)."""
    from zoo.generate import _cache_installed, _prefill
    from zoo.generate.cache import KVCache, decode_pack

    _, path = tiny["mla"]
    model = zoo.load(path, attn="sdpa")
    prompts = random_docs([5, 9], seed=4)
    attn = model.layers[0].attn
    assert attn.generation_bytes(2, 20, 4) == 2 * 20 * (16 + 8) * 4  # latent 16 + rope key 8, fp32
    cache = KVCache(2, 20)
    with torch.no_grad(), _cache_installed(model, cache):
        _prefill(model, prompts, None, torch.device("cpu"))
        assert not cache.k and not cache.v
        assert {k: tuple(v.shape) for k, v in cache.states.items()} == {
            (i, name): (2, 20, w) for i in range(3) for name, w in (("latent", 16), ("rope_key", 8))}
        cache.lengths = torch.tensor([5, 9])
        cache.begin_step(torch.device("cpu"))
        step = decode_pack(torch.tensor([3, 4]), cache.positions)
        before = model(step)
        for buf in cache.states.values():
            buf.zero_()
        cache.begin_step(torch.device("cpu"))
        assert (model(decode_pack(torch.tensor([3, 4]), cache.positions)) - before).abs().max() > 1e-3


def test_multi_token_prediction_layers_are_left_out(tiny, tmp_path, caplog):
    """A checkpoint with its MTP layer (model.layers.{num_hidden_layers}.*, as DeepSeek-V3's hub weights hold layer
    61) loads, saying so in one line, with the same logits."""
    import shutil

    _, src = tiny["mla"]
    shutil.copytree(src, tmp_path / "mtp")
    tensors = load_file(src / "model.safetensors")
    tensors.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
                    "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(88, 16)})
    save_file(tensors, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    doc = zoo.pack(random_docs([7]))
    with caplog.at_level("WARNING"):
        with_mtp = zoo.load(tmp_path / "mtp")
    assert any("multi-token-prediction layers" in r.message for r in caplog.records)
    with torch.no_grad():
        assert torch.equal(with_mtp(doc), zoo.load(src)(doc))


# ---- LoRA with PEFT's names ----


@pytest.mark.parametrize("name,targets,parts", [
    ("mla", ("auto",), ["kv_a_proj_with_mqa", "kv_b_proj"]),
    ("mla", ("q_a_proj", "q_b_proj", "o_proj"), ["q_a_proj", "q_b_proj", "o_proj"]),
    ("mla-plain-q", ("q_proj",), ["q_proj"]),
])
def test_lora_and_peft_loads_the_adapter(tiny, tmp_path, name, targets, parts):
    peft = pytest.importorskip("peft")
    from transformers import DeepseekV3ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny[name]
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=targets)
    wrapped = apply_lora(model, lora, seed=1)
    assert sorted(wrapped) == sorted(f"layers.{i}.attn.{p}" for i in range(3) for p in parts)
    docs = random_docs([20, 13, 7])
    packed = zoo.pack(docs)
    adamw_steps(model, packed)
    _, out = export_lora(model, lora, path, tmp_path)
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == sorted(parts)
    hf = peft.PeftModel.from_pretrained(DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    assert_adapter_logits(model, hf, ref, packed, docs, targets)
    if "kv_b_proj" in parts:  # decoding reads a LoRA kv_b_proj through the module: greedy = full forwards
        from zoo.generate import generate

        prompt = docs[2]
        seq = prompt
        with torch.no_grad():
            for _ in range(4):
                seq = torch.cat([seq, model(zoo.pack([seq]))[-1].argmax()[None]])
        assert generate(model, [prompt], max_new_tokens=4, stop=[])[0].tolist() == seq[len(prompt):].tolist()


# ---- sequence parallel: 2 and 4 processes equal one ----


def _sp_model():
    """4 heads (no-rope 12, rope 8, value 10), q latent 24, kv latent 16, YaRN, the interleaved rotary; a dense layer
    then a MoE layer (8 experts in 4 groups, 2 kept, 3 per token, 2 shared)."""
    from zoo.models.decoder import Decoder
    from zoo.models.deepseek_v3 import DeepseekV3Config

    cfg = DeepseekV3Config(dim=64, n_layers=2, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
                           qk_rope_head_dim=8, v_head_dim=10, ffn_dim=96, vocab_size=128, max_seq_len=64,
                           rope_scaling=YARN, first_k_dense_replace=1, n_experts=8, top_k=3, expert_ffn_dim=32,
                           n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=1.7)
    model = _sp_worker._build(Decoder, cfg)
    # the router bias is a buffer, which to_empty leaves as it finds the memory and init_weights does not touch: the
    # same non-zero values on every rank
    model.layers[1].mlp.router_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3)) * 0.3)
    return model


def test_sequence_parallel_equals_one_process(tmp_path):
    _sp_worker.check_model(tmp_path, _sp_model)
