"""One LLaVA training step (forward, backward, AdamW) on mixed text/image documents: zoo packed vs transformers, CPU.

Same weights (a transformers LlavaForConditionalGeneration saved, then converted by zoo's loader) and the same
documents: a third without an image, the rest with one or two images, text lengths log-normal (median ~80).
  zoo          zoo.load(HF_DIR) ; model.loss(zoo.pack(docs, images=...))   one packed stream, one tower call
  hf_padded    transformers on a right-padded [n_docs, longest] batch with attention_mask (the usual collator)
  hf_per_doc   transformers one document at a time, losses weighted by targets, one optimizer step
Peak memory: each variant's first step in a fresh process, RSS sampled every millisecond, minus RSS before it.

    python bench/bench_llava.py [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import memory_in_fresh_processes, peak_rss_growth, time_alternating  # noqa: E402

import zoo  # noqa: E402
from zoo.io.image import expand_image_tokens  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, FFN = 8000, 192, 3, 4, 512
V_DIM, V_LAYERS, V_HEADS, V_FFN, IMAGE, PATCH = 128, 3, 4, 512, 84, 14  # 36 image tokens per image
IMAGE_TOKEN, PAD, N_DOCS = 7999, 0, 12


def make_docs(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """(docs with expanded placeholders, pixel values or None per doc)."""
    g = torch.Generator().manual_seed(seed)
    docs: list[torch.Tensor] = []
    images: list[torch.Tensor | None] = []
    for i in range(N_DOCS):
        n = max(4, min(int(math.exp(math.log(80) + 0.8 * torch.randn(1, generator=g).item())), 600))
        text = torch.randint(1, IMAGE_TOKEN, (n,), generator=g)
        k = i % 3  # 0, 1 or 2 images
        if k:
            at = sorted(torch.randint(1, n, (k,), generator=g).tolist())
            parts = [text[: at[0]]] + [torch.cat([torch.tensor([IMAGE_TOKEN]), text[a:b]])
                                       for a, b in zip(at, at[1:] + [n], strict=True)]
            text = expand_image_tokens(torch.cat(parts), IMAGE_TOKEN, (IMAGE // PATCH) ** 2)
        docs.append(text)
        images.append(torch.randn(k, 3, IMAGE, IMAGE, generator=g) if k else None)
    return docs, images


def make_hf(path: Path) -> None:
    import transformers

    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4096)
    vision = transformers.CLIPVisionConfig(hidden_size=V_DIM, intermediate_size=V_FFN, num_hidden_layers=V_LAYERS,
                                           num_attention_heads=V_HEADS, image_size=IMAGE, patch_size=PATCH)
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                                   pad_token_id=PAD, vision_feature_layer=-2)
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(path)


def build(variant: str, hf_dir: Path, docs, images, attn: str):
    """(model, step function) for one variant."""
    import transformers

    if variant == "zoo":
        model = zoo.load(hf_dir, attn=attn)
        packed = zoo.pack(docs, images=images)

        def loss_backward():
            model.loss(packed).backward()
    else:
        model = transformers.LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32,
                                                                           attn_implementation="sdpa")
        model.train()
        if variant == "hf_padded":
            longest = max(len(d) for d in docs)
            ids = torch.full((len(docs), longest), PAD)
            mask = torch.zeros_like(ids)
            for i, d in enumerate(docs):
                ids[i, : len(d)], mask[i, : len(d)] = d, 1
            labels = ids.masked_fill((mask == 0) | (ids == IMAGE_TOKEN), -100)
            pixels = torch.cat([im for im in images if im is not None])

            def loss_backward():
                model(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=labels).loss.backward()
        elif variant == "hf_per_doc":
            doc_labels = [d.masked_fill(d == IMAGE_TOKEN, -100) for d in docs]
            n_targets = sum(int((lab[1:] != -100).sum()) for lab in doc_labels)

            def loss_backward():
                for d, lab, im in zip(docs, doc_labels, images, strict=True):
                    out = model(input_ids=d[None], pixel_values=im, labels=lab[None])
                    (out.loss * int((lab[1:] != -100).sum()) / n_targets).backward()
        else:
            raise ValueError(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def peak_memory(variant: str, hf_dir: Path, attn: str) -> int:
    """Peak RSS growth during the first training step (optimizer state included), in a fresh process."""
    _, step = build(variant, hf_dir, *make_docs(), attn)
    return peak_rss_growth(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: measure one variant's memory
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps({"peak": peak_memory(args.memory_of, Path(args.hf_dir), args.attn)}))
        return

    variants = ["zoo", "hf_padded", "hf_per_doc"]
    docs, images = make_docs()
    lens = [len(d) for d in docs]
    n_images = sum(0 if im is None else im.shape[0] for im in images)
    padded = len(docs) * max(lens)
    print(f"batch: {len(docs)} documents, {n_images} images ({(IMAGE // PATCH) ** 2} tokens each), {sum(lens)} tokens "
          f"(padded batch {padded}, {100 * (1 - sum(lens) / padded):.0f}% padding), longest {max(lens)}; "
          f"LM Llama {LAYERS}x{DIM}, tower CLIP {V_LAYERS}x{V_DIM} at {IMAGE}px; torch threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        make_hf(hf_dir)
        steps = {v: build(v, hf_dir, docs, images, args.attn)[1] for v in variants}
        times = time_alternating(steps, args.reps)
        del steps
        mem = memory_in_fresh_processes(__file__, variants, ["--hf-dir", str(hf_dir), "--threads", str(args.threads),
                                                            "--attn", args.attn])

    med = {v: statistics.median(t) for v, t in times.items()}
    print(f"\n{'variant':<12} {'median s/step':>14} {'tokens/s':>10} {'zoo speed-up':>13} {'peak step MB':>13}")
    for v in variants:
        print(f"{v:<12} {med[v]:>14.3f} {sum(lens) / med[v]:>10.0f} {med[v] / med['zoo']:>12.2f}x "
              f"{mem[v] / 2**20:>13.0f}")


if __name__ == "__main__":
    main()
