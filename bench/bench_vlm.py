"""One Qwen2.5-VL training step (forward + backward) on documents with images of mixed sizes: zoo packed vs
transformers' padded batch.

Same weights (a transformers Qwen2_5_VLForConditionalGeneration saved, then loaded by zoo) and the same documents:
a quarter without an image, the rest with one or two images of 112x112 to 448x336 pixels (14-pixel patches, a
temporal patch of 2, merged 2x2: 16 to 192 image tokens each), text lengths log-normal (median ~60). Shape scaled
down from Qwen2.5-VL-3B: tower 4 blocks x 128 (window attention, full attention in blocks 1 and 3, 112-pixel
windows), language model 4 layers x 256 (M-RoPE).
  zoo          zoo.load(HF_DIR) ; model.loss(zoo.pack(docs, images=...)): every image through the tower in one call
               (per-image cu_seqlens), the language model on one packed stream
  transformers the same documents right-padded to the longest with attention_mask, pixel_values concatenated and
               image_grid_thw as the processor gives them, labels = input_ids with placeholders and padding at -100
  *_tower      the vision tower alone (forward + backward of its merged features' mean square), both on the same
               concatenated patches: transformers' tower takes them unpadded too, attending per window and image in a
               loop of sdpa calls (or flash varlen), zoo in one call per block with cu_seqlens
Before timing: both losses (mean over the same text targets) agree within 1e-5 (fp32) or 5e-2 (bf16).
Peak memory: CPU, each variant's first step in a fresh process, RSS sampled every millisecond, minus RSS before it;
CUDA, the caching allocator's peak during a step minus what was allocated before it.

    python bench/bench_vlm.py [--reps 3] [--threads 2] [--device cuda --dtype bf16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import cuda_peak_growth, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402
from zoo.core.packing import ImagePatches  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 4096, 256, 4, 4, 2, 704
V_DIM, V_LAYERS, V_HEADS, V_FFN, PATCH, MERGE, TEMPORAL, WINDOW = 128, 4, 2, 352, 14, 2, 2, 112
IMAGE, VIDEO, START, END, PAD = 4090, 4091, 4088, 4089, 0
SIZES = [(112, 112), (224, 224), (336, 224), (448, 336), (224, 448), (168, 280)]  # (height, width) in pixels
SHAPES = {"default": 16, "smoke": 3}  # documents per batch


def hf_config():
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=8192, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e6},
                bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    vision = dict(depth=V_LAYERS, hidden_size=V_DIM, intermediate_size=V_FFN, num_heads=V_HEADS, out_hidden_size=DIM,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=WINDOW,
                  fullatt_block_indexes=[1, 3])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                            vision_start_token_id=START, vision_end_token_id=END, pad_token_id=PAD)


def make_hf(path: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(hf_config()).save_pretrained(path)


def make_docs(n_docs: int, seed: int = 0) -> tuple[list[torch.Tensor], list[ImagePatches | None]]:
    """(token ids with placeholders expanded, the image patches or None per document)."""
    g = torch.Generator().manual_seed(seed)
    docs: list[torch.Tensor] = []
    images: list[ImagePatches | None] = []
    for i in range(n_docs):
        k = (0, 1, 1, 2)[i % 4]
        parts = []
        grids: list[tuple[int, int]] = []
        for _ in range(k + 1):
            n = max(4, min(int(math.exp(math.log(60) + 0.8 * torch.randn(1, generator=g).item())), 600))
            parts.append(torch.randint(1, START, (n,), generator=g))
            if len(grids) < k:
                h, w = SIZES[int(torch.randint(len(SIZES), (1,), generator=g))]
                grids.append((h // PATCH, w // PATCH))
                parts.append(torch.tensor([START] + [IMAGE] * (h * w // (PATCH * MERGE) ** 2) + [END]))
        docs.append(torch.cat(parts))
        if grids:
            patches = sum(gh * gw for gh, gw in grids)
            images.append(ImagePatches(torch.randn(patches, 3 * TEMPORAL * PATCH * PATCH, generator=g),
                                       torch.tensor([[1, gh, gw] for gh, gw in grids])))
        else:
            images.append(None)
    return docs, images


def padded_batch(docs: list[torch.Tensor], images: list[ImagePatches | None]) -> dict:
    """What transformers' collator and processor give for these documents: right-padded ids, attention_mask, the
    image patches concatenated with their grids, labels = ids with placeholders and padding excluded."""
    longest = max(len(d) for d in docs)
    ids = torch.full((len(docs), longest), PAD)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = d, 1
    present = [im for im in images if im is not None]
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill((mask == 0) | (ids == IMAGE), -100),
                mm_token_type_ids=(ids == IMAGE).long(), pixel_values=torch.cat([im.pixel_values for im in present]),
                image_grid_thw=torch.cat([im.grid_thw for im in present]))


def build(variant: str, hf_dir: Path, docs, images, device: str, dtype: torch.dtype, attn: str):
    """(loss function, step function) of one variant: the step is forward + backward, gradients then dropped."""
    present = [im for im in images if im is not None]
    pixels = torch.cat([im.pixel_values for im in present]).to(device, dtype)
    grid = torch.cat([im.grid_thw for im in present]).to(device)
    if variant.startswith("zoo"):
        model = zoo.load(hf_dir, attn=attn, dtype=dtype, device=device)
        moved = [None if im is None else ImagePatches(im.pixel_values.to(dtype), im.grid_thw) for im in images]
        packed = zoo.pack(docs, images=moved).to(device)

        def loss():
            if variant == "zoo_tower":  # the tower alone: its merged features' mean square
                return model.vision(pixels, grid).float().square().mean()
            return model.loss(packed)
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
        model.to(device).train()
        batch = {k: v.to(device) for k, v in padded_batch(docs, images).items()}
        batch["pixel_values"] = batch["pixel_values"].to(dtype)

        def loss():
            if variant == "transformers_tower":
                return model.model.visual(pixels, grid_thw=grid).pooler_output.float().square().mean()
            return model(**batch).loss

    def step():
        loss().backward()
        for p in model.parameters():
            p.grad = None

    return loss, step


def peak_memory(variant: str, hf_dir: Path, n_docs: int, device: str, dtype: torch.dtype, attn: str) -> int:
    """Peak memory growth during one training step after a warm-up step (CPU: in this fresh process)."""
    _, step = build(variant, hf_dir, *make_docs(n_docs), device, dtype, attn)
    if device == "cuda":
        step()
        return cuda_peak_growth(step)
    return peak_rss_growth(step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--attn", default="sdpa", help="zoo's attention backend (transformers runs sdpa)")
    p.add_argument("--docs", type=int, default=SHAPES["default"], help="documents in the batch")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: measure one variant's memory
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.memory_of:
        print(json.dumps({"peak": peak_memory(args.memory_of, Path(args.hf_dir), args.docs, args.device, dtype,
                                              args.attn)}))
        return 0

    variants = ["zoo", "transformers", "zoo_tower", "transformers_tower"]
    docs, images = make_docs(args.docs)
    lens = [len(d) for d in docs]
    grids = torch.cat([im.grid_thw for im in images if im is not None])
    n_image_tokens = int(grids.prod(-1).sum()) // MERGE ** 2
    padded = len(docs) * max(lens)
    pad_fraction = 1 - sum(lens) / padded
    print(f"batch: {len(docs)} documents, {len(grids)} images ({int(grids[:, 1:].prod(-1).sum())} patches, "
          f"{n_image_tokens} image tokens; sizes {sorted({(h * PATCH, w * PATCH) for _, h, w in grids.tolist()})}), "
          f"{sum(lens)} tokens (padded batch {padded}, {100 * pad_fraction:.0f}% padding), longest {max(lens)}; "
          f"LM {LAYERS}x{DIM}, tower {V_LAYERS}x{V_DIM}; {args.device} {args.dtype}, torch threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        make_hf(hf_dir)
        built = {v: build(v, hf_dir, docs, images, args.device, dtype, args.attn) for v in variants}
        with torch.no_grad():
            losses = {v: float(loss()) for v, (loss, _) in built.items()}
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        for a, b in (("zoo", "transformers"), ("zoo_tower", "transformers_tower")):
            diff = abs(losses[a] - losses[b])
            print(f"loss {a} {losses[a]:.6f}, {b} {losses[b]:.6f}: |diff| {diff:.2e} (tolerance {tol:g})")
            if not diff <= tol * max(1.0, abs(losses[b])):
                print("the losses disagree: not the same work, not timed", file=sys.stderr)
                return 1
        times = time_alternating({v: step for v, (_, step) in built.items()}, args.reps, device=args.device)
        del built
        mem = {}
        for v in variants:
            out = subprocess.run([sys.executable, __file__, "--memory-of", v, "--hf-dir", str(hf_dir), "--threads",
                                  str(args.threads), "--device", args.device, "--dtype", args.dtype, "--attn",
                                  args.attn, "--docs", str(args.docs)], capture_output=True, text=True, check=True)
            mem[v] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]

    med = {v: statistics.median(t) for v, t in times.items()}
    print(f"\n{'variant':<19} {'median s/step':>14} {'tokens/s':>10} {'x zoo':>7} {'peak step MB':>13}")
    for v in variants:
        base, n = ("zoo_tower", n_image_tokens) if v.endswith("tower") else ("zoo", sum(lens))
        print(f"{v:<19} {med[v]:>14.3f} {n / med[v]:>10.0f} {med[v] / med[base]:>6.2f}x {mem[v] / 2**20:>13.0f}")
    if args.out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {args.threads} threads"
        Path(args.out).write_text(json.dumps({
            "device": device, "torch": torch.__version__, "dtype": args.dtype, "documents": len(docs),
            "images": len(grids), "tokens": sum(lens), "image_tokens": n_image_tokens, "padded_tokens": padded,
            "pad_fraction": round(pad_fraction, 4), "losses": losses, "loss_tolerance": tol,
            "rows": {v: {"s": med[v], "x_zoo": med[v] / med["zoo_tower" if v.endswith("tower") else "zoo"],
                         "tokens_per_s": (n_image_tokens if v.endswith("tower") else sum(lens)) / med[v],
                         "peak_mb": mem[v] / 2**20, "times": times[v]} for v in variants}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
