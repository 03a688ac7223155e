"""Which tokenizer a recipe uses: --tokenizer, else the model's checkpoint directory, else the bundled one.

The tokenizer and the chat templates themselves live in zoo.io.tokenizer (the generation CLI needs them too).
"""

from __future__ import annotations

from pathlib import Path

from zoo.errors import ZooError
from zoo.io.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def find_tokenizer(tokenizer: str | None, model: str) -> Tokenizer:
    """--tokenizer if given, else the model's checkpoint directory, else the bundled one (for presets)."""
    if tokenizer:
        if not Path(tokenizer).exists():
            raise ZooError(f"tokenizer {tokenizer} does not exist: expected a directory with tokenizer.json or "
                           "tokenizer.model")
        return Tokenizer(tokenizer)
    if Path(model).is_dir():
        found = [Path(model) / f for f in ("tokenizer.json", "tokenizer.model")]
        if not any(f.is_file() for f in found):
            raise ZooError(f"no tokenizer found: looked for {found[0]} and {found[1]}; pass --tokenizer DIR "
                           "(a directory with tokenizer.json or tokenizer.model)")
        return Tokenizer(model)
    from zoo.models.presets import PRESETS

    preset = PRESETS.get(model.lower())  # a preset's name in any case: Qwen3-0.6B is qwen3-0.6b
    if preset is not None and preset.hf_source is not None:
        raise ZooError(f"no tokenizer for preset {model.lower()}: looked for --tokenizer (not given) and a checkpoint "
                       f"directory (--model is a preset name); pass --tokenizer DIR with the tokenizer of "
                       f"{preset.hf_source}")
    return Tokenizer(ASSETS)  # zoo's own presets (debug) use the bundled tokenizer

