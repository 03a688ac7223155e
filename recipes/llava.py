"""python -m recipes.llava: LLaVA training, stage 1 (projector only) or stage 2 (projector + language model).

With no arguments: stage 1 of a tiny LLaVA (a 2-layer CLIP tower on 32x32 images + the debug language model,
from out/pretrain/model when it exists) on built-in synthetic images of colored squares. Stage 2 trains the language
model in full, or LoRA adapters on it with --lora-rank (and on the tower with --lora-vision), as XTuner's llm_lora
and visual_encoder_lora.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from torch import nn

import zoo
from recipes.build import build_model, check_model, model_config
from recipes.config import LlavaRecipeConfig, cli, parse
from recipes.data import LlavaData
from recipes.export import export
from recipes.loop import train
from recipes.metrics import summary
from recipes.processes import distributed
from recipes.tokenizer import find_tokenizer
from zoo.errors import ZooError
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llava import ORIGINAL_IMAGE_TOKEN, LlavaConfig, as_llava, as_llava_config
from zoo.train.lora import LoRAConfig, apply_lora, resolve_targets
from zoo.train.quant import require_nf4

PRETRAINED = Path("out/pretrain/model")


def debug_llava() -> LlavaConfig:
    """A tiny LLaVA: 4x4 patches of 8 pixels (16 image tokens), the debug language model, LLaVA's -200 <image>."""
    vision = CLIPVisionConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, image_size=32, patch_size=8)
    return LlavaConfig(vision=vision, language_family="llama", language=zoo.get_preset("debug").config,
                       image_token_id=ORIGINAL_IMAGE_TOKEN)


def prepare(model: nn.Module, stage: int, language: str | None) -> None:
    """The language model's weights from `language` (debug-llava only), then what trains: stage 1 the projector,
    stage 2 the projector and the language model; the tower stays frozen."""
    if language:
        lm = zoo.load(language)
        if lm.config != model.language_model.config:
            raise ZooError(f"--language {language} is not the debug language model debug-llava expects")
        model.language_model.load_state_dict(lm.state_dict())
    model.freeze(vision=True, projector=False, language=stage == 1)


def add_lora(model: nn.Module, lora: LoRAConfig, vision: tuple[str, ...] | None, seed: int) -> list[str]:
    """LoRA stage 2, as XTuner's llm_lora (and visual_encoder_lora with `vision`, the tower's targets): adapters
    on the language model's blocks (and the tower's), the rest frozen but the projector, which trains fully (PEFT's
    modules_to_save in the exported adapter)."""
    model = as_llava(model, "LoRA in recipes.llava")
    # the tower's blocks past its feature layer never run (LLaVA reads hidden state feature_layer, -2 by default):
    # adapters there would never train, and a resume would find no optimizer state for them. The tower first: the
    # wrapped names then come in state-dict order
    used = model.vision.layers[: model.config.feature_layer % (len(model.vision.layers) + 1)]
    blocks = {} if vision is None else {"vision.layers": (used, vision)}
    blocks["language_model.layers"] = (model.language_model.layers,
                                       resolve_targets(lora.targets, model.config.language_family))
    wrapped = apply_lora(model, lora, seed=seed, blocks=blocks)
    model.freeze(projector=False)
    return wrapped


def main(argv: list[str] | None = None) -> list[float]:
    started = time.perf_counter()
    cfg = parse(LlavaRecipeConfig, argv, __doc__.splitlines()[0])
    if cfg.lora_rank and cfg.stage == 1:
        raise ZooError("--lora-rank with --stage 1: stage 1 trains only the projector; LoRA is for --stage 2")
    if cfg.lora_vision and not cfg.lora_rank:
        raise ZooError("--lora-vision adds LoRA on the tower to a LoRA run; give --lora-rank too (got 0)")
    lora = cfg.lora()  # bad --lora-* values fail here, before any process starts
    if cfg.qlora:
        require_nf4()
    vision = cfg.lora_vision_names() if lora is not None and cfg.lora_vision else None
    builtin = cfg.model == "debug-llava"
    config = debug_llava() if builtin else model_config(cfg)
    config = as_llava_config(config, f"--model {cfg.model}")
    language = None  # a checkpoint for debug-llava's language model; a real --model has its own
    if builtin:
        language = cfg.language
        if language == "auto":
            language = str(PRETRAINED) if (PRETRAINED / "config.json").is_file() else None
    with distributed(cfg) as d:
        tok = find_tokenizer(cfg.tokenizer or language, "debug" if builtin else cfg.model)
        check_model(cfg, tok, config)
        data = LlavaData(cfg.data, cfg.image_folder, tok, cfg.seq_len, cfg.seed, config, cfg.chat_template,
                         cfg.overlong)
        if d.main:
            lm = language or ("random" if builtin else "as loaded")
            print(f"model: {cfg.model} (language model: {lm}), stage {cfg.stage}\ndata: {data.stats}")
        eval_data = None
        if cfg.eval_data:  # its images beside it, or in --image-folder
            eval_data = LlavaData(cfg.eval_data, cfg.image_folder, tok, cfg.seq_len, cfg.seed, config,
                                  cfg.chat_template, cfg.overlong)
            if d.main:
                print(f"eval data: {eval_data.stats}")
        wrap = None if lora is None else partial(add_lora, lora=lora, vision=vision, seed=cfg.seed)
        model = build_model(cfg, d, config if builtin else None, lambda model: prepare(model, cfg.stage, language),
                            lora, wrap)
        losses = train(cfg, d, model, data, eval_data)
        export(cfg, d, model, tok, lora)
        summary(cfg, d, losses, started)
    return losses


if __name__ == "__main__":
    cli(main)
