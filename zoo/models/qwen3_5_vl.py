"""Qwen3.5 multimodal (Qwen3_5ForConditionalGeneration, model_type "qwen3_5": every published Qwen3.5): Qwen3-VL's
tower without DeepStack (zoo.models.qwen_vision) and its merger over the hybrid Gated DeltaNet language model
(zoo.models.qwen3_5) with interleaved M-RoPE over the rotated quarter of each attention head.

Shapes: T tokens of the pack, D language-model width, U image tokens.
The model is QwenVL (zoo.models.qwen2_5_vl), as Qwen3-VL's (zoo.models.qwen3_vl, whose config reading and names
this shares): images in their placeholders, M-RoPE positions per packed document; the Gated DeltaNet layers see the
image tokens as any others, their state restarting at each document. The multi-token-prediction head (`mtp.*`) is
left out on load, as transformers leaves it out. A text checkpoint (Qwen3_5ForCausalLM, "qwen3_5_text") stays the
text family `qwen3_5`.

Qwen3.5-MoE's multimodal family (zoo.models.qwen3_5_moe_vl) differs only in its language model: `hybrid_vl`
makes either family's record from its config class and its text family's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from zoo.models import qwen3_5
from zoo.models.family import Family, family
from zoo.models.qwen2_5_vl import build, finish_vl, tied_head
from zoo.models.qwen3_5 import Qwen3_5Config, text_config_of
from zoo.models.qwen3_vl import (
    HALF,
    MAX_PIXELS,
    MIN_PIXELS,
    QWEN3_VISION,
    mrope_from_hf,
    vl_config_to_hf,
    vl_fields_from_hf,
    vl_plans,
)
from zoo.models.qwen_vision import QwenVisionConfig

SECTION = (11, 11, 10)  # transformers' default mrope_section for Qwen3.5, the published one
LEFT_OUT = ("mtp.",)


@dataclass(frozen=True)
class Qwen3_5VLFields:
    """What a Qwen3.5 multimodal config holds beside its tower and language model: the placeholders' token ids and
    the image processor's settings, the same for the dense and MoE checkpoints."""

    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF


@dataclass(frozen=True)
class Qwen3_5VLConfig(Qwen3_5VLFields):
    family: ClassVar[str] = "qwen3_5_vl"
    positive: ClassVar[frozenset[str]] = frozenset({"min_pixels", "max_pixels"})
    vision: QwenVisionConfig = field(default_factory=lambda: QwenVisionConfig(
        **{**QWEN3_VISION, "deepstack_layers": ()}))
    language: Qwen3_5Config = field(default_factory=lambda: Qwen3_5Config(mrope_section=SECTION))

    def __post_init__(self) -> None:
        finish_vl(self, Qwen3_5Config)


def hybrid_vl(cls: type[Any], text: Family, architecture: str, model_type: str, what: str) -> Family:
    """The record of a Qwen3.5 multimodal family: config class `cls`, whose `language` is the text family `text`'s
    config, read from and written as transformers' `architecture` (model_type `model_type`)."""

    def config_from_hf(hf: dict[str, Any]) -> Any:
        lm_hf, section = mrope_from_hf(text_config_of(hf, model_type), SECTION)
        lm = dataclasses.replace(cast(Any, text.config_from_hf(lm_hf)), mrope_section=section)
        return cls(language=lm, **vl_fields_from_hf(hf, cls, what))

    def config_to_hf(cfg: Any) -> dict[str, Any]:
        lm = text.config_to_hf(dataclasses.replace(cfg.language, mrope_section=()))
        return vl_config_to_hf(cfg, architecture, model_type, lm)

    plan_from_hf, plan_to_hf = vl_plans(text.plan_from_hf, text.plan_to_hf)
    return family(cls.family, cls, (model_type,), build=build, config_from_hf=config_from_hf,
                  config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                  lora_targets=text.lora_targets, text_config=lambda config: config.language,
                  with_text_config=lambda config, lm: dataclasses.replace(config, language=lm),
                  hf_tied=tied_head, hf_left_out=LEFT_OUT,
                  left_out_why=f"{cls.family}: the multi-token-prediction head (mtp.*) is left out, as transformers "
                               "does")


FAMILY = hybrid_vl(Qwen3_5VLConfig, qwen3_5.FAMILY, "Qwen3_5ForConditionalGeneration", "qwen3_5", "Qwen3.5")
