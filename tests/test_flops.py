"""zoo.train.flops: exact counts against hand computations, and the matrix products torch actually runs."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zoo
from zoo.core.layers import init_weights
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llama import Llama, LlamaConfig
from zoo.models.llava import Llava, LlavaConfig
from zoo.models.openelm import OpenELM, OpenELMConfig
from zoo.train.flops import attention_flops, forward_flops, matmul_params, step_flops

LLAMA = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100)
# OpenELM with its per-layer head counts and FFN widths given directly: 2/1 heads of 16 then 4/2, FFN 64 then 128
OPENELM = OpenELMConfig(dim=64, n_layers=2, head_dim=16, vocab_size=100, qkv_multipliers=(), ffn_multipliers=(),
                        n_heads=(2, 4), n_kv_heads=(1, 2), ffn_dim=(64, 128))


def on_meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


def test_llama_by_hand():
    model = on_meta(Llama, LLAMA)
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; gate, up, down 3 x 64x96 = 18432 -> 30720
    # two layers 61440, head 100x64 = 6400
    assert matmul_params(model) == 67840
    # documents of 3 and 5 tokens: T = 8; causal pairs 3*4/2 + 5*6/2 = 21; per layer 2 matmuls x 2 x 4 heads x 16
    linear, attn = 2 * 67840 * 8, 2 * (2 * 2 * 4 * 16 * 21)
    assert (linear, attn) == (1085440, 10752)
    assert forward_flops(model, [3, 5]) == 1096192
    assert step_flops(model, [3, 5]) == 3 * 1096192 == 3288576
    # packing is what makes it cheaper than one 8-token document: only the attention part changes
    assert step_flops(model, [8]) - step_flops(model, [3, 5]) == 3 * 2 * (2 * 2 * 4 * 16 * (36 - 21))


def test_tied_head_counted_once():
    tied = on_meta(Llama, LlamaConfig(**{**LLAMA.__dict__, "tie_embeddings": True}))
    assert tied.lm_head is None
    assert matmul_params(tied) == matmul_params(on_meta(Llama, LLAMA)) == 67840


def test_openelm_per_layer_by_hand():
    model = on_meta(OpenELM, OPENELM)
    # layer 0: q 64x32 + k 64x16 + v 64x16 + o 32x64 = 6144, SwiGLU 3 x 64x64 = 12288
    # layer 1: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288, SwiGLU 3 x 64x128 = 24576; tied head 100x64 = 6400
    assert matmul_params(model) == 18432 + 36864 + 6400 == 61696
    # documents 4, 2, 7: T = 13, causal pairs 10 + 3 + 28 = 41; 2 heads in layer 0, 4 in layer 1, head dim 16
    linear = 2 * 61696 * 13
    attn = 2 * 2 * 2 * 16 * 41 + 2 * 2 * 4 * 16 * 41
    assert (linear, attn) == (1604096, 15744)
    assert forward_flops(model, [4, 2, 7]) == 1619840
    assert step_flops(model, [4, 2, 7]) == 4859520


@pytest.mark.parametrize("cls, cfg", [(Llama, LLAMA), (OpenELM, OPENELM)], ids=["llama", "openelm"])
def test_counts_match_what_torch_runs(cls, cfg):
    """torch's FlopCounterMode on a real forward + backward: its nn.Linear products (aten.mm) are 6 x matmul
    parameters x tokens, and the eager backend's attention products (aten.bmm, the full L x L square: eager
    masks after multiplying) are 3 x the non-causal attention count of every layer's own head count."""
    model = cls(cfg, attn="eager")
    init_weights(model)
    lens = [4, 2, 7]
    packed = zoo.pack([torch.randint(0, cfg.vocab_size, (n,)) for n in lens])
    counter = FlopCounterMode(display=False)
    with counter:
        model(packed).sum().backward()
    ran = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert ran["aten.mm"] == 6 * matmul_params(model) * sum(lens)
    heads = [layer.attn.q_proj.out_features // cfg.head_dim for layer in model.layers]
    assert heads == ([4, 4] if cfg is LLAMA else [2, 4])
    assert ran["aten.bmm"] == 3 * sum(attention_flops(lens, n, cfg.head_dim, causal=False) for n in heads)
    assert set(ran) == {"aten.mm", "aten.bmm"}


def test_attention_flops_causal_and_full():
    assert attention_flops([1], 1, 1) == 4  # one token attends to itself
    assert attention_flops([3, 5], 8, 128) == 4 * 8 * 128 * (6 + 15)
    assert attention_flops([3, 5], 8, 128, causal=False) == 4 * 8 * 128 * (9 + 25)


def test_llava_tower_projector_and_frozen_parts():
    vision = CLIPVisionConfig(dim=32, n_layers=3, n_heads=4, ffn_dim=64, image_size=28, patch_size=14)
    model = on_meta(Llava, LlavaConfig(vision=vision, language=LLAMA, image_token_id=99))
    lens, images = [3, 5], 2
    # per image: 4 patches + class token = 5 positions; feature_layer -2 runs 2 of the 3 blocks
    conv = 2 * 4 * (3 * 14 * 14) * 32  # 150528
    blocks = 2 * 5 * 2 * (4 * 32 * 32 + 2 * 32 * 64)  # 163840
    tower_attn = 2 * (2 * 2 * 4 * 8 * 5 * 5)  # 6400: full attention, 4 heads of 8
    projector = 2 * 4 * (32 * 64 + 64 * 64)  # 49152: 4 image tokens (class token dropped)
    lm_linear, lm_attn = 1085440, 10752  # as in test_llama_by_hand
    tower, proj = images * (conv + blocks), images * projector
    assert forward_flops(model, lens, images) == tower + images * tower_attn + proj + lm_linear + lm_attn == 1836032
    # everything trains: 3 x forward
    assert step_flops(model, lens, images) == 3 * 1836032
    # stage 2: frozen tower runs forward only; projector and language model 3 x
    model.freeze(vision=True, projector=False, language=False)
    assert step_flops(model, lens, images) == tower + images * tower_attn + 3 * proj + 3 * (lm_linear + lm_attn)
    # stage 1: only the projector trains; the language model passes gradients down but computes no weight grads
    model.freeze(language=True)
    assert step_flops(model, lens, images) == (tower + images * tower_attn + 3 * proj + 2 * lm_linear
                                               + 3 * lm_attn) == 3139584


def test_refuses_what_it_cannot_count():
    with pytest.raises(zoo.ZooError, match="counted for zoo models .*not a Linear"):
        step_flops(torch.nn.Linear(2, 2), [4])
    with pytest.raises(zoo.ZooError, match="no vision tower"):
        step_flops(on_meta(Llama, LLAMA), [4], n_images=1)


def test_qwen2_5_vl_tower_counts_what_torch_runs():
    """Qwen2.5-VL's encoder_flops for images of different grids (windows cut short at the edges, a full-attention
    block among window blocks) equal torch's count of the tower's real forward with the eager backend: its
    nn.Linear products (aten.mm, aten.addmm) and its attention (aten.bmm, each window's or frame's square)."""
    import _tiny_qwen_vl as tiny

    from zoo.models import qwen2_5_vl

    model = qwen2_5_vl.QwenVL(qwen2_5_vl.config_from_hf(tiny.hf_config().to_dict()), attn="eager")
    init_weights(model)
    grids = [[1, 4, 6], [1, 10, 8], [1, 2, 2]]
    pixels = torch.cat([tiny.pixels(g[1:], i) for i, g in enumerate(grids)])
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.vision(pixels, torch.tensor(grids))
    ran = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    (tower, tower_attn, _), (merger, merger_attn, module) = model.encoder_flops(3, grids)
    assert module is model.vision.merger and merger_attn == 0
    assert ran["aten.mm"] + ran["aten.addmm"] == tower + merger
    assert ran["aten.bmm"] == tower_attn
    # every image pays for its own size: the sum of the images alone
    alone = [sum(a + b for a, b, _ in model.encoder_flops(1, [g])) for g in grids]
    assert forward_flops(model, [40], 3, grids) - forward_flops(model, [40]) == sum(alone)
    with pytest.raises(zoo.ZooError, match=r"3 image\(s\) need their 3 \(t, h, w\) grids"):
        step_flops(model, [40], 3)


def test_qwen3_vl_tower_counts_what_torch_runs():
    """Qwen3-VL's tower (no windows, a learned position table, DeepStack mergers) likewise: encoder_flops equal
    torch's count of its real forward, the DeepStack mergers' products an entry of their own."""
    import _tiny_qwen3_vl as tiny

    from zoo.models import qwen3_vl

    hf = {"model_type": "qwen3_vl", "text_config": tiny.TEXT["qwen3_vl"],
          "vision_config": {**tiny.VISION, "deepstack_visual_indexes": [0, 2]}}
    model = qwen3_vl.build(qwen3_vl.config_from_hf(hf), "eager")
    init_weights(model)
    grids = [[1, 4, 6], [1, 10, 8]]
    pixels = torch.cat([tiny.pixels(g[1:], i) for i, g in enumerate(grids)])
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.vision(pixels, torch.tensor(grids))
    ran = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    (tower, tower_attn, _), (merger, _, _), (deepstack, _, module) = model.encoder_flops(2, grids)
    assert module is model.vision.deepstack and deepstack == 2 * merger
    assert ran.get("aten.mm", 0) + ran["aten.addmm"] == tower + merger + deepstack  # every product has a bias
    assert ran["aten.bmm"] == tower_attn
