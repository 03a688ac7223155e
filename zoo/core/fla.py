"""flash-linear-attention (`fla`, an optional extra) for Gated DeltaNet layers: whether its Triton kernels import
and can train here, and the convolution + gated delta rule over a pack's documents by them (cu_seqlens).
zoo.core.deltanet chooses between them and its own torch path."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from zoo.core.internals import run_eagerly

FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def fla_kernels() -> tuple[Callable[..., Any], Callable[..., Any], str] | None:
    """flash-linear-attention's (causal_conv1d, chunk_gated_delta_rule, version) where they import (they need
    Triton), else None."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        conv = importlib.import_module("fla.modules.causal_conv1d").causal_conv1d
        rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:  # an install without Triton or built for another torch: the torch path runs
        return None
    return conv, rule, str(getattr(importlib.import_module("fla"), "__version__", "?"))


@functools.cache
def fla_backward_refused(device: torch.device) -> str | None:
    """Why fla's gated backward cannot run on `device`, or None: fla 0.6 raises in backward on Hopper with Triton
    3.4.0 up to 3.7.1 (wrong gradients there, its issue #640) unless tilelang is installed."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    version = str(getattr(importlib.import_module("triton"), "__version__", "0"))
    if (3, 4) <= _version(version) < (3, 7, 1):
        return f"fla's backward refuses Hopper with Triton {version} (< 3.7.1, fla issue #640) without tilelang"
    return None


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def fla_refused(device: torch.device, dtype: torch.dtype, head_dims: tuple[int, int]) -> str | None:
    """Why fla's kernels do not run a training step here, or None where they do."""
    return fla_forward_refused(device, dtype, head_dims) or fla_backward_refused(device)


def fla_forward_refused(device: torch.device, dtype: torch.dtype, head_dims: tuple[int, int]) -> str | None:
    """Why fla's kernels do not run a forward here (prefill, evaluation, reference log-probs: no gradient), or
    None where they do; its backward may still be refused (`fla_backward_refused`)."""
    if device.type != "cuda":
        return "fla needs CUDA"
    if fla_kernels() is None:
        return "flash-linear-attention is not installed or does not import"
    if dtype not in FLA_DTYPES:
        return f"fla takes no {str(dtype).removeprefix('torch.')}"
    if not all(16 <= d <= 256 and d & (d - 1) == 0 for d in head_dims):
        return f"fla tiles head dims that are powers of two in 16..256, not {head_dims}"
    return None


def fla_documents(mixed_TC: Tensor, conv_CK: Tensor, beta_TH: Tensor, g_TH: Tensor, cu_seqlens: Tensor,
                  Hk: int, Dk: int, Dv: int, states_out: list[Tensor] | None = None) -> Tensor:
    """[T, Hv, Dv] the convolution (+ SiLU) and the gated delta rule by flash-linear-attention's kernels, every
    document from a zero state (cu_seqlens), q and k L2-normalised inside; value heads grouped over key heads as
    zoo groups them (value head j reads key head j // (Hv / Hk)). `states_out` as chunked_delta_rule's."""
    kernels = fla_kernels()
    assert kernels is not None, "pick_kernel chose fla where it does not import"
    causal_conv1d, chunk_gated_delta_rule, _ = kernels
    T, Hv = beta_TH.shape
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    none_empty = bool((lens > 0).all())  # empty documents are left out of the kernels' cu_seqlens (state: zero)
    cu_runs = cu if none_empty else torch.cat([cu[:1], cu[1:][lens > 0]])
    qkv_1TC, _ = causal_conv1d(mixed_TC[None], weight=conv_CK, activation="silu", cu_seqlens=cu_runs)
    q_TC, k_TC, v_TC = qkv_1TC[0].split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    o_1THV, state_rHDV = chunk_gated_delta_rule(
        q_TC.reshape(1, T, Hk, Dk), k_TC.reshape(1, T, Hk, Dk), v_TC.reshape(1, T, Hv, Dv), g_TH[None],
        beta_TH[None], scale=Dk ** -0.5, cu_seqlens=cu_runs, use_qk_l2norm_in_kernel=True,
        output_final_state=states_out is not None)
    if states_out is not None:
        state_nHDV = state_rHDV.float()
        if not none_empty:
            state_nHDV = state_rHDV.new_zeros(lens.numel(), *state_rHDV.shape[1:], dtype=torch.float32)
            state_nHDV[lens > 0] = state_rHDV.float()
        states_out.append(state_nHDV)
    return o_1THV[0]


# Triton kernels behind autograd Functions that sync with the host: run eagerly inside a compiled block
fla_documents_eager = run_eagerly(fla_documents)
