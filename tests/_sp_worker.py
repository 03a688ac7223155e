"""Spawned-process side of tests/test_parallel.py: every mode and model at one world size, in one process group.

Each rank runs every case; rank 0 writes {case: [ok, detail]} as JSON for the test to assert on. A case compares
the SP loss (summed over ranks) and the SP gradients (all-reduced SUM) with one process on the global pack.
`spawned`, `reference`, `sp_run` and `against` are shared with the LLaVA worker (tests/_llava_sp_worker.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

import zoo
from zoo.core.layers import init_weights
from zoo.models.llama import Llama, LlamaConfig
from zoo.parallel import SequenceParallel

LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4

# documents crossing shard boundaries, a 1-token document, documents shorter than N, one longer than any shard;
# 61 tokens: not divisible by 2, 3 or 4
DOC_LENS = [1, 23, 5, 2, 30]


def _docs(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _build(model_cls, cfg, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_cls(cfg, attn="sdpa")
    model = model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    return model


def llama(n_heads, n_kv_heads):
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=16, ffn_dim=96,
                      vocab_size=128, rope_theta=10000.0)
    return _build(Llama, cfg)


def modded(sinks=True, softcap=1.5, window=7, n_heads=4, n_kv_heads=2, seed=0):
    """A tiny Llama whose attention has the score modifiers: sinks (non-zero, N(0, 0.1)), a softcap that binds
    (scores of the tiny model reach past it) and a window shorter than the documents (zoo.core.score_mods)."""
    cfg = ModdedConfig(dim=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=16, ffn_dim=96,
                       vocab_size=128, rope_theta=10000.0, sinks=sinks, softcap=softcap, window=window)
    model = _build(Llama, cfg, seed)
    with torch.no_grad():  # bigger q/k so the cap saturates: tanh(s / cap) far from linear
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(4.0)
    return model


@dataclasses.dataclass(frozen=True)
class ModdedConfig(LlamaConfig):
    sinks: bool = False
    softcap: float | None = None
    window: int | None = None

    def decoder_spec(self):
        spec = super().decoder_spec()
        mixer = dict(sinks=self.sinks, softcap=self.softcap, window=self.window)
        layers = tuple(dataclasses.replace(lay, mixer=dataclasses.replace(lay.mixer, **mixer)) for lay in spec.layers)
        return dataclasses.replace(spec, layers=layers)


def gemma2():
    """Gemma 2's tiny shape: 4 query heads over 2 KV heads, a window of 4 on the first layer (shorter than the
    documents that cross the shards), both soft-caps binding (scores 0.5, logits 1.5), every norm off its init."""
    from zoo.models.decoder import Decoder
    from zoo.models.gemma2 import Gemma2Config

    cfg = Gemma2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                       rope_theta=100.0, sliding_window=4, query_pre_attn_scalar=20, attn_softcap=0.5,
                       final_softcap=1.5, max_seq_len=256)
    model = _build(Decoder, cfg)
    g = torch.Generator().manual_seed(100)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def gpt_oss():
    """GPT-OSS's tiny shape: sinks on every layer, a window of 4 on the sliding layers (shorter than the documents
    that cross the shards), YaRN, the router's linear bias and the experts' biases, the SwiGLU's clamp binding."""
    from zoo.models.decoder import Decoder
    from zoo.models.gpt_oss import GptOssConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16}
    cfg = GptOssConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, rope_theta=100.0,
                       rope_scaling=yarn, max_seq_len=256, sliding_window=4, n_experts=4, top_k=2,
                       expert_ffn_dim=32, swiglu_limit=0.6)
    model = _build(Decoder, cfg)
    g = torch.Generator().manual_seed(101)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 or "bias" in n:  # sinks, biases and norms off their init
                p.copy_(0.5 * torch.randn(p.shape, generator=g) + (1.0 if "norm" in n else 0.0))
    return model


def glm4_moe():
    """GLM-4.5's tiny shape: partial rotary, q/k/v bias, q/k norms, a dense first layer, then DeepSeek-V3's router
    (sigmoid scores, a non-zero correction bias, 8 experts in 4 groups of which the best 2 are kept, scaling 2.5) and
    an ungated shared expert."""
    from zoo.models.decoder import Decoder
    from zoo.models.glm4_moe import Glm4MoeConfig

    cfg = Glm4MoeConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                        rotary_dim=8, attention_bias=True, qk_norm=True, n_experts=8, top_k=2, expert_ffn_dim=32,
                        routed_scaling=2.5, n_group=4, topk_group=2, first_dense=1, max_seq_len=256)
    model = _build(Decoder, cfg)
    with torch.no_grad():
        for layer in model.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.normal_(0.0, 0.5)
                layer.mlp.router_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    return model


def internlm2():
    from zoo.models.internlm2 import InternLM2, InternLM2Config

    # max_seq_len tiny so the dynamic NTK rescale is active on the 30- and 23-token documents
    cfg = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128,
                          rope_scaling={"type": "dynamic", "factor": 2.0}, max_seq_len=8)
    return _build(InternLM2, cfg)


def openelm():
    from zoo.models.openelm import OpenELM, OpenELMConfig

    cfg = OpenELMConfig(dim=64, n_layers=2, head_dim=16, n_heads=(4, 8), n_kv_heads=(2, 4), ffn_dim=(96, 128),
                        qkv_multipliers=(), ffn_multipliers=(), vocab_size=128)
    return _build(OpenELM, cfg)


def launch(main, world: int, out_path, *args) -> None:
    """Run `main(rank, world, port, out_path, *args)` on `world` processes and wait for them (torch's mp.spawn with
    a free port). The processes are forked from a fork server that imported torch and zoo once: a spawned process
    imports them again, ~3 s of CPU each, which made process start-up most of the suite's multi-process time."""
    import multiprocessing
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # read when the server starts, at the session's first launch; it holds no threads, so forking it is safe.
    # torch._dynamo: zoo's backends are run_eagerly (torch._disable_dynamo), which imports it at their first call,
    # ~3 s of CPU in every spawned process otherwise
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zoo", "transformers",
                                            "_sp_worker"])
    mp.start_processes(main, args=(world, port, str(out_path), *args), nprocs=world, join=True,
                       start_method="forkserver")


def spawned(body, rank: int, world: int, port: int, out_path: str) -> None:
    """Run `body() -> {case: [ok, detail]}` on every rank of a gloo group; rank 0 writes the results as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        results = body()
    except Exception:  # noqa: BLE001
        results["error"] = [False, traceback.format_exc()]
    finally:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.barrier()
        dist.destroy_process_group()


def reference(model, packed, **loss_kw):
    """(loss, {name: grad}) of one process on the global pack; frozen or unused parameters get zeros. `loss_kw`:
    model.loss's keywords (an MoE model's balancing terms)."""
    model.zero_grad(set_to_none=True)
    loss = model.loss(packed, **loss_kw)
    loss.backward()
    return loss.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for n, p in model.named_parameters()}


def sp_run(model, sp, packed, group=None, shard_first=False, **loss_kw):
    """(loss summed over the group, grads summed over it, this rank's shard) of the sequence-parallel run; the
    model's own attention function is back in place afterwards. `shard_first`: cut the pack before `sp.apply`
    (a shard holds nothing of the model: the model's target rule reaches it at the loss); `loss_kw` as
    `reference`'s."""
    backend = model.attend
    local = sp.shard(packed) if shard_first else None
    sp.apply(model)
    try:
        model.zero_grad(set_to_none=True)
        local = sp.shard(packed) if local is None else local
        loss = model.loss(local, **loss_kw)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=group)
            grads[n] = g
        return total, grads, local
    finally:
        model.set_attention(backend)


def against(ref, got, grad_atol: float = 0.0) -> list[str]:
    """What differs between one process (ref) and the summed SP run (got): the loss within LOSS_ATOL, each
    gradient within GRAD_RTOL relative (or `grad_atol` absolute, for gradients that are almost zero)."""
    (ref_loss, ref_grads), (loss, grads, _) = ref, got
    problems = []
    if not torch.allclose(loss, ref_loss, atol=LOSS_ATOL, rtol=0):
        problems.append(f"loss {loss.item():.8f} vs one process {ref_loss.item():.8f}")
    for n, g in ref_grads.items():
        rel = ((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item()
        if rel > GRAD_RTOL and (grads[n] - g).abs().max() > grad_atol:
            problems.append(f"grad {n} relative error {rel:.2e}")
    return problems


def compare(ref, got, packed, N):
    """`against`, plus: the shard sizes balance and the shard carries the global target count."""
    problems = against(ref, got)
    local, T = got[2], packed.num_tokens
    counts = torch.tensor([local.num_tokens])
    every = [torch.zeros_like(counts) for _ in range(N)]
    dist.all_gather(every, counts)
    every = [int(c) for c in every]
    if sum(every) != T or max(abs(c - T / N) for c in every) > 2:
        problems.append(f"tokens per rank {every} for T={T}, N={N} (want about {T / N:.1f} each)")
    if local.count_targets() != int((packed.labels != -100).sum()):
        problems.append("the shard's target count is not the global count")
    return problems


def cases(N):
    """(name, model factory, mode, ulysses_size) at world size N."""
    heads = {2: (4, 1), 3: (6, 2), 4: (8, 2)}[N]  # GQA with fewer KV heads than ranks
    out = [(f"llama-{m}", lambda: llama(*heads), m, 2) for m in ("ring", "ulysses")]
    if N == 4:
        out.append(("llama-hybrid", lambda: llama(*heads), "hybrid", 2))
    if N in (2, 4):
        for name, factory in (("internlm2", internlm2), ("openelm", openelm)):
            out += [(f"{name}-{m}", factory, m, 2) for m in ("ring", "ulysses")] + \
                ([(f"{name}-hybrid", factory, "hybrid", 2)] if N == 4 else [])
    else:
        out += [("internlm2-ring", internlm2, "ring", 2), ("openelm-ring", openelm, "ring", 2)]
    if N in (2, 4):  # sinks + softcap + window (ring: the math block kernel with the cap); sinks alone (ring: the
        # CPU flash block kernel, the sink after the merge); Ulysses: each member its heads' sinks
        out += [(f"mods-{m}", modded, m, 2) for m in ("ring", "ulysses") + (("hybrid",) if N == 4 else ())]
        out += [("sinks-ring", lambda: modded(softcap=None), "ring", 2)]
    if N in (2, 4):  # Gemma 2: both soft-caps (the loss's on each shard's rows), the window on alternate layers;
        # GPT-OSS: sinks and windows with its MoE block (router bias, expert biases, clamped SwiGLU)
        modes = ("ring", "ulysses") if N == 2 else ("ring", "hybrid")
        out += [(f"{name}-{m}", factory, m, 2) for name, factory in (("gemma2", gemma2), ("gpt_oss", gpt_oss),
                                                                     ("glm4_moe", glm4_moe)) for m in modes]
    return out


def errors(N):
    """Impossible configurations: each must raise ZooError with a helpful message."""
    out = {}

    def expect(name, fn, *words):
        try:
            fn()
        except zoo.ZooError as e:
            msg = str(e)
            missing = [w for w in words if w not in msg]
            out[name] = [not missing, msg if missing else ""]
        except Exception as e:  # noqa: BLE001
            out[name] = [False, f"raised {type(e).__name__}: {e}"]
        else:
            out[name] = [False, "no error"]

    if N == 3:
        def ulysses_heads():
            sp = SequenceParallel(mode="ulysses")
            model = sp.apply(llama(4, 2))
            model.loss(sp.shard(zoo.pack(_docs([20, 10], 128, 1))))
        expect("ulysses-heads-not-divisible", ulysses_heads, "ring", "hybrid")
        expect("hybrid-size-not-dividing", lambda: SequenceParallel(mode="hybrid", ulysses_size=2), "ulysses_size")
    expect("too-short", lambda: SequenceParallel(mode="ring").shard(zoo.pack(_docs([N], 128, 1))), "too short")
    expect("bad-mode", lambda: SequenceParallel(mode="rings"), "ring")
    sp = SequenceParallel(mode="ring")
    rank = dist.get_rank()
    expect("different-packs", lambda: sp.shard(zoo.pack(_docs([20, 10 + (rank == N - 1)], 128, 1))), "same global pack")
    expect("shard-twice", lambda: sp.shard(sp.shard(zoo.pack(_docs([20, 10], 128, 1)))), "already")

    def other_sp():
        model = SequenceParallel(mode="ring").apply(llama(4, 2))
        model.loss(sp.shard(zoo.pack(_docs([20, 10], 128, 1))))
    expect("sharded-by-another-sp", other_sp, "different SequenceParallel")

    def plain_model():  # a shard through a model no sp.apply wrapped would attend within its local pieces only
        llama(4, 2).loss(sp.shard(zoo.pack(_docs([20, 10], 128, 1))))
    expect("shard-through-an-unwrapped-model", plain_model, "sp.apply")
    return out


def main(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(lambda: every_case(world), rank, world, port, out_path)


def every_case(world: int) -> dict:
    results: dict[str, list[bool | str | None]] = {}  # case -> [passed (None: not run), what went wrong]
    have = {m: _has_module(m) for m in ("internlm2", "openelm")}
    packs = {"docs": zoo.pack(_docs(DOC_LENS, 128, 0)), "one-doc": zoo.pack(_docs([47], 128, 1))}
    for name, factory, mode, U in cases(world):
        family = name.split("-")[0]
        if family in have and not have[family]:
            results[name] = [None, f"zoo.models.{family} not available"]
            continue
        try:
            model = factory()
            sp = SequenceParallel(mode=mode, ulysses_size=U)
            for pack_name, packed in packs.items():
                if pack_name == "one-doc" and family != "llama":
                    continue
                problems = compare(reference(model, packed), sp_run(model, sp, packed), packed, world)
                results[f"{name}/{pack_name}"] = [not problems, "; ".join(problems)]
        except Exception:  # noqa: BLE001
            results[name] = [False, traceback.format_exc()]
    results.update({f"error/{k}": v for k, v in errors(world).items()})
    if world == 2:
        results["fsdp-bf16/ring"] = fsdp_bf16(world, packs["docs"])
    return results


def fsdp_bf16(world, packed):
    """SP (ring) under FSDP in bf16 through zoo.parallel.parallelize, FSDP's input cast on at the root: the Shard
    goes through the cast (rebuilt field by field, its plan and derived structures shared with the copy), and the
    loss summed over the ranks is one process's in bf16, up to bf16 rounding."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from zoo.parallel import Shard, parallelize

    try:
        model = llama(4, 1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = copy.deepcopy(model).loss(packed).float()
        sp = SequenceParallel(mode="ring")
        parallelize(model, init_device_mesh("cpu", (world,)), sp=sp, param_dtype=torch.bfloat16)
        local = sp.shard(packed)
        seen = []
        model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[3]))
        loss = model.loss(local)
        loss.backward()
        total = loss.detach().float()
        dist.all_reduce(total)
        problems = []
        copied = seen[0] if seen else None
        if not (isinstance(copied, Shard) and copied is not local and copied.plan is local.plan
                and copied.memo is local.memo and torch.equal(copied.input_ids, local.input_ids)):
            problems.append(f"the first block got {type(copied).__name__}, not the root's cast copy of the shard")
        if not torch.allclose(total, want, atol=1e-2, rtol=0):
            problems.append(f"loss {total.item():.5f} vs one process in bf16 {want.item():.5f}")
        return [not problems, "; ".join(problems)]
    except Exception:  # noqa: BLE001
        return [False, traceback.format_exc()]


def _has_module(family):
    import importlib.util

    return importlib.util.find_spec(f"zoo.models.{family}") is not None


def main_dp_by_sp(rank: int, world: int, port: int, out_path: str) -> None:
    """8 ranks as 2 data-parallel replicas x hybrid SP over 4 (ulysses 2 x ring 2), each replica its own pack:
    the replicas' SP subgroups are created without each other."""
    spawned(lambda: dp_by_sp(rank, world), rank, world, port, out_path)


def dp_by_sp(rank: int, world: int) -> dict:
    sp_groups = [dist.new_group(list(range(r, r + 4))) for r in range(0, world, 4)]
    replica = rank // 4
    group = sp_groups[replica]
    model = llama(8, 2)
    packed = zoo.pack(_docs(DOC_LENS if replica == 0 else [7, 40, 3, 12], 128, replica))
    ref = reference(model, packed)
    problems = against(ref, sp_run(model, SequenceParallel(group, mode="hybrid", ulysses_size=2), packed, group))
    flags = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([float(bool(problems))]))
    return {f"replica{replica}-rank{rank}": [not problems, "; ".join(problems)],
            "all-ranks": [not any(f.item() for f in flags), f"ranks with problems: {[int(f) for f in flags]}"]}


# ---- sliding-window attention through the sequence-parallel wrapper (tests/test_window.py) ----

WINDOW_LENS = [1, 23, 5, 2, 30]  # as DOC_LENS: documents longer than any shard, cut by every window below
WINDOWS = (1, 4, 9)


def main_window(rank: int, world: int, port: int, out_path: str) -> None:
    """One launch for every group size: ranks 0..n-1 form the group of n, for n = 2 .. world."""
    spawned(lambda: window_groups(rank, world), rank, world, port, out_path)


def window_groups(rank: int, world: int) -> dict:
    results = {}
    for n in range(world, 1, -1):  # the whole world first: hybrid's subgroups before any group of fewer ranks
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))  # every rank creates it
        if rank < n:
            results.update({f"{n}/{k}": v for k, v in window_cases(n, group).items()})
        dist.barrier()
    return results


def window_cases(world: int, group=None) -> dict:
    """Ring, Ulysses and (at 4 ranks) hybrid attention with each window: output and q/k/v gradients, gathered
    over the ranks, against eager on the global pack in one process; with window 1 the ring never turns."""
    from zoo.core.attention import BACKENDS
    from zoo.parallel.sequence import SequenceParallelAttention

    N, K, H = {2: 4, 3: 6, 4: 8}[world], 2, 8
    packed = zoo.pack(_docs(WINDOW_LENS, 128, 0))
    T = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(T, n, H, generator=g) for n in (N, K, K, N))
    # one SequenceParallel per mode: hybrid creates its subgroups once
    modes = {m: SequenceParallel(group, mode=m, ulysses_size=2) for m in ("ring", "ulysses", "hybrid")
             if m != "hybrid" or world == 4}
    results = {}
    for window in WINDOWS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = BACKENDS["eager"](*leaves, packed, window=window)
        want_grads = torch.autograd.grad(want, leaves, do)
        for mode, sp in modes.items():
            name = f"{mode}/window{window}"
            try:
                local = sp.shard(packed)
                idx = local.index
                mine = [t[idx].clone().requires_grad_() for t in (q, k, v)]
                out = SequenceParallelAttention(sp, BACKENDS["sdpa"])(mine[0], mine[1], mine[2], local, window=window)
                grads = torch.autograd.grad(out, mine, do[idx])
                problems = []
                for what, got_local, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
                    got = torch.zeros_like(ref)
                    got[idx] = got_local
                    dist.all_reduce(got, group=group)
                    err = (got - ref).abs().max().item()
                    if err > 1e-5:
                        problems.append(f"{what} differs from one process by {err:.2e}")
                ring = local.plan.ring
                if ring is not None and window == 1 and ring.last_step(1) != 0:  # a token sees itself alone
                    problems.append(f"window 1: the ring turned {ring.last_step(1)} steps, not 0")
                results[name] = [not problems, "; ".join(problems)]
            except Exception:  # noqa: BLE001
                results[name] = [False, traceback.format_exc()]
    return results


# ---- Qwen2/Qwen3/Mistral (tests/test_qwen_mistral.py): SP groups of 2, 3 and 4 inside one spawn of 4 ranks ----

FAMILY_SP_SIZES = (2, 3, 4)


def _family_models() -> dict:
    """Windowed Mistral (window 4 on every layer), Qwen3 (q/k norms) without and with per-layer windows. 12 query
    heads over 2 KV heads (Ulysses splits them over 2, 3 or 4 ranks, KV heads repeated up to lcm(2, U)), head_dim 16
    (not 64 / 12); every parameter random, norm scales and biases included."""
    from zoo.models.decoder import Decoder
    from zoo.models.mistral import MistralConfig
    from zoo.models.qwen3 import Qwen3Config

    shape: dict[str, Any] = dict(dim=64, n_heads=12, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128)
    configs = {
        "mistral-window4": MistralConfig(n_layers=2, sliding_window=4, **shape),
        "qwen3": Qwen3Config(n_layers=2, **shape),
        "qwen3-window3": Qwen3Config(n_layers=3, sliding_window=3, tie_embeddings=True,
                                     layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                                     **shape),
    }
    models = {}
    for i, (name, cfg) in enumerate(configs.items()):
        model = _build(Decoder, cfg, seed=i)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        models[name] = model
    return models


def _family_modes(size: int) -> list[str]:
    return ["ring", "ulysses"] + (["hybrid"] if size == 4 else [])


def family_case_names(size: int) -> list[str]:
    """The report's keys for the SP group of `size` ranks."""
    return [f"sp{size}/{model}/{mode}" for model in ("mistral-window4", "qwen3", "qwen3-window3")
            for mode in _family_modes(size)]


def main_families(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(lambda: family_cases(rank), rank, world, port, out_path)


def family_cases(rank: int) -> dict:
    """Each model's loss and gradients under ring, Ulysses (and hybrid at 4) SP over the first 2, 3 and 4 ranks,
    against one process on the global pack (documents longer than every window, cut across the shards)."""
    # the SP group of each size is the first ranks; the rest get a group of their own too, so that every rank holds
    # the same number of groups when hybrid creates its subgroups (use_local_synchronization: torch names a subgroup
    # from its ranks and how many groups the creating rank already has, and members must agree on the name)
    groups = {}
    for size in FAMILY_SP_SIZES:
        for ranks in (list(range(size)), list(range(size, dist.get_world_size()))):
            if ranks:
                group = dist.new_group(ranks)  # every rank creates every group (the default synchronization)
                if rank in ranks and len(ranks) == size:
                    groups[size] = group
    packed = zoo.pack(_docs(DOC_LENS, 128, 0))
    results = {}
    for name, model in _family_models().items():
        ref = reference(model, packed)
        for size, group in groups.items():
            if rank >= size:  # ranks 2 and 3 of a size-2 group sit out: the report is rank 0's
                continue
            for mode in _family_modes(size):
                case = f"sp{size}/{name}/{mode}"
                try:
                    sp = SequenceParallel(group, mode=mode, ulysses_size=2)
                    results[case] = [not (problems := against(ref, sp_run(model, sp, packed, group))),
                                     "; ".join(problems)]
                except Exception:  # noqa: BLE001
                    results[case] = [False, traceback.format_exc()]
    return results


# ---- one family's model under every SP mode (tests/test_gemma3.py, tests/test_olmo2.py) ----

MODEL_SP_SIZES = (2, 4)


def model_modes(size: int) -> list[str]:
    return ["ring", "ulysses"] + (["hybrid"] if size == 4 else [])


def model_cases(rank: int, build) -> dict:
    """`build()`'s model on DOC_LENS, each SP size and mode against one process (every rank creates every group, in
    the same order)."""
    import traceback

    import torch.distributed as dist

    import zoo
    from zoo.parallel import SequenceParallel

    groups = {}
    for size in MODEL_SP_SIZES:
        for ranks in (list(range(size)), list(range(size, dist.get_world_size()))):
            if ranks:
                group = dist.new_group(ranks)
                if rank in ranks and len(ranks) == size:
                    groups[size] = group
    packed = zoo.pack(_docs(DOC_LENS, 128, 0))
    model = build()
    ref = reference(model, packed)
    results = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        for mode in model_modes(size):
            case = f"sp{size}/{mode}"
            try:
                sp = SequenceParallel(group, mode=mode, ulysses_size=2)
                problems = against(ref, sp_run(model, sp, packed, group))
                results[case] = [not problems, "; ".join(problems)]
            except Exception:  # noqa: BLE001
                results[case] = [False, traceback.format_exc()]
    return results


def model_main(rank: int, world: int, port: int, out_path: str, build) -> None:
    spawned(lambda: model_cases(rank, build), rank, world, port, out_path)


def check_model(tmp_path, build) -> None:
    """Spawn 4 ranks running `model_cases` for `build` (a module-level function: it is pickled by name) and assert
    every case matched one process."""
    import json

    out = tmp_path / "report.json"
    launch(model_main, 4, out, build)
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"][1]
    expected = [f"sp{size}/{mode}" for size in MODEL_SP_SIZES for mode in model_modes(size)]
    assert sorted(report) == sorted(expected), report
    failures = [f"{c}: {report[c][1]}" for c in expected if not report[c][0]]
    assert not failures, "\n".join(failures)
