"""Qwen3.5's Gated DeltaNet on CUDA: flash-linear-attention's kernels (where installed) against zoo's torch path,
and the model in bf16 against transformers (all skipped without a CUDA GPU; the fla cases without fla):

- the convolution and the delta rule by fla's Triton kernels with cu_seqlens equal zoo's chunked torch path over a
  pack of documents shorter than, equal to and longer than fla's 64-token chunk, 1-token and empty ones: fp32 close
  to an fp64 run, bf16 within a few times the torch path's bf16 error; final states (the prefill's) too, and the
  gradients where fla's backward runs (fla 0.6 refuses it on Hopper with Triton < 3.7.1: there `auto` picks the
  torch path);
- the model in bf16 on CUDA (fla where installed) is at least as close to an fp64 run of the same weights as
  transformers' bf16 logits per document;
- greedy generate on CUDA (fla prefill, compiled CUDA-graph decode) equals transformers' token for token.
"""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.core import deltanet
from zoo.core.deltanet import causal_conv, chunked_delta_rule, describe, doc_positions
from zoo.core.fla import fla_backward_refused, fla_documents, fla_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_fla = pytest.mark.skipif(fla_kernels() is None, reason="needs flash-linear-attention (fla) importable")
Hk, Hv, Dk, Dv, K = 2, 4, 128, 128, 4  # Qwen3.5's head dims (fla tunes its kernels per shape)
LENGTHS = [65, 1, 64, 0, 9, 130, 1, 200, 17]
# the tiny Qwen3.5 of test_qwen3_5, with head dims fla's kernels tile (16..256, powers of two)
GPU_SHAPES = dict(hidden_size=128, linear_key_head_dim=128, linear_value_head_dim=128, head_dim=32,
                  full_attention_interval=2)


def _inputs(dtype: torch.dtype, seed: int = 0):
    """The layer's inputs for LENGTHS: channels before the convolution [T, 2 Hk Dk + Hv Dv], its weights [C, K],
    beta [T, Hv] in (0, 1), g [T, Hv] (log decay, fp32 as the layer makes it); cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    T, C = sum(LENGTHS), 2 * Hk * Dk + Hv * Dv
    mixed = torch.randn(T, C, generator=g)
    conv = torch.randn(C, K, generator=g) * 0.5
    beta = torch.rand(T, Hv, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=g) - 2)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    leaves = [x.to("cuda", dtype).requires_grad_() for x in (mixed, conv, beta)]
    return (*leaves, decay.to("cuda", torch.float32 if dtype != torch.float64 else dtype).requires_grad_()), cu


def _torch_path(mixed, conv, beta, decay, cu, states=None):
    T = mixed.shape[0]
    qkv = torch.nn.functional.silu(causal_conv(mixed, conv, doc_positions(cu, T)[1]))
    q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    return chunked_delta_rule(q.view(T, Hk, Dk), k.view(T, Hk, Dk), v.view(T, Hv, Dv), decay, beta, cu,
                              states_out=states)


def _fla_path(mixed, conv, beta, decay, cu, states=None):
    return fla_documents(mixed, conv, beta, decay, cu, Hk, Dk, Dv, states)


def _run(path, dtype, grads: bool):
    """[output, final states] and, with `grads`, the gradients of (output * w).sum() for the channels, the
    convolution weights, beta and g."""
    x, cu = _inputs(dtype)
    states: list[torch.Tensor] = []
    with torch.set_grad_enabled(grads):
        out = path(*x, cu, states)
    if not grads:
        return [out, states[0]]
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    return [out, states[0], *torch.autograd.grad((out.float() * w.float()).sum(), x)]


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_fla
def test_fla_kernels_equal_the_torch_path():
    """fla's convolution + delta rule with cu_seqlens (empty documents left out of its cu_seqlens) against zoo's
    chunked torch path in fp64: fp32 within 1e-2 (relative: Triton's dots take fp32 as tf32); in bf16 the output,
    final states and (where fla's backward runs) gradients of the channels, conv weights, beta and g within 3x the
    torch path's own bf16 error (which computes the rule in fp32 from bf16 inputs; fla keeps bf16 tiles) or 1e-2."""
    grads = fla_backward_refused(torch.device("cuda")) is None
    names = ["output", "final state", "d channels", "d conv", "d beta", "d g"]
    ref = _run(_torch_path, torch.float64, grads)
    fla32, fla16 = _run(_fla_path, torch.float32, grads), _run(_fla_path, torch.bfloat16, grads)
    torch16 = _run(_torch_path, torch.bfloat16, grads)
    for name, a, b, t, r in zip(names, fla32, fla16, torch16, ref):
        print(f"{name}: fla fp32 {_err(a, r):.2e}, fla bf16 {_err(b, r):.2e}, torch bf16 {_err(t, r):.2e}")
    for name, a, b, t, r in zip(names, fla32, fla16, torch16, ref):
        assert _err(a, r) < 1e-2, f"fla fp32 {name}: {_err(a, r):.2e} from fp64"
        assert _err(b, r) <= max(3 * _err(t, r), 1e-2), f"bf16 {name}: fla {_err(b, r):.2e}, torch {_err(t, r):.2e}"


@needs_fla
def test_auto_picks_fla_where_it_trains_and_describe_says_so():
    x = torch.empty(1, device="cuda", dtype=torch.bfloat16)
    refused = fla_backward_refused(x.device)
    assert deltanet.pick_kernel(x, "auto", (128, 128)) == ("torch" if refused else "fla")
    assert deltanet.pick_kernel(x, "auto", (8, 12)) == "torch"  # tiles fla does not take
    assert describe("cuda", torch.bfloat16).startswith("torch" if refused else "fla ")


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    from test_qwen3_5 import save_qwen3_5

    path = tmp_path_factory.mktemp("qwen3_5_gpu")
    save_qwen3_5(path, seed=3, **GPU_SHAPES)
    return path


def test_bf16_on_cuda_is_as_close_to_fp64_as_transformers(tiny_cuda):
    """One packed bf16 forward on CUDA (sdpa, the delta rule by fla where installed) against the fp64 forward of the
    same weights: at least as close (x1.25) as transformers' bf16 logits per document; the loss within 2e-2."""
    from transformers import Qwen3_5ForCausalLM

    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 128, (n,), generator=g) for n in (65, 1, 64, 130, 17)]
    packed = zoo.pack(docs).to("cuda")
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        ref = zoo.load(tiny_cuda, attn="eager", dtype=torch.float64, device="cuda")(packed)
        model = zoo.load(tiny_cuda, attn="sdpa", dtype=torch.bfloat16, device="cuda")
        got = model(packed)
        hf = Qwen3_5ForCausalLM.from_pretrained(tiny_cuda, dtype=torch.bfloat16).to("cuda").eval()
        theirs = torch.cat([hf(d[None].cuda()).logits[0] for d in docs])
    ours_err, hf_err = _err(got, ref), _err(theirs, ref)
    print(f"bf16 logits vs fp64: zoo {ours_err:.2e} ({describe('cuda')}), transformers {hf_err:.2e}")
    assert ours_err <= 1.25 * hf_err, (ours_err, hf_err)
    for i in range(len(docs)):
        assert _err(got[cu[i]:cu[i + 1]], ref[cu[i]:cu[i + 1]]) < 2e-2, f"doc {i}"


def test_greedy_generate_on_cuda_equals_transformers(tiny_cuda):
    """fp32 on CUDA, tf32 off: prompts of different lengths batched, the prefill through fla where installed, the
    decode steps compiled (CUDA graphs) and eager: each equals transformers' greedy decoding of the prompt alone."""
    from transformers import Qwen3_5ForCausalLM

    from zoo.generate import generate

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).cuda() for n in (5, 70, 1)]
    model = zoo.load(tiny_cuda, attn="sdpa", device="cuda").eval()
    hf = Qwen3_5ForCausalLM.from_pretrained(tiny_cuda).to("cuda").eval()
    new = 8
    want = [hf.generate(p[None], max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, len(p):].tolist()
            for p in prompts]
    for compiled in (False, True):
        got = generate(model, prompts, max_new_tokens=new, stop=[], compile=compiled)
        assert [o.tolist() for o in got] == want, f"compile={compiled}"
