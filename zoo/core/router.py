"""DeepSeek-V3's router (also GLM-4.5's, Kimi K2's): sigmoid scores, a bias for the choice alone, experts chosen
within the best groups; and GPT-OSS's (`route_topk`): the top k logits, a softmax over those k alone.

Shapes: T tokens, E experts, G groups of E/G experts each, K experts per token.

Each expert's score is the sigmoid of its logit in fp32, on its own (no softmax across experts). The choice adds the
per-expert correction bias to the scores (aux-loss-free balancing: DeepSeek-V3's `e_score_correction_bias`, zoo's
`router_bias` buffer); a group is worth the sum of its two best corrected scores; each token keeps its `topk_group`
best groups and picks its K best experts among theirs. The weights are the chosen experts' uncorrected scores,
renormalised to sum to 1 where `norm_topk` (DeepSeek divides by the sum plus 1e-20), times `routed_scaling`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zoo.errors import ZooError


def check_groups(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """A ZooError unless the E experts split into n_group groups of at least 2 (a group's worth is its two best
    scores) and the topk_group kept groups hold at least top_k experts."""
    if n_group < 1 or n_experts % n_group or n_experts // n_group < 2:
        raise ZooError(f"n_group must divide the {n_experts} experts into groups of at least 2, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ZooError(f"topk_group must be in 1..n_group ({n_group}), got {topk_group}")
    if top_k > topk_group * (n_experts // n_group):
        raise ZooError(f"num_experts_per_tok ({top_k}) must be at most the experts of the topk_group kept groups "
                       f"({topk_group} x {n_experts // n_group})")


def choose(scores_TE: Tensor, top_k: int, bias_E: Tensor | None = None, n_group: int = 1,
           topk_group: int = 1) -> Tensor:
    """experts_TK: each token's top_k experts by score plus bias, within its topk_group best groups."""
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    if n_group > 1:
        T, E = choice_TE.shape
        grouped_TGe = choice_TE.view(T, n_group, E // n_group)
        worth_TG = grouped_TGe.topk(2, dim=-1).values.sum(dim=-1)
        kept_TG = torch.zeros_like(worth_TG, dtype=torch.bool).scatter_(
            1, worth_TG.topk(topk_group, dim=-1).indices, True)
        choice_TE = grouped_TGe.masked_fill(~kept_TG.unsqueeze(-1), float("-inf")).view(T, E)
    return choice_TE.topk(top_k, dim=-1).indices


def sigmoid_route(logits_TE: Tensor, top_k: int, norm_topk: bool, bias_E: Tensor | None = None, n_group: int = 1,
                  topk_group: int = 1, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """(weights_TK fp32, experts_TK) of router logits, as the module docstring says."""
    scores_TE = torch.sigmoid(logits_TE.float())
    experts_TK = choose(scores_TE.detach(), top_k, bias_E, n_group, topk_group)
    weights_TK = scores_TE.gather(1, experts_TK)
    if norm_topk:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * scale, experts_TK


def balance_probs(logits_TE: Tensor) -> Tensor:
    """[T, E] what a balancing loss weighs each expert's load by for a sigmoid router: the scores normalised to sum
    to 1 per token (DeepSeek-V3's complementary sequence-wise balance loss)."""
    scores_TE = torch.sigmoid(logits_TE.float())
    return scores_TE / scores_TE.sum(dim=-1, keepdim=True)


def route_topk(logits_TE: Tensor, top_k: int, bias_E: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weights_TK fp32, experts_TK) as GPT-OSS routes: the top k of the raw logits (shifted by bias_E, aux-loss-free
    balancing, for the choice alone), then a softmax over those k in the logits' dtype, as transformers computes it."""
    if bias_E is None:
        top_TK, experts_TK = torch.topk(logits_TE, top_k, dim=-1)
    else:
        experts_TK = torch.topk(logits_TE.float() + bias_E, top_k, dim=-1).indices
        top_TK = logits_TE.gather(1, experts_TK)
    return torch.softmax(top_TK, dim=-1).float(), experts_TK
