"""The fused head + cross-entropy (zoo.core.loss) in low precision against an fp32 reference, on CPU and on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo.core.loss import linear_cross_entropy


def _problem(T, D, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, D, device=device, generator=g)
    w = torch.randn(V, D, device=device, generator=g) * D**-0.5
    labels = torch.randint(0, V, (T,), device=device, generator=g)
    labels[::7] = -100  # positions without a target are skipped
    return h, w, labels


def _reference(h, w, labels):
    """fp32 logits of the (already rounded) low-precision inputs, plain cross-entropy, autograd gradients."""
    h32, w32 = (t.detach().float().requires_grad_() for t in (h, w))
    loss = F.cross_entropy(F.linear(h32, w32), labels, ignore_index=-100)
    return (loss.detach(), *torch.autograd.grad(loss, (h32, w32)))


def _rel(got, want):
    return float((got.float() - want).norm() / want.norm())


def _check(h, w, labels, loss_tol, grad_tol):
    want_loss, want_gh, want_gw = _reference(h, w, labels)
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy(h, w, labels)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    assert abs(loss.item() - want_loss.item()) < loss_tol, (loss.item(), want_loss.item())
    assert _rel(gh, want_gh) < grad_tol and _rel(gw, want_gw) < grad_tol, (_rel(gh, want_gh), _rel(gw, want_gw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_on_cpu_against_fp32(dtype, monkeypatch):
    """CPU keeps logits and the weight gradient's sum in fp32; gradients are rounded to the dtype once."""
    import zoo.core.loss

    monkeypatch.setattr(zoo.core.loss, "LOGITS_PER_CHUNK", {"cpu": 500 * 40})  # 40 rows a chunk: several chunks
    monkeypatch.setattr(zoo.core.loss, "MIN_ROWS", 1)
    h, w, labels = (t.to(dtype) if t.is_floating_point() else t for t in _problem(200, 64, 500, "cpu"))
    _check(h, w, labels, loss_tol=1e-5, grad_tol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_softmax_gradient_equals_the_eager_one(dtype, monkeypatch):
    """COMPILED_SOFTMAX: each chunk's loss and softmax gradient from one compiled function (inductor), the same
    numbers as the eager in-place ops, over several chunks with rows that have no target."""
    import zoo.core.loss

    monkeypatch.setattr(zoo.core.loss, "LOGITS_PER_CHUNK", {"cpu": 500 * 40, "cuda": 500 * 40})
    monkeypatch.setattr(zoo.core.loss, "MIN_ROWS", 1)
    h, w, labels = (t.to(dtype) if t.is_floating_point() else t for t in _problem(200, 64, 500, "cpu"))
    results = []
    for compiled in (False, True):
        monkeypatch.setattr(zoo.core.loss, "COMPILED_SOFTMAX", compiled)
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = linear_cross_entropy(hh, ww, labels)
        results.append((loss.detach(), *torch.autograd.grad(loss, (hh, ww))))
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 8e-3}  # bf16: an ulp
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, **tol)
    _check(h, w, labels, loss_tol=1e-5, grad_tol=1e-2)  # and still the reference's, with the flag on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softmax", ["eager", "compiled", "triton"])
def test_low_precision_on_cuda_against_fp32(dtype, softmax, monkeypatch):
    """On CUDA the GEMMs take bf16/fp16 operands (no fp32 copies); logits and the weight gradient's sum over
    chunks stay fp32 where the GEMM can write fp32. The loss is that of the rounded inputs within 1e-5, with each
    chunk's softmax gradient from eager ops, compiled, or zoo's Triton kernel."""
    import zoo.core.loss

    monkeypatch.setattr(zoo.core.loss, "COMPILED_SOFTMAX", softmax == "compiled")
    monkeypatch.setattr(zoo.core.loss, "TRITON_SOFTMAX", True if softmax == "triton" else False)
    h, w, labels = (t.to(dtype) if t.is_floating_point() else t for t in _problem(4096, 1024, 32000, "cuda"))
    _check(h, w, labels, loss_tol=1e-5, grad_tol=1e-2)


def test_fp64_stays_fp64():
    """An fp64 model gets an fp64 loss and gradients (a reference run), not an fp32 head."""
    h, w, labels = (t.double() if t.is_floating_point() else t for t in _problem(60, 16, 40, "cpu"))
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy(h, w, labels)
    want = F.cross_entropy(F.linear(h, w), labels, ignore_index=-100)
    assert loss.dtype == torch.float64 and abs(loss.item() - want.item()) < 1e-12
    for got, ref in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
