"""Score modifiers (zoo.core.score_mods): attention sinks and soft-capping on every backend, packed per document
with sliding windows, in generation's KV cache, against a plain float64 reference written here.

The sequence-parallel side (Ulysses, ring, hybrid at 2 and 4 ranks with sinks + softcap + window) runs in
tests/_sp_worker.py's spawn (the `mods-*` and `sinks-ring` cases of tests/test_parallel.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.core.attention import BACKENDS, _varlen, describe
from zoo.core.kernels import LseKernels, VarlenKernel
from zoo.generate import generate
from zoo.parallel import ring_kernels as R

sys.path.insert(0, str(Path(__file__).parent))
from _sp_worker import modded  # noqa: E402

LENS = [9, 1, 6, 6, 13]  # equal-length neighbours (sdpa batches them), a 1-token document, windows that cut
N, K, H = 4, 2, 8
MODS = {"sinks": dict(sinks=True), "softcap": dict(softcap=0.7), "both": dict(sinks=True, softcap=0.7)}


def reference(q, k, v, lens, scale, window, sinks, softcap):
    """softmax(cap(q k^T * scale) + mask, sink) v per document in float64, the sink as one more column."""
    outs = []
    for q_, k_, v_ in zip(q.double().split(lens), k.double().split(lens), v.double().split(lens)):
        L = q_.shape[0]
        k_, v_ = (t.repeat_interleave(N // K, dim=1) for t in (k_, v_))
        s = torch.einsum("qnh,knh->nqk", q_, k_) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(L)[:, None], torch.arange(L)[None]
        allowed = (j <= i) & ((i - j < window) if window is not None else True)
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(N, L, 1)], dim=-1)
        p = s.softmax(-1)[..., :L]
        outs.append(torch.einsum("nqk,knh->qnh", p, v_))
    return torch.cat(outs)


def _inputs(seed, mods):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    q, k, v = (torch.randn(T, n, H, generator=g) * 2 for n in (N, K, K))  # scores past the cap: it binds
    sinks = torch.randn(N, generator=g) if mods.get("sinks") else None
    return q, k, v, sinks, mods.get("softcap")


def _stand_in_varlen(softcap_in_kernel: bool) -> tuple[VarlenKernel, LseKernels]:
    """flash_varlen's kernels on CPU: a 'kernel' that is eager per document (with a softcap where it claims one),
    and the ring's CPU flash kernels with lse as the lse pair sinks go through."""
    def attend(q, k, v, cu, max_len, scale, window=None, softcap=None):
        assert softcap is None or softcap_in_kernel, "a softcap reached a kernel that takes none"
        packed = zoo.pack([torch.zeros(int(n), dtype=torch.long) for n in (cu[1:] - cu[:-1]).tolist()])
        return BACKENDS["eager"](q, k, v, packed, scale, window, **({} if softcap is None else {"softcap": softcap}))

    kernel = VarlenKernel("stand-in", "native", attend, window=True, softcap=softcap_in_kernel)
    return kernel, LseKernels("cpu flash", R.cpu_flash_lse, R.cpu_flash_lse_backward, window=True)


def _run(backend, q, k, v, packed, scale, window, sinks, softcap):
    options = {"window": window} | ({} if sinks is None else {"sinks": sinks}) | \
        ({} if softcap is None else {"softcap": softcap})
    if backend.startswith("flash_varlen"):
        kernel, lse = _stand_in_varlen(backend.endswith("capped"))
        return _varlen(kernel, q, k, v, packed, scale, lse=lse, **options)
    return BACKENDS[backend](q, k, v, packed, scale, **options)


def _on_flex(backend, mods):
    """flash_varlen runs on flex what its kernels cannot: a softcap the kernel lacks, sinks with a softcap."""
    capped = "softcap" in MODS[mods]
    return backend.startswith("flash_varlen") and capped and (mods == "both" or not backend.endswith("capped"))


# every backend x modifier x window, except the flex-bound flash_varlen cases without a window: those compile flex
# once more for nothing new (test_flex_equals_reference covers flex itself)
CASES = [(b, w, m) for b in ("eager", "sdpa", "auto", "flash_varlen", "flash_varlen-capped") for w in (None, 4)
         for m in MODS if w is not None or not _on_flex(b, m)]


@pytest.mark.parametrize("backend, window, mods", CASES)
def test_backend_equals_reference_with_gradients(backend, window, mods):
    q, k, v, sinks, softcap = _inputs(0, MODS[mods])
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in LENS])
    on_flex = _on_flex(backend, mods)  # flex has no CPU backward: those paths are checked forward only here
    leaves = [t.requires_grad_(not on_flex) for t in (q, k, v) + (() if sinks is None else (sinks,))]
    out = _run(backend, q, k, v, packed, 0.3, window, sinks, softcap)
    ref = reference(q, k, v, LENS, 0.3, window, sinks, softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if on_flex:
        return
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad.float())
    want = torch.autograd.grad(ref, leaves, grad)
    for name, a, b in zip("qkvs", got, want):
        assert (a.double() - b).abs().max() < 1e-4, f"d{name}: {(a.double() - b).abs().max()}"


@pytest.mark.parametrize("mods", ["softcap", "both"])  # compiled flex (score_mod), uncompiled flex (lse, CPU)
def test_flex_equals_reference(mods):
    q, k, v, sinks, softcap = _inputs(2, MODS[mods])
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in LENS])
    with torch.no_grad():
        out = BACKENDS["flex"](q, k, v, packed, 0.3, 4, **({} if sinks is None else {"sinks": sinks}),
                               softcap=softcap)
    torch.testing.assert_close(out.double(), reference(q, k, v, LENS, 0.3, 4, sinks, softcap), atol=1e-5,
                               rtol=1e-5)


def test_ring_block_kernels_with_softcap_and_sinks_merge_to_reference():
    """The ring's pieces in one process: blocks of a pack attended with the capped math kernel, merged by lse, the
    sink applied once after the merge, equal the reference; the capped backward equals autograd's."""
    from zoo.core.score_mods import sink_lse
    from zoo.parallel.ring_blocks import BlockMeta

    q, k, v, sinks, softcap = _inputs(3, MODS["both"])
    doc = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    index = torch.arange(sum(LENS))
    halves = [index[: len(index) // 2], index[len(index) // 2 :]]
    metas = [BlockMeta(ix, doc[ix]) for ix in halves]
    fwd, bwd = R.block_kernels(q.device, q.dtype, None, 4, softcap)
    T = len(index)
    o, lse = torch.zeros(T, N, H), torch.full((N, T), float("-inf"))
    for b, meta in enumerate(metas):
        o_b, lse_b = fwd(q, k[halves[b]], v[halves[b]], BlockMeta(index, doc), meta, 0.3, False, window=4)
        o, lse = R.merge(o, lse, o_b, lse_b)
    o, lse = sink_lse(o, lse, sinks)
    torch.testing.assert_close(o.double(), reference(q, k, v, LENS, 0.3, 4, sinks, softcap), atol=1e-5, rtol=1e-5)
    do = torch.randn(T, N, H)
    delta = (do * o).sum(-1).T
    dq, dk, dv = bwd(q, k, v, o, lse, do, delta, BlockMeta(index, doc), BlockMeta(index, doc), 0.3, True, window=4)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, LENS, 0.3, 4, sinks, softcap), leaves, do.double())
    for a, b in zip((dq, dk, dv), want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_bad_options_are_refused():
    q, k, v, _, _ = _inputs(0, {})
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in LENS])
    with pytest.raises(zoo.ZooError, match=r"one logit per query head, shape \(4,\); got \(2,\)"):
        BACKENDS["eager"](q, k, v, packed, sinks=torch.zeros(2))
    with pytest.raises(zoo.ZooError, match="positive finite number"):
        BACKENDS["sdpa"](q, k, v, packed, softcap=0.0)


def test_describe_names_the_paths():
    d = describe("cpu", torch.float32)
    assert "sinks or a softcap runs eager" in d["sdpa"] and "softcap as score_mod" in d["flex"]


def test_model_packed_equals_alone_and_cached_decode_equals_uncached():
    """A tiny decoder with sinks, a binding softcap and a window of 7: packed = each document alone on every CPU
    backend, and greedy generation with the KV cache (eager prefill, dense decode, fused decode) = the argmax of
    uncached forwards."""
    model = modded()
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 128, (n,), generator=g) for n in (11, 3, 9)]
    packed = zoo.pack(docs)
    for backend in ("eager", "sdpa", "flex"):
        model.set_attention(backend)
        with torch.no_grad():
            alone = torch.cat([model(zoo.pack([d])) for d in docs])
            torch.testing.assert_close(model(packed), alone, atol=1e-4, rtol=1e-4, msg=backend)
    model.set_attention("sdpa")
    want = []
    for prompt in docs[:2]:
        seq = prompt.tolist()
        for _ in range(6):  # past the window of 7: decode steps whose window drops cached rows
            with torch.no_grad():
                seq.append(int(model(zoo.pack([torch.tensor(seq)]))[-1].argmax()))
        want.append(seq[len(prompt):])
    for fuse in (False, True):
        got = generate(model, docs[:2], max_new_tokens=6, stop=[], fuse=fuse)
        assert [t.tolist() for t in got] == want, (fuse, got, want)


def test_static_decode_step_with_mods_equals_reference():
    """The compiled decode step's attention (the whole capacity under a mask) with sinks, a softcap and a window:
    one new query per sequence against its cached rows = the reference's last row."""
    from zoo.generate.cache import static_decode_attention

    q, k, v, sinks, softcap = _inputs(5, MODS["both"])
    lens, C = [9, 6], 12
    k_cache, v_cache = torch.zeros(2, K, C, H), torch.zeros(2, K, C, H)
    starts = [0, 9]
    for i, (a, n) in enumerate(zip(starts, lens)):
        k_cache[i, :, : n - 1] = k[a : a + n - 1].transpose(0, 1)
        v_cache[i, :, : n - 1] = v[a : a + n - 1].transpose(0, 1)
    last = torch.tensor([a + n - 1 for a, n in zip(starts, lens)])
    out = static_decode_attention(q[last], k[last], v[last], k_cache, v_cache, torch.tensor(lens) - 1, 0.3, 4,
                                  sinks=sinks, softcap=softcap)
    ref = reference(q[:15], k[:15], v[:15], lens, 0.3, 4, sinks, softcap)
    torch.testing.assert_close(out.double(), ref[last], atol=1e-5, rtol=1e-5)


def test_chunked_loss_with_final_softcap_equals_autograd(monkeypatch):
    """linear_cross_entropy with a softcap, cut into chunks of 5 rows: the loss and both gradients of
    cross_entropy(cap * tanh(h w^T / cap)) through autograd (Gemma 2's final_logit_softcapping)."""
    from zoo.core import loss as L

    monkeypatch.setattr(L, "MIN_ROWS", 5)
    monkeypatch.setattr(L, "LOGITS_PER_CHUNK", {"cpu": 5 * 48})
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(23, 16, generator=g, requires_grad=True), torch.randn(48, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 48, (23,), generator=g)
    labels[[0, 9]] = -100
    got = L.linear_cross_entropy(h, w, labels, softcap=1.5)
    dh, dw = torch.autograd.grad(got, (h, w))
    logits = 1.5 * torch.tanh((h.double() @ w.double().T) / 1.5)
    want = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    assert abs(got.item() - want.item()) < 1e-6 and abs(got.item() - L.linear_cross_entropy(h, w, labels).item()) > 1e-2
    for a, b in zip((dh, dw), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-6, rtol=1e-5)
