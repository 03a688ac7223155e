"""Mixture-of-Experts families (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers' own classes, on tiny random
checkpoints they saved (save_pretrained: one tensor per expert, as the hub has them):

- config.json reads as transformers reads it (num_experts or num_local_experts, rope_theta or rope_parameters, dense
  layers by mlp_only_layers and decoder_sparse_step); what zoo cannot run is refused in one line;
- one packed forward equals transformers on each document alone on every CPU backend, router logits included; the
  loss and every gradient equal upstream's; the loss with aux_loss_coef equals transformers' loss with
  output_router_logits over the same documents (a padded batch whose mask leaves out the padding), per-document
  balancing equals the mean of transformers' per document;
- the experts' kernels (grouped_mm, padded batched GEMMs) equal a loop over experts and are bit-stable run to run;
- hf -> zoo -> hf is bit-exact, transformers loads the export as its own class and generates zoo's tokens;
- LoRA `auto` adapts q/v and leaves experts and router frozen; sequence parallel equals one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _sp_worker
import _tiny_families
import pytest
import torch
from helpers import assert_packed_loss_and_grads, convert_round_trip, export_lora, hf_greedy, transformers_reference

import zoo
from zoo.core.attention import available_backends
from zoo.core.moe import MoE, load_balancing_loss
from zoo.models import FAMILIES

CPU_BACKENDS = available_backends("cpu")
TRAIN_BACKENDS = [b for b in CPU_BACKENDS if b != "flex"]  # flex has no CPU backward
LENGTHS = [9, 1, 12, 12, 3, 17]
VOCAB = 128


def hf_config(family: str, vocab_size: int = VOCAB, **extra):
    """A tiny transformers config of `family`: width 64, 2 layers, 4 experts of 32 (top 2); Qwen3-MoE with its second
    layer dense (mlp_only_layers) and renormalised top-k, Qwen2-MoE with a shared expert of 48."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
                  num_experts_per_tok=2, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=24, intermediate_size=96, moe_intermediate_size=32,
                                           num_experts=4, norm_topk_prob=True, mlp_only_layers=[1], **extra)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, **extra)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, num_experts=4, **extra)
    raise ValueError(family)


CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
NAMES = tuple(CLASSES)


def save_moe(family: str, path: Path, seed: int, vocab_size: int = VOCAB, **extra):
    """transformers' model, random (norms and biases off their init, router weights large so that no two experts
    tie for a token), saved to `path`; returned in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family])(hf_config(family, vocab_size=vocab_size, **extra))
    model = _tiny_families.randomize(model, seed + 1).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == 4:  # the routers
                p.normal_(0.0, 0.5)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: (save_moe(name, root / name, seed=i), root / name) for i, name in enumerate(NAMES)}


def _docs(lens=LENGTHS, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def _in_memory_name(zoo_name: str) -> str:
    """The name transformers 5 gives a zoo tensor in memory: it stacks the checkpoint's experts on load, as zoo does
    (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]), and calls the router `mlp.gate`."""
    from zoo.models.family import rename
    from zoo.models.llama import HF_NAMES

    return rename(zoo_name.replace(".mlp.router.", ".mlp.gate."), HF_NAMES)


# ---- config ----

PUBLISHED_30B = {  # Qwen/Qwen3-30B-A3B's config.json as published
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_configs_read_as_transformers_reads_them(tiny):
    """Each tiny checkpoint's parameter count and sparse layers; both spellings of the expert count and of the RoPE
    base; the published Qwen3-30B-A3B config is the preset."""
    from zoo.models.qwen3_moe import config_from_hf

    for name, (hf, path) in tiny.items():
        model = zoo.load(path, device="meta")
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()), name
        moes = [isinstance(layer.mlp, MoE) for layer in model.layers]
        assert moes == ([True, False] if name == "qwen3_moe" else [True, True]), name
        written = json.loads((path / "config.json").read_text())
        assert "num_local_experts" in written or "num_experts" in written

    published = config_from_hf(PUBLISHED_30B)
    assert published == zoo.get_preset("qwen3-30b-a3b").config
    respelled = {k: v for k, v in PUBLISHED_30B.items() if k not in ("num_experts", "rope_theta")}
    respelled.update(num_local_experts=128, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert config_from_hf(respelled) == published
    assert published.sparse_layers() == (True,) * 48 and published.router_aux_loss_coef == 0.001
    assert config_from_hf({**PUBLISHED_30B, "decoder_sparse_step": 2, "mlp_only_layers": [1]}).sparse_layers()[:4] \
        == (False, False, False, True)


@pytest.mark.parametrize("family,change,words", [
    ("qwen3_moe", {"num_experts_per_tok": 200}, ["num_experts_per_tok must be in 1..num_experts (128)", "200"]),
    ("qwen3_moe", {"num_experts": None, "num_local_experts": None}, ["num_experts (or num_local_experts)"]),
    ("qwen3_moe", {"use_sliding_window": True}, ["use_sliding_window=true"]),
    ("qwen3_moe", {"mlp_only_layers": [48]}, ["mlp_only_layers", "0..47", "[48]"]),
    ("qwen3_moe", {"num_experts": 0}, ["num_experts must be an integer in 1..100000, got 0"]),
    ("mixtral", {"router_jitter_noise": 0.1}, ["router_jitter_noise=0.1"]),
])
def test_what_zoo_cannot_run_is_refused_in_one_line(tiny, family, change, words):
    hf = tiny[family][0].config.to_dict() if family != "qwen3_moe" else PUBLISHED_30B
    with pytest.raises(zoo.ZooError) as e:
        FAMILIES[family].config_from_hf({**hf, **change})
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ---- parity ----


@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_transformers_per_document(tiny, name):
    hf, path = tiny[name]
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
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, w=f"{name} {backend} doc {i}": f"{w}: {m}")
            for layer, ref_router in zip(records, ref_routers[i], strict=True):
                torch.testing.assert_close(layer[0][cu[i]:cu[i + 1]], ref_router, atol=1e-5, rtol=1e-5)

    names = {z: _in_memory_name(z) for z, _ in model.named_parameters()}
    assert sorted(names.values()) == sorted(n for n, _ in hf.named_parameters())
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, names, TRAIN_BACKENDS, name)


def _padded_batch(docs):
    T = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), T, dtype=torch.long)
    mask = torch.zeros(len(docs), T, dtype=torch.long)
    labels = torch.full((len(docs), T), -100)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)], labels[i, :len(d)] = d, 1, d
    return ids, mask, labels


@pytest.mark.parametrize("name", NAMES)
def test_aux_loss_equals_transformers_output_router_logits(tiny, name):
    """model.loss(packed, aux_loss_coef=c) = transformers' loss with labels and output_router_logits over the same
    documents as a right-padded batch (its load-balancing loss leaves out what the mask marks as padding; its CE
    the -100 labels): CE + c x balance, from one forward; gradients equal. Per-document balancing is the mean of
    transformers' balance over each document alone."""
    hf, path = tiny[name]
    docs = _docs([9, 14, 5, 11])
    coef = 0.3
    ids, mask, labels = _padded_batch(docs)
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
    packed = zoo.pack(docs)
    loss = model.loss(packed, aux_loss_coef=coef)
    loss.backward()
    assert abs(loss.item() - out.loss.item()) < 1e-5, (loss.item(), out.loss.item())
    for zoo_name, p in model.named_parameters():
        ref = ref_grads[_in_memory_name(zoo_name)]
        rel = ((p.grad - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, f"{name} grad {zoo_name}: relative error {rel:.2e}"

    parts: dict = {}
    with torch.no_grad():
        again = model.loss(packed, aux_loss_coef=coef, z_loss_coef=0.01, parts=parts)
    assert abs(again.item() - (parts["ce"] + coef * parts["aux_loss"] + 0.01 * parts["z_loss"]).item()) < 1e-6
    assert abs(parts["aux_loss"].item() - out.aux_loss.item()) < 1e-5
    n_moe = sum(isinstance(layer.mlp, MoE) for layer in model.layers)
    assert parts["expert_counts"].shape == (n_moe, 4)
    assert parts["expert_counts"].sum(1).tolist() == [2.0 * packed.num_tokens] * n_moe  # k choices per token

    with torch.no_grad():
        ce = model.loss(packed)
        per_doc = model.loss(packed, aux_loss_coef=1.0, aux_loss="per-document") - ce
        alone = [hf(d[None], output_router_logits=True).aux_loss for d in docs]
    assert abs(per_doc.item() - torch.stack(alone).mean().item()) < 1e-5


def test_z_loss_and_balance_statistics():
    """transformers' balance statistic: k (= E x E x k/E x 1/E) when the top-k choices and the probabilities spread
    evenly over the experts, E when every token sends everything to the same k experts; the router z-loss is the
    mean squared logsumexp; an unknown balance kind is refused in one line."""
    from zoo.core.moe import router_z_loss

    packed = zoo.pack([torch.arange(4), torch.arange(4)])
    E, k = 4, 2
    even = torch.full((8, E), -30.0)
    for t in range(8):
        even[t, [t % E, (t + 2) % E]] = 30.0
    assert abs(load_balancing_loss([even], k, packed).item() - k) < 1e-5
    collapsed = torch.tensor([[30.0, 30.0, -30.0, -30.0]]).repeat(8, 1)
    assert abs(load_balancing_loss([collapsed], k, packed).item() - E) < 1e-5
    logits = [torch.randn(8, E), torch.randn(8, E)]
    expected = torch.cat([torch.logsumexp(x, -1) ** 2 for x in logits]).mean()
    assert torch.allclose(router_z_loss(logits, packed), expected)
    with pytest.raises(zoo.ZooError, match="aux_loss must be 'batch' or 'per-document', got 'sequence'"):
        zoo.load("qwen3-0.6b", device="meta").loss(packed, aux_loss_coef=0.1, aux_loss="sequence")


def test_dense_models_refuse_a_balancing_loss(tiny):
    from zoo.models.decoder import Decoder
    from zoo.models.llama import LlamaConfig

    model = _sp_worker._build(Decoder, LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32,
                                                   vocab_size=VOCAB))
    with pytest.raises(zoo.ZooError, match="needs MoE layers; this llama model has none"):
        model.loss(zoo.pack(_docs([5, 6])), aux_loss_coef=0.01)


# ---- kernels ----


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
KERNEL_CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16),
                pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, requires_cuda])]


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
def test_expert_kernels_equal_a_loop_over_experts_and_are_bit_stable(device, dtype):
    """Every kernel against a per-expert loop in fp32 (an expert with no token included), forward and backward;
    each twice gives the same bits. On CUDA in bf16, grouped_mm is what runs (Hopper and Ampere have it)."""
    from zoo.core import moe

    torch.manual_seed(0)
    E, D, F, T, K = 5, 32, 16, 23, 2
    experts = moe.Experts(E, D, F).to(device, dtype)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(T, D, dtype=dtype, device=device, requires_grad=True)
    choice = torch.randint(0, E - 1, (T, K), device=device)  # expert E-1 gets nothing
    choice[:, 1] = (choice[:, 0] + 1) % (E - 1)
    g = torch.randn(T, K, D, dtype=dtype, device=device)
    if device == "cuda":
        assert moe.pick_kernel(x, D, F) == "grouped_mm"
    assert moe.describe(device, dtype, D, F) == moe.pick_kernel(x, F, D)  # what runs, said
    assert moe.describe("cpu", torch.float64) == "padded_bmm"  # grouped_mm takes no fp64

    def loop():
        out = torch.zeros(T, K, D, dtype=torch.float32, device=device)
        W1, W2 = experts.gate_up_proj.float(), experts.down_proj.float()
        for e in range(E):
            t, k = torch.where(choice == e)
            gate, up = (x[t].float() @ W1[e].T).chunk(2, -1)
            out[t, k] = (torch.nn.functional.silu(gate) * up) @ W2[e].T
        return out

    ref = loop()
    (ref * g.float()).sum().backward()
    ref_grads = [t.grad.clone() for t in (x, experts.gate_up_proj, experts.down_proj)]
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    kernels = ["padded_bmm", "gathered"] + (["grouped_mm"] if moe.grouped_mm_runs(x.device, dtype) else [])
    for kernel in kernels:
        runs = []
        for _ in range(2):
            for t in (x, experts.gate_up_proj, experts.down_proj):
                t.grad = None
            orig = moe.pick_kernel
            moe.pick_kernel = lambda *a, k=kernel: k  # type: ignore[assignment]
            try:
                y = experts(x, choice)
            finally:
                moe.pick_kernel = orig
            y.backward(g)
            runs.append([y.detach().clone()] + [t.grad.clone() for t in (x, experts.gate_up_proj, experts.down_proj)])
        for a, b in zip(*runs):
            assert torch.equal(a, b), kernel  # bit-stable
        torch.testing.assert_close(runs[0][0].float(), ref, **tol)
        for got, want in zip(runs[0][1:], ref_grads):
            torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", NAMES)
def test_bf16_on_cuda_is_as_close_to_fp64_as_transformers(tiny, name):
    """On CUDA in bf16 (grouped_mm experts), zoo's packed logits are at least as close to an fp64 run of the same
    weights as transformers' bf16 logits per document (router ties aside: tiny weights far from ties)."""
    from transformers import AutoModelForCausalLM

    _, path = tiny[name]
    docs = _docs()
    packed = zoo.pack(docs).to("cuda")
    ref = zoo.load(path, attn="eager", dtype=torch.float64, device="cuda")
    model = zoo.load(path, attn="sdpa", dtype=torch.bfloat16, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        want, got = ref(packed), model(packed).double()
        theirs = torch.cat([hf(d[None].cuda()).logits[0] for d in docs]).double()
    ours_err, theirs_err = (got - want).norm() / want.norm(), (theirs - want).norm() / want.norm()
    assert ours_err <= 1.05 * theirs_err + 1e-4, (ours_err.item(), theirs_err.item())


# ---- converters, export, generation ----

MAX_NEW = 10


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bit_exact_and_transformers_generates_with_the_export(tiny, tmp_path, name):
    """hf_to_zoo then zoo_to_hf: every per-expert tensor with its bits; transformers loads the export as its own
    class (no missing or unexpected keys) with the original's logits, and greedy tokens equal zoo's."""
    import transformers
    from safetensors.torch import load_file

    from zoo.generate import generate

    hf, src = tiny[name]
    _, again = convert_round_trip(src, tmp_path, hf.config.model_type, getattr(transformers, CLASSES[name]))
    stacked = load_file(tmp_path / "zoo" / "model.safetensors")
    assert stacked["layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert type(again).__name__ == CLASSES[name]
    again.eval()
    ids = _docs([23])[0]
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None]).logits, hf(ids[None]).logits, atol=0, rtol=0)

    model = zoo.load(tmp_path / "zoo", attn="sdpa")
    prompts = _docs([7, 1, 12], seed=5)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=MAX_NEW, stop=[])):
        assert tokens.tolist() == hf_greedy(hf, prompt, MAX_NEW), (name, len(prompt))


def test_compiled_greedy_decoding_equals_eager(tiny, monkeypatch):
    """generate(compile=True) compiles the decode step whole (fullgraph): the experts take a path with static
    shapes there (grouped_mm in bf16, else each row's gathered expert weights), so it traces, and its tokens are
    eager decoding's. aot_eager: the same graph, without inductor's minutes on a CPU."""
    import importlib

    from zoo.generate import generate

    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    model = zoo.load(tiny["mixtral"][1], attn="sdpa")
    prompts = _docs([7, 1, 12], seed=5)
    eager = generate(model, prompts, max_new_tokens=6, stop=[])
    assert [t.tolist() for t in generate(model, prompts, max_new_tokens=6, stop=[], compile=True)] == \
        [t.tolist() for t in eager]


# ---- LoRA ----


def test_lora_auto_adapts_attention_and_leaves_experts_frozen(tiny):
    from zoo.train.lora import LoRAConfig, apply_lora

    model = zoo.load(tiny["qwen3_moe"][1], attn="eager")
    wrapped = apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=("auto",)), seed=1)
    assert wrapped == [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    loss = model.loss(zoo.pack(_docs([9, 12])), aux_loss_coef=0.01)
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "experts" in n or "router" in n)


def test_all_linear_lora_leaves_routers_alone_and_peft_loads_the_adapter(tiny, tmp_path):
    """all-linear on Qwen2-MoE adapts attention and the shared expert, not the router (transformers' router is no
    nn.Linear: PEFT could not hold an adapter there), the stacked experts, nor (at rank 4) the shared expert's gate,
    a 1-output layer; after two steps the adapter export_adapter writes loads in PEFT over transformers' model with
    zoo's logits. At rank 1 the gate is adapted too."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen2MoeForCausalLM

    from zoo.train.lora import LoRAConfig, apply_lora

    _, path = tiny["qwen2_moe"]
    model = zoo.load(path, attn="eager")
    lora = LoRAConfig(rank=4, alpha=8, targets=("all-linear",))
    wrapped = apply_lora(model, lora, seed=1)
    assert not any("router" in w or "experts" in w for w in wrapped)
    assert "layers.0.mlp.shared_expert_gate" not in wrapped and "layers.0.mlp.shared_expert.up_proj" in wrapped
    rank1 = apply_lora(zoo.load(path, attn="eager"), LoRAConfig(rank=1, alpha=8, targets=("all-linear",)), seed=1)
    assert "layers.0.mlp.shared_expert_gate" in rank1 and not any("router" in w for w in rank1)
    docs = _docs([20, 13, 27])
    packed = zoo.pack(docs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(2):
        opt.zero_grad()
        model.loss(packed, aux_loss_coef=0.01).backward()
        opt.step()
    _, out = export_lora(model, lora, path, tmp_path)
    hf = peft.PeftModel.from_pretrained(Qwen2MoeForCausalLM.from_pretrained(path, attn_implementation="eager"), out)
    hf.eval()
    model.eval()
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        mine = model(packed)
        for i, doc in enumerate(docs):
            assert (mine[cu[i]:cu[i + 1]] - hf(input_ids=doc[None]).logits[0]).abs().max() < 1e-5, i


# ---- sequence parallel ----


def _sp_model():
    """Qwen3-MoE-shaped: 8 query heads over 2 KV heads, 6 experts of 32 (top 2), the second layer dense."""
    from zoo.models.decoder import Decoder
    from zoo.models.qwen3_moe import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                         n_experts=6, top_k=2, expert_ffn_dim=32, norm_topk_prob=True, mlp_only_layers=(1,))
    return _sp_worker._build(Decoder, cfg)


def _sp_model_balanced():
    """_sp_model whose loss adds the per-document balancing loss and the router z-loss: each shard holds pieces of
    documents, so its statistics must be summed with the other shards' (Packed.sum_over_parts)."""
    import functools

    model = _sp_model()
    model.loss = functools.partial(type(model).loss, model, aux_loss_coef=0.5, aux_loss="per-document",
                                   z_loss_coef=0.1)
    return model


def test_sequence_parallel_equals_one_process(tmp_path):
    """Ulysses, ring and hybrid at 2 and 4 ranks: the loss with every balancing term (documents across shards, so
    the routing statistics are summed over the shards) and every gradient equal one process."""
    _sp_worker.check_model(tmp_path, _sp_model_balanced)


def test_expert_parallel_equals_one_process(tmp_path):
    """Experts spread over 2 and 4 processes (data parallel, and data x sequence parallel with the expert groups
    inside or across the sequence-parallel ones; a GPT-OSS-shaped model's, biases and all, over data parallel; a
    DeepSeek-V3-shaped one's, MLA over the sigmoid group-limited router, over data x sequence parallel): the
    summed loss with the balancing term and every gradient (each expert's gathered whole) equal one process over all
    the packs."""
    import json

    import _ep_worker

    out = tmp_path / "report.json"
    _sp_worker.launch(_ep_worker.main, 4, out)
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"][1]
    assert sorted(report) == ["deepseek_v3 ep2/dp2xsp2", "ep2/dp2", "ep2/dp2xsp2", "ep4/dp2xsp2",
                              "gpt_oss ep2/dp2"], report
    failures = [f"{c}: {ok_detail[1]}" for c, ok_detail in report.items() if not ok_detail[0]]
    assert not failures, "\n".join(failures)


def test_expert_parallel_refuses_what_does_not_divide():
    from zoo.parallel.expert import ExpertParallel

    class Mesh:  # what ExpertParallel reads of a mesh: a 1-D group of 3
        ndim = 1

        def get_group(self):
            return None

        def size(self):
            return 3

        def get_local_rank(self):
            return 0

    with pytest.raises(zoo.ZooError,
                       match=r"--ep 3 must divide the number of experts \(4\); choose one of \[1, 2, 4\]"):
        ExpertParallel(Mesh()).apply(_meta_moe(n_experts=4))
    with pytest.raises(zoo.ZooError, match="spreads the experts of a Mixture-of-Experts model; this model has no"):
        ExpertParallel(Mesh()).apply(zoo.load("debug", device="meta"))


def _meta_moe(**changes):
    from zoo.models.decoder import Decoder
    from zoo.models.qwen3_moe import Qwen3MoeConfig

    with torch.device("meta"):
        return Decoder(Qwen3MoeConfig(**{**dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                                               vocab_size=128, n_experts=8, top_k=2, expert_ffn_dim=32), **changes}))


# ---- presets ----


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_presets_build_moe_blocks_on_meta(name):
    model = zoo.load(name, device="meta")
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers)


# ---- recipes ----


def _pretrain(out: Path, base: Path, *extra: str) -> list[float]:
    from recipes import pretrain

    return pretrain.main(["--model", str(base), "--steps", "2", "--seq-len", "64", "--batch-tokens", "128",
                          "--no-progress", "--device", "cpu", "--save-every", "0", "--out", str(out), *extra])



def test_pretrain_balances_logs_the_load_and_exports_what_transformers_loads(tmp_path):
    """recipes.pretrain from a Hugging Face Qwen3-MoE directory trains with the checkpoint's router_aux_loss_coef:
    the first step's loss is the CE plus that coefficient times the logged aux_loss (the same first step with
    --aux-loss-coef 0 gives the CE alone); metrics.jsonl has the balance, z-loss and expert load columns, and
    aux_loss.png is drawn; OUT/model-hf loads as Qwen3MoeForCausalLM with OUT/model's logits. A dense model refuses
    a balancing option in one line."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    from recipes.data.tokenizer_choice import ASSETS
    from recipes.engine.metrics import read_rows

    hf = save_moe("qwen3_moe", tmp_path / "base", seed=8, vocab_size=2048)
    coef = hf.config.router_aux_loss_coef
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, tmp_path / "base" / f)
    balanced = _pretrain(tmp_path / "a", tmp_path / "base", "--export-hf", "--router-z-loss", "0.01")
    plain = _pretrain(tmp_path / "b", tmp_path / "base", "--aux-loss-coef", "0")
    rows = read_rows(tmp_path / "a" / "metrics.jsonl")
    assert len(rows) == 2 and (tmp_path / "a" / "aux_loss.png").is_file()
    for r in rows:
        assert r["aux_loss"] >= 1.9 and r["z_loss"] > 0 and r["expert_load_max"] >= 1.0 >= r["expert_load_min"] >= 0
    assert abs(balanced[0] - (plain[0] + coef * rows[0]["aux_loss"] + 0.01 * rows[0]["z_loss"])) < 1e-5
    assert read_rows(tmp_path / "b" / "metrics.jsonl")[0]["aux_loss"] == rows[0]["aux_loss"]

    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "model-hf", dtype=torch.float32,
                                                       output_loading_info=True, attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(again) is Qwen3MoeForCausalLM
    trained = zoo.load(tmp_path / "a" / "model").eval()
    ids = torch.randint(0, 2048, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(trained(zoo.pack([ids])), again(ids[None]).logits[0], atol=1e-5, rtol=0)

    with pytest.raises(zoo.ZooError, match="--router-z-loss balances the experts .* this model has no MoE layers"):
        _pretrain(tmp_path / "c", Path("debug"), "--router-z-loss", "0.1")


def test_flops_count_the_experts_a_token_runs():
    """MFU's matmul parameters of Qwen3-30B-A3B: its published per-token count (list_presets' active_params) less
    the embedding and the norms, which multiply nothing: 3.04e9 of 30.5e9."""
    from zoo.models.presets import list_presets
    from zoo.train.flops import matmul_params

    row = next(r for r in list_presets() if r["name"] == "qwen3-30b-a3b")
    assert (row["params"], row["active_params"]) == (30_532_122_624, 3_353_032_704)
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    assert matmul_params(zoo.load("qwen3-30b-a3b", device="meta")) == row["active_params"] - 151936 * 2048 - norms
    assert "active_params" not in next(r for r in list_presets() if r["name"] == "qwen3-8b")


def test_pretrain_with_expert_parallel_equals_one_process_and_resumes_across_ep(tmp_path):
    """recipes.pretrain on a Qwen3-MoE with --ep 2 over 2 processes (data parallel 2) takes the steps of one process
    (loss with the balancing term, gradient norm, exported weights); its step-2 checkpoint resumes with --ep 1 (the
    experts' DTensors resharded by DCP) and still ends on the uninterrupted run's weights."""
    import shutil
    import subprocess

    from test_recipes import ROOT, assert_same_weights, env, grad_norms, losses

    from recipes import pretrain
    from recipes.data.tokenizer_choice import ASSETS

    save_moe("qwen3_moe", tmp_path / "base", seed=3, vocab_size=2048)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, tmp_path / "base" / f)
    args = ["--model", str(tmp_path / "base"), "--steps", "4", "--save-every", "2", "--seq-len", "64",
            "--batch-tokens", "256", "--no-progress", "--device", "cpu"]
    whole = tmp_path / "whole"
    pretrain.main([*args, "--out", str(whole)])

    def torchrun(out, *extra):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "-m", "recipes.pretrain", *args, "--out", str(out), *extra], cwd=ROOT, env=env(),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    ep = tmp_path / "ep2"
    torchrun(ep, "--ep", "2")
    assert losses(ep) == pytest.approx(losses(whole), abs=2e-5)
    assert grad_norms(ep) == pytest.approx(grad_norms(whole), rel=1e-4)
    assert_same_weights(ep, whole)

    shutil.rmtree(ep / "checkpoints" / "step_00000004")
    shutil.rmtree(ep / "model")
    torchrun(ep, "--ep", "1", "--resume")
    assert losses(ep) == pytest.approx(losses(whole), abs=2e-5)
    assert_same_weights(ep, whole)


def test_ep_that_does_not_divide_the_processes_is_refused():
    from recipes import pretrain

    with pytest.raises(zoo.ZooError, match=r"--ep 2 must divide the 1 processes started"):
        pretrain.main(["--ep", "2", "--steps", "1", "--device", "cpu"])


def test_router_bias_moves_the_choice_not_the_weights():
    from zoo.core.moe import route

    probs = torch.tensor([[0.5, 0.3, 0.2]])
    logits = probs.log()
    weights, experts = route(logits, 1, False, torch.tensor([0.0, 0.0, 0.4]))
    assert experts.tolist() == [[2]] and torch.allclose(weights, torch.tensor([[0.2]]))
    weights, experts = route(logits, 2, True, torch.tensor([0.0, 0.0, 0.4]))
    assert experts.tolist() == [[2, 0]] and torch.allclose(weights, torch.tensor([[0.2 / 0.7, 0.5 / 0.7]]))


def test_aux_loss_free_balancing_trains_keeps_and_resumes_its_biases(tmp_path):
    """--router-bias-update-rate: after each step every bias moved by the rate toward an even load (so each is a
    multiple of it); OUT/model keeps them (its config says router_bias) and zoo.load gives the trained model's
    logits; a run resumed from its step-2 checkpoint equals the uninterrupted one (the biases are in the
    checkpoint); --export-hf is refused in one line before any step."""
    import shutil

    from recipes.data.tokenizer_choice import ASSETS
    from zoo.core.moe import moe_layers

    save_moe("qwen3_moe", tmp_path / "base", seed=5, vocab_size=2048)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, tmp_path / "base" / f)
    extra = ["--router-bias-update-rate", "0.01", "--aux-loss-coef", "0", "--steps", "4", "--save-every", "2"]
    whole = _pretrain(tmp_path / "whole", tmp_path / "base", *extra)
    model = zoo.load(tmp_path / "whole" / "model")
    assert model.config.router_bias
    biases = [layer.router_bias for layer in moe_layers(model)]
    assert biases and all(b.abs().sum() > 0 for b in biases)
    for b in biases:
        steps = b / 0.01
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 4

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    shutil.rmtree(resumed / "model")
    again = _pretrain(resumed, tmp_path / "base", *extra, "--resume")
    assert again == whole[2:]
    for a, b in zip(moe_layers(zoo.load(resumed / "model")), moe_layers(model)):
        assert torch.equal(a.router_bias, b.router_bias)

    with pytest.raises(zoo.ZooError, match="--router-bias-update-rate trains per-expert router biases, which "
                                           "transformers' class of qwen3_moe cannot hold"):
        _pretrain(tmp_path / "hf", tmp_path / "base", *extra, "--export-hf")
    assert not (tmp_path / "hf" / "metrics.jsonl").exists()
