"""Gated DeltaNet: the gated delta rule over a packed batch, forward + backward, tokens/s (CPU or CUDA).

One Gated DeltaNet layer's delta rule (Qwen3.5's: q/k L2-normalised inside, 1/sqrt(Dk) scale, value heads grouped
over key heads) on a pack of log-normal documents, each from a zero state:
  zoo_chunked       zoo.core.deltanet.chunked_delta_rule with cu_seqlens: every document at once, in chunks of 64
  zoo_recurrent     zoo.core.deltanet.recurrent_delta_rule: token by token (the reference the chunked form is tested
                    against; a Python loop over tokens)
  hf_torch          transformers' torch fallback for Qwen3.5 (torch_chunk_gated_delta_rule, the function its layer
                    calls without flash-linear-attention), run per document as it must be: it takes no cu_seqlens,
                    and one call over the pack would carry the state from one document into the next
  fla               (--device cuda, where flash-linear-attention trains: zoo.core.fla.fla_refused) its
                    chunk_gated_delta_rule with cu_seqlens, value heads grouped over the key heads inside (what zoo
                    runs on CUDA there)
Before timing, each variant's output and its gradients (q, k, v, g, beta) are checked against zoo_chunked's.
Medians of alternating runs (CUDA events on a GPU, perf_counter on CPU). Then the forward alone under no_grad (what
prefill, evaluation and reference log-probs run): zoo_chunked, hf_torch and, on CUDA where fla's forward runs even if
its backward is refused (zoo.core.fla.fla_forward_refused), fla, each output checked against zoo_chunked's.

    python bench/bench_deltanet.py [--device cpu|cuda] [--shape 0.8b|9b|small] [--tokens 4096] [--reps 3]
                                   [--threads N] [--skip-recurrent] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import lognormal_lengths, time_alternating  # noqa: E402

from zoo.core.deltanet import chunked_delta_rule, recurrent_delta_rule  # noqa: E402
from zoo.core.fla import fla_forward_refused, fla_refused  # noqa: E402

# (key heads, value heads, key head dim, value head dim) of one Gated DeltaNet layer
SHAPES = {"small": (4, 8, 64, 64), "0.8b": (16, 16, 128, 128), "9b": (16, 32, 128, 128)}
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Rule = Callable[[Inputs, torch.Tensor], torch.Tensor]


def make_inputs(shape: str, tokens: int, device: str, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] (log decay, <= 0, as -exp(A_log) * softplus(a + dt_bias) gives),
    beta [T, Hv] in (0, 1); leaves that take gradients."""
    Hk, Hv, Dk, Dv = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, Hk, Dk, generator=gen) for _ in range(2))
    v = torch.randn(tokens, Hv, Dv, generator=gen)
    g = -F.softplus(torch.randn(tokens, Hv, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(tokens, Hv, generator=gen))
    return tuple(x.to(device, dtype).requires_grad_() for x in (q, k, v, g, beta))  # type: ignore[return-value]


def hf_rule() -> Rule:
    """transformers' torch fallback, once per document (the undecorated function: the torch path even where fla is
    installed, which the decorator would otherwise pick)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    fn = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)

    def run(x: Inputs, cu: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = x
        groups = v.shape[1] // k.shape[1]  # its layer repeats q and k to the value heads before the call
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
        bounds = cu.tolist()
        outs = [fn(*(t[None, s:e] for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0][0]
                for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs)

    return run


def fla_rule() -> Rule:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def run(x: Inputs, cu: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = x  # value heads grouped over key heads in the kernel (GVA), as zoo calls it
        out, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], cu_seqlens=cu.long(),
                                        use_qk_l2norm_in_kernel=True)
        return out[0]

    return run


def rules(device: str, skip_recurrent: bool) -> dict[str, Rule]:
    found: dict[str, Rule] = {"zoo_chunked": lambda x, cu: chunked_delta_rule(*x, cu)}
    if not skip_recurrent:
        found["zoo_recurrent"] = lambda x, cu: recurrent_delta_rule(*x, cu)
    found["hf_torch"] = hf_rule()
    if device == "cuda":
        refused = fla_refused(torch.device("cuda"), torch.bfloat16, (128, 128))
        if refused is None:
            found["fla"] = fla_rule()
        else:
            print(f"fla: left out ({refused})", file=sys.stderr)
    return found


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=list(SHAPES), default=None, help="default: 0.8b on CPU, 9b on CUDA")
    p.add_argument("--tokens", type=int, default=None, help="tokens in the pack (default: 4096 on CPU, 32768 on CUDA)")
    p.add_argument("--median", type=float, default=300.0, help="median document length (log-normal, capped at 4096)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--skip-recurrent", action="store_true", help="leave out the per-token reference (slow)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if (args.tokens is not None and args.tokens < 1) or args.reps < 1:
        p.error(f"--tokens and --reps must be positive, got {args.tokens} and {args.reps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    shape = args.shape or ("9b" if cuda else "0.8b")
    tokens = args.tokens or (32768 if cuda else 4096)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if cuda else "fp32")]

    lens = lognormal_lengths(tokens, args.median, 4096)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=args.device)
    x = make_inputs(shape, tokens, args.device, dtype)
    dy = torch.randn(tokens, SHAPES[shape][1], SHAPES[shape][3], generator=torch.Generator().manual_seed(1))
    dy = dy.to(args.device, dtype)

    cpu: dict[str, list[float]] = {}  # process CPU seconds of each timed call: less moved by a busy machine

    def step(rule: Rule, name: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            for t in x:
                t.grad = None
            c0 = time.process_time()
            out = rule(x, cu)
            out.backward(dy)
            cpu.setdefault(name, []).append(time.process_time() - c0)
            return (out.detach(), *(t.grad for t in x if t.grad is not None))
        return run

    variants = rules(args.device, args.skip_recurrent)
    steps = {v: step(rule, v) for v, rule in variants.items()}
    ref = steps["zoo_chunked"]()
    tol = 2e-4 if dtype == torch.float32 else 5e-2
    errors = {}
    for v, run in steps.items():  # the check is each variant's warm-up too
        got = run()
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref))
        if len(got) != len(ref) or err > tol:
            raise SystemExit(f"{v}: output or a gradient differs from zoo_chunked's by {err:.2e} (relative; "
                             f"expected within {tol:g})")
        errors[v] = err
    cpu.clear()
    times = time_alternating(steps, args.reps, warmup=0, device=args.device)

    Hk, Hv, Dk, Dv = SHAPES[shape]
    timed: dict[str, dict[str, float]] = {}
    device = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    result: dict[str, object] = {"device": device,
              "torch": torch.__version__, "shape": shape, "heads": [Hk, Hv], "head_dims": [Dk, Dv],
              "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "documents": len(lens),
              "longest": max(lens), "load_average": os.getloadavg()[0], "variants": timed}
    base = statistics.median(times["hf_torch"])
    print(f"{tokens} tokens in {len(lens)} documents (longest {max(lens)}), {shape}: {Hk} key / {Hv} value heads of "
          f"{Dk}/{Dv}, {result['dtype']}, {result['device']}, load average {result['load_average']:.2f}; "
          f"forward + backward, medians of {args.reps} alternating runs (CPU: process time too)")
    base_cpu = statistics.median(cpu["hf_torch"])
    for v, ts in times.items():
        med, med_cpu = statistics.median(ts), statistics.median(cpu[v])
        timed[v] = {"seconds": med, "cpu_seconds": med_cpu, "tokens_per_s": tokens / med, "max_rel_err": errors[v]}
        print(f"  {v:14s} {med * 1e3:10.1f} ms  {tokens / med:12,.0f} tokens/s  {base / med:6.2f}x hf_torch  "
              f"(max rel err {errors[v]:.1e})" + ("" if cuda else f"  CPU {med_cpu * 1e3:8.1f} ms "
                                                  f"{base_cpu / med_cpu:5.2f}x"))
    result["forward_no_grad"] = forward_only(variants, x, cu, args.device, args.reps, tol)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def forward_only(variants: dict[str, Rule], x: Inputs, cu: torch.Tensor, device: str, reps: int,
                 tol: float) -> dict[str, dict[str, float]]:
    """Seconds of each forward under no_grad (fla's where its forward runs, trained or not), outputs checked."""
    chosen = {v: variants[v] for v in ("zoo_chunked", "hf_torch")}
    if device == "cuda":
        refused = fla_forward_refused(torch.device("cuda"), x[0].dtype, (x[0].shape[-1], x[2].shape[-1]))
        if refused is None:
            chosen["fla"] = fla_rule()
        else:
            print(f"fla forward: left out ({refused})", file=sys.stderr)
    with torch.no_grad():
        ref = chosen["zoo_chunked"](x, cu).float()
        for v, rule in chosen.items():
            err = ((rule(x, cu).float() - ref).abs().max() / ref.abs().max()).item()
            if err > tol:
                raise SystemExit(f"{v} forward differs from zoo_chunked's by {err:.2e} (relative; within {tol:g})")
        def forward(rule: Rule) -> Callable[[], torch.Tensor]:
            return lambda: rule(x, cu)

        times = time_alternating({v: forward(r) for v, r in chosen.items()}, reps, warmup=0, device=device)
    base = statistics.median(times["hf_torch"])
    print("forward alone, no_grad:")
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"  {v:14s} {med * 1e3:10.1f} ms  {x[0].shape[0] / med:12,.0f} tokens/s  {base / med:6.2f}x hf_torch")
    return {v: {"seconds": statistics.median(ts)} for v, ts in times.items()}


if __name__ == "__main__":
    main()
