"""python -m recipes.pretokenize SRC OUT --tokenizer DIR: pretraining text into a dataset read by memory map.

SRC is a JSONL file ({"text": ...} per line) or a directory of *.jsonl (and *.parquet with a `text` column, read
through pyarrow when it is installed). OUT becomes a directory that `python -m recipes.pretrain --data OUT` reads
without tokenizing or loading the corpus:

- tokens-NNNNN.bin: the token stream, raw little-endian uint16 (when the tokenizer's largest id is at most 65,535)
  or uint32, one shard per chunk of the sources (chunks are cut at line ends, about --chunk-mb of text each);
- documents.npy: int64 [documents + 1], where each document starts in the concatenated stream, then its length;
- manifest.json: format and version, the tokenizer's hash and special ids, every source's path, size and sha256,
  the shards and their token counts, documents, tokens, dtype.

Documents are wrapped as PretrainData wraps them (<s> ids </s>, an empty document dropped), in the order the JSONL
path reads them (files sorted, lines in order), so the stream and every pack are the same. Memory is bounded by a
batch of lines per worker and the document index (8 bytes a document), never by the corpus; a line (or Parquet
row) longer than recipes.data.jsonl.MAX_LINE_BYTES (16 MiB) is refused, as the JSONL path refuses it, found without
reading it whole. OUT is written to a temporary directory and renamed when complete; running again on unchanged
sources with the same tokenizer does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from recipes.data import (
    DOCUMENTS,
    FORMAT,
    MANIFEST,
    VERSION,
    check_line,
    is_dataset,
    jsonl,
    read_manifest,
    text_of,
    token_dtype,
    tokenizer_hash,
    wrap,
)
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.engine.command import cli
from zoo.errors import ArgumentParser, ZooError
from zoo.io.atomic import alive
from zoo.io.paths import inside
from zoo.io.tokenizer import Tokenizer

SUFFIXES = (".jsonl", ".parquet")
BATCH_BYTES = 1 << 20  # text encoded per encode_batch call: a worker holds about this much, plus its tokens


def sources(src: Path) -> list[Path]:
    """SRC itself, or every *.jsonl / *.parquet under it, sorted; each a regular file inside SRC."""
    if src.is_file():
        if src.suffix not in SUFFIXES:
            raise ZooError(f"{src}: expected a .jsonl or .parquet file, or a directory of them")
        return [src]
    if not src.is_dir():
        what = "is not a regular file (a FIFO or device never ends)" if src.exists() else "does not exist"
        raise ZooError(f"{src} {what}: expected a .jsonl or .parquet file, or a directory of them")
    root = src.resolve()
    files = sorted(f for f in src.rglob("*") if f.suffix in SUFFIXES and (f.is_file() or f.is_symlink()))
    for f in files:
        if not f.resolve().is_relative_to(root) or not f.is_file():
            raise ZooError(f"{f}: resolves to {f.resolve()}, which is not a regular file inside {root}")
    if not files:
        raise ZooError(f"no .jsonl or .parquet files under {src}")
    return files


def _pyarrow(f: Path) -> tuple[ModuleType, tuple[type[Exception], ...]]:
    """pyarrow.parquet, and what it raises on a file that is not Parquet or is damaged (text renamed .parquet, a
    truncated copy): ArrowInvalid is a ValueError, a footer that does not parse an OSError."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ZooError(f"{f}: reading Parquet needs pyarrow (pip install pyarrow), or convert the data to "
                       "JSONL") from e
    return pq, (OSError, ValueError, pyarrow.ArrowException)


def _unreadable(f: Path, e: Exception) -> ZooError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return ZooError(f"{f}: expected a Parquet file, got one pyarrow cannot read ({first}); check the file, or give "
                    "JSONL sources the suffix .jsonl")


# a source's chunk: (start byte, end byte, first line number) of JSONL, (row group, None, first row) of Parquet
Chunk = tuple[int, int | None, int]


def scan(f: Path, chunk_bytes: int) -> tuple[dict[str, Any], list[Chunk]]:
    """One pass over a source: its size and sha256, and its chunks: (start byte, end byte, first line number) cut
    at line ends for JSONL, (row group, None, first row) for Parquet."""
    h, size = hashlib.sha256(), 0
    chunks: list[Chunk] = []
    start, first, lines = 0, 1, 0
    with f.open("rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
            while f.suffix == ".jsonl" and start + chunk_bytes < size + len(block):
                j = block.find(b"\n", max(start + chunk_bytes - size, 0))
                if j < 0:
                    break
                chunks.append((start, size + j + 1, first))
                first = lines + block.count(b"\n", 0, j + 1) + 1
                start = size + j + 1
            lines += block.count(b"\n")
            size += len(block)
    if f.suffix == ".jsonl" and start < size:
        chunks.append((start, size, first))
    if f.suffix == ".parquet":
        pq, errors = _pyarrow(f)
        try:
            meta = pq.ParquetFile(f).metadata
        except errors as e:
            raise _unreadable(f, e) from e
        row = 1
        for g in range(meta.num_row_groups):
            chunks.append((g, None, row))
            row += meta.row_group(g).num_rows
    return {"bytes": size, "sha256": h.hexdigest()}, chunks


def _texts(f: Path, chunk: Chunk) -> Iterator[tuple[int, str]]:
    """(line or row number, text) of one chunk."""
    if f.suffix == ".parquet":
        yield from _parquet_texts(f, chunk)
        return
    start, end, n = chunk
    assert end is not None, chunk  # a JSONL chunk ends at a line end (scan)
    with f.open("rb") as fh:
        fh.seek(start)
        pos = start
        while pos < end:
            raw = jsonl.read_line(fh, f, n)
            pos += len(raw)
            obj = check_line(f, n, raw)
            if obj is not None:
                yield n, text_of(f, n, obj)
            n += 1


def _parquet_texts(f: Path, chunk: Chunk) -> Iterator[tuple[int, str]]:
    """(row number, text) of one row group, each text held to the bound of a JSONL line."""
    group, _, row = chunk
    pq, errors = _pyarrow(f)
    try:
        pf = pq.ParquetFile(f)
        if "text" not in pf.schema_arrow.names:
            raise ZooError(f"{f}: expected a 'text' column, got columns {pf.schema_arrow.names}")
        for batch in pf.iter_batches(row_groups=[group], columns=["text"], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise ZooError(f"{f}: row {row}: expected a string in column 'text', got {type(text).__name__}")
                limit = jsonl.MAX_LINE_BYTES
                if len(text) > limit or (4 * len(text) > limit and len(text.encode("utf-8")) > limit):
                    raise ZooError(f"{f}: row {row}: expected a document of at most {limit:,} bytes, got a longer "
                                   "one; split it into several rows")
                yield row, text
                row += 1
    except errors as e:
        if isinstance(e, ZooError):
            raise
        raise _unreadable(f, e) from e


_TOK: Tokenizer | None = None


def _init_worker(tokenizer: str, threads: int) -> None:
    global _TOK
    os.environ["RAYON_RS_NUM_CPUS"] = str(threads)  # the tokenizers thread pool: the cores shared among workers
    _TOK = Tokenizer(tokenizer)


# what a worker tokenizes: (source, chunk, its shard file, token dtype, source bytes for the progress bar)
Job = tuple[Path, Chunk, Path, str, int]


def tokenize_chunk(job: Job, tok: Tokenizer | None = None) -> tuple[int, np.ndarray, int]:
    """Tokenize one chunk into its shard file; returns (tokens, document lengths, source bytes)."""
    f, chunk, out, dtype, nbytes = job
    tok = tok or _TOK
    assert tok is not None
    top = int(np.iinfo(dtype).max)
    lengths: list[int] = []
    total = 0
    with open(out, "wb") as fh:
        batch: list[str] = []
        numbers: list[int] = []  # each text's line or row
        size = 0

        def flush() -> None:
            nonlocal total
            flat: list[int] = []
            for n, ids in zip(numbers, tok.encode_batch(batch, add_special_tokens=False), strict=True):
                if ids:  # as PretrainData: an empty document adds nothing
                    doc = wrap(tok, ids)
                    if max(doc) > top:  # numpy would wrap it around silently
                        where = f"{f}: row {n}" if f.suffix == ".parquet" else f"{f}:{n}"
                        raise ZooError(f"{where}: expected token ids that fit {dtype} (at most {top}), got "
                                       f"{max(doc)} from the tokenizer {tok.path} (vocab_size {tok.vocab_size})")
                    flat += doc
                    lengths.append(len(doc))
            fh.write(np.asarray(flat, dtype=dtype).tobytes())
            total += len(flat)
            batch.clear()
            numbers.clear()

        for n, text in _texts(f, chunk):
            batch.append(text)
            numbers.append(n)
            size += len(text)
            if size >= BATCH_BYTES:
                flush()
                size = 0
        flush()
    return total, np.asarray(lengths, dtype=np.int64), nbytes


def tokenizer_info(tok: Tokenizer) -> dict[str, Any]:
    """The manifest's tokenizer: its hash (what recipes.pretrain checks) and, for people, what it is."""
    return {"sha256": tokenizer_hash(tok), "file": tok.path.name, "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id, "eos_id": tok.eos_id}


def main(argv: list[str] | None = None) -> Path:
    p = ArgumentParser(prog="python -m recipes.pretokenize", description=__doc__.splitlines()[0])
    p.add_argument("src", metavar="SRC", help="JSONL file, or a directory of .jsonl / .parquet files")
    p.add_argument("out", metavar="OUT", help="dataset directory to write")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json or tokenizer.model (the "
                                                      "model's: recipes.pretrain checks it)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    p.add_argument("--chunk-mb", type=float, default=64, help="text per shard and per task, in MB (default: 64)")
    p.add_argument("--force", action="store_true", help="replace an OUT that holds something else")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    args = p.parse_args(argv)
    most = max(64, 4 * (os.cpu_count() or 1))  # each worker is a process holding a tokenizer: more only cost memory
    if not 1 <= args.workers <= most:
        raise ZooError(f"--workers must be between 1 and {most} (each a process with its own tokenizer), got "
                       f"{args.workers}")
    if not 0 < args.chunk_mb < math.inf:
        raise ZooError(f"--chunk-mb must be a finite number above 0, got {args.chunk_mb}")
    src, out = Path(args.src), Path(args.out)
    tok = find_tokenizer(args.tokenizer, "debug")
    files = sources(src)
    if src.resolve().is_relative_to(out.resolve()):
        raise ZooError(f"OUT {out} holds the sources {src}; choose another OUT")
    if Path(tok.path).resolve().is_relative_to(out.resolve()):
        raise ZooError(f"OUT {out} holds the tokenizer {tok.path}; choose another OUT")
    t0 = time.perf_counter()
    records, jobs = [], []
    for f in files:
        record, chunks = scan(f, int(args.chunk_mb * 1e6))
        records.append({"path": (f.relative_to(src) if src.is_dir() else Path(f.name)).as_posix(), **record})
        jobs += [(f, c, (c[1] - c[0]) if c[1] is not None else record["bytes"] // max(len(chunks), 1))
                 for c in chunks]
    tok_info = tokenizer_info(tok)
    existed = out.exists() or out.is_symlink()
    if existed:
        m, damaged = _existing(out)
        if m is not None and m["sources"] == records and m["tokenizer"]["sha256"] == tok_info["sha256"]:
            print(f"{out} is up to date (same {len(records)} source files, same tokenizer): nothing to do")
            return out
        empty = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
        if damaged is not None and not args.force:
            raise ZooError(f"{damaged}; pass --force to replace it")
        # not a dataset this command wrote: --force replaces only that, never a user's
        if m is None and damaged is None and not empty:
            names = sorted(p.name for p in out.iterdir())[:5] if out.is_dir() and not out.is_symlink() else [out.name]
            raise ZooError(f"{out} exists and holds other files ({', '.join(names)}), not a dataset "
                           "recipes.pretokenize wrote; it replaces only its own datasets (with --force): choose "
                           "another OUT")
        if not args.force and not empty:
            raise ZooError(f"{out} exists and holds a dataset of other sources or another tokenizer; pass --force to "
                           "replace it, or choose another OUT")
    dtype = token_dtype(tok.id_bound)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # a killed run's: its process is gone
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        manifest = _write(tmp, jobs, tok, args, dtype, sum(r["bytes"] for r in records))
        manifest.update(tokenizer=tok_info, sources=records)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if (out.exists() or out.is_symlink()) and not existed:  # another run wrote OUT while this one worked
            raise ZooError(f"{out} was written by another run while this one tokenized; this run's result is "
                           "dropped (run again to check it is up to date)")
        if out.exists() or out.is_symlink():
            out.rename(old)  # --force: the old OUT goes only once the new one is complete
        tmp.rename(out)
        if old.is_symlink() or old.is_file():
            old.unlink()
        elif old.exists():
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dt = time.perf_counter() - t0
    size = sum(r["bytes"] for r in records)
    print(f"{out}: {plural(manifest['documents'], 'document')}, {plural(manifest['tokens'], 'token')} ({dtype}) "
          f"from {plural(len(records), 'file')} of {in_bytes(size)} in {dt:.1f} s ({in_bytes(size / max(dt, 1e-9))}"
          f"/s, {plural(args.workers, 'worker')})")
    return out


def plural(n: int, noun: str) -> str:
    """'1 file', '2 files', '1,234 tokens'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def in_bytes(n: float) -> str:
    """A size in the unit that shows it: '512 bytes', '3.4 kB', '12.0 MB', '1.5 GB' (never '0.0 MB')."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} byte{'' if round(n) == 1 else 's'}"


def _existing(out: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when OUT holds a dataset this command wrote; (None, what is wrong) when it holds one whose
    manifest names the format but does not read (hand-edited, another version): --force may replace that; (None,
    None) when OUT holds something else."""
    if not is_dataset(out):
        return None, None
    try:
        return read_manifest(out), None
    except ZooError as e:
        try:
            ours = json.loads(inside(out, MANIFEST).read_bytes()).get("format") == FORMAT
        except (ValueError, AttributeError, RecursionError):  # not JSON, not an object (a ZooError is a ValueError)
            ours = False
        return None, str(e) if ours else None


def _write(tmp: Path, jobs: list[tuple[Path, Chunk, int]], tok: Tokenizer, args: argparse.Namespace, dtype: str,
           total_bytes: int) -> dict[str, Any]:
    """Every chunk into its shard (in order), then documents.npy; the manifest's counts."""
    work: list[Job] = [(f, c, tmp / f"tokens-{k:05d}.bin", dtype, n) for k, (f, c, n) in enumerate(jobs)]
    results: Iterator[tuple[int, np.ndarray, int]]
    bar = None
    if args.progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", dynamic_ncols=True)
    if args.workers == 1:
        results = (tokenize_chunk(job, tok) for job in work)
        pool = None
    else:
        import multiprocessing

        threads = max(1, (os.cpu_count() or 1) // args.workers)
        # fork where there is one: a spawned worker would spend seconds importing torch (through recipes.data)
        # before its first line; this process has not started the tokenizers or torch thread pools to inherit
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = multiprocessing.get_context(method).Pool(args.workers, _init_worker, (str(tok.path), threads))
        results = pool.imap(tokenize_chunk, work)
    shards, lengths = [], []
    try:
        for job, (n_tokens, doc_lengths, nbytes) in zip(work, results, strict=True):
            if n_tokens:
                shards.append({"file": job[2].name, "tokens": n_tokens})
                lengths.append(doc_lengths)
            else:
                job[2].unlink()
            if bar is not None:
                bar.update(nbytes)
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    starts = np.zeros(len(all_lengths) + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=starts[1:])
    np.save(tmp / DOCUMENTS, starts)
    return {"format": FORMAT, "version": VERSION, "dtype": dtype, "documents": len(all_lengths),
            "tokens": int(starts[-1]), "shards": shards}


if __name__ == "__main__":
    cli(main)
