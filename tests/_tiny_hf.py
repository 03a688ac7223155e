"""Tiny random checkpoints written by transformers' own Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM.

Every parameter is random (norm scales and q/k norms around 1, biases and weights around 0): a misplaced norm, a
bias read into the wrong projection or a dropped q_norm changes the logits. The configs are the upstream classes',
so config.json is exactly what transformers writes for these models (rope_parameters, layer_types and all).
"""

from __future__ import annotations

from pathlib import Path

import torch

# vocab 128, width 64, GQA 4 query heads over 2 KV heads. eos/bos/pad are None: neither transformers' generate nor
# zoo's (stop=None: the checkpoint's eos) stops early, so greedy runs compare over every step
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)

# name -> (transformers class names, config keywords beyond COMMON)
SPECS: dict[str, tuple[str, str, dict]] = {
    # Qwen2.5-0.5B style: bias on q/k/v, the head tied to the embedding, no window (use_sliding_window false)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e6})),
    # Qwen2 with its optional window: layer 0 attends in full, layers 1 and 2 within 5 keys (max_window_layers 1)
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(num_hidden_layers=3, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
                          max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Qwen3: q/k RMSNorm per head, head_dim 24 (not 64 / 4)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_hidden_layers=2, head_dim=24, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen3 with windows on the layers layer_types names (not a max_window_layers prefix): sliding, full, sliding
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM",
                     dict(num_hidden_layers=3, head_dim=24, tie_word_embeddings=True, use_sliding_window=True,
                          sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Mistral-7B-v0.1 style: every layer within a window of 4, head_dim 24 (Nemo style: not 64 / 4)
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_hidden_layers=2, head_dim=24, sliding_window=4, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Mistral-7B-v0.3 style: sliding_window null (full attention)
    "mistral-nowindow": ("MistralConfig", "MistralForCausalLM",
                         dict(num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def build(name: str, seed: int = 0):
    """transformers' model for SPECS[name], every parameter randomised, in eval mode with eager attention (the
    reference: masks applied exactly, sliding windows included)."""
    import transformers

    config_cls, model_cls, extra = SPECS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in n:  # input/post-attention/final norms, and Qwen3's q_norm / k_norm
                p.copy_(1 + 0.3 * noise)
            elif n.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed" in n:
                p.copy_(0.1 * noise)
            else:  # large enough that the blocks, not the (tied) embedding, decide the next token: at 0.1 a tied
                # head mostly predicts the input token again, and greedy runs repeat one token
                p.copy_(0.2 * noise)
    return model


def save(name: str, path: Path, seed: int = 0) -> Path:
    """Write SPECS[name] with save_pretrained into `path`; returns `path`."""
    build(name, seed).save_pretrained(path)
    return path
