"""python -m recipes.pretrain: next-token pretraining on JSONL text, one process or torchrun with --dp/--sp.

With no arguments it trains the tiny `debug` preset on the bundled corpus with the bundled tokenizer, on CPU.
"""

from __future__ import annotations

import sys

from recipes import train
from recipes.config import TrainConfig, parse
from recipes.data import PretrainData
from recipes.tokenizer import find_tokenizer
from zoo.errors import ZooError


def main(argv: list[str] | None = None) -> list[float]:
    cfg = parse(TrainConfig, argv, __doc__.splitlines()[0])
    d = train.init_distributed(cfg)
    try:
        tok = find_tokenizer(cfg.tokenizer, cfg.model)
        train.check_model(cfg, tok)
        data = PretrainData(cfg.data, tok, cfg.seq_len, cfg.seed)
        if d.main:
            print(f"data: {data.stats}")
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
