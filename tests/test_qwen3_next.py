"""Qwen3-Next against transformers' own Qwen3NextForCausalLM, on a tiny random checkpoint it saved (save_pretrained:
the fused in_proj_qkvz / in_proj_ba, one tensor per expert), routers far from ties, norms off their init, one dense
layer (mlp_only_layers) and the top-k weights not renormalised (norm_topk_prob false):

- config.json reads as transformers reads it (its defaults);
- one packed forward equals transformers on each document alone, documents crossing the 64-token chunk and a
  1-token one, on the CPU backends but flex (fp32 logits within 2e-4); the loss (1e-5) and every gradient (relative
  5e-5 against transformers run in fp64 throughout, or as close as transformers' fp32 ones are; the fused
  projections' by their rows) equal upstream's;
- hf -> zoo -> hf is bit-exact and transformers loads the export; a checkpoint with its MTP head loads without it;
- greedy generate equals transformers' token for token;
- LoRA `auto` adapts q_proj, v_proj and the fused in_proj_qkvz (zoo's in_proj_qkv and in_proj_z sharing one A): the
  exported adapter loads in PEFT over transformers' model with zoo's logits;
- sequence parallel (Ulysses, ring over 2 ranks, hybrid 2 x 2) equals one process: tests/test_qwen3_5_sp.py;
- the presets build on meta with their computed counts (total and per token, embeddings included).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import (
    adamw_steps,
    assert_packed_loss_and_grads,
    convert_round_trip,
    export_lora,
    transformers_reference,
    transformers_reference_fp64,
)

import zoo
from zoo.core.attention import available_backends
from zoo.core.moe import MoE

BACKENDS = [b for b in available_backends("cpu") if b != "flex"]  # flex: compiles on CPU, no CPU backward
LENGTHS = [65, 1, 9, 70]
VOCAB = 128
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
            vocab_size=VOCAB, eos_token_id=None, pad_token_id=None, bos_token_id=None, full_attention_interval=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5},
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model in eval mode, its save_pretrained directory)."""
    import _tiny_families
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(0)
    model = _tiny_families.randomize(Qwen3NextForCausalLM(Qwen3NextConfig(**TINY)), 1).eval()
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


def _expected_grads(model, ref_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gradients in zoo's layout: the fused projections split by the family's own rule (rows only),
    the experts stacked in memory as zoo's, the router called `mlp.gate`, the rest named as Qwen3.5."""
    import re

    from zoo.models.qwen3_5 import hf_name
    from zoo.models.qwen3_next import split_qkvz

    out = {}
    for z, _ in model.named_parameters():
        if m := re.fullmatch(r"layers\.(\d+)\.attn\.in_proj_(qkv|z|b|a)\.weight", z):
            fused = "qkvz" if m[2] in ("qkv", "z") else "ba"
            fused_grad = ref_grads[f"model.layers.{m[1]}.linear_attn.in_proj_{fused}.weight"]
            out[z] = split_qkvz(model.config, m[2], fused_grad)
        else:
            out[z] = ref_grads[hf_name(model.config, z.replace(".mlp.router.", ".mlp.gate."))]
    return out


def test_config_reads_as_transformers_reads_it(tiny):
    from transformers import Qwen3NextConfig as HFConfig

    from zoo.models.qwen3_next import Qwen3NextConfig, config_from_hf

    hf, path = tiny
    model = zoo.load(path, device="meta")
    assert model.family == "qwen3_next"
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert list(model.config.layer_types) == hf.config.layer_types and model.config.rotary_dim == 8
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [True, False, True, True]
    assert not model.config.norm_topk_prob
    assert Qwen3NextConfig() == config_from_hf(HFConfig().to_dict())


def test_packed_equals_transformers_per_document(tiny):
    hf, path = tiny
    docs = _docs()
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    model = zoo.load(path, attn="eager")
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    want = _expected_grads(model, ref_grads)
    for backend in BACKENDS:
        model.set_attention(backend)
        with torch.no_grad():
            logits = model(packed)
        for i, ref in enumerate(ref_logits):
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], ref, atol=2e-4, rtol=2e-4,
                                       msg=lambda m, w=f"{backend} doc {i}": f"{w}: {m}")
    # the gradients against transformers in fp64 throughout (the truth both fp32 runs round from): within 5e-5, or
    # as close as transformers' fp32 ones are (fp32 against fp32 would sum two runs' rounding; transformers forms
    # its decays from an fp32 cumulative sum, so its A_log is 1.5e-4 from fp64, zoo's, from an fp64 one, 2e-6)
    _, ref_loss64, ref_grads64 = transformers_reference_fp64(hf, docs)
    assert abs(ref_loss64.item() - ref_loss.item()) < 1e-5
    assert_packed_loss_and_grads(model, packed, ref_loss64, _expected_grads(model, ref_grads64),
                                 {z: z for z in want}, BACKENDS, "qwen3_next", grad_rel=5e-5, upstream=want)


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(tiny, tmp_path):
    """convert.hf_to_zoo then convert.zoo_to_hf: the fused projections and per-expert tensors with their bits;
    transformers loads the export with the original's logits exactly; the MTP head of a published checkpoint is
    left out."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    hf, src = tiny
    b, again = convert_round_trip(src, tmp_path, "qwen3_next", Qwen3NextForCausalLM)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in b and "model.layers.1.mlp.up_proj.weight" in b
    ids = _docs([70])[0]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)
    with_mtp = tmp_path / "mtp"
    with_mtp.mkdir()
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(2, 2)}, with_mtp / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(src / "config.json", with_mtp / "config.json")
    with torch.no_grad():
        torch.testing.assert_close(zoo.load(with_mtp)(zoo.pack([ids])), zoo.load(src)(zoo.pack([ids])), atol=0,
                                   rtol=0)


def test_greedy_generate_equals_transformers(tiny):
    from zoo.generate import generate

    hf, path = tiny
    model = zoo.load(path).eval()
    prompts = _docs([5, 70, 1], seed=5)
    got = generate(model, prompts, max_new_tokens=6, stop=[])
    for p, out in zip(prompts, got):
        want = hf.generate(p[None], max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, len(p):]
        assert out.tolist() == want.tolist()


def test_lora_auto_loads_in_peft_with_zoos_logits(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Qwen3NextForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=("auto",))
    wrapped = apply_lora(model, lora, seed=1)
    assert sorted(wrapped) == sorted([f"layers.{i}.attn.{p}" for i in range(4)
                                      for p in (("in_proj_qkv", "in_proj_z") if i % 2 == 0 else ("q_proj", "v_proj"))])
    docs = _docs([20, 70, 9])
    packed = zoo.pack(docs)
    adamw_steps(model, packed, steps=2)
    _, out = export_lora(model, lora, path, tmp_path)
    hf = peft.PeftModel.from_pretrained(Qwen3NextForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    adapted = {n.split(".layers.")[1] for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert adapted == {"0.linear_attn.in_proj_qkvz", "2.linear_attn.in_proj_qkvz", "1.self_attn.q_proj",
                       "1.self_attn.v_proj", "3.self_attn.q_proj", "3.self_attn.v_proj"}
    model.eval()
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        mine = model(packed)
        for i, doc in enumerate(docs):
            theirs = hf(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(mine[cu[i]:cu[i + 1]], theirs, atol=1e-4, rtol=0)  # fp32, as the logits
            assert (theirs - ref(input_ids=doc[None]).logits[0]).abs().max() > 1e-3  # the adapter matters


def test_presets_build_on_meta_with_their_computed_counts():
    from zoo.core.deltanet import GatedDeltaNet
    from zoo.models.presets import PRESETS

    names = sorted(n for n, p in PRESETS.items() if p.family == "qwen3_next")
    assert names == ["qwen3-next-80b-a3b-instruct", "qwen3-next-80b-a3b-thinking"]  # no base was published
    for name in names:
        model = zoo.load(name, device="meta")
        assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params == 79_674_391_296, name
        assert PRESETS[name].active_params == 3_874_929_408, name  # 10 of 512 experts, embeddings included
        assert all(isinstance(layer.mlp, MoE) for layer in model.layers), name
        assert [isinstance(layer.attn, GatedDeltaNet) for layer in model.layers] == [bool((i + 1) % 4)
                                                                                     for i in range(48)]
