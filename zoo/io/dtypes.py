"""The dtype names zoo accepts, in one table: `zoo.load(dtype=...)` takes every spelling, the command lines
(`convert.*`, `python -m zoo.generate`) offer the full names as their `--dtype` choices."""

from __future__ import annotations

import torch

from zoo.errors import ZooError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the full names
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_NAMES = {name: dtype for full, dtype in DTYPES.items() for name in (full, SHORT_NAMES[full])}  # every spelling


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype, or its name: float32/bfloat16/float16 (also "torch.bfloat16") or fp32/bf16/fp16."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.removeprefix("torch.")]
    raise ZooError(f"dtype {dtype!r} is not one zoo loads weights in; use one of {', '.join(DTYPE_NAMES)} "
                   "(or torch.float32 / torch.bfloat16 / torch.float16)")
