"""The rotary's layout, declared in the spec (AttentionSpec.rope_layout): "half" pairs dim i with i + R/2 as
transformers' Llama does, "interleaved" pairs 2i with 2i + 1 as its GLM-4 does; both over the leading R dims of a
head (partial rotary). Each equals its transformers function bit for bit, fp32 and bf16, from the same tables."""

from __future__ import annotations

import pytest
import torch

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import Rotary, apply_rope
from zoo.core.packing import as_packed
from zoo.errors import ZooError

H = 16


def _tables(rotary_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, R] cos/sin at 11 positions (theta 10000): what a family's rotary hands its layers."""
    packed = as_packed(torch.zeros(11, dtype=torch.long), torch.tensor([0, 11]))
    return Rotary(rotary_dim, 10000.0)(packed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [H, H // 2])
def test_interleaved_equals_transformers_glm4(rotary_dim, dtype):
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    cos, sin = _tables(rotary_dim, dtype)
    q_TNH, k_TKH = torch.randn(11, 4, H).to(dtype), torch.randn(11, 2, H).to(dtype)
    # transformers: [B, heads, T, H] with tables [B, T, R]
    ref_q, ref_k = apply_rotary_pos_emb(q_TNH.transpose(0, 1)[None], k_TKH.transpose(0, 1)[None], cos[None], sin[None])
    got_q, got_k = apply_rope(q_TNH, cos, sin, "interleaved"), apply_rope(k_TKH, cos, sin, "interleaved")
    assert torch.equal(got_q, ref_q[0].transpose(0, 1)) and torch.equal(got_k, ref_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., rotary_dim:], q_TNH[..., rotary_dim:])  # the rest passes
    # the layouts differ (the test could fail): half-split turns other pairs
    assert not torch.equal(apply_rope(q_TNH, cos, sin), got_q)


@pytest.mark.parametrize("rotary_dim", [H, H // 2])
def test_half_equals_transformers_llama_and_stays_the_default(rotary_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = _tables(rotary_dim, torch.float32)
    q_TNH = torch.randn(11, 4, H)
    q_rot = q_TNH[..., :rotary_dim].transpose(0, 1)[None]
    ref = apply_rotary_pos_emb(q_rot, q_rot, cos[None], sin[None])[0][0].transpose(0, 1)
    assert torch.equal(apply_rope(q_TNH, cos, sin)[..., :rotary_dim], ref)
    assert torch.equal(apply_rope(q_TNH, cos, sin, "half"), apply_rope(q_TNH, cos, sin))


def test_an_unknown_layout_is_refused_in_one_line():
    from zoo.models.decoder import Decoder
    from zoo.models.llama import LlamaConfig

    class Odd(LlamaConfig):
        def decoder_spec(self) -> DecoderSpec:
            spec = super().decoder_spec()
            layer = LayerSpec(AttentionSpec(4, 2, 16, rope_layout="pairs"), MLPSpec(96))  # type: ignore[arg-type]
            return DecoderSpec((layer,), spec.rotaries)

    cfg = Odd(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)
    with torch.device("meta"), pytest.raises(ZooError) as e:
        Decoder(cfg)
    assert "rope_layout must be one of half, interleaved, got 'pairs'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("scaling", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 64},  # truncate by default, betas 32 and 1
    {"factor": 8.0, "original_max_position_embeddings": 256, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 0.9},
])
def test_yarn_equals_transformers_and_scales_cos_and_sin(scaling):
    """YaRN's frequencies and attention factor are transformers' `_compute_yarn_parameters`' to the bit (GPT-OSS's
    config: truncate false; DeepSeek's mscale pair; a given factor); the Rotary multiplies cos and sin by the factor
    in fp32. Families that do not name YaRN still refuse it."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from zoo.core.layers import rope_kind, yarn_attention_factor, yarn_inv_freq

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **scaling}
    hf = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=4096,
                      rope_parameters=dict(params))
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv, factor = yarn_inv_freq(16, 150000.0, params), yarn_attention_factor(params)
    assert torch.equal(inv, want_inv) and factor == want_factor
    rotary = Rotary(16, 150000.0, params)
    cos, sin = rotary(as_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 5])), torch.float32)
    angles = torch.arange(5.0)[:, None] * want_inv
    torch.testing.assert_close(cos[:, :8], angles.cos() * want_factor, rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 8:], angles.sin() * want_factor, rtol=0, atol=0)
    with pytest.raises(ZooError, match="unsupported rope scaling 'yarn' for this model; supported: default, llama3"):
        rope_kind(params)
