"""python -m recipes.vlm: vision-language fine-tuning of the natively multimodal families (Qwen2.5-VL, Qwen3-VL,
Qwen3.5, Gemma 3) on TRL's conversational rows with images or LLaVA's JSON.

With no arguments: a tiny Qwen2.5-VL-shaped model (random weights, the bundled tokenizer with Qwen2-VL's vision tokens
and chat template) learns the built-in synthetic images of colored squares, of mixed sizes, packed. --train picks
which parts get gradients (vision: the tower's blocks; merger: the merger or projector; language: the language
model); with --lora-rank the language model gets LoRA adapters instead (and the tower with --lora-vision).
recipes.llava stays LLaVA-1.5's own recipe (its stages, CLIP tower, XTuner's layouts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import cast

import torch
from torch import nn

from recipes.data.tokenizer_choice import ASSETS, find_tokenizer
from recipes.data.vlm import Expand, VLMData, synthetic_rows
from recipes.engine.build import add_adapters, build_model, check_model, model_config, resolve_model
from recipes.engine.checkpoint import check_out
from recipes.engine.command import cli
from recipes.engine.config import Section, check, opt, parse, section
from recipes.engine.defaults import choose_lr, schedule_warning
from recipes.engine.finetune import eval_data_of, train_and_export
from recipes.engine.metrics import Result
from recipes.engine.processes import distributed
from recipes.engine.sections import (
    WHOLE_SAMPLES_HELP,
    CheckpointSection,
    LlavaDataSection,
    LogSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    VisionLoRASection,
)
from zoo.errors import ZooError
from zoo.io.image import preprocess
from zoo.io.tokenizer import Tokenizer
from zoo.models import FAMILIES, Model, ModelConfig
from zoo.models.qwen2 import Qwen2Config
from zoo.models.qwen2_5_vl import Qwen25VLConfig
from zoo.models.qwen_vision import QwenVisionConfig
from zoo.models.vlm import VisionLanguage
from zoo.train.lora import ALL_LINEAR, Blocks, LoRAConfig, apply_lora, resolve_targets
from zoo.train.quant import require_nf4

BUILTIN = "debug-vl"
PARTS = ("vision", "merger", "language")
SYNTHETIC_SIZES = ((16, 16), (24, 16), (16, 24), (24, 24), (32, 24), (32, 32))  # (width, height) pixels


def some_parts(v: str) -> str | None:
    names = [p.strip() for p in v.split(",")]
    return None if names and all(p in PARTS for p in names) else f"a comma-separated subset of {','.join(PARTS)}"


@dataclass
class VLMSection(Section):
    """recipes.vlm's own: which parts of the model train."""

    train: str = opt("merger,language", "the parts that get gradients, the rest frozen (the optimizer sees only "
                                        "these): vision (the tower's patch embedding and blocks), merger (Qwen's "
                                        "patch merger, Gemma's projector), language (the language model, embeddings "
                                        "and head included); with --lora-rank, language and vision (with "
                                        "--lora-vision) train LoRA adapters, the others in full", check=some_parts)

    def parts(self) -> set[str]:
        return {p.strip() for p in self.train.split(",")}


@dataclass
class VLMRecipeConfig(Section):
    """The options of recipes.vlm."""

    model: ModelSection = section(lambda: ModelSection(name=BUILTIN), help={
        "name": "vision-language checkpoint directory (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3) or hub id; debug-vl: "
                "a tiny Qwen2.5-VL with random weights and the bundled tokenizer"})
    data: LlavaDataSection = section(lambda: LlavaDataSection(seq_len=256, batch_tokens=1024, overlong="drop"), help={
        "path": "TRL vision-language JSONL ({\"messages\": [... {\"type\": \"image\"} parts ...], \"images\": "
                "[paths]}) or LLaVA-Instruct .json, a file or a directory; default: the built-in synthetic images",
        **WHOLE_SAMPLES_HELP,
        "overlong": "samples longer than --seq-len, their image tokens counted: drop (counted), or truncate (only "
                    "after the last image)"})
    run: RunSection = section(lambda: RunSection(out="out/vlm", steps=60))
    optim: OptimSection = section(lambda: OptimSection(lr=0.0, warmup=5, weight_decay=0.0), help={
        "lr": "peak learning rate; 0: by what is trained: 2e-5 for full fine-tuning of a checkpoint, 2e-4 for LoRA, "
              "2e-3 for the built-in model from scratch (recipes/engine/defaults.py)"})
    checkpoint: CheckpointSection = section(CheckpointSection)
    parallel: ParallelSection = section(ParallelSection)
    log: LogSection = section(LogSection)
    lora: VisionLoRASection = section(VisionLoRASection, help={
        "vision_targets": f"with --lora-vision: comma-separated linear layers of each tower block to adapt (zoo's "
                          f"names: q_proj,k_proj,v_proj,o_proj and the MLP's), or {ALL_LINEAR}"})
    vlm: VLMSection = section(VLMSection)


def debug_vl(tok: Tokenizer) -> Qwen25VLConfig:
    """A tiny Qwen2.5-VL over the bundled VLM tokenizer: patches of 4 pixels merged 2x2 (an image of 16 x 24 pixels
    is 6 image tokens), windows of 16 pixels, a 2-layer language model of width 64."""
    ids = {name: tok.token_to_id(f"<|{name}|>") for name in ("image_pad", "vision_start", "vision_end")}
    if None in ids.values():
        raise ZooError(f"--model {BUILTIN} needs a tokenizer with <|image_pad|>, <|vision_start|> and <|vision_end|> "
                       f"(the bundled one in {ASSETS / 'vlm'}); {tok.dir} lacks some")
    vocab = tok.id_bound + 5  # an id past the tokenizer's for the (unused) video placeholder
    vision = QwenVisionConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64, out_dim=64, patch_size=4, merge_size=2,
                              window_size=16, full_layers=(1,))
    language = Qwen2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=vocab,
                           rope_theta=10_000.0, max_seq_len=4096, mrope_section=(2, 3, 3))
    return Qwen25VLConfig(vision=vision, language=language, image_token_id=cast(int, ids["image_pad"]),
                          video_token_id=vocab - 1, vision_start_token_id=cast(int, ids["vision_start"]),
                          vision_end_token_id=cast(int, ids["vision_end"]), min_pixels=8 * 8, max_pixels=32 * 32)


def as_vision_language(model: Model) -> VisionLanguage:
    """`model` as a vision-language model this recipe trains, else one line saying which recipe does."""
    if model.family == "llava":
        raise ZooError("recipes.vlm trains the natively multimodal families (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3); "
                       "a LLaVA trains with python -m recipes.llava (its stages, CLIP's feature layer, XTuner's "
                       "layouts)")
    if not isinstance(model, VisionLanguage):
        raise ZooError(f"recipes.vlm trains vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3); --model "
                       f"is a {model.family} model, which takes no images (python -m recipes.sft trains it)")
    return model


def expander(model: Model) -> Expand:
    """The text with each image's placeholder expanded as the checkpoint's processor expands it, from the images'
    sizes alone (`expand_for_sizes`: equal to `expand_placeholders` over the preprocessed images)."""
    return as_vision_language(model).expand_for_sizes


def parts_of(model: nn.Module) -> dict[str, str]:
    """{parameter name: its part} by the model's `parts()`, --train's names (the projector is "merger": Qwen's patch
    merger, Gemma's and LLaVA's projector)."""
    ids = {id(p): ("merger" if part == "projector" else part)
           for part, modules in as_vision_language(cast(Model, model)).parts().items()
           for m in modules for p in m.parameters()}
    named = dict(model.named_parameters())
    missing = [n for n, p in named.items() if id(p) not in ids]
    if missing:
        raise ZooError(f"a {cast(Model, model).family} model's parts() leave {missing[0]} out: it would train (or not) "
                       "by no flag")
    return {n: ids[id(p)] for n, p in named.items()}


def freeze(model: nn.Module, parts: set[str], adapted: bool = False) -> None:
    """Only `parts` train; with `adapted` (LoRA), a part that holds adapters trains them alone, and a part in `parts`
    without any trains in full."""
    where = parts_of(model)
    has_adapter = {where[n] for n in where if ".lora_" in n}
    for name, p in model.named_parameters():
        part = where[name]
        if adapted and part in has_adapter:
            p.requires_grad_(".lora_" in name)
        else:
            p.requires_grad_(part in parts)


def add_lora(model: Model, lora: LoRAConfig, parts: set[str], vision: tuple[str, ...] | None, seed: int) -> list[str]:
    """LoRA adapters on the language model's blocks (when it trains) and, with `vision`, on the tower's; the other
    parts in --train train in full, as PEFT's modules_to_save."""
    blocks: Blocks = {}
    if vision is not None:
        blocks["vision.layers"] = (cast(nn.ModuleList, model.vision.layers), vision)  # type: ignore[union-attr]
    if "language" in parts:
        lm = cast(ModelConfig, FAMILIES[model.family].text_config(model.config))
        blocks["language_model.layers"] = (model.layers, resolve_targets(lora.targets, lm.family))
    wrapped = apply_lora(model, lora, seed=seed, blocks=blocks)
    freeze(model, parts, adapted=True)
    return wrapped


def main(argv: list[str] | None = None) -> list[float]:
    """The command line: `python -m recipes.vlm [flags]`; returns the losses of the steps run."""
    return run(parse(VLMRecipeConfig, argv, __doc__)).losses


def check_choices(cfg: VLMRecipeConfig, config: ModelConfig) -> None:
    """Refuse, before any process starts, what this model cannot run."""
    parts = cfg.vlm.parts()
    if cfg.lora.vision and not cfg.lora.rank:
        raise ZooError("--lora-vision adds LoRA on the tower to a LoRA run; give --lora-rank too (got 0)")
    if cfg.lora.vision and "vision" not in parts:
        raise ZooError(f"--lora-vision trains adapters on the tower: add vision to --train (got {cfg.vlm.train})")
    if cfg.lora.rank and "language" not in parts and not cfg.lora.vision:
        raise ZooError(f"--lora-rank adapts the language model (and with --lora-vision the tower): --train "
                       f"{cfg.vlm.train} trains neither")
    if config.family == "gemma3_vision" and cfg.parallel.sp > 1 and cfg.parallel.sp_mode != "ulysses":
        raise ZooError(f"--sp-mode {cfg.parallel.sp_mode}: Gemma 3's image tokens attend both ways within their "
                       "image, which only Ulysses runs across ranks; use --sp-mode ulysses")


def run(cfg: VLMRecipeConfig) -> Result:
    """Train with `cfg` (the same path as the command line, its values checked alike; under torchrun each process
    calls it), returning where the outputs are and the final metrics."""
    started = time.perf_counter()
    check(cfg, VLMRecipeConfig)
    lora = cfg.lora.config()  # bad --lora-* values fail here, before any process starts
    if cfg.lora.qlora:
        require_nf4()
    vision = None
    if lora is not None and cfg.lora.vision:
        vision = tuple(t.strip() for t in cfg.lora.vision_targets.split(",") if t.strip())
    builtin = cfg.model.name == BUILTIN
    if not builtin:  # a hub id as its cached snapshot, a preset in any case
        cfg = replace(cfg, model=resolve_model(cfg.model))
    if builtin and not cfg.model.tokenizer:  # the rest of the run (samples, resume) reads it from the config
        cfg = replace(cfg, model=replace(cfg.model, tokenizer=str(ASSETS / "vlm")))
    tok = find_tokenizer(cfg.model.tokenizer, cfg.model.name)
    config = debug_vl(tok) if builtin else model_config(cfg.model)
    check_choices(cfg, config)
    check_out(cfg)  # before the model and the data load
    lr_line = choose_lr(cfg.optim, cfg.model, lora is not None, preference=False, scratch=2e-3)
    parts = cfg.vlm.parts()
    with distributed(cfg.parallel) as d:
        if d.main:
            print("\n".join(filter(None, (lr_line, schedule_warning(cfg.optim, cfg.run.steps)))))
        check_model(cfg.model, cfg.data.seq_len, tok, config, device=d.device, lora=cfg.lora)
        with torch.device("meta"):  # what the data needs of the model: its processor's expansion and preprocessing
            shape = cast(Model, FAMILIES[config.family].build(config, "eager"))
        read = partial(VLMData, image_folder=cfg.data.image_folder, tok=tok, seq_len=cfg.data.seq_len,
                       seed=cfg.run.seed, expand=expander(shape), preprocess=partial(preprocess, shape),
                       image_token_id=config.image_token_id,  # type: ignore[attr-defined]
                       template=cfg.data.chat_template, overlong=cfg.data.overlong,
                       synthetic=synthetic_rows(256, SYNTHETIC_SIZES, cfg.run.seed))
        data = read(cfg.data.path)
        if d.main:
            print(f"model: {cfg.model.name} ({config.family}), training {', '.join(p for p in PARTS if p in parts)}"
                  f"{' (LoRA)' if lora is not None else ''}\ndata: {data.describe()}")
        eval_data = eval_data_of(cfg, d, read)

        model, on_meta = build_model(cfg.model, d, cfg.run.seed, config if builtin else None, cfg.lora)
        freeze(model, parts)
        wrap = None
        if lora is not None:
            wrap = partial(add_lora, lora=lora, parts=parts, vision=vision, seed=cfg.run.seed)
            add_adapters(model, d, cfg.model, lora, cfg.lora.qlora, wrap)
        if d.main:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            print(f"trainable: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters")
        losses = train_and_export(cfg, d, model, on_meta, wrap, tok, data, eval_data, started)
    return Result.of(cfg, losses)


if __name__ == "__main__":
    cli(main)
