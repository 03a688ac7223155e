"""OpenELM parity: one packed forward equals the upstream remote code on each document (fixture goldens); the
layer-wise counts derive as upstream derives them; documents longer than max_context_length / rope_max_length and
unusual per-layer head layouts match an independent per-document reference."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend_gradients_agree, assert_matches_golden, converted_fixture, fixture_dir

import zoo
from zoo.models.openelm import OpenELM, OpenELMConfig, config_from_hf, per_layer_multipliers

BACKENDS = ["eager", "sdpa", "flex"]  # flex: forward only on CPU


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return converted_fixture("openelm", tmp_path_factory.mktemp("openelm"))


def test_fixture_logits_and_losses_from_one_packed_forward(fixture):
    src, zoo_dir, golden, docs = fixture
    packed = zoo.pack(docs)
    for path in (src, zoo_dir):
        model = zoo.load(path)
        assert model.config.n_heads == (4, 6, 6, 8) and model.config.n_kv_heads == (2, 3, 3, 4)
        assert model.config.ffn_dim == (64, 224, 352, 512) and model.lm_head is None
        for backend in BACKENDS:
            model.set_attention(backend)
            assert_matches_golden(model, packed, golden, docs, f"{path.name} {backend}")


def test_fixture_gradients_finite_and_equal_between_backends(fixture):
    src, _, _, docs = fixture
    model = zoo.load(src)
    packed = zoo.pack(docs)
    assert_backend_gradients_agree(model, packed)


# ---- layer-wise scaling: derived as upstream's OpenELMConfig derives it ----

# the per-layer lists of the published apple/OpenELM-1_1B config.json
OPENELM_1_1B = {
    "ffn_multipliers": [0.5, 0.63, 0.76, 0.89, 1.02, 1.15, 1.28, 1.41, 1.54, 1.67, 1.8, 1.93, 2.06, 2.19, 2.31, 2.44,
                        2.57, 2.7, 2.83, 2.96, 3.09, 3.22, 3.35, 3.48, 3.61, 3.74, 3.87, 4.0],
    "num_kv_heads": [4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 8, 8, 8, 8],
    "num_query_heads": [16, 16, 16, 20, 20, 20, 20, 20, 20, 20, 24, 24, 24, 24, 24, 24, 24, 24, 28, 28, 28, 28, 28,
                        28, 32, 32, 32, 32],
}


def test_published_per_layer_lists_are_derived():
    cfg = zoo.get_preset("openelm-1_1b").config
    assert list(cfg.ffn_multipliers) == OPENELM_1_1B["ffn_multipliers"]
    assert list(cfg.n_heads) == OPENELM_1_1B["num_query_heads"]
    assert list(cfg.n_kv_heads) == OPENELM_1_1B["num_kv_heads"]
    small = zoo.get_preset("openelm-270m").config  # the lists quoted in vllm issue 4549
    assert small.n_heads == (12,) * 5 + (16,) * 7 + (20,) * 4 and small.n_kv_heads == (3,) * 5 + (4,) * 7 + (5,) * 4


def test_published_config_json_reads_as_the_preset():
    """zoo.load(preset, checkpoint=...) compares configs: the hub config.json must read back as the preset."""
    published = {
        "activation_fn_name": "swish", "architectures": ["OpenELMForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "ffn_dim_divisor": 256, "ffn_with_glu": True, "head_dim": 64, "initializer_range": 0.02,
        "max_context_length": 2048, "model_dim": 2048, "model_type": "openelm", "normalization_layer_name": "rms_norm",
        "normalize_qk_projections": True, "num_gqa_groups": 4, "num_transformer_layers": 28,
        "qkv_multipliers": [0.5, 1.0], "rope_freq_constant": 10000, "rope_max_length": 4096,
        "share_input_output_layers": True, "torch_dtype": "float32", "use_cache": True, "vocab_size": 32000,
        **OPENELM_1_1B,
    }
    assert config_from_hf(published) == zoo.get_preset("openelm-1_1b").config


def test_linspace_rounding_matches_numpy():
    np = pytest.importorskip("numpy")
    for n in (1, 2, 3, 4, 16, 20, 28, 36, 37):
        for a, b in ((0.5, 4.0), (0.5, 1.0), (0.25, 3.3), (1.0, 1.0)):
            ref = tuple(float(round(v, 2)) for v in np.linspace(a, b, num=n, dtype=float))
            assert per_layer_multipliers((a, b), n) == ref, (n, a, b)


def test_config_lists_that_disagree_with_the_multipliers_are_refused(tmp_path):
    hf = json.loads((fixture_dir("openelm") / "config.json").read_text())
    assert config_from_hf(hf).n_heads == tuple(hf["num_query_heads"])
    hf["num_kv_heads"] = [2, 2, 3, 4]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(zoo.ZooError, match=r"num_kv_heads=\[2, 2, 3, 4\].*derive \[2, 3, 3, 4\]"):
        zoo.load(tmp_path, device="meta")


# ---- long documents and per-layer head layouts, against an independent per-document reference ----

def reference_logits(model: OpenELM, ids: torch.Tensor) -> torch.Tensor:
    """OpenELM on one document written out plainly: full causal softmax attention, KV heads repeated per query
    group, RoPE from scratch at positions 0..L-1 (what upstream computes at any length it runs)."""
    cfg, w = model.config, dict(model.state_dict())
    assert isinstance(cfg, OpenELMConfig)
    L, H = len(ids), cfg.head_dim

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    angle = torch.arange(L, dtype=torch.float64)[:, None] / (cfg.rope_theta ** (torch.arange(0, H, 2) / H))
    angle = torch.cat([angle, angle], -1)[:, None]  # [L, 1, H], broadcast over heads
    cos, sin = angle.cos().float(), angle.sin().float()

    def rope(x):
        return x * cos + torch.cat([-x[..., H // 2:], x[..., : H // 2]], -1) * sin

    causal = torch.ones(L, L, dtype=torch.bool).tril()
    x = w["embed.weight"][ids]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope(rms((h @ w[p + "attn.q_proj.weight"].T).view(L, -1, H), w[p + "attn.q_norm.weight"]))
        k = rope(rms((h @ w[p + "attn.k_proj.weight"].T).view(L, -1, H), w[p + "attn.k_norm.weight"]))
        v = (h @ w[p + "attn.v_proj.weight"].T).view(L, -1, H)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qnh,knh->nqk", q, k) / math.sqrt(H)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("nqk,knh->qnh", attn, v).reshape(L, -1) @ w[p + "attn.o_proj.weight"].T
        h = rms(x, w[p + "mlp_norm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"]) @ w["embed.weight"].T


LAYOUTS = {
    # derived like the fixture (q 4/6/6/8, kv 2/3/3/4); tiny context limits so documents run past both
    "derived": {"n_layers": 4, "qkv_multipliers": (0.5, 1.0), "num_gqa_groups": 2, "ffn_multipliers": (0.5, 4.0),
                "ffn_dim_divisor": 32},
    # layer 0: KV heads == query heads; layer 1: 3 KV heads, which divide neither 4 nor 2; layer 2: 4 per KV head
    "explicit": {"n_layers": 3, "qkv_multipliers": (), "n_heads": (4, 6, 8), "n_kv_heads": (4, 3, 2),
                 "ffn_multipliers": (), "ffn_dim": (96, 160, 64)},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_long_documents_and_head_layouts_match_reference(layout):
    cfg = OpenELMConfig(dim=128, head_dim=16, vocab_size=256, max_context_length=8, rope_max_length=12,
                        **LAYOUTS[layout])
    torch.manual_seed(4)
    model = OpenELM(cfg, attn="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    # 20 > rope_max_length > max_context_length; 13 between them (twice: equal-length neighbours, which sdpa batches);
    # 5 inside both
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(100 * i + n))
            for i, n in enumerate((20, 5, 13, 13))]
    packed = zoo.pack(docs)
    refs = [reference_logits(model, d) for d in docs]
    for backend in ("eager", "sdpa"):
        model.set_attention(backend)
        with torch.no_grad():
            logits = model(packed)
        for i, ref in enumerate(refs):
            s, e = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
            torch.testing.assert_close(logits[s:e], ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, i=i, b=backend: f"{layout} {b} doc {i}: {m}")
    if layout == "explicit":  # upstream re-derives heads from multipliers, so this layout has no HF form
        with pytest.raises(zoo.ZooError, match="cannot be written as a Hugging Face OpenELM checkpoint"):
            zoo.models.openelm.config_to_hf(cfg)
