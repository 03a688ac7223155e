"""Qwen2 / Qwen2.5, Qwen3 and Mistral against transformers' own Qwen2ForCausalLM, Qwen3ForCausalLM and
MistralForCausalLM, on tiny random checkpoints those classes saved (tests/_tiny_hf.py):

- one packed forward of mixed-length documents (equal-length neighbours, documents longer than the window) equals
  transformers on each document alone, on every CPU backend; the loss and every gradient equal upstream's;
- hf -> zoo -> hf is bit-exact, transformers loads the result with no missing or unexpected keys and the windows
  it had (Qwen's use_sliding_window / max_window_layers / layer_types, Mistral's sliding_window, null included);
- greedy generation equals transformers' generate token for token, past the window, eager and compiled;
- sequence parallel over 2, 3 and 4 processes equals one process, windows included;
- FLOPs count the pairs a window keeps; the presets build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _sp_worker
import _tiny_hf
import pytest
import torch
from helpers import (
    assert_packed_logits,
    assert_packed_loss_and_grads,
    hf_greedy,
    hf_names,
    transformers_reference,
)

import zoo
from convert import hf_to_zoo, zoo_to_hf
from zoo.core.attention import available_backends
from zoo.generate import generate
from zoo.io.safetensors import SafetensorsDir

transformers = pytest.importorskip("transformers")

NAMES = list(_tiny_hf.SPECS)
FAMILY = {"qwen2": "qwen2", "qwen2-window": "qwen2", "qwen3": "qwen3", "qwen3-window": "qwen3",
          "mistral": "mistral", "mistral-nowindow": "mistral"}
ARCHITECTURE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
# each layer's window as upstream's config means it (None: full attention)
WINDOWS = {"qwen2": [None, None], "qwen2-window": [None, 5, 5], "qwen3": [None, None],
           "qwen3-window": [3, None, 3], "mistral": [4, 4], "mistral-nowindow": [None, None]}

# a 1-token document; equal-length neighbours longer than every window (sdpa batches them under one band mask) and
# no longer than any window (is_causal); documents of 9 and 17 cut by every window
LENGTHS = [9, 1, 12, 12, 3, 3, 17]
CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward


class Tiny:
    """The tiny checkpoints of one session: each built once by transformers, saved, and its model kept."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._hf: dict[str, Any] = {}  # name -> the transformers model

    def hf(self, name: str):
        if name not in self._hf:
            self._hf[name] = _tiny_hf.build(name)
            self._hf[name].save_pretrained(self.root / name)
        return self._hf[name]

    def path(self, name: str) -> Path:
        self.hf(name)
        return self.root / name


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("tiny_hf"))


def _docs(vocab: int, lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(path)
    return {n: reader.get(n) for n in reader.names()}


# ---- parity: one packed forward equals transformers per document; loss and gradients ----


@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_transformers_per_document(tiny, name):
    hf = tiny.hf(name)
    docs = _docs(hf.config.vocab_size)
    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    packed = zoo.pack(docs)
    model = zoo.load(tiny.path(name), attn="eager")
    assert model.family == FAMILY[name]
    assert [layer.attn.window for layer in model.layers] == WINDOWS[name]
    assert (model.lm_head is None) == hf.config.tie_word_embeddings
    assert_packed_logits(model, packed, ref_logits, CPU_BACKENDS, name)

    to_hf = hf_names(model)
    assert sorted(to_hf.values()) == sorted(ref_grads)  # every upstream parameter, the tied head once
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, to_hf, TRAIN_BACKENDS, name)

    if any(WINDOWS[name]):  # the documents are long enough that a model ignoring its window would fail above
        model.set_attention("eager")
        for layer in model.layers:
            layer.attn.window = None
        with torch.no_grad():
            unwindowed = model(packed)
        s, e = packed.cu_seqlens[-2:].tolist()
        assert (unwindowed[s:e] - ref_logits[-1]).abs().max() > 1e-2


# ---- converters: hf -> zoo -> hf bit for bit, and transformers reads the result as it wrote the source ----


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny, tmp_path, name):
    src = tiny.path(name)
    assert hf_to_zoo.main([str(src), str(tmp_path / "zoo"), "--quiet"]) is None
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"]) is None
    a, b = _tensors(src), _tensors(tmp_path / "hf")
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    if tiny.hf(name).config.tie_word_embeddings:
        assert "lm_head.weight" not in _tensors(tmp_path / "zoo") and "lm_head.weight" not in b

    original, written = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "hf"))
    family = FAMILY[name]
    assert (written["model_type"], written["architectures"]) == (family, [ARCHITECTURE[family]])
    assert written["tie_word_embeddings"] == original["tie_word_embeddings"]
    if family == "mistral":  # written even when null: transformers reads a missing sliding_window as 4096
        assert "sliding_window" in written and written["sliding_window"] == original["sliding_window"]
    else:
        for key in ("use_sliding_window", "sliding_window", "layer_types"):
            assert written[key] == original[key], (key, written[key], original[key])
        if name == "qwen2-window":  # layer_types derived from max_window_layers: the same prefix of full layers
            assert written["max_window_layers"] == original["max_window_layers"] == 1

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                                    attn_implementation="eager")
    assert not any(info.values()), info
    assert type(model).__name__ == ARCHITECTURE[family]
    upstream = tiny.hf(name).config
    assert model.config.sliding_window == upstream.sliding_window
    assert getattr(model.config, "layer_types", None) == getattr(upstream, "layer_types", None)
    # the head dim upstream's attention reads from either config (Qwen2's has none of its own: dim / heads)
    assert model.model.layers[0].self_attn.head_dim == tiny.hf(name).model.layers[0].self_attn.head_dim
    ids = _docs(128, [23])[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids[None]).logits, tiny.hf(name)(ids[None]).logits, atol=0, rtol=0)
        # and the zoo checkpoint in between is the same model as the Hugging Face one
        assert zoo.load(tmp_path / "zoo").config == zoo.load(src).config
        torch.testing.assert_close(zoo.load(tmp_path / "zoo", attn="sdpa")(ids), model(ids[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)


# ---- greedy generation: zoo's KV cache (sliding) against transformers' generate ----

PROMPT_LENS = [7, 1, 12]  # batched in one call; with 14 new tokens every sequence runs past every window
MAX_NEW = 14


@pytest.mark.parametrize("name", ["qwen2", "qwen2-window", "qwen3", "qwen3-window", "mistral"])
def test_greedy_equals_transformers(tiny, name):
    hf = tiny.hf(name)
    assert hf.generation_config.eos_token_id is None  # neither side can stop early
    model = zoo.load(tiny.path(name), attn="sdpa")
    prompts = _docs(hf.config.vocab_size, PROMPT_LENS, seed=5)
    got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW), (name, len(prompt))
    assert model.attend is zoo.get_attention("sdpa")


@pytest.fixture
def aot_eager(monkeypatch):
    """The compiled step traced whole but run by aot_eager, as in tests/test_generate.py (no C++ build)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")


@pytest.mark.parametrize("name", ["mistral", "qwen2-window"])
def test_compiled_decode_with_window_equals_transformers(tiny, aot_eager, name):
    """The compiled step's static cache masks rows outside each layer's window (Mistral: every layer; Qwen2:
    full then sliding layers, two masks in one graph)."""
    from torch._dynamo.utils import counters

    hf = tiny.hf(name)
    model = zoo.load(tiny.path(name), attn="sdpa")
    prompts = _docs(hf.config.vocab_size, PROMPT_LENS, seed=6)
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, max_new_tokens=MAX_NEW, stop=[], compile=True)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not left to eager
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW), (name, len(prompt))


# ---- sequence parallel: 2, 3 and 4 processes equal one (one spawn of 4, SP groups of 2, 3 and 4 in it) ----


@pytest.fixture(scope="module")
def sp_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_families") / "report.json"
    _sp_worker.launch(_sp_worker.main_families, 4, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("size", (2, 3, 4))
def test_sequence_parallel_equals_one_process(sp_report, size):
    assert "error" not in sp_report, sp_report["error"][1]
    expected = _sp_worker.family_case_names(size)
    missing = [c for c in expected if c not in sp_report]
    assert not missing, f"cases that did not run: {missing}; report: {sorted(sp_report)}"
    failures = [f"{c}: {sp_report[c][1]}" for c in expected if not sp_report[c][0]]
    assert not failures, "\n".join(failures)


# ---- FLOPs: a window keeps fewer (query, key) pairs ----


def _pairs_by_hand(L: int, window: int | None) -> int:
    """(query, key) pairs of one causal document, counted one by one: key j seen by query i iff
    i - window < j <= i."""
    return sum(1 for i in range(L) for j in range(L) if j <= i and (window is None or j > i - window))


@pytest.mark.parametrize("name", ["mistral", "qwen2-window", "qwen3-window"])
def test_forward_flops_count_the_window(tiny, name):
    from torch.utils.flop_counter import FlopCounterMode

    from zoo.train.flops import forward_flops, matmul_params

    lens = [3, 10, 1, 6]
    model = zoo.load(tiny.path(name), attn="eager")
    H = model.layers[0].attn.head_dim
    N = model.layers[0].attn.q_proj.out_features // H
    assert (N, H) == (4, 24 if FAMILY[name] != "qwen2" else 16)
    attention = sum(2 * 2 * N * H * sum(_pairs_by_hand(L, w) for L in lens) for w in WINDOWS[name])
    linear = 2 * matmul_params(model) * sum(lens)
    assert forward_flops(model, lens) == linear + attention
    # the window saves pairs here: a count that ignored it would be larger
    full = sum(2 * 2 * N * H * sum(_pairs_by_hand(L, None) for L in lens) for _ in WINDOWS[name])
    assert full > attention

    # the linear part is what torch runs: its matrix products with weights (mm, or addmm with a bias) over T
    packed = zoo.pack(_docs(128, lens))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(packed)
    ran = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert ran.get("aten.mm", 0) + ran.get("aten.addmm", 0) == linear
    # eager multiplies the whole L x L square of each document, then masks: the non-causal count
    assert ran["aten.bmm"] == len(WINDOWS[name]) * 2 * 2 * N * H * sum(L * L for L in lens)


# ---- presets ----

NEW_PRESETS = {
    # name: (family, tied head, q/k/v bias, q/k norm, head_dim, windows)
    "qwen2.5-0.5b": ("qwen2", True, True, False, 64, {None}),
    "qwen2.5-7b-instruct": ("qwen2", False, True, False, 128, {None}),
    "qwen3-0.6b": ("qwen3", True, False, True, 128, {None}),
    "qwen3-8b": ("qwen3", False, False, True, 128, {None}),
    "mistral-7b-v0.1": ("mistral", False, False, False, 128, {4096}),
    "mistral-7b-v0.3-instruct": ("mistral", False, False, False, 128, {None}),
    "mistral-nemo-12b": ("mistral", False, False, False, 128, {None}),
}


@pytest.mark.parametrize("name", sorted(NEW_PRESETS))
def test_new_presets_build_on_meta(name):
    """Parameter counts of every preset are tests/test_presets.py's (parametrized over all of PRESETS); here the
    shape of what each new family builds."""
    from zoo.models.presets import PRESETS

    family, tied, bias, qk_norm, head_dim, windows = NEW_PRESETS[name]
    model = zoo.load(name, device="meta")
    assert model.family == family == PRESETS[name].family
    attn = model.layers[0].attn
    assert (model.lm_head is None, attn.q_proj.bias is not None, attn.k_proj.bias is not None,
            attn.o_proj.bias is not None, attn.q_norm is not None) == (tied, bias, bias, False, qk_norm)
    assert attn.head_dim == head_dim and {layer.attn.window for layer in model.layers} == windows
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params
