"""python -m recipes.sft: supervised fine-tuning on JSONL chats, loss on assistant tokens only.

With no arguments it fine-tunes the output of `python -m recipes.pretrain` (out/pretrain/model), or the `debug`
preset from scratch when there is none, on the bundled chat set. With --lora-rank it trains LoRA adapters on the
frozen model instead (and with --qlora over its 4-bit NF4 copy).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from recipes.data import SFTData
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.engine.build import add_adapters, build_model, check_model, resolve_model
from recipes.engine.checkpoint import check_out
from recipes.engine.command import cli
from recipes.engine.config import Section, check, parse, section
from recipes.engine.defaults import choose_lr, schedule_warning
from recipes.engine.finetune import eval_data_of, train_and_export
from recipes.engine.metrics import Result
from recipes.engine.processes import distributed
from recipes.engine.sections import (
    WHOLE_SAMPLES_HELP,
    CheckpointSection,
    LogSection,
    LoRASection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    SFTDataSection,
)
from zoo.io.chat_jinja import template_choice
from zoo.io.json_input import load_json_bounded
from zoo.train.lora import apply_lora
from zoo.train.quant import require_nf4

PRETRAINED = Path("out/pretrain/model")


@dataclass
class SFTConfig(Section):
    """The options of recipes.sft."""

    model: ModelSection = section(lambda: ModelSection(name="auto"), help={
        "name": "preset or checkpoint directory; auto: out/pretrain/model when it exists, else the debug preset "
                "from scratch"})
    data: SFTDataSection = section(lambda: SFTDataSection(batch_tokens=2048), help={
        "path": "JSONL chat file or directory: {\"messages\": [{\"role\", \"content\"}]} per line (default: the "
                "bundled chat set)",
        **WHOLE_SAMPLES_HELP})
    run: RunSection = section(lambda: RunSection(out="out/sft", steps=300))
    optim: OptimSection = section(lambda: OptimSection(lr=0.0, warmup=5, weight_decay=0.0), help={
        "lr": "peak learning rate; 0: by what is trained: 2e-5 for full fine-tuning of a checkpoint, 2e-4 for "
              "LoRA, 1e-3 for a preset from scratch (recipes/engine/defaults.py)"})
    checkpoint: CheckpointSection = section(CheckpointSection)
    parallel: ParallelSection = section(ParallelSection)
    log: LogSection = section(LogSection)
    lora: LoRASection = section(LoRASection)


def main(argv: list[str] | None = None) -> list[float]:
    """The command line: `python -m recipes.sft [flags]`; returns the losses of the steps run."""
    return run(parse(SFTConfig, argv, __doc__)).losses


def run(cfg: SFTConfig) -> Result:
    """Train with `cfg` (the same path as the command line, its values checked alike; under torchrun each process
    calls it), returning where the outputs are and the final metrics."""
    started = time.perf_counter()
    check(cfg, SFTConfig)
    cfg = copy.deepcopy(cfg)  # the caller's config stays as given ("auto" is resolved below)
    if cfg.model.name == "auto":
        cfg.model.name = str(PRETRAINED) if (PRETRAINED / "config.json").is_file() else "debug"
    cfg.model = resolve_model(cfg.model)  # a hub id as its cached snapshot, a preset in any case
    lora = cfg.lora.config()  # bad --lora-* values fail here, before any process starts
    check_out(cfg)  # before the model and the data load
    lr_line = choose_lr(cfg.optim, cfg.model, lora is not None, preference=False, scratch=1e-3)
    if cfg.lora.qlora:
        require_nf4()
    with distributed(cfg.parallel) as d:
        tok = find_tokenizer(cfg.model.tokenizer, cfg.model.name)
        check_model(cfg.model, cfg.data.seq_len, tok, device=d.device, lora=cfg.lora)
        read = partial(SFTData, tok=tok, seq_len=cfg.data.seq_len, seed=cfg.run.seed,
                       template=cfg.data.chat_template, overlong=cfg.data.overlong,
                       template_kwargs=load_json_bounded(cfg.data.chat_template_kwargs, "--chat-template-kwargs"))
        data = read(cfg.data.path)
        if d.main:
            print("\n".join(filter(None, (lr_line, schedule_warning(cfg.optim, cfg.run.steps)))))
            print(f"model: {cfg.model.name}\nchat template: {template_choice(tok, cfg.data.chat_template)}; "
                  f"--chat-template to choose\ndata: {data.describe()}")
        eval_data = eval_data_of(cfg, d, read)

        model, on_meta = build_model(cfg.model, d, cfg.run.seed, lora=cfg.lora)
        wrap = None
        if lora is not None:
            wrap = partial(apply_lora, cfg=lora, seed=cfg.run.seed)
            add_adapters(model, d, cfg.model, lora, cfg.lora.qlora, wrap)
        losses = train_and_export(cfg, d, model, on_meta, wrap, tok, data, eval_data, started)
    return Result.of(cfg, losses)


if __name__ == "__main__":
    cli(main)
