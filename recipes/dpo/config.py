"""The options of recipes.dpo: the shared sections with DPO's defaults, and the preference section."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.dpo.losses import PreferenceSection
from recipes.engine.config import Section, section
from recipes.engine.sections import (
    WHOLE_SAMPLES_HELP,
    ChatDataSection,
    CheckpointSection,
    LogSection,
    LoRASection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
)


@dataclass
class DPOConfig(Section):
    """The options of recipes.dpo."""

    model: ModelSection = section(lambda: ModelSection(name="auto"), help={
        "name": "preset or checkpoint directory; auto: out/sft/model, else out/pretrain/model, else the debug preset"})
    data: ChatDataSection = section(lambda: ChatDataSection(seq_len=1024, batch_tokens=4096), help={
        "path": "JSONL preference pairs: {\"prompt\", \"chosen\", \"rejected\"} as text, or as conversations "
                "(message lists, prompt optional), with an optional \"system\" (required)",
        "eval_data": "held-out pairs in --data's format: their loss and metrics, as TRL's eval_loss, "
                     "eval_rewards/accuracies, ..., every --eval-every steps and after the last",
        "overlong": "pairs longer than --seq-len: truncate (both sequences keep their start) or drop; counted",
        **WHOLE_SAMPLES_HELP})
    run: RunSection = section(lambda: RunSection(out="out/dpo", steps=100))
    optim: OptimSection = section(lambda: OptimSection(lr=0.0, warmup=5, weight_decay=0.0), help={
        "lr": "peak learning rate; 0: by what is trained: 1e-6 for full tuning of a checkpoint, 5e-5 for LoRA, "
              "5e-6 for a preset from scratch (recipes/engine/defaults.py)"})
    checkpoint: CheckpointSection = section(CheckpointSection)
    parallel: ParallelSection = section(ParallelSection)
    log: LogSection = section(LogSection)
    lora: LoRASection = section(LoRASection)
    pref: PreferenceSection = section(PreferenceSection)
