"""Attention backends: document-causal, GQA, 1-token documents, dtypes, and their errors."""

import pytest
import torch

import zoo
from zoo.attention import BACKENDS, eager, pick_backend

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
    assert pick_backend(torch.device("cpu"), torch.float32, training=True) == "sdpa"
    assert pick_backend(torch.device("cuda"), torch.bfloat16, training=True) == "flash_varlen"


def test_pack_fields_and_errors():
    p = zoo.pack([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])])
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6] and p.cu_seqlens.dtype == torch.int32
    assert p.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert p.labels.tolist() == [6, 7, -100, -100, 10, -100]
    assert p.max_seqlen == 3
    masked = zoo.pack([torch.tensor([5, 6, 7, 8])], label_masks=[torch.tensor([0, 0, 1, 1])])
    assert masked.labels.tolist() == [-100, 7, 8, -100]
    with pytest.raises(ValueError, match="document 1 must be a non-empty 1-D tensor"):
        zoo.pack([torch.tensor([1]), torch.tensor([[1, 2]])])
    with pytest.raises(ValueError, match="zoo has no batch dimension"):
        zoo.load("debug", device="meta")(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        zoo.as_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 3, 3, 5], dtype=torch.int32))


def test_forward_from_cu_seqlens_equals_packed():
    model = zoo.load("debug", attn="sdpa")
    docs = [torch.randint(0, 2048, (n,)) for n in (6, 1, 9)]
    p = zoo.pack(docs)
    with torch.no_grad():
        torch.testing.assert_close(model(p.input_ids, cu_seqlens=p.cu_seqlens), model(p))
        alone = model(docs[2])
    torch.testing.assert_close(model(p)[7:], alone, atol=1e-5, rtol=1e-5)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["flash_varlen", "flex", "sdpa"])
def test_gpu_backends_bf16_against_eager(backend):
    lens = [300, 1, 1024, 77, 513]
    q, k, v = (t.cuda().requires_grad_() for t in qkv(lens, N=8, K=2, H=64, dtype=torch.bfloat16))
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens]).to("cuda")
    out = BACKENDS[backend](q, k, v, packed)
    grads = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = eager(q2, k2, v2, packed)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q2, k2, v2))
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert ((g.float() - r).norm() / r.norm()) < 2e-2


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex", "auto"])
def test_a_shard_needs_the_wrapped_model(backend):
    """A sequence-parallel shard run through a plain backend would attend within local pieces only: refused."""
    lens = [4, 3]
    q, k, v = qkv(lens)
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
    packed.sp = object()
    with torch.no_grad(), pytest.raises(zoo.ZooError, match="sp.apply"):
        BACKENDS[backend](q, k, v, packed)
