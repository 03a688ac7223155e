"""Sliding-window attention (`window=`): every backend, the flex BlockMask, the varlen kernel paths, the ring's
blocks, sequence parallelism against one process, and the KV cache's decode steps.

The reference is built from transformers' own mask functions (masking_utils: `causal_mask_function` and
`sliding_window_overlay`, `kv_idx > q_idx - window`), so the inclusive edge is theirs: a query sees `window` keys of
its document, itself included.
"""

from __future__ import annotations

import json
import sys
import types

import _sp_worker
import pytest
import torch

import zoo
from zoo.core import kernels
from zoo.core.attention import BACKENDS, _varlen, available_backends, describe, document_block_mask, eager
from zoo.generate.cache import CachedAttention, KVCache, decode_pack, static_decode_attention
from zoo.parallel import balanced_layout
from zoo.parallel import ring_blocks as B
from zoo.parallel import ring_kernels as R

masking_utils = pytest.importorskip("transformers.masking_utils")

# equal-length neighbours (sdpa batches them), a 1-token document, documents longer than every window below but one;
# both packs 41 tokens, so compiled flex builds one graph for both
PACKS = [[5, 1, 7, 7, 7, 2, 12], [9, 9, 3, 20]]
WINDOWS = [1, 2, 3, 6, 100]  # 6: between the documents' lengths; 100: longer than every document


def allowed_mask(L: int, window: int | None) -> torch.Tensor:
    """[L, L] bool of one document from transformers' mask functions, evaluated on an index grid."""
    fn = masking_utils.causal_mask_function
    if window is not None:
        fn = masking_utils.and_masks(masking_utils.sliding_window_overlay(window), fn)
    i = torch.arange(L)
    return fn(0, 0, i[:, None], i[None, :]).expand(L, L)


def reference(q, k, v, lens, window):
    """Plain softmax attention per document under transformers' mask, float64."""
    N, H = q.shape[1:]
    outs, start = [], 0
    for L in lens:
        q_d, k_d, v_d = (t[start : start + L].double() for t in (q, k, v))
        k_d, v_d = k_d.repeat_interleave(N // k_d.shape[1], 1), v_d.repeat_interleave(N // v_d.shape[1], 1)
        scores = torch.einsum("qnh,knh->nqk", q_d, k_d) / H**0.5
        probs = scores.masked_fill(~allowed_mask(L, window), float("-inf")).softmax(-1)
        outs.append(torch.einsum("nqk,knh->qnh", probs, v_d))
        start += L
    return torch.cat(outs)


def _pack(lens):
    return zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])


def _qkv(T, N, K, H=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, n, H, generator=g) for n in (N, K, K)]


@pytest.mark.parametrize("backend", available_backends("cpu"))
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_every_backend_equals_transformers_masks(backend, heads):
    for lens in PACKS:
        packed = _pack(lens)
        q, k, v = _qkv(sum(lens), *heads)
        for window in WINDOWS:
            with torch.no_grad():
                out = BACKENDS[backend](q, k, v, packed, window=window)
            torch.testing.assert_close(out.double(), reference(q, k, v, lens, window), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, lens=lens, window=window: f"{lens} window {window}: {m}")


def test_window_changes_the_output_and_none_is_document_causal():
    """The test above would pass for a backend that ignored the window if the reference did too: not so."""
    lens = PACKS[0]
    q, k, v = _qkv(sum(lens), 4, 2)
    assert not torch.allclose(reference(q, k, v, lens, 3), reference(q, k, v, lens, None))
    torch.testing.assert_close(reference(q, k, v, lens, 100), reference(q, k, v, lens, None))
    # window 1: each token's output is its own value row
    torch.testing.assert_close(eager(q, k, v, _pack(lens), window=1), v.repeat_interleave(2, 1))


def test_gradients_sdpa_equal_eager():
    lens = PACKS[0]
    packed = _pack(lens)
    q0, k0, v0 = _qkv(sum(lens), 4, 2)
    do = torch.randn(sum(lens), 4, 8)
    for window in (2, 6):
        grads = {}
        for backend in ("eager", "sdpa"):
            leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
            grads[backend] = torch.autograd.grad(BACKENDS[backend](*leaves, packed, window=window), leaves, do)
        for a, b in zip(grads["eager"], grads["sdpa"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "4"])
def test_a_bad_window_is_refused(window):
    lens = [4, 3]
    packed = _pack(lens)
    q, k, v = _qkv(7, 4, 2)
    cached = CachedAttention(BACKENDS["sdpa"], KVCache(2, 8))
    for fn in [BACKENDS[name] for name in ("eager", "sdpa", "flex", "auto")] + [cached.for_layer(0)]:
        with torch.no_grad(), pytest.raises(zoo.ZooError, match="window must be a positive int"):
            fn(q, k, v, packed, window=window)


# ---- flex: the windowed BlockMask ----


def _tiles(num, idx):
    return [set(idx[0, 0, i, : num[0, 0, i]].tolist()) for i in range(num.shape[-1])]


@pytest.mark.parametrize("block", [4, 8])
def test_flex_block_mask_covers_exactly_the_window(block):
    """Tiles smaller than the documents: every full tile lies wholly inside the window, every tile left out holds
    no allowed pair, partial tiles' mask_mod is the reference mask; the tiles equal what create_block_mask derives
    from a dense mask; and the window skips tiles the document-causal mask computes."""
    from torch.nn.attention.flex_attention import create_block_mask

    for lens in ([5, 1, 17, 5, 5, 1, 9], [30, 3, 25], [13], [2, 40]):
        packed = _pack(lens)
        T, B = packed.num_tokens, block
        doc_T = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        for window in (1, 2, 3, 4, 5, 7, 9, 16):
            ref = torch.block_diag(*[allowed_mask(L, window) for L in lens])
            got = document_block_mask(packed.cu_seqlens, T, B, window=window)
            partial, full = _tiles(got.kv_num_blocks, got.kv_indices), _tiles(got.full_kv_num_blocks,
                                                                               got.full_kv_indices)
            n = -(-T // B)
            q_idx, kv_idx = torch.arange(T)[:, None], torch.arange(T)[None, :]
            mask_mod = got.mask_mod(0, 0, q_idx, kv_idx)
            for i in range(n):
                assert not partial[i] & full[i]
                for j in range(n):
                    tile = (slice(i * B, (i + 1) * B), slice(j * B, (j + 1) * B))
                    if j in full[i]:
                        assert ref[tile].all(), (lens, window, i, j)
                    elif j in partial[i]:
                        assert torch.equal(mask_mod[tile], ref[tile]), (lens, window, i, j)
                    else:
                        assert not ref[tile].any(), (lens, window, i, j)

            def windowed(b, h, q, k, doc=doc_T, w=window):
                return (doc[q] == doc[k]) & (q >= k) & (q - k < w)

            want = create_block_mask(windowed, None, None, T, T, device="cpu", BLOCK_SIZE=B)
            assert partial == _tiles(want.kv_num_blocks, want.kv_indices), (lens, window)
            assert full == _tiles(want.full_kv_num_blocks, want.full_kv_indices), (lens, window)
        plain = document_block_mask(packed.cu_seqlens, T, B)
        narrow = document_block_mask(packed.cu_seqlens, T, B, window=2)
        if max(lens) > 2 * B:
            assert int(narrow.kv_num_blocks.sum() + narrow.full_kv_num_blocks.sum()) < \
                int(plain.kv_num_blocks.sum() + plain.full_kv_num_blocks.sum())


# ---- flash_varlen: the window in the kernel, or on flex where the kernel takes none (stand-in kernels) ----


@pytest.fixture
def fresh_kernels(monkeypatch):
    for module in ("flash_attn_interface", "flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    kernels.varlen_kernel.cache_clear()
    yield monkeypatch
    kernels.varlen_kernel.cache_clear()


def _flash_band(q, k, v, cu, left, scale):
    """What a flash varlen kernel computes for window_size=(left, 0), per document (flash semantics)."""
    packed = zoo.as_packed(torch.zeros(q.shape[0], dtype=torch.long), cu)
    return eager(q, k, v, packed, scale, window=None if left < 0 else left + 1)


def test_torch_varlen_kernel_gets_window_size(fresh_kernels):
    """torch 2.11-2.13's varlen_attn takes window_size=(left, right): a window w is (w - 1, 0)."""
    import torch.nn.attention.varlen as varlen

    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        seen.append(window_size)
        assert window_size[1] == 0
        return _flash_band(query, key, value, cu_seq_q, window_size[0], scale)

    fresh_kernels.setattr(varlen, "varlen_attn", varlen_attn)
    kernel = kernels.varlen_kernel()
    assert kernel.window and "window in the kernel" in describe("cuda")["flash_varlen"]
    lens = PACKS[0]
    q, k, v = _qkv(sum(lens), 4, 2)
    for window in (1, 3, 100):
        out = _varlen(kernel, q, k, v, _pack(lens), None, window)
        torch.testing.assert_close(out.double(), reference(q, k, v, lens, window), atol=1e-5, rtol=1e-5)
    assert seen == [(0, 0), (2, 0), (-1, 0)]  # 100 is longer than every document: plain causal


def test_kernel_without_window_runs_it_on_flex(fresh_kernels):
    """torch 2.10's varlen_attn has is_causal and no window: a window runs on flex (CPU here, under no_grad)."""
    import torch.nn.attention.varlen as varlen

    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
        calls.append(is_causal)
        return _flash_band(query, key, value, cu_seq_q, -1, None)

    fresh_kernels.setattr(varlen, "varlen_attn", varlen_attn)
    kernel = kernels.varlen_kernel()
    assert not kernel.window and "window on flex" in describe("cuda")["flash_varlen"]
    lens = PACKS[0]
    q, k, v = _qkv(sum(lens), 4, 2)
    with torch.no_grad():
        out = _varlen(kernel, q, k, v, _pack(lens), None, 3)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, 3), atol=1e-5, rtol=1e-5)
    assert calls == []  # the kernel never saw the window
    _varlen(kernel, q, k, v, _pack(lens), None, None)
    assert calls == [True]


@pytest.mark.parametrize("module, keywords", [("flash_attn", "window_size"), ("flash_attn.cute", "window_size_left")])
def test_flash_attn_gets_its_window_keywords(fresh_kernels, module, keywords):
    seen = []

    def flash_attn_2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1)):
        seen.append(window_size)
        return _flash_band(q, k, v, cu_seqlens_q, window_size[0], softmax_scale)

    def flash_attn_cute(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                        softmax_scale=None, causal=False, window_size_left=None, window_size_right=None):
        seen.append((window_size_left, window_size_right))
        left = -1 if window_size_left is None else window_size_left
        return _flash_band(q, k, v, cu_seqlens_q, left, softmax_scale), None

    fake = types.ModuleType(module)
    fake.__dict__["flash_attn_varlen_func"] = flash_attn_2 if keywords == "window_size" else flash_attn_cute
    fresh_kernels.setitem(sys.modules, module, fake)
    kernel = kernels.varlen_kernel()
    assert kernel.window
    lens = PACKS[1]
    q, k, v = _qkv(sum(lens), 4, 2)
    out = _varlen(kernel, q, k, v, _pack(lens), 0.3, 4)
    packed = _pack(lens)
    torch.testing.assert_close(out, eager(q, k, v, packed, 0.3, window=4))
    assert seen == [(3, 0)]


# ---- the ring: blocks with a window, from global indices ----


@pytest.mark.parametrize("kernel", ["math", "varlen-segments", "cpu-flash", "no-window-kernel"])
def test_ring_blocks_with_a_window_merge_to_windowed_attention(kernel, monkeypatch):
    """Forward and backward of every (query block, key block) pair with a window, merged by LSE, equal windowed
    attention; has_pairs is exactly "the block has an allowed pair". varlen-segments runs the flash contract's
    dense stand-in (the CUDA kernel's window_size band per segment); no-window-kernel is the CUDA path of a torch
    whose flash kernels take no window (dense math where the window cuts a block, the plain kernel elsewhere)."""
    lens = [1, 23, 5, 2, 30, 3, 3, 3, 3, 3]
    T, N, K, H = sum(lens), 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(T, n, H, generator=g, dtype=torch.float64) for n in (N, K, K, N))
    packed = _pack(lens)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    blocks = [B.BlockMeta(ix, doc[ix]) for ix in balanced_layout(lens, 4, 1)]
    scale = H**-0.5
    if kernel == "no-window-kernel":
        fake = kernels.LseKernels("stand-in", R.math_varlen_lse, R.math_varlen_lse_backward, window=False)
        monkeypatch.setattr(R, "require_lse_kernels", lambda: fake)
    fwd_kernel = {"cpu-flash": R.cpu_flash_lse}.get(kernel, R.math_varlen_lse)
    bwd_kernel = {"cpu-flash": R.cpu_flash_lse_backward}.get(kernel, R.math_varlen_lse_backward)

    def fwd(qm, km, diagonal, window, q_b, k_b, v_b):
        if kernel == "math":
            return R.math_forward(q_b, k_b, v_b, qm, km, scale, window)
        if kernel == "no-window-kernel":
            return R._dense_where_cut_forward(q_b, k_b, v_b, qm, km, scale, diagonal, window=window)
        return R.varlen_forward(q_b, k_b, v_b, qm, km, scale, diagonal, kernel=fwd_kernel, window=window)

    def bwd(qm, km, diagonal, window, q_b, k_b, v_b, o, lse, do_b, delta):
        if kernel == "math":
            return R.math_backward(q_b, k_b, v_b, lse, do_b, delta, qm, km, scale, window)
        if kernel == "no-window-kernel":
            return R._dense_where_cut_backward(q_b, k_b, v_b, o, lse, do_b, delta, qm, km, scale, diagonal,
                                               window=window)
        return R.varlen_backward(q_b, k_b, v_b, o, lse, do_b, delta, qm, km, scale, diagonal, kernel_bwd=bwd_kernel,
                                 window=window)

    for window in (1, 3, 8):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = eager(*leaves, packed, window=window)
        ref_grads = torch.autograd.grad(ref, leaves, do)
        out = torch.zeros_like(ref)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        skipped = 0
        for i, qm in enumerate(blocks):
            o, lse = torch.zeros(qm.size, N, H), torch.full((N, qm.size), float("-inf"))
            for j, km in enumerate(blocks):
                pairs = B.has_pairs(qm, km, window)
                assert pairs == bool(B.mask_TS(qm, km, window).any()), (window, i, j)
                if not pairs:
                    skipped += 1
                    continue
                o, lse = R.merge(o, lse, *fwd(qm, km, i == j, window, q[qm.index_S], k[km.index_S], v[km.index_S]))
            out[qm.index_S] = o.double()
            delta = (do[qm.index_S].float() * o).sum(-1).T
            for j, km in enumerate(blocks):
                if B.has_pairs(qm, km, window):
                    dq_b, dk_b, dv_b = bwd(qm, km, i == j, window, q[qm.index_S], k[km.index_S], v[km.index_S], o,
                                           lse, do[qm.index_S], delta)
                    grads[0][qm.index_S] += dq_b.double()
                    grads[1][km.index_S] += dk_b.double()
                    grads[2][km.index_S] += dv_b.double()
        plain_skipped = sum(not B.has_pairs(a, b) for a in blocks for b in blocks)
        assert skipped >= plain_skipped and (window > 1 or skipped > plain_skipped), window  # the window skips more
        torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ---- sequence parallel against one process ----


def test_sequence_parallel_with_a_window_equals_one_process(tmp_path):
    """Ring, Ulysses and hybrid over groups of 2, 3 and 4 processes (one launch of 4: ranks 0..n-1 form the group
    of n), windows 1, 4 and 9 shorter than documents that span shards: outputs and q/k/v gradients equal eager in
    one process; with window 1 the ring never passes a block."""
    out = tmp_path / "report.json"
    _sp_worker.launch(_sp_worker.main_window, 4, out)
    report = json.loads(out.read_text())
    expected = {f"{n}/{mode}/window{w}" for n in (2, 3, 4) for mode in ("ring", "ulysses") + (("hybrid",) * (n == 4))
                for w in _sp_worker.WINDOWS}
    assert set(report) == expected, sorted(set(report) ^ expected)
    bad = [f"{case}: {detail}" for case, (ok, detail) in sorted(report.items()) if not ok]
    assert not bad, "\n".join(bad)


# ---- generation: prefill and decode steps through CachedAttention ----


@pytest.mark.parametrize("static", [False, True], ids=["eager-step", "static-step"])
def test_cached_decoding_with_a_window_equals_windowed_attention_on_each_prefix(static):
    """Two layers, one windowed (3) and one not, three sequences: the prefill and every decode step equal eager
    windowed attention over the whole sequence so far (positions past the window are masked in the cache)."""
    prompt_lens, steps, N, K, H = [5, 1, 4], 5, 4, 2, 8
    layer_windows = (3, None)
    total = [n + steps for n in prompt_lens]
    g = torch.Generator().manual_seed(1)
    # per layer, per sequence: q/k/v of every position the sequence will ever have
    seqs = [[[torch.randn(L, n, H, generator=g) for n in (N, K, K)] for L in total] for _ in layer_windows]
    want = [[eager(*qkv, _pack([len(qkv[0])]), window=w) for qkv in layer] for layer, w in zip(seqs, layer_windows)]

    cache = KVCache(len(prompt_lens), 16)
    cached = CachedAttention(BACKENDS["sdpa"], cache)
    prompt = _pack(prompt_lens)
    for layer, window in enumerate(layer_windows):
        q, k, v = (torch.cat([s[i][:n] for s, n in zip(seqs[layer], prompt_lens)]) for i in range(3))
        got = cached.for_layer(layer)(q, k, v, prompt, window=window)
        torch.testing.assert_close(got, torch.cat([w[:n] for w, n in zip(want[layer], prompt_lens)]))
    cache.lengths = torch.tensor(prompt_lens)
    cached.decoding, cached.static = True, static
    for _ in range(steps):
        positions = cache.lengths.clone()
        cache.begin_step(torch.device("cpu"))
        step = decode_pack(torch.zeros(len(prompt_lens), dtype=torch.long), positions)
        for layer, window in reversed(list(enumerate(layer_windows))):  # by index: the order of calls is no matter
            q, k, v = (torch.stack([s[i][p] for s, p in zip(seqs[layer], positions.tolist())]) for i in range(3))
            got = cached.for_layer(layer)(q, k, v, step, window=window)
            torch.testing.assert_close(got, torch.stack([w[p] for w, p in zip(want[layer], positions.tolist())]))
        cache.lengths += 1


def test_static_decode_attention_compiles_with_a_window():
    """The compiled step's attention function, traced whole (aot_eager: no C++ build), honours the window."""
    n, N, K, H, C = 2, 4, 2, 8, 12
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(n, K, C, H, generator=g) for _ in range(2))
    q, k, v = (torch.randn(n, m, H, generator=g) for m in (N, K, K))
    position = torch.tensor([6, 2])
    compiled = torch.compile(static_decode_attention, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, k_cache.clone(), v_cache.clone(), position, None, 3)
    want = static_decode_attention(q, k, v, k_cache.clone(), v_cache.clone(), position, None, 3)
    torch.testing.assert_close(got, want)
    # by hand: sequence 0 at row 6 sees rows 4, 5, 6 (6 being its own new k/v)
    keys = torch.cat([k_cache[0, :, 4:6], k[0][:, None]], 1)
    vals = torch.cat([v_cache[0, :, 4:6], v[0][:, None]], 1)
    q0 = q[0].view(K, N // K, H)
    probs = (q0 @ keys.transpose(-1, -2) / H**0.5).softmax(-1)
    torch.testing.assert_close(got[0], (probs @ vals).reshape(N, H))
