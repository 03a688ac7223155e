"""python -m recipes.llava: LLaVA training, stage 1 (projector only) or stage 2 (projector + language model).

With no arguments: stage 1 of a tiny LLaVA (a 2-layer CLIP tower on 32x32 images + the debug language model,
from out/pretrain/model when it exists) on built-in synthetic images of colored squares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import zoo
from recipes import train
from recipes.config import LlavaRecipeConfig, parse
from recipes.data import LlavaData
from recipes.tokenizer import find_tokenizer
from zoo.errors import ZooError
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llava import ORIGINAL_IMAGE_TOKEN, LlavaConfig

PRETRAINED = Path("out/pretrain/model")


def debug_llava() -> LlavaConfig:
    """A tiny LLaVA: 4x4 patches of 8 pixels (16 image tokens), the debug language model, LLaVA's -200 <image>."""
    vision = CLIPVisionConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, image_size=32, patch_size=8)
    return LlavaConfig(vision=vision, language_family="llama", language=zoo.get_preset("debug").config,
                       image_token_id=ORIGINAL_IMAGE_TOKEN)


def main(argv: list[str] | None = None) -> list[float]:
    cfg = parse(LlavaRecipeConfig, argv, __doc__.splitlines()[0])
    builtin = cfg.model == "debug-llava"
    config = debug_llava() if builtin else train.model_config(cfg)
    if not isinstance(config, LlavaConfig):
        raise ZooError(f"--model {cfg.model} is a {type(config).__name__} model, not LLaVA; use recipes.sft for "
                       "language models")
    language = cfg.language
    if builtin and language == "auto":
        language = str(PRETRAINED) if (PRETRAINED / "config.json").is_file() else None
    d = train.init_distributed(cfg)
    try:
        tok_from = cfg.tokenizer or (language if builtin and language else None)
        tok = find_tokenizer(tok_from, "debug" if builtin else cfg.model)
        train.check_model(cfg, tok, config)
        data = LlavaData(cfg.data, cfg.image_folder, tok, cfg.seq_len, cfg.seed, config, cfg.chat_template,
                         cfg.overlong)
        if d.main:
            lm = language or ("random" if builtin else "as loaded")
            print(f"model: {cfg.model} (language model: {lm}), stage {cfg.stage}\ndata: {data.stats}")

        def adapt(model):
            if builtin and language:
                lm = zoo.load(language)
                if lm.config != config.language:
                    raise ZooError(f"--language {language} is not the debug language model debug-llava expects")
                model.language_model.load_state_dict(lm.state_dict())
            model.freeze(vision=True, projector=False, language=cfg.stage == 1)

        model = train.build_model(cfg, d, tok, None if not builtin else config, adapt)
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
