"""zoo.train.lora on its own: what it wraps and freezes, the unmerged forward equal to the merged weights', PEFT's
names."""

import pytest
import torch
from conftest import FIXTURES

import zoo
from zoo.train.lora import LoRAConfig, LoRALinear, adapter_state, apply_lora, lora_modules, merged_state


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
    from zoo.models import FAMILIES

    plan = FAMILIES["llama"].plan_to_hf(a.config, list(zoo.load("debug", device="meta").state_dict()))
    names = adapter_state(a.state_dict(), plan)
    assert len(names) == 2 * 2 * len(a.layers)
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

    from recipes.engine.export import export_adapter
    from zoo.models import FAMILIES
    from zoo.models.internlm2 import InternLM2Config

    config = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    for targets, out in ((("o_proj", "down_proj"), tmp_path / "ok"), (("q_proj",), tmp_path / "fused")):
        model = FAMILIES["internlm2"].build(config, "eager")
        lora = LoRAConfig(rank=2, targets=targets)
        apply_lora(model, lora)
        with torch.device("meta"):
            plain = FAMILIES["internlm2"].build(config, "eager")
        got = export_adapter(out, "m", plain, model.state_dict(), lora)
        if targets == ("q_proj",):
            assert got is None and not (out / "adapter").exists()
            assert "fused tensor" in capsys.readouterr().out
            continue
        written = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert written["target_modules"] == ["w2", "wo"]
        from safetensors import safe_open

        with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as f:
            assert "base_model.model.model.layers.1.attention.wo.lora_B.weight" in set(f.keys())


def _hf_state(model) -> dict:
    """The Hugging Face layout of a zoo model's weights, by its family's conversion plan."""
    from zoo.models import FAMILIES

    state = model.state_dict()
    plan = FAMILIES[model.family].plan_to_hf(model.config, list(state))
    return {hf: (fn([state[s] for s in srcs]) if fn else state[srcs[0]]) for hf, (srcs, fn) in plan.items()}


def _hf_tree(state: dict) -> torch.nn.Module:
    """A module tree with the Hugging Face names and nn.Linear shapes of `state` (an HF-layout state dict), so PEFT
    can attach an adapter to it without any model code (InternLM2 and OpenELM are remote code upstream)."""
    root = torch.nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        node = root
        for part in path[:-1]:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        if leaf == "weight" and t.dim() == 2 and not hasattr(node, path[-1]):
            node.add_module(path[-1], torch.nn.Linear(t.shape[1], t.shape[0], bias=f"{name[:-7]}.bias" in state))
        elif t.dim() != 2 or leaf != "weight":
            if not hasattr(node, path[-1]):
                node.add_module(path[-1], torch.nn.Module())
            getattr(node, path[-1]).register_parameter(leaf, torch.nn.Parameter(t.clone()))
    root.load_state_dict(state)
    root.__dict__["prepare_inputs_for_generation"] = None  # PEFT's causal-LM wrapper reads it; merging never calls it
    return root


@pytest.mark.parametrize("family,targets,fused", [
    ("internlm2", ("all-linear",), {"wqkv", "wo", "w1", "w2", "w3"}),
    ("internlm2", ("wqkv", "w2"), {"wqkv", "w2"}),
    ("openelm", ("all-linear",), {"qkv_proj", "out_proj", "proj_1", "proj_2"}),
    ("openelm", ("gate_proj", "up_proj"), {"proj_1"}),
])
def test_fused_tensors_get_one_shared_a_and_peft_merges_the_adapter_to_our_weights(tmp_path, family, targets, fused):
    """Adapting every part of InternLM2's wqkv (OpenELM's qkv_proj, proj_1) is PEFT's adapter on the fused module:
    the parts share one A; the exported adapter, loaded by PEFT onto the Hugging Face layout of the base and merged
    by merge_and_unload, gives the Hugging Face layout of zoo's merged model."""
    import json

    peft = pytest.importorskip("peft")  # in the test extra; a GPU image may lack it

    from recipes.engine.export import export_adapter
    from zoo.train.lora import shared_a

    base = zoo.load(str(FIXTURES / family), attn="eager")
    model = zoo.load(str(FIXTURES / family), attn="eager")
    lora = LoRAConfig(rank=3, alpha=6, targets=targets)
    apply_lora(model, lora, seed=1)
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.05, generator=torch.Generator().manual_seed(7))
    a_from = shared_a(model)
    attn = model.layers[0].attn
    if "wqkv" in fused or "qkv_proj" in fused:
        assert attn.k_proj.a is attn.q_proj.lora_A and "lora_A" not in dict(attn.v_proj.named_children())
        assert a_from["layers.0.attn.v_proj"] == "layers.0.attn.q_proj"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".k_proj.lora_A" in n for n in trainable) or not fused & {"wqkv", "qkv_proj"}

    with torch.device("meta"):
        plain = type(model)(model.config, attn="eager")
    got = export_adapter(tmp_path, "m", plain, model.state_dict(), lora, a_from)
    assert got == tmp_path / "adapter"
    assert set(json.loads((got / "adapter_config.json").read_text())["target_modules"]) == fused

    merged = zoo.load(str(FIXTURES / family), attn="eager", device="meta")
    merged.load_state_dict(merged_state(model.state_dict(), lora.scale, a_from), assign=True)
    ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cu), merged(ids, cu), atol=1e-4, rtol=0)  # unmerged vs merged rounding

    tree = _hf_tree(_hf_state(base))
    peft_merged = peft.PeftModel.from_pretrained(tree, str(got)).merge_and_unload().state_dict()
    ours = _hf_state(merged)
    assert set(peft_merged) == set(ours)
    for name, t in ours.items():
        torch.testing.assert_close(peft_merged[name], t, atol=1e-6, rtol=0, msg=name)


def test_shared_a_gets_the_fused_modules_gradient():
    """The parts' shared A receives the gradient of PEFT's A on the fused wqkv: sum over the parts, by linearity."""
    from zoo.models.internlm2 import InternLM2, InternLM2Config, merge_wqkv

    config = InternLM2Config(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50)
    model = InternLM2(config, attn="eager")
    lora = LoRAConfig(rank=2, alpha=4, targets=("wqkv",))
    apply_lora(model, lora, seed=0)
    attn = model.layers[0].attn
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        torch.nn.init.normal_(m.lora_B.weight, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    g = torch.randn(5, (4 + 2 * 2) * 8, generator=torch.Generator().manual_seed(5))
    outs = [p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    y = merge_wqkv(*(o.t() for o in outs), cfg=config).t()
    (y * g).sum().backward()

    w = merge_wqkv(*(p.base.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj)), cfg=config)
    a = attn.q_proj.lora_A.weight.detach().clone().requires_grad_()
    b = merge_wqkv(*(p.lora_B.weight.detach() for p in (attn.q_proj, attn.k_proj, attn.v_proj)), cfg=config)
    b.requires_grad_()
    y_ref = x @ w.t() + (x @ a.t()) @ b.t() * lora.scale
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(attn.q_proj.lora_A.weight.grad, a.grad, atol=1e-5, rtol=1e-5)
    grads_b = merge_wqkv(*(p.lora_B.weight.grad for p in (attn.q_proj, attn.k_proj, attn.v_proj)), cfg=config)
    torch.testing.assert_close(grads_b, b.grad, atol=1e-5, rtol=1e-5)


def test_auto_targets_per_family():
    """auto: PEFT's q_proj,v_proj on Llama; the fused q/k/v tensor on InternLM2 and OpenELM (its parts share one A)."""
    from zoo.train.lora import shared_a

    llama = zoo.load("debug", device="cpu")
    assert {n.rsplit(".", 1)[-1] for n in apply_lora(llama, LoRAConfig(rank=2, targets=("auto",)))} == {"q_proj",
                                                                                                        "v_proj"}
    for family in ("internlm2", "openelm"):
        model = zoo.load(str(FIXTURES / family))
        wrapped = apply_lora(model, LoRAConfig(rank=2, targets=("auto",)))
        assert {n.rsplit(".", 1)[-1] for n in wrapped} == {"q_proj", "k_proj", "v_proj"}
        assert shared_a(model)["layers.0.attn.k_proj"] == "layers.0.attn.q_proj"
