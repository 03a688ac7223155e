"""The preference losses of recipes.dpo, per pair (TRL's DPOTrainer, CPOTrainer and ORPOTrainer formulas), their
options, and the per-document log-prob sums of a pack they are computed from (summed over a sequence-parallel
group where a pack is cut across it)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from recipes.data.preference import TargetPlan
from recipes.engine.config import Section, non_negative, opt, positive
from recipes.engine.processes import Dist
from zoo.core.logprobs import document_ids, row_logprobs, token_logprobs
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models import Model

LOSSES = ("sigmoid", "robust", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("sigmoid", "robust", "ipo")
REF_TABLE = "ref_logps.safetensors"
SCORE_METHOD = "preference_score"  # the FSDP forward method `scorer` adds


@dataclass
class PreferenceSection(Section):
    """The preference loss and its reference."""

    loss: str = opt("sigmoid", "sigmoid: DPO; robust: robust DPO (--label-smoothing the flip rate); ipo: IPO "
                               "(length-normalised, as TRL); simpo: SimPO (TRL's CPO loss_type simpo, cpo_alpha 0); "
                               "orpo: ORPO (odds ratio plus the chosen NLL)", LOSSES)
    beta: float = opt(0.1, "beta: the KL strength of DPO/IPO (IPO's tau), SimPO's reward scale, ORPO's lambda",
                      check=positive)
    label_smoothing: float = opt(0.0, "sigmoid: the conservative DPO's label noise (cDPO, TRL before 1.0); robust: "
                                      "the flip rate; simpo: as TRL's CPO; in [0, 0.5)", check=non_negative)
    simpo_gamma: float = opt(0.5, "SimPO's target reward margin (TRL's simpo_gamma)", check=non_negative)
    ref_model: str | None = opt(None, "reference checkpoint directory (frozen; default: the policy's adapters "
                                      "switched off with LoRA, else a frozen copy of --model)")
    precompute_ref: bool = opt(False, "compute the reference log-probs once before training (kept in "
                                      f"OUT/{REF_TABLE}, read back by --resume) and free the reference")
    share_prompt: bool = opt(True, "lay a pair out as prompt + chosen + rejected, the prompt computed once (the "
                                   "same numbers as two documents); off by itself under --sp, --compile and RoPE "
                                   "scaled by the document's length")


# ---- the losses (TRL's, per pair) ----


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass
class PairScores:
    """Per pair of a pack: the policy's (and reference's) completion log-prob sums, the completion lengths, and
    what the metrics read."""

    chosen: Tensor  # sum of log p over the chosen completion (differentiable)
    rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    chosen_len: Tensor  # completion tokens (TRL's completion_mask sums: IPO's normaliser)
    rejected_len: Tensor
    chosen_count: Tensor  # completion tokens predicted (SimPO's and ORPO's averages)
    rejected_count: Tensor
    chosen_logits: Tensor  # sum over the completion of each token's vocabulary-mean logit
    rejected_logits: Tensor
    chosen_nll: Tensor  # ORPO: minus the sum of log p over every token of prompt + chosen (differentiable)
    chosen_nll_count: Tensor


def pair_losses(cfg: PreferenceSection, s: PairScores) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss per pair, metric per pair): TRL's DPOTrainer (sigmoid, robust, ipo), CPOTrainer (simpo) and
    ORPOTrainer (orpo) formulas."""
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.loss in NEEDS_REFERENCE:
        assert s.ref_chosen is not None and s.ref_rejected is not None
        chosen_ratio, rejected_ratio = s.chosen - s.ref_chosen, s.rejected - s.ref_rejected
        delta = chosen_ratio - rejected_ratio
        if cfg.loss == "sigmoid":
            loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        elif cfg.loss == "robust":
            loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        else:  # IPO, each log-ratio averaged over its completion's tokens (TRL's normalisation)
            ipo = chosen_ratio / s.chosen_len.clamp(min=1) - rejected_ratio / s.rejected_len.clamp(min=1)
            loss = (ipo - 1 / (2 * beta)) ** 2
        rewards = (beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
        logps = (s.chosen.detach(), s.rejected.detach())
        return loss, metrics_of(rewards, logps)
    avg_chosen, avg_rejected = s.chosen / s.chosen_count.clamp(min=1), s.rejected / s.rejected_count.clamp(min=1)
    rewards = (beta * avg_chosen.detach(), beta * avg_rejected.detach())
    logps = (avg_chosen.detach(), avg_rejected.detach())
    if cfg.loss == "simpo":
        margin = avg_chosen - avg_rejected - cfg.simpo_gamma / beta
        loss = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
        return loss, metrics_of(rewards, logps)
    log_odds = (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))
    ratio = F.logsigmoid(log_odds)
    out = metrics_of(rewards, logps)
    out["log_odds_ratio"], out["log_odds_chosen"] = ratio.detach(), log_odds.detach()
    return -beta * ratio, out


def metrics_of(rewards: tuple[Tensor, Tensor], logps: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    return {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1],
            "rewards/accuracies": (rewards[0] > rewards[1]).to(rewards[0].dtype),
            "rewards/margins": rewards[0] - rewards[1], "logps/chosen": logps[0], "logps/rejected": logps[1]}


# ---- log-prob sums of a pack ----


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a group whose ranks all go on to compute the same loss from the sum: the gradient of
    each rank's part is the sum's gradient, passed back unchanged (each rank then backpropagates its own share)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


Scorer = Callable[[Tensor | TargetPlan, Packed], Tensor]  # `score` bound to a model

# the per-document columns a scorer returns: log p over the completion, its predicted tokens, its mean-logit sum,
# log p over every target (ORPO's NLL), their count
COMPLETION, COUNT, LOGITS, ALL, ALL_COUNT = range(5)


def score(model: Model, where: Tensor | TargetPlan, packed: Packed) -> Tensor:
    """[documents of the whole pack, 5]: per document the COMPLETION .. ALL_COUNT sums over this pack's (or
    shard's) targets. `where`: for a pack of documents, per token where its document's completion starts (a target
    is the completion's when the token it predicts sits at or after it); for a shared-prompt pack, its TargetPlan."""
    if model.decoder.final_softcap is not None:
        raise ZooError(f"preference tuning's log-probabilities do not soft-cap the logits yet; this {model.family} "
                       f"model caps them at {model.decoder.final_softcap} (final_logit_softcapping)")
    h_TD = model.hidden(packed)
    if isinstance(where, TargetPlan):
        doc_M, completion_M, n = where.doc_M, where.completion_M, 2 * packed.num_docs
        logp_M, mean_logit_M = row_logprobs(h_TD, model.head_weight, where.rows_M, where.targets_M)
    else:
        rows_M, logp_M, mean_logit_M = token_logprobs(h_TD, model.head_weight, packed.targets(model.labels))
        doc_T, n = document_ids(packed)
        doc_M = doc_T.index_select(0, rows_M)
        completion_M = packed.position_ids.index_select(0, rows_M) + 1 >= where.index_select(0, rows_M)
    ones_M, zeros_M = torch.ones_like(logp_M), torch.zeros_like(logp_M)
    cols_M5 = torch.stack([torch.where(completion_M, logp_M, zeros_M), completion_M.to(logp_M.dtype),
                           torch.where(completion_M, mean_logit_M, zeros_M), logp_M, ones_M], dim=1)
    return torch.zeros(n, 5, dtype=logp_M.dtype, device=h_TD.device).index_add(0, doc_M, cols_M5)


def scorer(model: Model) -> Scorer:
    """`score` bound to `model`. Under FSDP it runs as one of the model's forward methods (the root's embedding,
    norm and head are gathered around it, as for `loss`): the contract has no such method, so it is set on this
    model object and registered with FSDP."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    bound = partial(score, model)
    if not isinstance(model, FSDPModule):
        return bound
    if not hasattr(model, SCORE_METHOD):  # else registered already (with LoRA the policy is its own reference)
        setattr(model, SCORE_METHOD, bound)
        register_fsdp_forward_method(model, SCORE_METHOD)
    return cast(Scorer, getattr(model, SCORE_METHOD))


def over_group(x: Tensor, d: Dist) -> Tensor:
    """A shard's per-document sums, summed over its sequence-parallel group (the whole documents')."""
    if d.sequence_parallel is None or d.mesh is None:
        return x
    return _SumOverGroup.apply(x, d.mesh["sp"].get_group())
