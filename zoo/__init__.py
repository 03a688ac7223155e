"""zoo: packed-varlen, sequence-parallel PyTorch re-implementations of Llama, Qwen2.5, Qwen3, Mistral, InternLM2,
OpenELM and LLaVA."""

from zoo.core.attention import BACKENDS, get_attention
from zoo.core.packing import IGNORE_INDEX, Packed, as_packed, pack
from zoo.errors import ZooError
from zoo.io.load import load
from zoo.io.save import save
from zoo.models.presets import PRESETS, get_preset, list_presets

__all__ = ["BACKENDS", "IGNORE_INDEX", "PRESETS", "Packed", "ZooError", "as_packed", "get_attention",
           "get_preset", "list_presets", "load", "pack", "save"]
__version__ = "0.1.0"
