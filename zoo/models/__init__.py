"""The families zoo knows, by the name in zoo checkpoints and by Hugging Face model_type."""

from zoo.family import Family
from zoo.models import internlm2, llama, llava, openelm

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, internlm2.FAMILY, openelm.FAMILY)}
FAMILIES[llava.FAMILY.name] = llava.FAMILY  # LLaVA wraps any of the language-model families above

HF_MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
