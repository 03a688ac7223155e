"""Expert parallelism: each process of a group holds E / N of every MoE layer's experts and the tokens travel.

Shapes: T tokens of this process, K experts per token, D model dim, E experts, N processes in the group, E_l = E / N
experts held here, R (token, expert) rows.

`ExpertParallel(group).apply(model)` turns each MoE layer's stacked expert weights into DTensors sharded on their
expert dimension over the group (process n holds experts n*E_l .. (n+1)*E_l - 1) and installs `dispatch` in the
layer: the router runs where the tokens are; each process sorts its (token, expert) rows by expert (so by the
process holding it), one all-to-all sends the counts, one sends the rows; the rows that arrived are regrouped by
local expert (stable: by source process, then token order) and run as two grouped GEMMs; the reverse all-to-all
brings each row home, where the token's k outputs are summed in their fixed order. Each layer costs one host sync
(the all-to-all's split sizes) and four all-to-alls (two forward, two backward).

Gradients: a held expert's gradient arrives summed over every process's tokens (the all-to-all's backward); the
weights are DTensors, so checkpoints (DCP) save and load whole experts whatever the group size, and a run can resume
with another --ep. Processes in different groups hold the same experts (replicas, with `replicas` the group across
them): `reduce_expert_grads` sums their gradients. Everything else of the model is replicated or FSDP-sharded as
before; a recipe leaves the experts out of FSDP (`expert_params`).

The tokens a process holds are its own (a data-parallel rank's packs, a sequence-parallel rank's shard): expert
parallelism composes with both, as the routing of a token never depends on another token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from zoo.core.moe import Experts, count_per_expert, expert_mlp, inverse, moe_layers
from zoo.errors import ZooError
from zoo.parallel.sequence import _AllToAll

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class ExpertParallel:
    """Spread every MoE layer's experts over `mesh` (a 1-D DeviceMesh, the expert-parallel group); `replicas`: the
    group of the processes holding the same experts in the other expert-parallel groups (None: there are none)."""

    def __init__(self, mesh: DeviceMesh, replicas: ProcessGroup | None = None) -> None:
        if mesh.ndim != 1:
            raise ZooError(f"expert parallelism takes a 1-D device mesh, got {mesh.ndim} dimensions")
        self.mesh, self.group, self.replicas = mesh, mesh.get_group(), replicas
        self.size, self.rank = mesh.size(), mesh.get_local_rank()

    def apply(self, model: nn.Module) -> nn.Module:
        """Shard the experts of every MoE layer of `model` (on meta too) and install the dispatch; returns it."""
        layers = moe_layers(model)
        if not layers:
            raise ZooError("expert parallelism (--ep) spreads the experts of a Mixture-of-Experts model; this model "
                           "has no MoE layers")
        for layer in layers:
            experts = layer.experts
            E = experts.gate_up_proj.shape[0]
            if E % self.size:
                raise ZooError(f"--ep {self.size} must divide the number of experts ({E}); choose one of "
                               f"{[n for n in range(1, E + 1) if E % n == 0 and n <= 64]}")
            for name in experts.stacked():  # the weights and, where the family has them, the experts' biases
                p = getattr(experts, name)
                if not isinstance(p, DTensor):
                    setattr(experts, name, nn.Parameter(distribute_tensor(p.data, self.mesh, [Shard(0)]),
                                                        requires_grad=p.requires_grad))
            experts.dispatch = self.dispatch
        return model

    def dispatch(self, experts: Experts, x_TD: Tensor, experts_TK: Tensor) -> Tensor:
        """[T, K, D]: each of this process's tokens through its K experts, wherever they are held."""
        T, K = experts_TK.shape
        N = self.size
        # in the activations' dtype: FSDP's mixed precision casts the weights it manages, not these
        w1, w2, b1, b2 = (_local(getattr(experts, n), x_TD.dtype)
                          for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"))
        assert w1 is not None and w2 is not None
        E_l = w1.shape[0]
        flat_R = experts_TK.reshape(-1)
        order_R = torch.argsort(flat_R, stable=True)  # by expert, so by the process holding it
        counts_NE = count_per_expert(flat_R, N * E_l).view(N, E_l)
        recv_NE = torch.empty_like(counts_NE)
        dist.all_to_all_single(recv_NE, counts_NE, group=self.group)  # row n: what process n sends here, per expert
        sizes = torch.stack([counts_NE.sum(1), recv_NE.sum(1)]).tolist()  # the split sizes: one host sync
        send, recv = sizes[0], sizes[1]
        x_RD = _AllToAll.apply(x_TD[order_R // K], send, recv, self.group)
        local_R = torch.repeat_interleave(torch.arange(E_l, device=x_TD.device).repeat(N), recv_NE.reshape(-1),
                                          output_size=x_RD.shape[0])
        by_expert = torch.argsort(local_R, stable=True)  # by local expert, then by source process and token order
        y_RD = expert_mlp(x_RD[by_expert], recv_NE.sum(0), w1, w2, experts.glu, b1, b2)[inverse(by_expert)]
        y_home = _AllToAll.apply(y_RD, recv, send, self.group)
        return y_home[inverse(order_R)].view(T, K, -1)

    def reduce_expert_grads(self, model: nn.Module, scale: float = 1.0) -> None:
        """Sum each held expert's gradient over the processes holding the same experts (`replicas`), times
        `scale`, after the backward and before clipping. A recipe's losses are scaled by the world size for FSDP,
        which averages what it reduces: the experts, which FSDP leaves alone, take 1 / world here."""
        for p in expert_params(model):
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.replicas is not None:
                dist.all_reduce(g, group=self.replicas)
            if scale != 1.0:
                g.mul_(scale)


def _local(p: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """This process's shard of a stacked expert parameter (None stays None), in `dtype`."""
    if p is None:
        return None
    return (p.to_local() if isinstance(p, DTensor) else p).to(dtype)


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """torch's clip_grad_norm_ over parameters whose gradients are DTensors on different meshes (FSDP's over every
    rank, the experts' over an expert-parallel group): each mesh's norm reduced over its own mesh, then combined.
    Returns the total norm (a plain tensor, the same on every rank)."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for group in groups.values():
        norm = get_total_norm([p.grad for p in group if p.grad is not None])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    for group in groups.values():  # one mesh at a time: DTensor scales a mesh's gradients by a scalar of its own
        clip_grads_with_norm_(group, max_norm, total)
    return total


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights (and biases) of every MoE layer (what FSDP leaves to expert parallelism)."""
    return [getattr(layer.experts, n) for layer in moe_layers(model) for n in layer.experts.stacked()]
