"""python -m recipes.pretrain: next-token pretraining on JSONL or a tokenized dataset, one process or torchrun.

A dataset written by `python -m recipes.tokenize` is read by memory map (--data OUT); JSONL is tokenized at start.

With no arguments it trains the tiny `debug` preset on the bundled corpus with the bundled tokenizer, on CPU.
"""

from __future__ import annotations

import time

from recipes.build import build_model, check_model
from recipes.config import TrainConfig, cli, parse
from recipes.data import pretrain_data
from recipes.export import export
from recipes.loop import train
from recipes.metrics import summary
from recipes.processes import distributed
from recipes.tokenizer import find_tokenizer


def main(argv: list[str] | None = None) -> list[float]:
    started = time.perf_counter()
    cfg = parse(TrainConfig, argv, __doc__.splitlines()[0])
    with distributed(cfg) as d:
        tok = find_tokenizer(cfg.tokenizer, cfg.model)
        check_model(cfg, tok)
        data = pretrain_data(cfg.data, tok, cfg.seq_len, cfg.seed)
        if d.main:
            print(f"data: {data.stats}")
        eval_data = pretrain_data(cfg.eval_data, tok, cfg.seq_len, cfg.seed) if cfg.eval_data else None
        model = build_model(cfg, d)
        losses = train(cfg, d, model, data, eval_data)
        export(cfg, d, model, tok)
        summary(cfg, d, losses, started)
    return losses


if __name__ == "__main__":
    cli(main)
