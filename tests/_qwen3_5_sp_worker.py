"""Spawned-process side of tests/test_qwen3_5_sp.py: a Qwen3.5-shaped model (Gated DeltaNet and gated attention
layers) under Ulysses, ring and hybrid sequence parallelism over groups of 2, 3 and 4 of the 4 ranks, against one
process (loss, every gradient), on packs whose documents start, end and pass through shards, with 1-token pieces;
a Qwen3-Next (the same layers over MoE blocks) over 2 and 4;
Ulysses over 3 ranks (heads not divisible) refused in one line. Rank 0 writes {case: [ok, detail]}
(`_sp_worker.spawned`)."""

from __future__ import annotations

import traceback

import _sp_worker
import torch
import torch.distributed as dist

import zoo
from zoo.errors import ZooError
from zoo.parallel import SequenceParallel

# 80 and 59 tokens: documents cut by every split, one shorter than the conv kernel; in the second, documents of
# 2G tokens (4, 6, 8) cut into 1-token pieces at G = 2, 3, 4, whose conv windows reach back over several ranks
PACKS = {"docs": [1, 23, 5, 2, 30, 19], "short-pieces": [4, 6, 8, 1, 37, 3]}
SIZES = (2, 3, 4)
NEXT_CASES = ("sp2/ulysses", "sp2/ring", "sp4/hybrid")  # Qwen3-Next's


def modes(size: int) -> list[str]:
    return {2: ["ulysses", "ring"], 3: ["ring"], 4: ["ulysses", "ring", "hybrid"]}[size]


def case_names() -> list[str]:
    return [f"sp{size}/{mode}/{pack}" for size in SIZES for mode in modes(size) for pack in PACKS] + \
        ["ulysses-3 refused"] + [f"qwen3-next/{case}" for case in NEXT_CASES]


def build():
    """4 key heads and 8 value heads (Ulysses 2 and 4 split both), 8 attention heads over 4 KV heads, two linear
    layers then a full one; every 1-d parameter and the conv weights random, the decays slow (A = U(0.02, 0.3):
    a document's state reaches far into its next pieces) and chunks of 4 tokens (pieces of several chunks)."""
    from zoo.models.decoder import Decoder
    from zoo.models.qwen3_5 import Qwen3_5Config

    cfg = Qwen3_5Config(dim=64, n_layers=3, n_heads=8, n_kv_heads=4, head_dim=16, rotary_dim=8, ffn_dim=96,
                        vocab_size=128, layer_types=("linear_attention", "linear_attention", "full_attention"),
                        linear_key_heads=4, linear_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
                        linear_conv_kernel=4)
    model = _sp_worker._build(Decoder, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 or "conv1d" in n:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
            if n.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=g).log())
    for layer in model.layers[:2]:
        layer.attn.chunk = 4
    return model


def build_qwen3_next():
    """Qwen3-Next: the same hybrid layers over MoE blocks with a shared expert (one dense layer), random routers."""
    from zoo.models.decoder import Decoder
    from zoo.models.qwen3_next import Qwen3NextConfig

    cfg = Qwen3NextConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, rotary_dim=8, ffn_dim=96,
                          vocab_size=128, layer_types=("linear_attention", "full_attention"), linear_key_heads=4,
                          linear_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, n_experts=4, top_k=2,
                          expert_ffn_dim=32, shared_expert_ffn_dim=48, mlp_only_layers=(1,))
    model = _sp_worker._build(Decoder, cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=g).log())
            elif "router" in n:
                p.normal_(0.0, 0.5, generator=g)
    return model


def cases(rank: int, world: int) -> dict:
    # every rank creates every group in the same order (the rest of the ranks get a group of their own too, so
    # that every rank holds as many groups when hybrid creates its subgroups)
    groups = {}
    for size in SIZES:
        for ranks in (list(range(size)), list(range(size, world))):
            if ranks:
                group = dist.new_group(ranks)
                if rank in ranks and len(ranks) == size:
                    groups[size] = group
    model = build()
    results = {}
    for pack_name, lens in PACKS.items():
        packed = zoo.pack(_sp_worker._docs(lens, 128, 1))
        ref = _sp_worker.reference(model, packed)
        for size, group in groups.items():
            if rank >= size:
                continue
            for mode in modes(size):
                case = f"sp{size}/{mode}/{pack_name}"
                try:
                    sp = SequenceParallel(group, mode=mode, ulysses_size=2)
                    problems = _sp_worker.against(ref, _sp_worker.sp_run(model, sp, packed, group))
                    results[case] = [not problems, "; ".join(problems)]
                except Exception:  # noqa: BLE001
                    results[case] = [False, traceback.format_exc()]
                finally:
                    for m in model.decoder.mixers():
                        m.sequence_parallel(None, mode)
    model = build_qwen3_next()
    packed = zoo.pack(_sp_worker._docs(PACKS["docs"], 128, 2))
    ref = _sp_worker.reference(model, packed)
    for case in NEXT_CASES:
        size, mode = int(case[2]), case.split("/")[1]
        if rank < size:
            case = f"qwen3-next/{case}"
            try:
                sp = SequenceParallel(groups[size], mode=mode, ulysses_size=2)
                problems = _sp_worker.against(ref, _sp_worker.sp_run(model, sp, packed, groups[size]))
                results[case] = [not problems, "; ".join(problems)]
            except Exception:  # noqa: BLE001
                results[case] = [False, traceback.format_exc()]
            finally:
                for m in model.decoder.mixers():
                    m.sequence_parallel(None, mode)
    if rank < 3:
        try:
            SequenceParallel(groups[3], mode="ulysses").apply(build())
            results["ulysses-3 refused"] = [False, "Ulysses over 3 ranks was accepted for 4 key heads"]
        except ZooError as e:
            results["ulysses-3 refused"] = ["'ring'" in str(e) and "\n" not in str(e), str(e)]
    dist.barrier()
    return results


def main(rank: int, world: int, port: int, out_path: str) -> None:
    _sp_worker.spawned(lambda: cases(rank, world), rank, world, port, out_path)
