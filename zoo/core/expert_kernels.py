"""Which kernel a Mixture-of-Experts layer's experts run on (zoo.core.moe.expert_mlp): `F.grouped_mm` where a probe
finds it runs forward and backward on the device and dtype (asked once per process, as the attention kernels'
probes), else padded batched GEMMs, or inside a compiled decoding step each row's gathered expert weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core.internals import run_eagerly

_GROUPED_MM_RUNS: dict[tuple[str, int | None, torch.dtype], bool] = {}  # the probe's answers


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            x = torch.randn(6, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([2, 6], device=device, dtype=torch.int32)
            y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
            y.backward(torch.ones_like(y))
        ref = torch.cat([x[:2].float() @ w[0].float().T, x[2:].float() @ w[1].float().T])
        return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)) and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


# a probe runs real kernels: never traced (a compiled region calls it eagerly, once)
_probe_grouped_mm = run_eagerly(_probe)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Does F.grouped_mm run forward and backward, exactly, on this device and dtype? Asked once per process."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM_RUNS:
        _GROUPED_MM_RUNS[key] = _probe_grouped_mm(device, dtype)
    return _GROUPED_MM_RUNS[key]


# under torch.compile, at most this many weight elements gathered for the rows of one projection: a decoding step's
# few rows take the gathered path (static shapes, so a fullgraph compile holds); more, the padded one, run eagerly
GATHER_LIMIT = 1 << 26


def describe(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, dim: int = 2048,
             ffn_dim: int = 768) -> str:
    """Which kernel the experts of this width run on `device` in `dtype` in this process, eagerly (the probe runs
    once): "grouped_mm" or "padded_bmm" (inside a compiled decoding step, "gathered" for a few rows)."""
    x = torch.empty(1, dim, device=device, dtype=dtype)
    return pick_kernel(x, ffn_dim, dim)


def pick_kernel(x: Tensor, *widths: int) -> str:
    """grouped_mm where it runs on x's device and dtype and every row is 16-byte aligned (under torch.compile in
    bf16 only: the op's shape rule takes nothing else); else padded_bmm, or inside a compiled model the gathered
    weights for a few rows (decoding)."""
    aligned = all(w * x.element_size() % 16 == 0 for w in widths)
    compiling = torch.compiler.is_compiling()
    if aligned and (x.dtype == torch.bfloat16 or not compiling) and grouped_mm_runs(x.device, x.dtype):
        return "grouped_mm"
    if compiling and x.shape[0] * 2 * widths[0] * widths[-1] <= GATHER_LIMIT:
        return "gathered"
    return "padded_bmm"
