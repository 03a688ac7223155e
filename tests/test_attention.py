"""Attention backends: document-causal, GQA, 1-token documents, dtypes, and their errors."""


import pytest
import torch

import zoo
from zoo.core.attention import BACKENDS, document_block_mask, eager, pick_backend
from zoo.core.kernels import varlen_kernel

CPU = ["eager", "sdpa", "auto"]


def reference(q, k, v, lens):
    """Dense softmax with an explicit T x T document-causal mask, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    T, N, H = q.shape
    k = k.repeat_interleave(N // k.shape[1], dim=1)
    v = v.repeat_interleave(N // v.shape[1], dim=1)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    allowed = (doc[:, None] == doc[None]) & torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.einsum("qnh,knh->nqk", q, k) / H**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("nqk,knh->qnh", probs, v)


def qkv(lens, N=8, K=2, H=16, dtype=torch.float32):
    T = sum(lens)
    return [torch.randn(T, n, H, dtype=dtype) for n in (N, K, K)]


@pytest.mark.parametrize("backend", CPU + ["flex"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 3)])
def test_document_causal_against_dense_mask(backend, heads):
    lens = [5, 1, 17, 5, 5, 1, 9]  # equal-length neighbours (batched by sdpa) and 1-token documents
    q, k, v = qkv(lens, N=heads[0], K=heads[1])
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    with torch.no_grad():
        out = BACKENDS[backend](q, k, v, packed)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_low_precision(backend, dtype):
    lens = [7, 1, 12]
    q, k, v = qkv(lens, dtype=dtype)
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    out = BACKENDS[backend](q, k, v, packed)
    assert out.dtype == dtype
    ref = reference(q, k, v, lens)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_backends_agree_on_gradients():
    lens = [11, 1, 6, 6]
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    grads = {}
    q0, k0, v0 = qkv(lens)
    for backend in ["eager", "sdpa"]:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        BACKENDS[backend](q, k, v, packed).pow(2).sum().backward()
        grads[backend] = (q.grad, k.grad, v.grad)
    for a, b in zip(grads["eager"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_compiled_blocks_do_not_recompile_per_pack(backend):
    """eager and sdpa loop over a pack's documents in Python; inside blocks compiled as the recipes compile them
    (block.compile(); aot_eager here, for time) they run eagerly, so packs of other structures (numbers of
    documents and of runs of equal lengths) compile nothing new once the shapes are dynamic, and the loss and
    gradients equal an uncompiled model's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = zoo.load("debug", attn=backend)
    reference = zoo.load("debug", attn=backend)
    reference.load_state_dict(model.state_dict())
    for block in model.layers:
        block.compile(backend="aot_eager")
    graphs, g = [], torch.Generator().manual_seed(1)
    for lens in ([40, 40, 9], [12, 30, 30, 30, 5], [7, 7, 7, 7, 20, 1, 3], [64, 2, 2, 50, 50, 9, 9, 9]):
        packed = zoo.pack([torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lens])
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
            m.loss(packed).backward()
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[-2] == graphs[-3], f"graphs compiled after each pack: {graphs}"


def test_flex_refuses_to_train_on_cpu():
    lens = [4, 3]
    q, k, v = (t.requires_grad_() for t in qkv(lens))
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    with pytest.raises(zoo.ZooError, match="cannot train on CPU.*sdpa"):
        BACKENDS["flex"](q, k, v, packed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
def test_flash_varlen_without_cuda_names_what_runs():
    lens = [4, 3]
    q, k, v = qkv(lens)
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    with pytest.raises(zoo.ZooError, match="needs a CUDA device.*eager, sdpa"):
        BACKENDS["flash_varlen"](q, k, v, packed)


def test_auto_picks():
    assert pick_backend(torch.device("cpu"), torch.float32) == "sdpa"
    assert pick_backend(torch.device("cpu"), torch.bfloat16) == "sdpa"
    fused = "flash_varlen" if varlen_kernel() is not None else "sdpa"
    assert pick_backend(torch.device("cuda"), torch.bfloat16) == fused


def _tile_sets(num, idx):
    return [set(idx[0, 0, i, : num[0, 0, i]].tolist()) for i in range(num.shape[-1])]


@pytest.mark.parametrize("block", [4, 8, 128])
def test_flex_block_mask_from_cu_seqlens_equals_create_block_mask(block):
    """The BlockMask built from cu_seqlens has the same partial and full tiles (both directions) as the one
    create_block_mask derives from a dense mask: 1-token documents, documents over many tiles, a ragged end."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(block)
    packs = [[5, 1, 17, 5, 5, 1, 9], [300, 1, 1024, 77, 513], [128, 128, 256], [1], [129, 127, 1, 1000]]
    packs += [torch.randint(1, 5 * block, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
              for _ in range(30)]
    for lens in packs:
        packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))

        def document_causal(b, h, q, k, doc=doc):
            return (doc[q] == doc[k]) & (q >= k)

        T = packed.num_tokens
        want = create_block_mask(document_causal, None, None, T, T, device="cpu", BLOCK_SIZE=block)
        got = document_block_mask(packed.cu_seqlens, T, block)
        for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
            assert _tile_sets(getattr(got, num), getattr(got, idx)) == _tile_sets(getattr(want, num),
                                                                                 getattr(want, idx)), (lens, num)


def test_flex_at_131072_tokens_builds_no_dense_mask():
    """A 131,072-token pack: the BlockMask is a few MB (a dense T x T mask would be 17 GB) and flex's forward
    equals sdpa's on CPU."""
    lens = [2000] * 65 + [1072]
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    mask = document_block_mask(packed.cu_seqlens, packed.num_tokens)
    size = sum(t.numel() * t.element_size() for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                                      mask.full_kv_indices, mask.q_num_blocks, mask.q_indices,
                                                      mask.full_q_num_blocks, mask.full_q_indices))
    assert size < 32 << 20, size
    q, k, v = qkv(lens, N=2, K=1, H=16)
    with torch.no_grad():
        out = BACKENDS["flex"](q, k, v, packed)
        torch.testing.assert_close(out, BACKENDS["sdpa"](q, k, v, packed), atol=1e-5, rtol=1e-5)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

# a 1-token document first, one over 8K tokens, equal-length neighbours (sdpa batches them)
GPU_LENS = [1, 8300, 300, 300, 1, 1024, 77]


@pytest.fixture(scope="module")
def gpu_reference():
    """GQA 32 q / 8 kv heads, head dim 128: inputs, an upstream gradient, and eager's fp32 output and gradients."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T = sum(GPU_LENS)
    q, k, v = (torch.randn(T, n, 128, device="cuda", generator=g) for n in (32, 8, 8))
    do = torch.randn(T, 32, 128, device="cuda", generator=g)
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in GPU_LENS]).to("cuda")
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = eager(*leaves, packed)
        grads = torch.autograd.grad(out, leaves, do)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return (q, k, v, do, packed), out.detach(), grads


def _rel(got, want):
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["flash_varlen", "flex", "sdpa", "auto"])
def test_gpu_backends_against_fp32(backend, dtype, gpu_reference):
    """Every backend in bf16 and fp16, forward and backward, against eager in fp32: errors of the size the dtype
    allows (bf16 keeps 8 bits of mantissa, fp16 11)."""
    if backend == "flash_varlen" and varlen_kernel() is None:
        pytest.skip("no fused varlen kernel in this process (flash-attn or torch.nn.attention.varlen)")
    (q, k, v, do, packed), want, want_grads = gpu_reference
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = BACKENDS[backend](*leaves, packed)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    bound = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert out.dtype == dtype and _rel(out, want) < bound, _rel(out, want)
    for name, g, w in zip("qkv", grads, want_grads):
        assert _rel(g, w) < 2 * bound, (name, _rel(g, w))
    # a 1-token document attends to itself only: its output is its value row
    torch.testing.assert_close(out[0].float(), v[0].repeat_interleave(4, 0).to(dtype).float(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex", "auto"])
def test_a_shard_needs_the_wrapped_model(backend):
    """A sequence-parallel shard run through a plain backend would attend within local pieces only: refused."""
    lens = [4, 3]
    q, k, v = qkv(lens)
    whole = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])

    class Part(zoo.Packed):  # a part of a pack, as zoo.parallel.Shard is one
        def part_of(self):
            return whole, torch.arange(self.num_tokens)

    packed = Part(whole.input_ids, whole.cu_seqlens, whole.position_ids, whole.max_seqlen)
    with torch.no_grad(), pytest.raises(zoo.ZooError, match="sp.apply"):
        BACKENDS[backend](q, k, v, packed)
