"""python -m recipes.sft: supervised fine-tuning on JSONL chats, loss on assistant tokens only.

With no arguments it fine-tunes the output of `python -m recipes.pretrain` (out/pretrain/model), or the `debug`
preset from scratch when there is none, on the bundled chat set.
"""

from __future__ import annotations

import time
from pathlib import Path

from recipes.build import build_model, check_model
from recipes.config import SFTConfig, cli, parse
from recipes.data import SFTData
from recipes.export import export
from recipes.loop import train
from recipes.metrics import summary
from recipes.processes import distributed
from recipes.tokenizer import find_tokenizer
from zoo.train.quant import require_nf4

PRETRAINED = Path("out/pretrain/model")


def main(argv: list[str] | None = None) -> list[float]:
    started = time.perf_counter()
    cfg = parse(SFTConfig, argv, __doc__.splitlines()[0])
    if cfg.model == "auto":
        cfg.model = str(PRETRAINED) if (PRETRAINED / "config.json").is_file() else "debug"
    lora = cfg.lora()  # bad --lora-* values fail here, before any process starts
    if cfg.qlora:
        require_nf4()
    with distributed(cfg) as d:
        tok = find_tokenizer(cfg.tokenizer, cfg.model)
        check_model(cfg, tok)
        data = SFTData(cfg.data, tok, cfg.seq_len, cfg.seed, cfg.chat_template, cfg.overlong)
        if d.main:
            print(f"model: {cfg.model}\ndata: {data.stats}")
        eval_data = None
        if cfg.eval_data:
            eval_data = SFTData(cfg.eval_data, tok, cfg.seq_len, cfg.seed, cfg.chat_template, cfg.overlong)
            if d.main:
                print(f"eval data: {eval_data.stats}")
        model = build_model(cfg, d, lora=lora)
        losses = train(cfg, d, model, data, eval_data)
        export(cfg, d, model, tok, lora)
        summary(cfg, d, losses, started)
    return losses


if __name__ == "__main__":
    cli(main)
