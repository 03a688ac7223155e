"""The families zoo knows: one `zoo.models.family.Family` record each, by the name in zoo checkpoints and by
Hugging Face model_type. A family is a module of this package that declares `FAMILY` (its config, Hugging Face
names, conversions and record); the registry below finds it, so adding a family is its file, its presets in
zoo/models/presets.py and its tests, and no line here. Everything that lists families (HF_MODEL_TYPES, LLaVA's
language models, the tests' and docs' family lists) reads FAMILIES."""

import importlib
import pkgutil
from typing import TYPE_CHECKING

from zoo.core.contract import FamilyConfig
from zoo.models import gemma3_vision, llava, qwen2_5_vl, qwen3_vl
from zoo.models.decoder import Decoder
from zoo.models.family import Family

# every model class zoo builds (what zoo.load returns, what zoo.parallel and zoo.save take), and their configs
Model = Decoder | llava.Llava | qwen2_5_vl.QwenVL | gemma3_vision.Gemma3Vision
ModelConfig = FamilyConfig


def _discover() -> dict[str, Family]:
    """Every module of zoo.models with a FAMILY record, by family name, in module-name order."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "presets":  # the presets are built from the registry (LLaVA's check its language families)
            continue
        record = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(record, Family):
            if record.name in found:
                raise RuntimeError(f"two zoo.models modules declare the family {record.name!r}")
            found[record.name] = record
    return found


FAMILIES: dict[str, Family] = _discover()

llava.LANGUAGE_FAMILIES.update((name, f) for name, f in FAMILIES.items()
                               if name not in ("llava", "gemma3_vision", *qwen3_vl.QWEN_VL_FAMILIES))

HF_MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}

if TYPE_CHECKING:
    from zoo.core.contract import ZooModel

    # Each text family's config is checked against the decoder by mypy where its record is made:
    # family(..., build=Decoder) types build as Callable[[its config, ...], ...], which Decoder only accepts for a
    # DecoderConfig. So no list of configs is kept here.
    def _every_model_keeps_the_contract(model: Model) -> ZooModel:  # checked by mypy (tests/test_types.py)
        return model

    def _every_config_is_a_family_config(config: llava.LlavaConfig | qwen2_5_vl.Qwen25VLConfig) -> FamilyConfig:
        return config

    def _gemma3_vision_config_is_a_family_config(config: gemma3_vision.Gemma3VisionConfig) -> FamilyConfig:
        return config
