"""FP8 block-quantised Hugging Face checkpoints (DeepSeek-V3's float8_e4m3fn weights with `weight_scale_inv`),
dequantised as zoo.load and hf_to_zoo stream them:

- on synthetic tensors, zoo's dequantisation equals transformers' own (its `_dequantize_fp8_weight`, and its loader's
  Fp8Dequantize where the blocks divide the shape) and a plain loop over the blocks, bit for bit, shapes that are no
  multiple of the block included;
- a tiny GLM-4.5 checkpoint quantised that way loads with the weights and logits transformers gets from the same
  files, by zoo.load and through hf_to_zoo;
- other quantisations, and a quantised weight without its scale, are refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import random_docs

import zoo
from zoo.io.fp8 import dequantize

SHAPES = [(256, 384), (200, 300), (130, 129), (1, 7), (576, 1024)]  # DeepSeek-V3's kv_a_proj: 576 rows


def quantize(w_NK: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale_inv) of w, as DeepSeek-V3's checkpoints hold it: each block's amax / 448."""
    N, K = w_NK.shape
    bn, bk = block
    gN, gK = -(-N // bn), -(-K // bk)
    padded = torch.zeros(gN * bn, gK * bk)
    padded[:N, :K] = w_NK
    blocks = padded.view(gN, bn, gK, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    q = (blocks / scale[:, None, :, None]).view(gN * bn, gK * bk)[:N, :K].to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_equals_transformers(shape):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    torch.manual_seed(sum(shape))
    q, scale = quantize(torch.randn(shape) * torch.rand(1) * 3, (128, 128))
    ours = dequantize(q, scale, (128, 128), torch.float32)
    assert torch.equal(ours, _dequantize_fp8_weight(q, scale, [128, 128], torch.float32))
    loop = torch.empty(shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            loop[rows, cols] = q[rows, cols].float() * scale[i, j]
    assert torch.equal(ours, loop)
    if shape[0] % 128 == 0 and shape[1] % 128 == 0:  # its loader derives the block from the grid: whole blocks only
        theirs = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.bfloat16)
        assert torch.equal(dequantize(q, scale, (128, 128), torch.bfloat16), theirs)
    assert (ours - q.float()).abs().max() > 0  # the scales mattered


def _quantized_checkpoint(src: Path, dst: Path, block: list[int]) -> None:
    """`src`'s checkpoint with every projection weight fp8 block-quantised, as DeepSeek-V3 ships them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = quantize(t, (block[0], block[1]))
        else:
            tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block}
    (dst / "config.json").write_text(json.dumps(config))


def test_quantised_checkpoint_loads_as_transformers_loads_it(tmp_path):
    from test_glm4_moe import save_glm4_moe
    from transformers import Glm4MoeForCausalLM

    from convert import hf_to_zoo

    save_glm4_moe(tmp_path / "plain", seed=0)
    _quantized_checkpoint(tmp_path / "plain", tmp_path / "fp8", [32, 32])
    theirs = Glm4MoeForCausalLM.from_pretrained(tmp_path / "fp8", attn_implementation="eager",
                                                dtype=torch.float32).eval()
    ours = zoo.load(tmp_path / "fp8", attn="eager")
    assert ours.layers[0].attn.q_proj.weight.dtype == torch.float32  # the checkpoint's own dtype
    expected = theirs.state_dict()
    assert torch.equal(ours.layers[0].attn.q_proj.weight, expected["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(ours.layers[1].mlp.experts.down_proj, expected["model.layers.1.mlp.experts.down_proj"])
    docs = random_docs([11, 5])
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        logits = ours(packed)
        for i, doc in enumerate(docs):
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], theirs(doc[None]).logits[0], atol=1e-5, rtol=0)
    hf_to_zoo.main([str(tmp_path / "fp8"), str(tmp_path / "zoo"), "--quiet"])
    converted = zoo.load(tmp_path / "zoo", attn="eager")
    for (name, a), b in zip(ours.state_dict().items(), converted.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_what_cannot_be_dequantised_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file
    from test_glm4_moe import save_glm4_moe

    save_glm4_moe(tmp_path / "plain", seed=1)
    base = json.loads((tmp_path / "plain" / "config.json").read_text())
    for quant, words in [({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
                         ({"quant_method": "fp8"}, "weight_block_size must be two positive integers"),
                         ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt must be")]:
        (tmp_path / "plain" / "config.json").write_text(json.dumps({**base, "quantization_config": quant}))
        with pytest.raises(zoo.ZooError, match=words) as e:
            zoo.load(tmp_path / "plain")
        assert "\n" not in str(e.value)
    (tmp_path / "plain" / "config.json").write_text(json.dumps(base))
    _quantized_checkpoint(tmp_path / "plain", tmp_path / "fp8", [32, 32])
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(zoo.ZooError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight is torch\.float8_e4m3fn "
                                           r"without its model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv"):
        zoo.load(tmp_path / "fp8")
