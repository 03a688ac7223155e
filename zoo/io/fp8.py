"""FP8 block-quantised checkpoints (DeepSeek-V3's format), dequantised as they are read.

Such a checkpoint's config.json has a `quantization_config` with quant_method "fp8" and `weight_block_size`
[128, 128]: each quantised weight [N, K] is stored as float8_e4m3fn beside `<name>_scale_inv` [ceil(N/128),
ceil(K/128)] in fp32, block (i, j) of the weight (the last one in each dimension cut short where N or K is no
multiple of 128) times scale (i, j). `Dequantized` wraps the checkpoint's reader: it lists the weights without their
scales and hands each weight back multiplied out (the product in fp32, cast to the model's dtype), one tensor at a
time, so loading streams as before. Any other quant method is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zoo.errors import ZooError
from zoo.io.paths import json_object, optional
from zoo.io.safetensors import Reader, SafetensorsDir

FP8_WEIGHTS = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"


# quant methods a family's own weight plan dequantises (GPT-OSS's MXFP4 experts, zoo.models.gpt_oss), which this
# reader leaves to it
FAMILY_DEQUANTISED = ("mxfp4",)


def block_size(hf: dict[str, Any], source: Path | str) -> tuple[int, int] | None:
    """The (rows, columns) of a quantised block from a Hugging Face config's quantization_config; None when it has
    none. A ZooError naming `source` for what zoo cannot dequantise."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method in FAMILY_DEQUANTISED:
        return None
    if method != "fp8":
        raise ZooError(f"{source}: quantization_config quant_method {method!r} is not supported; zoo reads fp8 "
                       "block-quantised checkpoints (DeepSeek-V3's weight_scale_inv) and unquantised ones")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ZooError(f"{source}: quantization_config weight_block_size must be two positive integers such as "
                       f"[128, 128], got {block!r} (per-tensor fp8 is not supported)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ZooError(f"{source}: quantization_config fmt must be 'e4m3' (float8_e4m3fn weights), got "
                       f"{quant['fmt']!r}")
    return block[0], block[1]


def dequantize(weight_NK: Tensor, scale_inv: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """weight [N, K] (fp8) times its block's scale (scale_inv [ceil(N/bn), ceil(K/bk)]), in fp32, as `dtype`."""
    N, K = weight_NK.shape
    bn, bk = block
    expected = (-(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scales {list(scale_inv.shape)} for a weight {[N, K]} in blocks {list(block)}: expected "
                         f"{list(expected)}")
    scale_NK = scale_inv.float().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return (weight_NK.float() * scale_NK).to(dtype)


class Dequantized:
    """A Reader over an fp8 block-quantised checkpoint's reader: its names without the scales, each fp8 weight
    dequantised to `dtype` as it is read (see the module docstring)."""

    def __init__(self, reader: Reader, block: tuple[int, int], dtype: torch.dtype) -> None:
        self.reader, self.block, self.dtype, self.path = reader, block, dtype, reader.path
        names = reader.names()
        self.scales = {n[:-len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}
        self._names = [n for n in names if not n.endswith(SCALE_SUFFIX)]
        stray = sorted(set(self.scales) - set(self._names))
        if stray:
            raise ZooError(f"{self.path}: scales without their weight: {', '.join(self.scales[n] for n in stray[:5])}")

    def names(self) -> list[str]:
        return self._names

    def get(self, name: str) -> Tensor:
        t = self.reader.get(name)
        scale = self.scales.get(name)
        if scale is None:
            if t.dtype in FP8_WEIGHTS:
                raise ZooError(f"{self.path}: {name} is {t.dtype} without its {name}{SCALE_SUFFIX}")
            return t
        if t.dtype not in FP8_WEIGHTS or t.dim() != 2:
            raise ZooError(f"{self.path}: {name} has a {name}{SCALE_SUFFIX} but is a {t.dtype} tensor of "
                           f"{t.dim()} dims; expected a float8_e4m3fn matrix")
        try:
            return dequantize(t, self.reader.get(scale), self.block, self.dtype)
        except ValueError as e:
            raise ZooError(f"{self.path}: cannot dequantise {name}: {e}") from e


def dequantizing(reader: SafetensorsDir, dtype: torch.dtype | None = None) -> Reader:
    """`reader`, or a Dequantized over it (to `dtype`, else the checkpoint's own) where the config.json beside its
    tensors says they are fp8 block-quantised."""
    found = optional(reader.path, "config.json", "config")
    raw = json_object(found) if found is not None else {}
    block = None if found is None or raw.get("format") == "zoo" else block_size(raw, found)
    return reader if block is None else Dequantized(reader, block, dtype or checkpoint_dtype(raw))


def checkpoint_dtype(hf: dict[str, Any]) -> torch.dtype:
    """The dtype a quantised checkpoint's other tensors have (config.json's torch_dtype or dtype; bf16 if neither
    names one zoo knows): what its weights are dequantised to unless the load asks for another."""
    name = hf.get("torch_dtype", hf.get("dtype"))
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16) if isinstance(
        name, str) else torch.bfloat16
