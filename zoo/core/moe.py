"""Mixture-of-Experts: the router, the experts as grouped GEMMs, and the balancing losses.

Shapes: T tokens, D model dim, E experts, K experts per token (top-k), F an expert's width, n documents.

A token's router logits (a linear map, in the activations' dtype, with a bias where the family has one) go through a
softmax over all E experts in fp32; its K most probable experts run, renormalised to sum to 1 where the family says
(or, scoring "softmax_topk" as GPT-OSS, the K largest logits are chosen and a softmax over those K alone weighs
them), and their outputs are summed by those weights, in a fixed order (expert choice 0..K-1, never an atomic
scatter: bit-stable run to run). The experts' weights are stacked, one tensor per projection ([E, 2F, D] gate and up,
[E, D, F] down; biases [E, 2F] and [E, D] where the family has them), and run as two grouped GEMMs
over the T*K (token, expert) rows sorted by expert: `torch.nn.functional.grouped_mm` where this torch, device and
dtype run it (a probe decides once, as for the attention kernels), else the same rows padded to the most loaded
expert's count and run as batched GEMMs (one host sync per layer: that count; run eagerly inside a compiled model),
or, for the few rows of a compiled decoding step, each row times its expert's gathered weights (static shapes: a
fullgraph compile holds). None loops over experts in Python.

`scoring` "sigmoid" (MoESpec) routes as DeepSeek-V3 does instead (zoo.core.router), its shared expert ungated.

Losses (`load_balancing_loss`, `router_z_loss`) read the router logits a forward recorded (`recording`): the
Switch-Transformer balance of transformers' `load_balancing_loss_func` over every token of the pack, or the same
statistic within each document, averaged over documents (a packed batch is many sequences, not one). A part of a
pack (a sequence-parallel shard) sums its statistics with the other parts' (`Packed.sum_over_parts`), so that the
parts' losses add up to the whole pack's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.contract import MoESpec
from zoo.core.expert_kernels import describe as describe
from zoo.core.expert_kernels import grouped_mm_runs as grouped_mm_runs
from zoo.core.expert_kernels import pick_kernel
from zoo.core.internals import run_eagerly
from zoo.core.layers import ACTIVATIONS, GatedMLP, Glu, clamped_swiglu, gated
from zoo.core.packing import Packed
from zoo.core.router import balance_probs, check_groups, route_topk, sigmoid_route
from zoo.errors import ZooError


def route(logits_TE: Tensor, top_k: int, norm_topk: bool, bias_E: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weights_TK fp32, experts_TK) of router logits: softmax in fp32 over all experts, the top k, renormalised
    if norm_topk. bias_E (aux-loss-free balancing) shifts which experts are chosen, not their weights."""
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    if bias_E is None:
        weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    else:
        experts_TK = torch.topk(probs_TE + bias_E, top_k, dim=-1).indices
        weights_TK = probs_TE.gather(1, experts_TK)
    if norm_topk:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK, experts_TK


class Router(nn.Linear):
    """The router: a linear map to one logit per expert. Neither a LoRA target nor quantized by QLoRA (a low-rank or
    4-bit error would move tokens between experts; transformers' router is no nn.Linear, so PEFT never adapts it).
    in_fp32: the product in fp32 (DeepSeek-V3's router casts its input and weight)."""

    in_fp32 = False

    def forward(self, x: Tensor) -> Tensor:
        if self.in_fp32:
            return F.linear(x.float(), self.weight.float())
        return super().forward(x)


def expert_mlp(x_RD: Tensor, counts_E: Tensor, gate_up_EFD: Tensor, down_EDF: Tensor, glu: Glu,
               gate_up_bias_EF: Tensor | None = None, down_bias_ED: Tensor | None = None) -> Tensor:
    """[R, D]: rows sorted by expert (counts_E of each) through their expert's gated MLP (`glu` of its gate and up
    halves; each projection plus its expert's bias where given), as two grouped GEMMs."""
    kernel = pick_kernel(x_RD, down_EDF.shape[-1], gate_up_EFD.shape[-1])
    if kernel == "padded_bmm":
        return _padded_expert_mlp(x_RD, counts_E, gate_up_EFD, down_EDF, glu, gate_up_bias_EF, down_bias_ED)
    return _expert_mlp(x_RD, counts_E, gate_up_EFD, down_EDF, glu, gate_up_bias_EF, down_bias_ED, kernel)


def _expert_mlp(x_RD: Tensor, counts_E: Tensor, gate_up_EFD: Tensor, down_EDF: Tensor, glu: Glu,
                gate_up_bias_EF: Tensor | None, down_bias_ED: Tensor | None, kernel: str) -> Tensor:
    """`expert_mlp` on `kernel`; the rows' layout (offsets, or each row's expert and slot) derived once for both
    projections."""
    R, E = x_RD.shape[0], gate_up_EFD.shape[0]
    mm: Callable[[Tensor, Tensor], Tensor]  # (rows [R, I], weights [E, O, I]) -> [R, O], each row by its expert's
    expert_R = None
    if kernel != "grouped_mm" or gate_up_bias_EF is not None or down_bias_ED is not None:
        expert_R = torch.repeat_interleave(torch.arange(E, device=x_RD.device), counts_E, output_size=R)
    if kernel == "grouped_mm":
        offs_E = counts_E.cumsum(0).to(torch.int32)

        def mm(x: Tensor, w: Tensor) -> Tensor:
            return F.grouped_mm(x, w.transpose(-2, -1), offs=offs_E)
    else:
        assert expert_R is not None
        if kernel == "gathered":  # each row times its own expert's weights, gathered: static shapes, no host sync

            def mm(x: Tensor, w: Tensor) -> Tensor:
                return torch.bmm(w[expert_R], x.unsqueeze(-1)).squeeze(-1)
        else:  # padded to the busiest expert's rows: one host sync for that count
            C = int(counts_E.max()) if R else 0
            slot_R = torch.arange(R, device=x_RD.device) - (counts_E.cumsum(0) - counts_E)[expert_R]

            def mm(x: Tensor, w: Tensor) -> Tensor:
                padded_ECI = x.new_zeros(E, C, x.shape[1]).index_put((expert_R, slot_R), x)
                return torch.bmm(padded_ECI, w.transpose(-2, -1))[expert_R, slot_R]
    gate_up_RF = mm(x_RD, gate_up_EFD)
    if gate_up_bias_EF is not None and expert_R is not None:  # the product, then its expert's bias (transformers)
        gate_up_RF = gate_up_RF + gate_up_bias_EF[expert_R]
    gate_RF, up_RF = gate_up_RF.chunk(2, dim=-1)
    y_RD = mm(glu(gate_RF, up_RF), down_EDF)
    if down_bias_ED is not None and expert_R is not None:
        y_RD = y_RD + down_bias_ED[expert_R]
    return y_RD


def inverse(order_R: Tensor) -> Tensor:
    """The permutation undoing `order_R` (a scatter, not a second sort)."""
    return torch.empty_like(order_R).scatter_(0, order_R, torch.arange(order_R.numel(), device=order_R.device))


# the padded path's shapes depend on the routing (the busiest expert's count): run eagerly inside a compiled model
_padded = functools.partial(_expert_mlp, kernel="padded_bmm")
_padded_expert_mlp = cast(Callable[[Tensor, Tensor, Tensor, Tensor, Glu, Tensor | None, Tensor | None], Tensor],
                          run_eagerly(_padded))


def count_per_expert(flat_R: Tensor, n_experts: int) -> Tensor:
    """[E] how many rows go to each expert (no host sync: bincount's output size would need one)."""
    return torch.zeros(n_experts, dtype=torch.long, device=flat_R.device).scatter_add_(
        0, flat_R, torch.ones_like(flat_R))


# (experts, x_TD, experts_TK) -> [T, K, D]: how the experts run when they are spread over processes (installed by
# zoo.parallel.expert.ExpertParallel; a model never imports torch.distributed)
Dispatch = Callable[["Experts", Tensor, Tensor], Tensor]


class Experts(nn.Module):
    """E gated MLPs stacked: gate_up_proj [E, 2F, D] (gate rows first, then up), down_proj [E, D, F], and with `bias`
    gate_up_proj_bias [E, 2F] and down_proj_bias [E, D] (else None). `glu` joins the gate and up halves: act(gate) *
    up, or with `swiglu_limit` GPT-OSS's clamped SwiGLU. `dispatch`, when installed, runs them spread over processes
    (expert parallelism)."""

    dispatch: Dispatch | None = None
    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None

    def __init__(self, n_experts: int, dim: int, ffn_dim: int, activation: str = "silu", bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ZooError(f"unknown MLP activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.glu = gated(self.act) if swiglu_limit is None else clamped_swiglu(swiglu_limit, swiglu_alpha)
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        for name, width in (("gate_up_proj_bias", 2 * ffn_dim), ("down_proj_bias", dim)):
            self.register_parameter(name, nn.Parameter(torch.empty(n_experts, width)) if bias else None)

    def stacked(self) -> list[str]:
        """The names of the stacked per-expert parameters (what expert parallelism shards on dim 0)."""
        return [n for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
                if getattr(self, n) is not None]

    def forward(self, x_TD: Tensor, experts_TK: Tensor) -> Tensor:
        """[T, K, D]: each token through each of its K experts."""
        if self.dispatch is not None:
            return self.dispatch(self, x_TD, experts_TK)
        T, K = experts_TK.shape
        flat_R = experts_TK.reshape(-1)
        order_R = torch.argsort(flat_R, stable=True)  # (token, choice) rows grouped by expert, in token order
        counts_E = count_per_expert(flat_R, self.gate_up_proj.shape[0])
        y_RD = expert_mlp(x_TD[order_R // K], counts_E, self.gate_up_proj, self.down_proj, self.glu,
                          self.gate_up_proj_bias, self.down_proj_bias)
        return y_RD[inverse(order_R)].view(T, K, -1)  # back to (token, choice) order


class MoE(nn.Module):
    """The sparse MLP of a MoESpec: router, experts, the optional shared expert (see the module docstring).

    Recording (`record_router`, which `recording` and the decoder's `recording_router` open): while a list is
    given, each forward appends its router logits [T, E] to it.
    router_bias: the [E] buffer biasing the expert choice (aux-loss-free balancing) where the spec has one, else
    None; `add_router_bias` gives a layer one."""

    def __init__(self, dim: int, spec: MoESpec) -> None:
        super().__init__()
        if not 0 < spec.top_k <= spec.n_experts:
            raise ZooError(f"experts per token must be in 1..{spec.n_experts} (the experts), got {spec.top_k}")
        if spec.scoring not in ("softmax", "sigmoid", "softmax_topk"):
            raise ZooError(f"router scoring must be 'softmax', 'sigmoid' or 'softmax_topk', got {spec.scoring!r}")
        self.top_k, self.norm_topk, self.weights_fp32 = spec.top_k, spec.norm_topk, spec.weights_fp32
        self.scoring, self.n_group, self.topk_group = spec.scoring, spec.n_group, spec.topk_group
        self.routed_scaling = spec.routed_scaling
        if spec.scoring == "sigmoid":
            check_groups(spec.n_experts, spec.top_k, spec.n_group, spec.topk_group)
        elif spec.n_group != 1:
            raise ZooError(f"group-limited routing (n_group {spec.n_group}) takes sigmoid scoring, got {spec.scoring}")
        self.router = Router(dim, spec.n_experts, bias=spec.router_linear_bias)
        self.router.in_fp32 = spec.scoring == "sigmoid"
        self.experts = Experts(spec.n_experts, dim, spec.ffn_dim, spec.activation, bias=spec.expert_bias,
                               swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha)
        shared = spec.shared_ffn_dim
        self.shared_expert = None if shared is None else GatedMLP(dim, shared, activation=spec.activation)
        gated = shared is not None and spec.shared_gated
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if gated else None
        self._record: list[Tensor] | None = None
        self.router_bias: Tensor | None
        self.register_buffer("router_bias", None)  # a buffer of None: in no state dict until it is set
        if spec.router_bias:
            self.add_router_bias()

    def record_router(self, into: list[Tensor] | None) -> None:
        """Append the router logits of each forward to `into` from now on (None: stop)."""
        self._record = into

    def add_router_bias(self) -> None:
        """Set the [E] `router_bias` buffer to zeros (a recipe turning on aux-loss-free balancing)."""
        self.router_bias = torch.zeros(self.n_experts, device=self.router.weight.device)

    def init_buffers(self) -> None:
        """init_weights' part: the router bias (where there is one, materialised from meta) zeros, in fp32."""
        if self.router_bias is not None:
            self.router_bias = torch.zeros(self.n_experts, device=self.router_bias.device)

    @property
    def n_experts(self) -> int:
        return self.router.out_features

    def routing(self, logits_TE: Tensor) -> tuple[Tensor, Tensor]:
        """(weights_TK fp32, experts_TK) of router logits, as this layer routes (its router bias included)."""
        if self.scoring == "sigmoid":
            return sigmoid_route(logits_TE, self.top_k, self.norm_topk, self.router_bias, self.n_group,
                                 self.topk_group, self.routed_scaling)
        if self.scoring == "softmax_topk":
            return route_topk(logits_TE, self.top_k, self.router_bias)
        weights_TK, experts_TK = route(logits_TE, self.top_k, self.norm_topk, self.router_bias)
        return (weights_TK * self.routed_scaling if self.routed_scaling != 1.0 else weights_TK), experts_TK

    def balance_terms(self, logits_TE: Tensor) -> tuple[Tensor, Tensor]:
        """(probs_TE, chosen_TK) a balancing loss weighs: softmax in the logits' dtype and its unbiased top-k, as
        transformers; sigmoid, DeepSeek-V3's: the normalised scores and the layer's own choice (biased, grouped)."""
        if self.scoring == "sigmoid":
            return balance_probs(logits_TE), self.routing(logits_TE.detach())[1]
        probs_TE = torch.softmax(logits_TE, dim=-1)
        return probs_TE, torch.topk(probs_TE, self.top_k, dim=-1).indices

    def forward(self, x_TD: Tensor) -> Tensor:
        logits_TE = self.router(x_TD)
        if self._record is not None:
            self._record.append(logits_TE)
        weights_TK, experts_TK = self.routing(logits_TE)
        y_TKD = self.experts(x_TD, experts_TK)
        w_TK1 = weights_TK.unsqueeze(-1)
        if self.weights_fp32:  # Mixtral: the product in fp32, cast before the sum
            out_TD = (y_TKD * w_TK1).to(x_TD.dtype).sum(dim=1)
        else:
            out_TD = (y_TKD * w_TK1.to(x_TD.dtype)).sum(dim=1)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        return out_TD


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@contextmanager
def recording(model: nn.Module, enabled: bool = True) -> Iterator[list[list[Tensor]]]:
    """Within: every MoE layer of `model` keeps the router logits of each forward; yields one list per layer (in
    layer order; none when not `enabled`). Outside (a backward's recomputation under activation checkpointing
    included) nothing is kept."""
    layers = moe_layers(model) if enabled else []
    records: list[list[Tensor]] = [[] for _ in layers]
    for layer, record in zip(layers, records):
        layer.record_router(record)
    try:
        yield records
    finally:
        for layer in layers:
            layer.record_router(None)


def _doc_of_tokens(packed: Packed) -> tuple[Tensor, int]:
    """([T] each token's document index in the whole pack, number of documents of the whole pack)."""
    part = packed.part_of()
    whole, index_T = part if part is not None else (packed, None)
    lens = (whole.cu_seqlens[1:] - whole.cu_seqlens[:-1]).long()
    doc_T = torch.repeat_interleave(torch.arange(whole.num_docs, device=lens.device), lens)
    return (doc_T if index_T is None else doc_T[index_T]), whole.num_docs


def load_balancing_loss(logits: list[Tensor], top_k: int, packed: Packed, per_document: bool = False,
                        layers: list[MoE] | None = None) -> Tensor:
    """transformers' `load_balancing_loss_func` over every token of the pack: E * sum_e f_e * P_e, f_e the share of
    top-k choices that went to expert e and P_e its mean router probability, both over all (layer, token) rows.
    per_document: f and P per document (from cu_seqlens), the loss averaged over the documents.
    `logits`: each MoE layer's router logits [T, E] of this pack (or of this part of it); `layers`, where given,
    the layers they came from, whose `balance_terms` say what P and the choice are (a sigmoid router's)."""
    if not logits:
        raise ZooError("a load-balancing loss needs MoE layers; this model has none")
    E, dev = logits[0].shape[-1], logits[0].device
    doc_T, n = _doc_of_tokens(packed) if per_document else (torch.zeros(logits[0].shape[0], dtype=torch.long,
                                                                       device=dev), 1)
    counts_nE = torch.zeros(n, E, device=dev)
    probs_nE = torch.zeros(n, E, device=dev)
    for i, logits_TE in enumerate(logits):
        if layers is not None:
            probs_TE, chosen_TK = layers[i].balance_terms(logits_TE)
        else:
            probs_TE = torch.softmax(logits_TE, dim=-1)  # in the logits' dtype, as transformers
            chosen_TK = torch.topk(probs_TE, top_k, dim=-1).indices
        hits_TE = torch.zeros_like(probs_TE, dtype=torch.float32).scatter_add_(
            1, chosen_TK, torch.ones_like(chosen_TK, dtype=torch.float32))
        counts_nE = counts_nE.index_add(0, doc_T, hits_TE)
        probs_nE = probs_nE.index_add(0, doc_T, probs_TE.float())
    rows_n = torch.zeros(n, device=dev).index_add(0, doc_T, torch.ones_like(doc_T, dtype=torch.float32))
    # the whole pack's counts (no gradient); this part's probabilities over the whole pack's rows: the parts'
    # losses add up to the whole's
    counts_nE, rows_n = packed.sum_over_parts(counts_nE.detach()), packed.sum_over_parts(rows_n)
    rows_n = rows_n.clamp(min=1) * len(logits)
    return E * ((counts_nE / rows_n[:, None]) * (probs_nE / rows_n[:, None])).sum() / n


def router_z_loss(logits: list[Tensor], packed: Packed) -> Tensor:
    """ST-MoE's router z-loss: the mean over (layer, token) of logsumexp(router logits)^2 (fp32)."""
    if not logits:
        raise ZooError("a router z-loss needs MoE layers; this model has none")
    total = sum((torch.logsumexp(x.float(), dim=-1) ** 2).sum() for x in logits)
    rows = packed.sum_over_parts(torch.tensor(float(logits[0].shape[0]), device=logits[0].device))
    return total / (rows * len(logits))


def expert_counts(logits: list[Tensor], layers: list[MoE]) -> Tensor:
    """[layers, E] how many top-k choices of this pack (or part of it) went to each expert, per MoE layer, chosen as
    the layer routes (its router bias included): what a recipe sums over a step to log and balance the load."""
    rows = []
    for layer, logits_TE in zip(layers, logits):
        chosen_R = layer.routing(logits_TE.detach())[1].reshape(-1)
        rows.append(torch.zeros(logits_TE.shape[-1], device=chosen_R.device).scatter_add_(
            0, chosen_R, torch.ones_like(chosen_R, dtype=torch.float32)))
    return torch.stack(rows)


def balancing_terms(moes: list[MoE], logits: list[Tensor], packed: Packed, share: float, aux_loss_coef: float,
                    aux_loss: str, z_loss_coef: float, parts: dict[str, Tensor] | None = None) -> Tensor:
    """What a Mixture-of-Experts model adds to its loss from one forward's router `logits` (one [T, E] per layer of
    `moes`): aux_loss_coef x the load-balancing loss (aux_loss "batch": over the pack's tokens; "per-document": within
    each document, averaged) + z_loss_coef x the router z-loss, each times `share` (this pack's weight in its step).
    `parts`, where given, receives the terms without their coefficients, detached, and the [layers, E] top-k
    choices ("aux_loss", "z_loss", "expert_counts")."""
    total = torch.zeros((), device=logits[0].device)
    top_k = moes[0].top_k
    if aux_loss_coef or parts is not None:
        aux = share * load_balancing_loss(logits, top_k, packed, aux_loss == "per-document", moes)
        total = total + aux_loss_coef * aux if aux_loss_coef else total
        if parts is not None:
            parts["aux_loss"] = aux.detach()
    if z_loss_coef or parts is not None:
        z = share * router_z_loss(logits, packed)
        total = total + z_loss_coef * z if z_loss_coef else total
        if parts is not None:
            parts["z_loss"] = z.detach()
    if parts is not None:
        parts["expert_counts"] = expert_counts(logits, moes)
    return total
