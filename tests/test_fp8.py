"""zoo.train.fp8: torchao float8 training of the blocks' linears (not the head, not dims off 16), refused in one line
where it cannot run; the conversion itself checked on CPU, the training step on a GPU of capability >= 8.9."""

import pytest
import torch
from torch import nn

import zoo
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.train import fp8
from zoo.train.fp8 import convert_fp8, fp8_problem, is_fp8, require_fp8

torchao = pytest.importorskip("torchao", reason="fp8 training needs torchao")


def _model(dim=64, ffn=96, vocab=304, tie=False):
    torch.manual_seed(0)
    cfg = zoo.models.llama.LlamaConfig(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=ffn, vocab_size=vocab,
                                       tie_embeddings=tie)
    model = zoo.models.llama.Llama(cfg, attn="sdpa")
    init_weights(model)
    return model


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_conversion_leaves_head_and_odd_dims(recipe):
    model = _model(ffn=88)  # 88 is no multiple of 16: gate/up/down stay nn.Linear
    names = {n for n, _ in model.named_parameters()}
    done, plain = convert_fp8(model, recipe, check=False)
    converted = sorted(n for n, m in model.named_modules() if is_fp8(m))
    assert converted == sorted(f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkvo")
    assert (done, plain) == (8, 15)  # 2 x (4 attention + 3 MLP) + the head
    assert type(model.lm_head) is nn.Linear and type(model.layers[0].mlp.up_proj) is nn.Linear
    assert {n for n, _ in model.named_parameters()} == names  # checkpoints and optimizers see the same parameters


def test_refusals_in_one_line(monkeypatch):
    for recipe, device, dtype, want in (("tensorwise", "cpu", torch.bfloat16, "needs a CUDA GPU"),
                                        ("delayed", "cpu", torch.bfloat16, "--fp8 must be one of tensorwise, rowwise")):
        with pytest.raises(ZooError, match=want) as e:
            require_fp8(recipe, device, dtype)
        assert "\n" not in str(e.value)
    with pytest.raises(ZooError, match="needs a CUDA GPU"):
        convert_fp8(_model(), "tensorwise")  # checks by default: a CPU model is refused, nothing converted
    # a pretend GPU: capability and dtype decide
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    assert "compute capability >= 8.9" in fp8_problem("rowwise", "cuda", torch.bfloat16)
    assert "has 8.0" in fp8_problem("rowwise", "cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert "bf16" in fp8_problem("rowwise", "cuda", torch.float32)
    assert fp8_problem("rowwise", "cuda", torch.bfloat16) is None
    monkeypatch.setattr(fp8, "_float8", lambda: None)
    assert "needs torchao" in fp8_problem("tensorwise", "cuda", torch.bfloat16)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_converted_step_close_to_bf16_on_cpu(recipe):
    """torchao emulates the fp8 products on CPU: the converted model's loss within 1% of bf16's, the gradient of a
    converted weight within 15% (fp8 keeps 3 mantissa bits), the head's (left in bf16) within 5%."""
    ref = _model().to(torch.bfloat16)
    model = _model().to(torch.bfloat16)
    packed = zoo.pack([torch.randint(0, 304, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 7, 60)])
    convert_fp8(model, recipe, check=False)
    losses = []
    for m in (ref, model):
        loss = m.loss(packed)
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[1] - losses[0]) < 0.01 * losses[0], losses
    for name in ("layers.0.mlp.up_proj.weight", "layers.1.attn.q_proj.weight", "lm_head.weight"):
        g, g_ref = (dict(m.named_parameters())[name].grad.float() for m in (model, ref))
        err = float((g - g_ref).norm() / g_ref.norm())
        assert 0 < err < (0.05 if name == "lm_head.weight" else 0.15), (name, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 matmuls need a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_step_close_to_bf16(recipe):
    """One training step in fp8 (blocks compiled, as it runs for speed): the loss within 1% of bf16's and the
    gradients of the converted weights within 15% (fp8 has 3 mantissa bits)."""
    ref = _model(dim=256, ffn=512, vocab=1024).cuda().to(torch.bfloat16)
    model = _model(dim=256, ffn=512, vocab=1024).cuda().to(torch.bfloat16)
    packed = zoo.pack([torch.randint(0, 1024, (n,)) for n in (300, 17, 700)]).to("cuda")
    done, _ = convert_fp8(model, recipe)
    assert done == 14
    for block in model.layers:
        block.compile()
    losses = []
    for m in (ref, model):
        loss = m.loss(packed)
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[1] - losses[0]) < 0.01 * losses[0], losses
    g, g_ref = model.layers[0].mlp.up_proj.weight.grad.float(), ref.layers[0].mlp.up_proj.weight.grad.float()
    assert float((g - g_ref).norm() / g_ref.norm()) < 0.15
