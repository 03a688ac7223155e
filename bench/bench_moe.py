"""Mixture-of-Experts: one MoE layer, and one training step of a small Qwen3-MoE, zoo against transformers, on the
same weights and tokens (CPU or CUDA); with --arch gpt_oss, one GPT-OSS MoE layer (router bias, top-k softmax,
experts with biases and the clamped SwiGLU) against transformers' GptOssMLP (no step).

Layer (forward + backward of the sparse MLP alone, router included, on T tokens):
  zoo              zoo.core.moe.MoE, its kernel chosen by capability (grouped_mm where it runs, else padded_bmm)
  zoo_padded       zoo's padded batched-GEMM path, forced
  hf_eager         transformers' Qwen3MoeSparseMoeBlock, experts_implementation "eager" (a loop over experts)
  hf_grouped_mm    the same, experts_implementation "grouped_mm"
  hf_batched_mm    the same, "batched_mm" (gathers every token's expert weights: memory-bound; --with-batched)
  (--shape ds-small / v3: a DeepSeek-V3-shaped layer, zoo's sigmoid group-limited router with its correction bias,
  8 groups of which 4 are kept, routed scaling 2.5 and one ungated shared expert, against transformers'
  DeepseekV3MoE; the step is then skipped)
Step (forward, backward, AdamW) of a Qwen3-MoE (CPU: 4 small layers; CUDA: 2 layers of Qwen3-30B-A3B) on a pack of
log-normal documents:
  zoo              zoo sharing transformers' weights (attn auto), model.loss(packed, aux_loss_coef=coef)
  zoo_compiled     the same, every block torch.compile'd (CUDA only)
  hf_*             transformers on the same stream with position_ids restarting per document, labels and
                   output_router_logits (its loss then holds the same balancing term), experts as named
Before timing, each variant's output is checked against zoo's (the layer: outputs and input gradients; the step:
the loss). Medians of alternating runs (CUDA events on a GPU); peak memory: torch.cuda.max_memory_allocated on a
GPU, peak RSS growth in a fresh process on CPU.

    python bench/bench_moe.py [--device cpu|cuda] [--shape small|30b|ds-small|v3] [--tokens N] [--reps 5]
    python bench/bench_moe.py --arch gpt_oss [--shape gpt-oss-20b|gpt-oss-20b-half|gpt-oss-20b-8e|gpt-oss-tiny]
                              [--tokens N]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import memory_in_fresh_processes, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402
from zoo.core import moe  # noqa: E402

# (dim, experts, expert width, top-k): "30b" is one layer of Qwen3-30B-A3B; "small" fits a CPU
SHAPES = {"small": (512, 32, 256, 4), "30b": (2048, 128, 768, 8),
          # DeepSeek-V3's router and shared expert: "v3" is one of its MoE layers, "ds-small" scaled to a CPU
          "ds-small": (512, 64, 128, 8), "v3": (7168, 256, 2048, 8),
          # one layer of gpt-oss-20b, and the same at half the width (its weights fit a CPU's memory four times over)
          "gpt-oss-20b": (2880, 32, 2880, 4), "gpt-oss-20b-half": (1440, 32, 1440, 4),
          # gpt-oss-20b's widths with 8 of its 32 experts (each token's work unchanged; a quarter of the weights)
          "gpt-oss-20b-8e": (2880, 8, 2880, 4),
          "gpt-oss-tiny": (256, 32, 256, 4)}  # --smoke's
DEEPSEEK = {"ds-small", "v3"}
# the step's model: small on CPU; on CUDA two layers of Qwen3-30B-A3B (its attention and 128 experts of 768)
STEP_SHAPES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=512, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                  vocab_size=8000, norm_topk_prob=True),
    "30b": dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                vocab_size=32000, norm_topk_prob=True),
}
LAYER_VARIANTS = ["zoo", "zoo_padded", "hf_eager", "hf_grouped_mm"]
STEP_VARIANTS = ["zoo", "hf_eager", "hf_grouped_mm"]


def hf_layer(shape: str, device: str, dtype: torch.dtype, impl: str):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    D, E, F, k = SHAPES[shape]
    if shape in DEEPSEEK:
        cfg = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, moe_intermediate_size=F,
                                            num_experts_per_tok=k, n_group=8, topk_group=4, n_shared_experts=1,
                                            routed_scaling_factor=2.5, norm_topk_prob=True)
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=D, num_experts=E, moe_intermediate_size=F,
                                          num_experts_per_tok=k, norm_topk_prob=True)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    block = DeepseekV3MoE(cfg) if shape in DEEPSEEK else Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02 if p.dim() == 3 or p.shape[0] != E else 0.5)
        for b in block.buffers():  # the correction bias: the scores' spread, so it moves choices
            b.copy_(torch.rand(b.shape) * 0.1)
    return block.to(device, dtype)


def zoo_layer_sharing(block) -> moe.MoE:
    """A zoo MoE whose parameters ARE the transformers block's (same tensors, same .grad)."""
    E, D = block.gate.weight.shape
    F = block.experts.down_proj.shape[-1]
    from zoo.core.contract import MoESpec

    shared = getattr(block, "shared_experts", None)  # DeepseekV3MoE
    spec = MoESpec(E, block.gate.top_k, F, norm_topk=True)
    if shared is not None:
        spec = MoESpec(E, block.gate.top_k, F, norm_topk=True, weights_fp32=True, router_bias=True, scoring="sigmoid",
                       n_group=block.gate.num_group, topk_group=block.gate.topk_group,
                       routed_scaling=block.gate.routed_scaling_factor, shared_ffn_dim=shared.intermediate_size,
                       shared_gated=False)
    with torch.device("meta"):
        layer = moe.MoE(D, spec)
    if shared is not None:
        layer.router_bias = block.gate.e_score_correction_bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_expert, name).weight = getattr(shared, name).weight
    layer.router.weight = block.gate.weight
    layer.experts.gate_up_proj = block.experts.gate_up_proj
    layer.experts.down_proj = block.experts.down_proj
    return layer


def gpt_oss_layers(shape: str, device: str, dtype: torch.dtype):
    """(transformers' GptOssMLP as fn(impl) -> its [T, D] forward, zoo's MoE with the same weights converted to its
    layout by the loader's own plan functions): one transformers block, its experts_implementation set per call."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from zoo.core.contract import MoESpec
    from zoo.models.gpt_oss import FROM_HF

    D, E, F, k = SHAPES[shape]
    cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k)
    torch.manual_seed(0)
    block = GptOssMLP(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, 0.02 if p.dim() == 3 else 0.5 if name == "router.weight" else 0.1)
    block = block.to(device, dtype)
    layer = moe.MoE(D, MoESpec(E, k, F, norm_topk=False, scoring="softmax_topk", router_linear_bias=True,
                               expert_bias=True, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha))
    with torch.no_grad():
        layer.router.weight.copy_(block.router.weight)
        layer.router.bias.copy_(block.router.bias)
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            theirs = getattr(block.experts, name)
            convert = FROM_HF[name]
            getattr(layer.experts, name).copy_(convert([theirs]) if convert else theirs)
    layer = layer.to(device, dtype)

    def hf(x_TD: torch.Tensor, impl: str) -> torch.Tensor:
        block.experts.config._experts_implementation = impl
        return block(x_TD[None])[0][0]

    return hf, layer


def layer_steps(shape: str, tokens: int, device: str, dtype: torch.dtype, variants: list[str]):
    """{variant: fn() running forward + backward}, the variants' outputs checked against zoo's first."""
    D = SHAPES[shape][0]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, D, generator=g).to(device, dtype)
    dy = torch.randn(tokens, D, generator=g).to(device, dtype)
    blocks = {}
    if shape.startswith("gpt-oss"):
        hf_gpt_oss, zoo_moe = gpt_oss_layers(shape, device, dtype)
        for v in variants:
            if v.startswith("hf_"):
                blocks[v] = functools.partial(hf_gpt_oss, impl=v.removeprefix("hf_"))
    else:
        for v in variants:
            if v.startswith("hf_"):
                blocks[v] = hf_layer(shape, device, dtype, v.removeprefix("hf_"))
        ref_block = blocks.get("hf_eager") or hf_layer(shape, device, dtype, "eager")
        zoo_moe = zoo_layer_sharing(ref_block)
    forced = {"zoo": None, "zoo_padded": "padded_bmm"}

    def run(v: str):
        xi = x.detach().requires_grad_()
        if v in forced:
            orig = moe.pick_kernel
            if forced[v]:
                moe.pick_kernel = lambda *a, k=forced[v]: k  # type: ignore[assignment]
            try:
                y = zoo_moe(xi)
            finally:
                moe.pick_kernel = orig
        elif shape.startswith("gpt-oss"):
            y = blocks[v](xi)
        else:
            y = blocks[v](xi[None])[0]
        y.backward(dy)
        return y, xi.grad

    ref_y, ref_dx = run("zoo")
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for v in variants:
        y, dx = run(v)
        err = max(((y - ref_y).abs().max() / ref_y.abs().max()).item(),
                  ((dx - ref_dx).abs().max() / ref_dx.abs().max()).item())
        if err > tol:
            raise SystemExit(f"{v}: output or input gradient differs from zoo's by {err:.2e} (relative)")
    return {v: (lambda v=v: run(v)) for v in variants}, moe.pick_kernel(x, D, SHAPES[shape][2])


def make_docs(tokens: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < tokens:
        n = int(math.exp(math.log(200) + torch.randn(1, generator=g).item()))
        n = max(2, min(n, 2048, tokens - total))
        if tokens - total - n == 1:
            n += 1
        docs.append(torch.randint(0, vocab, (n,), generator=g))
        total += n
    return docs


def hf_model(shape: str, device: str, dtype: torch.dtype, impl: str):
    """transformers' Qwen3MoeForCausalLM of STEP_SHAPES[shape], seeded: every variant gets the same weights."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(**STEP_SHAPES[shape])
    cfg._experts_implementation = impl
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.Qwen3MoeForCausalLM(cfg).to(dtype).train()


def zoo_model_sharing(hf):
    """A zoo Qwen3-MoE whose parameters ARE transformers' (it stacks the experts in memory as zoo does)."""
    from zoo.models.decoder import Decoder
    from zoo.models.family import rename
    from zoo.models.llama import HF_NAMES
    from zoo.models.qwen3_moe import config_from_hf

    with torch.device("meta"):
        model = Decoder(config_from_hf(hf.config.to_dict()), attn="auto")
    theirs = dict(hf.named_parameters())
    for name, _ in list(model.named_parameters()):
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, theirs[rename(name.replace(".mlp.router.", ".mlp.gate."),
                                                                   HF_NAMES)])
    return model.train()


def step_fn(variant: str, shape: str, docs: list[torch.Tensor], device: str, dtype: torch.dtype):
    """(the loss of a first forward, fn() running one training step) of a variant."""
    if variant in ("zoo", "zoo_compiled"):
        model = zoo_model_sharing(hf_model(shape, device, dtype, "eager"))
        if variant == "zoo_compiled":
            from zoo.parallel.fsdp import apply_compile

            apply_compile(model)
        packed = zoo.pack(docs).to(device)
        coef = model.config.router_aux_loss_coef

        def loss():
            return model.loss(packed, aux_loss_coef=coef)
    else:
        model = hf_model(shape, device, dtype, variant.removeprefix("hf_"))
        ids = torch.cat(docs)[None].to(device)
        pos = torch.cat([torch.arange(len(d)) for d in docs])[None].to(device)
        labels = ids.clone()
        labels[0, torch.cumsum(torch.tensor([len(d) for d in docs]), 0)[:-1]] = -100

        def loss():
            return model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False,
                         output_router_logits=True).loss
    first = loss().item()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return first, step


def peak(fn, device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return peak_rss_growth(fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--arch", choices=["qwen3_moe", "gpt_oss"], default="qwen3_moe",
                   help="gpt_oss: a GPT-OSS layer (no step); default shapes gpt-oss-20b on CUDA, -half on CPU")
    p.add_argument("--shape", default=None, help="layer shape: small or 30b (default: 30b on CUDA, small on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="layer tokens (default 8192 on CUDA, 2048 on CPU)")
    p.add_argument("--step-tokens", type=int, default=None, help="default 8192 on CUDA, 4096 on CPU")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--with-batched", action="store_true", help="also transformers' batched_mm (memory-hungry)")
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--memory-of", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = args.shape or ("30b" if cuda else "small")
    if args.arch == "gpt_oss":
        shape = args.shape or ("gpt-oss-20b" if cuda else "gpt-oss-20b-half")
    tokens = args.tokens or (8192 if cuda else 512 if shape.startswith("gpt-oss") else 2048)
    args.step_tokens = args.step_tokens or (8192 if cuda else 4096)
    layer_variants = LAYER_VARIANTS + (["hf_batched_mm"] if args.with_batched else [])
    args.skip_step = args.skip_step or shape in DEEPSEEK or shape.startswith("gpt-oss")  # the step is Qwen3-MoE's

    common = ["--device", args.device, "--shape", shape, "--tokens", str(tokens), "--threads", str(args.threads)]
    if args.memory_of:  # a fresh process: one variant's first call
        if args.part == "layer":
            fns, _ = layer_steps(shape, tokens, args.device, dtype, [args.memory_of])
            fn = fns[args.memory_of]
        else:
            _, fn = step_fn(args.memory_of, shape, make_docs(args.step_tokens, STEP_SHAPES[shape]["vocab_size"]),
                            args.device, dtype)
        print(json.dumps({"peak": peak(fn, args.device)}))
        return

    results: dict[str, object] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                                  "torch": torch.__version__, "dtype": str(dtype), "shape": shape, "tokens": tokens}
    D, E, F, k = SHAPES[shape]
    fns, kernel = layer_steps(shape, tokens, args.device, dtype, layer_variants)
    times = time_alternating(fns, args.reps, device=args.device)
    if cuda:
        mem = {v: peak(fns[v], args.device) for v in layer_variants}
    else:
        mem = memory_in_fresh_processes(__file__, layer_variants, [*common, "--part", "layer"])
    router = "DeepSeek-V3 router (8 groups, 4 kept) + 1 shared expert, " if shape in DEEPSEEK else ""
    print(f"MoE layer: d={D}, {E} experts of {F}, top {k}, {router}{tokens} tokens, {dtype}, {results['device']}; "
          f"zoo runs {kernel}")
    print(f"{'variant':<16} {'median ms':>10} {'tokens/s':>11} {'zoo speed-up':>13} {'peak MB':>9}")
    layer = {}
    for v in layer_variants:
        t = statistics.median(times[v])
        layer[v] = {"ms": t * 1e3, "tokens_per_s": tokens / t, "peak_mb": mem[v] / 2**20}
        print(f"{v:<16} {t * 1e3:>10.2f} {tokens / t:>11.0f} {t / statistics.median(times['zoo']):>12.2f}x "
              f"{mem[v] / 2**20:>9.0f}")
    results["layer"] = layer

    if not args.skip_step:
        S = STEP_SHAPES[shape]
        docs = make_docs(args.step_tokens, S["vocab_size"])
        step_variants = STEP_VARIANTS + (["zoo_compiled"] if cuda else [])
        built = {v: step_fn(v, shape, docs, args.device, dtype) for v in step_variants}
        ref = built["zoo"][0]
        for v, (first, _) in built.items():
            if abs(first - ref) > (1e-4 if not cuda else 2e-2) * max(1.0, abs(ref)):
                raise SystemExit(f"step {v}: first loss {first:.6f} vs zoo's {ref:.6f}")
        times = time_alternating({v: fn for v, (_, fn) in built.items()}, args.reps, device=args.device)
        if cuda:
            smem = {v: peak(built[v][1], args.device) for v in step_variants}
        else:
            del built
            smem = memory_in_fresh_processes(__file__, STEP_VARIANTS, [*common, "--part", "step",
                                                                       "--step-tokens", str(args.step_tokens)])
        print(f"\ntraining step: Qwen3-MoE {S['num_hidden_layers']} layers, d={S['hidden_size']}, "
              f"{S['num_experts']} experts of {S['moe_intermediate_size']} (top {S['num_experts_per_tok']}), "
              f"{len(docs)} documents / {args.step_tokens} tokens, aux loss on")
        print(f"{'variant':<16} {'median s':>9} {'tokens/s':>10} {'zoo speed-up':>13} {'peak MB':>9}")
        step = {}
        for v in step_variants:
            t = statistics.median(times[v])
            step[v] = {"s": t, "tokens_per_s": args.step_tokens / t, "peak_mb": smem[v] / 2**20}
            print(f"{v:<16} {t:>9.3f} {args.step_tokens / t:>10.0f} {t / statistics.median(times['zoo']):>12.2f}x "
                  f"{smem[v] / 2**20:>9.0f}")
        results["step"] = step
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
