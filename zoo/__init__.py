"""zoo: packed-varlen, sequence-parallel PyTorch re-implementations of Llama, Qwen2.5, Qwen3, Mistral, Gemma 3,
OLMo 2, InternLM2, OpenELM, Phi-3/Phi-4, GLM-4, Qwen3.5 (Gated DeltaNet), the Mixture-of-Experts Qwen3-MoE,
Mixtral, Qwen2-MoE and Qwen3.5-MoE, and LLaVA."""

import os as _os

# OpenMP's threads wait for work by spinning unless told otherwise: beside another busy process on the same cores,
# two spinning thread teams starve each other (2-thread CPU training fell from ~7,000 to ~300 tokens/s with a second
# one running; passive, both ran at ~6,800). Waiting passively costs nothing measurable alone. Set before torch loads
# its OpenMP runtime (a program that imported torch first keeps its own); a value already set wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from zoo.core.attention import BACKENDS, get_attention  # noqa: E402
from zoo.core.packing import IGNORE_INDEX, Packed, as_packed, pack  # noqa: E402
from zoo.errors import ZooError  # noqa: E402
from zoo.io.load import load  # noqa: E402
from zoo.io.save import save  # noqa: E402
from zoo.models.presets import PRESETS, get_preset, list_presets  # noqa: E402

__all__ = ["BACKENDS", "IGNORE_INDEX", "PRESETS", "Packed", "ZooError", "as_packed", "get_attention",
           "get_preset", "list_presets", "load", "pack", "save"]
__version__ = "0.1.0"
