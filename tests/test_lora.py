"""zoo.lora on its own: what it wraps and freezes, the unmerged forward equal to the merged weights', PEFT's names."""

import pytest
import torch

import zoo
from zoo.lora import LoRAConfig, LoRALinear, adapter_state, apply_lora, lora_modules, merged_state


@pytest.mark.parametrize("rslora", [False, True])
def test_unmerged_forward_equals_merged_weights(rslora):
    torch.manual_seed(0)
    model = zoo.load("debug", attn="eager")
    cfg = LoRAConfig(rank=4, alpha=16, dropout=0.1, rslora=rslora, targets=("all-linear",))
    wrapped = apply_lora(model, cfg, seed=3)
    assert len(wrapped) == 7 * len(model.layers) and wrapped[0] == "layers.0.attn.q_proj"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{w}.lora_{x}.weight" for w in wrapped for x in "AB"}
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.02)  # B is zero at the start; give the update something to do
    assert model.layers[0].attn.q_proj.scale == (16 / 2 if rslora else 16 / 4)
    plain = zoo.load("debug", attn="eager", device="meta")
    plain.load_state_dict(merged_state(model.state_dict(), cfg.scale), assign=True)
    model.eval()  # dropout off, as PEFT's eval mode
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cu), plain(ids, cu), atol=1e-5, rtol=0)


def test_init_is_peft_s_and_the_same_for_a_seed():
    a, b = (zoo.load("debug", device="cpu") for _ in range(2))
    cfg = LoRAConfig(rank=8, targets=("q_proj", "v_proj"))
    apply_lora(a, cfg, seed=5)
    apply_lora(b, cfg, seed=5)
    qa, qb = a.layers[1].attn.q_proj, b.layers[1].attn.q_proj
    assert isinstance(qa, LoRALinear) and not isinstance(a.layers[1].attn.k_proj, LoRALinear)
    assert torch.equal(qa.lora_A.weight, qb.lora_A.weight) and not qa.lora_B.weight.any()
    bound = 1 / qa.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) = nn.Linear's default
    assert qa.lora_A.weight.abs().max() <= bound and qa.lora_A.weight.dtype == torch.float32
    names = adapter_state(a.state_dict(), {"layers.1.attn.q_proj.weight": "model.layers.1.self_attn.q_proj.weight",
                                           **{f"layers.{i}.attn.{p}.weight": f"m.{i}.{p}.weight"
                                              for i in range(len(a.layers)) for p in ("q_proj", "v_proj")
                                              if (i, p) != (1, "q_proj")}})
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names


def test_bad_lora_settings():
    with pytest.raises(zoo.ZooError, match="rank must be at least 1"):
        LoRAConfig(rank=0)
    with pytest.raises(zoo.ZooError, match="alpha must be"):
        LoRAConfig(rank=4, alpha=float("nan"))
    with pytest.raises(zoo.ZooError, match="lm_head: no such linear layer"):
        apply_lora(zoo.load("debug", device="meta"), LoRAConfig(rank=4, targets=("lm_head",)))


def test_adapter_names_follow_the_family_and_fused_tensors_get_none(tmp_path, capsys):
    """InternLM2's Hugging Face layout: wo and w1/w2/w3 are PEFT-addressable, q/k/v live in the fused wqkv."""
    import json
    from types import SimpleNamespace

    from recipes.export import export_adapter
    from zoo.models import FAMILIES
    from zoo.models.internlm2 import InternLM2Config

    config = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    for targets, out in ((("o_proj", "down_proj"), tmp_path / "ok"), (("q_proj",), tmp_path / "fused")):
        model = FAMILIES["internlm2"].model_cls(config, attn="eager")
        lora = LoRAConfig(rank=2, targets=targets)
        apply_lora(model, lora)
        with torch.device("meta"):
            plain = FAMILIES["internlm2"].model_cls(config, attn="eager")
        got = export_adapter(SimpleNamespace(out=str(out), model="m"), plain, model.state_dict(), lora)
        if targets == ("q_proj",):
            assert got is None and not (out / "adapter").exists()
            assert "fused tensor" in capsys.readouterr().out
            continue
        written = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert written["target_modules"] == ["w2", "wo"]
        from safetensors import safe_open

        with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as f:
            assert "base_model.model.model.layers.1.attention.wo.lora_B.weight" in set(f.keys())
