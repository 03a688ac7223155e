"""python -m convert.zoo_to_hf SRC DST: a zoo checkpoint into the Hugging Face layout of its family.

The output loads with transformers (Llama, LLaVA) or the upstream remote code (InternLM2, OpenELM): the same
tensor names, shapes and config keys as the published checkpoints; fused weights are merged back.
"""

from __future__ import annotations

import sys

import torch

from convert.common import DTYPES, output_options, parse_args, run_cli, source, write_checkpoint
from zoo.checkpoint import stream
from zoo.errors import ZooError


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])
    family, config, fmt, reader = source(args)
    if fmt != "zoo":
        raise ZooError(f"{args.src} is not a zoo checkpoint (its config.json has no 'format: zoo'); "
                       "for a Hugging Face checkpoint use convert.hf_to_zoo")
    with torch.device("meta"):
        model = family.model_cls(config, attn="eager")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # check names and shapes of the zoo side first, reading headers only
    for name in shapes:
        if name in reader.file_of and list(reader.shape(name)) != list(shapes[name]):
            raise ZooError(f"{args.src}: shape mismatch for {name}: expected {list(shapes[name])}, "
                           f"got {list(reader.shape(name))}")
    next(stream(reader, {n: ((n,), None) for n in shapes}, None), None)  # raises on missing/unexpected names
    plan = family.plan_to_hf(config, list(shapes))
    dtype = DTYPES[args.dtype] if args.dtype else reader.get(next(iter(shapes))).dtype
    hf_config = family.config_to_hf(config)
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_checkpoint(args.dst, plan, reader, hf_config, tokenizer_from=args.src, **output_options(args))


if __name__ == "__main__":
    sys.exit(run_cli(main))
