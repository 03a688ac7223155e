"""Multi-head latent attention (DeepSeek-V3's MLA): one layer's forward + backward against transformers', and the
latent generation cache's bytes per token beside an expanded cache's.

Step: zoo.core.mla.MLA over one pack of equal-length documents (the installed attention function: sdpa by default;
values zero-padded to the key width, see zoo.core.mla) against transformers' DeepseekV3Attention on the same
documents as a batch with its causal mask (attn_implementation sdpa), the same weights, a scaled-down shape (--shape
small; `v3` is DeepSeek-V3's own layer, for a GPU). Before timing, outputs and every weight's gradient are compared.
Medians of alternating runs (perf_counter on CPU, CUDA events on a GPU).

Cache: bytes per token and layer, and per token over all layers, of zoo's latent cache (the normed kv latent and the
rope key: what `MLA.generation_bytes` allocates) and of a cache of expanded keys and values (N heads of
qk_nope + qk_rope key dims and v_head_dim value dims), at the published shapes, bf16, computed (no model is built).

    python bench/bench_mla.py [--device cpu|cuda] [--shape small|v3] [--docs 4] [--doc-len 512] [--reps 3]
                              [--threads N] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import time_alternating  # noqa: E402

import zoo  # noqa: E402
from zoo.core.attention import get_attention  # noqa: E402
from zoo.core.contract import MLASpec, NormSpec  # noqa: E402
from zoo.core.layers import Rotary  # noqa: E402
from zoo.core.mla import MLA, expanded_cache_bytes, mla_cache_bytes  # noqa: E402

# (dim, heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
SHAPES = {"small": (1024, 16, 384, 128, 64, 32, 64), "v3": (7168, 128, 1536, 512, 128, 64, 128)}
# the published shapes whose caches are compared: (layers, heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim)
PUBLISHED = {"deepseek-v3": (61, 128, 512, 128, 64, 128), "kimi-k2": (61, 64, 512, 128, 64, 128),
             "moonlight-16b-a3b": (27, 16, 512, 128, 64, 128)}


def cache_table(itemsize: int = 2) -> dict[str, dict[str, float]]:
    """Per published shape: bytes per token and layer of each cache, per token over the layers, and the ratio."""
    out = {}
    for name, (layers, N, L, P, R, V) in PUBLISHED.items():
        latent, expanded = mla_cache_bytes(L, R, itemsize), expanded_cache_bytes(N, P, R, V, itemsize)
        out[name] = {"latent_per_layer": latent, "expanded_per_layer": expanded, "latent_per_token": latent * layers,
                     "expanded_per_token": expanded * layers, "ratio": expanded / latent}
    return out


def build(shape: str, device: str, dtype: torch.dtype) -> tuple[MLA, Any, Rotary]:
    """zoo's MLA and transformers' DeepseekV3Attention with the same random weights, and zoo's rotary."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    D, N, Q, L, P, R, V = SHAPES[shape]
    config = DeepseekV3Config(hidden_size=D, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=Q,
                              kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V,
                              rope_interleave=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = DeepseekV3Attention(config, 0)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=D ** -0.5) if p.dim() == 2 else torch.nn.init.ones_(p)
    mine = MLA(D, MLASpec(N, Q, L, P, R, V, rope_layout="interleaved"), NormSpec(), 1e-6, 0)
    mine.load_state_dict(hf.state_dict())
    return mine.to(device, dtype), hf.to(device, dtype), Rotary(R, config.rope_parameters["rope_theta"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=list(SHAPES), default="small")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--attn", default="sdpa", help="zoo's attention backend")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if min(args.docs, args.doc_len, args.reps) < 1:
        p.error("--docs, --doc-len and --reps must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    mine, hf, rotary = build(args.shape, args.device, dtype)
    mine.attend = get_attention(args.attn)
    B, S, D = args.docs, args.doc_len, SHAPES[args.shape][0]
    x_BSD = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).to(args.device, dtype)
    dy_BSD = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2)).to(args.device, dtype)
    packed = zoo.pack([torch.zeros(S, dtype=torch.long, device=args.device)] * B)
    cos, sin = rotary(packed, dtype)
    position_ids = torch.arange(S, device=args.device)[None].expand(B, S)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf.config).to(args.device)(x_BSD, position_ids)
    mask = torch.ones(S, S, dtype=torch.bool, device=args.device).tril()[None, None]

    def zoo_step() -> tuple[torch.Tensor, ...]:
        mine.zero_grad(set_to_none=True)
        out = mine(x_BSD.reshape(B * S, D), cos, sin, packed)
        out.backward(dy_BSD.reshape(B * S, D))
        return (out.detach().view(B, S, D), *(p.grad for p in mine.parameters()))

    def hf_step() -> tuple[torch.Tensor, ...]:
        hf.zero_grad(set_to_none=True)
        out = hf(x_BSD, (hf_cos, hf_sin), mask)[0]
        out.backward(dy_BSD)
        return (out.detach(), *(p.grad for p in hf.parameters()))

    tol = 1e-4 if dtype == torch.float32 else 5e-2
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for a, b in zip(zoo_step(), hf_step(), strict=True))
    if err > tol:
        raise SystemExit(f"zoo's MLA differs from transformers' by {err:.2e} (relative; expected within {tol:g})")
    times = time_alternating({"zoo": zoo_step, "transformers": hf_step}, args.reps, warmup=1, device=args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    med = {v: statistics.median(t) for v, t in times.items()}
    result: dict[str, Any] = {"device": device, "torch": torch.__version__, "shape": args.shape,
                              "dims": SHAPES[args.shape], "dtype": str(dtype).removeprefix("torch."),
                              "docs": B, "doc_len": S, "attn": args.attn, "max_rel_err": err,
                              "seconds": med, "cache_bf16": cache_table()}
    print(f"MLA layer {args.shape} {SHAPES[args.shape]}, {B} documents of {S} tokens, {result['dtype']}, {device}; "
          f"forward + backward (max rel err {err:.1e})")
    for v, s in med.items():
        print(f"  {v:13s} {s * 1e3:9.1f} ms  {B * S / s:10,.0f} tokens/s  {med['transformers'] / s:5.2f}x transformers")
    print("generation cache, bf16, bytes per token (per layer / all layers):")
    for name, c in result["cache_bf16"].items():
        print(f"  {name:18s} latent {c['latent_per_layer']:6,.0f} / {c['latent_per_token'] / 2**10:7.1f} KiB   "
              f"expanded K/V {c['expanded_per_layer']:7,.0f} / {c['expanded_per_token'] / 2**20:5.2f} MiB   "
              f"{c['ratio']:.1f}x smaller")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
