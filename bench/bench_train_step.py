"""One training step (forward, backward, AdamW) on a realistic packed batch: zoo vs transformers, CPU.

Documents have log-normal lengths (median ~200 tokens, capped at 2048), packed to 4096 tokens. Same weights and
data for every variant; the variants run alternating in one process and the medians are compared:
  zoo             zoo.load(HF_DIR, attn=...) ; model.loss(packed)             one packed stream, no mask
  hf_packed       transformers (sdpa) with position_ids restarting per document (builds a dense T x T mask)
  hf_packed_eager the same with attn_implementation="eager"
  hf_padded       transformers on a right-padded [n_docs, longest] batch with attention_mask
  hf_per_doc      transformers one document at a time, losses weighted by tokens, one optimizer step
Peak memory: each variant's first step in a fresh process, RSS sampled every millisecond, minus RSS before it.

    python bench/bench_train_step.py [--reps 5] [--threads 2] [--skip-padded]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import memory_in_fresh_processes, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, TOKENS = 8000, 256, 4, 4, 4, 688, 4096


def make_docs(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < TOKENS:
        n = int(math.exp(math.log(200) + 1.0 * torch.randn(1, generator=g).item()))
        n = max(2, min(n, 2048, TOKENS - total))
        if TOKENS - total - n == 1:
            n += 1
        docs.append(torch.randint(0, VOCAB, (n,), generator=g))
        total += n
    return docs


def make_hf(path: Path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def build(variant: str, hf_dir: Path, docs: list[torch.Tensor], attn: str):
    """(model, step function) for one variant."""
    import transformers

    if variant == "zoo":
        model = zoo.load(hf_dir, attn=attn)
        packed = zoo.pack(docs)

        def loss_backward():
            model.loss(packed).backward()
    else:
        impl = "eager" if variant.endswith("_eager") else "sdpa"
        model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=impl)
        model.train()
        if variant in ("hf_packed", "hf_packed_eager"):
            ids = torch.cat(docs)[None]
            pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
            labels = ids.clone()
            labels[0, torch.cumsum(torch.tensor([len(d) for d in docs]), 0)[:-1]] = -100  # no cross-doc target

            def loss_backward():
                # use_cache=False: with a cache transformers 5 skips its packed-sequence detection and attends
                # across documents (plain causal over the whole pack)
                model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
        elif variant == "hf_padded":
            longest = max(len(d) for d in docs)
            ids = torch.zeros(len(docs), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, d in enumerate(docs):
                ids[i, : len(d)], mask[i, : len(d)] = d, 1
            labels = ids.masked_fill(mask == 0, -100)

            def loss_backward():
                model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        elif variant == "hf_per_doc":
            n_targets = sum(len(d) - 1 for d in docs)

            def loss_backward():
                for d in docs:
                    out = model(input_ids=d[None], labels=d[None])
                    (out.loss * (len(d) - 1) / n_targets).backward()
        else:
            raise ValueError(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def peak_memory(variant: str, hf_dir: Path, attn: str) -> int:
    """Peak RSS growth during the first training step (optimizer state included), in a fresh process."""
    _, step = build(variant, hf_dir, make_docs(), attn)
    return peak_rss_growth(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--skip-padded", action="store_true")
    p.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: measure one variant's memory
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps({"peak": peak_memory(args.memory_of, Path(args.hf_dir), args.attn)}))
        return

    variants = ["zoo", "hf_packed", "hf_packed_eager", "hf_per_doc"] + ([] if args.skip_padded else ["hf_padded"])
    docs = make_docs()
    lens = [len(d) for d in docs]
    print(f"batch: {len(docs)} documents, {sum(lens)} tokens, median {statistics.median(lens):.0f}, "
          f"max {max(lens)}; model: Llama {LAYERS} layers, d={DIM}, vocab {VOCAB}; torch threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        make_hf(hf_dir)
        steps = {v: build(v, hf_dir, docs, args.attn)[1] for v in variants}
        times = time_alternating(steps, args.reps)
        del steps
        mem = memory_in_fresh_processes(__file__, variants, ["--hf-dir", str(hf_dir), "--threads", str(args.threads),
                                                            "--attn", args.attn])

    tok_s = {v: TOKENS / statistics.median(t) for v, t in times.items()}
    print(f"\n{'variant':<16} {'median s/step':>14} {'tokens/s':>10} {'zoo speed-up':>13} {'peak step MB':>13}")
    for v in variants:
        print(f"{v:<16} {statistics.median(times[v]):>14.3f} {tok_s[v]:>10.0f} {tok_s['zoo'] / tok_s[v]:>12.2f}x "
              f"{mem[v] / 2**20:>13.0f}")
    print(f"\ntargets: zoo >= 5x hf_packed: {tok_s['zoo'] / tok_s['hf_packed']:.2f}x (sdpa), "
          f"{tok_s['zoo'] / tok_s['hf_packed_eager']:.2f}x (eager); "
          f">= 1.2x hf_per_doc: {tok_s['zoo'] / tok_s['hf_per_doc']:.2f}x; "
          f"peak memory below hf_packed: {mem['zoo'] / 2**20:.0f} MB vs {mem['hf_packed'] / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
