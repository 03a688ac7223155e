"""GPT-OSS at gpt-oss-20b's widths: a sliding and a full layer, a training step, and what sinks cost per backend.

zoo against transformers' GptOssForCausalLM on the same weights (transformers' random init, converted to zoo's layout
by the loader's own plan) and the same pack of log-normal documents (transformers fed the stream with position_ids
restarting per document, labels -100 at each document's first token). Widths are gpt-oss-20b's: hidden 2880, 64
query heads and 8 KV heads of 64, sinks, experts of width 2880 (top 4), window 128 on the sliding layer.

  layer   forward + backward of a model of one sliding and one full layer (vocab 1024: the head costs ~nothing)
  step    forward + backward + AdamW of a model of `--step-layers` layers (vocab --vocab)
  sinks   attention alone at GPT-OSS's head shape, packed, forward + backward: each zoo backend without a score
          modifier, with sinks, with Gemma 2's softcap (50), and on the sliding window (128) with and without sinks

Variants (layer, step): zoo_<backend> (experts by pick_kernel), zoo_padded (padded_bmm forced), and hf_<attention>_
<experts> for the attention implementations that take sinks on the device (CPU: eager alone, transformers refuses
sdpa for GPT-OSS and flex with sinks on CPU; CUDA: eager, flex, and the flash kernels transformers lists for GPT-OSS
where they load) and the experts implementations (eager: a loop over experts; grouped_mm; batched_mm gathers each
token's 4 experts' weights, ~200 MB a token in bf16 at this width: --with-batched).
transformers gets its document masks prepared (`document_masks`: its GPT-OSS forward drops the position_ids its mask
functions need, so a pack fed as other families' attends across documents).
Before timing each variant's first loss must equal zoo's (fp32: 1e-4 relative; bf16: 2e-2). Medians of alternating
runs (CUDA events on a GPU); memory: CUDA's peak allocation during one call, or on CPU the peak RSS growth of one
call after the warm-up (activations and gradients; weights and optimizer state are counted apart as `static`).
CPU defaults shrink the expert count (--experts 8: each token's work is unchanged, top 4 of width 2880, the weights
4x fewer) and the tokens; the step runs one layer there.

    python bench/bench_gpt_oss.py [--device cpu|cuda] [--parts layer,step,sinks] [--tokens N] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import lognormal_lengths, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402
from zoo.core import attention, moe  # noqa: E402

# gpt-oss-20b's widths (its config.json), and a tiny shape for the CPU smoke test
SHAPES = {
    "20b": dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                num_local_experts=32, num_experts_per_tok=4, sliding_window=128, vocab_size=201088),
    "tiny": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                 num_local_experts=8, num_experts_per_tok=4, sliding_window=16, vocab_size=256),
}
GEMMA2_SOFTCAP = 50.0
PICK_KERNEL = moe.pick_kernel


def hf_model(shape: dict, layers: int, vocab: int, device: str, dtype: torch.dtype):
    """transformers' GptOssForCausalLM, seeded, sinks and the router drawn wide (sinks matter, no expert ties)."""
    import transformers

    cfg = transformers.GptOssConfig(**{**shape, "vocab_size": vocab}, num_hidden_layers=layers,
                                    layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
                                    max_position_embeddings=4096, eos_token_id=None, pad_token_id=None,
                                    bos_token_id=None)
    cfg._attn_implementation, cfg._experts_implementation = "eager", "eager"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5 / shape["hidden_size"] ** 0.5 * 8)
    return model.to(dtype).train()


def zoo_from(hf, attn: str):
    """zoo's GPT-OSS holding a converted copy of transformers' weights (the loader's plan: experts transposed and
    de-interleaved)."""
    from zoo.models.decoder import Decoder
    from zoo.models.gpt_oss import config_from_hf, plan_from_hf

    p = next(hf.parameters())
    cfg = config_from_hf(hf.config.to_dict())
    with torch.device(p.device):
        model = Decoder(cfg, attn=attn).to(p.dtype)
    theirs = hf.state_dict()
    mine = model.state_dict()
    with torch.no_grad():
        for name, (sources, combine) in plan_from_hf(cfg, list(mine)).items():
            t = [theirs[s] for s in sources]
            mine[name].copy_(combine(t) if combine else t[0])
    return model.train()


def hf_inputs(docs: list[torch.Tensor], device: str):
    ids = torch.cat(docs)[None].to(device)
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None].to(device)
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([len(d) for d in docs]), 0)[:-1]] = -100  # no target across documents
    return ids, pos, labels


FLASH_WITH_SINKS = ("flash_attention_4", "kernels-community/vllm-flash-attn3")  # GPT-OSS's compatible kernels


def document_masks(hf, ids: torch.Tensor, pos: torch.Tensor) -> dict:
    """transformers' own masks of the pack for its current attention implementation, made from the position_ids.
    transformers 5.23's GptOssModel does not pass position_ids to its mask functions, so a pack fed as in the other
    families (position_ids restarting per document, no mask) attends across documents; the masks made here (once,
    outside the timed calls) are what it would build with them, handed in as the prepared mapping it accepts."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = dict(config=hf.config, inputs_embeds=hf.get_input_embeddings()(ids), attention_mask=None,
              past_key_values=None, position_ids=pos)
    return {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw)}


def hf_attention_impls(device: str, hf=None) -> tuple[dict[str, str], dict[str, str]]:
    """{label: the value of config._attn_implementation} of transformers' GPT-OSS attention implementations that take
    sinks here, and {implementation: why not} for the others. transformers maps a flash_attention_2/3 request to the
    kernels GPT-OSS lists as compatible (those that take sinks); with `hf` given on CUDA each is tried."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    ok, why = {"eager": "eager"}, {}
    if not GptOssPreTrainedModel._supports_sdpa:
        why["sdpa"] = "transformers' GPT-OSS declares no sdpa support (sdpa has no sink)"
    if device == "cpu":
        why["flex_attention"] = "transformers refuses sinks with flex on CPU (its CPU flex returns no lse)"
        why["flash"] = "CUDA only"
        return ok, why
    ok["flex"] = "flex_attention"
    for impl in FLASH_WITH_SINKS:
        if hf is None:
            continue
        try:
            hf.set_attn_implementation(impl)
            ok[impl.rpartition("/")[2]] = hf.config._attn_implementation
        except Exception as e:  # noqa: BLE001  # whatever the loader raises: not here, say why
            why[impl] = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if hf is not None:
        hf.config._attn_implementation = "eager"
    return ok, why


def variants(hf, docs, device: str, zoo_attns: list[str], experts_impls: list[str],
             optimizer: bool) -> tuple[dict, dict[str, float], dict[str, str]]:
    """{variant: fn() running one call}, and each variant's first loss (checked against zoo's by the caller). One zoo
    model and one transformers model (each with its own AdamW), switched between backends before each call."""
    hf_attns, refused = hf_attention_impls(device, hf)
    packed = zoo.pack(docs).to(device)
    ids, pos, labels = hf_inputs(docs, device)
    zoo_model = zoo_from(hf, zoo_attns[0])
    opts = {model: torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None for model in (zoo_model, hf)}
    steps, first = {}, {}

    def zoo_loss():
        return zoo_model.loss(packed)

    masks: dict[str, dict] = {}

    def hf_loss():
        return hf(input_ids=ids, position_ids=pos, labels=labels, attention_mask=masks[hf.config._attn_implementation],
                  use_cache=False).loss

    choices: list[tuple[str, Any, Callable[[], Any], tuple[str, str | None]]] = [
        (f"zoo_{a}", zoo_model, zoo_loss, (a, None)) for a in zoo_attns]
    choices.append(("zoo_padded", zoo_model, zoo_loss, (zoo_attns[0], "padded_bmm")))
    choices += [(f"hf_{label}_{e}", hf, hf_loss, (a, e)) for label, a in hf_attns.items() for e in experts_impls]
    for name, model, loss_fn, (attn, kernel) in choices:
        if model is zoo_model:
            def setup(attn=attn, kernel=kernel):
                zoo_model.set_attention(attn)
                moe.pick_kernel = (lambda *a, k=kernel: k) if kernel else PICK_KERNEL  # type: ignore[assignment]
        else:
            def setup(attn=attn, experts=kernel):
                hf.config._attn_implementation, hf.config._experts_implementation = attn, experts
            setup()
            masks[attn] = document_masks(hf, ids, pos)

        def call(model=model, loss_fn=loss_fn, setup=setup, opt=opts[model]):
            setup()
            loss_fn().backward()
            if opt is not None:
                opt.step()
            model.zero_grad(set_to_none=True)
        setup()
        first[name] = loss_fn().item()
        steps[name] = call
    moe.pick_kernel = PICK_KERNEL
    return steps, first, refused


def measure(steps: dict, reps: int, device: str, tokens: int) -> dict[str, dict]:
    times = time_alternating(steps, reps, device=device)
    rows: dict[str, dict[str, Any]] = {}
    for v, fn in steps.items():
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            mem = torch.cuda.max_memory_allocated() - base
        else:
            mem = peak_rss_growth(fn)
        t = statistics.median(times[v])
        rows[v] = {"ms": t * 1e3, "tokens_per_s": tokens / t, "peak_mb": mem / 2**20,
                   "times_ms": [round(x * 1e3, 2) for x in times[v]]}
    ref = rows[next(iter(rows))]["ms"]
    for row in rows.values():
        row["vs_first"] = row["ms"] / ref
    return rows


def model_part(part: str, args, shape: dict, docs, dtype: torch.dtype) -> dict:
    layers = 2 if part == "layer" else args.step_layers
    vocab = 1024 if part == "layer" else args.vocab
    hf = hf_model(shape, layers, vocab, args.device, dtype)
    static = sum(p.numel() * p.element_size() for p in hf.parameters())
    steps, first, refused = variants(hf, docs, args.device, args.zoo_attn, args.experts_impl, part == "step")
    ref = first[next(iter(first))]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for v, loss in first.items():
        if abs(loss - ref) > tol * max(1.0, abs(ref)):
            raise SystemExit(f"{part} {v}: loss {loss:.6f} differs from zoo's {ref:.6f} (tolerance {tol})")
    rows = measure(steps, args.reps, args.device, sum(len(d) for d in docs))
    for v in rows:
        rows[v]["loss"] = first[v]
    moe.pick_kernel = PICK_KERNEL
    kernel = PICK_KERNEL(torch.empty(1, shape["hidden_size"], device=args.device, dtype=dtype),
                             shape["hidden_size"], shape["intermediate_size"])
    return {"layers": layers, "vocab": vocab, "hf_attention_refused": refused,
            "static_mb_per_model": static / 2**20 * (3 if part == "step" else 1),
            "zoo_moe_kernel": kernel, "rows": rows}


def sinks_part(args, shape: dict, docs, dtype: torch.dtype) -> dict:
    """Attention alone: for each backend, no modifier vs sinks vs softcap (window None), and window 128 +- sinks."""
    N, K, H, W = (shape[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window"))
    packed = zoo.pack(docs).to(args.device)
    T = int(packed.cu_seqlens[-1].item())
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(T, n, H, generator=g).to(args.device, dtype) for n in (N, K, K, N))
    sinks = torch.randn(N, generator=g).to(args.device, dtype)
    mods: dict[str, dict[str, Any]] = {"plain": {}, "sinks": {"sinks": sinks}, "softcap": {"softcap": GEMMA2_SOFTCAP},
            f"window {W}": {"window": W}, f"window {W} + sinks": {"window": W, "sinks": sinks}}
    backends = args.sinks_backends or [b for b in attention.available_backends(args.device) if b != "auto"]
    cpu = args.device == "cpu"
    out: dict[str, dict] = {}
    with torch.no_grad():
        ref = {m: attention.eager(q, k, v, packed, **kw) for m, kw in mods.items()}
    for backend in backends:
        fn = attention.get_attention(backend)
        train = not (cpu and backend == "flex")  # torch has no CPU backward for FlexAttention

        def call(kw, fn=fn, train=train):
            qi, ki, vi = (t.detach().requires_grad_(train) for t in (q, k, v))
            kw = {**kw, "sinks": kw["sinks"].detach().requires_grad_(train)} if "sinks" in kw else kw
            with torch.set_grad_enabled(train):
                o = fn(qi, ki, vi, packed, **kw)
                if train:
                    o.backward(do)
            return o
        calls = {m: (lambda kw=kw, call=call: call(kw)) for m, kw in mods.items()}
        for m in mods:  # the same function everywhere first
            err = ((calls[m]().float() - ref[m].float()).abs().max() / ref[m].float().abs().max()).item()
            if err > (1e-4 if dtype == torch.float32 else 2e-2):
                raise SystemExit(f"sinks part: {backend} {m} differs from eager by {err:.2e}")
        times = time_alternating(calls, args.reps, device=args.device)
        plain = statistics.median(times["plain"])
        out[backend] = {"pass": "forward + backward" if train else "forward only (no CPU backward)",
                        **{m: {"ms": statistics.median(t) * 1e3, "vs_plain": statistics.median(t) / plain}
                           for m, t in times.items()}}
    return {"tokens": T, "describe": attention.describe(args.device, dtype), "rows": out}


def print_rows(title: str, rows: dict[str, dict]) -> None:
    print(title)
    print(f"{'variant':<28} {'median ms':>10} {'tokens/s':>10} {'vs first':>9} {'peak MB':>9} {'loss':>10}")
    for v, r in rows.items():
        print(f"{v:<28} {r['ms']:>10.1f} {r['tokens_per_s']:>10.0f} {r['vs_first']:>8.2f}x {r['peak_mb']:>9.0f} "
              f"{r['loss']:>10.5f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="20b", choices=list(SHAPES))
    p.add_argument("--parts", default="layer,step,sinks")
    p.add_argument("--tokens", type=int, help="tokens of the pack (default: 4096 on CUDA, 512 on CPU)")
    p.add_argument("--sinks-tokens", type=int, help="tokens of the attention pack (default: 32768 CUDA, 2048 CPU)")
    p.add_argument("--sinks-backends", type=lambda v: v.split(","), help="zoo backends of the sinks part "
                   "(default: every one that runs here)")
    p.add_argument("--experts", type=int, help="experts per layer (default: the shape's on CUDA, 8 on CPU)")
    p.add_argument("--step-layers", type=int, help="layers of the step's model (default: 2 on CUDA, 1 on CPU)")
    p.add_argument("--vocab", type=int, help="the step's vocabulary (default: the shape's on CUDA, 8192 on CPU)")
    p.add_argument("--zoo-attn", help="zoo backends, comma-separated (default: flash_varlen,flex on CUDA, sdpa on CPU)")
    p.add_argument("--experts-impl", default="eager,grouped_mm", help="transformers' experts implementations")
    p.add_argument("--with-batched", action="store_true", help="also transformers' batched_mm (memory-hungry)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = dict(SHAPES[args.shape])
    shape["num_local_experts"] = args.experts or (shape["num_local_experts"] if cuda else min(8, shape[
        "num_local_experts"]))
    args.tokens = args.tokens or (4096 if cuda else 512)
    args.step_layers = args.step_layers or (2 if cuda else 1)
    args.vocab = args.vocab or (shape["vocab_size"] if cuda else min(8192, shape["vocab_size"]))
    args.zoo_attn = (args.zoo_attn or ("flash_varlen,flex" if cuda else "sdpa")).split(",")
    args.experts_impl = args.experts_impl.split(",") + (["batched_mm"] if args.with_batched else [])
    W = shape["sliding_window"]
    # documents of mixed length, many longer than the window, none over half the pack
    lens = lognormal_lengths(args.tokens, median=W, cap=min(8 * W, args.tokens // 2), seed=1)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in lens]  # every vocab holds them
    import transformers

    _, refused = hf_attention_impls(args.device)
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "transformers": transformers.__version__, "dtype": str(dtype), "shape": shape,
                 "documents": lens, "threads": args.threads, "hf_attention_refused": refused}
    print(f"GPT-OSS {args.shape}: d={shape['hidden_size']}, {shape['num_attention_heads']}/"
          f"{shape['num_key_value_heads']} heads of {shape['head_dim']}, {shape['num_local_experts']} experts of "
          f"{shape['intermediate_size']} (top {shape['num_experts_per_tok']}), window {W}; {dtype}, {res['device']}; "
          f"{len(lens)} documents / {args.tokens} tokens (median {statistics.median(lens):.0f}, max {max(lens)})")
    for impl, why in refused.items():
        print(f"transformers {impl}: {why}")
    for part in args.parts.split(","):
        if part in ("layer", "step"):
            res[part] = model_part(part, args, shape, docs, dtype)
            r = res[part]
            print_rows(f"\n{part}: {r['layers']} layer(s), vocab {r['vocab']}, "
                       f"{'forward + backward + AdamW' if part == 'step' else 'forward + backward'}; zoo's experts "
                       f"{r['zoo_moe_kernel']}; weights{' + AdamW' if part == 'step' else ''} "
                       f"{r['static_mb_per_model']:.0f} MB a model", r["rows"])
        elif part == "sinks":
            S = args.sinks_tokens or (32768 if cuda else 2048)
            slens = lognormal_lengths(S, median=4 * W, cap=min(16 * W, S // 2), seed=1)
            res["sinks"] = r = sinks_part(args, shape, [torch.zeros(n, dtype=torch.long) for n in slens], dtype)
            print(f"\nattention alone, {r['tokens']} tokens in {len(slens)} documents, ms (x the plain call)")
            for backend, row in r["rows"].items():
                cells = "  ".join(f"{m} {c['ms']:.1f} ({c['vs_plain']:.2f}x)" for m, c in row.items() if m != "pass")
                print(f"{backend:<13} {row['pass']}: {cells}")
        else:
            p.error(f"unknown part {part!r}; expected layer, step or sinks")
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
