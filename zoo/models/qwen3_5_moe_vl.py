"""Qwen3.5-MoE multimodal (Qwen3_5MoeForConditionalGeneration, model_type "qwen3_5_moe": Qwen3.5-35B-A3B and its
larger siblings as published): Qwen3.5's tower and merger (transformers' Qwen3_5MoeVisionModel is Qwen3_5VisionModel)
over the Qwen3.5-MoE language model (zoo.models.qwen3_5_moe) with interleaved M-RoPE; everything but the language
model's config class is zoo.models.qwen3_5_vl's (`hybrid_vl`). A text checkpoint (Qwen3_5MoeForCausalLM,
"qwen3_5_moe_text") stays the text family `qwen3_5_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from zoo.models import qwen3_5_moe
from zoo.models.qwen2_5_vl import finish_vl
from zoo.models.qwen3_5_moe import Qwen3_5MoeConfig
from zoo.models.qwen3_5_vl import SECTION, Qwen3_5VLFields, hybrid_vl
from zoo.models.qwen3_vl import QWEN3_VISION
from zoo.models.qwen_vision import QwenVisionConfig


@dataclass(frozen=True)
class Qwen3_5MoeVLConfig(Qwen3_5VLFields):
    family: ClassVar[str] = "qwen3_5_moe_vl"
    positive: ClassVar[frozenset[str]] = frozenset({"min_pixels", "max_pixels"})
    vision: QwenVisionConfig = field(default_factory=lambda: QwenVisionConfig(
        **{**QWEN3_VISION, "deepstack_layers": (), "out_dim": 2048}))
    language: Qwen3_5MoeConfig = field(default_factory=lambda: Qwen3_5MoeConfig(mrope_section=SECTION))

    def __post_init__(self) -> None:
        finish_vl(self, Qwen3_5MoeConfig)


FAMILY = hybrid_vl(Qwen3_5MoeVLConfig, qwen3_5_moe.FAMILY, "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
                   "Qwen3.5-MoE")
