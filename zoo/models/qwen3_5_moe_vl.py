"""Qwen3.5-MoE multimodal (Qwen3_5MoeForConditionalGeneration, model_type "qwen3_5_moe": Qwen3.5-35B-A3B and its
larger siblings as published): Qwen3.5's tower and merger (transformers' Qwen3_5MoeVisionModel is Qwen3_5VisionModel)
over the Qwen3.5-MoE language model (zoo.models.qwen3_5_moe) with interleaved M-RoPE; everything but the language
model's config class is zoo.models.qwen3_5_vl's. A text checkpoint (Qwen3_5MoeForCausalLM, "qwen3_5_moe_text")
stays the text family `qwen3_5_moe`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from zoo.models import qwen3_5_moe
from zoo.models.family import family
from zoo.models.qwen3_5 import text_config_of
from zoo.models.qwen3_5_moe import Qwen3_5MoeConfig
from zoo.models.qwen3_5_vl import LEFT_OUT, SECTION
from zoo.models.qwen3_vl import (
    HALF,
    MAX_PIXELS,
    MIN_PIXELS,
    QWEN3_VISION,
    build,
    finish_vl,
    mrope_from_hf,
    tied_head,
    vl_config_to_hf,
    vl_fields_from_hf,
    vl_plans,
)
from zoo.models.qwen_vision import QwenVisionConfig


@dataclass(frozen=True)
class Qwen3_5MoeVLConfig:
    family: ClassVar[str] = "qwen3_5_moe_vl"
    positive: ClassVar[frozenset[str]] = frozenset({"min_pixels", "max_pixels"})
    vision: QwenVisionConfig = field(default_factory=lambda: QwenVisionConfig(
        **{**QWEN3_VISION, "deepstack_layers": (), "out_dim": 2048}))
    language: Qwen3_5MoeConfig = field(default_factory=lambda: Qwen3_5MoeConfig(mrope_section=SECTION))
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF

    def __post_init__(self) -> None:
        finish_vl(self, Qwen3_5MoeConfig)


def config_from_hf(hf: dict[str, Any]) -> Qwen3_5MoeVLConfig:
    text, section = mrope_from_hf(text_config_of(hf, "qwen3_5_moe"), SECTION)
    lm = dataclasses.replace(qwen3_5_moe.config_from_hf(text), mrope_section=section)
    return Qwen3_5MoeVLConfig(language=lm, **vl_fields_from_hf(hf, Qwen3_5MoeVLConfig, "Qwen3.5-MoE"))


def config_to_hf(cfg: Qwen3_5MoeVLConfig) -> dict[str, Any]:
    text = qwen3_5_moe.config_to_hf(dataclasses.replace(cfg.language, mrope_section=()))
    return vl_config_to_hf(cfg, "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", text)


plan_from_hf, plan_to_hf = vl_plans(qwen3_5_moe.plan_from_hf, qwen3_5_moe.plan_to_hf)

FAMILY = family("qwen3_5_moe_vl", Qwen3_5MoeVLConfig, ("qwen3_5_moe",), build=build, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=qwen3_5_moe.FAMILY.lora_targets, text_config=lambda config: config.language,
                with_text_config=lambda config, lm: dataclasses.replace(config, language=cast(Qwen3_5MoeConfig, lm)),
                hf_tied=tied_head, hf_left_out=LEFT_OUT,
                left_out_why="qwen3_5_moe_vl: the multi-token-prediction head (mtp.*) is left out, as transformers "
                             "does")
