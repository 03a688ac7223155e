"""zoo.generate.fused: decode steps with q/k/v and gate/up each one product give the same greedy tokens as the
model's own projections, across block shapes (GQA Llama; Qwen3's per-head q/k norms; Gemma 3's sandwich norms,
windows, softmax scale and GeGLU; Qwen2's q/k/v biases; OLMo 2's full-width q/k norms; Qwen3.5's gated queries
beside Gated DeltaNet layers), eager and compiled, and leave the model's parameters as they were."""

from typing import Any

import pytest
import torch

from zoo.core.layers import init_weights
from zoo.generate import fused as fused_mod
from zoo.generate import generate
from zoo.generate.fused import FusedDecoder, fused_decoder
from zoo.models import FAMILIES
from zoo.models.gemma3 import Gemma3Config
from zoo.models.llama import LlamaConfig
from zoo.models.olmo2 import Olmo2Config
from zoo.models.qwen2 import Qwen2Config
from zoo.models.qwen3 import Qwen3Config
from zoo.models.qwen3_5 import Qwen3_5Config

VOCAB = 200
SMALL: dict[str, Any] = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB)
CONFIGS = {
    "llama": LlamaConfig(**SMALL),
    "qwen3": Qwen3Config(**{**SMALL, "head_dim": 24}),
    "gemma3": Gemma3Config(**{**SMALL, "head_dim": 16}, sliding_window=4, query_pre_attn_scalar=24,
                           layer_types=("sliding_attention", "full_attention")),
    "qwen2-bias": Qwen2Config(**SMALL),
    "olmo2": Olmo2Config(**SMALL),
    "qwen3_5": Qwen3_5Config(**{**SMALL, "n_layers": 2, "head_dim": 16}, rotary_dim=8, linear_key_heads=2,
                             linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             layer_types=("linear_attention", "full_attention")),
}


def _model(cfg, seed=3):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = FAMILIES[cfg.family].build(cfg, "sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms and biases off their init: a norm or bias dropped by the fused path would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _prompts(lens=(7, 1, 12, 3), seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_greedy_equals_unfused(name, monkeypatch):
    calls = []
    for cls in (fused_mod.FusedAttention, fused_mod.FusedMLP):
        forward = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, *a, forward=forward: calls.append(self) or forward(self, *a))
    model = _model(CONFIGS[name])
    before = {n: p.clone() for n, p in model.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    fused = fused_decoder(model.decoder)
    assert isinstance(fused, FusedDecoder) and fused.fused_layers == 2
    if name == "qwen3_5":  # the Gated DeltaNet layer keeps its own mixer, its MLP fuses
        assert fused.blocks[0].attn is None and fused.blocks[0].mlp is not None
    else:
        assert all(b.attn is not None and b.mlp is not None for b in fused.blocks)
    assert list(fused.parameters(recurse=True)) and not any(p.requires_grad for p in fused.parameters())
    del fused
    prompts = _prompts()
    plain = generate(model, prompts, max_new_tokens=10, fuse=False)
    assert not calls
    got = generate(model, prompts, max_new_tokens=10, fuse=True)
    assert [t.tolist() for t in got] == [t.tolist() for t in plain]
    assert len(calls) == 9 * (3 if name == "qwen3_5" else 4)  # 9 decode steps (not the prefill), each fused module
    # the hidden states of one decode step agree to float rounding (the tokens alone could hide a small error)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_fused_step_hidden_close_to_unfused():
    """One decode-shaped pack through both: the same hidden states up to float rounding."""
    import zoo

    model = _model(CONFIGS["gemma3"])
    packed = zoo.pack(_prompts())
    fused = fused_decoder(model.decoder)
    want = model.decoder.hidden(packed)
    got = fused.hidden(packed)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_fused_compiled_equals_eager_and_is_kept(monkeypatch):
    """The compiled path (aot_eager: the graph a GPU would compile) with fused weights gives the eager tokens; its
    fused weights are kept for a second call on the same weights and rebuilt after the weights change."""
    import importlib

    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    model = _model(CONFIGS["qwen3"])
    prompts = _prompts()
    want = [t.tolist() for t in generate(model, prompts, max_new_tokens=6, fuse=False)]
    assert [t.tolist() for t in generate(model, prompts, max_new_tokens=6, compile=True, fuse=True)] == want
    kept = fused_mod._last[0][2]
    assert [t.tolist() for t in generate(model, prompts, max_new_tokens=6, compile=True, fuse=True)] == want
    assert fused_mod._last[0][2] is kept  # reused: the CUDA graphs would replay at the same addresses
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.mul_(1.5)
    want = [t.tolist() for t in generate(model, prompts, max_new_tokens=6, fuse=False)]
    assert [t.tolist() for t in generate(model, prompts, max_new_tokens=6, compile=True, fuse=True)] == want
    assert fused_mod._last[0][2] is not kept  # the weights changed in place: built again
    fused_mod.release()
    assert not fused_mod._last


def test_nothing_to_fuse_runs_the_model():
    """A model whose projections are not plain linears (a LoRA wrap) keeps its own forward."""
    from zoo.train.lora import LoRAConfig, apply_lora

    model = _model(CONFIGS["llama"])
    apply_lora(model, LoRAConfig(rank=2, alpha=4, targets=("q_proj", "gate_proj")))
    fused = fused_decoder(model.decoder)
    assert fused is None  # no layer's q/k/v or gate/up are all plain
    prompts = _prompts()
    assert [t.tolist() for t in generate(model, prompts, max_new_tokens=4, fuse=True)] == \
        [t.tolist() for t in generate(model, prompts, max_new_tokens=4, fuse=False)]
