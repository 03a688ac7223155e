"""Qwen3.5 (text) against transformers' own Qwen3_5ForCausalLM, on tiny random checkpoints it saved (save_pretrained),
and zoo's Gated DeltaNet against its per-token form:

- the chunked delta rule equals the recurrent one over packs of documents shorter than, equal to and longer than a
  chunk, 1-token and empty ones (in fp64 to rounding, in fp32 within 1e-5), and its gradients too; the convolution
  restarts at every document;
- config.json reads as transformers reads it (layer_types or full_attention_interval, rope_parameters with
  partial_rotary_factor, the multimodal text_config); what zoo cannot run is refused in one line;
- one packed forward equals transformers on each document alone, documents crossing the 64-token chunk, on every
  CPU backend (fp32 logits within 1e-4); the loss (1e-5) and every gradient equal upstream's; bf16 logits bit for
  bit; a model materialised from meta gets transformers' init;
- a text config over a Qwen3_5ForConditionalGeneration's tensors (`model.language_model.*`) loads its language model,
  the vision tower and the MTP head left out (the multimodal checkpoint itself loads whole: tests/test_qwen3_vl.py);
  hf -> zoo -> hf is bit-exact and transformers loads the export;
- greedy generate equals transformers' token for token (prompts batched, eager and compiled), its decode steps
  equal the chunked rule over the longer documents;
- LoRA: `auto` adapts q_proj, v_proj and in_proj_qkv; an all-linear adapter loads in PEFT with zoo's logits;
- recipes.pretrain trains a tiny Qwen3.5 checkpoint 2 steps and its --export-hf loads in transformers;
- FLOPs: the convolution's and the chunked rule's, per Gated DeltaNet layer, by hand;
- the presets build on meta with the counts computed from their config.json shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    adamw_steps,
    assert_packed_logits,
    assert_packed_loss_and_grads,
    convert_round_trip,
    export_lora,
    hf_names,
    pretrain_exports_what_transformers_loads,
    transformers_reference,
)

import zoo
from zoo.core.attention import available_backends
from zoo.core.deltanet import causal_conv, chunked_delta_rule, doc_positions, recurrent_delta_rule
from zoo.models import FAMILIES

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
# documents crossing the 64-token chunk (65, 130), exactly one chunk (64), and 1-token ones
LENGTHS = [65, 1, 64, 9, 130, 1, 17]
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, vocab_size=128, eos_token_id=None, pad_token_id=None, bos_token_id=None)
VARIANTS: dict[str, dict] = {
    # two of each layer type; rotary over half of each head
    "qwen3_5": dict(full_attention_interval=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5}),
    # transformers' interval of 4 (3 linear, 1 full), q/k/v/o biases, a tied head, the default quarter rotary
    "qwen3_5-bias-tied": dict(attention_bias=True, tie_word_embeddings=True),
}


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _rule_inputs(lens: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T, Hk, Hv, Dk, Dv = sum(lens), 2, 4, 8, 6

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    return (rand(T, Hk, Dk), rand(T, Hk, Dk), rand(T, Hv, Dv), -torch.rand(T, Hv, generator=g, dtype=dtype) * 3,
            torch.rand(T, Hv, generator=g, dtype=dtype))


# ---- the delta rule and the convolution ----


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_rule_equals_the_recurrent_one(chunk):
    """Documents shorter than, equal to and longer than a chunk, 1-token and empty ones, in one pack: the chunked
    form equals the per-token one (fp64: to rounding; fp32: within 1e-5), and so do their gradients."""
    lens = [1, 5, 16, 0, 17, 64, 40, 1, 33]
    cu = _cu(lens)
    inputs = _rule_inputs(lens, torch.float64)
    torch.testing.assert_close(chunked_delta_rule(*inputs, cu, chunk), recurrent_delta_rule(*inputs, cu),
                               atol=1e-12, rtol=0)
    inputs32 = [x.float().requires_grad_() for x in inputs]
    out = chunked_delta_rule(*inputs32, cu, chunk)
    ref = recurrent_delta_rule(*inputs32, cu)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), inputs32)
    refs = torch.autograd.grad((ref * w).sum(), inputs32)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_each_document_is_its_own_sequence():
    """A document's output depends on it alone: the same document alone, or in another pack at another offset,
    gives the same rows (no state and no convolution tap crosses a boundary)."""
    lens = [7, 70, 3]
    q, k, v, g, beta = _rule_inputs(lens, torch.float64)
    whole = chunked_delta_rule(q, k, v, g, beta, _cu(lens), 16)
    s, e = 7, 77
    alone = chunked_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], _cu([70]), 16)
    torch.testing.assert_close(whole[s:e], alone, atol=1e-12, rtol=0)

    x = torch.randn(sum(lens), 5, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64)
    conv = causal_conv(x, w, doc_positions(_cu(lens), sum(lens))[1])
    ref = torch.nn.functional.conv1d(x[s:e].T[None], w[:, None], padding=3, groups=5)[0, :, :e - s].T
    torch.testing.assert_close(conv[s:e], ref, atol=1e-12, rtol=0)


def test_kernel_choice_on_cpu_and_its_refusals(monkeypatch):
    """On CPU `auto` runs the torch path and says so; "fla" where it cannot run and an unknown kernel are refused in
    one line; fla's backward is refused on Hopper with Triton 3.4.0 <= v < 3.7.1 unless tilelang is installed."""
    import importlib.util
    import sys
    import types

    from zoo.core import deltanet, fla
    from zoo.errors import ZooError

    x = torch.empty(2)
    assert deltanet.pick_kernel(x) == "torch" == deltanet.pick_kernel(x, "torch")
    assert deltanet.describe("cpu").startswith("torch: ")
    for kernel, words in [("fla", "'fla' cannot run here: fla needs CUDA"), ("triton", "expected one of auto")]:
        with pytest.raises(ZooError, match=words) as err:
            deltanet.pick_kernel(x, kernel)
        assert "\n" not in str(err.value)

    refused = fla.fla_backward_refused.__wrapped__
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    find_spec = importlib.util.find_spec
    for version, tilelang, expected in [("3.6.0", False, True), ("3.7.1", False, False), ("3.3.1", False, False),
                                        ("3.6.0+git", True, False)]:
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, t=tilelang: object() if name == "tilelang" and t else find_spec(name, *a))
        assert (refused(torch.device("cuda")) is not None) == expected, (version, tilelang)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert refused(torch.device("cuda")) is None  # Ampere: fla trains


def test_fla_forward_runs_without_gradients_where_its_backward_is_refused(monkeypatch):
    """The dispatch decision (CPU: fla's kernels stood in for, their outputs are tests/test_qwen3_5_gpu.py's): where
    fla's forward runs and its backward is refused, a layer runs fla under no_grad and the torch path where a gradient
    is taken, and the explicit "fla" is refused only there."""
    from zoo.core import deltanet
    from zoo.core.contract import GatedDeltaNetSpec, NormSpec
    from zoo.core.packing import pack
    from zoo.errors import ZooError

    monkeypatch.setattr(deltanet, "fla_forward_refused", lambda *a: None)
    monkeypatch.setattr(deltanet, "fla_refused", lambda *a: "fla's backward refuses this GPU")
    ran = []

    def fake_fla(mixed_TC, conv_CK, beta_TH, g_TH, cu, Hk, Dk, Dv, states_out):
        ran.append(torch.is_grad_enabled())
        return mixed_TC.new_zeros(mixed_TC.shape[0], beta_TH.shape[1], Dv)

    monkeypatch.setattr(deltanet, "fla_documents_eager", fake_fla)
    torch.manual_seed(0)
    layer = deltanet.GatedDeltaNet(32, GatedDeltaNetSpec(2, 4, 8, 8, chunk=16), NormSpec(), 1e-6, 0)
    packed = pack([torch.arange(5), torch.arange(9)])
    x_TD = torch.randn(14, 32)
    none = torch.empty(0)
    assert layer(x_TD, none, none, packed).requires_grad and ran == []  # a gradient: the torch path
    with torch.no_grad():
        layer(x_TD, none, none, packed)
        assert ran == [False]
        layer.kernel = "fla"
        layer(x_TD, none, none, packed)
    assert ran == [False, False]
    with pytest.raises(ZooError, match="'fla' cannot run here: fla's backward refuses this GPU"):
        layer(x_TD, none, none, packed)


# ---- tiny transformers checkpoints ----


def save_qwen3_5(path: Path, seed: int, **options):
    """transformers' Qwen3_5ForCausalLM (the TINY shapes and `options`), every 1-D parameter (norms, biases, A_log,
    dt_bias) moved off its init, saved to `path`; returned in eval mode."""

    import _tiny_families
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **options}))
    model = _tiny_families.randomize(model, seed + 1).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (transformers model, its save_pretrained directory)."""
    root = tmp_path_factory.mktemp("qwen3_5")
    return {name: (save_qwen3_5(root / name, seed=i, **VARIANTS[name]), root / name)
            for i, name in enumerate(VARIANTS)}


def _docs(vocab: int, lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


# ---- config ----

# Qwen/Qwen3.5-27B's text config as published (inside a Qwen3_5ForConditionalGeneration config.json)
PUBLISHED_27B_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "eos_token_id": 248044,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 17408, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "model_type": "qwen3_5_text", "num_attention_heads": 24,
    "num_hidden_layers": 64, "num_key_value_heads": 4, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "tie_word_embeddings": False, "vocab_size": 248320}
PUBLISHED_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                 "text_config": PUBLISHED_27B_TEXT, "tie_word_embeddings": False, "eos_token_id": 248046,
                 "vision_config": {"depth": 27}}


def test_config_reads_as_transformers_reads_it(tiny):
    """The tiny checkpoints' shapes and layer types; a config.json that leaves keys out gets transformers'
    Qwen3_5TextConfig defaults (zoo's own defaults are those too); the published 27B multimodal config gives its
    language model, the top-level eos id winning."""
    from transformers import Qwen3_5TextConfig

    from zoo.models.qwen3_5 import FULL, LINEAR, Qwen3_5Config, config_from_hf

    for name, (hf, path) in tiny.items():
        model = zoo.load(path, device="meta")
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
        cfg = model.config
        assert list(cfg.layer_types) == hf.config.layer_types
        assert cfg.rotary_dim == (8 if name == "qwen3_5" else 4) and cfg.tie_embeddings == (name != "qwen3_5")
    assert tiny["qwen3_5"][0].config.layer_types == [LINEAR, FULL] * 2

    minimal = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, intermediate_size=512)
    upstream = config_from_hf(Qwen3_5TextConfig(**minimal).to_dict())
    assert config_from_hf({"model_type": "qwen3_5_text", **minimal}) == upstream
    assert Qwen3_5Config() == config_from_hf(Qwen3_5TextConfig().to_dict())

    published = config_from_hf(PUBLISHED_27B)
    assert published == config_from_hf(PUBLISHED_27B_TEXT) == zoo.get_preset("qwen3.5-27b-text").config
    assert (published.eos_token_ids, published.rotary_dim, published.rope_theta) == ((248046,), 64, 1e7)
    assert published.layer_types.count(FULL) == 16 and published.layer_types[3] == FULL


@pytest.mark.parametrize("change,words", [
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "expected 'silu'"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["'yarn'", "expected the default RoPE"]),
    ({"linear_num_value_heads": 20}, ["multiple of linear_num_key_heads (16)"]),
    ({"layer_types": ["full_attention", "mamba"]}, ["layer_types", "64 layers"]),
    ({"attn_output_gate": False}, ["attn_output_gate=False", "expected true"]),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(change, words):
    from zoo.models.qwen3_5 import config_from_hf

    with pytest.raises(zoo.ZooError) as e:
        config_from_hf({**PUBLISHED_27B_TEXT, **change})
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("field,value", [("linear_num_key_heads", 0), ("linear_num_value_heads", "4"),
                                         ("linear_conv_kernel_dim", 1e9), ("linear_key_head_dim", None)])
def test_hostile_linear_fields_are_refused_naming_the_file(tiny, tmp_path, field, value):
    """Sizes of the linear layers of the wrong type or range: one line naming config.json and what came (0 key
    heads was a ZeroDivisionError)."""
    path = tmp_path / "m"
    shutil.copytree(tiny["qwen3_5"][1], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(zoo.ZooError) as e:
        zoo.load(path)
    message = str(e.value)
    assert "\n" not in message and str(path / "config.json") in message and f"got {value!r}" in message, message


# ---- parity: one packed forward equals transformers per document; loss and gradients ----


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_equals_transformers_per_document(tiny, name):
    hf, path = tiny[name]
    docs = _docs(128)
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)

    model = zoo.load(path, attn="eager")
    assert model.family == "qwen3_5" and (model.lm_head is None) == hf.config.tie_word_embeddings
    packed = zoo.pack(docs)
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, name)

    to_hf = hf_names(model)
    assert sorted(to_hf.values()) == sorted(ref_grads)  # every upstream parameter, once
    # 5e-5, not the 1e-5 of the softmax families: transformers' own fp32 gradients here are 3e-5 (relative) from its
    # fp64 ones (the delta rule runs in fp32 through 130-token documents), zoo's 2e-5 from its fp32
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, to_hf, TRAIN_BACKENDS, name, grad_rel=5e-5)


def test_compiled_blocks_train_as_eager_without_a_graph_per_pack(tiny):
    """Blocks compiled as the recipes compile them (apply_compile: block.compile(); aot_eager here, for time): the
    loss and gradients equal eager's on packs of other documents, and a new pack compiles nothing new once the shapes
    are dynamic (the delta rule's step loop follows the documents: it runs eagerly inside the compiled block)."""
    from torch._dynamo.utils import counters

    path = tiny["qwen3_5"][1]
    eager, model = zoo.load(path, attn="sdpa"), zoo.load(path, attn="sdpa")
    for block in model.layers:
        block.compile(backend="aot_eager")
    graphs = []
    for seed, lens in enumerate([[70, 9, 40, 6], [12, 130, 3, 33], [260, 2, 44, 20]]):
        packed = zoo.pack(_docs(128, lens, seed=seed))
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            m.loss(packed).backward()
        for (n, a), b in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[-2], f"graphs compiled after each pack: {graphs}"


def test_bf16_logits_equal_transformers_bit_for_bit(tiny):
    """In bf16 (eager on both sides) every logit is transformers': the convolution sums in fp32 and rounds once (as
    its conv1d does), the delta rule runs in fp32, the gated norm multiplies as Qwen3_5RMSNormGated, the (1 + w)
    norms in fp32. A convolution summed tap by tap in bf16 moves logits by several bf16 steps, which this sees."""
    from transformers import Qwen3_5ForCausalLM

    path = tiny["qwen3_5"][1]
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    model = zoo.load(path, attn="eager", dtype=torch.bfloat16)
    docs = _docs(128)
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        logits = model(packed)
        for i, d in enumerate(docs):
            assert torch.equal(logits[cu[i]:cu[i + 1]], hf(d[None]).logits[0]), f"doc {i}"


def test_random_init_from_meta(tiny):
    """A model built on meta and materialised gets transformers' init for the decay (dt_bias 1, A in [0.01, 16])
    and the gated norm (1), and runs a finite forward."""
    from zoo.core.deltanet import GatedDeltaNet
    from zoo.core.layers import init_weights

    config = zoo.load(tiny["qwen3_5"][1], device="meta").config
    with torch.device("meta"):
        model = FAMILIES["qwen3_5"].build(config, "eager")
    model.to_empty(device="cpu")
    init_weights(model)
    deltas = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert len(deltas) == 2
    for m in deltas:
        A = m.decay.A_log.exp()
        assert torch.all(m.decay.dt_bias == 1) and torch.all((A >= 0.01 - 1e-6) & (A <= 16)) and A.std() > 0
        assert torch.all(m.norm.weight == 1)
    with torch.no_grad():
        assert torch.isfinite(model(zoo.pack(_docs(128, [70, 3])))).all()


# ---- checkpoints: the multimodal layout, converters ----


def test_multimodal_checkpoint_loads_its_language_model(tiny, tmp_path, caplog):
    """The published tensors (the language model under `model.language_model.*`, the head as `lm_head.*`, beside a
    vision tower and an MTP head) under a text config: zoo loads the language model (the same logits as the text
    checkpoint), says in one line what it left out. (With its own Qwen3_5ForConditionalGeneration config the
    checkpoint is the multimodal qwen3_5_vl family, tested in tests/test_qwen3_vl.py.)"""
    from safetensors.torch import load_file, save_file

    hf, src = tiny["qwen3_5"]
    tensors = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
               for n, t in load_file(src / "model.safetensors").items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(text))
    with caplog.at_level("WARNING"):
        model = zoo.load(tmp_path)
    assert any("vision tower" in r.getMessage() and "mtp" in r.getMessage() for r in caplog.records)
    ids = _docs(128, [23])[0]
    with torch.no_grad():
        torch.testing.assert_close(model(zoo.pack([ids])), zoo.load(src)(zoo.pack([ids])), atol=0, rtol=0)


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_bit_exact_and_transformers_loads_the_export(tiny, tmp_path, name):
    """convert.hf_to_zoo then convert.zoo_to_hf: every tensor with its bits and dtype (no head for a tied model);
    transformers loads the export as a Qwen3_5ForCausalLM with no missing or unexpected keys and the original's
    logits exactly."""
    from transformers import Qwen3_5ForCausalLM


    hf, src = tiny[name]
    b, again = convert_round_trip(src, tmp_path, "qwen3_5_text", Qwen3_5ForCausalLM)
    assert ("lm_head.weight" in b) is not hf.config.tie_word_embeddings
    for key in ("layer_types", "rope_parameters", "linear_num_value_heads", "head_dim", "tie_word_embeddings",
                "attention_bias"):
        assert getattr(again.config, key) == getattr(hf.config, key), key
    again.eval()
    ids = _docs(128, [70])[0]
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)
    assert zoo.load(tmp_path / "zoo").config == zoo.load(src).config
    shutil.rmtree(tmp_path / "zoo")


# ---- generation ----


def test_decode_steps_equal_the_chunked_rule_on_the_longer_sequence():
    """conv_step and delta_rule_step from a prefill's kept states (chunked_delta_rule's `states_out`, the last K - 1
    inputs) equal the convolution and the chunked rule run over the whole longer documents."""
    from zoo.core.deltanet import conv_step, delta_rule_step

    lens, extra = [3, 70, 1], 5
    q, k, v, g, beta = _rule_inputs([n + extra for n in lens], torch.float64, seed=3)
    cu_long, cu = _cu([n + extra for n in lens]), _cu(lens)
    prompt = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_long[:-1].tolist(), lens)])
    ref = chunked_delta_rule(q, k, v, g, beta, cu_long, 16)
    states = []
    chunked_delta_rule(q[prompt], k[prompt], v[prompt], g[prompt], beta[prompt], cu, 16, states_out=states)
    S = states[0]
    x = torch.randn(int(cu_long[-1]), 5, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64)
    conv_ref = causal_conv(x, w, doc_positions(cu_long, x.shape[0])[1])
    window = torch.zeros(3, 3, 5, dtype=torch.float64)
    for i, (s0, n) in enumerate(zip(cu_long[:-1].tolist(), lens)):
        tail = x[max(s0, s0 + n - 3) : s0 + n]
        window[i, 3 - tail.shape[0]:] = tail
    for step in range(extra):
        rows = cu_long[:-1].long() + torch.tensor(lens) + step
        torch.testing.assert_close(delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], S), ref[rows],
                                   atol=1e-12, rtol=0)
        torch.testing.assert_close(conv_step(x[rows], window, w), conv_ref[rows], atol=1e-12, rtol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_greedy_generate_equals_transformers(tiny, compiled, monkeypatch):
    """Prompts of different lengths (one crossing the 64-token chunk) batched: greedy tokens equal transformers'
    generate on each prompt alone, eager and compiled (aot_eager: the whole step traced, no graph break)."""
    import importlib

    from zoo.generate import generate

    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    hf, path = tiny["qwen3_5"]
    model = zoo.load(path).eval()
    prompts = _docs(128, [5, 70, 1], seed=5)
    new = 6
    got = generate(model, prompts, max_new_tokens=new, stop=[], compile=compiled)
    for p, out in zip(prompts, got):
        want = hf.generate(p[None], max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, len(p):]
        assert out.tolist() == want.tolist()
    assert all(getattr(m, "cache", None) is None for m in model.decoder.mixers())  # the cache handed back


# ---- LoRA ----


def test_lora_auto_and_all_linear_load_in_peft(tiny, tmp_path):
    """PEFT has no default targets for qwen3_5: `auto` adapts the attention layers' q_proj, v_proj and the Gated
    DeltaNet layers' in_proj_qkv. all-linear at rank 8 adapts in_proj_qkv, in_proj_z, out_proj and the attention
    projections, not in_proj_a/in_proj_b (Hv = 4 outputs, narrower than the rank); after two AdamW steps the
    adapter recipes.engine.export writes loads in PEFT over transformers' model, the same modules adapted, with zoo's
    logits."""
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
    from transformers import Qwen3_5ForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    ref, path = tiny["qwen3_5"]
    assert "qwen3_5" not in PEFT_DEFAULTS and "qwen3_5_text" not in PEFT_DEFAULTS
    auto = apply_lora(zoo.load(path), LoRAConfig(rank=4, alpha=8, targets=("auto",)))
    assert auto == [f"layers.{i}.attn.{p}" for i in range(4)
                    for p in (("in_proj_qkv",) if i % 2 == 0 else ("q_proj", "v_proj"))]

    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=8, alpha=16, targets=("all-linear",))
    wrapped = apply_lora(model, lora, seed=1)
    linear = ("in_proj_qkv", "in_proj_z", "out_proj")
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert {w.split(".")[-1] for w in wrapped if ".attn." in w} == set(linear + attn), wrapped
    docs = _docs(128, [20, 70, 9])
    packed = zoo.pack(docs)
    adamw_steps(model, packed, steps=2)
    _, out = export_lora(model, lora, path, tmp_path)
    hf = peft.PeftModel.from_pretrained(Qwen3_5ForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    adapted = {n.split(".layers.")[1] for n, m in hf.named_modules()
               if hasattr(m, "lora_A") and "default" in m.lora_A}
    want = {f"{i}.linear_attn.{p}" for i in (0, 2) for p in linear}
    want |= {f"{i}.self_attn.{p}" for i in (1, 3) for p in attn}
    assert {a for a in adapted if "mlp" not in a} == want
    model.eval()
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        mine = model(packed)
        for i, doc in enumerate(docs):
            theirs = hf(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(mine[cu[i]:cu[i + 1]], theirs, atol=1e-5, rtol=0)
            assert (theirs - ref(input_ids=doc[None]).logits[0]).abs().max() > 1e-3  # the adapter matters


# ---- recipes ----


def test_pretrain_from_a_qwen3_5_checkpoint_exports_what_transformers_loads(tmp_path):
    """recipes.pretrain from a Hugging Face Qwen3.5 directory trains 2 steps (every weight moves), OUT/model keeps
    the architecture, and OUT/model-hf loads in transformers as Qwen3_5ForCausalLM with OUT/model's logits."""
    from transformers import Qwen3_5ForCausalLM

    save_qwen3_5(tmp_path / "base", seed=8, vocab_size=2048, **VARIANTS["qwen3_5"])
    pretrain_exports_what_transformers_loads(tmp_path / "base", tmp_path / "pt", Qwen3_5ForCausalLM,
                                             _docs(2048, [40, 9, 70]), atol=1e-4)


# ---- FLOPs ----


def test_flops_count_the_convolution_and_the_chunked_rule(tiny):
    """MFU's count adds, per Gated DeltaNet layer, the convolution (2 x channels x K per token) and the chunked
    rule's products per value head and whole chunk (zoo.train.flops' docstring), by hand for the tiny model: 2
    such layers, Hv = 4, Dk = 8, Dv = 12, 80 channels, K = 4, chunks of 64; documents of 65 and 3 tokens take 3."""
    from zoo.train.flops import attention_flops, deltanet_flops, forward_flops, matmul_params, step_flops

    model = zoo.load(tiny["qwen3_5"][1])
    lens = [65, 3]
    per_chunk = 4 * 64 * 64 * 8 + 64 * 63 * (8 + 12) + 2 * 64 * 64 * 12 + 6 * 64 * 8 * 12
    assert per_chunk == 346880
    per_layer = 2 * 80 * 4 * 68 + 4 * per_chunk * 3
    assert deltanet_flops(lens, 4, 8, 12, 80, 4, 64) == per_layer == 4206080
    attn = 2 * attention_flops(lens, 4, 16)  # the two gated attention layers
    forward = 2 * matmul_params(model) * 68 + attn + 2 * per_layer
    assert forward_flops(model, lens) == forward
    assert step_flops(model, lens) == 3 * forward
    # one more token past the chunk costs a whole chunk of the rule (zoo's torch path computes it)
    one_more = 2 * matmul_params(model) + 2 * (attention_flops([65], 4, 16) - attention_flops([64], 4, 16))
    assert forward_flops(model, [65]) - forward_flops(model, [64]) == one_more + 2 * (2 * 80 * 4 + 4 * per_chunk)


def test_gated_deltanet_refuses_part_of_a_pack_in_one_line(tiny):
    """A Gated DeltaNet layer handed part of a pack outside sequence parallelism (sp.apply hands it the exchange
    that continues documents across ranks) refuses it: it would start each piece from a zero state."""
    model = zoo.load(tiny["qwen3_5"][1])
    packed = zoo.pack(_docs(128, [5, 3]))
    part = zoo.Packed(packed.input_ids, packed.cu_seqlens, packed.position_ids, packed.max_seqlen,
                      doc_len=torch.full((8,), 9))
    with pytest.raises(zoo.ZooError, match="parts of documents"):
        model(part)


# ---- presets ----


def test_presets_build_on_meta_with_their_computed_counts():
    """Every Qwen3.5 preset builds on meta with the count computed from its config.json shapes, and its blocks
    are 3 Gated DeltaNet layers to 1 gated attention layer."""
    from zoo.core.deltanet import GatedDeltaNet
    from zoo.models.presets import PRESETS

    names = [n for n, p in PRESETS.items() if p.family in ("qwen3_5", "qwen3_5_vl")]
    assert {"qwen3.5-0.8b-text", "qwen3.5-2b", "qwen3.5-4b-text", "qwen3.5-9b-text", "qwen3.5-27b-text"} <= set(names)
    whole = ("qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-4b-base", "qwen3.5-9b", "qwen3.5-9b-base", "qwen3.5-27b")
    assert {PRESETS[n].family for n in whole} == {"qwen3_5_vl"}
    assert {PRESETS[n].family for n in ("qwen3.5-2b", "qwen3.5-2b-base")} == {"qwen3_5"}  # its tower unconfirmed
    for name in names:
        model = zoo.load(name, device="meta")
        assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params, name
        linear = [isinstance(layer.attn, GatedDeltaNet) for layer in model.layers]
        assert linear == [bool((i + 1) % 4) for i in range(len(linear))], name


@pytest.mark.parametrize("size", ["0.8b", "4b"])
def test_whole_presets_count_as_transformers_builds_them(size):
    """The multimodal presets' counts are transformers' Qwen3_5ForConditionalGeneration's, built on meta from the
    config zoo writes for them (its tower, merger and language model; transformers builds no MTP head either), and
    the tower is the published one."""
    import transformers

    from zoo.models import FAMILIES
    from zoo.models.presets import PRESETS

    preset = PRESETS[f"qwen3.5-{size}"]
    hf = FAMILIES["qwen3_5_vl"].config_to_hf(preset.config)
    config = transformers.Qwen3_5Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    v = config.vision_config
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size) == {
        "0.8b": (12, 768, 12, 3072, 1024), "4b": (24, 1024, 16, 4096, 2560)}[size]
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size, v.num_position_embeddings, v.hidden_act) == (
        16, 2, 2, 2304, "gelu_pytorch_tanh")
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == preset.params
    assert PRESETS[f"qwen3.5-{size}-text"].params == sum(p.numel() for p in model.model.language_model.parameters())
