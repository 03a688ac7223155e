"""Spawned-process side of the sequence-parallel test of the Qwen vision-language families (tests/test_qwen3_vl.py):
Qwen2.5-VL, Qwen3-VL (DeepStack), Qwen3.5 and Qwen3.5-MoE multimodal (the Gated DeltaNet language model), each under
ring, Ulysses and hybrid (2 x 2) over groups of 2 and 4 of one spawn of 4 ranks.

A case compares the SP loss (summed over its group) and gradients (all-reduced SUM) with one process on the global
pack, computed in-rank once per model (`_sp_worker.reference` / `against`). The pack is cut so that in every layout
an image's placeholders cross a shard cut, and image rows (where DeepStack adds) lie on several ranks: the case checks
both of its own shards, so a pack that stopped crossing would fail rather than pass on an easier cut. Each rank must
call the tower once a step, on exactly the images its placeholders show. The Gated DeltaNet's state passes from one
rank's piece of a document to the next (ring), its heads split over the Ulysses members; one it cannot split is
refused in one line. Qwen3.5-MoE's loss carries its balancing terms (load-balancing and z-loss): the shards' routing
statistics sum to one process's. Rank 0 writes {case: [ok, detail]}.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
from _sp_worker import against, reference, sp_run, spawned

import zoo
from zoo.core.layers import init_weights
from zoo.core.packing import ImagePatches
from zoo.errors import ZooError
from zoo.models.qwen2 import Qwen2Config
from zoo.models.qwen2_5_vl import Qwen25VLConfig, QwenVL
from zoo.models.qwen3 import Qwen3Config
from zoo.models.qwen3_5 import Qwen3_5Config
from zoo.models.qwen3_5_moe import Qwen3_5MoeConfig
from zoo.models.qwen3_5_moe_vl import Qwen3_5MoeVLConfig
from zoo.models.qwen3_5_vl import Qwen3_5VLConfig
from zoo.models.qwen3_vl import QWEN3_VISION, Qwen3VLConfig
from zoo.models.qwen_vision import QwenVisionConfig

IMAGE, START, END = 120, 121, 122  # 2-pixel patches merged 2x2: an image of grid (h, w) is h*w/4 placeholders
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl")
SIZES = (2, 4)
# per document: ints are text runs, (h, w) image grids; two images in one document, a text-only one. 66 tokens: with
# these lengths an image crosses a cut in every layout below (checked per case), and a ring of 4 leaves rank 0 no
# image (its tower runs on none)
DOCS: list[list[Any]] = [[3, (4, 6), 5, (8, 4), 2], [3, (6, 6), 4], [9], [3, (4, 4), 2]]


def modes(size: int) -> list[str]:
    return ["ring", "ulysses"] + (["hybrid"] if size == 4 else [])


def case_names() -> list[str]:
    """The report's keys."""
    return [f"{name}/sp{size}/{mode}" for name in FAMILIES for size in SIZES for mode in modes(size)] + \
        ["qwen3_5_vl/ulysses4-refused"]


def pack() -> zoo.Packed:
    g = torch.Generator().manual_seed(3)
    docs, images = [], []
    for spec in DOCS:
        ids, grids = [], []
        for part in spec:
            if isinstance(part, int):
                ids.append(torch.randint(0, 110, (part,), generator=g))
            else:
                ids.append(torch.tensor([START] + [IMAGE] * (part[0] * part[1] // 4) + [END]))
                grids.append(part)
        docs.append(torch.cat(ids))
        n = sum(h * w for h, w in grids)
        images.append(ImagePatches(torch.randn(n, 3 * 2 * 2 * 2, generator=g),
                                   torch.tensor([[1, h, w] for h, w in grids])) if grids else None)
    return zoo.pack(docs, images=images)


def build(name: str, linear_key_heads: int = 4) -> QwenVL:
    """A tiny model of the family, every parameter random (norms, biases and the DeltaNet's decays off their init).
    4 query heads over 2 KV heads (Ulysses over 4 repeats the KV heads); the DeltaNet's 4 key and 8 value heads split
    over 2 and 4; Qwen3-VL's DeepStack adds into both language layers."""
    tower: dict[str, Any] = dict(dim=16, n_layers=2, n_heads=2, ffn_dim=24, out_dim=32, patch_size=2)
    shape: dict[str, Any] = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    hybrid: dict[str, Any] = dict(head_dim=8, rotary_dim=6, layer_types=("linear_attention", "full_attention"),
                  linear_key_heads=linear_key_heads, linear_value_heads=8, linear_key_head_dim=8,
                  linear_value_head_dim=8, mrope_section=(1, 1, 1))
    qwen3_tower: dict[str, Any] = {**QWEN3_VISION, **tower, "n_position_embeddings": 9}
    cfg: Qwen25VLConfig | Qwen3VLConfig | Qwen3_5VLConfig | Qwen3_5MoeVLConfig
    if name == "qwen2_5_vl":
        cfg = Qwen25VLConfig(vision=QwenVisionConfig(**tower, window_size=8, full_layers=(1,)),
                             language=Qwen2Config(**shape, ffn_dim=48, mrope_section=(1, 1, 2)), image_token_id=IMAGE)
    elif name == "qwen3_vl":
        cfg = Qwen3VLConfig(vision=QwenVisionConfig(**{**qwen3_tower, "deepstack_layers": (0, 1)}),
                            language=Qwen3Config(**shape, head_dim=8, ffn_dim=48, mrope_section=(1, 1, 2)),
                            image_token_id=IMAGE)
    elif name == "qwen3_5_vl":
        cfg = Qwen3_5VLConfig(vision=QwenVisionConfig(**{**qwen3_tower, "deepstack_layers": ()}),
                              language=Qwen3_5Config(**shape, **hybrid, ffn_dim=48), image_token_id=IMAGE)
    else:
        lm = Qwen3_5MoeConfig(**shape, **hybrid, n_experts=4, top_k=2, expert_ffn_dim=16, shared_expert_ffn_dim=24)
        cfg = Qwen3_5MoeVLConfig(vision=QwenVisionConfig(**{**qwen3_tower, "deepstack_layers": ()}), language=lm,
                                 image_token_id=IMAGE)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = QwenVL(cfg, attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            if "router" in n:  # routers that choose differently per token
                p.normal_(0.0, 0.5, generator=g)
    return model


def main(rank: int, world: int, port: int, out_path: str) -> None:
    spawned(lambda: every_case(rank), rank, world, port, out_path)


def groups(rank: int) -> dict:
    """{size: this rank's group of `size` ranks}, the first ranks (every rank creates every group, in one order)."""
    out = {}
    for size in SIZES:
        for ranks in (list(range(size)), list(range(size, dist.get_world_size()))):
            if ranks:
                group = dist.new_group(ranks)
                if rank in ranks and len(ranks) == size:
                    out[size] = group
    return out


def every_case(rank: int) -> dict:
    from zoo.parallel import SequenceParallel

    packed = pack()
    by_size = groups(rank)
    results: dict = {}
    for name in FAMILIES:
        model = build(name)
        # Qwen3.5-MoE's loss with its balancing terms, each shard's weighed by its share of the pack's targets
        loss_kw = (dict(denominator=packed.count_targets(model.labels), aux_loss_coef=0.1, z_loss_coef=0.01)
                   if name == "qwen3_5_moe_vl" else {})
        ref = reference(model, packed, **loss_kw)
        for size, group in by_size.items():
            if rank >= size:  # ranks 2 and 3 sit out the groups of 2: the report is rank 0's
                continue
            for mode in modes(size):
                case = f"{name}/sp{size}/{mode}"
                try:
                    sp = SequenceParallel(group, mode=mode, ulysses_size=2)
                    encoded: list[int] = []  # images per tower call on this rank
                    hook = model.vision.register_forward_hook(
                        lambda m, args, out, seen=encoded: seen.append(args[1].shape[0]))
                    try:
                        got = sp_run(model, sp, packed, group, shard_first=mode == "ring", **loss_kw)
                    finally:
                        hook.remove()
                    problems = against(ref, got, grad_atol=1e-6) + layout_problems(packed, got[2], encoded, group)
                    # every trained weight of the tower has a gradient on every rank, zero where it encoded nothing:
                    # FSDP reduce-scatters the parameters that have one, and the ranks' reductions must agree
                    problems += [f"rank {dist.get_rank()}: no gradient for vision.{n}"
                                 for n, p in model.vision.named_parameters() if p.grad is None]
                    results[case] = [not problems, "; ".join(problems)]
                except Exception:  # noqa: BLE001
                    results[case] = [False, traceback.format_exc()]
    results["qwen3_5_vl/ulysses4-refused"] = refused(by_size[4])
    return results


def layout_problems(packed: zoo.Packed, local, encoded: list[int], group) -> list[str]:
    """What makes the case weaker than it claims (no image crossing a cut, image rows on one rank only), and a tower
    that did not run once on exactly the images this rank's placeholders show."""
    assert packed.image_grid_thw is not None
    units_end = torch.cumsum(packed.image_grid_thw.prod(-1) // 4, 0)
    ordinal_G = torch.cumsum(packed.input_ids == IMAGE, 0) - 1
    held = sorted({int(torch.searchsorted(units_end, ordinal_G[i], right=True)) for i in local.index.tolist()
                   if packed.input_ids[i] == IMAGE})
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, held, group=group)
    problems = []
    if encoded != [len(held)]:
        problems.append(f"rank {dist.get_rank()} encoded {encoded} images in its tower calls, holds placeholders of "
                        f"{held}")
    crossing = [i for i in range(len(units_end)) if sum(i in h for h in every) > 1]
    if not crossing or sum(bool(h) for h in every) < 2:
        problems.append(f"the pack's layout is too easy: images held per rank {every}, none crossing a cut")
    return problems


def refused(group) -> list:
    """Ulysses over 4 ranks cannot split 2 DeltaNet key heads: one line at `apply`, and the model left as it was."""
    from zoo.parallel import SequenceParallel

    model = build("qwen3_5_vl", linear_key_heads=2)
    backend = model.attend
    try:
        SequenceParallel(group, mode="ulysses").apply(model)
    except ZooError as e:
        msg = str(e)
        ok = "2 key and 8 value heads over 4 Ulysses ranks" in msg and "\n" not in msg and model.attend is backend
        return [ok, "" if ok else f"refusal {msg!r}; attention left {model.attend!r}"]
    except Exception as e:  # noqa: BLE001
        return [False, f"raised {type(e).__name__}: {e}"]
    return [False, "no error"]
