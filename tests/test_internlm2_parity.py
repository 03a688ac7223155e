"""InternLM2 parity: one packed forward equals the upstream remote code on each document (fixture goldens), and
dynamic NTK scaling is applied per document, from each document's own length."""

import pytest
import torch
from conftest import assert_backend_gradients_agree, assert_matches_golden, converted_fixture

import zoo
from zoo.models.internlm2 import (
    InternLM2,
    InternLM2Config,
    InternLM2Rotary,
    config_from_hf,
    merge_wqkv,
    split_wqkv,
)

BACKENDS = ["eager", "sdpa", "flex"]  # flex: forward only on CPU


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return converted_fixture("internlm2", tmp_path_factory.mktemp("internlm2"))


def test_fixture_logits_and_losses_from_one_packed_forward(fixture):
    src, zoo_dir, golden, docs = fixture
    packed = zoo.pack(docs)
    for path in (src, zoo_dir):
        model = zoo.load(path)
        for backend in BACKENDS:
            model.set_attention(backend)
            assert_matches_golden(model, packed, golden, docs, f"{path.name} {backend}")


def test_fixture_gradients_finite_and_equal_between_backends(fixture):
    src, _, _, docs = fixture
    model = zoo.load(src)
    packed = zoo.pack(docs)
    assert_backend_gradients_agree(model, packed)


def test_published_config_json_reads_as_the_preset():
    """zoo.load(preset, checkpoint=...) compares configs: the hub config.json must read back as the preset."""
    published = {  # internlm/internlm2-chat-7b
        "architectures": ["InternLM2ForCausalLM"], "attn_implementation": "eager", "bias": False, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "internlm2",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pad_token_id": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 2.0, "type": "dynamic"},
        "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 92544,
    }
    assert config_from_hf(published) == zoo.get_preset("internlm2-7b-chat").config


def test_wqkv_rows_are_grouped_per_kv_head():
    """Row r of wqkv belongs to KV group r // ((G+2)H): G query heads, then the key head, then the value head."""
    cfg = InternLM2Config(dim=24, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=8, vocab_size=8)  # H=4, G=3
    H, G = cfg.head_dim, 3
    labels = []  # (kind, head) of each fused row, built from the layout description, not from split_wqkv
    for group in range(2):
        labels += [("q", group * G + j) for j in range(G) for _ in range(H)]
        labels += [("k", group)] * H + [("v", group)] * H
    code = {"q": 0, "k": 1000, "v": 2000}
    wqkv = torch.tensor([[code[k] + head] for k, head in labels], dtype=torch.float32).expand(-1, 24).contiguous()
    q, k, v = (split_wqkv(wqkv, w, cfg) for w in "qkv")
    assert q[:, 0].tolist() == [h for h in range(6) for _ in range(H)]
    assert k[:, 0].tolist() == [1000 + h for h in range(2) for _ in range(H)]
    assert v[:, 0].tolist() == [2000 + h for h in range(2) for _ in range(H)]
    assert torch.equal(merge_wqkv(q, k, v, cfg), wqkv)
    bias = wqkv[:, 0].clone()
    assert torch.equal(merge_wqkv(*(split_wqkv(bias, w, cfg) for w in "qkv"), cfg), bias)


# ---- dynamic NTK: documents longer than max_position_embeddings ----

TINY = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, rope_theta=10000.0,
                       max_seq_len=16, rope_scaling={"type": "dynamic", "factor": 2.0})
# scaled, plain, scaled, exactly at the limit (plain), just over twice (equal-length neighbours, different documents:
# sdpa runs them as one batched call, each still scaled by its own length), one token
LENGTHS = [40, 7, 23, 16, 17, 17, 1]


def random_model(cfg):
    torch.manual_seed(3)
    model = InternLM2(cfg, attn="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in n else 0.15 * torch.randn_like(p))
    return model


def upstream_cos_sin(cfg, n_positions, seq_len):
    """cos/sin the way upstream's dynamic NTK rotary makes them, for a forward whose max(position_ids)+1 is seq_len."""
    H, factor, base = cfg.head_dim, cfg.rope_scaling["factor"], cfg.rope_theta
    if seq_len > cfg.max_seq_len:
        base = base * ((factor * torch.tensor(seq_len) / cfg.max_seq_len) - (factor - 1)) ** (H / (H - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, H, 2, dtype=torch.int64).float() / H))
    freqs = torch.arange(n_positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def logits_with_rotary(model, packed, cos_sin):
    model.rotaries["default"] = lambda p, dtype: tuple(t.to(dtype) for t in cos_sin)
    try:
        with torch.no_grad():
            return model(packed)
    finally:
        model.rotaries["default"] = InternLM2Rotary(model.config)


def test_dynamic_ntk_scales_each_document_by_its_own_length():
    model = random_model(TINY)
    docs = [torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(100 * i + n))
            for i, n in enumerate(LENGTHS)]
    packed = zoo.pack(docs)
    T = packed.num_tokens
    by_pack_length = logits_with_rotary(model, packed, upstream_cos_sin(TINY, T, T))
    for backend in ("eager", "sdpa"):
        model.set_attention(backend)
        with torch.no_grad():
            logits = model(packed)
        for i, doc in enumerate(docs):
            s, e = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
            alone = logits_with_rotary(model, zoo.pack([doc]), upstream_cos_sin(TINY, len(doc), len(doc)))
            torch.testing.assert_close(logits[s:e], alone, atol=1e-5, rtol=1e-5)
            if len(doc) > 1:  # scaling by the pack's length would have been wrong for every document
                assert (by_pack_length[s:e] - alone).abs().max() > 1e-3, f"doc {i}"
    # the scaling is really active: a long document differs from plain RoPE
    long_doc = zoo.pack([docs[0]])
    plain = logits_with_rotary(model, long_doc, upstream_cos_sin(TINY, 40, 1))
    with torch.no_grad():
        assert (model(long_doc) - plain).abs().max() > 1e-3


def test_dynamic_ntk_uses_the_global_document_length_of_a_shard():
    """A sequence-parallel shard holds a piece of a document; doc_len carries the whole document's length."""
    rotary = InternLM2Rotary(TINY)
    full = zoo.pack([torch.zeros(40, dtype=torch.long), torch.zeros(9, dtype=torch.long)])
    cos, sin = rotary(full, torch.float32)
    piece = zoo.Packed(input_ids=full.input_ids[20:45], cu_seqlens=torch.tensor([0, 20, 25], dtype=torch.int32),
                       position_ids=full.position_ids[20:45], max_seqlen=20, doc_len=full.doc_len_per_token()[20:45])
    piece_cos, piece_sin = rotary(piece, torch.float32)
    assert torch.equal(piece_cos, cos[20:45]) and torch.equal(piece_sin, sin[20:45])
    ref_cos, _ = upstream_cos_sin(TINY, 40, 40)
    torch.testing.assert_close(cos[:40], ref_cos, atol=1e-6, rtol=0)


def test_linear_rope_scaling_divides_positions():
    cfg = InternLM2Config(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=8, vocab_size=8,
                          rope_scaling={"type": "linear", "factor": 4.0})
    cos, _ = InternLM2Rotary(cfg)(zoo.pack([torch.zeros(12, dtype=torch.long)]), torch.float32)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2).float() / 16))
    expected = (torch.arange(12).float()[:, None] / 4.0) * inv_freq
    torch.testing.assert_close(cos, torch.cat((expected, expected), -1).cos())
