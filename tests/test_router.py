"""DeepSeek-V3's router as an option of zoo's MoE block (MoESpec scoring "sigmoid"), against transformers' own
DeepseekV3TopkRouter and DeepseekV3MoE on random inputs, every option active: a non-zero correction bias that
changes the choice, groups limiting it (n_group 4, topk_group 2), norm_topk with and without, routed scaling 2.5, an
ungated shared expert; the block's output and every gradient equal upstream's; the balancing terms count the choice
the layer makes; what cannot route is refused in one line."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.core.contract import MoESpec
from zoo.core.moe import MoE, expert_counts, load_balancing_loss
from zoo.core.router import choose

E, K, G, TOPK_G, D, F = 16, 4, 4, 2, 32, 16


def _hf_config(norm_topk: bool = True):
    import transformers

    return transformers.DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E,
                                         num_experts_per_tok=K, n_group=G, topk_group=TOPK_G,
                                         norm_topk_prob=norm_topk, routed_scaling_factor=2.5, n_shared_experts=2)


def _spec(norm_topk: bool = True) -> MoESpec:
    return MoESpec(E, K, F, norm_topk=norm_topk, router_bias=True, scoring="sigmoid", n_group=G,
                   topk_group=TOPK_G, routed_scaling=2.5, shared_ffn_dim=2 * F, shared_gated=False)


def _pair(norm_topk: bool, seed: int = 0):
    """(transformers' DeepseekV3MoE, zoo's MoE) with the same random weights and correction bias."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(seed)
    hf = DeepseekV3MoE(_hf_config(norm_topk)).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.rand(E) * 0.3)
    ours = MoE(D, _spec(norm_topk))
    assert ours.router_bias is not None  # the spec's router_bias
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.router_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return hf, ours


@pytest.mark.parametrize("norm_topk", [True, False])
def test_routing_equals_transformers_deepseek_v3(norm_topk):
    hf, ours = _pair(norm_topk)
    x_TD = torch.randn(64, D)
    logits_hf, weights_hf, experts_hf = hf.gate(x_TD)
    logits_TE = ours.router(x_TD)
    weights_TK, experts_TK = ours.routing(logits_TE)
    assert torch.equal(logits_TE, logits_hf)
    # transformers' top-k is unsorted: the same experts with the same weights, in any order
    by_expert = experts_TK.argsort(dim=-1)
    by_expert_hf = experts_hf.argsort(dim=-1)
    assert torch.equal(experts_TK.gather(1, by_expert), experts_hf.gather(1, by_expert_hf))
    torch.testing.assert_close(weights_TK.gather(1, by_expert), weights_hf.gather(1, by_expert_hf),
                               rtol=0, atol=1e-6)
    # the options are live: the bias and the groups each change some token's choice, the scale the weights
    scores_TE = torch.sigmoid(logits_TE)
    assert not torch.equal(choose(scores_TE, K, None, G, TOPK_G).sort().values, experts_TK.sort().values)
    assert not torch.equal(choose(scores_TE, K, ours.router_bias).sort().values, experts_TK.sort().values)
    if norm_topk:
        torch.testing.assert_close(weights_TK.sum(-1), torch.full((64,), 2.5))


def test_block_output_and_gradients_equal_transformers():
    hf, ours = _pair(True, seed=1)
    x_TD = torch.randn(48, D)
    x_hf = x_TD.clone().requires_grad_()
    x_ours = x_TD.clone().requires_grad_()
    y_hf = hf(x_hf.unsqueeze(0)).squeeze(0)
    y_ours = ours(x_ours)
    torch.testing.assert_close(y_ours, y_hf, rtol=0, atol=1e-5)
    g = torch.randn_like(y_hf)
    y_hf.backward(g)
    y_ours.backward(g)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=0, atol=1e-5)
    pairs = [(ours.router.weight, hf.gate.weight), (ours.experts.gate_up_proj, hf.experts.gate_up_proj),
             (ours.experts.down_proj, hf.experts.down_proj),
             (ours.shared_expert.down_proj.weight, hf.shared_experts.down_proj.weight)]
    for a, b in pairs:
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)


def test_balancing_terms_count_the_choice_the_layer_makes():
    _, ours = _pair(True, seed=2)
    x_TD = torch.randn(40, D)
    logits_TE = ours.router(x_TD)
    chosen_TK = ours.routing(logits_TE)[1]
    counts = expert_counts([logits_TE], [ours])
    assert torch.equal(counts[0], torch.bincount(chosen_TK.reshape(-1), minlength=E).float())
    packed = zoo.pack([torch.arange(15), torch.arange(25)])
    # DeepSeek-V3's balance: E * sum_e (count_e / T) * mean_t (s_te / sum_e' s_te')
    scores_TE = torch.sigmoid(logits_TE)
    expected = E * (counts[0] / 40 * (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0)).sum()
    loss = load_balancing_loss([logits_TE], K, packed, layers=[ours])
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert ours.router.weight.grad is not None and ours.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("change,words", [
    (dict(n_group=3), "n_group must divide the 16 experts into groups of at least 2, got 3"),
    (dict(n_group=16), "n_group must divide the 16 experts into groups of at least 2, got 16"),
    (dict(topk_group=5), r"topk_group must be in 1\.\.n_group \(4\), got 5"),
    (dict(top_k=9), r"num_experts_per_tok \(9\) must be at most the experts of the topk_group kept groups"),
    (dict(scoring="softmax"), "group-limited routing .n_group 4. takes sigmoid scoring, got softmax"),
])
def test_what_cannot_route_is_refused_in_one_line(change, words):
    import dataclasses

    with pytest.raises(zoo.ZooError, match=words):
        MoE(D, dataclasses.replace(_spec(), **change))


def test_random_init_zeroes_the_correction_bias():
    """A model materialised from meta (a preset's random weights) gets a zero router bias, not to_empty's memory."""
    from zoo.core.layers import init_weights

    with torch.device("meta"):
        layer = MoE(D, _spec())
    layer = layer.to_empty(device="cpu")
    layer.router_bias.fill_(float("nan"))
    init_weights(layer)
    assert torch.equal(layer.router_bias, torch.zeros(E)) and layer.router_bias.dtype == torch.float32
