"""Output head + next-token cross-entropy in chunks, never holding fp32 logits for the whole pack.

A 32K-token pack with a 128K vocabulary has 16 GB of fp32 logits. Here only the positions with a target are
projected, a chunk at a time, and the gradient of each chunk is taken right away (softmax - one_hot is all
cross-entropy needs), so the peak is one chunk of logits and no logits are kept for backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zoo.packing import IGNORE_INDEX

# fp32 logits per chunk: 128 MB on GPU; 16 MB on CPU, where a chunk that stays in cache and in the allocator's
# free lists (no fresh pages to fault in) runs the head ~2x faster. At least MIN_ROWS rows, so a large vocabulary
# is not re-read for a handful of tokens.
LOGITS_PER_CHUNK = {"cuda": 1 << 25, "cpu": 1 << 22}
MIN_ROWS = 256


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_MD: Tensor, w_VD: Tensor, target_M: Tensor, denom: float, chunk: int) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_MD = torch.empty_like(h_MD) if need_h else None
        grad_w_VD = torch.zeros_like(w_VD, dtype=torch.float32) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h_MD.device)
        # one logits buffer for all chunks: a fresh [C, V] allocation per chunk costs page faults on CPU
        buf_CV = torch.empty(min(chunk, h_MD.shape[0]), w_VD.shape[0], dtype=torch.float32, device=h_MD.device)
        for s in range(0, h_MD.shape[0], chunk):
            h_CD, y_C = h_MD[s : s + chunk], target_M[s : s + chunk]
            logits_CV = buf_CV[: len(y_C)]
            if w_VD.dtype == torch.float32:
                torch.mm(h_CD, w_VD.T, out=logits_CV)
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
                    torch.mm(g_CV, w_VD, out=grad_h_MD[s : s + chunk])
                if need_w:
                    grad_w_VD.addmm_(g_CV.T.float(), h_CD.float())
        ctx.save_for_backward(grad_h_MD, grad_w_VD.to(w_VD.dtype) if need_w else None)
        return total / denom

    @staticmethod
    def backward(ctx, grad_out: Tensor):
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

    Equals `F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)` with the default denominator;
    a sequence-parallel shard passes the global target count so that the ranks' losses sum to the global mean.
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

    def save_for_backward(self, *tensors):
        pass
