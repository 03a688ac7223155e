"""Qwen3.5-MoE (text) against transformers' own Qwen3_5MoeForCausalLM, on a tiny random checkpoint it saved
(save_pretrained: one tensor per expert, as published), routers far from ties and norms off their init:

- config.json reads as transformers reads it (its defaults, the multimodal text_config); what zoo cannot run
  (dense layers) is refused in one line;
- one packed forward equals transformers on each document alone, documents crossing the 64-token chunk, on the
  CPU backends but flex (fp32 logits and router logits within 1e-4); the loss (1e-5) and every gradient (relative
  5e-5 against transformers run in fp64 throughout, or as close as transformers' fp32 ones are) equal upstream's;
- the loss with aux_loss_coef equals transformers' loss with output_router_logits over the same documents;
- hf -> zoo -> hf is bit-exact, transformers loads the export; the multimodal tensors under a text config load its
  language model;
- greedy generate equals transformers' token for token;
- the preset builds on meta with its computed count, every layer an MoE block.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    assert_packed_loss_and_grads,
    convert_round_trip,
    transformers_reference,
    transformers_reference_fp64,
)

import zoo
from zoo.core.attention import available_backends
from zoo.core.moe import MoE
from zoo.models import FAMILIES

# flex is left out: it compiles on CPU (seconds) and has no CPU backward; the attention layers are Qwen3.5's, which
# tests/test_qwen3_5.py runs through every backend
BACKENDS = [b for b in available_backends("cpu") if b != "flex"]
LENGTHS = [65, 1, 9, 130, 17]  # crossing the 64-token chunk, and a 1-token document
VOCAB = 128
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
            vocab_size=VOCAB, eos_token_id=None, pad_token_id=None, bos_token_id=None, full_attention_interval=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5},
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model in eval mode, its save_pretrained directory)."""

    import _tiny_families
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    path = tmp_path_factory.mktemp("qwen3_5_moe")
    torch.manual_seed(0)
    model = _tiny_families.randomize(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY)), 1).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers: large, so that no two experts tie for a token
                p.normal_(0.0, 0.5)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model, path


def _docs(lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def _in_memory_name(cfg, zoo_name: str) -> str:
    """transformers' in-memory name of a zoo tensor: it stacks the experts on load as zoo does, calls the router
    `mlp.gate`, and names the rest as Qwen3.5."""
    from zoo.models.qwen3_5 import hf_name

    return hf_name(cfg, zoo_name.replace(".mlp.router.", ".mlp.gate."))


# ---- config ----


def test_config_reads_as_transformers_reads_it(tiny):
    from transformers import Qwen3_5MoeConfig as HFMultimodal
    from transformers import Qwen3_5MoeTextConfig

    from zoo.models.qwen3_5_moe import Qwen3_5MoeConfig, config_from_hf

    hf, path = tiny
    model = zoo.load(path, device="meta")
    assert model.family == "qwen3_5_moe"
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert list(model.config.layer_types) == hf.config.layer_types and model.config.rotary_dim == 8
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers)
    assert Qwen3_5MoeConfig() == config_from_hf(Qwen3_5MoeTextConfig().to_dict())
    multimodal = HFMultimodal(text_config={**TINY, "eos_token_id": 7}, tie_word_embeddings=True).to_dict()
    cfg = config_from_hf(multimodal)
    assert cfg.tie_embeddings and cfg.eos_token_ids == (7,) and cfg.n_experts == 4 and cfg.shared_expert_ffn_dim == 48


@pytest.mark.parametrize("change,words", [
    ({"mlp_only_layers": [1]}, ["every layer", "mlp_only_layers=[1]"]),
    ({"num_experts_per_tok": 9}, ["num_experts_per_tok", "1..num_experts (4)"]),
    ({"hidden_act": "gelu"}, ["Qwen3.5-MoE", "expected 'silu'"]),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    from zoo.models.qwen3_5_moe import config_from_hf

    with pytest.raises(zoo.ZooError) as e:
        config_from_hf({"model_type": "qwen3_5_moe_text", **TINY, **change})
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_zero_linear_key_heads_are_refused_naming_the_file(tiny, tmp_path):
    """The hybrid's checks are Qwen3.5's (one function): 0 key heads reach check_config's one line, naming
    config.json, not a ZeroDivisionError."""
    path = tmp_path / "m"
    shutil.copytree(tiny[1], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "linear_num_key_heads": 0}))
    with pytest.raises(zoo.ZooError) as e:
        zoo.load(path)
    assert "\n" not in str(e.value) and str(path / "config.json") in str(e.value) and "got 0" in str(e.value)


# ---- parity ----


def test_packed_equals_transformers_per_document(tiny):
    hf, path = tiny
    docs = _docs()
    ref_logits, ref_loss, ref_grads, ref_routers = transformers_reference(hf, docs, routers=True)

    model = zoo.load(path, attn="eager")
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    for backend in BACKENDS:
        model.set_attention(backend)
        with torch.no_grad(), model.recording_router() as records:
            logits = model(packed)
        for i, ref in enumerate(ref_logits):
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, w=f"{backend} doc {i}": f"{w}: {m}")
            for layer, ref_router in zip(records, ref_routers[i], strict=True):
                # 1e-4 as the logits (test_moe's softmax families hold 1e-5): the delta rule's fp32 rounding over the
                # 130-token document reaches the routers, whose weights are scaled up to keep experts from tying
                torch.testing.assert_close(layer[0][cu[i]:cu[i + 1]], ref_router, atol=1e-4, rtol=1e-4)

    names = {z: _in_memory_name(model.config, z) for z, _ in model.named_parameters()}
    assert sorted(names.values()) == sorted(ref_grads)  # every upstream parameter, once
    # the gradients against transformers in fp64 throughout (the truth both fp32 runs round from; a plain .double()
    # copy still runs its delta rule in fp32): within 5e-5, or as close as transformers' fp32 ones are. zoo forms
    # the decays from an fp64 cumulative sum: its A_log is 4e-5 from fp64 here, transformers' 1.9e-4
    _, ref_loss64, ref_grads64, _ = transformers_reference_fp64(hf, docs, routers=True)
    assert abs(ref_loss64.item() - ref_loss.item()) < 1e-5
    assert_packed_loss_and_grads(model, packed, ref_loss64, ref_grads64, names, BACKENDS, "qwen3_5_moe", grad_rel=5e-5,
                                 upstream=ref_grads)


def test_aux_loss_equals_transformers_output_router_logits(tiny):
    """model.loss(packed, aux_loss_coef=c) = transformers' loss with labels and output_router_logits over the same
    documents as a right-padded batch (its balancing loss leaves out what the mask marks as padding, its CE the -100
    labels; right padding leaves the real tokens' DeltaNet states alone): CE + c x balance, gradients equal."""
    hf, path = tiny
    docs = _docs([9, 14, 5, 11])
    coef = 0.3
    T = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), T, dtype=torch.long)
    mask = torch.zeros(len(docs), T, dtype=torch.long)
    labels = torch.full((len(docs), T), -100)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)], labels[i, :len(d)] = d, 1, d
    hf.zero_grad(set_to_none=True)
    default, hf.router_aux_loss_coef = hf.router_aux_loss_coef, coef  # read by its forward (set from the config)
    try:
        out = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    finally:
        hf.router_aux_loss_coef = default
    out.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    assert out.aux_loss > 0

    model = zoo.load(path, attn="eager")
    loss = model.loss(zoo.pack(docs), aux_loss_coef=coef)
    loss.backward()
    assert abs(loss.item() - out.loss.item()) < 1e-5, (loss.item(), out.loss.item())
    for zoo_name, p in model.named_parameters():
        ref = ref_grads[_in_memory_name(model.config, zoo_name)]
        rel = ((p.grad - ref).norm() / ref.norm()).item()
        assert rel < 5e-5, f"grad {zoo_name}: relative error {rel:.2e}"


# ---- conversion ----


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(tiny, tmp_path):
    """convert.hf_to_zoo then convert.zoo_to_hf: every per-expert tensor with its bits and dtype; transformers loads
    the export as a Qwen3_5MoeForCausalLM with no missing or unexpected keys and the original's logits exactly."""
    from transformers import Qwen3_5MoeForCausalLM


    hf, src = tiny
    b, again = convert_round_trip(src, tmp_path, "qwen3_5_moe_text", Qwen3_5MoeForCausalLM)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in b
    again.eval()
    ids = _docs([70])[0]
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)
    assert zoo.load(tmp_path / "zoo").config == zoo.load(src).config
    shutil.rmtree(tmp_path / "zoo")


def test_multimodal_checkpoint_loads_its_language_model(tiny, tmp_path):
    """The published tensors (`model.language_model.*` beside a vision tower and an MTP head) under a text config: the
    same logits as the text checkpoint. (With its own Qwen3_5MoeForConditionalGeneration config the checkpoint is the
    multimodal qwen3_5_moe_vl family, tested in tests/test_qwen3_vl.py.)"""
    from safetensors.torch import load_file, save_file

    hf, src = tiny
    tensors = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
               for n, t in load_file(src / "model.safetensors").items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(text))
    ids = _docs([23])[0]
    with torch.no_grad():
        torch.testing.assert_close(zoo.load(tmp_path)(zoo.pack([ids])), zoo.load(src)(zoo.pack([ids])), atol=0,
                                   rtol=0)


# ---- generation and presets ----


def test_greedy_generate_equals_transformers(tiny):
    from zoo.generate import generate

    hf, path = tiny
    model = zoo.load(path).eval()
    prompts = _docs([5, 70, 1], seed=5)
    new = 6
    got = generate(model, prompts, max_new_tokens=new, stop=[])
    for p, out in zip(prompts, got):
        want = hf.generate(p[None], max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, len(p):]
        assert out.tolist() == want.tolist()


def test_preset_builds_on_meta_with_its_computed_count():
    from zoo.core.deltanet import GatedDeltaNet
    from zoo.models.presets import PRESETS

    names = [n for n, p in PRESETS.items() if p.family in ("qwen3_5_moe", "qwen3_5_moe_vl")]
    assert {"qwen3.5-35b-a3b", "qwen3.5-35b-a3b-text"} <= set(names)
    for name in names:
        model = zoo.load(name, device="meta")
        assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params, name
        assert all(isinstance(layer.mlp, MoE) for layer in model.layers), name
        linear = [isinstance(layer.attn, GatedDeltaNet) for layer in model.layers]
        assert linear == [bool((i + 1) % 4) for i in range(len(linear))], name
    assert PRESETS["qwen3.5-35b-a3b-text"].active_params == 3_454_988_928  # 8 of 256 experts and the shared one
    # the whole model: its tower and merger run for every image token
    assert PRESETS["qwen3.5-35b-a3b"].active_params == 3_454_988_928 + 35_107_181_936 - 34_660_610_688
    assert FAMILIES["qwen3_5_moe"].lora_targets == ("q_proj", "v_proj", "in_proj_qkv")
