"""Spawned-process side of the LLaVA sequence-parallel test: every case at one world size, in one process group.

A case compares the SP loss (summed over ranks) and the SP gradients (all-reduced SUM) of a LLaVA model with
one process on the global pack, and records which images each rank encoded. Rank 0 writes {case: [ok, detail]}.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from _sp_worker import against, reference, sp_run, spawned

import zoo
from zoo.core.contract import DecoderConfig
from zoo.core.layers import init_weights
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llama import LlamaConfig
from zoo.models.llava import Llava, LlavaConfig
from zoo.parallel import SequenceParallel

IMAGE_TOKEN = 60


def build(family: str) -> Llava:
    lm: DecoderConfig
    if family == "llama":
        lm = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    else:
        from zoo.models.internlm2 import InternLM2Config

        lm = InternLM2Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    cfg = LlavaConfig(vision=CLIPVisionConfig(dim=24, n_layers=2, n_heads=2, ffn_dim=40, image_size=8, patch_size=4),
                      language_family=family, language=lm, image_token_id=IMAGE_TOKEN)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llava(cfg, attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    return model


def pack() -> zoo.Packed:
    """89 tokens: documents with 3, 0 and 2 images of 4 placeholders each, placed so that under every mode some
    image crosses a shard cut, the images spread over several ranks, and no rank holds all of them."""
    g = torch.Generator().manual_seed(3)

    def text(n):
        return torch.randint(2, 60, (n,), generator=g)

    img = torch.full((4,), IMAGE_TOKEN)
    docs = [torch.cat([text(2), img, text(14), img, text(18), img, text(14)]), text(9),
            torch.cat([text(3), img, text(5), img, text(4)])]
    images = [torch.randn(3, 3, 8, 8, generator=g), None, torch.randn(2, 3, 8, 8, generator=g)]
    return zoo.pack(docs, images=images)


def run_case(model: Llava, sp: SequenceParallel, packed: zoo.Packed, world: int, shard_first: bool) -> list[str]:
    ref = reference(model, packed)
    encoded = []  # images per call of the tower on this rank
    hook = model.vision.patch_embed.register_forward_hook(lambda m, args, out: encoded.append(args[0].shape[0]))
    try:
        got = sp_run(model, sp, packed, shard_first=shard_first)
    finally:
        hook.remove()
    local = got[2]
    problems = against(ref, got, grad_atol=1e-6)

    # which images does this rank hold placeholders of? Each one must be encoded once, and no other
    positions_G = (packed.input_ids == IMAGE_TOKEN).nonzero().squeeze(1)
    held = set(local.index.tolist())
    assert packed.pixel_values is not None
    mine = torch.tensor([int(any(int(t) in held for t in positions_G[4 * i : 4 * i + 4]))
                         for i in range(packed.pixel_values.shape[0])])
    if encoded != [int(mine.sum())]:  # one tower call per step (FSDP needs it), with exactly the held images
        problems.append(f"rank {dist.get_rank()} encoded {encoded} images in its tower calls, holds {mine.tolist()}")
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    every = torch.stack(gathered)  # [ranks, images]
    if (every.sum(1) == every.shape[1]).any():
        problems.append(f"a rank encoded every image: {every.tolist()}")
    if not (every.sum(0) >= 2).any():
        problems.append(f"no image was split across a shard boundary: {every.tolist()}")
    if (every.sum(1) > 0).sum() < 2:
        problems.append(f"images on fewer than two ranks: {every.tolist()}")
    return problems


def main(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(lambda: every_case(world), rank, world, port, out_path)


def every_case(world: int) -> dict:
    results = {}
    packed = pack()
    cases = [("llama", "ring"), ("llama", "ulysses"), ("internlm2", "ring")]
    if world == 4:
        cases.append(("llama", "hybrid"))
    for family, mode in cases:
        name = f"{family}-{mode}"
        try:
            # ring: the pack cut before sp.apply (the image placeholders' targets are still never counted)
            problems = run_case(build(family), SequenceParallel(mode=mode, ulysses_size=2), packed, world,
                                shard_first=mode == "ring")
            results[name] = [not problems, "; ".join(problems)]
        except Exception:  # noqa: BLE001
            results[name] = [False, traceback.format_exc()]
    return results
