"""python -m convert.hf_to_zoo SRC DST: a Hugging Face checkpoint (a directory, or a cached hub id) into zoo's layout.

The architecture comes from SRC/config.json (model_type). Tensors stream one at a time through the family's
weight plan (renames, and splits of fused weights); DST is written beside itself and renamed at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import cast

import torch

from convert.common import output_options, parse_args, run_cli, source, write_checkpoint
from zoo.errors import ZooError
from zoo.io.config import zoo_config_json
from zoo.io.dtypes import as_dtype
from zoo.io.fp8 import dequantizing
from zoo.io.hub import is_hub_id, resolve
from zoo.io.load import hf_plan
from zoo.io.safetensors import DEFAULT_SHARD_BYTES
from zoo.models import Model


def hf_to_zoo(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
              force: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False,
              revision: str | None = None, download: bool = False, flag: str = "download=True") -> Path:
    """Convert the Hugging Face checkpoint in `src` (a directory, or a hub id's snapshot in the local cache at
    `revision`, downloaded first with `download`: zoo.io.hub.resolve) into a zoo checkpoint `dst` (written
    atomically; a non-empty `dst` only with `force`), floating tensors cast to `dtype` (None: kept). Returns `dst`."""
    cast_to = as_dtype(dtype)
    if revision is not None or download or (is_hub_id(os.fspath(src)) and not Path(src).exists()):
        src = resolve(src, revision, download, flag)
    family, config, fmt, files = source(src, dst)
    if fmt != "hf":
        raise ZooError(f"{src} is already a zoo checkpoint (config.json has format: zoo)")
    with torch.device("meta"):
        model = cast(Model, family.build(config, "eager"))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    reader = dequantizing(files, cast_to)  # fp8 block-quantised weights multiplied out as they stream
    plan, ignore = hf_plan(family, config, list(shapes), reader.names())
    write_checkpoint(dst, plan, reader, zoo_config_json(family, config), tokenizer_from=src, shapes=shapes,
                     ignore=ignore, dtype=cast_to, max_shard_bytes=max_shard_bytes, force=force,
                     progress=progress)
    return Path(dst)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0], hub=True)
    hf_to_zoo(args.src, args.dst, **output_options(args), revision=args.revision, download=args.download,
              flag="--download")


if __name__ == "__main__":
    sys.exit(run_cli(main))
