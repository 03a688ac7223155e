"""python -m convert.hf_to_zoo SRC DST: a Hugging Face checkpoint directory into zoo's layout.

The architecture comes from SRC/config.json (model_type). Tensors stream one at a time through the family's
weight plan (renames, and splits of fused weights); DST is written beside itself and renamed at the end.
"""

from __future__ import annotations

import sys

import torch

from convert.common import output_options, parse_args, run_cli, source, write_checkpoint
from zoo.errors import ZooError
from zoo.io.checkpoint import hf_plan, zoo_config_json


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])
    family, config, fmt, reader = source(args)
    if fmt != "hf":
        raise ZooError(f"{args.src} is already a zoo checkpoint (config.json has format: zoo)")
    with torch.device("meta"):
        model = family.build(config, "eager")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    plan = hf_plan(family, config, list(shapes), reader.names())
    ignore = family.hf_tied(config)
    write_checkpoint(args.dst, plan, reader, zoo_config_json(family, config), tokenizer_from=args.src, shapes=shapes,
                     ignore=ignore, **output_options(args))


if __name__ == "__main__":
    sys.exit(run_cli(main))
