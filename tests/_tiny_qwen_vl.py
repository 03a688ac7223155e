"""A tiny random Qwen2.5-VL written by transformers' own Qwen2_5_VLForConditionalGeneration, and documents for it.

Patches of 4 pixels merged 2x2 (an image of 16 x 24 pixels is a grid of 4 x 6 patches, 2 x 3 = 6 image tokens),
windows of 16 pixels (2 x 2 units: most images have several windows, some cut short at the edge), full attention
in blocks 1 and 3 of 4. Every parameter is random (norms around 1, biases around 0), so a misplaced norm, bias or
permutation changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE, VIDEO, START, END = 250, 251, 248, 249
VOCAB = 256
MERGE = 2


def hf_config():
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1, 3])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                            vision_start_token_id=START, vision_end_token_id=END)


def build(seed: int = 0):
    """transformers' model, every parameter randomised, eval mode, eager attention."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = hf_config()
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in n or "ln_q" in n:
                p.copy_(1 + 0.3 * noise)
            elif n.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in n:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
    return model


PROCESSOR = {"image_processor": {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
                                 "temporal_patch_size": 2, "size": {"shortest_edge": 8 * 8, "longest_edge": 64 * 64},
                                 "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]},
             "processor_class": "Qwen2_5_VLProcessor"}


def save(path: Path, seed: int = 0):
    """The model's save_pretrained in `path`, with transformers 5's processor_config.json; returns the model."""
    import json

    model = build(seed)
    model.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(PROCESSOR))
    return model


def pixels(grid_hw: tuple[int, int], seed: int) -> torch.Tensor:
    """Random patches [h*w, 3*2*4*4] of an image of grid_hw patches."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(grid_hw[0] * grid_hw[1], 3 * 2 * 4 * 4, generator=g)


def document(parts: list, seed: int) -> torch.Tensor:
    """Token ids: ints are runs of that many random text tokens, (h, w) grids images (start, placeholders, end)."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for part in parts:
        if isinstance(part, int):
            ids.append(torch.randint(0, 240, (part,), generator=g))
        else:
            n = part[0] * part[1] // MERGE ** 2
            ids.append(torch.tensor([START] + [IMAGE] * n + [END]))
    return torch.cat(ids)
