"""`parallelize`: sequence parallel, activation checkpointing, torch.compile and FSDP2 over a zoo model.

Order (as torchtitan): sequence parallel -> activation checkpointing -> compile -> FSDP (`fully_shard` per
block, per `fsdp_units()` submodule, then the root). The model's `loss` is registered as an FSDP forward method,
so the root's parameters (embeddings, final norm, head) are gathered for it just as for `forward`. Only the
model contract (zoo.core.contract) is used: `layers`, `fsdp_units()`, `loss`, and `set_attention` through `sp.apply`.

Gradients are averaged over `mesh` (FSDP's reduce-scatter divides by its size); a caller whose per-rank losses
are shares of one global mean, as with sequence parallelism, multiplies the loss by the mesh size before
backward so that the average becomes the sum (see recipes/engine/loop.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zoo.core.contract import ZooModel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from zoo.parallel.expert import ExpertParallel
    from zoo.parallel.sequence import SequenceParallel

M = TypeVar("M", bound=ZooModel)  # any zoo model; what comes in goes out, with its own type


def apply_activation_checkpointing(model: ZooModel) -> None:
    """Recompute each block's forward during backward: only block inputs are kept between forward and backward.

    The block's own forward is wrapped on the instance, so parameter names (and checkpoints) stay the same.
    """
    for block in model.layers:
        inner = block.forward
        block.forward = functools.partial(checkpoint, inner, use_reentrant=False)


def apply_compile(model: ZooModel) -> None:
    """torch.compile each block (all blocks share one graph, so one compilation serves the whole stack)."""
    for block in model.layers:
        block.compile()


def apply_fsdp(model: M, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True,
               ignored: set[nn.Parameter] | None = None) -> M:
    """fully_shard every block, then the root; `param_dtype` (bf16 on GPU) turns on mixed precision. `ignored`:
    parameters left as they are (experts spread by expert parallelism)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # FSDP's input cast rebuilds every dataclass argument field by field (dataclasses.replace), at every unit: a
    # Packed or a Shard takes it (no field is hidden from __init__, and what is derived from a pack is keyed by its
    # tensors, which the copy keeps). It is on where inputs come from outside the model: the root (the pack and its
    # pixels) and the other units (LLaVA's tower, fed those pixels, and projector). It stays off for the blocks,
    # whose floating arguments are the model's own activations and rotary tables, already in the dtype the model
    # chose: OpenELM rotates q and k in fp32 (as upstream), and a cast would round its cos/sin tables to bf16.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    mp_blocks = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        # the last block is gathered again at once for backward: keeping it saves one all-gather
        fully_shard(block, mesh=mesh, mp_policy=mp_blocks,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, ignored_params=ignored)
    for unit in model.fsdp_units():  # LLaVA's tower and projector: units of their own (frozen or not)
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    root = cast(nn.Module, model)  # every zoo model is an nn.Module; the contract names only what zoo reads
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    register_fsdp_forward_method(root, "loss")
    return model


def parallelize(model: M, mesh: DeviceMesh | None = None, *, sp: SequenceParallel | None = None,
                ep: ExpertParallel | None = None, activation_checkpointing: bool = False, compile: bool = False,
                param_dtype: torch.dtype | None = None) -> M:
    """Everything zoo.parallel does to a model, in torchtitan's order: sequence parallel (`sp.apply`) -> expert
    parallel (`ep.apply`) -> activation checkpointing -> compile -> FSDP over `mesh` (`param_dtype`, e.g. bf16,
    turns on mixed precision; the experts of expert parallelism left to it). Build the model on meta first and
    load or materialize its weights afterwards, so no rank holds a full copy. Returns the model."""
    if sp is not None:
        sp.apply(model)
    ignored = None
    if ep is not None:
        from zoo.parallel.expert import expert_params

        ep.apply(cast(nn.Module, model))
        ignored = set(expert_params(cast(nn.Module, model)))
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=param_dtype, ignored=ignored)
    return model
