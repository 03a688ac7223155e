"""Greedy decoding: zoo.generate (all prompts at once) vs transformers' generate on the same weights.

8 prompts of mixed lengths (16..400 tokens, random ids from a fixed seed), 128 new tokens each, greedy. The
weights are those of one transformers LlamaForCausalLM (built with a fixed seed, then re-initialised so that greedy
decoding depends on the prompt, see `sharpen`); zoo runs the same tensors (bench/common.zoo_llama_sharing).
  zoo                    zoo.generate(model, prompts, compile=False): one packed prefill, then one eager forward a
                         step for all prompts
  zoo compiled           (--compile) the same with compile=True: each decode step one torch.compile'd graph (CUDA
                         graphs on CUDA), attention over the whole preallocated cache; its compilation happens in the
                         token check, before any timing
  transformers batched   hf.generate on the prompts left-padded to the longest, with attention_mask (its usual
                         batch generate; DynamicCache, sdpa)
  transformers static    the same with cache_implementation="static": on CUDA transformers then compiles its
                         forward itself (mode reduce-overhead: CUDA graphs); its compilation happens in the check
  transformers 1 by 1    hf.generate on one prompt at a time (DynamicCache): batch 1, the first `one_by_one` prompts
  zoo compiled 1 by 1    (--compile) zoo.generate(compile=True) on one prompt at a time, the same prompts
First the tokens: every variant once (which is also the warm-up); per prompt the number of leading tokens equal to
transformers' one-prompt-at-a-time output. In fp32 (CPU) zoo's, eager and compiled, must all be equal (exit status 1
otherwise); in bf16 greedy paths may part after a few tokens (an argmax near-tie flips), so only the counts are
reported.
Then the time, the variants alternating, medians over --reps: new tokens/s (all new tokens / wall time of the call),
the prefill (the same call with max_new_tokens=1) and ms per decode step ((total - prefill) / steps after the
first token; a step adds one token to every sequence of the call, one sequence for "1 by 1"); "x hf" is
transformers' time over the variant's on the same prompts: batched (DynamicCache) for the batched rows, 1 by 1 for
the 1-by-1 rows; "x static" is transformers static's over the variant's (the goals on a GPU: zoo compiled >= 1.5 x
static; zoo compiled 1 by 1 >= 5 x transformers 1 by 1). "HBM" (CUDA) is the fraction of the memory-bandwidth bound
a 1-by-1 decode step reaches: the bytes it must read (every weight once, tied head counted once, plus the K/V cache)
over the measured device-to-device copy bandwidth, divided by its measured ms/step (the goal: >= 0.5).

--batches 1,8,32 runs only this instead: per batch size, prompts of 128 tokens, zoo.generate with q/k/v and gate/up
fused (zoo.generate.fused, `fuse=True`) and unfused, compiled with --compile, against transformers' static-cache
decode (compiled by transformers on CUDA); ms per decode step, decode tokens/s, "x static" (transformers static's
ms per step over the variant's; goal at batch 1: >= 2) and HBM (the bound: every weight once plus the batch's K/V
cache, over the copy bandwidth, divided by the step; goal at batch 1: >= 0.6). In fp32 the fused tokens must equal
the unfused ones (exit status 1 otherwise).

  --device cpu (default)  tiny Llama: 4 layers, d=256, 4/2 heads, ffn 688, vocab 8000, fp32, 2 threads (~1 min)
  --device cuda           Llama-3.2-1B shape: 16 layers, d=2048, 32/8 heads, ffn 8192, vocab 128256, tied head,
                          llama3 RoPE, bf16, sdpa for transformers (estimate: ~2-3 min on an H100)

    python bench/bench_generate.py [--out gen-cpu.json]
    python bench/bench_generate.py --device cuda --compile --out gen-gpu.json [--profile]
    python bench/bench_generate.py --device cuda --compile --batches 1,8,32 --new-tokens 64 --out dec.json
    python bench/bench_generate.py --smoke [--compile] [--device cuda]   # tiny shapes, 8 new tokens: seconds
                                                                         # (--compile on CPU: inductor, ~20 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import copy_bandwidth, time_alternating, zoo_llama_sharing  # noqa: E402

from zoo.core.attention import pick_backend  # noqa: E402
from zoo.generate import generate  # noqa: E402

PAD = 0  # left padding for transformers' batch; prompts never contain it


@dataclass(frozen=True)
class Shape:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    llama3_rope: bool  # Llama 3.1/3.2's rope_parameters (theta 5e5, llama3 scaling), else transformers' default
    prompt_lens: tuple[int, ...] = (16, 400, 37, 211, 90, 25, 312, 150)
    new_tokens: int = 128
    reps: int = 3
    one_by_one: int = 2  # the "1 by 1" rows (batch 1) run the first this many prompts
    batch_prompt: int = 128  # --batches: every prompt this long


CPU = Shape(layers=4, dim=256, heads=4, kv_heads=2, ffn=688, vocab=8000, tied=False, llama3_rope=False, one_by_one=8)
CUDA = Shape(layers=16, dim=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True, llama3_rope=True)
SMOKE = Shape(layers=2, dim=64, heads=4, kv_heads=2, ffn=96, vocab=300, tied=True, llama3_rope=True,
              prompt_lens=(16, 40, 3, 25, 9, 1, 33, 18), new_tokens=8, reps=1, one_by_one=8, batch_prompt=12)


def build(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(transformers LlamaForCausalLM in eval mode, a zoo Llama sharing its parameters)."""
    import transformers

    rope = None
    if shape.llama3_rope:  # Llama-3.2-1B's values
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=shape.tied, rope_parameters=rope,
        bos_token_id=None, eos_token_id=None, pad_token_id=PAD)  # no eos: every sequence runs its full length
    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    sharpen(hf, seed)
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = PAD
    return hf, zoo_llama_sharing(hf)


@torch.no_grad()
def sharpen(hf, seed: int) -> None:
    """Every matrix N(0, 1/fan_in), norm scales 1 + N(0, 0.2^2). transformers' init (std 0.02) leaves attention
    uniform and, with a tied head, the current token's own logit far above the rest: greedy decoding would just
    repeat the last prompt token, and the token check would prove little. Here logits are ~N(0, 1) and depend on
    the context; ties between the top two are rare."""
    g = torch.Generator(device=hf.device).manual_seed(seed)
    for p in hf.parameters():  # a tied head is the embedding: [V, D], fan-in D either way
        if p.dim() == 1:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * p.shape[1] ** -0.5)


def make_prompts(shape: Shape, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(PAD + 1, shape.vocab, (n,), generator=g).to(device) for n in shape.prompt_lens]


def variants(hf, model, prompts: list[torch.Tensor], compiled: bool = False,
             one_by_one: int | None = None) -> dict[str, Callable[[int], list[torch.Tensor]]]:
    """name -> fn(max_new_tokens) returning the new tokens of each prompt (the 1-by-1 rows: of the first
    `one_by_one` prompts)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):], mask[i, longest - len(p):] = p, 1

    singles = prompts[:one_by_one]

    def hf_generate(ids, mask, n, **kw):
        return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=PAD, **kw)[:, ids.shape[1]:]

    def hf_batched(n):
        return list(hf_generate(ids, mask, n))

    def hf_static(n):
        return list(hf_generate(ids, mask, n, cache_implementation="static"))

    def hf_one_by_one(n):
        return [hf_generate(p[None], torch.ones_like(p)[None], n)[0] for p in singles]

    fns = {"zoo": lambda n: generate(model, prompts, max_new_tokens=n, compile=False)}
    if compiled:
        fns["zoo compiled"] = lambda n: generate(model, prompts, max_new_tokens=n, compile=True)
    fns |= {"transformers batched": hf_batched, "transformers static": hf_static, "transformers 1 by 1": hf_one_by_one}
    if compiled:
        fns["zoo compiled 1 by 1"] = lambda n: [generate(model, [p], max_new_tokens=n, compile=True)[0]
                                                for p in singles]
    return fns


def weight_bytes(model) -> int:
    """Bytes of every parameter, a tied head counted once (parameters() yields each tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes(model, length: int) -> int:
    """Bytes of one sequence's K and V over `length` positions, every layer."""
    cfg = model.config
    head_dim = cfg.dim // cfg.n_heads
    return 2 * cfg.n_layers * cfg.n_kv_heads * head_dim * length * next(model.parameters()).element_size()


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_tokens(fns: dict[str, Callable], new_tokens: int) -> dict:
    """Run every variant once; per prompt, how many leading tokens equal transformers' one-prompt-at-a-time."""
    tokens = {name: [t.tolist() for t in fn(new_tokens)] for name, fn in fns.items()}
    ref = tokens["transformers 1 by 1"]
    out: dict[str, Any] = {"reference": "transformers 1 by 1",
                           "lengths": {k: [len(t) for t in v] for k, v in tokens.items()}}
    zoos = [name for name in fns if name.startswith("zoo")]
    for name in (*zoos, "transformers batched", "transformers static"):
        out[name] = [leading_equal(t, r) for t, r in zip(tokens[name], ref)]  # the 1-by-1 prompts
    out["zoo vs transformers batched"] = [leading_equal(t, r) for t, r in zip(tokens["zoo"],
                                                                              tokens["transformers batched"])]
    if "zoo compiled" in tokens:
        out["zoo compiled vs zoo"] = [leading_equal(t, r) for t, r in zip(tokens["zoo compiled"], tokens["zoo"])]
    full = all(len(t) == new_tokens for v in tokens.values() for t in v)  # nothing stopped early
    out["zoo_equal"] = full and all(n == new_tokens for name in zoos for n in out[name])
    out["all_equal"] = out["zoo_equal"] and all(n == new_tokens for name in ("transformers batched",
                                                                          "transformers static") for n in out[name])
    return out


def profile(fns: dict[str, Callable], new_tokens: int, device: torch.device) -> None:
    """The top operators of one call of zoo and of transformers batched, by self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # decoding small batches is bound by the host on a GPU: the CPU table says as much as the kernel table
    keys = ["self_cpu_time_total"] + (["self_device_time_total"] if cuda else [])
    for name in [k for k in fns if k != "transformers 1 by 1"]:
        with torch_profile(activities=activities) as prof:
            fns[name](new_tokens)
            if cuda:
                torch.cuda.synchronize()
        for key in keys:
            print(f"\n== profile: {name}, {new_tokens} new tokens, by {key} ==")
            print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


def profile_batch1(model, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> None:
    """Where a compiled batch-1 decode step spends its time: the kernels of one call by device time (the first call,
    which compiles, is not profiled), and the step time against the bytes it must read."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def call():
        generate(model, [prompt], max_new_tokens=new_tokens, compile=device.type == "cuda")

    call()
    cuda = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\n== zoo compiled, one prompt of {len(prompt)} tokens, {new_tokens} new tokens: top kernels by {key} ==")
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=70))


def batch_variants(hf, model, prompts: list[torch.Tensor], compiled: bool) -> dict[str, Callable[[int], list]]:
    """name -> fn(max_new_tokens) for one batch of equal-length prompts: zoo with q/k/v and gate/up fused
    (zoo.generate.fused) and without, compiled where `compiled`, and transformers' static-cache decode (on CUDA
    compiled by transformers itself, CUDA graphs)."""
    ids = torch.stack(prompts)
    mask = torch.ones_like(ids)
    suffix = " compiled" if compiled else ""

    def hf_static(n):
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=0, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD, cache_implementation="static")
        return list(out[:, ids.shape[1]:])

    return {f"zoo fused{suffix}": lambda n: generate(model, prompts, max_new_tokens=n, compile=compiled, fuse=True),
            f"zoo{suffix}": lambda n: generate(model, prompts, max_new_tokens=n, compile=compiled, fuse=False),
            "transformers static": hf_static}


def run_batches(args, shape: Shape, device: torch.device, dtype: torch.dtype, batches: list[int]) -> int:
    """Decode speed by batch size: ms per step, new tokens/s and the fraction of the memory-bandwidth bound (every
    weight once, the head tied or not, plus each sequence's K/V cache, over the measured copy bandwidth; CUDA),
    zoo fused vs unfused vs transformers' static-cache decode, on prompts of `batch_prompt` tokens."""
    hf, model = build(shape, device, dtype)
    compiled = args.compile
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    new, length = shape.new_tokens, shape.batch_prompt
    exact = dtype == torch.float32
    weights = weight_bytes(model)
    print(f"  Llama {shape.layers} layers, d={shape.dim}, {shape.heads}/{shape.kv_heads} heads, ffn {shape.ffn}, "
          f"vocab {shape.vocab}; prompts of {length} tokens, {new} new tokens, greedy; medians of {shape.reps}; "
          f"weights {weights / 1e9:.2f} GB" + (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""))
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"prompt_len": length, "new_tokens": new, "weight_bytes": weights,
                           "copy_tb_per_s": bandwidth / 1e12 if bandwidth else None, "batches": {}}
    failed = False
    for b in batches:
        prompts = [torch.randint(PAD + 1, shape.vocab, (length,), generator=g).to(device) for _ in range(b)]
        fns = batch_variants(hf, model, prompts, compiled)
        tokens = {name: [t.tolist() for t in fn(new)] for name, fn in fns.items()}  # also the warm-up
        names = list(fns)
        fused, plain, static = names[0], names[1], names[2]
        equal = [leading_equal(a, r) for a, r in zip(tokens[fused], tokens[plain])]
        vs_hf = [leading_equal(a, r) for a, r in zip(tokens[fused], tokens[static])]
        if exact and any(n != new for n in equal):
            failed = True
        times = time_alternating({k: partial(fn, new) for k, fn in fns.items()}, shape.reps, warmup=0, device=device)
        prefill = time_alternating({k: partial(fn, 1) for k, fn in fns.items()}, shape.reps, warmup=1, device=device)
        cache = b * kv_bytes(model, length + new)
        rows: dict[str, dict[str, float]] = {}
        for name in fns:
            total, first = statistics.median(times[name]), statistics.median(prefill[name])
            step = max(total - first, 1e-9) / (new - 1)
            row = {"s": total, "prefill_ms": first * 1e3, "decode_step_ms": step * 1e3,
                   "decode_tokens_per_s": b / step}
            if bandwidth:
                row["hbm_bound_ms"] = (weights + cache) / bandwidth * 1e3
                row["hbm_fraction"] = row["hbm_bound_ms"] / row["decode_step_ms"]
            rows[name] = row
        for row in rows.values():
            row["x_transformers_static"] = rows[static]["decode_step_ms"] / row["decode_step_ms"]
        out["batches"][str(b)] = {"rows": rows, "fused_vs_unfused_equal": equal, "fused_vs_transformers": vs_hf}
        print(f"\n  batch {b}: tokens equal fused vs unfused {equal[:8]}{'...' if b > 8 else ''}, "
              f"vs transformers static {vs_hf[:8]}{'...' if b > 8 else ''} (of {new})")
        print(f"    {'':<22}{'ms/step':>9}{'tok/s':>10}{'prefill ms':>12}{'x static':>9}{'HBM':>6}")
        for name, r in rows.items():
            hbm = f"{r['hbm_fraction']:>6.0%}" if "hbm_fraction" in r else ""
            print(f"    {name:<22}{r['decode_step_ms']:>9.3f}{r['decode_tokens_per_s']:>10,.0f}{r['prefill_ms']:>12.1f}"
                  f"{r['x_transformers_static']:>9.2f}{hbm}")
    if bandwidth:
        one = out["batches"].get("1", {}).get("rows", {})
        if one:
            best = one[next(iter(one))]
            out["targets"] = {"hbm_fraction_batch1": best["hbm_fraction"], "hbm_goal": 0.6,
                              "x_transformers_static_batch1": best["x_transformers_static"], "static_goal": 2.0}
            print(f"\n  batch 1, zoo fused: {best['hbm_fraction']:.0%} of the HBM bound (goal 60%), "
                  f"{best['x_transformers_static']:.2f}x transformers static (goal 2x)")
    out["failed"] = failed
    if failed:
        print("  MISMATCH: fp32 greedy tokens of the fused path differ from the unfused path's")
    if args.out:
        args.out.write_text(json.dumps({"env": env_info(device, dtype, None, compiled), "shape": asdict(shape),
                                        "smoke": args.smoke, "decode": out}, indent=1))
    return 1 if failed else 0


def env_info(device: torch.device, dtype: torch.dtype, threads: int | None, compiled: bool) -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "threads": threads, "dtype": str(dtype).removeprefix("torch."),
            "zoo_prefill_backend": pick_backend(device, dtype), "zoo_decode_attention": "sdpa over the KV cache",
            "zoo_compiled": ("torch.compile " + ("mode=reduce-overhead (CUDA graphs)" if device.type == "cuda" else
                                                 "inductor, default mode")) if compiled else "not run (--compile)",
            "transformers_attention": "sdpa; DynamicCache, and a static cache (compiled by transformers on CUDA)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--device", default="cpu", help="cpu (tiny Llama, fp32) or cuda (Llama-3.2-1B shape, bf16)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 8 new tokens, one repetition: seconds")
    p.add_argument("--new-tokens", type=int, help="new tokens per prompt (default 128; smoke 8)")
    p.add_argument("--reps", type=int, help="timed repetitions per variant (default 3; smoke 1)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU only)")
    p.add_argument("--compile", action="store_true",
                   help="also time zoo.generate(compile=True): the decode step compiled (CUDA graphs on CUDA)")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's top operators of one call")
    p.add_argument("--profile-batch1", action="store_true",
                   help="only this: the top kernels of zoo's compiled decoding of one prompt (no timing, no baseline)")
    p.add_argument("--batches", help="only this: decode speed at these batch sizes (e.g. 1,8,32), zoo fused vs "
                                     "unfused vs transformers static, with the HBM bound")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    batches = None
    if args.batches:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError:
            p.error(f"--batches {args.batches!r}: expected comma-separated batch sizes such as 1,8,32")
        if not batches or min(batches) < 1:
            p.error(f"--batches {args.batches!r}: batch sizes must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    shape = SMOKE if args.smoke else CUDA if device.type == "cuda" else CPU
    shape = replace(shape, new_tokens=args.new_tokens or shape.new_tokens, reps=args.reps or shape.reps)
    if shape.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the decode steps are timed apart from the prefill)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    threads_before = torch.get_num_threads()
    threads = args.threads if device.type == "cpu" else None
    try:
        if threads:
            torch.set_num_threads(threads)
        if batches:
            return run_batches(args, shape, device, dtype, batches)
        return run(args, shape, device, dtype, threads)
    finally:
        torch.set_num_threads(threads_before)  # in-process callers (the test) keep their setting


def run(args, shape: Shape, device: torch.device, dtype: torch.dtype, threads: int | None) -> int:
    info = env_info(device, dtype, threads, args.compile)
    for k, v in info.items():
        print(f"  {k:<24} {v}")
    hf, model = build(shape, device, dtype)
    prompts = make_prompts(shape, device)
    if args.profile_batch1:
        profile_batch1(model, prompts[0], shape.new_tokens, device)
        return 0
    n, new = len(prompts), shape.new_tokens
    cfg = model.config
    print(f"  Llama {cfg.n_layers} layers, d={cfg.dim}, {cfg.n_heads}/{cfg.n_kv_heads} heads, ffn {cfg.ffn_dim}, "
          f"vocab {cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'untied'} head, rope theta {cfg.rope_theta:g} "
          f"{(cfg.rope_scaling or {}).get('rope_type', 'default')}; {sum(p.numel() for p in hf.parameters()):,} "
          f"parameters")
    print(f"  {n} prompts of {list(shape.prompt_lens)} tokens ({sum(shape.prompt_lens)} in all), {new} new tokens "
          f"each, greedy; medians of {shape.reps}")
    fns = variants(hf, model, prompts, args.compile, shape.one_by_one)
    singles = len(prompts[:shape.one_by_one])

    check = check_tokens(fns, new)
    exact = dtype == torch.float32
    print(f"\n  leading tokens equal to transformers 1 by 1, per prompt (of {new}):")
    for name in [k for k in check if k.startswith(("zoo", "transformers b", "transformers s")) and k != "zoo_equal"]:
        print(f"    {name:<28} {check[name]}")
    if not check["all_equal"]:
        print("  MISMATCH: fp32 greedy tokens differ" if exact else
              "  (bf16: greedy paths part where an argmax near-tie flips; reported, not failed)")

    times = time_alternating({k: partial(fn, new) for k, fn in fns.items()}, shape.reps, warmup=0,
                             device=device)  # check_tokens was the warm-up
    prefill = time_alternating({k: partial(fn, 1) for k, fn in fns.items()}, shape.reps, warmup=1, device=device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    rows = {}
    for name in fns:
        total, first = statistics.median(times[name]), statistics.median(prefill[name])
        single = name.endswith("1 by 1")
        steps = (new - 1) * (singles if single else 1)
        rows[name] = {"s": total, "s_min": min(times[name]), "s_max": max(times[name]),
                      "new_tokens_per_s": (singles if single else n) * new / total, "prefill_ms": first * 1e3,
                      "decode_step_ms": (total - first) / steps * 1e3, "decode_steps": steps}
    for name, row in rows.items():
        single = name.endswith("1 by 1")
        row["x_transformers"] = rows["transformers 1 by 1" if single else "transformers batched"]["s"] / row["s"]
        if not single:
            row["x_transformers_static"] = rows["transformers static"]["s"] / row["s"]
        if single and bandwidth:  # a batch-1 step reads every weight once and the K/V cache written so far
            cache_bytes = kv_bytes(model, max(shape.prompt_lens[:singles]) + new)
            bound_ms = (weight_bytes(model) + cache_bytes) / bandwidth * 1e3
            row["hbm_bound_ms"], row["hbm_fraction"] = bound_ms, bound_ms / row["decode_step_ms"]
    print(f"\n  {'':<22}{'s':>8}{'min':>8}{'max':>8}{'new tok/s':>11}{'prefill ms':>12}{'ms/step':>9}{'steps':>7}"
          f"{'x hf':>7}{'x static':>9}{'HBM':>6}")
    for name, r in rows.items():
        static = f"{r['x_transformers_static']:>9.2f}" if "x_transformers_static" in r else f"{'':>9}"
        hbm = f"{r['hbm_fraction']:>6.0%}" if "hbm_fraction" in r else ""
        print(f"  {name:<22}{r['s']:>8.3f}{r['s_min']:>8.3f}{r['s_max']:>8.3f}{r['new_tokens_per_s']:>11,.0f}"
              f"{r['prefill_ms']:>12.1f}{r['decode_step_ms']:>9.2f}{r['decode_steps']:>7}{r['x_transformers']:>7.2f}"
              f"{static}{hbm}")
    print("  ms/step: (total - prefill) / steps; a step adds a token to every sequence of the call (1 by 1: to one);"
          "\n  x hf: transformers' time over the variant's (batched rows: transformers batched; 1-by-1 rows: "
          "transformers 1 by 1);\n  x static: transformers static's time over the variant's"
          + (f"; HBM: bandwidth bound / ms per step ({bandwidth / 1e12:.2f} TB/s measured)" if bandwidth else ""))
    info["copy_tb_per_s"] = bandwidth / 1e12 if bandwidth else None
    if args.profile:
        profile(fns, new, device)

    failed = exact and not check["zoo_equal"]  # transformers batched vs 1 by 1 is transformers' own business
    if args.out:
        args.out.write_text(json.dumps({"env": info, "shape": asdict(shape), "smoke": args.smoke, "tokens": check,
                                        "rows": rows, "failed": failed}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
