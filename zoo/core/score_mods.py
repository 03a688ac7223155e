"""Score modifiers of softmax attention: a learned sink logit per head, and soft-capping of the scores.

Shapes: T tokens, N query heads, K KV heads, G = N / K query heads per KV head, H head dim, L keys.

- **softcap** (Gemma 2's `attn_logit_softcapping`): scores = cap * tanh(scores / cap), after the scale and before
  the mask and the softmax.
- **sinks** (GPT-OSS): a logit per query head that joins each query's softmax denominator as exp(sink) and attends
  to no value: p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink)). Given the plain softmax's output o and log-sum-exp
  lse, the sink's output is o * exp(lse - lse') with lse' = logaddexp(lse, sink), i.e. o * sigmoid(lse - sink): a
  kernel that returns lse carries sinks without knowing them (flex, a varlen kernel with lse, the ring's merge).
  Its backward is the flash backward handed the final o' and lse' (the sink is one more key with a zero value), and
  d sink = -sum_T exp(sink - lse') * rowsum(dO * o').

Every attention function takes them as keyword options `sinks` ([N] logits of the call's query heads) and
`softcap` (a positive float), absent or None for none; `zoo.core.attention` says which path each backend runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from zoo.errors import ZooError

# the varlen contract with lse (zoo.core.kernels.LseKernels, the ring's block kernels):
# fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None) -> (out, lse [N, rows]);
# bwd(do, q, k, v, out, lse, delta, cu_q, cu_k, max_q, max_k, causal, scale, window=None) -> (dq, dk, dv)
LseForward = Callable[..., tuple[Tensor, Tensor]]
LseBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def check_window(window: int | None) -> int | None:
    """`window` as every attention function takes it: None, or a positive int (keys seen, the query included)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ZooError(f"attention window must be a positive int (keys a query sees, itself included) or None for "
                       f"no window; got {window!r}")
    return window


def check_mods(sinks: Tensor | None, softcap: float | None, n_heads: int) -> None:
    """`sinks` None or [n_heads] logits; `softcap` None or a positive finite number."""
    if sinks is not None and (not isinstance(sinks, Tensor) or tuple(sinks.shape) != (n_heads,)):
        got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ZooError(f"attention sinks must be a tensor of one logit per query head, shape ({n_heads},); got {got}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ZooError(f"attention softcap must be a positive finite number or None; got {softcap!r}")


def mods(sinks: Tensor | None, softcap: float | None) -> dict[str, Any]:
    """The keyword options to pass on: only those set, so a function that knows neither sees the same call."""
    out: dict[str, Any] = {}
    if sinks is not None:
        out["sinks"] = sinks
    if softcap is not None:
        out["softcap"] = softcap
    return out


def cap(scores: Tensor, softcap: float | None) -> Tensor:
    """cap * tanh(scores / cap), as Gemma 2 computes it (divide, tanh, multiply); None: scores unchanged."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def softmax(scores: Tensor, sinks_G: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Softmax over the last dim in fp32, cast to `dtype`; with sinks (broadcast against scores[..., :1]), each row's
    sink joins the denominator as one more column that is dropped after."""
    if sinks_G is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    scores = scores.float()
    sink = sinks_G.float().expand_as(scores[..., :1])
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(dtype)


def dense(q_nKGH: Tensor, k_nKLH: Tensor, v_nKLH: Tensor, allowed: Tensor, scale: float | None,
          sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """softmax(cap(q k^T * scale) masked, sinks) v over grouped heads (leading dims broadcast; `allowed` broadcasts
    against the [..., K, G, Q, L] scores): a decode step over the KV cache, where sdpa has no score modifier."""
    H = q_nKGH.shape[-1]
    scale = H**-0.5 if scale is None else scale
    scores = cap((q_nKGH @ k_nKLH.transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    K, G = q_nKGH.shape[-4], q_nKGH.shape[-3]
    sinks_KG11 = None if sinks is None else sinks.view(K, G, 1, 1)
    return softmax(scores, sinks_KG11, q_nKGH.dtype) @ v_nKLH


def with_sinks(o_TNH: Tensor, lse_NT: Tensor, sinks_N: Tensor) -> Tensor:
    """The output of softmax with sinks from the plain softmax's output and lse (differentiable through both)."""
    weight_TN1 = torch.sigmoid(lse_NT.float() - sinks_N.float()[:, None]).T[..., None]
    return (o_TNH.float() * weight_TN1).to(o_TNH.dtype)


def sink_lse(o_TNH: Tensor, lse_NT: Tensor, sinks_N: Tensor) -> tuple[Tensor, Tensor]:
    """(o', lse') in fp32: the output and log-sum-exp once each query's sink has joined its denominator."""
    lse2_NT = torch.logaddexp(lse_NT.float(), sinks_N.float()[:, None])
    return o_TNH.float() * torch.exp(lse_NT.float() - lse2_NT).T[..., None], lse2_NT


def sink_grad(sinks_N: Tensor, lse_NT: Tensor, delta_NT: Tensor) -> Tensor:
    """d loss / d sinks given the final lse' (sink included) and delta = rowsum(dO * o'): -sum_T p_sink * delta."""
    return -(torch.exp(sinks_N.float()[:, None] - lse_NT) * delta_NT).sum(-1)


class SinkVarlen(torch.autograd.Function):
    """Document-causal attention with sinks through a varlen kernel with lse (`LseForward`/`LseBackward`): the
    plain forward, its output corrected by the sinks, the backward handed the final output and lse."""

    @staticmethod
    def forward(ctx: Any, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, sinks_N: Tensor, cu: Tensor, max_len: int,
                scale: float, band: tuple[int, int] | None, fwd: LseForward, bwd: LseBackward) -> Tensor:
        window = {} if band is None else {"window": band}
        o, lse = fwd(q_TNH, k_TKH, v_TKH, cu, cu, max_len, max_len, True, scale, **window)
        o2, lse2 = sink_lse(o, lse, sinks_N)
        out = o2.to(q_TNH.dtype)
        ctx.save_for_backward(q_TNH, k_TKH, v_TKH, sinks_N, out, lse2, cu)
        ctx.max_len, ctx.scale, ctx.window, ctx.bwd = max_len, scale, window, bwd
        return out

    @staticmethod
    def backward(ctx: Any, do_TNH: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, sinks_N, out, lse2, cu = ctx.saved_tensors
        delta_NT = (do_TNH.float() * out.float()).sum(-1).T.contiguous()
        dq, dk, dv = ctx.bwd(do_TNH.contiguous(), q, k, v, out, lse2.contiguous(), delta_NT, cu, cu, ctx.max_len,
                             ctx.max_len, True, ctx.scale, **ctx.window)
        dsinks = sink_grad(sinks_N, lse2, delta_NT).to(sinks_N.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None, None


@functools.cache
def softcap_mod(softcap: float) -> Callable[..., Tensor]:
    """FlexAttention's score_mod for a cap: one function object per cap, so a compiled flex is reused."""

    def softcapped(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / softcap) * softcap

    return softcapped
