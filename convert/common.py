"""What the converters share: arguments, the source checks, the streaming copy through a weight plan, one-line
errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from zoo.errors import ArgumentParser, ZooError
from zoo.io.atomic import atomic_dir
from zoo.io.config import Format, read_config
from zoo.io.dtypes import DTYPES
from zoo.io.load import stream
from zoo.io.safetensors import DEFAULT_SHARD_BYTES, Reader, SafetensorsDir, ShardWriter
from zoo.io.save import copy_tokenizer_files
from zoo.models import ModelConfig
from zoo.models.family import Family, Plan


def parse_args(argv: list[str] | None, description: str, hub: bool = False) -> argparse.Namespace:
    """The converters' flags; with `hub`, SRC may be a Hugging Face hub id (--revision, --download)."""
    p = ArgumentParser(description=description)
    p.add_argument("src", help="source checkpoint directory" + (", or a Hugging Face hub id ORG/NAME in the local "
                                                                "cache (HF_HUB_CACHE, HF_HOME)" if hub else ""))
    if hub:
        p.add_argument("--revision", default=None, help="SRC as a hub id: the branch, tag or commit of its snapshot "
                                                        "(default main)")
        p.add_argument("--download", action="store_true", help="SRC as a hub id not in the cache: download it "
                       "through huggingface_hub (safetensors, configs, tokenizer files; never with HF_HUB_OFFLINE)")
    p.add_argument("dst", help="output directory (must not exist or be empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: keep)")
    p.add_argument("--shard-size", type=float, default=DEFAULT_SHARD_BYTES / 2**30, help="max GiB per shard")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not 0 < args.shard_size < math.inf or args.shard_size * 2**30 < 1:
        raise ZooError(f"--shard-size must be a finite number of GiB above 0, got {args.shard_size}")
    return args


def write_checkpoint(dst: str | os.PathLike[str], plan: Plan, reader: Reader, config_json: dict[str, Any], *,
                     tokenizer_from: str | os.PathLike[str], shapes: dict[str, torch.Size] | None = None,
                     ignore: Collection[str] = frozenset(), dtype: torch.dtype | None = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False, progress: bool = True,
                     extra_files: dict[str, str] | None = None) -> None:
    """Stream every target of `plan` from `reader` into `dst` (atomically), with config.json and the tokenizer files
    of `tokenizer_from`; floating tensors cast to `dtype` (None: kept), shapes checked against `shapes` (None: not).
    extra_files: {name: text} written last (over a copied tokenizer file of that name). With `progress`, ends with
    a line saying what was written."""
    started = time.perf_counter()
    with atomic_dir(dst, force=force) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        tensors = stream(reader, plan, shapes, ignore)
        for name, t in tqdm(tensors, total=len(plan), desc="converting", unit="tensor", disable=not progress):
            writer.add(name, t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        copy_tokenizer_files(tokenizer_from, tmp)
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
    if progress:
        shards = len(writer.shards)
        size = f"{writer.total / 2**30:.2f} GiB" if writer.total >= 2**30 else f"{writer.total / 2**20:.1f} MiB"
        print(f"wrote {dst}: {len(plan)} tensors, {size} in {shards} "
              f"shard{'s' if shards != 1 else ''}, {time.perf_counter() - started:.1f} s", flush=True)


def output_options(args: argparse.Namespace) -> dict[str, Any]:
    """write_checkpoint's (and the converter functions') output keywords from the converters' shared flags
    (--dtype, --shard-size, --force, --quiet)."""
    return {"dtype": DTYPES[args.dtype] if args.dtype else None, "max_shard_bytes": int(args.shard_size * 2**30),
            "force": args.force, "progress": not args.quiet}


def run_cli(main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> int:
    """Run a converter; bad input becomes one line on stderr and exit code 2, not a traceback."""
    try:
        main(argv)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or vanished directory: DST was not written (atomic_dir)
        print(f"error: {e.strerror or e} ({e.filename or 'writing the output'}); nothing was written", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


def source(src: str | os.PathLike[str],
           dst: str | os.PathLike[str]) -> tuple[Family, ModelConfig, Format, SafetensorsDir]:
    """The checkpoint in directory `src` to be converted into `dst`: (family, config, format, its tensors)."""
    src_dir = Path(src)
    if not src_dir.is_dir():
        raise ZooError(f"{src_dir} is not a directory: expected a checkpoint directory (config.json + *.safetensors)")
    dst_dir = Path(dst).resolve()
    if dst_dir == src_dir.resolve() or src_dir.resolve().is_relative_to(dst_dir):
        # replacing DST would delete the source being read, --force or not
        raise ZooError(f"DST {dst} is SRC {src} or contains it; write the converted checkpoint elsewhere")
    family, config, fmt = read_config(src_dir)
    return family, config, fmt, SafetensorsDir(src_dir)
