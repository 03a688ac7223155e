"""One pair of ring blocks attended with its log-sum-exp: the kernels ring attention runs per step.

Shapes: T query tokens of this rank, S key tokens of one block, N query heads, K KV heads (query head i reads
KV head i // G, with G = N / K query heads per KV head), H head dim.

Each kernel returns (out, lse) of the queries against one block of keys, and `merge` combines the partial results
of disjoint key sets by an fp32 log-sum-exp. The backward is the flash-attention one, given the final lse: P =
exp(q k^T * scale - lse), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K, dK = dS^T Q.

`math_forward`/`math_backward` do a whole block in fp32 with the mask from global indices (zoo.parallel.ring_blocks):
the reference the tests hold the others to. `varlen_forward`/`varlen_backward` run the block as per-document
segments (`segments`, `window_segments`) through a varlen kernel with LSE: flash varlen on CUDA (bf16/fp16;
zoo.core.kernels.lse_kernels), torch's fused CPU flash kernel on CPU, or the same contract done densely per segment
(`math_varlen_lse`). `block_kernels` picks them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from zoo.core.internals import cpu_flash_attention, fallback, flash_backward_problem
from zoo.core.kernels import lse_kernels, require_lse_kernels
from zoo.core.score_mods import cap
from zoo.parallel.ring_blocks import BlockMeta, mask_TS, segments, window_cuts, window_segments

# the varlen contract of the block kernels, on gathered segment rows:
# (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None) -> (out, lse [N, rows]); `window=(left, right)`
# replaces `causal` by flash's band: query row r of a segment of Lq x Lk sees key column c when
# -left <= c - r - (Lk - Lq) <= right (-1: unbounded), which is causal within left + 1 keys for (left, 0)
VarlenLse = Callable[..., tuple[Tensor, Tensor]]
# (do, q, k, v, out, lse, delta, cu_q, cu_k, max_q, max_k, causal, scale, window=None) -> (dq, dk, dv)
VarlenLseBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


# ---- the math kernel: dense, fp32, any device ----


def _grouped(q_TNH: Tensor, k_SKH: Tensor) -> tuple[Tensor, Tensor]:
    """q as [K, G, T, H] and k as [K, 1, S, H], fp32: query head i reads KV head i // G, no K/V repeat."""
    T, N, H = q_TNH.shape
    K = k_SKH.shape[1]
    return (q_TNH.float().view(T, K, N // K, H).permute(1, 2, 0, 3),
            k_SKH.float().permute(1, 0, 2).unsqueeze(1))


def dense_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, allowed_TS: Tensor | None,
                  scale: float, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(out [T, N, H] fp32, lse [N, T] fp32) of q against k/v where allowed (None: everywhere), the scores capped
    by `softcap` (zoo.core.score_mods.cap) when given.

    Rows with no allowed key get out 0 and lse -inf, so merging them changes nothing."""
    T, N, H = q_TNH.shape
    q_KGTH, k_K1SH = _grouped(q_TNH, k_SKH)
    v_K1SH = v_SKH.float().permute(1, 0, 2).unsqueeze(1)
    s_KGTS = cap((q_KGTH @ k_K1SH.transpose(-1, -2)) * scale, softcap)
    if allowed_TS is not None:
        s_KGTS = s_KGTS.masked_fill(~allowed_TS, float("-inf"))
    lse_KGT = torch.logsumexp(s_KGTS, dim=-1)
    p_KGTS = torch.exp(s_KGTS - _finite(lse_KGT)[..., None])
    o_KGTH = p_KGTS @ v_K1SH
    return o_KGTH.reshape(N, T, H).transpose(0, 1), lse_KGT.reshape(N, T)


def dense_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, lse_NT: Tensor, do_TNH: Tensor, delta_NT: Tensor,
                   allowed_TS: Tensor | None, scale: float,
                   softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [T, N, H], dk [S, K, H], dv [S, K, H]) fp32, given the final lse and rowsum(dO * O) of the queries; with
    a `softcap` the score gradient passes through the cap's derivative, 1 - tanh^2."""
    T, N, H = q_TNH.shape
    K = k_SKH.shape[1]
    q_KGTH, k_K1SH = _grouped(q_TNH, k_SKH)
    v_K1SH = v_SKH.float().permute(1, 0, 2).unsqueeze(1)
    do_KGTH = do_TNH.float().view(T, K, N // K, H).permute(1, 2, 0, 3)
    s_KGTS = (q_KGTH @ k_K1SH.transpose(-1, -2)) * scale
    tanh_KGTS = None
    if softcap is not None:
        tanh_KGTS = torch.tanh(s_KGTS / softcap)
        s_KGTS = tanh_KGTS * softcap
    if allowed_TS is not None:
        s_KGTS = s_KGTS.masked_fill(~allowed_TS, float("-inf"))
    p_KGTS = torch.exp(s_KGTS - lse_NT.view(K, N // K, T, 1))
    dv_KSH = (p_KGTS.transpose(-1, -2) @ do_KGTH).sum(1)
    dp_KGTS = do_KGTH @ v_K1SH.transpose(-1, -2)
    ds_KGTS = p_KGTS * (dp_KGTS - delta_NT.view(K, N // K, T, 1)) * scale
    if tanh_KGTS is not None:
        ds_KGTS = ds_KGTS * (1 - tanh_KGTS * tanh_KGTS)
    dq_KGTH = ds_KGTS @ k_K1SH
    dk_KSH = (ds_KGTS.transpose(-1, -2) @ q_KGTH).sum(1)
    return dq_KGTH.reshape(N, T, H).transpose(0, 1), dk_KSH.transpose(0, 1), dv_KSH.transpose(0, 1)


def math_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta,
                 scale: float, window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """One whole block with the document-causal (windowed) mask from global indices: the reference, any layout."""
    return dense_forward(q_TNH, k_SKH, v_SKH, mask_TS(q, k, window), scale, softcap)


def math_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, lse_NT: Tensor, do_TNH: Tensor, delta_NT: Tensor,
                  q: BlockMeta, k: BlockMeta, scale: float, window: int | None = None,
                  softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of math_forward's block, given the final lse and delta = rowsum(dO * O) of the queries.

    Unlike the flash kernels it needs no output: delta carries all it would read from it."""
    return dense_backward(q_TNH, k_SKH, v_SKH, lse_NT, do_TNH, delta_NT, mask_TS(q, k, window), scale, softcap)


def _capped_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                    diagonal: bool, window: int | None = None, *, softcap: float) -> tuple[Tensor, Tensor]:
    return math_forward(q_TNH, k_SKH, v_SKH, q, k, scale, window, softcap)


def _capped_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, o_TNH: Tensor, lse_NT: Tensor, do_TNH: Tensor,
                     delta_NT: Tensor, q: BlockMeta, k: BlockMeta, scale: float, diagonal: bool,
                     window: int | None = None, *, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    return math_backward(q_TNH, k_SKH, v_SKH, lse_NT, do_TNH, delta_NT, q, k, scale, window, softcap)


def _finite(lse: Tensor) -> Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(o_TNH: Tensor, lse_NT: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax results of the same queries over disjoint key sets (fp32)."""
    lse = torch.logaddexp(lse_NT, lse_b)
    safe = _finite(lse)
    w_a = torch.exp(lse_NT - safe).T[..., None]
    w_b = torch.exp(lse_b - safe).T[..., None]
    return o_TNH * w_a + o_b * w_b, lse


# ---- the varlen kernels: per-document segments, with LSE ----


def _cu(lens: list[int], device: torch.device) -> Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return cu.to(device)


def varlen_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                   diagonal: bool, kernel: VarlenLse | None = None, window: int | None = None) -> tuple[Tensor, Tensor]:
    """Like math_forward, through a varlen kernel `kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    -> (out, lse [N, rows])` run on the gathered segment rows; default: torch's flash varlen (CUDA). With a
    window, one call per `window_segments` call, merged by LSE."""
    kernel = kernel or require_lse_kernels().forward
    T, N, H = q_TNH.shape
    o_TNH = torch.zeros(T, N, H, dtype=torch.float32, device=q_TNH.device)
    lse_NT = torch.full((N, T), float("-inf"), dtype=torch.float32, device=q_TNH.device)
    if window is not None:
        for rows_q, rows_k, lens_q, lens_k, band in window_segments(q, k, diagonal, window):
            o, lse = kernel(q_TNH[rows_q], k_SKH[rows_k], v_SKH[rows_k], _cu(lens_q, q_TNH.device),
                            _cu(lens_k, q_TNH.device), max(lens_q), max(lens_k), True, scale, window=band)
            o_TNH[rows_q], lse_NT[:, rows_q] = merge(o_TNH[rows_q], lse_NT[:, rows_q], o.float(), lse.float())
        return o_TNH, lse_NT
    rows_q, rows_k, lens_q, lens_k, causal = segments(q, k, diagonal)
    if not lens_q:
        return o_TNH, lse_NT
    o, lse = kernel(q_TNH[rows_q], k_SKH[rows_k], v_SKH[rows_k], _cu(lens_q, q_TNH.device),
                    _cu(lens_k, q_TNH.device), max(lens_q), max(lens_k), causal, scale)
    o_TNH[rows_q] = o.float()
    lse_NT[:, rows_q] = lse.float()
    return o_TNH, lse_NT


def varlen_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, o_TNH: Tensor, lse_NT: Tensor, do_TNH: Tensor,
                    delta_NT: Tensor, q: BlockMeta, k: BlockMeta, scale: float, diagonal: bool,
                    kernel_bwd: VarlenLseBackward | None = None,
                    window: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Like math_backward, through a varlen backward kernel fed the final out/lse (gathered segment rows); the
    kernel gets both out and delta = rowsum(dO * O), and uses either (flash recomputes delta from out)."""
    kernel_bwd = kernel_bwd or require_lse_kernels().backward
    dq = torch.zeros(q_TNH.shape, dtype=torch.float32, device=q_TNH.device)
    dk = torch.zeros(k_SKH.shape, dtype=torch.float32, device=q_TNH.device)
    dv = torch.zeros(v_SKH.shape, dtype=torch.float32, device=q_TNH.device)
    calls: list[tuple[Tensor, Tensor, list[int], list[int], bool, tuple[int, int] | None]]
    if window is not None:
        calls = [(rq, rk, lq, lk, True, band) for rq, rk, lq, lk, band in window_segments(q, k, diagonal, window)]
    else:
        rows_q, rows_k, lens_q, lens_k, causal = segments(q, k, diagonal)
        calls = [(rows_q, rows_k, lens_q, lens_k, causal, None)] if lens_q else []
    for rows_q, rows_k, lens_q, lens_k, causal, band in calls:
        # given the final lse, each call's gradient is its share: the shares of calls sharing rows add up
        dq_r, dk_r, dv_r = kernel_bwd(do_TNH[rows_q], q_TNH[rows_q], k_SKH[rows_k], v_SKH[rows_k], o_TNH[rows_q],
                                      lse_NT[:, rows_q].contiguous(), delta_NT[:, rows_q], _cu(lens_q, q_TNH.device),
                                      _cu(lens_k, q_TNH.device), max(lens_q), max(lens_k), causal, scale,
                                      **({} if band is None else {"window": band}))
        dq.index_add_(0, rows_q, dq_r.float())
        dk.index_add_(0, rows_k, dk_r.float())
        dv.index_add_(0, rows_k, dv_r.float())
    return dq, dk, dv


def _segment_pairs(cu_q: Tensor, cu_k: Tensor) -> Iterator[tuple[int, int, int, int]]:
    return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True)


def _allowed(n_q: int, n_k: int, causal: bool, window: tuple[int, int] | None, device: torch.device) -> Tensor | None:
    """A segment's [n_q, n_k] mask under the varlen contract (None: all allowed)."""
    if window is None:
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q) if causal else None
    left, right = window
    rel = torch.arange(n_k, device=device)[None, :] - torch.arange(n_q, device=device)[:, None] - (n_k - n_q)
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= rel >= -left
    if right >= 0:
        allowed &= rel <= right
    return allowed


def math_varlen_lse(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                    scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """The flash varlen contract done densely per segment: the CPU kernel, and the GPU kernel's stand-in in tests."""
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        allowed = _allowed(qb - qa, kb - ka, causal, window, q.device)
        o[qa:qb], lse[:, qa:qb] = dense_forward(q[qa:qb], k[ka:kb], v[ka:kb], allowed, scale)
    return o, lse


def math_varlen_lse_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, delta: Tensor,
                             cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                             scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """math_varlen_lse's gradients, densely per segment (from delta; `o` is part of the contract, unused here)."""
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        allowed = _allowed(qb - qa, kb - ka, causal, window, q.device)
        dq[qa:qb], dk[ka:kb], dv[ka:kb] = dense_backward(q[qa:qb], k[ka:kb], v[ka:kb], lse[:, qa:qb], do[qa:qb],
                                                         delta[:, qa:qb], allowed, scale)
    return dq, dk, dv


def _require_cpu_flash_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    ops = cpu_flash_attention()
    if ops is None:
        raise RuntimeError(f"torch {torch.__version__} has no fused CPU flash attention with a backward; "
                           "the ring runs math_varlen_lse instead")
    return ops


def _heads_first(x_TnH: Tensor) -> Tensor:
    return x_TnH.transpose(0, 1)[None]


def _additive(n_q: int, n_k: int, window: tuple[int, int] | None, dtype: torch.dtype,
              device: torch.device) -> Tensor | None:
    """The fused CPU kernel's attn_mask for a windowed segment: 0 where allowed, -inf elsewhere."""
    if window is None:
        return None
    allowed = _allowed(n_q, n_k, True, window, device)
    assert allowed is not None
    return torch.zeros(n_q, n_k, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def cpu_flash_lse(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                  scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """The varlen contract through torch's fused CPU flash kernel (the one sdpa runs), one call per segment; a
    window goes in as an additive [Lq, Lk] mask (the kernel has no window of its own)."""
    fwd, _ = _require_cpu_flash_ops()
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        mask = _additive(qb - qa, kb - ka, window, q.dtype, q.device)
        o_1NLH, lse_1NL = fwd(_heads_first(q[qa:qb]), _heads_first(k[ka:kb]), _heads_first(v[ka:kb]), 0.0,
                              causal and window is None, attn_mask=mask, scale=scale)
        o[qa:qb], lse[:, qa:qb] = o_1NLH[0].transpose(0, 1), lse_1NL[0]
    return o, lse


def cpu_flash_lse_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, delta: Tensor,
                           cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                           scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """cpu_flash_lse's gradients through the fused CPU flash backward (from `o`; `delta` is unused here)."""
    _, bwd = _require_cpu_flash_ops()
    dq, dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v))
    do, o = do.to(q.dtype), o.to(q.dtype)
    lse = lse.to(torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)  # what the kernel keeps
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        mask = _additive(qb - qa, kb - ka, window, q.dtype, q.device)
        dq_, dk_, dv_ = bwd(_heads_first(do[qa:qb]), _heads_first(q[qa:qb]), _heads_first(k[ka:kb]),
                            _heads_first(v[ka:kb]), _heads_first(o[qa:qb]), lse[None, :, qa:qb], 0.0,
                            causal and window is None, attn_mask=mask, scale=scale)
        dq[qa:qb], dk[ka:kb], dv[ka:kb] = dq_[0].transpose(0, 1), dk_[0].transpose(0, 1), dv_[0].transpose(0, 1)
    return dq, dk, dv


# (q, k, v, q block, k block, scale, diagonal, window=None) -> (out, lse); the backward likewise, see varlen_backward
BlockForward = Callable[..., tuple[Tensor, Tensor]]
BlockBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _dense_where_cut_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                             diagonal: bool, window: int | None = None) -> tuple[Tensor, Tensor]:
    if window is not None and window_cuts(q, k, window):
        return math_forward(q_TNH, k_SKH, v_SKH, q, k, scale, window)
    return varlen_forward(q_TNH, k_SKH, v_SKH, q, k, scale, diagonal)


def _dense_where_cut_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, o_TNH: Tensor, lse_NT: Tensor,
                              do_TNH: Tensor, delta_NT: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                              diagonal: bool, window: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if window is not None and window_cuts(q, k, window):
        return math_backward(q_TNH, k_SKH, v_SKH, lse_NT, do_TNH, delta_NT, q, k, scale, window)
    return varlen_backward(q_TNH, k_SKH, v_SKH, o_TNH, lse_NT, do_TNH, delta_NT, q, k, scale, diagonal)


def block_kernels(device: torch.device, dtype: torch.dtype, override: tuple[BlockForward, BlockBackward] | None,
                  window: int | None = None, softcap: float | None = None) -> tuple[BlockForward, BlockBackward]:
    """(forward, backward) block kernels, all over per-document segments: flash varlen on CUDA in half precision
    (`zoo.core.kernels.lse_kernels`), torch's fused CPU flash kernel on CPU, dense fp32 math elsewhere. With a
    `softcap` (which neither flash kernel takes), the dense fp32 math kernel with the cap, whatever `override` says."""
    if softcap is not None:
        return (functools.partial(_capped_forward, softcap=softcap),
                functools.partial(_capped_backward, softcap=softcap))
    if override is not None:
        return override
    lse = lse_kernels() if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) else None
    if lse is not None:  # flash kernels take half types only
        if window is None or lse.window:
            return varlen_forward, varlen_backward
        # a torch whose flash varlen kernels take no window: blocks the window cuts run the dense fp32 math kernel
        # ([T, S] scores per block: fine for the short blocks of tests, costly for long ones), the others flash
        return _dense_where_cut_forward, _dense_where_cut_backward
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        fallback("the ring's flash block kernels", "the ring's dense fp32 math kernel (slow, more memory)",
                 flash_backward_problem() or "torch's varlen_attn returns no lse or takes no causal switch")
    fwd: VarlenLse
    bwd: VarlenLseBackward
    if device.type == "cpu" and cpu_flash_attention() is not None:
        fwd, bwd = cpu_flash_lse, cpu_flash_lse_backward
    else:
        fwd, bwd = math_varlen_lse, math_varlen_lse_backward
    return functools.partial(varlen_forward, kernel=fwd), functools.partial(varlen_backward, kernel_bwd=bwd)

