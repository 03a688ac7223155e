"""4-bit NormalFloat (NF4) base weights for QLoRA, through torchao's NF4Tensor (the QLoRA paper's format: blocks of
64 weights with an absmax scale each, the scales themselves quantized to 8 bits in blocks of 256; torchtune's QLoRA
uses the same tensor).

`quantize_nf4` swaps the weight of every nn.Linear inside a model's blocks (the frozen bases of LoRA layers and the
layers LoRA left alone, as bitsandbytes' load_in_4bit does; the embedding and output head stay as they are) for a
frozen NF4 tensor. The module stays an nn.Linear: NF4Tensor answers `F.linear` itself, dequantizing to its original
dtype block by block and multiplying, and its backward gives the input's gradient (the weight never gets one). So
LoRA, FSDP2 (torchao implements its all-gather), activation checkpointing and the attention backends see an
ordinary Linear. It runs on CPU as on CUDA.

torchao is an optional extra (`pip install 'zoo[qlora]'`); it is imported only here, and only when asked for.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from zoo.core.moe import Router
from zoo.errors import ZooError
from zoo.train.params import swap_parameters

BLOCK = 64  # weights per absmax scale (QLoRA)
SCALER_BLOCK = 256  # scales per second-level scale (QLoRA's double quantization)


class _TorchaoImportNoise(logging.Filter):
    """Drops two warnings of torchao's import, and only those: one per compiled extension it cannot load (CUDA
    kernels on a CPU machine, other torch or Python builds; NF4 is pure PyTorch and needs none of them), and torch
    pytree's, once per enum torchao registers (some only when a submodule is first imported), about a registration
    torch has made redundant."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ((message.startswith("Failed to load") and "torchao" in message)
                    or "register_constant() on Enum subclasses" in message)


def import_torchao() -> ModuleType:
    """torchao.quantization, imported without torchao's import-time noise (_TorchaoImportNoise), for good:
    transformers and PEFT import torchao and its submodules wherever it is installed, and print nothing of it after
    this (tests and bench scripts call it first). Raises ImportError where torchao is not installed."""
    for name in ("torchao", "torch.utils._pytree"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoImportNoise) for f in log.filters):
            log.addFilter(_TorchaoImportNoise())
    return importlib.import_module("torchao.quantization")


def _torchao() -> ModuleType:
    """torchao's quantization module, or a ZooError saying how to get it."""
    try:
        quantization = import_torchao()
    except ImportError as e:
        raise ZooError(f"QLoRA needs torchao's NF4 tensor: pip install 'zoo[qlora]' (torchao>=0.16); "
                       f"importing it failed: {e}") from None
    if not hasattr(quantization, "to_nf4"):
        raise ZooError("QLoRA needs torchao's NF4 tensor (torchao.quantization.to_nf4, torchao>=0.16); "
                       f"the installed torchao {getattr(importlib.import_module('torchao'), '__version__', '?')} "
                       "lacks it")
    return quantization


def require_nf4() -> None:
    """Raise the ZooError that says how to install torchao where its NF4 tensor cannot be imported."""
    _torchao()


def is_nf4(t: Tensor) -> bool:
    """Whether `t` (or the data of a Parameter) is an NF4 tensor."""
    return type(t).__name__ == "NF4Tensor"


def quantizable(weight: Tensor) -> bool:
    """NF4 quantizes whole blocks: the weight's size must divide into 64 x 256 values (every real model's
    linear layers do; the smallest test models' may not, and stay as they are)."""
    return weight.dim() == 2 and weight.numel() % (BLOCK * SCALER_BLOCK) == 0


def quantize_nf4(model: nn.Module, device: torch.device | str | None = None) -> tuple[int, int]:
    """Replace the weight of every nn.Linear in `model.layers` (an MoE router excepted: 4-bit error would move
    tokens between experts) by a frozen NF4 tensor of the same dtype, quantized
    on `device` (default: where the weight is), one layer at a time: a model loaded on CPU goes to the GPU at
    4 bits. Trainable layers (LoRA's A and B) are left alone. Returns (quantized, frozen linear layers in the
    blocks)."""
    to_nf4 = _torchao().to_nf4
    layers = model.layers
    if not isinstance(layers, nn.ModuleList):
        raise ZooError("QLoRA needs a zoo model (its blocks in .layers)")
    done = total = 0
    for linear in (m for block in layers for m in block.modules()
                   if isinstance(m, nn.Linear) and not isinstance(m, Router)):
        if any(p.requires_grad for p in linear.parameters()):
            continue  # what trains (LoRA's A and B) keeps its precision
        total += 1
        w = linear.weight
        if w.device.type == "meta":
            raise ZooError("QLoRA quantizes real weights: load the model on a device first, not on meta")
        if is_nf4(w) or not quantizable(w):
            done += is_nf4(w)
            continue
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ZooError(f"QLoRA quantizes bf16, fp16 or fp32 weights, got {w.dtype}")
        w = w.detach().to(device or w.device)
        linear.weight = nn.Parameter(to_nf4(w, BLOCK, SCALER_BLOCK), requires_grad=False)
        done += 1
    return done, total


def to_device(model: nn.Module, device: torch.device | str) -> None:
    """Move every parameter and buffer to `device`, NF4 weights excepted (quantize_nf4 put them there already;
    module.to would route them through the subclass's copy for nothing)."""
    device = torch.device(device)

    def moved(p: nn.Parameter) -> nn.Parameter | None:
        if is_nf4(p) or p.device == device:
            return None
        return nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)

    swap_parameters(model, moved)
    for module in model.modules():
        for name, b in list(module.named_buffers(recurse=False)):
            if b.device != device:
                module.register_buffer(name, b.to(device), persistent=name not in module._non_persistent_buffers_set)


def dequantized(t: Tensor) -> Tensor:
    """A plain tensor of `t`'s values (an NF4 tensor dequantized to its original dtype; anything else as it is)."""
    if is_nf4(t):
        nf4: Any = t
        return nf4.get_original_weight()
    return t
