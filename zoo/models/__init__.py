"""The families zoo knows: one `zoo.models.family.Family` record each, by the name in zoo checkpoints and by
Hugging Face model_type. Adding a family: its file here (config, Hugging Face names, conversions, its FAMILY
record), a line below, its presets in zoo/models/presets.py, its tests."""

from typing import TYPE_CHECKING

from zoo.core.contract import FamilyConfig
from zoo.models import (
    gemma3,
    internlm2,
    llama,
    llava,
    mistral,
    mixtral,
    olmo2,
    openelm,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
)
from zoo.models.decoder import Decoder
from zoo.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, internlm2.FAMILY, openelm.FAMILY,
    olmo2.FAMILY,
    gemma3.FAMILY,
    qwen3_moe.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY,
    qwen3_5.FAMILY, qwen3_5_moe.FAMILY,
    llava.FAMILY,  # LLaVA wraps any of the language-model families above
)}

llava.LANGUAGE_FAMILIES.update((name, f) for name, f in FAMILIES.items() if name != "llava")

HF_MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}

# every model class zoo builds (what zoo.load returns, what zoo.parallel and zoo.save take), and their configs
Model = Decoder | llava.Llava
ModelConfig = FamilyConfig


if TYPE_CHECKING:
    from zoo.core.contract import DecoderConfig, ZooModel

    def _every_model_keeps_the_contract(model: Model) -> ZooModel:  # checked by mypy (tests/test_types.py)
        return model

    def _every_config_is_a_family_config(config: llava.LlavaConfig) -> FamilyConfig:
        return config

    def _every_text_config_serves_the_decoder(
            config: llama.LlamaConfig | qwen2.Qwen2Config | qwen3.Qwen3Config | mistral.MistralConfig
            | internlm2.InternLM2Config | openelm.OpenELMConfig
            | olmo2.Olmo2Config
            | gemma3.Gemma3Config
            | qwen3_moe.Qwen3MoeConfig | mixtral.MixtralConfig | qwen2_moe.Qwen2MoeConfig
            | qwen3_5.Qwen3_5Config | qwen3_5_moe.Qwen3_5MoeConfig) -> DecoderConfig:
        return config
