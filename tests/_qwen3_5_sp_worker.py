"""Spawned-process side of tests/test_qwen3_5_sp.py: a Qwen3.5-shaped model (Gated DeltaNet and gated attention
layers) under Ulysses sequence parallelism at 2 and 4 ranks against one process (loss, every gradient), documents
crossing shard boundaries; ring refused in one line. Rank 0 writes {case: [ok, detail]} (`_sp_worker.spawned`)."""

from __future__ import annotations

import traceback

import _sp_worker
import torch
import torch.distributed as dist

import zoo
from zoo.errors import ZooError
from zoo.parallel import SequenceParallel

DOC_LENS = [1, 23, 5, 2, 30, 19]  # 80 tokens: documents cut by every split, one shorter than the conv kernel


def build():
    """4 key heads and 8 value heads (Ulysses 2 and 4 split both), 8 attention heads over 4 KV heads, every other
    layer linear; the decays, norms and conv weights random."""
    from zoo.models.decoder import Decoder
    from zoo.models.qwen3_5 import Qwen3_5Config

    cfg = Qwen3_5Config(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, rotary_dim=8, ffn_dim=96,
                        vocab_size=128, layer_types=("linear_attention", "full_attention"), linear_key_heads=4,
                        linear_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4)
    model = _sp_worker._build(Decoder, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 or "conv1d" in n:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
    return model


def cases(rank: int, world: int) -> dict:
    results = {}
    groups = {size: dist.new_group(list(range(size))) for size in (2, 4)}
    packed = zoo.pack(_sp_worker._docs(DOC_LENS, 128, 1))
    model = build()
    ref = _sp_worker.reference(model, packed)
    for size, group in groups.items():
        if rank >= size:
            continue
        case = f"sp{size}/ulysses"
        try:
            sp = SequenceParallel(group, mode="ulysses")
            problems = _sp_worker.against(ref, _sp_worker.sp_run(model, sp, packed, group))
            results[case] = [not problems, "; ".join(problems)]
        except Exception:  # noqa: BLE001
            results[case] = [False, traceback.format_exc()]
        finally:
            for m in model.decoder.mixers():
                m.sequence_parallel(None, "ulysses")
    try:
        SequenceParallel(groups[4], mode="ring").apply(build())
        results["ring refused"] = [False, "ring mode was accepted"]
    except ZooError as e:
        results["ring refused"] = ["--sp-mode ulysses" in str(e) and "\n" not in str(e), str(e)]
    return results


def main(rank: int, world: int, port: int, out_path: str) -> None:
    _sp_worker.spawned(lambda: cases(rank, world), rank, world, port, out_path)
