"""Per-layer state through the model contract (zoo.core.mixer.Mixer): a mixer zoo does not have (tests/
_toy_mixer.py, a running mean of each document) plugs into generation and sequence parallelism with nothing in
zoo.generate or zoo.parallel naming it; and no generic code names Gated DeltaNet or MoE."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import _sp_worker
import _toy_mixer
import pytest
import torch

import zoo
from zoo.core.mixer import Mixer
from zoo.generate import generate

ROOT = Path(__file__).resolve().parent.parent


def _greedy_without_cache(model, prompt, new):
    """Greedy tokens by the whole forward over prompt + tokens so far, every step: no cache, no state."""
    seq = prompt.clone()
    for _ in range(new):
        logits = model(seq, torch.tensor([0, len(seq)], dtype=torch.int32))
        seq = torch.cat([seq, logits[-1].argmax()[None]])
    return seq[len(prompt):]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_new_mixer_generates_as_the_whole_forward_does(compiled, monkeypatch):
    """Prompts of different lengths batched, eager and compiled (aot_eager: the step traced whole): the tokens equal
    the uncached greedy ones, so the toy's state was filled by the prefill and advanced by each step, and handed
    back after."""
    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    model = _toy_mixer.build(torch.float64).eval()
    mixers = model.decoder.mixers()
    assert [type(m).__name__ for m in mixers] == ["MeanMixer", "Attention", "MeanMixer"]
    assert all(isinstance(m, Mixer) for m in mixers)
    prompts = _sp_worker._docs([5, 17, 1], 96, 2)
    got = generate(model, prompts, max_new_tokens=6, stop=[], compile=compiled)
    with torch.no_grad():
        for p, out in zip(prompts, got):
            assert out.tolist() == _greedy_without_cache(model, p, 6).tolist()
    assert all(getattr(m, "cache", None) is None for m in mixers)


def test_a_new_mixer_states_its_kernel_and_flops():
    """What runs, and the FLOPs of its mixing, come from the mixer itself: zoo.train.flops counts the toy's running
    sums (32 channels a token, in 2 of 3 layers) beside the linears and the one attention layer."""
    from zoo.train.flops import forward_flops, matmul_params

    model = _toy_mixer.build()
    mixers = model.decoder.mixers()
    assert mixers[0].kernel_choice(torch.device("cpu"), torch.float32) == "torch: a cumulative sum per document"
    assert "installed function" in mixers[1].kernel_choice(torch.device("cpu"), torch.float32)
    lens = [5, 9]
    mixing = 2 * 32 * sum(lens)
    assert forward_flops(model, lens) == 2 * matmul_params(model) * sum(lens) + model.decoder.attention_flops(lens) \
        + mixing


def test_a_new_mixer_states_its_generation_memory():
    """generate's memory check adds what each mixer says: a cache too large for this machine is refused."""
    model = _toy_mixer.build()
    with pytest.raises(zoo.ZooError, match="needs .* GiB"):
        generate(model, [torch.tensor([1, 2])], max_new_tokens=10**13)


def test_a_new_mixer_runs_under_ulysses_as_one_process_and_refuses_ring(tmp_path):
    out = tmp_path / "report.json"
    _sp_worker.launch(_toy_mixer.main, 2, out)
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"][1]
    assert sorted(report) == ["ring refused", "ulysses"], report
    failures = [f"{c}: {detail}" for c, (ok, detail) in report.items() if not ok]
    assert not failures, "\n".join(failures)


# the only files that may name the Gated DeltaNet and MoE modules: their own, and the decoder's table of parts.
# zoo/train/flops.py reads an MoE layer's expert shapes (an MLP, not a mixer: not yet through the contract);
# recipes/engine/moe.py moves MoE router biases (the recipe part of MoE balancing)
OWNERS = {"GatedDeltaNet": {"zoo/core/deltanet.py", "zoo/models/decoder.py"},
          "MoE": {"zoo/core/moe.py", "zoo/models/decoder.py", "zoo/train/flops.py", "recipes/engine/moe.py"}}


def test_generic_code_names_no_mixer_or_mlp_class():
    """No module of zoo/, recipes/ or convert/ imports or refers to GatedDeltaNet or MoE but their owners (imports,
    lazy ones included, and attribute uses such as deltanet.GatedDeltaNet)."""
    found = []
    for path in sorted([*ROOT.glob("zoo/**/*.py"), *ROOT.glob("recipes/**/*.py"), *ROOT.glob("convert/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            found += [f"{rel}:{node.lineno} {n}" for n in names if n in OWNERS and rel not in OWNERS[n]]
    assert not found, found
