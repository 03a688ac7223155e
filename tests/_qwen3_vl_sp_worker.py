"""Spawned-process side of the Qwen3-VL / Qwen3.5 multimodal sequence-parallel test: ring and Ulysses for each, in
one process group of 2.

A case compares the SP loss (summed over ranks) and gradients (all-reduced SUM) with one process on the global pack,
whose images' placeholders cross the shard cut: the M-RoPE positions, the image tokens and Qwen3-VL's DeepStack
additions must be those of the whole pack, and Qwen3.5's Gated DeltaNet state must pass from one rank's piece of a
document to the next (ring). Rank 0 writes {case: [ok, detail]}.
"""

from __future__ import annotations

import traceback

import torch
from _qwen_vl_sp_worker import pack
from _sp_worker import against, reference, sp_run, spawned

from zoo.core.layers import init_weights
from zoo.models.qwen2_5_vl import QwenVL
from zoo.models.qwen3 import Qwen3Config
from zoo.models.qwen3_5 import Qwen3_5Config
from zoo.models.qwen3_5_vl import Qwen3_5VLConfig
from zoo.models.qwen3_vl import QWEN3_VISION, Qwen3VLConfig
from zoo.models.qwen_vision import QwenVisionConfig

IMAGE = 120  # the placeholder id of _qwen_vl_sp_worker.pack: 2-pixel patches merged 2x2


def build(name: str) -> QwenVL:
    tower = dict(dim=16, n_layers=2, n_heads=2, ffn_dim=24, out_dim=32, patch_size=2, n_position_embeddings=9)
    if name == "qwen3_vl":
        lm = Qwen3Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=128,
                         mrope_section=(1, 1, 2))
        cfg: Qwen3VLConfig | Qwen3_5VLConfig = Qwen3VLConfig(
            vision=QwenVisionConfig(**{**QWEN3_VISION, **tower, "deepstack_layers": (0, 1)}), language=lm,
            image_token_id=IMAGE)
    else:
        lm35 = Qwen3_5Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=128,
                             rotary_dim=6, layer_types=("linear_attention", "full_attention"), linear_key_heads=2,
                             linear_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             mrope_section=(1, 1, 1))
        cfg = Qwen3_5VLConfig(vision=QwenVisionConfig(**{**QWEN3_VISION, **tower, "deepstack_layers": ()}),
                              language=lm35, image_token_id=IMAGE)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = QwenVL(cfg, attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    with torch.no_grad():  # norms and the DeltaNet's decays off their init
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def main(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(every_case, rank, world, port, out_path)


def every_case() -> dict:
    from zoo.parallel import SequenceParallel

    results = {}
    packed = pack()
    for name in ("qwen3_vl", "qwen3_5_vl"):
        for mode in ("ring", "ulysses"):
            try:
                model = build(name)
                ref = reference(model, packed)
                got = sp_run(model, SequenceParallel(mode=mode, ulysses_size=2), packed, shard_first=mode == "ring")
                problems = against(ref, got, grad_atol=1e-6)
                results[f"{name}-{mode}"] = [not problems, "; ".join(problems)]
            except Exception:  # noqa: BLE001
                results[f"{name}-{mode}"] = [False, traceback.format_exc()]
    return results
