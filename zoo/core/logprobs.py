"""Per-document sums of target-token log-probabilities, the output head applied in chunks: what preference losses
(DPO and its kin) read of a model, without ever holding [T, V] fp32 logits.

Unlike the cross-entropy head (zoo.core.loss), whose gradient is known in its forward (softmax - one_hot, times
1/denominator), a sequence's log-prob is a term inside a loss the caller builds afterwards (a sigmoid of a margin
between two documents), so the gradient per target row is known only in backward. The forward keeps each row's
log-sum-exp (one number a row); backward recomputes each chunk's logits and forms d logp / d logits = one_hot -
softmax, scaled by the row's incoming gradient. Peak memory: one chunk of logits, forward and backward.

Under sequence parallelism a shard holds pieces of documents; `document_ids` numbers its tokens by document of the
whole pack, so the sums of all shards add up (the caller all-reduces them over the group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zoo.core.loss import LOGITS_PER_CHUNK, MIN_ROWS, _wide_gemm
from zoo.core.packing import IGNORE_INDEX, Packed


def _logits(h_CD: Tensor, w_VD: Tensor, acc: torch.dtype) -> Tensor:
    """[C, V] logits in `acc` (fp32; fp64 for fp64 weights): operands in fp32 on CPU or for fp32 weights; on a GPU
    with half-precision weights the GEMM writes fp32 where it can (no fp32 copy of the head), else rounds."""
    if w_VD.dtype == acc or not h_CD.is_cuda:
        return h_CD.to(acc) @ w_VD.to(acc).T
    if _wide_gemm(h_CD.device.type):
        return torch.mm(h_CD, w_VD.T, out_dtype=torch.float32)
    return (h_CD @ w_VD.T).to(acc)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_MD: Tensor, w_VD: Tensor, target_M: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        acc = torch.float64 if w_VD.dtype == torch.float64 else torch.float32
        logp_M = torch.empty(h_MD.shape[0], dtype=acc, device=h_MD.device)
        lse_M = torch.empty_like(logp_M)
        mean_logit_M = torch.empty_like(logp_M)
        for s in range(0, h_MD.shape[0], chunk):
            logits_CV = _logits(h_MD[s : s + chunk], w_VD, acc)
            y_C = target_M[s : s + chunk]
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            logp_M[s : s + chunk] = logits_CV.gather(1, y_C[:, None])[:, 0] - lse_C
            lse_M[s : s + chunk] = lse_C
            mean_logit_M[s : s + chunk] = logits_CV.mean(dim=-1)
        ctx.save_for_backward(h_MD, w_VD, target_M, lse_M)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(mean_logit_M)
        return logp_M, mean_logit_M

    @staticmethod
    def backward(ctx: Any, grad_M: Tensor, _: Tensor | None) -> tuple[Tensor | None, Tensor | None, None, None]:
        h_MD, w_VD, target_M, lse_M = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse_M.dtype
        grad_h_MD = torch.empty_like(h_MD) if need_h else None
        grad_w_VD = torch.zeros_like(w_VD, dtype=acc) if need_w else None
        w_op = w_VD.to(acc)
        for s in range(0, h_MD.shape[0], ctx.chunk):
            h_CD, y_C, g_C = h_MD[s : s + ctx.chunk], target_M[s : s + ctx.chunk], grad_M[s : s + ctx.chunk].to(acc)
            logits_CV = _logits(h_CD, w_VD, acc)
            # d logp / d logits = one_hot - softmax, times the row's gradient; formed in place on the chunk
            g_CV = logits_CV.sub_(lse_M[s : s + ctx.chunk, None]).exp_().mul_(-g_C[:, None])
            g_CV[torch.arange(len(y_C), device=y_C.device), y_C] += g_C
            if grad_h_MD is not None:
                grad_h_MD[s : s + ctx.chunk] = g_CV @ w_op
            if grad_w_VD is not None:
                grad_w_VD.addmm_(g_CV.T, h_CD.to(acc))
        return grad_h_MD, None if grad_w_VD is None else grad_w_VD.to(w_VD.dtype), None, None


def row_logprobs(h_TD: Tensor, w_VD: Tensor, rows_M: Tensor, targets_M: Tensor) -> tuple[Tensor, Tensor]:
    """(logp_M, mean_logit_M): log p(targets_M[m]) under softmax(h[rows_M[m]] @ w^T) in fp32 (differentiable in h
    and w), and the mean over the vocabulary of those logits (not differentiable; TRL logs it as logits/*). A row
    may appear more than once, with different targets (a shared prompt's last token predicts both completions)."""
    h_MD = h_TD.index_select(0, rows_M)
    chunk = max(MIN_ROWS, LOGITS_PER_CHUNK.get(h_TD.device.type, 1 << 25) // w_VD.shape[0])
    logp_M, mean_logit_M = _TokenLogprobs.apply(h_MD, w_VD, targets_M, chunk)
    return logp_M, mean_logit_M


def token_logprobs(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rows_M, logp_M, mean_logit_M) for the M tokens with a target (labels != -100): their indices and
    `row_logprobs` of their labels."""
    if labels_T.shape[0] != h_TD.shape[0]:
        raise ValueError(f"labels have {labels_T.shape[0]} tokens, hidden states have {h_TD.shape[0]}")
    rows_M = (labels_T != IGNORE_INDEX).nonzero().squeeze(1)
    return rows_M, *row_logprobs(h_TD, w_VD, rows_M, labels_T.index_select(0, rows_M))


def document_ids(packed: Packed) -> tuple[Tensor, int]:
    """([T] the document of the whole pack each token of `packed` belongs to, the whole pack's document count): a
    sequence-parallel shard numbers its pieces by the documents they were cut from."""
    part = packed.part_of()
    whole, index_T = (packed, None) if part is None else part
    lens_N = torch.tensor(whole.seqlens(), device=packed.device)
    doc_T = torch.repeat_interleave(torch.arange(len(lens_N), device=packed.device), lens_N)
    return (doc_T if index_T is None else doc_T[index_T]), len(lens_N)


def sequence_logprobs(h_TD: Tensor, w_VD: Tensor, packed: Packed, labels_T: Tensor | None = None,
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """(logp_N, count_N, logit_sum_N) per document of the (whole) pack: the sum of its target tokens' log-probs
    (fp32, differentiable), how many targets it has here, and the sum of those targets' vocabulary-mean logits.
    `labels_T` defaults to the pack's labels. For a shard each sum covers its own tokens only: all-reduce the three
    over the sequence-parallel group for the documents' totals."""
    labels_T = packed.require_labels() if labels_T is None else labels_T
    doc_T, n = document_ids(packed)
    rows_M, logp_M, mean_logit_M = token_logprobs(h_TD, w_VD, labels_T)
    doc_M = doc_T.index_select(0, rows_M)
    logp_N = torch.zeros(n, dtype=logp_M.dtype, device=h_TD.device).index_add(0, doc_M, logp_M)
    count_N = torch.zeros(n, dtype=logp_M.dtype, device=h_TD.device).index_add_(0, doc_M, torch.ones_like(logp_M))
    logit_N = torch.zeros(n, dtype=logp_M.dtype, device=h_TD.device).index_add_(0, doc_M, mean_logit_M)
    return logp_N, count_N, logit_N
