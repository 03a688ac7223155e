"""InternLM2 / OpenELM converters: hf -> zoo -> hf is bit-exact (fused wqkv, qkv_proj, proj_1 split and merged
back), the output carries upstream's config keys (auto_map included) and the tokenizer files."""

import json
import shutil

import pytest
import torch
from conftest import fixture_dir

import zoo
from convert import hf_to_zoo, zoo_to_hf
from zoo.io.safetensors import SafetensorsDir
from zoo.models.internlm2 import InternLM2, InternLM2Config

TOKENIZER = {"tokenizer.model": "spm", "tokenizer_config.json": "{}"}


def tensors_of(path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(path)
    return {n: reader.get(n) for n in reader.names()}


@pytest.mark.parametrize("name", ["internlm2", "openelm"])
def test_fixture_round_trip_is_bit_exact(tmp_path, name):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(name), src, ignore=shutil.ignore_patterns("golden.safetensors", "README.md"))
    for fname, text in TOKENIZER.items():
        (src / fname).write_text(text)
    assert hf_to_zoo.main([str(src), str(tmp_path / "zoo"), "--quiet"]) is None
    zoo_tensors = tensors_of(tmp_path / "zoo")
    assert not any(fused in n for n in zoo_tensors for fused in ("wqkv", "qkv_proj", "proj_1")), "fused weights split"
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet", "--shard-size", "0.0002"]) is None

    a, b = tensors_of(src), tensors_of(tmp_path / "hf")
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # several shards, merged per tensor

    original = json.loads((src / "config.json").read_text())
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original.pop("transformers_version")
    assert written == original  # every key upstream's config class reads, auto_map included, same values
    for fname, text in TOKENIZER.items():
        assert (tmp_path / "zoo" / fname).read_text() == text and (tmp_path / "hf" / fname).read_text() == text


def test_internlm2_bias_is_split_and_merged(tmp_path):
    """`bias: true` checkpoints carry a fused wqkv.bias, grouped per KV head like the weight."""
    cfg = InternLM2Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64,
                          attention_bias=True)
    torch.manual_seed(5)
    model = InternLM2(cfg, attn="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    zoo.save(model, tmp_path / "zoo")
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"]) is None
    hf = tensors_of(tmp_path / "hf")
    assert hf["model.layers.1.attention.wqkv.bias"].shape == (4 * 8 + 2 * 2 * 8,)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bias"] is True
    # group 0 of the fused bias: query heads 0 and 1, then key head 0, then value head 0
    wqkv_bias = hf["model.layers.1.attention.wqkv.bias"]
    attn = model.layers[1].attn
    torch.testing.assert_close(wqkv_bias[:16], attn.q_proj.bias[:16], rtol=0, atol=0)
    torch.testing.assert_close(wqkv_bias[16:24], attn.k_proj.bias[:8], rtol=0, atol=0)
    torch.testing.assert_close(wqkv_bias[24:32], attn.v_proj.bias[:8], rtol=0, atol=0)

    back = zoo.load(tmp_path / "hf", attn="eager")
    for n, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[n], t), n
    packed = zoo.pack([torch.arange(9), torch.arange(5)])
    with torch.no_grad():
        assert torch.equal(back(packed), model(packed))
