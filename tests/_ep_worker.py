"""Spawned-process side of the expert-parallel tests (tests/test_moe.py): each case runs a Qwen3-MoE-shaped model
with its experts spread over an expert-parallel group and compares the summed loss and every gradient with one
process running all the packs. Rank 0 writes {case: [ok, detail]} as JSON (`_sp_worker.spawned`).

Cases (world 4): ep2 over data-parallel ranks {0,1} (ranks 2, 3 idle); on all four ranks, data parallel 2 x sequence
parallel 2 with ep2 inside each SP group (replicas across) and with ep4 over everything. And ep2 over data parallel
for a GPT-OSS-shaped model (router bias, top-k softmax, experts with biases sharded beside their weights, the clamped
SwiGLU).
"""

from __future__ import annotations

import copy
import traceback

import _sp_worker
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import zoo
from zoo.parallel import SequenceParallel
from zoo.parallel.expert import ExpertParallel, expert_params

PACKS = [[7, 30, 1, 12], [19, 3, 25, 9]]  # one pack per data-parallel rank
COEF = 0.1


def build():
    from zoo.models.decoder import Decoder
    from zoo.models.qwen3_moe import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                         n_experts=8, top_k=2, expert_ffn_dim=32, norm_topk_prob=True, mlp_only_layers=(1,))
    model = _sp_worker._build(Decoder, cfg)
    with torch.no_grad():
        for layer in model.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.normal_(0.0, 0.5)  # far from ties
    return model


def build_gpt_oss():
    from zoo.models.decoder import Decoder
    from zoo.models.gpt_oss import GptOssConfig

    cfg = GptOssConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, sliding_window=8,
                       n_experts=4, top_k=2, expert_ffn_dim=32, swiglu_limit=0.6)
    model = _sp_worker._build(Decoder, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.weight", "_bias", "sinks")):
                p.normal_(0.0, 0.5)  # far from ties; biases and sinks that matter
    return model


def build_deepseek_v3():
    """MLA over DeepSeek-V3's router: sigmoid scores, a non-zero correction bias, 8 experts in 4 groups of which a
    token's best 2 are kept, routed scaling 2.5, an ungated shared expert, a dense first layer."""
    from zoo.models.decoder import Decoder
    from zoo.models.deepseek_v3 import DeepseekV3Config

    cfg = DeepseekV3Config(dim=64, n_layers=2, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=12, ffn_dim=96, vocab_size=128, first_k_dense_replace=1,
                           n_experts=8, top_k=2, expert_ffn_dim=32, n_shared_experts=1, n_group=4, topk_group=2)
    model = _sp_worker._build(Decoder, cfg)
    with torch.no_grad():
        for layer in model.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.normal_(0.0, 0.5)
                layer.mlp.router_bias.copy_(torch.linspace(-0.3, 0.3, 8))  # the choice differs from the weights'
    return model


def reference(model, packs):
    """(loss, grads) of one process over every pack, each pack's loss over the targets of all."""
    total = sum(p.count_targets() for p in packs)
    model.zero_grad(set_to_none=True)
    loss = sum(model.loss(p, denominator=total, aux_loss_coef=COEF) for p in packs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run(model, packs, dp_rank, sp, ep, groups):
    """This rank's loss share and gradients, summed over `groups["all"]` (experts: gathered whole)."""
    total = sum(p.count_targets() for p in packs)
    packed = packs[dp_rank]
    if sp is not None:
        sp.apply(model)
        packed = sp.shard(packed)
    model.zero_grad(set_to_none=True)
    loss = model.loss(packed, denominator=total, aux_loss_coef=COEF)
    loss.backward()
    ep.reduce_expert_grads(model)
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss, group=groups["all"])
    experts = {id(p) for p in expert_params(model)}
    grads = {}
    for n, p in model.named_parameters():
        if id(p) in experts:
            grads[n] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        else:
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=groups["all"])
            grads[n] = g
    return total_loss, grads


def cases(rank: int, world: int) -> dict:
    results = {}
    packs = [zoo.pack(_sp_worker._docs(lens, 128, seed)) for seed, lens in enumerate(PACKS)]
    models = {"qwen3_moe": build(), "gpt_oss": build_gpt_oss(), "deepseek_v3": build_deepseek_v3()}
    refs = {name: reference(model, packs) for name, model in models.items()}

    def case(name, ranks, dp_of, sp_groups, ep_groups, replica_groups, arch="qwen3_moe"):
        base, ref = models[arch], refs[arch]
        # every rank creates every group, in the same order
        all_group = dist.new_group(ranks)
        sp_pg = {tuple(g): dist.new_group(g) for g in sp_groups}
        rep_pg = {tuple(g): dist.new_group(g) for g in replica_groups}
        ep_pg = {tuple(g): dist.new_group(g) for g in ep_groups}
        if rank not in ranks:
            return
        try:
            model = copy.deepcopy(base)
            mine = next(g for g in ep_groups if rank in g)
            mesh = DeviceMesh.from_group(ep_pg[tuple(mine)], "cpu", mesh_dim_names=("ep",))
            replicas = next((rep_pg[tuple(g)] for g in replica_groups if rank in g), None)
            ep = ExpertParallel(mesh, replicas)
            ep.apply(model)
            sp = None
            if sp_groups:
                sp = SequenceParallel(next(sp_pg[tuple(g)] for g in sp_groups if rank in g), mode="ulysses")
            problems = _sp_worker.against(ref, (*run(model, packs, dp_of[rank], sp, ep, {"all": all_group}), None))
            results[name] = [not problems, "; ".join(problems)]
        except Exception:  # noqa: BLE001
            results[name] = [False, traceback.format_exc()]

    case("ep2/dp2", [0, 1], {0: 0, 1: 1}, [], [[0, 1]], [])
    case("ep2/dp2xsp2", [0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, [[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    case("ep4/dp2xsp2", [0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, [[0, 1], [2, 3]], [[0, 1, 2, 3]], [])
    case("gpt_oss ep2/dp2", [0, 1], {0: 0, 1: 1}, [], [[0, 1]], [], arch="gpt_oss")
    case("deepseek_v3 ep2/dp2xsp2", [0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, [[0, 1], [2, 3]], [[0, 1], [2, 3]],
         [[0, 2], [1, 3]], arch="deepseek_v3")
    return results


def main(rank: int, world: int, port: int, out_path: str) -> None:
    _sp_worker.spawned(lambda: cases(rank, world), rank, world, port, out_path)
