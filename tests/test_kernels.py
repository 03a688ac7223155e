"""Kernel choice by capability (zoo.core.kernels): what is importable and what a signature takes, never a version
number.

The flash-attn and torch varlen kernels need CUDA, so here they are stood in for by fakes with the real
signatures that compute attention on CPU; the choice, the arguments passed and the result are checked.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import zoo
from zoo.core import kernels
from zoo.core.attention import BACKENDS, describe, eager


@pytest.fixture(autouse=True)
def _fresh_choice():
    kernels.varlen_kernel.cache_clear()
    kernels.lse_kernels.cache_clear()
    yield
    kernels.varlen_kernel.cache_clear()
    kernels.lse_kernels.cache_clear()


def _pack(lens):
    return zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])


def _inputs(lens, N=8, K=2, H=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(sum(lens), n, H, generator=g) for n in (N, K, K)]


def _reference(q, k, v, cu, scale):
    packed = zoo.as_packed(torch.zeros(q.shape[0], dtype=torch.long), cu)
    return eager(q, k, v, packed, scale)


def _fake_flash_module(monkeypatch, module: str, returns_lse: bool, calls: list):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        calls.append({"module": module, "causal": causal, "max": (max_seqlen_q, max_seqlen_k),
                      "same_cu": cu_seqlens_q is cu_seqlens_k, "scale": softmax_scale})
        out = _reference(q, k, v, cu_seqlens_q, softmax_scale)
        return (out, torch.zeros(q.shape[1], q.shape[0])) if returns_lse else out

    fake = types.ModuleType(module)
    fake.__dict__["flash_attn_varlen_func"] = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, module, fake)


@pytest.mark.parametrize("installed, chosen", [
    (["flash_attn"], "flash-attn 2"),
    (["flash_attn_interface", "flash_attn"], "flash-attn 3"),
    (["flash_attn.cute"], "flash-attn 4"),
])
def test_flash_attn_is_preferred_in_order_and_called_right(monkeypatch, installed, chosen):
    calls = []
    for module in ("flash_attn_interface", "flash_attn", "flash_attn.cute"):
        if module in installed:
            _fake_flash_module(monkeypatch, module, returns_lse=module != "flash_attn", calls=calls)
        else:
            monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    kernel = kernels.varlen_kernel()
    assert kernel.name.startswith(chosen) and kernel.gqa == "native"
    lens = [5, 1, 9]
    q, k, v = _inputs(lens)
    packed = _pack(lens)
    out = kernel.attend(q, k, v, packed.cu_seqlens, packed.max_seqlen, 0.3)
    torch.testing.assert_close(out, _reference(q, k, v, packed.cu_seqlens, 0.3))
    assert calls == [{"module": calls[0]["module"], "causal": True, "max": (9, 9), "same_cu": True, "scale": 0.3}]
    assert describe("cuda")["flash_varlen"].startswith(chosen)


def _no_flash_attn(monkeypatch):
    for module in ("flash_attn_interface", "flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, module, None)


def test_torch_varlen_with_enable_gqa_gets_it(monkeypatch):
    """torch 2.13's signature: GQA through enable_gqa, causal through window_size."""
    import torch.nn.attention.varlen as varlen

    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        seen.append((window_size, enable_gqa))
        if not enable_gqa and query.shape[1] != key.shape[1]:
            raise ValueError("Try setting enable_gqa=True for GQA.")
        return _reference(query, key, value, cu_seq_q, scale)

    _no_flash_attn(monkeypatch)
    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
    kernel = kernels.varlen_kernel()
    assert kernel.name == "torch.nn.attention.varlen.varlen_attn" and kernel.gqa == "native"
    lens = [3, 8]
    q, k, v = _inputs(lens)
    cu = _pack(lens).cu_seqlens
    torch.testing.assert_close(kernel.attend(q, k, v, cu, 8, None), _reference(q, k, v, cu, None))
    assert seen == [((-1, 0), True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA the GQA probe cannot run, which this checks")
def test_torch_varlen_without_enable_gqa(monkeypatch):
    """torch 2.10-2.12's signature has no enable_gqa: the flash kernel underneath takes fewer K/V heads."""
    import torch.nn.attention.varlen as varlen

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
        assert window_size == (-1, 0)
        return _reference(query, key, value, cu_seq_q, scale)

    _no_flash_attn(monkeypatch)
    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
    kernel = kernels.varlen_kernel()
    assert kernel.gqa == "native"
    lens = [6, 2]
    q, k, v = _inputs(lens)
    cu = _pack(lens).cu_seqlens
    torch.testing.assert_close(kernel.attend(q, k, v, cu, 6, None), _reference(q, k, v, cu, None))


def test_no_kernel_is_a_clear_error_and_auto_avoids_it(monkeypatch):
    import torch.nn.attention.varlen as varlen

    _no_flash_attn(monkeypatch)
    monkeypatch.delattr(varlen, "varlen_attn")  # as on a torch before torch.nn.attention.varlen
    assert kernels.varlen_kernel() is None
    assert describe("cuda")["flash_varlen"].startswith("unavailable")
    assert describe("cuda")["auto"] == "sdpa for bfloat16 on cuda"
    assert "flash_varlen" not in zoo.core.attention.available_backends("cuda")


def test_describe_names_what_runs_here():
    d = describe("cpu", torch.float32)
    assert set(d) == set(BACKENDS)
    assert d["auto"] == "sdpa for float32 on cpu" and d["flash_varlen"] == "needs a CUDA device"
    assert set(zoo.core.attention.available_backends("cpu")) == {"eager", "sdpa", "flex", "auto"}


def test_ring_lse_kernels_found_here_and_a_clear_error_without():
    """The ring's CUDA backward is torch's private flash backward, checked against the schema zoo calls."""
    import torch.nn.attention.varlen as varlen

    assert "aten::_flash_attention_backward" in kernels.lse_kernels().name  # torch 2.11-2.13 all have it
    kernels.lse_kernels.cache_clear()
    with pytest.MonkeyPatch.context() as m:
        m.delattr(varlen, "varlen_attn")
        assert kernels.lse_kernels() is None
        with pytest.raises(zoo.ZooError, match="torch 2.11-2.13"):
            kernels.require_lse_kernels()


# ---- zoo.core.internals: each torch internal's fallback, with its one warning line ----


@pytest.fixture
def internals_fresh(monkeypatch):
    from zoo.core import internals

    monkeypatch.setattr(internals, "_WARNED", set())
    return internals


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zoo.core.internals" and r.levelname == "WARNING"]


def test_run_eagerly_falls_back_to_torch_compiler_disable(internals_fresh, monkeypatch, caplog):
    monkeypatch.delattr(torch, "_disable_dynamo")
    seen = []
    monkeypatch.setattr(torch.compiler, "disable", lambda fn: seen.append(fn) or fn)
    fn = internals_fresh.run_eagerly(eager)
    internals_fresh.run_eagerly(eager)
    assert fn is eager and seen == [eager, eager]
    assert len(_warnings(caplog)) == 1 and "torch._disable_dynamo" in _warnings(caplog)[0]


def test_run_eagerly_uses_the_internal_where_it_is(internals_fresh, caplog):
    fn = internals_fresh.run_eagerly(eager)
    assert getattr(fn, "__wrapped__", None) is eager and not _warnings(caplog)


def test_mark_static_address_without_the_internal_marks_nothing_once_said(internals_fresh, monkeypatch, caplog):
    import torch._dynamo

    monkeypatch.delattr(torch._dynamo, "mark_static_address")
    t = torch.zeros(3)
    internals_fresh.mark_static_address(t)
    internals_fresh.mark_static_address(t)
    assert len(_warnings(caplog)) == 1 and "mark_static_address" in _warnings(caplog)[0]


def test_flash_backward_schema_change_sends_the_ring_to_math_with_a_warning(internals_fresh, monkeypatch, caplog):
    """A torch whose aten::_flash_attention_backward changed: no lse kernels, and the CUDA ring says in one warning
    line that its blocks run the dense fp32 math kernel (which it had logged at debug level only)."""
    from zoo.parallel import ring_kernels

    assert internals_fresh.flash_attention_backward() is not None  # torch 2.11-2.13 have it as zoo calls it
    monkeypatch.setattr(internals_fresh, "FLASH_BACKWARD_ARGS", ["grad_out", "renamed"])
    assert internals_fresh.flash_attention_backward() is None
    assert "not the layout zoo calls" in internals_fresh.flash_backward_problem()
    kernels.lse_kernels.cache_clear()
    try:
        assert kernels.lse_kernels() is None
        for _ in range(2):
            fwd, _bwd = ring_kernels.block_kernels(torch.device("cuda"), torch.bfloat16, None)
            assert fwd.keywords["kernel"] is ring_kernels.math_varlen_lse
    finally:
        kernels.lse_kernels.cache_clear()
    lines = _warnings(caplog)
    assert len(lines) == 1 and "fp32 math" in lines[0] and "not the layout zoo calls" in lines[0]


def test_cpu_flash_kernel_gone_sends_the_cpu_ring_to_math_with_a_warning(internals_fresh, monkeypatch, caplog):
    from zoo.parallel import ring_kernels

    fwd, _ = ring_kernels.block_kernels(torch.device("cpu"), torch.float32, None)
    assert fwd.keywords["kernel"] is ring_kernels.cpu_flash_lse and not _warnings(caplog)
    real_hasattr = hasattr  # torch.ops.aten resolves ops lazily: hide them from the module's hasattr

    def no_cpu_flash(obj, name):
        return False if name.startswith("_scaled_dot_product_flash_attention_for_cpu") else real_hasattr(obj, name)

    monkeypatch.setattr(internals_fresh, "hasattr", no_cpu_flash, raising=False)
    fwd, _ = ring_kernels.block_kernels(torch.device("cpu"), torch.float32, None)
    assert fwd.keywords["kernel"] is ring_kernels.math_varlen_lse
    lines = _warnings(caplog)
    assert len(lines) == 1 and "_scaled_dot_product_flash_attention_for_cpu" in lines[0]
