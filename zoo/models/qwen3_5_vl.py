"""Qwen3.5 multimodal (Qwen3_5ForConditionalGeneration, model_type "qwen3_5": every published Qwen3.5): Qwen3-VL's
tower without DeepStack (zoo.models.qwen_vision) and its merger over the hybrid Gated DeltaNet language model
(zoo.models.qwen3_5) with interleaved M-RoPE over the rotated quarter of each attention head.

Shapes: T tokens of the pack, D language-model width, U image tokens.
The model is QwenVL (zoo.models.qwen2_5_vl), as Qwen3-VL's (zoo.models.qwen3_vl, whose config reading and names
this shares): images in their placeholders, M-RoPE positions per packed document; the Gated DeltaNet layers see the
image tokens as any others, their state restarting at each document. The multi-token-prediction head (`mtp.*`) is
left out on load, as transformers leaves it out. A text checkpoint (Qwen3_5ForCausalLM, "qwen3_5_text") stays the
text family `qwen3_5`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from zoo.models import qwen3_5
from zoo.models.family import family
from zoo.models.qwen3_5 import Qwen3_5Config, text_config_of
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

SECTION = (11, 11, 10)  # transformers' default mrope_section for Qwen3.5, the published one
LEFT_OUT = ("mtp.",)


@dataclass(frozen=True)
class Qwen3_5VLConfig:
    family: ClassVar[str] = "qwen3_5_vl"
    positive: ClassVar[frozenset[str]] = frozenset({"min_pixels", "max_pixels"})
    vision: QwenVisionConfig = field(default_factory=lambda: QwenVisionConfig(
        **{**QWEN3_VISION, "deepstack_layers": ()}))
    language: Qwen3_5Config = field(default_factory=lambda: Qwen3_5Config(mrope_section=SECTION))
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF

    def __post_init__(self) -> None:
        finish_vl(self, Qwen3_5Config)


def config_from_hf(hf: dict[str, Any]) -> Qwen3_5VLConfig:
    text, section = mrope_from_hf(text_config_of(hf, "qwen3_5"), SECTION)
    lm = dataclasses.replace(qwen3_5.config_from_hf(text), mrope_section=section)
    return Qwen3_5VLConfig(language=lm, **vl_fields_from_hf(hf, Qwen3_5VLConfig, "Qwen3.5"))


def config_to_hf(cfg: Qwen3_5VLConfig) -> dict[str, Any]:
    text = qwen3_5.config_to_hf(dataclasses.replace(cfg.language, mrope_section=()))
    return vl_config_to_hf(cfg, "Qwen3_5ForConditionalGeneration", "qwen3_5", text)


plan_from_hf, plan_to_hf = vl_plans(qwen3_5.plan_from_hf, qwen3_5.plan_to_hf)

FAMILY = family("qwen3_5_vl", Qwen3_5VLConfig, ("qwen3_5",), build=build, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=qwen3_5.FAMILY.lora_targets, text_config=lambda config: config.language,
                with_text_config=lambda config, lm: dataclasses.replace(config, language=cast(Qwen3_5Config, lm)),
                hf_tied=tied_head, hf_left_out=LEFT_OUT,
                left_out_why="qwen3_5_vl: the multi-token-prediction head (mtp.*) is left out, as transformers does")
