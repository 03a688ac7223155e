"""FLOPs of a forward pass or a training step of a zoo model on a packed batch: the one count benches and recipes
use for TFLOP/s and MFU.

Only matrix products are counted, 2 FLOP per multiply-add (norms, RoPE, activations, softmax and the loss are
left out; they are a few percent at most):
- every nn.Linear of the language model (q/k/v/o, gate/up/down, an MoE router and shared expert) and the output
  head (the embedding matrix when the head is tied to it): 2 x in x out per token, over all T tokens of the pack
  (model.loss projects only the positions with a target, one fewer per document); a Mixture-of-Experts layer's
  experts count the k a token runs (its active parameters), not all E;
- attention, per layer and per document of length L: q k^T and p v over the (query, key) pairs the kernel needs,
  L(L+1)/2 of them when causal: 2 x 2 x heads x head_dim x L(L+1)/2. Head counts come from each layer's q_proj,
  so OpenELM's per-layer counts are right;
- a Gated DeltaNet layer (Qwen3.5's linear attention; its projections are nn.Linear, counted above): the
  depthwise causal convolution, 2 x channels x conv_kernel per token, and the chunked delta rule as zoo runs it
  (zoo.core.deltanet.chunked_delta_rule; flash-linear-attention's chunk kernel has the same products), per value
  head and per chunk of C tokens, a document of L tokens taking ceil(L / C) whole chunks:
  4 C^2 Dk (k k^T, q k^T) + C (C - 1) (Dk + Dv) (the two unit-triangular solves) + 2 C^2 Dv (the scores times the
  new values) + 6 C Dk Dv (w S, q S and the state's update k^T v'). Both sit with attention below (a backward of
  twice the forward; the convolution's weight gradient is part of it);
- LLaVA adds the vision tower (the patch convolution and the blocks that actually run, up to `feature_layer`, with
  full, non-causal attention over each image's positions) and the projector on each image's tokens.
Embedding lookups, biases and the unused part of the tower (blocks after `feature_layer`, the post-norm) are not.

A training step is a forward and a backward. The backward of a matrix product costs its forward once for the
input's gradient and once for the weight's; attention's backward is twice its forward (a kernel that recomputes
the scores in its backward does more work than counted here). With every parameter trained that is the usual
3 x forward = 6 x parameters x tokens + 3 x attention. Per part of the model, from the bottom (LLaVA: tower,
projector, language model; others: the language model alone, with the embedding below it):
- weight gradients are counted where the part has trainable parameters;
- input gradients and attention's backward where a gradient flows through the part: it trains, or a part below
  it does (LLaVA's stage 1 trains only the projector, so the frozen language model still runs its input
  gradients and attention backward, but no weight gradients; the frozen tower below runs forward only).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zoo.core.attention import attention_flops as attention_flops  # the count lives with attention; read here too
from zoo.core.contract import TextModel, ZooModel, is_zoo_model
from zoo.core.deltanet import deltanet_flops as deltanet_flops  # the count lives with the layer; read here too
from zoo.core.layers import linear_params
from zoo.core.moe import MoE
from zoo.errors import ZooError


def _trains(module: nn.Module | TextModel) -> bool:
    return any(p.requires_grad for p in module.parameters())


@dataclass
class _Part:
    """One piece of the model in forward order: its forward FLOPs split into matrix products with weights and
    attention, and whether it has trainable parameters."""

    linear: int
    attention: int
    trains: bool


def _unwrap(model: nn.Module) -> ZooModel:
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd model
    if not is_zoo_model(model):
        raise ZooError(f"FLOPs are counted for zoo models (zoo.core.contract.ZooModel), not a {type(model).__name__}")
    return model


def matmul_params(model: nn.Module) -> int:
    """The language model's weights that multiply every token: each nn.Linear in its layers and the top-k experts
    of each MoE layer, plus the output head (counted once, also when it is the tied embedding matrix). Embeddings
    and norms are not included."""
    return _decoder_params(_unwrap(model).decoder)


def _decoder_params(lm: TextModel) -> int:
    V, D = lm.head_weight.shape
    experts = 0
    for layer in lm.layers:
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, MoE):  # the shapes, not numel(): right on meta and under any sharding
            E, F2, D_ = moe.experts.gate_up_proj.shape
            experts += moe.top_k * (F2 * D_ + D_ * F2 // 2)
    return linear_params(lm.layers) + experts + V * D


def _parts(model: nn.Module, seqlens: Sequence[int], n_images: int) -> tuple[list[_Part], bool]:
    """(parts from the bottom up, whether a gradient is wanted below the first part)."""
    zoo_model = _unwrap(model)
    lm = zoo_model.decoder
    encoders = [_Part(linear, attention, _trains(m)) for linear, attention, m in zoo_model.encoder_flops(n_images)]
    # a text model given images is an error; a tower that counts none is not (Qwen2.5-VL's: an image's cost depends
    # on its size, which the count does not say)
    if n_images and not encoders and not hasattr(zoo_model, "preprocess_images"):
        raise ZooError(f"{n_images} images were given, but a {zoo_model.family} model has no vision tower")
    text = _Part(2 * _decoder_params(lm) * sum(seqlens),
                 lm.attention_flops(seqlens) + sum(m.mixing_flops(seqlens) for m in lm.mixers()), _trains(lm))
    return [*encoders, text], not encoders and lm.embed.weight.requires_grad


def forward_flops(model: nn.Module, seqlens: Sequence[int], n_images: int = 0) -> int:
    """FLOPs of one forward pass over a pack of documents with these lengths (and, for LLaVA, `n_images`
    images, whose placeholder tokens are part of `seqlens`). What is counted: see the module docstring."""
    parts, _ = _parts(model, seqlens, n_images)
    return sum(p.linear + p.attention for p in parts)


def step_flops(model: nn.Module, seqlens: Sequence[int], n_images: int = 0) -> int:
    """FLOPs of one training step (forward and backward of the loss) over a pack of documents with these
    lengths; 3 x forward_flops when every parameter trains. Frozen parts: see the module docstring."""
    parts, grad_below = _parts(model, seqlens, n_images)
    total = 0
    for p in parts:
        flows = grad_below or p.trains  # a gradient passes through this part
        total += p.linear * (1 + flows + p.trains) + p.attention * (1 + 2 * flows)
        grad_below = flows
    return total


def matmul_peak(device: torch.device | str, dtype: torch.dtype, n: int | None = None) -> float:
    """FLOP/s of an n x n x n matrix product on `device` in `dtype` (median of 10 after warm-up): the denominator
    of MFU, measured on the machine rather than read from a datasheet. n defaults to 8192 on GPU, 512 on CPU."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    times = []
    for i in range(13):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)
