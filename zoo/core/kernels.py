"""Which fused varlen attention kernels this process has, decided once by what imports and what signatures accept.

Nothing here guesses from version numbers. `flash_varlen` runs the first of these that is usable:

1. flash-attn 3 (`flash_attn_interface`), flash-attn 2 (`flash_attn`), flash-attn 4 (`flash_attn.cute`);
2. torch's `torch.nn.attention.varlen.varlen_attn`: GQA through its `enable_gqa` switch where the signature has
   one (torch 2.13); where it has none (torch 2.10-2.12) the flash kernel underneath still takes fewer K/V heads
   than query heads, which a one-time probe on the GPU confirms; if the probe fails, K/V are repeated per query
   head, which costs N/K times the K/V memory and bandwidth of the attention call (said in `describe`).

A sliding window runs in the kernel where its signature takes one (`VarlenKernel.window`): flash-attn's and torch's
`window_size=(window - 1, 0)` (flash counts the keys left of the query, zoo counts the query too; flash-attn 4's
`window_size_left`). torch 2.10's varlen_attn has only `is_causal`; there `flash_varlen` runs windows on flex.

The sequence-parallel ring needs a kernel that returns the log-sum-exp and a backward that takes the *final*
output and log-sum-exp of the whole ring (`lse_kernels`): the forward is the public `varlen_attn(...,
return_aux=AuxRequest(lse=True))`; torch has no public backward, so the private op `aten::_flash_attention_backward`
is called after its schema is checked against the layout zoo was written for (torch 2.11-2.13;
`zoo.core.internals.flash_attention_backward`). Without it the ring falls back to its fp32 math kernel, with a
warning (`zoo.parallel.ring_kernels.block_kernels`).

`zoo.core.attention.describe(device)` shows the decisions; they are logged at debug level under `zoo.core.kernels`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core.internals import flash_attention_backward, flash_backward_problem
from zoo.errors import ZooError

log = logging.getLogger(__name__)

# (q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale, window) -> o_TNH; document-causal (within `window` keys,
# the query included, when given and the kernel takes one) and differentiable
Attend = Callable[[Tensor, Tensor, Tensor, Tensor, int, "float | None", "int | None"], Tensor]


@dataclass(frozen=True)
class VarlenKernel:
    """The causal varlen kernel `flash_varlen` runs: its name, how it serves GQA, whether it takes a sliding window,
    and the call (a window passed to a kernel without one is an error: `flash_varlen` does not pass it)."""

    name: str
    gqa: str  # "native" or "repeated K/V"
    attend: Attend
    window: bool = False
    softcap: bool = False  # takes `softcap=` (flash-attn 2.6 on, 3): Gemma 2's soft-capping in the kernel


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: assume the documented keywords only
        return {}


def _flash_attn_kernel(label: str, module: str) -> VarlenKernel | None:
    """flash-attn 2/3/4's `flash_attn_varlen_func`; all three name the arguments zoo passes the same way."""
    try:
        fn = importlib.import_module(module).flash_attn_varlen_func
    except Exception as e:  # not installed, or built for another torch/CUDA: either way not usable here
        log.debug("%s (%s) not usable: %s", label, module, e)
        return None
    params = _parameters(fn)
    has_max = "max_seqlen_q" in params or not params
    # a window only where the signature shows one: flash-attn 2 (2.3 on) and 3 take window_size=(left, right),
    # flash-attn 4 window_size_left/right; left counts the keys before the query, so a window of w is w - 1
    window_keywords = ("window_size" if "window_size" in params else
                       "window_size_left" if "window_size_left" in params else None)

    def attend(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, cu: Tensor, max_len: int, scale: float | None,
               window: int | None = None, softcap: float | None = None) -> Tensor:
        kw: dict[str, Any] = {"max_seqlen_q": max_len, "max_seqlen_k": max_len} if has_max else {}
        if softcap is not None:  # passed only where the signature shows it (VarlenKernel.softcap)
            kw["softcap"] = softcap
        if window is not None:
            if window_keywords is None:
                raise ZooError(f"{label}'s flash_attn_varlen_func takes no window; "
                               "zoo.core.attention runs windows on flex")
            kw.update({"window_size": (window - 1, 0)} if window_keywords == "window_size" else
                      {"window_size_left": window - 1, "window_size_right": 0})
        out = fn(q_TNH, k_TKH, v_TKH, cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=scale, causal=True, **kw)
        return out[0] if isinstance(out, tuple) else out  # flash-attn 3/4 also return the log-sum-exp

    return VarlenKernel(f"{label} ({module}.flash_attn_varlen_func)", "native", attend, window_keywords is not None,
                        "softcap" in params)


def _causal_keywords(params: dict[str, inspect.Parameter], window: int | None = None) -> dict[str, Any] | None:
    """The keywords of a causal call (within `window` keys) for this varlen_attn signature: window_size (torch 2.11
    on; (-1, 0) is causal, (window - 1, 0) the band), is_causal (torch 2.10: no window); None: neither."""
    if "window_size" in params:
        return {"window_size": (-1 if window is None else window - 1, 0)}
    if "is_causal" in params and window is None:
        return {"is_causal": True}
    return None


def _torch_varlen_kernel() -> VarlenKernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        log.debug("torch %s has no torch.nn.attention.varlen: %s", torch.__version__, e)
        return None
    params = _parameters(varlen_attn)
    if _causal_keywords(params) is None:
        log.debug("torch varlen_attn takes neither window_size nor is_causal: %s", list(params))
        return None
    name = "torch.nn.attention.varlen.varlen_attn"
    takes_window = "window_size" in params
    if "enable_gqa" in params:

        def attend(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, cu: Tensor, max_len: int, scale: float | None,
                   window: int | None = None) -> Tensor:
            # enable_gqa and the causal switch through dicts: the keywords exist only in some torch versions'
            # signature (checked above). varlen_attn's declared return includes (out, aux), which it returns only
            # when given return_aux
            gqa: dict[str, Any] = {"enable_gqa": k_TKH.shape[1] != q_TNH.shape[1]}
            return varlen_attn(q_TNH, k_TKH, v_TKH, cu, cu, max_len, max_len, scale=scale,  # type: ignore[return-value]
                               **gqa, **_causal_call(params, window))

        return VarlenKernel(name, "native", attend, takes_window)

    def native(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, cu: Tensor, max_len: int, scale: float | None,
               window: int | None = None) -> Tensor:
        # as in attend: without return_aux, varlen_attn returns the output alone
        return varlen_attn(q_TNH, k_TKH, v_TKH, cu, cu, max_len, max_len, scale=scale,  # type: ignore[return-value]
                           **_causal_call(params, window))

    if _takes_fewer_kv_heads(native):
        return VarlenKernel(name, "native", native, takes_window)

    def repeated(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, cu: Tensor, max_len: int, scale: float | None,
                 window: int | None = None) -> Tensor:
        G = q_TNH.shape[1] // k_TKH.shape[1]
        if G > 1:  # N/K times the K/V memory and bandwidth: the price of a kernel without GQA
            k_TKH, v_TKH = k_TKH.repeat_interleave(G, dim=1), v_TKH.repeat_interleave(G, dim=1)
        return native(q_TNH, k_TKH, v_TKH, cu, max_len, scale, window)

    return VarlenKernel(name, "repeated K/V", repeated, takes_window)


def _causal_call(params: dict[str, inspect.Parameter], window: int | None) -> dict[str, Any]:
    causal = _causal_keywords(params, window)
    if causal is None:
        raise ZooError(f"torch {torch.__version__}'s varlen_attn takes no window; "
                       "zoo.core.attention runs windows on flex")
    return causal


def _takes_fewer_kv_heads(attend: Attend) -> bool:
    """One tiny GQA call on the GPU against sdpa: does this kernel serve 4 query heads from 2 K/V heads?"""
    if not torch.cuda.is_available():
        return True  # no GPU to ask; the kernel cannot run here anyway
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(16, n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for n in (4, 2, 2))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device="cuda")
    try:
        out = attend(q, k, v, cu, 11, None, None)
    except Exception as e:
        log.debug("torch varlen_attn refused GQA: %s", e)
        return False
    ref = []
    for a, b in ((0, 5), (5, 16)):
        q_NLH, k_NLH, v_NLH = (t[a:b].repeat_interleave(4 // t.shape[1], 1).transpose(0, 1) for t in (q, k, v))
        ref.append(F.scaled_dot_product_attention(q_NLH, k_NLH, v_NLH, is_causal=True).transpose(0, 1))
    ref = torch.cat(ref)
    return bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2))


@functools.cache
def varlen_kernel() -> VarlenKernel | None:
    """The kernel `attn="flash_varlen"` runs in this process (None: no fused varlen kernel is installed)."""
    for label, module in (("flash-attn 3", "flash_attn_interface"), ("flash-attn 2", "flash_attn"),
                          ("flash-attn 4", "flash_attn.cute")):
        kernel = _flash_attn_kernel(label, module)
        if kernel is not None:
            break
    else:
        kernel = _torch_varlen_kernel()
    log.debug("flash_varlen runs %s", "nothing (no varlen kernel)" if kernel is None else
              f"{kernel.name}, GQA {kernel.gqa}, window {'in the kernel' if kernel.window else 'on flex'}")
    return kernel


# ---- kernels with log-sum-exp, for the sequence-parallel ring ----

@dataclass(frozen=True)
class LseKernels:
    """A varlen forward that also returns lse [N, rows], and the backward that takes the final out and lse.

    Both take `window=(left, right)`, flash's band per segment (bottom-right aligned: query row r of Lq sees key
    column c of Lk when -left <= c - r - (Lk - Lq) <= right, -1 unbounded), where `window` is True: torch's
    varlen_attn takes window_size and aten::_flash_attention_backward window_size_left/right."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    window: bool = False


@functools.cache
def lse_kernels() -> LseKernels | None:
    """The ring's CUDA block kernels, or None when this torch lacks them (the ring then runs its fp32 math kernel)."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        log.debug("ring: torch %s has no varlen_attn; blocks run the fp32 math kernel", torch.__version__)
        return None
    params = _parameters(varlen_attn)
    causal_kw = _causal_keywords(params)
    flash_backward = flash_attention_backward()
    problem = flash_backward_problem()
    if causal_kw is None or "return_aux" not in params or flash_backward is None:
        log.debug("ring: no usable flash varlen kernel with lse (%s); blocks run the fp32 math kernel",
                  problem or f"varlen_attn takes {list(params)}")
        return None
    gqa = "enable_gqa" in params
    flash_backward_op, backward_names = flash_backward
    takes_window = "window_size" in params and "window_size_left" in backward_names

    def forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
        kw: dict[str, Any]  # the causal switch this varlen_attn takes, and enable_gqa
        kw = dict(window_size=(-1, 0) if causal else (-1, -1)) if "window_size" in causal_kw else {"is_causal": causal}
        if window is not None:
            if not takes_window:
                raise ZooError(f"torch {torch.__version__}'s flash varlen kernels take no window")
            kw = {"window_size": window}
        if gqa:
            kw["enable_gqa"] = k.shape[1] != q.shape[1]
        out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True), scale=scale, **kw)
        return out, lse if lse.shape[0] == q.shape[1] else lse.T  # flash's lse is [heads, tokens]

    def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, delta: Tensor, cu_q: Tensor,
                 cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                 window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # the flash backward recomputes P from (q, k, lse) and rowsum(dO * O) from (o, do): handed the final out and
        # lse of the whole ring, it returns exactly this block's share of the gradient
        # what torch's own varlen backward passes (dropout is 0, so the kernel never reads it): uint64 zeros
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        # a window as torch's own varlen backward passes it: is_causal off, the band as window_size_left/right
        band = {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}
        return flash_backward_op(
            do.to(q.dtype).contiguous(), q, k, v, o.to(q.dtype).contiguous(), lse.contiguous(), cu_q, cu_k, max_q,
            max_k, 0.0, causal and window is None, rng_state, unused, scale=scale, **band)

    log.debug("ring: torch varlen_attn with lse, backward through aten::_flash_attention_backward (window: %s)",
              takes_window)
    return LseKernels("torch varlen_attn (lse) + aten::_flash_attention_backward", forward, backward, takes_window)


def require_lse_kernels() -> LseKernels:
    """`lse_kernels()`, or a ZooError that says what this torch lacks."""
    kernels = lse_kernels()
    if kernels is None:
        why = flash_backward_problem() or "its varlen_attn has no return_aux or causal switch"
        raise ZooError(f"the ring's flash kernel needs torch.nn.attention.varlen.varlen_attn with return_aux and "
                       f"aten::_flash_attention_backward as in torch 2.11-2.13; this is torch {torch.__version__} "
                       f"({why})")
    return kernels


def compile_copy(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """torch.compile of a copy of `fn` with a code object of its own. Dynamo keeps its compilations per code object
    and gives up after `recompile_limit` (8) of them (with fullgraph: an error; else the function runs uncompiled,
    which for flex attention means a dense T x T score matrix). Copies made per model config or per shape each get
    their own count, and leave the process-wide limit alone."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__wrapped__ = fn  # type: ignore[attr-defined]
    return torch.compile(copy, **options)

