"""python -m recipes.llava: LLaVA training, stage 1 (projector only) or stage 2 (projector + language model).

With no arguments: stage 1 of a tiny LLaVA (a 2-layer CLIP tower on 32x32 images + the debug language model,
from out/pretrain/model when it exists) on built-in synthetic images of colored squares. Stage 2 trains the language
model in full, or LoRA adapters on it with --lora-rank (and on the tower with --lora-vision), as XTuner's llm_lora
and visual_encoder_lora.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import zoo
from recipes.data import LlavaData
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.engine.build import add_adapters, build_model, check_model, model_config, resolve_model
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
    LlavaDataSection,
    LlavaSection,
    LogSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    VisionLoRASection,
)
from zoo.errors import ZooError
from zoo.io.config import language_config
from zoo.models import Model
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llava import ORIGINAL_IMAGE_TOKEN, LlavaConfig, as_llava, as_llava_config
from zoo.train.lora import Blocks, LoRAConfig, apply_lora, resolve_targets
from zoo.train.quant import require_nf4

PRETRAINED = Path("out/pretrain/model")


@dataclass
class LlavaRecipeConfig(Section):
    """The options of recipes.llava."""

    model: ModelSection = section(lambda: ModelSection(name="debug-llava"), help={
        "name": "LLaVA preset or checkpoint directory; debug-llava: a tiny CLIP tower + the debug language model "
                "(from --language)"})
    data: LlavaDataSection = section(lambda: LlavaDataSection(seq_len=256, batch_tokens=1024, overlong="drop"),
                                     help={"path": "LLaVA-Instruct .json (or .jsonl) with conversations and image; "
                                                   "default: the built-in synthetic shapes",
                                           **WHOLE_SAMPLES_HELP,
                                           "overlong": "samples longer than --seq-len: drop, or truncate (only "
                                                       "after the image)"})
    run: RunSection = section(lambda: RunSection(out="out/llava", steps=40))
    optim: OptimSection = section(lambda: OptimSection(lr=2e-3, warmup=5, weight_decay=0.0))
    checkpoint: CheckpointSection = section(CheckpointSection)
    parallel: ParallelSection = section(ParallelSection)
    log: LogSection = section(LogSection)
    lora: VisionLoRASection = section(VisionLoRASection, help={
        "rank": "stage 2 only: LoRA rank r on the language model's blocks (the projector still trains fully, the "
                "tower stays frozen; 0: full stage 2); writes OUT/adapter in PEFT's layout for the llava-hf model and "
                "the merged model to OUT/model"})
    llava: LlavaSection = section(LlavaSection)


def debug_llava() -> LlavaConfig:
    """A tiny LLaVA: 4x4 patches of 8 pixels (16 image tokens), the debug language model, LLaVA's -200 <image>."""
    vision = CLIPVisionConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, image_size=32, patch_size=8)
    return LlavaConfig(vision=vision, language_family="llama", language=language_config(zoo.get_preset("debug").config),
                       image_token_id=ORIGINAL_IMAGE_TOKEN)


def prepare(model: Model, stage: int, language: str | None) -> None:
    """The language model's weights from `language` (debug-llava only), then what trains: stage 1 the projector,
    stage 2 the projector and the language model; the tower stays frozen."""
    llava = as_llava(model, "recipes.llava")
    if language:
        lm = zoo.load(language)
        if lm.config != llava.language_model.config:
            raise ZooError(f"--language {language} is not the debug language model debug-llava expects")
        llava.language_model.load_state_dict(lm.state_dict())
    llava.freeze(vision=True, projector=False, language=stage == 1)


def add_lora(model: Model, lora: LoRAConfig, vision: tuple[str, ...] | None, seed: int) -> list[str]:
    """LoRA stage 2, as XTuner's llm_lora (and visual_encoder_lora with `vision`, the tower's targets): adapters
    on the language model's blocks (and the tower's), the rest frozen but the projector, which trains fully (PEFT's
    modules_to_save in the exported adapter)."""
    llava = as_llava(model, "LoRA in recipes.llava")
    # the tower's blocks past its feature layer never run (LLaVA reads hidden state feature_layer, -2 by default):
    # adapters there would never train, and a resume would find no optimizer state for them. The tower first: the
    # wrapped names then come in state-dict order
    used = llava.vision.layers[: llava.config.feature_layer % (len(llava.vision.layers) + 1)]
    blocks: Blocks = {} if vision is None else {"vision.layers": (used, vision)}
    blocks["language_model.layers"] = (llava.language_model.layers,
                                       resolve_targets(lora.targets, llava.config.language_family))
    wrapped = apply_lora(llava, lora, seed=seed, blocks=blocks)
    llava.freeze(projector=False)
    return wrapped


def main(argv: list[str] | None = None) -> list[float]:
    """The command line: `python -m recipes.llava [flags]`; returns the losses of the steps run."""
    return run(parse(LlavaRecipeConfig, argv, __doc__)).losses


def run(cfg: LlavaRecipeConfig) -> Result:
    """Train with `cfg` (the same path as the command line, its values checked alike; under torchrun each process
    calls it), returning where the outputs are and the final metrics."""
    started = time.perf_counter()
    check(cfg, LlavaRecipeConfig)
    if cfg.lora.rank and cfg.llava.stage == 1:
        raise ZooError("--lora-rank with --stage 1: stage 1 trains only the projector; LoRA is for --stage 2")
    if cfg.lora.vision and not cfg.lora.rank:
        raise ZooError("--lora-vision adds LoRA on the tower to a LoRA run; give --lora-rank too (got 0)")
    lora = cfg.lora.config()  # bad --lora-* values fail here, before any process starts
    if cfg.lora.qlora:
        require_nf4()
    vision = cfg.lora.vision_names() if lora is not None and cfg.lora.vision else None
    builtin = cfg.model.name == "debug-llava"
    if not builtin:  # a hub id as its cached snapshot, a preset in any case
        cfg = replace(cfg, model=resolve_model(cfg.model))
    config = as_llava_config(debug_llava() if builtin else model_config(cfg.model), f"--model {cfg.model.name}")
    language = None  # a checkpoint for debug-llava's language model; a real --model has its own
    if builtin:
        language = cfg.llava.language
        if language == "auto":
            language = str(PRETRAINED) if (PRETRAINED / "config.json").is_file() else None
        elif not Path(language).is_dir():  # else it would be read as a tokenizer file first, and misreported
            raise ZooError(f"--language {language}: expected a zoo checkpoint directory of the debug language model, "
                           f"got {'a file' if Path(language).exists() else 'nothing there'}")
    check_out(cfg)  # before the model and the data load
    # --lr 0: stage 1 trains a new projector (LLaVA's own 1e-3 to 2e-3), stage 2 a checkpoint like any other
    lr_line = choose_lr(cfg.optim, cfg.model if cfg.llava.stage == 2 else ModelSection(name="new projector"),
                        lora is not None, preference=False, scratch=2e-3)
    with distributed(cfg.parallel) as d:
        if d.main:
            print("\n".join(filter(None, (lr_line, schedule_warning(cfg.optim, cfg.run.steps)))))
        tok = find_tokenizer(cfg.model.tokenizer or language, "debug" if builtin else cfg.model.name)
        check_model(cfg.model, cfg.data.seq_len, tok, config, device=d.device, lora=cfg.lora)
        # the eval data's images beside it, or in --image-folder
        read = partial(LlavaData, image_folder=cfg.data.image_folder, tok=tok, seq_len=cfg.data.seq_len,
                       seed=cfg.run.seed, model_config=config, template=cfg.data.chat_template,
                       overlong=cfg.data.overlong)
        data = read(cfg.data.path)
        if d.main:
            lm = language or ("random" if builtin else "as loaded")
            print(f"model: {cfg.model.name} (language model: {lm}), stage {cfg.llava.stage}\ndata: {data.describe()}")
        eval_data = eval_data_of(cfg, d, read)

        model, on_meta = build_model(cfg.model, d, cfg.run.seed, config if builtin else None, cfg.lora)
        prepare(model, cfg.llava.stage, language)
        wrap = None
        if lora is not None:
            wrap = partial(add_lora, lora=lora, vision=vision, seed=cfg.run.seed)
            add_adapters(model, d, cfg.model, lora, cfg.lora.qlora, wrap)
        losses = train_and_export(cfg, d, model, on_meta, wrap, tok, data, eval_data, started)
    return Result.of(cfg, losses)


if __name__ == "__main__":
    cli(main)
