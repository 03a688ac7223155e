"""OLMo 2 against transformers' own Olmo2ForCausalLM, on tiny random checkpoints it saved (save_pretrained):

- config.json reads as transformers reads it: its defaults where a key is missing, rope_theta or rope_parameters,
  an explicit head_dim; a published config gives the preset; what zoo cannot run is refused in one line;
- one packed forward equals transformers on each document alone on every CPU backend; the loss and every gradient
  equal upstream's; in bf16 the logits equal transformers' bit for bit (the norms' fp32 product, fp32 RoPE);
- hf -> zoo -> hf is bit-exact, and transformers loads the export and generates zoo's tokens; greedy generation
  equals transformers' generate token for token;
- LoRA `auto` adapts q_proj / v_proj, and PEFT loads the exported adapter with zoo's logits and merged weights;
- sequence parallel over 2 and 4 processes equals one process; recipes.pretrain trains one and exports it;
- the presets build with OLMo 2's block (post-norms, full-width q/k norms).
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
    assert_packed_logits,
    assert_packed_loss_and_grads,
    assert_refused_in_one_line,
    convert_round_trip,
    export_lora,
    hf_greedy,
    hf_names,
    pretrain_exports_what_transformers_loads,
    random_docs,
    save_randomized,
    tiny_checkpoints,
    transformers_reference,
)

import zoo
from zoo.core.attention import available_backends
from zoo.models import FAMILIES

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
# GQA 4/2 in both; the second has q/k/v/o biases, a tied head, an explicit head_dim (24, not 64 / 4) and the
# default RoPE base, which transformers' attention and rotary both honour
VARIANTS: dict[str, dict] = {
    "olmo2": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "olmo2-bias-tied": dict(attention_bias=True, tie_word_embeddings=True, head_dim=24),
}
LENGTHS = [9, 1, 12, 12, 3, 17]  # a 1-token document, equal-length neighbours (sdpa batches them)


def save_olmo2(path: Path, seed: int, vocab_size: int = 128, **options):
    """transformers' Olmo2ForCausalLM, width 64, 2 layers, every norm weight and bias moved off its init, saved to
    `path`; returned in eval mode. No eos/pad ids: transformers' defaults (50279, 1) lie outside a tiny vocabulary."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(seed)
    config = Olmo2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, rms_norm_eps=1e-6, eos_token_id=None, pad_token_id=None, **options)
    return save_randomized(Olmo2ForCausalLM(config), path, seed + 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (transformers model, its save_pretrained directory)."""
    return tiny_checkpoints(tmp_path_factory.mktemp("olmo2"), save_olmo2, VARIANTS)


def _docs(vocab: int, lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    return random_docs(lens, vocab, seed)


# ---- config ----

# allenai/OLMo-2-1124-13B's config.json as published (rope_theta at the top, rope_scaling null)
PUBLISHED_13B = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 13824,
    "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 40, "num_hidden_layers": 40,
    "num_key_value_heads": 40, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
    "vocab_size": 100352}


def test_config_reads_as_transformers_reads_it(tiny):
    """The tiny checkpoints' shapes; a config.json that leaves keys out gets transformers' Olmo2Config defaults
    (zoo's own defaults are those too); the published 13B config, and transformers' re-spelling of it
    (rope_parameters), are the preset, with the checkpoint's eos and pad ids."""
    from transformers import Olmo2Config as HFOlmo2Config

    from zoo.models.olmo2 import Olmo2Config, config_from_hf

    for name, (hf, path) in tiny.items():
        model = zoo.load(path, device="meta")
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
        cfg = model.config
        head_dim = 24 if name == "olmo2-bias-tied" else 16
        assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.norm_eps) == (
            64, 2, 4, 2, head_dim, 96, 1e-6)
        assert (cfg.attention_bias, cfg.tie_embeddings) == ((True, True) if name != "olmo2" else (False, False))
        assert cfg.rope_theta == (10000.0 if name != "olmo2" else 500000.0) and cfg.rope_scaling is None

    minimal = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, intermediate_size=512, vocab_size=1000)
    upstream = config_from_hf(HFOlmo2Config(**minimal).to_dict())
    assert config_from_hf({"model_type": "olmo2", **minimal}) == upstream
    assert (upstream.n_kv_heads, upstream.norm_eps, upstream.rope_theta, upstream.max_seq_len) == (8, 1e-5, 1e4, 2048)
    assert Olmo2Config() == config_from_hf(HFOlmo2Config().to_dict())

    published = config_from_hf(PUBLISHED_13B)
    assert published == zoo.get_preset("olmo-2-13b").config
    assert (published.eos_token_ids, published.pad_token_id, published.bos_token_id) == ((100257,), 100277, None)
    assert config_from_hf(HFOlmo2Config(**PUBLISHED_13B).to_dict()) == published  # rope_parameters spelling


@pytest.mark.parametrize("change,words", [
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "expected 'silu'"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["'yarn'", "supported: default, llama3, linear"]),
    ({"num_attention_heads": 40, "num_key_value_heads": 3}, ["multiple of n_kv_heads (3)"]),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    from zoo.models.olmo2 import config_from_hf

    assert_refused_in_one_line(config_from_hf, {**PUBLISHED_13B, **change}, words)


# ---- parity: one packed forward equals transformers per document; loss and gradients; bf16 ----


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_equals_transformers_per_document(tiny, name):
    hf, path = tiny[name]
    docs = _docs(128)
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)

    model = zoo.load(path, attn="eager")
    assert model.family == "olmo2" and (model.lm_head is None) == hf.config.tie_word_embeddings
    packed = zoo.pack(docs)
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, name)

    to_hf = hf_names(model)
    assert sorted(to_hf.values()) == sorted(ref_grads)  # every upstream parameter (q/k norms, post-norms), once
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, to_hf, TRAIN_BACKENDS, name)


def test_bf16_logits_equal_transformers_bit_for_bit(tiny):
    """In bf16 (eager on both sides) every logit is transformers': each norm multiplies its weight in fp32 before
    the cast, and q and k are rotated in fp32. Either in the activations' dtype instead (Llama's order) moves
    logits by a bf16 step, which this equality sees."""
    from transformers import Olmo2ForCausalLM

    path = tiny["olmo2"][1]
    hf = Olmo2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    model = zoo.load(path, attn="eager", dtype=torch.bfloat16)
    docs = _docs(128)
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        logits = model(packed)
        for i, d in enumerate(docs):
            assert torch.equal(logits[cu[i]:cu[i + 1]], hf(d[None]).logits[0]), f"doc {i}"


# ---- converters, export, generation ----

PROMPT_LENS = [7, 1, 12]  # batched in one call
ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                     "rope_parameters", "attention_bias", "tie_word_embeddings")
MAX_NEW = 12


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_bit_exact_and_transformers_generates_with_the_export(tiny, tmp_path, name):
    """convert.hf_to_zoo then convert.zoo_to_hf: every tensor with its bits and dtype (no head for a tied model),
    the config as transformers reads it; transformers loads the export with no missing or unexpected keys, the
    original's logits exactly, and its greedy tokens are zoo's."""
    from transformers import Olmo2ForCausalLM

    from zoo.generate import generate

    hf, src = tiny[name]
    b, again = convert_round_trip(src, tmp_path, "olmo2", Olmo2ForCausalLM, original=hf, keys=ARCHITECTURE_KEYS)
    assert ("lm_head.weight" in b) is not hf.config.tie_word_embeddings
    # the head dim transformers' attention reads (config.json's, else width / heads): zoo writes it explicitly
    assert again.model.layers[0].self_attn.head_dim == hf.model.layers[0].self_attn.head_dim
    again.eval()
    ids = _docs(128, [23])[0]
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)

    model = zoo.load(tmp_path / "zoo", attn="sdpa")
    prompts = _docs(128, PROMPT_LENS, seed=5)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(again, prompt, MAX_NEW), len(prompt)


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_equals_transformers(tiny, name):
    from zoo.generate import generate

    hf, path = tiny[name]
    assert hf.generation_config.eos_token_id is None  # neither side can stop early
    model = zoo.load(path, attn="sdpa")
    prompts = _docs(128, PROMPT_LENS, seed=6)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW), (name, len(prompt))


# ---- LoRA with PEFT's names ----


def test_lora_auto_adapts_q_and_v_and_peft_loads_the_trained_adapter(tiny, tmp_path):
    """PEFT has no default targets for olmo2 (it asks for target_modules); zoo's `auto` adapts q_proj and v_proj,
    as for Llama. After three AdamW steps the adapter export_adapter writes loads in PEFT over transformers' model
    (the same modules adapted) with zoo's LoRA logits, and merge_and_unload gives zoo's merged weights bit for bit;
    the base (biases, norms, the tied embedding) stays frozen."""
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
    from transformers import Olmo2ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora, merged_state

    ref, path = tiny["olmo2-bias-tied"]
    assert "olmo2" not in PEFT_DEFAULTS and FAMILIES["olmo2"].lora_targets == ("q_proj", "v_proj")
    model = zoo.load(path, attn="eager")
    base = {n: t.clone() for n, t in model.state_dict().items()}
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    wrapped = apply_lora(model, lora, seed=1)
    assert wrapped == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    docs = _docs(128, [20, 13, 27])
    packed = zoo.pack(docs)
    losses = adamw_steps(model, packed)
    assert losses[-1] < losses[0], losses
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(t, base[name.replace(".base.", ".")]), name

    plain, out = export_lora(model, lora, path, tmp_path)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    hf = peft.PeftModel.from_pretrained(Olmo2ForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    adapted = {n for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{p}" for i in range(2)
                       for p in ("q_proj", "v_proj")}
    assert_adapter_logits(model, hf, ref, packed, docs)

    merged = hf.merge_and_unload().state_dict()
    to_hf = {z: h for h, ((z,), _) in FAMILIES["olmo2"].plan_to_hf(plain.config, list(plain.state_dict())).items()}
    ours = merged_state(model.state_dict(), lora.scale)
    assert set(merged) == {to_hf[n] for n in ours} | {"lm_head.weight"}  # transformers lists the tied head too
    changed = 0
    for name, t in ours.items():
        assert torch.equal(merged[to_hf[name]], t), name
        changed += not torch.equal(t, base[name])
    assert changed == 4  # the q and v weights of both layers, nothing else


# ---- sequence parallel: 2 and 4 processes equal one (one spawn of 4 ranks) ----



def _sp_model():
    """12 query heads over 2 KV heads (Ulysses splits them over 2 or 4 ranks), head_dim 16, a tied head; every
    norm weight random (the full-width q/k norms see all heads of a token on its own rank)."""
    from zoo.models.decoder import Decoder
    from zoo.models.olmo2 import Olmo2Config

    cfg = Olmo2Config(dim=64, n_layers=2, n_heads=12, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                      rope_theta=500000.0, norm_eps=1e-6, attention_bias=True, tie_embeddings=True)
    model = _sp_worker._build(Decoder, cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.copy_((1.0 if "norm" in n else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return model


def test_sequence_parallel_equals_one_process(tmp_path):
    _sp_worker.check_model(tmp_path, _sp_model)


# ---- a recipe from a Hugging Face directory ----


def test_pretrain_from_an_olmo2_checkpoint_exports_what_transformers_loads(tmp_path):
    """recipes.pretrain from a Hugging Face OLMo 2 directory: every weight trains, OUT/model keeps the
    architecture, and OUT/model-hf loads in transformers with OUT/model's logits."""
    from transformers import Olmo2ForCausalLM

    save_olmo2(tmp_path / "base", seed=8, vocab_size=2048)
    pretrain_exports_what_transformers_loads(tmp_path / "base", tmp_path / "pt", Olmo2ForCausalLM,
                                             _docs(2048, [40, 9, 30]), atol=1e-5)


# ---- presets ----


@pytest.mark.parametrize("name,dim,head_dim", [("olmo-2-1b", 2048, 128), ("olmo-2-7b-instruct", 4096, 128),
                                               ("olmo-2-13b", 5120, 128)])
def test_presets_build_olmo2_blocks_on_meta(name, dim, head_dim):
    """Parameter counts are tests/test_presets.py's; here the block: a norm after the mixer and after the MLP and
    none before, q/k norms over every head at once, no biases, an untied head."""
    model = zoo.load(name, device="meta")
    layer = model.layers[0]
    attn = layer.attn
    N, K = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    assert model.family == "olmo2" and model.lm_head is not None and attn.head_dim == head_dim and N == K
    assert layer.attn_norm is None and layer.mlp_norm is None
    assert layer.attn_post_norm.weight.shape == layer.mlp_post_norm.weight.shape == (dim,)
    assert attn.q_norm.weight.shape == (N * head_dim,) and attn.k_norm.weight.shape == (K * head_dim,)
    assert attn.q_proj.bias is None and attn.o_proj.bias is None
    assert not layer.attn_post_norm.cast_first and not model.norm.cast_first
