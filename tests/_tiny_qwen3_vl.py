"""Tiny random Qwen3-VL and Qwen3.5 multimodal models written by transformers' own Qwen3VLForConditionalGeneration
and Qwen3_5ForConditionalGeneration, and documents for them.

Patches of 4 pixels merged 2x2 (an image of grid 4 x 6 patches is 2 x 3 = 6 image tokens), a learned position table
of 3 x 3 resampled to every grid (so every patch reads an interpolated position), 3 tower blocks; Qwen3-VL's
DeepStack taps blocks 0 and 2 into the first two of its 3 language layers. Qwen3.5's language model has two Gated
DeltaNet and two gated-attention layers, half of each head rotated. Every parameter is random (norms around 1, biases
around 0, A_log and dt_bias off their init), so a misplaced norm, bias or permutation changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE, VIDEO, START, END = 250, 251, 248, 249
VOCAB = 256
MERGE = 2
PATCH_DIM = 3 * 2 * 4 * 4

VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=MERGE, temporal_patch_size=2, num_position_embeddings=9, initializer_range=0.1)
TEXT = {
    "qwen3_vl": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                     initializer_range=0.1,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                      "mrope_interleaved": True}),
    "qwen3_5_vl": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                       vocab_size=VOCAB, max_position_embeddings=512, full_attention_interval=2, initializer_range=0.1,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
}
TEXT["qwen3_5_moe_vl"] = {**{k: v for k, v in TEXT["qwen3_5_vl"].items() if k != "intermediate_size"},
                          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "shared_expert_intermediate_size": 48}
PROCESSOR = {"image_processor": {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
                                 "temporal_patch_size": 2, "size": {"shortest_edge": 8 * 8, "longest_edge": 64 * 64},
                                 "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
             "processor_class": "Qwen3VLProcessor"}


def build(name: str, seed: int = 0, ids: dict | None = None, vocab: int = VOCAB):
    """transformers' model, every parameter randomised, eval mode, eager attention; `ids` (image_token_id,
    video_token_id, vision_start_token_id, vision_end_token_id) and `vocab` for another tokenizer's."""
    import _tiny_families
    import transformers

    ids = ids or dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                      vision_end_token_id=END)
    text = {**TEXT[name], "vocab_size": vocab, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if name == "qwen3_vl":
        config = transformers.Qwen3VLConfig(text_config=text, vision_config={**VISION, "deepstack_visual_indexes":
                                                                             [0, 2]}, **ids)
        cls = transformers.Qwen3VLForConditionalGeneration
    elif name == "qwen3_5_vl":
        config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION, **ids)
        cls = transformers.Qwen3_5ForConditionalGeneration
    else:
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **ids)
        cls = transformers.Qwen3_5MoeForConditionalGeneration
    for c in (config, config.vision_config, config.text_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    return _tiny_families.randomize(model, seed + 1).eval()


def save(name: str, path: Path, seed: int = 0):
    """The model's save_pretrained in `path`, with transformers 5's processor_config.json; returns the model."""
    model = build(name, seed)
    model.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(PROCESSOR))
    return model


def pixels(grid_hw: tuple[int, int], seed: int) -> torch.Tensor:
    """Random patches [h*w, 3*2*4*4] of an image of grid_hw patches."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(grid_hw[0] * grid_hw[1], PATCH_DIM, generator=g)


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
