"""Output head + next-token cross-entropy in chunks, never holding fp32 logits for the whole pack.

A 32K-token pack with a 128K vocabulary has 16 GB of fp32 logits. Here only the positions with a target are
projected, a chunk at a time, and the gradient of each chunk is taken right away (softmax - one_hot is all
cross-entropy needs), so the peak is one chunk of logits and no logits are kept for backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from zoo.packing import IGNORE_INDEX

# fp32 logits per chunk: 1 GB on GPU, where fewer, larger GEMMs run near the matmul peak (2^25 elements, ~260 rows
# at a 128K vocabulary, ran the head 4x slower on an H100); 16 MB on CPU, where a chunk that stays in cache and in
# the allocator's free lists (no fresh pages to fault in) runs the head ~2x faster. At least MIN_ROWS rows, so a
# large vocabulary is not re-read for a handful of tokens.
LOGITS_PER_CHUNK = {"cuda": 1 << 28, "cpu": 1 << 22}
MIN_ROWS = 256


@functools.cache
def _wide_gemm(device_type: str) -> bool:
    """Does this device's mm/addmm take half-precision operands into an fp32 result (`out_dtype`)? Then logits are
    formed and the weight gradient accumulated in fp32 straight from bf16 operands: no fp32 copy of an operand,
    no rounding of a chunk's product to bf16. Asked once, numerically, with a tiny in-place accumulation."""
    try:
        a = torch.randn(8, 16, device=device_type).to(torch.bfloat16)
        b = torch.randn(16, 8, device=device_type).to(torch.bfloat16)
        acc = torch.ones(8, 8, device=device_type)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        logits = torch.mm(a, b, out_dtype=torch.float32)
        want = a.float() @ b.float()
        return bool(torch.allclose(acc, want + 1, atol=1e-3) and torch.allclose(logits, want, atol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _accumulate(acc_VD: Tensor, g_VC: Tensor, h_CD: Tensor, wide: bool) -> None:
    """acc += g @ h into an fp32 accumulator. On GPU the operands stay in bf16/fp16 (an fp32 GEMM there costs
    ~4x); a chunk's product is rounded to that dtype only where the GEMM cannot write fp32 (no `out_dtype`). CPU
    multiplies in fp32, which it does as fast as bf16 and without the rounding."""
    if wide:
        torch.addmm(acc_VD, g_VC, h_CD, out_dtype=torch.float32, out=acc_VD)
    elif g_VC.dtype == torch.float32 or not g_VC.is_cuda:
        acc_VD.addmm_(g_VC.float(), h_CD.float())
    else:
        acc_VD += g_VC @ h_CD


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_MD: Tensor, w_VD: Tensor, target_M: Tensor, denom: float, chunk: int) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # a tensor exactly when need_h / need_w: the type: ignores below are where mypy cannot see that
        grad_h_MD = torch.empty_like(h_MD) if need_h else None
        grad_w_VD = torch.zeros_like(w_VD, dtype=torch.float32) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h_MD.device)
        wide = w_VD.dtype != torch.float32 and _wide_gemm(h_MD.device.type)
        # one logits buffer for all chunks: a fresh [C, V] allocation per chunk costs page faults on CPU
        buf_CV = torch.empty(min(chunk, h_MD.shape[0]), w_VD.shape[0], dtype=torch.float32, device=h_MD.device)
        for s in range(0, h_MD.shape[0], chunk):
            h_CD, y_C = h_MD[s : s + chunk], target_M[s : s + chunk]
            logits_CV = buf_CV[: len(y_C)]
            if w_VD.dtype == torch.float32:
                torch.mm(h_CD, w_VD.T, out=logits_CV)
            elif wide:
                torch.mm(h_CD, w_VD.T, out_dtype=torch.float32, out=logits_CV)
            else:
                logits_CV.copy_(h_CD @ w_VD.T)
            target_C = logits_CV.gather(1, y_C[:, None])[:, 0]
            # log-sum-exp and softmax in place on the one chunk buffer: no second [C, V] temporary
            max_C = logits_CV.amax(dim=-1)
            probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
            sum_C = probs_CV.sum(dim=-1)
            total += (max_C + sum_C.log() - target_C).sum()
            if need_h or need_w:
                g_CV = probs_CV.div_(sum_C[:, None] * denom)  # softmax / denom
                g_CV[torch.arange(len(y_C), device=y_C.device), y_C] -= 1.0 / denom
                g_CV = g_CV.to(h_MD.dtype)
                if need_h:
                    torch.mm(g_CV, w_VD, out=grad_h_MD[s : s + chunk])  # type: ignore[index]
                if need_w:
                    _accumulate(grad_w_VD, g_CV.T, h_CD, wide)  # type: ignore[arg-type]
        ctx.save_for_backward(grad_h_MD, grad_w_VD.to(w_VD.dtype) if need_w else None)  # type: ignore[union-attr]
        return total / denom

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None,
            None,
            None,
            None,
        )


def linear_cross_entropy(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, denominator: int | None = None) -> Tensor:
    """sum over targets of CE(h @ w^T, label) / denominator (default: the number of targets).

    Equals `F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)` with the default denominator
    (on a GPU whose GEMM writes fp32 from bf16 operands, the logits are not rounded to bf16 first: closer to an
    fp32 reference than that expression); a sequence-parallel shard passes the global target count so that the
    ranks' losses sum to the global mean.
    """
    if labels_T.shape[0] != h_TD.shape[0]:
        raise ValueError(f"labels have {labels_T.shape[0]} tokens, hidden states have {h_TD.shape[0]}")
    rows_M = (labels_T != IGNORE_INDEX).nonzero().squeeze(1)
    if len(rows_M) == 0:
        # nothing to predict here: a zero that still reaches the graph, so a rank without targets can backward
        return (h_TD.sum() + w_VD.sum()) * 0.0
    denom = float(len(rows_M) if denominator is None else denominator)
    h_MD, target_M = h_TD.index_select(0, rows_M), labels_T.index_select(0, rows_M)
    chunk = max(MIN_ROWS, LOGITS_PER_CHUNK.get(h_TD.device.type, 1 << 25) // w_VD.shape[0])
    if not torch.is_grad_enabled():
        return _LinearCrossEntropy.forward(_NoCtx(), h_MD, w_VD, target_M, denom, chunk)
    return _LinearCrossEntropy.apply(h_MD, w_VD, target_M, denom, chunk)


class _NoCtx:
    """Stands in for autograd's ctx when no gradient is wanted."""

    needs_input_grad = (False, False, False, False, False)

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        pass
