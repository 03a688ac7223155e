"""Llama parity: one packed forward of mixed-length documents equals transformers on each document alone."""

import pytest
import torch

import zoo
from convert import hf_to_zoo
from zoo.models.family import rename
from zoo.models.llama import HF_NAMES

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, head_dim=24),
}
# 1-token documents, and equal-length neighbours (different documents: sdpa runs each such run as one batched
# call), one run of them 1-token documents
LENGTHS = [9, 1, 1, 23, 7, 7, 40]
CPU_BACKENDS = ["eager", "sdpa", "auto"]


def make_hf(tmp_path, name):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2, rms_norm_eps=1e-5,
              max_position_embeddings=128, attn_implementation="eager")
    kw.update(CONFIGS[name])
    config = transformers.LlamaConfig(**kw)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))  # random norm scales, so a misplaced norm shows
            else:
                p.normal_(0, 0.1)
    path = tmp_path / f"hf-{name}"
    hf.save_pretrained(path)
    return hf, path


def docs_for(vocab):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def hf_reference(hf, docs):
    """Logits of each document alone, and the token-weighted mean loss with its gradients."""
    hf.zero_grad()
    logits, total, count = [], 0.0, 0
    for d in docs:
        out = hf(d[None], labels=d[None])
        logits.append(out.logits[0].detach())
        n = d.numel() - 1
        if n:
            total = total + out.loss * n
            count += n
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    return logits, loss.detach(), grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_equals_hf_per_document(tmp_path, name):
    hf, path = make_hf(tmp_path, name)
    docs = docs_for(hf.config.vocab_size)
    ref_logits, ref_loss, ref_grads = hf_reference(hf, docs)
    packed = zoo.pack(docs)

    zoo_dir = tmp_path / "zoo"
    assert hf_to_zoo.main([str(path), str(zoo_dir), "--quiet"]) is None
    for src in (path, zoo_dir):
        model = zoo.load(src, attn="eager")
        for backend in CPU_BACKENDS + ["flex"]:
            model.set_attention(backend)
            with torch.no_grad():
                logits = model(packed)
            for i, ref in enumerate(ref_logits):
                s, e = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
                torch.testing.assert_close(logits[s:e], ref, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, w=f"{name} {src.name} {backend} doc {i}": f"{w}: {m}")
        for backend in CPU_BACKENDS:  # training backends: loss and every gradient
            model.set_attention(backend)
            model.zero_grad()
            loss = model.loss(packed)
            loss.backward()
            assert abs(loss.item() - ref_loss.item()) < 1e-5, (backend, loss.item(), ref_loss.item())
            params = dict(model.named_parameters())
            for zoo_name, p in params.items():
                hf_name = rename(zoo_name, HF_NAMES)
                torch.testing.assert_close(p.grad, ref_grads[hf_name], atol=1e-5, rtol=1e-4,
                                           msg=lambda m, w=f"{name} {backend} grad {zoo_name}": f"{w}: {m}")
            if hf.config.tie_word_embeddings:
                assert "lm_head.weight" not in params


def test_fixture_llama(tmp_path):
    """The sharded upstream fixture: goldens of transformers' LlamaForCausalLM, from one packed forward."""
    from conftest import assert_backend_gradients_agree, assert_matches_golden, converted_fixture

    src, zoo_dir, golden, docs = converted_fixture("llama", tmp_path)
    packed = zoo.pack(docs)
    for path in (src, zoo_dir):
        model = zoo.load(path)
        for backend in CPU_BACKENDS + ["flex"]:
            model.set_attention(backend)
            assert_matches_golden(model, packed, golden, docs, f"{path.name} {backend}")
        assert_backend_gradients_agree(model, packed, tuple(CPU_BACKENDS))


def test_chunked_loss_matches_plain_cross_entropy(monkeypatch):
    """The chunked head+loss equals F.cross_entropy on full logits, value and gradients, across chunk borders."""
    import zoo.core.loss

    monkeypatch.setattr(zoo.core.loss, "LOGITS_PER_CHUNK", {"cpu": 2048 * 7})
    monkeypatch.setattr(zoo.core.loss, "MIN_ROWS", 1)  # 7 rows a chunk
    model = zoo.load("debug", attn="sdpa")
    packed = zoo.pack([torch.randint(0, 2048, (n,)) for n in (20, 1, 13)])
    loss = model.loss(packed)
    loss.backward()
    g_chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = torch.nn.functional.cross_entropy(model(packed).float(), packed.labels, ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_chunked[n], p.grad, atol=1e-6, rtol=1e-4)
