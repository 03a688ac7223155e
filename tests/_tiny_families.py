"""Tiny random checkpoints of the Qwen2, Qwen3 and Mistral families, saved by transformers' own classes (and a
LLaVA with one of them as its language model), for tests/test_new_families.py.

Every parameter is random: transformers initialises norms to 1 and biases to 0, which would let a converter that
drops a bias or a q/k norm pass, so those are moved off their init too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch

TEXT_FAMILIES = ("qwen2", "qwen3", "mistral")
IMAGE_TOKEN = 100  # a LLaVA's placeholder: inside the tiny vocabulary (llava-hf embeds every id)
PAD = 101
WINDOW = 8  # Mistral's sliding window: shorter than the test documents, so it cuts them


def text_config(family: str, vocab_size: int = 128, tie: bool = False, **extra):
    """transformers' config of a tiny `family` model: width 64, 2 layers, 4 query heads over 2 KV heads (GQA), an
    explicit head_dim 24 for Qwen3 and Mistral (not width / heads: as Qwen3-0.6B and Mistral-Nemo), Mistral's
    window shorter than the documents."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
                  tie_word_embeddings=tie)
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=1_000_000.0, **extra)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, rope_theta=1_000_000.0, **extra)
    if family == "mistral":
        return MistralConfig(**common, head_dim=24, sliding_window=WINDOW, rms_norm_eps=1e-5, **extra)
    raise ValueError(family)


M = TypeVar("M", bound=torch.nn.Module)


def randomize(model: M, seed: int) -> M:
    """Every 1-D parameter (norm weights, biases, Qwen3's q_norm/k_norm) moved off its init; the matrices keep
    transformers' random init (initializer_range 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def causal_lm_class(family: str):
    import transformers

    return getattr(transformers, {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                  "mistral": "MistralForCausalLM"}[family])


def save_causal_lm(family: str, path: Path, seed: int = 0, vocab_size: int = 128, tie: bool = False):
    """transformers' `family` model, random, saved to `path` with save_pretrained; returned in eval mode."""
    torch.manual_seed(seed)
    model = randomize(causal_lm_class(family)(text_config(family, vocab_size, tie)), seed + 1).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


def llava_config(family: str, tie: bool = False, vocab_size: int = 128, image_token: int = IMAGE_TOKEN):
    """transformers' LlavaConfig: a tiny CLIP tower (16 px images, 4 px patches: 16 image tokens) before a tiny
    `family` language model."""
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
                              image_size=16, patch_size=4, hidden_act="quick_gelu", initializer_range=0.1)
    return LlavaConfig(text_config=text_config(family, vocab_size, tie), vision_config=vision,
                       image_token_index=image_token, pad_token_id=PAD, vision_feature_layer=-2,
                       vision_feature_select_strategy="default")


def save_llava(family: str, path: Path, tie: bool = False, seed: int = 0, vocab_size: int = 128,
               image_token: int = IMAGE_TOKEN):
    """transformers' LlavaForConditionalGeneration over a `family` language model, random, saved to `path`."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    config = llava_config(family, tie, vocab_size, image_token)
    model = randomize(LlavaForConditionalGeneration(config), seed + 1).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


def llava_docs(image_tokens: int, seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Five documents with 1, 1, 0, 0 and 2 images (placeholders expanded), each of the first four beside a
    different document of the same length (sdpa runs equal lengths as one batched call), all longer than Mistral's
    window; and their pixel values."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> torch.Tensor:
        return torch.randint(2, IMAGE_TOKEN, (n,), generator=g)

    img = torch.full((image_tokens,), IMAGE_TOKEN)
    docs = [torch.cat([text(3), img, text(6)]), torch.cat([text(5), img, text(4)]), text(11), text(11),
            torch.cat([text(2), img, text(4), img, text(3)])]
    images = [torch.randn(3, 16, 16, generator=g), torch.randn(3, 16, 16, generator=g), None, None,
              torch.randn(2, 3, 16, 16, generator=g)]
    return docs, images
