"""What a recipe chooses for the user: the learning rate by what is trained (--lr 0, the default of recipes.sft and
recipes.dpo), said in one line, and a warning where the schedule's warmup is as long as the run.

The rates are those of the recipes people come from. Full fine-tuning of a pretrained checkpoint: 2e-5 (TRL's
SFTConfig, torchtune's full_finetune configs); at SFT's old 1e-3 one step wrecked SmolLM2 (eval loss 3.95 -> 4.52).
LoRA: 2e-4 (Axolotl's and the QLoRA paper's; torchtune's lora configs 3e-4): its B starts at zero, and a step of
the full-fine-tuning rate hardly moves it. DPO, full: 1e-6 (TRL's DPOConfig); DPO with LoRA: 5e-5 (TRL's LoRA DPO
examples use 5e-6 to 5e-5; at 5e-6 the loss stayed at ln 2 = 0.6931 for the first steps: step 1 is exactly ln 2,
B being zero, and the next ones moved it by less than 1e-4). A model from scratch (a preset's random weights) has
nothing to forget and keeps the recipe's own rate, as does a checkpoint of a toy's size (under TINY parameters:
zoo's debug model after `python -m recipes.pretrain`, which the built-in SFT and DPO runs tune: at 2e-5 its 300
SFT steps would learn nothing of the chat set).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from recipes.engine.build import model_config
from recipes.engine.sections import ModelSection, OptimSection
from zoo.models import FAMILIES, Model

# (preference tuning, LoRA) -> the rate for a pretrained checkpoint, and where it comes from
PRETRAINED_LR = {
    (False, False): (2e-5, "full fine-tuning from a checkpoint"),
    (False, True): (2e-4, "LoRA"),
    (True, False): (1e-6, "full preference tuning from a checkpoint"),
    (True, True): (5e-5, "LoRA preference tuning"),
}


TINY = 10_000_000  # parameters: below this a checkpoint is a toy (zoo's debug model has 1.3M); real ones, 100M up


def choose_lr(optim: OptimSection, model: ModelSection, lora: bool, preference: bool, scratch: float) -> str:
    """Sets `optim.lr` where it is 0 (auto) by what is trained: --model a checkpoint directory (pretrained) or a
    preset (random weights: `scratch`, the recipe's own rate, unless LoRA), full or `lora`, SFT or `preference`.
    Returns the line that says the rate and why; a rate the user gave is kept."""
    if optim.lr:
        return f"lr {optim.lr:g}"
    if lora:
        optim.lr, why = PRETRAINED_LR[preference, lora]
    elif not Path(model.name).is_dir():
        optim.lr, why = scratch, f"{'preference tuning' if preference else 'training'} a model from scratch"
    elif (n := parameters(model)) < TINY:
        optim.lr, why = scratch, f"a checkpoint of {n / 1e6:.1f}M parameters, a toy's size"
    else:
        optim.lr, why = PRETRAINED_LR[preference, lora]
    return f"lr {optim.lr:g} ({why}; --lr to change)"


def parameters(model: ModelSection) -> int:
    """The parameter count of --model, built on meta from its config (no weights read)."""
    config = model_config(model)
    with torch.device("meta"):
        built = cast(Model, FAMILIES[config.family].build(config, "eager"))
    return sum(p.numel() for p in built.parameters())


def schedule_warning(optim: OptimSection, steps: int) -> str | None:
    """One line where --warmup is at least --steps: the rate then only rises, never reaching --lr's decay."""
    if optim.warmup < steps:
        return None
    peak = "reaches --lr only at the last step" if optim.warmup == steps else (
        f"never reaches --lr (its last step runs at {steps / optim.warmup:.0%} of it)")
    return (f"warning: --warmup {optim.warmup} is at least --steps {steps}: the learning rate rises through the whole "
            f"run, {peak}, and never decays; a --warmup of a tenth of --steps or less is usual")
