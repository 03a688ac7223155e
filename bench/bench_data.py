"""Pretraining data at scale: tokenization speed, loader speed against a training step, and the memory of a run on
a corpus over 1 GB against the bundled one. Everything is generated in a temporary directory and deleted.

    python bench/bench_data.py [--mb 16] [--big-gb 1.1] [--bpe-128k]

1. `python -m recipes.pretokenize` on a synthetic JSONL corpus (the bundled corpus's documents repeated to --mb MB),
   MB/s with 1 worker on 1 core (the per-worker rate) and with 1 worker per core; with --bpe-128k also with a 128K
   byte-level BPE trained here on synthetic words (uint32 tokens).
2. The memory-mapped loader (TokenData.pack) in tokens/s, against the tokens/s of the debug model's training step
   (both seq-len 512, single process).
3. Peak RSS and data start-up time of a 3-step `recipes.pretrain`: the bundled corpus and the --mb corpus (JSONL,
   and tokenized), and a dataset of more than --big-gb GB of tokens (the tokenized --mb corpus repeated, with a
   manifest as recipes.pretokenize writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipes.data import DOCUMENTS, FORMAT, MANIFEST, VERSION, TokenData, token_dtype  # noqa: E402
from recipes.data.tokenizer_choice import ASSETS, Tokenizer  # noqa: E402
from recipes.pretokenize import tokenizer_info  # noqa: E402

# peak RSS as VmHWM: getrusage's ru_maxrss keeps the forking parent's peak across exec, so it would report the
# bench process's own memory for a child that used less
RSS = """
import sys, time
t0 = time.perf_counter()
import recipes.data as d
from recipes import pretrain
orig = d.pretrain_data
def timed(*a, **k):
    t = time.perf_counter(); data = orig(*a, **k); print("data_s", time.perf_counter() - t); return data
pretrain.pretrain_data = timed
pretrain.main(sys.argv[1:])
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0], "= maxrss_kb")
"""


def env(threads: int | None = None) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if threads:
        e["RAYON_RS_NUM_CPUS"] = str(threads)
    return e


def make_corpus(path: Path, mb: float) -> None:
    docs = [line for line in (ASSETS / "corpus.jsonl").read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        size, k = 0, 0
        while size < mb * 1e6:
            line = docs[k % len(docs)] + "\n"
            f.write(line)
            size += len(line.encode())
            k += 1


TOKENIZE = """
import sys
from recipes import pretokenize
pretokenize.main(sys.argv[1:])
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0], "= maxrss_kb")
"""


def reported(pattern: str, output: str) -> str:
    """What a child process printed: the first group of `pattern` in its `output`."""
    m = re.search(pattern, output)
    if m is None:
        raise SystemExit(f"the child's output has no {pattern!r}:\n{output[-3000:]}")
    return m.group(1)


def tokenize(src: Path, out: Path, tokenizer: Path, workers: int, threads: int) -> tuple[float, float]:
    """MB/s as recipes.pretokenize reports it (hashing, tokenizing and writing; not interpreter start-up), and the
    main process's peak RSS in MB."""
    shutil.rmtree(out, ignore_errors=True)
    run = subprocess.run([sys.executable, "-c", TOKENIZE, str(src), str(out), "--tokenizer", str(tokenizer),
                          "--workers", str(workers), "--chunk-mb", "4", "--no-progress"], cwd=ROOT, env=env(threads),
                         capture_output=True, text=True, check=True)
    rss = int(reported(r"(\d+) = maxrss_kb", run.stdout)) / 1024
    return float(reported(r"\(([\d.]+) MB/s", run.stdout)), rss


def train_bpe_128k(tmp: Path) -> Path:
    """A 131,072-entry byte-level BPE trained on synthetic Zipf-distributed words (minutes of CPU at most)."""
    import itertools
    import random

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ea")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.choice([1, 2, 2, 3, 3, 4]))) for _ in range(400_000)]
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(len(words))))
    lines = (" ".join(rng.choices(words, cum_weights=cum, k=200)) for _ in range(20_000))
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=131_072, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    d = tmp / "bpe128k"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


def loader_tokens_per_s(ds: Path, tok: Tokenizer, seq_len: int = 512, packs: int = 2000) -> float:
    data = TokenData(ds, tok, seq_len, seed=0)
    data.pack(0)
    t0 = time.perf_counter()
    for g in range(packs):
        data.num_loss_tokens(g)
        data.pack(g)
    return packs * seq_len / (time.perf_counter() - t0)


def pretrain_run(data: Path | None, out: Path, steps: int = 3, seq_len: int = 512,
                 batch_tokens: int = 4096) -> dict:
    args = ["--steps", str(steps), "--save-every", "0", "--seq-len", str(seq_len), "--batch-tokens",
            str(batch_tokens), "--no-progress", "--device", "cpu", "--out", str(out), "--force"]
    if data is not None:
        args += ["--data", str(data)]
    run = subprocess.run([sys.executable, "-c", RSS, *args], cwd=ROOT, env=env(), capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"maxrss_mb": int(reported(r"(\d+) = maxrss_kb", run.stdout)) / 1024,
            "data_s": float(reported(r"data_s ([\d.e-]+)", run.stdout)),
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows[1:] or rows]))}


def make_big(small: Path, big: Path, gb: float, tok: Tokenizer) -> int:
    """A dataset of more than `gb` GB of tokens: the small dataset's stream repeated, one shard per copy."""
    m = json.loads((small / MANIFEST).read_text())
    stream = np.concatenate([np.fromfile(small / s["file"], dtype=m["dtype"]) for s in m["shards"]])
    starts = np.load(small / DOCUMENTS)[:-1]
    copies = int(gb * 1e9 // stream.nbytes) + 1
    big.mkdir()
    shards, doc_starts = [], []
    for k in range(copies):
        name = f"tokens-{k:05d}.bin"
        stream.tofile(big / name)
        shards.append({"file": name, "tokens": len(stream)})
        doc_starts.append(starts + k * len(stream))
    doc_starts.append(np.array([copies * len(stream)]))
    np.save(big / DOCUMENTS, np.concatenate(doc_starts).astype(np.int64))
    manifest = {"format": FORMAT, "version": VERSION, "dtype": token_dtype(tok.vocab_size),
                "documents": len(starts) * copies, "tokens": copies * len(stream), "shards": shards,
                "tokenizer": tokenizer_info(tok), "sources": [{"path": "synthetic", "bytes": 0, "sha256": ""}]}
    (big / MANIFEST).write_text(json.dumps(manifest))
    return copies * stream.nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=16, help="size of the synthetic JSONL corpus")
    p.add_argument("--big-gb", type=float, default=1.1, help="size of the large token dataset")
    p.add_argument("--bpe-128k", action="store_true", help="also train and measure a 128K-vocabulary BPE")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    tok = Tokenizer(ASSETS)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as t:
        tmp = Path(t)
        corpus = tmp / "corpus" / "c.jsonl"
        corpus.parent.mkdir()
        make_corpus(corpus, args.mb)
        print(f"1. tokenization of {args.mb:.0f} MB of JSONL ({cores} cores)")
        print(f"   {'tokenizer':<28} {'1 worker, 1 core MB/s':>22} {f'{cores} workers MB/s':>17} {'peak RSS MB':>12}")
        tokenizers = [("bundled (2,048, uint16)", ASSETS)]
        if args.bpe_128k:
            t0 = time.perf_counter()
            tokenizers.append(("BPE 131,072 (uint32)", train_bpe_128k(tmp)))
            print(f"   (the 128K BPE trained in {time.perf_counter() - t0:.0f} s)")
        for name, path in tokenizers:
            one, rss = tokenize(corpus, tmp / "ds", path, 1, 1)
            many, _ = tokenize(corpus, tmp / "ds", path, cores, 1)
            print(f"   {name:<28} {one:>22.1f} {many:>17.1f} {rss:>12.0f}")
        half = tmp / "corpus-half.jsonl"  # memory is bounded by a chunk, not the corpus: half the corpus, same peak
        make_corpus(half, args.mb / 2)
        rss_half = tokenize(half, tmp / "h", ASSETS, 1, 1)[1]
        print(f"   bundled tokenizer, {args.mb / 2:.0f} MB of JSONL: peak RSS {rss_half:.0f} MB")
        tokenize(corpus, tmp / "ds", ASSETS, 1, cores)

        print("2. loader vs training step (debug model, seq-len 512, one process)")
        loader = loader_tokens_per_s(tmp / "ds", tok)
        step = pretrain_run(tmp / "ds", tmp / "run-step", steps=4)["tokens_per_s"]
        print(f"   loader {loader:,.0f} tokens/s, training step {step:,.0f} tokens/s: loader {loader / step:.0f}x "
              "faster")

        print("3. 3-step recipes.pretrain: peak RSS and data start-up")
        small = tmp / "bundled"
        subprocess.run([sys.executable, "-m", "recipes.pretokenize", str(ASSETS / "corpus.jsonl"), str(small),
                        "--tokenizer", str(ASSETS), "--no-progress"], cwd=ROOT, env=env(), check=True,
                       capture_output=True)
        big = tmp / "big"
        nbytes = make_big(tmp / "ds", big, args.big_gb, tok)
        runs = [("bundled corpus (0.6 MB), JSONL", None), ("bundled corpus, tokenized", small),
                (f"{args.mb:.0f} MB corpus, JSONL", corpus), (f"{args.mb:.0f} MB corpus, tokenized", tmp / "ds"),
                (f"{nbytes / 1e9:.2f} GB of tokens, tokenized", big)]
        print(f"   {'data':<34} {'peak RSS MB':>12} {'data start-up s':>16}")
        for name, data in runs:
            r = pretrain_run(data, tmp / "run")
            print(f"   {name:<34} {r['maxrss_mb']:>12.0f} {r['data_s']:>16.3f}")


if __name__ == "__main__":
    main()
