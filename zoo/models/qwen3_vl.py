"""Qwen3-VL (dense): Qwen3's language model with interleaved M-RoPE and DeepStack, under Qwen3-VL's vision tower;
and what Qwen3.5's multimodal checkpoints share with it (zoo.models.qwen3_5_vl).

Shapes: T tokens of the pack, D language-model width, U image tokens, L DeepStack levels.
The model is zoo.models.qwen2_5_vl's QwenVL: its images' placeholders, per-document M-RoPE positions (transformers'
get_rope_index for Qwen3-VL gives Qwen2.5-VL's positions for images), packing and loss are the same. What differs is
configuration: the tower (zoo.models.qwen_vision: LayerNorms, a GELU-tanh MLP, a learned position table resampled
to each grid, no windows, 16-pixel patches), the rotary's frequencies interleaved over (t, h, w) rather than split in
sections (zoo.core.layers.MRotary), and DeepStack: the tower's blocks in `deepstack_visual_indexes` feed mergers of
their own, and level l's tokens are added to the language model's hidden states at the image tokens after its
layer l (QwenVL passes them as the decoder's `adds`). Images only: video placeholders are refused.

Tensor names are those transformers saves and the hub publishes: `model.visual.*`, `model.language_model.*`,
`lm_head.*`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from zoo.errors import ZooError
from zoo.models import qwen3, qwen_vision
from zoo.models.family import Plan, family
from zoo.models.names import rename_plans
from zoo.models.qwen2_5_vl import build, finish_vl, tied_head
from zoo.models.qwen3 import Qwen3Config
from zoo.models.qwen3_5 import text_config_of
from zoo.models.qwen_vision import QwenVisionConfig

if TYPE_CHECKING:
    pass

# transformers' Qwen3VLVisionConfig defaults (Qwen3-VL-32B's tower; the 2B, 4B and 8B have 24 blocks of 1024)
QWEN3_VISION: dict[str, Any] = dict(
    dim=1152, n_layers=27, n_heads=16, ffn_dim=4304, out_dim=3584, patch_size=16, window_size=0, full_layers=(),
    norm="layer", mlp_act="gelu_pytorch_tanh", patch_bias=True, n_position_embeddings=2304,
    deepstack_layers=(8, 16, 24))
# the families whose model is QwenVL
QWEN_VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl")
HALF = (0.5, 0.5, 0.5)  # the published processors' image mean and std
MIN_PIXELS, MAX_PIXELS = 65536, 16777216  # the published preprocessor_config.json's size (shortest/longest edge)


@dataclass(frozen=True)
class Qwen3VLConfig:
    family: ClassVar[str] = "qwen3_vl"
    positive: ClassVar[frozenset[str]] = frozenset({"min_pixels", "max_pixels"})
    vision: QwenVisionConfig = field(default_factory=lambda: QwenVisionConfig(**QWEN3_VISION))
    language: Qwen3Config = field(default_factory=lambda: Qwen3Config(mrope_section=(24, 20, 20)))
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF

    def __post_init__(self) -> None:
        finish_vl(self, Qwen3Config)


# ---- Hugging Face config, shared with Qwen3.5 ----

def mrope_from_hf(text: dict[str, Any], default: tuple[int, ...]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the text config with its rope parameters plain, mrope_section): transformers 5's rope_parameters or the
    published rope_scaling, whose mrope_interleaved transformers ignores (it always interleaves)."""
    text = dict(text)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(rope.pop("mrope_section", None) or default)
    rope.pop("mrope_interleaved", None)
    if rope.get("rope_type", rope.pop("type", "default")) not in ("default", "mrope"):
        raise ZooError(f"a Qwen-VL rope {rope.get('rope_type')!r} is not supported (expected the default M-RoPE)")
    rope["rope_type"] = "default"
    text.pop("rope_scaling", None)
    text["rope_parameters"] = rope
    return text, section


def vl_fields_from_hf(hf: dict[str, Any], cls: Any, what: str) -> dict[str, Any]:
    """The tower, token ids and image processor settings of a Qwen3-VL or Qwen3.5 config.json (the processor's
    settings, zoo.io.config's `image_processor`: preprocessor_config.json or processor_config.json's)."""
    vision = qwen_vision.config_from_hf_qwen3(dict(hf.get("vision_config") or {}), what)
    ip = dict(hf.get("image_processor") or {})
    size = dict(ip.get("size") or {})
    for key, ours in (("patch_size", vision.patch_size), ("merge_size", vision.merge_size),
                      ("temporal_patch_size", vision.temporal_patch_size)):
        if ip.get(key, ours) != ours:
            raise ZooError(f"the image processor's {key} {ip[key]} differs from the vision tower's {ours}")
    d = cls.__dataclass_fields__
    ids = {k: hf.get(k, d[k].default) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                "vision_end_token_id")}
    return dict(vision=vision, **ids,
                min_pixels=ip.get("min_pixels") or size.get("shortest_edge") or d["min_pixels"].default,
                max_pixels=ip.get("max_pixels") or size.get("longest_edge") or d["max_pixels"].default,
                image_mean=tuple(ip.get("image_mean", d["image_mean"].default)),
                image_std=tuple(ip.get("image_std", d["image_std"].default)))


def vl_config_to_hf(cfg: Any, architecture: str, model_type: str, text: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's nested config.json around a text config (its rope parameters given the mrope_section)."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": list(cfg.language.mrope_section),
                               "mrope_interleaved": True}
    return {"architectures": [architecture], "model_type": model_type, "text_config": text,
            "vision_config": qwen_vision.config_to_hf_qwen3(cfg.vision, f"{model_type}_vision"),
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": cfg.language.tie_embeddings}


def config_from_hf(hf: dict[str, Any]) -> Qwen3VLConfig:
    text, section = mrope_from_hf(text_config_of(hf, "qwen3_vl"), (24, 20, 20))
    text["rope_parameters"].setdefault("rope_theta", text.pop("rope_theta", 500000.0))  # Qwen3VLTextConfig's
    text.setdefault("max_position_embeddings", 128000)
    text.setdefault("rms_norm_eps", 1e-6)
    text.setdefault("num_key_value_heads", text.get("num_attention_heads", 32))
    lm = dataclasses.replace(qwen3.config_from_hf(text), mrope_section=section)
    return Qwen3VLConfig(language=lm, **vl_fields_from_hf(hf, Qwen3VLConfig, "Qwen3-VL"))


def config_to_hf(cfg: Qwen3VLConfig) -> dict[str, Any]:
    text = {**qwen3.config_to_hf(dataclasses.replace(cfg.language, mrope_section=())), "model_type": "qwen3_vl_text"}
    return vl_config_to_hf(cfg, "Qwen3VLForConditionalGeneration", "qwen3_vl", text)


# ---- Hugging Face names, shared with Qwen3.5: the tower's table, the text family's plans moved under
# model.language_model. ----

VISION_PLANS = rename_plans(qwen_vision.hf_names_qwen3("vision.", "model.visual."))
TextPlan = Callable[[Any, list[str]], Plan]


def _in_vl(hf_name: str) -> str:
    return "model.language_model." + hf_name.removeprefix("model.") if hf_name.startswith("model.") else hf_name


def vl_plans(text_from_hf: TextPlan, text_to_hf: TextPlan) -> tuple[TextPlan, TextPlan]:
    """plan_from_hf and plan_to_hf of a Qwen-VL model whose language model the text family's plans name."""
    vision_from, vision_to = VISION_PLANS

    def split(names: list[str]) -> tuple[list[str], list[str]]:
        return ([n for n in names if n.startswith("vision.")],
                [n.removeprefix("language_model.") for n in names if not n.startswith("vision.")])

    def plan_from_hf(cfg: Any, zoo_names: list[str]) -> Plan:
        vision, text = split(zoo_names)
        plan = vision_from(cfg, vision)
        for z, (sources, combine) in text_from_hf(cfg.language, text).items():
            plan["language_model." + z] = (tuple(_in_vl(s) for s in sources), combine)
        return plan

    def plan_to_hf(cfg: Any, zoo_names: list[str]) -> Plan:
        vision, text = split(zoo_names)
        plan = vision_to(cfg, vision)
        for h, (sources, combine) in text_to_hf(cfg.language, text).items():
            plan[_in_vl(h)] = (tuple("language_model." + s for s in sources), combine)
        return plan

    return plan_from_hf, plan_to_hf


plan_from_hf, plan_to_hf = vl_plans(qwen3.plan_from_hf, qwen3.plan_to_hf)

FAMILY = family("qwen3_vl", Qwen3VLConfig, ("qwen3_vl",), build=build, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"), text_config=lambda config: config.language,
                with_text_config=lambda config, lm: dataclasses.replace(config, language=cast(Qwen3Config, lm)),
                hf_tied=tied_head)
