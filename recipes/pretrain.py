"""python -m recipes.pretrain: next-token pretraining on JSONL or a tokenized dataset, one process or torchrun.

A dataset written by `python -m recipes.pretokenize` is read by memory map (--data OUT); JSONL is tokenized at start.

With no arguments it trains the tiny `debug` preset on the bundled corpus with the bundled tokenizer, on CPU.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from recipes.data import pretrain_data
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.engine.build import build_model, check_model, load_sharded, parallelize_model, resolve_model
from recipes.engine.checkpoint import check_out
from recipes.engine.command import cli
from recipes.engine.config import Section, check, parse, section
from recipes.engine.defaults import choose_lr, schedule_warning
from recipes.engine.export import export
from recipes.engine.loop import train
from recipes.engine.metrics import Result, summary
from recipes.engine.processes import distributed
from recipes.engine.sections import (
    CheckpointSection,
    DataSection,
    LogSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
)


@dataclass
class PretrainConfig(Section):
    """The options of recipes.pretrain; the sections' own defaults are pretraining's."""

    model: ModelSection = section(ModelSection)
    data: DataSection = section(DataSection)
    run: RunSection = section(RunSection)
    optim: OptimSection = section(OptimSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    parallel: ParallelSection = section(ParallelSection)
    log: LogSection = section(LogSection)


def main(argv: list[str] | None = None) -> list[float]:
    """The command line: `python -m recipes.pretrain [flags]`; returns the losses of the steps run."""
    return run(parse(PretrainConfig, argv, __doc__)).losses


def run(cfg: PretrainConfig) -> Result:
    """Train with `cfg` (the same path as the command line, its values checked alike; under torchrun each process
    calls it), returning where the outputs are and the final metrics."""
    started = time.perf_counter()
    check(cfg, PretrainConfig)
    cfg = copy.deepcopy(cfg)  # the caller's config stays as given (--lr 0 is resolved below)
    cfg.model = resolve_model(cfg.model)  # a hub id as its cached snapshot, a preset in any case
    check_out(cfg)  # before the model and the data load
    lr_line = choose_lr(cfg.optim, cfg.model, lora=False, preference=False, scratch=5e-3)
    with distributed(cfg.parallel) as d:
        tok = find_tokenizer(cfg.model.tokenizer, cfg.model.name)
        check_model(cfg.model, cfg.data.seq_len, tok, device=d.device)
        data = pretrain_data(cfg.data.path, tok, cfg.data.seq_len, cfg.run.seed)
        if d.main:
            print("\n".join(filter(None, (lr_line, schedule_warning(cfg.optim, cfg.run.steps)))))
            print(f"data: {data.describe()}")
        eval_data = None
        if cfg.data.eval_data:
            eval_data = pretrain_data(cfg.data.eval_data, tok, cfg.data.seq_len, cfg.run.seed)

        model, on_meta = build_model(cfg.model, d, cfg.run.seed)
        parallelize_model(model, d, cfg.model, cfg.parallel)
        if on_meta:
            load_sharded(model, d, cfg.model)
        losses = train(cfg, d, model, data, eval_data)
        export(cfg, d, model, tok)
        summary(cfg, d, losses, started)
    return Result.of(cfg, losses)


if __name__ == "__main__":
    cli(main)
