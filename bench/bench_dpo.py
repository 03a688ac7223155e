"""One DPO step on CPU: zoo's packed pairs (recipes.dpo's step) vs TRL's DPOTrainer (padded, as it must be), the same
model, reference and pairs.

Pairs: log-normal prompts (median ~120 words) and answers (median ~40), text through the bundled tokenizer; a
Llama of width 256, 4 layers, vocabulary 2048, and a different reference of the same shape. One step = the policy's
forward and backward and the reference's forward over every pair:
  zoo          PreferenceStep: pairs packed whole into --seq-len packs, gradients accumulated over the packs
  trl_bN       DPOTrainer.compute_loss + backward over micro-batches of N pairs, each right-padded to its longest
               sequence by TRL's collator (gradient accumulation over the micro-batches)
The variants run alternating in one process (medians over --reps); tokens/s counts real tokens (no padding).
Peak memory: each variant's first step in a fresh process, RSS sampled every millisecond, minus RSS before it.

    python bench/bench_dpo.py [--pairs 32] [--reps 3] [--threads 2]
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

from common import memory_in_fresh_processes, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402
from recipes.data.preference import PreferenceData  # noqa: E402
from recipes.dpo import DPOConfig, PreferenceStep, Reference  # noqa: E402
from recipes.processes import Dist  # noqa: E402
from recipes.tokenizer import ASSETS  # noqa: E402
from zoo.io.tokenizer import Tokenizer  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which are be this had not were but "
         "they all one have their has been more when there who can will would said about into some other time "
         "could only then its also after first two over new years most").split()
SEQ_LEN = 2048


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(median: float) -> str:
        k = max(1, min(600, int(math.exp(math.log(median) + 0.6 * rng.gauss(0, 1)))))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(120) + " ", "chosen": text(40), "rejected": text(40)}) + "\n")


def make_checkpoint(path: Path, seed: int) -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, path / f)


def zoo_step(root: Path):
    policy, ref = zoo.load(str(root / "policy")), zoo.load(str(root / "ref"))
    ref.requires_grad_(False)
    data = PreferenceData(str(root / "pairs.jsonl"), Tokenizer(root / "policy"), SEQ_LEN, 0)
    step = PreferenceStep(DPOConfig(), Dist(), data, Reference(model=ref))

    def run() -> None:
        policy.zero_grad(set_to_none=True)
        step(Dist(), policy, data, 1, 1 << 20, nullcontext())  # every pack of the data once

    tokens = sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in data.pairs)
    return run, tokens, data


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


def build(variant: str, root: Path):
    if variant == "zoo":
        run, tokens, data = zoo_step(root)
        return run, {"tokens": tokens, "padded": tokens, "packs": len(data)}
    run, padded = trl_step(root, int(variant.removeprefix("trl_b")))
    return run, {"padded": padded}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="8,32", help="TRL micro-batch sizes (pairs), comma-separated")
    p.add_argument("--dir", help="(internal) the prepared directory")
    p.add_argument("--memory-of", help="(internal) measure one variant's peak step memory in this process")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants = ["zoo", *(f"trl_b{b}" for b in args.batches.split(","))]
    if args.memory_of:
        run, _ = build(args.memory_of, Path(args.dir))
        print(json.dumps({"peak": peak_rss_growth(run)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_checkpoint(root / "policy", 0)
        make_checkpoint(root / "ref", 1)
        write_pairs(root / "pairs.jsonl", args.pairs)
        built = {v: build(v, root) for v in variants}
        tokens = built["zoo"][1]["tokens"]
        times = time_alternating({v: b[0] for v, b in built.items()}, args.reps)
        mem = memory_in_fresh_processes(__file__, variants, ["--dir", str(root), "--threads", str(args.threads),
                                                             "--batches", args.batches])
    print(f"{args.pairs} pairs, {tokens} real tokens; zoo packs them into {built['zoo'][1]['packs']} packs of "
          f"{SEQ_LEN}; threads {args.threads}, median of {args.reps}")
    print(f"{'variant':<10} {'s/step':>8} {'tokens/s':>9} {'padded tokens':>14} {'peak MB':>8}")
    for v in variants:
        s = statistics.median(times[v])
        print(f"{v:<10} {s:8.3f} {tokens / s:9.0f} {built[v][1]['padded']:14d} {mem[v] / 2**20:8.0f}")


if __name__ == "__main__":
    main()
