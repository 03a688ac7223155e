"""What both converter CLIs share: arguments, the streaming copy through a weight plan, one-line errors."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from zoo.checkpoint import (
    DEFAULT_SHARD_BYTES,
    SafetensorsDir,
    ShardWriter,
    atomic_dir,
    copy_tokenizer_files,
    read_config,
    stream,
)
from zoo.errors import ZooError
from zoo.family import Plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist or be empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: keep)")
    p.add_argument("--shard-size", type=float, default=DEFAULT_SHARD_BYTES / 2**30, help="max GiB per shard")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def write_checkpoint(args: argparse.Namespace, plan: Plan, shapes: dict | None, config_json: dict,
                     reader: SafetensorsDir, ignore: set[str] = frozenset()) -> None:
    """Stream every target of `plan` from `reader` into DST (atomically), with config.json and tokenizer files."""
    dtype = DTYPES[args.dtype] if args.dtype else None
    with atomic_dir(args.dst, force=args.force) as tmp:
        writer = ShardWriter(tmp, int(args.shard_size * 2**30))
        tensors = stream(reader, plan, shapes, ignore)
        for name, t in tqdm(tensors, total=len(plan), desc="converting", unit="tensor", disable=args.quiet):
            writer.add(name, t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        copy_tokenizer_files(args.src, tmp)


def run_cli(main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> int:
    """Run a converter; bad input becomes one line on stderr and exit code 2, not a traceback."""
    try:
        main(argv)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


def source(args: argparse.Namespace):
    src = Path(args.src)
    if not src.is_dir():
        raise ZooError(f"{src} is not a directory: expected a checkpoint directory (config.json + *.safetensors)")
    family, config, fmt = read_config(src)
    return family, config, fmt, SafetensorsDir(src)
