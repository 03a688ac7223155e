"""One DPO step on CPU: zoo's packed pairs (recipes.dpo's step) vs TRL's DPOTrainer (padded, as it must be), the same
model, reference and pairs.

Pairs: log-normal prompts (median --prompt-words, 120) and answers (median --answer-words, 40), text through the
bundled tokenizer; a Llama of width 256, 4 layers, vocabulary 2048, and a different reference of the same shape.
With --family qwen3_5, a Qwen3.5 hybrid of the same width (three Gated DeltaNet layers to one gated attention;
add --batches "" to time zoo's two layouts alone).
One step = the policy's forward and backward and the reference's forward over every pair:
  zoo          PreferenceStep: each pair two documents, packed whole into 2048-token packs, gradients accumulated
  zoo_shared   the same with --share-prompt: each pair prompt + chosen + rejected, the prompt run once
  trl_bN       DPOTrainer.compute_loss + backward over micro-batches of N pairs, each right-padded to its longest
               sequence by TRL's collator (gradient accumulation over the micro-batches)
The variants run alternating in one process (medians over --reps); tokens/s counts the pairs' tokens as two
documents each (what every variant computes), "tokens run" what each ran (TRL's padding included; zoo_shared's
prompts once).
Peak memory: each variant's first step in a fresh process, RSS sampled every millisecond, minus RSS before it.

    python bench/bench_dpo.py [--pairs 32] [--reps 3] [--threads 2] [--prompt-words 120] [--answer-words 40]
    python bench/bench_dpo.py --device cuda --dim 2048 --layers 8 --ffn 5504 --batches ""   # zoo alone, GPU, bf16
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import cuda_peak_growth, memory_in_fresh_processes, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402
from recipes.data.preference import PreferenceData  # noqa: E402
from recipes.data.tokenizer_choice import ASSETS  # noqa: E402
from recipes.dpo import DPOConfig, PreferenceStep, Reference, SharedPromptAttention  # noqa: E402
from recipes.engine.processes import Dist  # noqa: E402
from zoo.io.tokenizer import Tokenizer  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which are be this had not were but "
         "they all one have their has been more when there who can will would said about into some other time "
         "could only then its also after first two over new years most").split()
SEQ_LEN = 2048


def write_pairs(path: Path, n: int, prompt_words: int, answer_words: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(median: float) -> str:
        k = max(1, min(600, int(math.exp(math.log(median) + 0.6 * rng.gauss(0, 1)))))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(prompt_words) + " ", "chosen": text(answer_words),
                                "rejected": text(answer_words)}) + "\n")


def make_checkpoint(path: Path, seed: int, dim: int = 256, layers: int = 4, ffn: int = 688,
                    family: str = "llama") -> None:
    import transformers

    common = dict(vocab_size=2048, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=dim // 64, num_key_value_heads=dim // 64, max_position_embeddings=4096,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "qwen3_5":  # three Gated DeltaNet layers to one gated attention, Qwen3.5-0.8B's head shapes
        cfg = transformers.Qwen3_5TextConfig(**common, head_dim=64, linear_num_key_heads=dim // 128,
                                             linear_num_value_heads=dim // 64, linear_key_head_dim=128,
                                             linear_value_head_dim=128, full_attention_interval=4)
        transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    else:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, path / f)


def zoo_step(root: Path, shared: bool, device: str = "cpu"):
    dtype = torch.bfloat16 if device == "cuda" else None  # the frozen reference in bf16 on a GPU; the policy fp32
    policy, ref = zoo.load(str(root / "policy"), device=device), zoo.load(str(root / "ref"), device=device, dtype=dtype)
    ref.requires_grad_(False)
    d = Dist(device=torch.device(device))
    context = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()
    data = PreferenceData(str(root / "pairs.jsonl"), Tokenizer(root / "policy"), SEQ_LEN, 0, share_prompt=shared)
    if shared:
        for m in (policy, ref):
            m.set_attention(SharedPromptAttention(m.attend))
    step = PreferenceStep(DPOConfig(), data)
    step.reference = Reference(model=ref)

    def run() -> None:
        policy.zero_grad(set_to_none=True)
        step(d, policy, data, 1, 1 << 20, context, balance=None)  # every pack of the data once

    tokens = sum(p.num_tokens for p in data.pairs)  # the two documents' tokens, the work done either way
    return run, tokens, data, sum(sum(data.seqlens(i)) for i in range(len(data)))


def trl_step(root: Path, batch: int):
    import transformers
    import trl
    from datasets import Dataset

    rows = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(root / "policy")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "policy")
    ref = transformers.AutoModelForCausalLM.from_pretrained(root / "ref")
    args = trl.DPOConfig(output_dir=str(root / "trl"), report_to="none", max_length=None, use_cpu=True, bf16=False,
                         per_device_train_batch_size=batch, gradient_checkpointing=False)
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tok)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    batches = [trainer.data_collator(examples[i : i + batch]) for i in range(0, len(rows), batch)]
    model.train()

    def run() -> None:
        model.zero_grad(set_to_none=True)
        for b in batches:
            (trainer.compute_loss(model, b) * len(b["input_ids"]) / 2 / len(rows)).backward()

    padded = sum(b["input_ids"].numel() for b in batches)
    return run, padded


def build(variant: str, root: Path, device: str = "cpu"):
    if variant in ("zoo", "zoo_shared"):
        run, tokens, data, ran = zoo_step(root, variant == "zoo_shared", device)
        return run, {"tokens": tokens, "padded": ran, "packs": len(data)}
    run, padded = trl_step(root, int(variant.removeprefix("trl_b")))
    return run, {"padded": padded}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="8,32", help="TRL micro-batch sizes (pairs), comma-separated")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--family", default="llama", choices=("llama", "qwen3_5"),
                   help="qwen3_5: a hybrid (Gated DeltaNet and attention layers), whose answers continue the prompt's "
                        "recurrent state in the shared layout")
    p.add_argument("--prompt-words", type=int, default=120)
    p.add_argument("--answer-words", type=int, default=40)
    p.add_argument("--dir", help="(internal) the prepared directory")
    p.add_argument("--memory-of", help="(internal) measure one variant's peak step memory in this process")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants = ["zoo", "zoo_shared", *(f"trl_b{b}" for b in args.batches.split(",") if b)]
    if args.memory_of:
        run, _ = build(args.memory_of, Path(args.dir))
        print(json.dumps({"peak": peak_rss_growth(run)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_checkpoint(root / "policy", 0, args.dim, args.layers, args.ffn, args.family)
        make_checkpoint(root / "ref", 1, args.dim, args.layers, args.ffn, args.family)
        write_pairs(root / "pairs.jsonl", args.pairs, args.prompt_words, args.answer_words)
        built = {v: build(v, root, args.device) for v in variants}
        tokens = built["zoo"][1]["tokens"]
        times = time_alternating({v: b[0] for v, b in built.items()}, args.reps, device=args.device)
        if args.device == "cuda":  # the caching allocator's peak, in this process
            mem = {v: cuda_peak_growth(b[0]) for v, b in built.items()}
        else:
            mem = memory_in_fresh_processes(__file__, variants, ["--dir", str(root), "--threads", str(args.threads),
                                                                 "--batches", args.batches])
    print(f"{args.pairs} pairs (prompts ~{args.prompt_words} words, answers ~{args.answer_words}), {tokens} tokens "
          f"as two documents each; zoo packs them into {built['zoo'][1]['packs']} packs of {SEQ_LEN} "
          f"({built['zoo_shared'][1]['packs']} shared); {args.device}, {args.family}, width {args.dim}, "
          f"{args.layers} layers, "
          f"threads {args.threads}, median of {args.reps}")
    print(f"{'variant':<10} {'s/step':>8} {'tokens/s':>9} {'tokens run':>11} {'peak MB':>8}")
    for v in variants:
        s = statistics.median(times[v])
        print(f"{v:<10} {s:8.3f} {tokens / s:9.0f} {built[v][1]['padded']:11d} {mem[v] / 2**20:8.0f}")


if __name__ == "__main__":
    main()
