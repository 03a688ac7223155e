"""The families zoo knows, by the name in zoo checkpoints and by Hugging Face model_type."""

from typing import TYPE_CHECKING

from zoo.family import Family
from zoo.models import internlm2, llama, llava, openelm

# every model class zoo builds (what zoo.load returns, what zoo.parallel and zoo.save take), and their configs
Model = llama.Llama | internlm2.InternLM2 | openelm.OpenELM | llava.Llava
ModelConfig = llama.LlamaConfig | internlm2.InternLM2Config | openelm.OpenELMConfig | llava.LlavaConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, internlm2.FAMILY, openelm.FAMILY)}
FAMILIES[llava.FAMILY.name] = llava.FAMILY  # LLaVA wraps any of the language-model families above

HF_MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}


if TYPE_CHECKING:
    from zoo.contract import ZooModel

    def _every_model_keeps_the_contract(model: Model) -> ZooModel:  # checked by mypy (tests/test_types.py)
        return model
