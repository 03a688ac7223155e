"""Spawned-process side of the Qwen2.5-VL sequence-parallel test: ring and Ulysses in one process group.

A case compares the SP loss (summed over ranks) and gradients (all-reduced SUM) with one process on the global pack,
whose images' placeholders cross the shard cuts (so M-RoPE positions and image tokens must be those of the whole
pack). Rank 0 writes {case: [ok, detail]}.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from _sp_worker import against, reference, sp_run, spawned

import zoo
from zoo.core.layers import init_weights
from zoo.core.packing import ImagePatches
from zoo.models.qwen2 import Qwen2Config
from zoo.models.qwen2_5_vl import Qwen25VLConfig, QwenVL
from zoo.models.qwen_vision import QwenVisionConfig

IMAGE = 120
UNITS_END = torch.tensor([6, 14, 23])  # the pack's images' tokens, cumulated


def build() -> QwenVL:
    lm = Qwen2Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=128, mrope_section=(1, 1, 2))
    vision = QwenVisionConfig(dim=16, n_layers=2, n_heads=2, ffn_dim=24, out_dim=32, patch_size=2, window_size=8,
                              full_layers=(1,))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = QwenVL(Qwen25VLConfig(vision=vision, language=lm, image_token_id=IMAGE), attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    return model


def pack() -> zoo.Packed:
    """Documents with two images (grids 4x6 and 8x4: 6 and 8 tokens), none, and one (6x6: 9 tokens)."""
    g = torch.Generator().manual_seed(3)

    def text(n):
        return torch.randint(0, 110, (n,), generator=g)

    def image(h, w):
        return torch.full((h * w // 4,), IMAGE)

    def patches(*grids):
        n = sum(h * w for h, w in grids)
        return ImagePatches(torch.randn(n, 3 * 2 * 2 * 2, generator=g), torch.tensor([[1, h, w] for h, w in grids]))

    docs = [torch.cat([text(3), image(4, 6), text(7), image(8, 4), text(9)]), text(11),
            torch.cat([text(2), image(6, 6), text(6)])]
    return zoo.pack(docs, images=[patches((4, 6), (8, 4)), None, patches((6, 6))])


def main(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(lambda: every_case(world), rank, world, port, out_path)


def every_case(world: int) -> dict:
    from zoo.parallel import SequenceParallel

    results = {}
    packed = pack()
    for mode in ("ring", "ulysses"):
        try:
            model = build()
            ref = reference(model, packed)
            encoded: list[int] = []  # images per tower call on this rank
            hook = model.vision.register_forward_hook(
                lambda m, args, out, seen=encoded: seen.append(args[1].shape[0]))
            try:
                got = sp_run(model, SequenceParallel(mode=mode, ulysses_size=2), packed, shard_first=mode == "ring")
            finally:
                hook.remove()
            problems = against(ref, got, grad_atol=1e-6)
            # one tower call a step, with exactly the images whose placeholders this rank holds
            ordinal_G = torch.cumsum(packed.input_ids == IMAGE, 0) - 1
            held = {int(torch.searchsorted(UNITS_END, ordinal_G[i], right=True)) for i in got[2].index.tolist()
                    if packed.input_ids[i] == IMAGE}
            if encoded != [len(held)]:
                problems.append(f"rank {dist.get_rank()} encoded {encoded} images in its tower calls, holds "
                                f"placeholders of {sorted(held)}")
            results[mode] = [not problems, "; ".join(problems)]
        except Exception:  # noqa: BLE001
            results[mode] = [False, traceback.format_exc()]
    return results
