"""GPT-OSS against transformers' own GptOssForCausalLM, on a tiny random checkpoint it saved (save_pretrained) with
every feature active: sinks drawn at random (non-zero), sliding layers whose window (4) is shorter than the
documents, YaRN with a short original context (its ramp and attention factor both matter), the router's bias and the
experts' biases off zero, a SwiGLU limit low enough to bind (checked: without it the logits move).

- config.json reads as transformers writes it, the published gpt-oss-20b config is the preset; what zoo cannot run
  is refused in one line;
- one packed forward equals transformers on each document alone on every CPU backend (logits, router logits); the
  loss and every gradient equal upstream's (the experts' gradients through the converter's layout change);
- the loss with aux_loss_coef equals transformers' loss with output_router_logits;
- hf -> zoo -> hf is bit-exact, transformers loads the export, greedy decoding with the cache (sinks and windows in
  decode) equals transformers' generate;
- MXFP4: zoo's dequantisation equals transformers' `convert_moe_packed_tensors` on random bytes (every scale), and an
  MXFP4 checkpoint (the hub's layout) loads with transformers' dequantised model's logits;
- LoRA all-linear (q, k, v, o: transformers' router and experts are no nn.Linear, so PEFT adapts neither) equals
  PEFT's adapter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _tiny_families
import pytest
import torch
from conftest import prefixed
from helpers import convert_round_trip, export_lora, hf_greedy, transformers_reference

import zoo
from zoo.core.attention import available_backends
from zoo.models import FAMILIES
from zoo.models.gpt_oss import config_from_hf, dequantize_mxfp4

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
VOCAB = 128
LENGTHS = [9, 1, 12, 3, 17]
ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}


def hf_config(**extra):
    """Width 64, layers sliding then full (window 4), 4 query heads of 16 over 2 KV heads, 4 experts of 32 (top 2),
    SwiGLU limit 0.6 (the published 7.0 rarely binds at this width)."""
    from transformers import GptOssConfig as HFConfig

    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                   max_position_embeddings=256, initializer_range=0.1, swiglu_limit=0.6, rope_parameters=dict(ROPE),
                   eos_token_id=None, pad_token_id=None, bos_token_id=None)
    return HFConfig(**{**options, **extra})


def save_gpt_oss(path: Path, seed: int = 0):
    """transformers' model, random (norms, biases and sinks off their init, router weights large so that no two
    experts tie for a token), saved to `path`; returned in eval mode with eager attention."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = _tiny_families.randomize(GptOssForCausalLM(hf_config()), seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):  # the experts' stacked biases (2-D: randomize moves 1-D ones only)
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5, generator=g)
    model.eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "tiny"
    return save_gpt_oss(path), path


def _docs(lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


# ---- config ----

PUBLISHED_20B = {  # openai/gpt-oss-20b's config.json as published
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}


def test_config_reads_as_transformers_writes_it_and_the_published_one_is_the_preset(tiny):
    hf, path = tiny
    model = zoo.load(path, device="meta")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    cfg = model.config
    assert cfg.layer_types == ("sliding_attention", "full_attention") and not cfg.mxfp4_experts
    assert [layer.attn.window for layer in model.layers] == [4, None]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0

    published = config_from_hf(PUBLISHED_20B)
    preset = zoo.get_preset("gpt-oss-20b")
    assert published == preset.config and published.mxfp4_experts and published.router_aux_loss_coef == 0.9
    assert published.eos_token_ids == (200002,) and published.pad_token_id == 199999
    respelled = {k: v for k, v in PUBLISHED_20B.items() if k not in ("rope_theta", "rope_scaling", "layer_types")}
    respelled["rope_parameters"] = {**PUBLISHED_20B["rope_scaling"], "rope_theta": 150000.0}
    assert config_from_hf(respelled) == published  # transformers 5's spelling; layer_types by default
    # the card's active counts (3.61B, 5.13B) leave the embedding matrix out
    for name, active in [("gpt-oss-20b", 3.61e9), ("gpt-oss-120b", 5.13e9)]:
        p = zoo.get_preset(name)
        assert p.active_params is not None
        assert round((p.active_params - 201088 * 2880) / 1e7) == round(active / 1e7), name


@pytest.mark.parametrize("change,words", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, ["quantization_config 'bitsandbytes'", "mxfp4"]),
    ({"layer_types": ["sliding_attention"] * 3}, ["layer_types must be 24", "sliding_attention"]),
    ({"layer_types": ["chunked_attention"] * 24}, ["layer_types must be 24 of sliding_attention, full_attention"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["unsupported rope scaling 'dynamic'", "yarn"]),
    ({"num_experts_per_tok": 40}, ["num_experts_per_tok must be in 1..num_experts (32)"]),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    with pytest.raises(zoo.ZooError) as e:
        FAMILIES["gpt_oss"].config_from_hf({**PUBLISHED_20B, **change})
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ---- parity ----


def _grads_as_zoo(model, hf_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gradients in zoo's layout, through the loader's plan (experts transposed, gate/up halves)."""
    names = [n for n, _ in model.named_parameters()]
    plan = FAMILIES["gpt_oss"].plan_from_hf(model.config, names)
    return {z: (combine([hf_grads[s] for s in srcs]) if combine else hf_grads[srcs[0]])
            for z, (srcs, combine) in plan.items()}


def test_packed_equals_transformers_per_document(tiny):
    hf, path = tiny
    docs = _docs()
    ref_logits, ref_loss, ref_grads, ref_routers = transformers_reference(hf, docs, routers=True)
    model = zoo.load(path, attn="eager")
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    for backend in CPU_BACKENDS:
        model.set_attention(backend)
        with torch.no_grad(), model.recording_router() as records:
            logits = model(packed)
        for i, ref in enumerate(ref_logits):
            where = f"{backend} doc {i}"
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], ref, atol=1e-4, rtol=1e-4, msg=prefixed(where))
            for layer, ref_router in zip(records, ref_routers[i], strict=True):
                torch.testing.assert_close(layer[0][cu[i]:cu[i + 1]], ref_router, atol=1e-5, rtol=1e-5)

    want = _grads_as_zoo(model, ref_grads)
    for backend in TRAIN_BACKENDS:
        model.set_attention(backend)
        model.zero_grad(set_to_none=True)
        loss = model.loss(packed)
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-5, (backend, loss.item(), ref_loss.item())
        for name, p in model.named_parameters():
            rel = ((p.grad - want[name]).norm() / want[name].norm()).item()
            assert want[name].norm() > 0 and rel < 1e-5, f"{backend} grad {name}: relative error {rel:.2e}"

    # every feature matters here: without the SwiGLU limit, or with the sinks at -inf, the logits move
    for change in ({"swiglu_limit": 1e9}, {"sinks": True}):
        other = zoo.load(path, attn="eager")
        if "sinks" in change:
            with torch.no_grad():
                for layer in other.layers:
                    layer.attn.sinks.fill_(-1e30)
        else:
            other = _rebuilt(other, **change)
        with torch.no_grad():
            assert (other(packed) - model(packed)).abs().max() > 1e-3, change


def _rebuilt(model, **changes):
    """`model`'s weights in a model of its config with `changes`."""
    import dataclasses

    from zoo.models.decoder import Decoder

    again = Decoder(dataclasses.replace(model.config, **changes), "eager")
    again.load_state_dict(model.state_dict())
    return again


def _padded_batch(docs):
    T = max(len(d) for d in docs)
    ids, mask = torch.zeros(len(docs), T, dtype=torch.long), torch.zeros(len(docs), T, dtype=torch.long)
    labels = torch.full((len(docs), T), -100)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)], labels[i, :len(d)] = d, 1, d
    return ids, mask, labels


def test_aux_loss_equals_transformers_output_router_logits(tiny):
    """model.loss(packed, aux_loss_coef=c) = transformers' loss with output_router_logits over the same documents as
    a right-padded batch (its balancing loss: the softmax over every expert of the router's logits, bias included,
    and its top-k, not the routing's softmax over the chosen k), gradients included."""
    hf, path = tiny
    docs = _docs([9, 14, 5, 11])
    coef = 0.3
    ids, mask, labels = _padded_batch(docs)
    hf.zero_grad(set_to_none=True)
    default, hf.router_aux_loss_coef = hf.router_aux_loss_coef, coef
    try:
        out = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    finally:
        hf.router_aux_loss_coef = default
    out.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)

    model = zoo.load(path, attn="eager")
    parts: dict = {}
    loss = model.loss(zoo.pack(docs), aux_loss_coef=coef, parts=parts)
    loss.backward()
    assert abs(loss.item() - out.loss.item()) < 1e-5, (loss.item(), out.loss.item())
    assert abs(parts["aux_loss"].item() - out.aux_loss.item()) < 1e-5 and out.aux_loss > 0
    assert parts["expert_counts"].sum(1).tolist() == [2.0 * sum(map(len, docs))] * 2
    want = _grads_as_zoo(model, ref_grads)
    for name, p in model.named_parameters():
        rel = ((p.grad - want[name]).norm() / want[name].norm()).item()
        assert rel < 1e-5, f"grad {name}: relative error {rel:.2e}"


MAX_NEW = 8


def test_round_trip_is_bit_exact_and_generation_equals_transformers(tiny, tmp_path):
    """hf_to_zoo then zoo_to_hf: every tensor with its bits; transformers loads the export as GptOssForCausalLM
    with the original's config; greedy decoding with zoo's KV cache (prompts and outputs past the window, sinks in
    every step) equals transformers' generate."""
    from transformers import GptOssForCausalLM

    from zoo.generate import generate

    hf, src = tiny
    convert_round_trip(src, tmp_path, "gpt_oss", GptOssForCausalLM, original=hf,
                       keys=("layer_types", "sliding_window", "swiglu_limit", "rope_parameters", "num_local_experts"))
    model = zoo.load(tmp_path / "zoo", attn="sdpa")
    prompts = _docs([7, 1, 12], seed=5)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW), len(prompt)


# ---- MXFP4 ----


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantisation_equals_transformers(dtype):
    """Random bytes and every scale 0..255 (inf and NaN included where 2^128 overflows): the values of
    transformers' convert_moe_packed_tensors, which returns them transposed ([E, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 256, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(256, dtype=torch.uint8).repeat(3, 2).view(3, 2, 256).transpose(1, 2).contiguous()
    mine = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert mine.shape == (3, 256, 64) and mine.dtype == dtype
    torch.testing.assert_close(mine, theirs.transpose(1, 2), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(zoo.ZooError, match="MXFP4 blocks must be uint8"):
        dequantize_mxfp4(blocks.float(), scales)


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(tiny, tmp_path):
    """The tiny checkpoint with its expert matrices replaced by random MXFP4 blocks and scales (the hub's names and
    layout, quantization_config in config.json): zoo.load streams and dequantises them, its logits equal those of
    transformers' model loaded from the same directory (dequantised on CPU); hf_to_zoo converts it too."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM, Mxfp4Config

    from convert import hf_to_zoo

    _, src = tiny
    dst = tmp_path / "mxfp4"
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, inputs, outputs = tensors.pop(name).shape  # transformers' [E, in, out]
        tensors[name + "_blocks"] = torch.randint(0, 256, (E, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                  generator=g)
        tensors[name + "_scales"] = torch.randint(121, 128, (E, outputs, inputs // 32), dtype=torch.uint8,
                                                  generator=g)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = PUBLISHED_20B["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))

    hf = GptOssForCausalLM.from_pretrained(dst, dtype=torch.float32, attn_implementation="eager",
                                           quantization_config=Mxfp4Config(dequantize=True)).eval()
    model = zoo.load(dst, attn="eager", dtype=torch.float32)
    assert model.config.mxfp4_experts
    docs = _docs([13, 6])
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        ours = model(packed)
        for i, d in enumerate(docs):
            torch.testing.assert_close(ours[cu[i]:cu[i + 1]], hf(d[None]).logits[0], atol=1e-4, rtol=1e-4)
    hf_to_zoo.main([str(dst), str(tmp_path / "zoo"), "--quiet"])
    converted = load_file(tmp_path / "zoo" / "model.safetensors")
    for name, p in model.state_dict().items():
        assert torch.equal(converted[name].float(), p), name


# ---- LoRA ----


def test_all_linear_lora_equals_peft(tiny, tmp_path):
    """zoo's all-linear adapts q, k, v and o of every layer, never the router nor the stacked experts (PEFT's
    all-linear finds the same: transformers' router and experts are no nn.Linear); after two steps the exported
    adapter loads in PEFT over transformers' model with zoo's logits. `auto` (PEFT names no GPT-OSS default): q, v."""
    peft = pytest.importorskip("peft")
    from transformers import GptOssForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    _, path = tiny
    model = zoo.load(path, attn="eager")
    auto = apply_lora(zoo.load(path, attn="eager"), LoRAConfig(rank=4, alpha=8, targets=("auto",)), seed=1)
    assert auto == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    lora = LoRAConfig(rank=4, alpha=8, targets=("all-linear",))
    wrapped = apply_lora(model, lora, seed=1)
    assert wrapped == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    docs = _docs([20, 13, 27])
    packed = zoo.pack(docs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(2):
        opt.zero_grad()
        model.loss(packed, aux_loss_coef=0.01).backward()
        opt.step()
    _, out = export_lora(model, lora, path, tmp_path)
    base = GptOssForCausalLM.from_pretrained(path, attn_implementation="eager")
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["k_proj", "o_proj", "q_proj", "v_proj"], targets
    hf = peft.PeftModel.from_pretrained(base, out).eval()
    model.eval()
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        mine = model(packed)
        for i, doc in enumerate(docs):
            assert (mine[cu[i]:cu[i + 1]] - hf(input_ids=doc[None]).logits[0]).abs().max() < 1e-5, i
