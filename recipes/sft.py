"""python -m recipes.sft: supervised fine-tuning on JSONL chats, loss on assistant tokens only.

With no arguments it fine-tunes the output of `python -m recipes.pretrain` (out/pretrain/model), or the `debug`
preset from scratch when there is none, on the bundled chat set.
"""

from __future__ import annotations

import sys
from pathlib import Path

from recipes import train
from recipes.config import SFTConfig, parse
from recipes.data import SFTData
from recipes.tokenizer import find_tokenizer
from zoo.errors import ZooError

PRETRAINED = Path("out/pretrain/model")


def main(argv: list[str] | None = None) -> list[float]:
    cfg = parse(SFTConfig, argv, __doc__.splitlines()[0])
    if cfg.model == "auto":
        cfg.model = str(PRETRAINED) if (PRETRAINED / "config.json").is_file() else "debug"
    d = train.init_distributed(cfg)
    try:
        tok = find_tokenizer(cfg.tokenizer, cfg.model)
        train.check_model(cfg, tok)
        data = SFTData(cfg.data, tok, cfg.seq_len, cfg.seed, cfg.chat_template, cfg.overlong)
        if d.main:
            print(f"model: {cfg.model}\ndata: {data.stats}")
        model = train.build_model(cfg, d, tok)
        opt, sched = train.build_optimizer(cfg, model)
        start = train.start_or_resume(cfg, d, model, opt, sched, data)
        losses = train.train(cfg, d, model, opt, sched, data, start)
        train.export(cfg, d, model, tok)
        return losses
    finally:
        train.close_distributed()


if __name__ == "__main__":
    try:
        main()
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
