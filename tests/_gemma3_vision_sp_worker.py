"""Spawned-process side of the Gemma 3 vision sequence-parallel test (tests/test_gemma3_vision.py), one process group.

Ulysses: the SP loss (summed over ranks) and gradients (all-reduced SUM) of a tiny Gemma 3 vision model equal one
process on the global pack, whose images' tokens cross the shard cut (each image is one bidirectional block, which
the attention over whole documents after the head exchange answers). Ring: refused in one line. Rank 0 writes
{case: [ok, detail]}.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from _sp_worker import against, reference, sp_run, spawned

import zoo
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.models.clip import CLIPVisionConfig
from zoo.models.gemma3 import Gemma3Config
from zoo.models.gemma3_vision import Gemma3Vision, Gemma3VisionConfig
from zoo.parallel import SequenceParallel

IMG, BOI, EOI = 127, 125, 126


def build() -> Gemma3Vision:
    tower = CLIPVisionConfig(dim=16, n_layers=1, n_heads=2, ffn_dim=24, image_size=28, patch_size=14,
                             act="gelu_pytorch_tanh", class_token=False, pre_norm=False, patch_bias=True)
    lm = Gemma3Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=128,
                      sliding_window=3, layer_types=("sliding_attention", "full_attention"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Gemma3Vision(Gemma3VisionConfig(vision=tower, language=lm, mm_tokens_per_image=4,
                                                image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI), attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    return model


def pack() -> zoo.Packed:
    """46 tokens, the second image's 4 tokens at 21..24 (the Ulysses cut at 2 ranks falls at 23)."""
    g = torch.Generator().manual_seed(3)

    def text(n):
        return torch.randint(2, 120, (n,), generator=g)

    img = torch.tensor([BOI, IMG, IMG, IMG, IMG, EOI])
    docs = [torch.cat([text(2), img, text(12), img, text(6)]), text(7), torch.cat([img, text(7)])]
    return zoo.pack(docs, images=[torch.randn(2, 3, 28, 28, generator=g), None, torch.randn(1, 3, 28, 28,
                                                                                              generator=g)])


def main(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(lambda: every_case(world), rank, world, port, out_path)


def every_case(world: int) -> dict:
    results = {}
    packed = pack()
    try:
        model = build()
        ref = reference(model, packed)
        problems = against(ref, sp_run(model, SequenceParallel(mode="ulysses"), packed), grad_atol=1e-6)
        local = SequenceParallel(mode="ulysses").shard(packed)
        if dist.get_rank() == 0 and (local.input_ids == IMG).sum() in (0, 12):
            problems.append("no image crosses the shard cut")
        results["ulysses"] = [not problems, "; ".join(problems)]
    except Exception:  # noqa: BLE001
        results["ulysses"] = [False, traceback.format_exc()]
    try:
        sp_run(build(), SequenceParallel(mode="ring"), packed)
        results["ring refuses"] = [False, "the ring ran bidirectional blocks"]
    except ZooError as e:
        ok = "cannot run bidirectional blocks" in str(e) and "\n" not in str(e)
        results["ring refuses"] = [ok, str(e)]
    return results
