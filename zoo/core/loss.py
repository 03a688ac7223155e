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

from zoo.core.packing import IGNORE_INDEX

# fp32 logits per chunk: 1 GB on GPU, where fewer, larger GEMMs run near the matmul peak (2^25 elements, ~260 rows
# at a 128K vocabulary, ran the head 4x slower on an H100); 16 MB on CPU, where a chunk that stays in cache and in
# the allocator's free lists (no fresh pages to fault in) runs the head ~2x faster. At least MIN_ROWS rows, so a
# large vocabulary is not re-read for a handful of tokens.
LOGITS_PER_CHUNK = {"cuda": 1 << 28, "cpu": 1 << 22}
MIN_ROWS = 256
# How each chunk's softmax gradient is computed. On CUDA, where Triton imports: one Triton kernel of two passes over
# each row of logits (zoo.core.loss_kernel), where the eager ops below make ~10. Measured on an H100 at T = 32,768,
# V = 128,256, D = 4,096 (bench/bench_gpu.py --only loss): head forward+backward 178 ms with it, 221 ms eager, 181 ms
# with the eager ops torch.compile'd (COMPILED_SOFTMAX, which also runs on CPU; backend inductor, tests may pick
# another); the same loss and gradients. TRITON_SOFTMAX None: on CUDA when Triton imports; False: never.
COMPILED_SOFTMAX = False
COMPILE_BACKEND = "inductor"
TRITON_SOFTMAX: bool | None = None


@functools.cache
def _wide_gemm(device_type: str) -> bool:
    """Does this device's mm/addmm take half-precision operands into an fp32 result (`out_dtype`)? Then logits are
    formed and the weight gradient accumulated in fp32 straight from bf16 operands: no fp32 copy of an operand,
    no rounding of a chunk's product to bf16. Asked once, numerically, with a tiny scaled in-place accumulation."""
    try:
        a = torch.randn(8, 16, device=device_type).to(torch.bfloat16)
        b = torch.randn(16, 8, device=device_type).to(torch.bfloat16)
        acc = torch.ones(8, 8, device=device_type)
        torch.addmm(acc, a, b, alpha=0.5, out_dtype=torch.float32, out=acc)  # the weight gradient's scaled sum
        logits = torch.mm(a, b, out_dtype=torch.float32)
        want = a.float() @ b.float()
        return bool(torch.allclose(acc, 0.5 * want + 1, atol=1e-3) and torch.allclose(logits, want, atol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _softmax_grad(logits_CV: Tensor, y_C: Tensor, scale: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(sum of the rows' cross-entropy, (softmax - one_hot) * scale in `out_dtype`) from a chunk of fp32 logits."""
    max_C1 = logits_CV.amax(dim=-1, keepdim=True)
    lse_C1 = max_C1 + (logits_CV - max_C1).exp().sum(dim=-1, keepdim=True).log()
    loss = (lse_C1[:, 0] - logits_CV.gather(1, y_C[:, None])[:, 0]).sum()
    g_CV = (logits_CV - lse_C1).exp() * scale
    hit_CV = torch.arange(logits_CV.shape[1], device=y_C.device) == y_C[:, None]
    return loss, torch.where(hit_CV, g_CV - scale, g_CV).to(out_dtype)


@functools.cache
def _compiled_softmax_grad(backend: str) -> Any:
    return torch.compile(_softmax_grad, backend=backend, dynamic=True, fullgraph=True)


@functools.cache
def _triton_softmax_grad() -> Any:
    """zoo.core.loss_kernel.softmax_grad, or None where Triton does not import (a CPU build of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from zoo.core.loss_kernel import softmax_grad

    return softmax_grad


def _fused_softmax_grad(cuda: bool) -> Any:
    """The function that gives a chunk's loss and softmax gradient in one go: zoo's Triton kernel on CUDA (unless
    TRITON_SOFTMAX is False, or Triton does not import), else the compiled eager ops where COMPILED_SOFTMAX, else
    None (the eager in-place ops)."""
    kernel = _triton_softmax_grad() if cuda and TRITON_SOFTMAX is not False else None
    if kernel is not None:
        return kernel
    return _compiled_softmax_grad(COMPILE_BACKEND) if COMPILED_SOFTMAX else None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_MD: Tensor, w_VD: Tensor, target_M: Tensor, denom: float, chunk: int,
                softcap: float | None = None) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_MD = torch.empty_like(h_MD) if need_h else None
        acc = torch.float64 if w_VD.dtype == torch.float64 else torch.float32  # logits, sums: fp32 (fp64 for fp64)
        grad_w_VD = torch.zeros_like(w_VD, dtype=acc) if need_w else None
        total = torch.zeros((), dtype=acc, device=h_MD.device)
        # How the GEMMs run. GPU: operands in the activations' dtype (an fp32 GEMM there costs ~4x), products
        # written in fp32 where the GEMM can ("wide"), else rounded to that dtype ("narrow", what F.linear does).
        # CPU: operands in fp32 (w converted once), as fast as bf16 there and without rounding.
        full = w_VD.dtype == acc or not h_MD.is_cuda
        # A half-precision g is softmax - one_hot unscaled, and 1/denom is applied to the GEMMs' fp32 results: scaled
        # first, fp16 would flush most of softmax/denom (~1e-9 at a 128K vocabulary and 4K targets) to zero.
        pre, post = (1.0 / denom, 1.0) if full else (1.0, 1.0 / denom)
        wide = not full and _wide_gemm(h_MD.device.type)
        fused = _fused_softmax_grad(h_MD.is_cuda) if softcap is None else None
        w_op = w_VD.to(acc) if full else w_VD
        # one logits buffer for all chunks: a fresh [C, V] allocation per chunk costs page faults on CPU
        buf_CV = torch.empty(min(chunk, h_MD.shape[0]), w_VD.shape[0], dtype=acc, device=h_MD.device)
        for s in range(0, h_MD.shape[0], chunk):
            h_CD, y_C = h_MD[s : s + chunk], target_M[s : s + chunk]
            logits_CV = buf_CV[: len(y_C)]
            if full:
                torch.mm(h_CD.to(acc), w_op.T, out=logits_CV)
            elif wide:
                torch.mm(h_CD, w_VD.T, out_dtype=torch.float32, out=logits_CV)
            else:
                logits_CV.copy_(h_CD @ w_VD.T)
            tanh_CV = None
            if softcap is not None:  # Gemma 2: cap * tanh(logits / cap); the gradient through it is 1 - tanh^2
                tanh_CV = torch.tanh(logits_CV / softcap)
                torch.mul(tanh_CV, softcap, out=logits_CV)
            if fused is not None and (need_h or need_w):
                partial, g_CV = fused(logits_CV, y_C, pre, acc if full else h_MD.dtype)
                total += partial
                _accumulate(g_CV, h_CD, w_VD, w_op, s, chunk, grad_h_MD, grad_w_VD, full, wide, post)
                continue
            target_C = logits_CV.gather(1, y_C[:, None])[:, 0]
            # log-sum-exp and softmax in place on the one chunk buffer: no second [C, V] temporary
            max_C = logits_CV.amax(dim=-1)
            probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
            sum_C = probs_CV.sum(dim=-1)
            total += (max_C + sum_C.log() - target_C).sum()
            if need_h or need_w:
                g_CV = probs_CV.div_(sum_C[:, None] / pre)  # softmax * pre
                g_CV[torch.arange(len(y_C), device=y_C.device), y_C] -= pre
                if tanh_CV is not None:
                    g_CV.mul_(tanh_CV.mul_(tanh_CV).neg_().add_(1))
                if not full:
                    g_CV = g_CV.to(h_MD.dtype)
                _accumulate(g_CV, h_CD, w_VD, w_op, s, chunk, grad_h_MD, grad_w_VD, full, wide, post)
        ctx.save_for_backward(grad_h_MD, None if grad_w_VD is None else grad_w_VD.to(w_VD.dtype))
        return total / denom

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None,
            None,
            None,
            None,
            None,
        )


def _accumulate(g_CV: Tensor, h_CD: Tensor, w_VD: Tensor, w_op: Tensor, s: int, chunk: int, grad_h_MD: Tensor | None,
                grad_w_VD: Tensor | None, full: bool, wide: bool, post: float) -> None:
    """A chunk's share of the gradients from its g = dloss/dlogits / post: rows s.. of grad_h, and added to grad_w
    (post: the scale applied to the products, 1 where g carries it)."""
    if grad_h_MD is not None:
        if full:
            grad_h_MD[s : s + chunk] = g_CV @ w_op  # (cast to grad_h's dtype where they differ)
        elif wide:  # scaled in fp32, rounded once
            grad_h_MD[s : s + chunk] = torch.mm(g_CV, w_VD, out_dtype=torch.float32).mul_(post)
        else:
            torch.mm(g_CV, w_VD, out=grad_h_MD[s : s + chunk]).mul_(post)
    if grad_w_VD is not None:
        if full:
            grad_w_VD.addmm_(g_CV.T, h_CD.to(grad_w_VD.dtype))
        elif wide:
            torch.addmm(grad_w_VD, g_CV.T, h_CD, alpha=post, out_dtype=torch.float32, out=grad_w_VD)
        else:
            grad_w_VD.add_(g_CV.T @ h_CD, alpha=post)


def linear_cross_entropy(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, denominator: int | None = None, *,
                         softcap: float | None = None) -> Tensor:
    """sum over targets of CE(h @ w^T, label) / denominator (default: the number of targets); with a `softcap` the
    logits are cap * tanh(logits / cap) first (Gemma 2's final_logit_softcapping), chunk by chunk.

    Equals `F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)` with the default denominator
    (in bf16/fp16 the logits are formed in fp32 from the inputs as given - on CPU, and on GPUs whose GEMM writes
    fp32 - closer to an fp32 reference than that expression); a sequence-parallel shard passes the global target
    count so that the ranks' losses sum to the global mean.
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
        return _LinearCrossEntropy.forward(_NoCtx(), h_MD, w_VD, target_M, denom, chunk, softcap)
    return _LinearCrossEntropy.apply(h_MD, w_VD, target_M, denom, chunk, softcap)


class _NoCtx:
    """Stands in for autograd's ctx when no gradient is wanted."""

    needs_input_grad = (False, False, False, False, False, False)

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        pass
