"""Document-causal attention over a packed batch, one plain function per backend.

Every backend has the same signature, `fn(q_TNH, k_TKH, v_TKH, packed, scale=None, window=None) -> o_TNH`: T tokens,
N query heads, K key/value heads (N divisible by K, query head i reads KV head i // (N // K)), H head dim.
A token attends to itself and to the earlier tokens of its own document, never to another document.
`window` (a positive int, or None for no limit) makes it sliding-window attention as transformers has it
(masking_utils.sliding_window_overlay: `kv_idx > q_idx - window`): the token at position i of a document sees
the keys j of that document with i - window < j <= i, `window` keys counting itself (Mistral, Qwen2/3).
`causal=False` (the backends' keyword; no wrapper passes it) lets every token see its whole document instead: a
vision tower's images (or windows of one) are the documents of a pack of patches.
Score modifiers (zoo.core.score_mods) come as keyword options `sinks` ([N] logits, GPT-OSS) and `softcap` (Gemma 2),
passed only where set; every backend honours them, by the path `describe` names.
`attn=` names one of `BACKENDS`; sequence parallelism wraps the chosen function and leaves models alone. The
BlockMasks flex runs a pack with are built in zoo.core.flex_masks.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core import blocks as bidi
from zoo.core.flex_masks import FLEX_BLOCK, causal_block_mask, document_block_mask, full_block_mask
from zoo.core.internals import run_eagerly
from zoo.core.kernels import VarlenKernel, compile_copy, lse_kernels, varlen_kernel
from zoo.core.packing import Packed
from zoo.core.score_mods import SinkVarlen, cap, check_mods, check_window, mods, softcap_mod, softmax, with_sinks
from zoo.errors import ZooError

# re-exported: the homes of check_window and of the BlockMask builders are zoo.core.score_mods and .flex_masks
__all__ = ["check_window", "FLEX_BLOCK", "document_block_mask"]
# fn(q_TNH, k_TKH, v_TKH, packed, scale=None, window=None, *, sinks=None, softcap=None) -> o_TNH: a backend, or a
# wrapper zoo installs around one (sequence parallelism, the KV cache), which takes and honours the options the same way
AttentionFn = Callable[..., Tensor]


def band_mask(q_len: int, k_len: int, window: int | None, device: torch.device | str = "cpu") -> Tensor:
    """[q_len, k_len] bool, True where query i (the last q_len of k_len positions) sees key j: causal, and within
    `window` keys of it. Query i sits at position i + k_len - q_len, so a decode step's one query is the last."""
    pos_q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    pos_k = torch.arange(k_len, device=device)[None, :]
    allowed = pos_k <= pos_q
    return allowed if window is None else allowed & (pos_k > pos_q - window)


def _doc_runs(packed: Packed) -> list[tuple[int, int]]:
    """(length, count): runs of consecutive documents of equal length, so they can share one kernel call. Like
    every per-pack structure here, built once per pack (`Packed.derived`) and shared by every layer."""

    def build() -> list[tuple[int, int]]:
        runs: list[list[int]] = []
        for n in packed.seqlens():
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        return [(n, count) for n, count in runs]

    return packed.derived("doc runs", build)


def _whole(packed: Packed) -> None:
    """A part of a pack (a sequence-parallel shard) holds pieces of documents, a forked pack paths that share
    tokens: attention over either as it is would be silently wrong."""
    if packed.part_of() is not None:
        raise ZooError("this Packed is a sequence-parallel shard; attention over it needs the model wrapped by "
                       "the same SequenceParallel: model = sp.apply(model)")
    if packed.forks() is not None:
        raise ZooError("this Packed's documents fork (they share their start, laid out once: zoo.core.forks); "
                       "attention over it needs each path gathered as a document (recipes.dpo.SharedPromptAttention)")


def eager(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
          window: int | None = None, causal: bool = True, *, sinks: Tensor | None = None,
          softcap: float | None = None) -> Tensor:
    """The reference: softmax(cap(q k^T * scale) + causal (window, block) mask, sinks) v, one document at a time,
    fp32 softmax."""
    _whole(packed)
    check_window(window)
    _, N, H = q_TNH.shape
    check_mods(sinks, softcap, N)
    K = k_TKH.shape[1]
    scale = H**-0.5 if scale is None else scale
    outs = []
    lens = packed.seqlens()
    blocks = [None] * len(lens) if packed.blocks is None else packed.blocks.split(lens)
    for L, q_LNH, k_LKH, v_LKH, b_L in zip(lens, q_TNH.split(lens), k_TKH.split(lens), v_TKH.split(lens), blocks):
        # query heads grouped under their KV head: [K, G, L, H] against [K, 1, L, H], no K/V repeat
        q_KGLH = q_LNH.view(L, K, N // K, H).permute(1, 2, 0, 3)
        k_K1LH = k_LKH.permute(1, 0, 2).unsqueeze(1)
        v_K1LH = v_LKH.permute(1, 0, 2).unsqueeze(1)
        scores_KGLL = cap((q_KGLH @ k_K1LH.transpose(-1, -2)) * scale, softcap)
        if causal:
            allowed_LL = band_mask(L, L, window, q_TNH.device) if b_L is None else bidi.document_mask(b_L, window)
            scores_KGLL = scores_KGLL.masked_fill(~allowed_LL, float("-inf"))
        probs_KGLL = softmax(scores_KGLL, None if sinks is None else sinks.view(K, N // K, 1, 1), q_TNH.dtype)
        o_KGLH = probs_KGLL @ v_K1LH
        outs.append(o_KGLH.permute(2, 0, 1, 3).reshape(L, N, H))
    return torch.cat(outs)


def _band(packed: Packed, L: int, window: int, device: torch.device) -> Tensor:
    """The [L, L] band of one run length, built once per pack and window and shared by every layer."""
    return packed.derived(("band", window, L, str(device)), lambda: band_mask(L, L, window, device))


def sdpa(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
         window: int | None = None, causal: bool = True, *, sinks: Tensor | None = None,
         softcap: float | None = None) -> Tensor:
    """torch SDPA per run of equal-length documents with is_causal, so no T x T mask is ever built; with a window
    shorter than a run's documents, a [L, L] band mask for that run instead (one per pack, window and length).
    SDPA has no score modifier and returns no lse: a layer with sinks or a softcap runs `eager` (exact)."""
    _whole(packed)
    check_window(window)
    _, N, H = q_TNH.shape
    check_mods(sinks, softcap, N)
    if sinks is not None or softcap is not None:
        return eager(q_TNH, k_TKH, v_TKH, packed, scale, window, causal, sinks=sinks, softcap=softcap)
    K = k_TKH.shape[1]
    runs = _doc_runs(packed)
    # split (not slicing) so that the backward is one concatenation, not a zero-filled [T, ...] per document
    sizes = [L * count for L, count in runs]
    outs = []
    masks = bidi.run_masks(packed, window, runs)
    for (L, count), q, k, v, mask in zip(runs, q_TNH.split(sizes), k_TKH.split(sizes), v_TKH.split(sizes), masks):
        # [count, heads, L, H] views of the run: equal-length neighbours batch without a copy
        q = q.view(count, L, N, H).transpose(1, 2)
        k = k.view(count, L, K, H).transpose(1, 2)
        v = v.view(count, L, K, H).transpose(1, 2)
        if not causal or (mask is None and (window is None or window >= L)):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=K != N)
        else:  # the diagonal is always allowed, so no row is fully masked (which would give NaN)
            mask = _band(packed, L, window or L, q.device) if mask is None else mask
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=K != N)
        outs.append(o.transpose(1, 2).reshape(L * count, N, H))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@functools.cache
def _compiled_flex(device_type: str, shape: tuple[int, ...] = ()) -> Callable[..., Any]:
    """GPU: one compilation with automatic dynamic shapes, so packs of new lengths do not recompile. CPU: static
    shapes (inductor's CPU flex template fails to compile with dynamic shapes in torch 2.13), one compiled copy per
    shape, so that a ninth pack length never hits dynamo's recompile limit and runs flex uncompiled (dense)."""
    from torch.nn.attention.flex_attention import flex_attention

    return compile_copy(flex_attention, dynamic=False if device_type == "cpu" else None)


def flex(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
         window: int | None = None, causal: bool = True, *, sinks: Tensor | None = None,
         softcap: float | None = None) -> Tensor:
    """Compiled FlexAttention with a document-causal (windowed, bidirectional within `packed.blocks`) BlockMask,
    built once per pack and window and shared by all layers; tiles outside the window are skipped. A softcap is its
    score_mod; sinks correct the output by the lse it returns (differentiable through it)."""
    _whole(packed)
    check_window(window)
    check_mods(sinks, softcap, q_TNH.shape[1])
    if q_TNH.device.type == "cpu" and torch.is_grad_enabled() and q_TNH.requires_grad:
        raise ZooError(
            "attn='flex' cannot train on CPU: torch has no CPU backward for FlexAttention. "
            "Use attn='sdpa' (or 'eager') to train on CPU, or run flex under torch.no_grad()"
        )
    N, K = q_TNH.shape[1], k_TKH.shape[1]
    shape = (*q_TNH.shape, k_TKH.shape[1], window or 0) if q_TNH.device.type == "cpu" else ()
    extra: dict[str, Any] = {}
    if softcap is not None:
        extra["score_mod"] = softcap_mod(float(softcap))
    if sinks is not None:
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    key = (softcap is not None, sinks is not None)  # each kind of call its own compiled copy
    run = _compiled_flex(q_TNH.device.type, shape + key if key != (False, False) else shape)
    if sinks is not None and q_TNH.device.type == "cpu":  # inductor's CPU flex returns no lse: flex uncompiled
        run = _uncompiled_flex
    o = run(
        q_TNH.transpose(0, 1)[None],
        k_TKH.transpose(0, 1)[None],
        v_TKH.transpose(0, 1)[None],
        block_mask=causal_block_mask(packed, window) if causal else full_block_mask(packed),
        scale=scale,
        enable_gqa=K != N,
        **extra,
    )
    if sinks is None:
        return o[0].transpose(0, 1)
    o, aux = o
    return with_sinks(o[0].transpose(0, 1), aux.lse[0], sinks)


def _uncompiled_flex(*args: Any, **kwargs: Any) -> Any:
    """FlexAttention run eagerly (dense scores; forward-only tests on CPU), its warning saying so silenced."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def flash_varlen(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
                 window: int | None = None, causal: bool = True, *, sinks: Tensor | None = None,
                 softcap: float | None = None) -> Tensor:
    """The fused varlen kernel this process has (flash-attn 3/2/4, else torch's varlen_attn; `describe` names it).

    CUDA only, half precision. GQA is native except on a torch whose varlen_attn refuses fewer K/V heads, where K/V
    are repeated per query head (N/K times the K/V memory of the call). A window runs in the kernel where its
    signature takes one, else on flex with the windowed BlockMask (`describe` says which), as are `packed.blocks`.
    A softcap runs in the kernel where it takes one (flash-attn), else on flex; sinks through torch's varlen kernels
    with lse (the output corrected by the sinks, the flash backward handed the final lse), else on flex."""
    _whole(packed)
    check_window(window)
    check_mods(sinks, softcap, q_TNH.shape[1])
    if not q_TNH.is_cuda:
        raise ZooError(
            f"attn='flash_varlen' needs a CUDA device, tensors are on {q_TNH.device.type}; "
            f"backends that run here: {', '.join(available_backends(q_TNH.device))}"
        )
    kernel = varlen_kernel()
    if kernel is None:
        raise ZooError(f"attn='flash_varlen' needs flash-attn (pip install flash-attn) or a torch with "
                       f"torch.nn.attention.varlen (2.10 or later); this is torch {torch.__version__}. "
                       f"attn='sdpa' or 'flex' run without either")
    if not causal:  # the varlen kernels are called causal only: a tower's images run sdpa (one call per size)
        return sdpa(q_TNH, k_TKH, v_TKH, packed, scale, causal=False, **mods(sinks, softcap))
    return _varlen(kernel, q_TNH, k_TKH, v_TKH, packed, scale, window, sinks=sinks, softcap=softcap,
                   lse=lse_kernels() if sinks is not None else None)


def _varlen(kernel: VarlenKernel, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None,
            window: int | None, *, sinks: Tensor | None = None, softcap: float | None = None,
            lse: Any = None) -> Tensor:
    """flash_varlen past its checks (tests drive it on CPU with stand-in kernels; `lse`: a zoo.core.kernels.
    LseKernels, for sinks)."""
    if window is not None and window >= packed.max_seqlen:
        window = None  # no document is long enough for the window to cut it
    if sinks is not None:
        if softcap is None and lse is not None and packed.blocks is None and (window is None or lse.window):
            band = None if window is None else (window - 1, 0)
            scale = q_TNH.shape[-1] ** -0.5 if scale is None else scale
            return SinkVarlen.apply(q_TNH, k_TKH, v_TKH, sinks, packed.cu_seqlens, packed.max_seqlen, scale, band,
                                    lse.forward, lse.backward)
        return flex(q_TNH, k_TKH, v_TKH, packed, scale, window=window, sinks=sinks, softcap=softcap)
    if softcap is not None and not kernel.softcap:
        return flex(q_TNH, k_TKH, v_TKH, packed, scale, window=window, softcap=softcap)
    if packed.blocks is None and (window is None or kernel.window):
        return kernel.attend(q_TNH, k_TKH, v_TKH, packed.cu_seqlens, packed.max_seqlen, scale, window,
                             **mods(None, softcap))
    # a kernel without a window (torch 2.10's varlen_attn, a flash-attn without window_size), or bidirectional blocks
    # (no varlen kernel takes them): FlexAttention with the BlockMask, which skips what the mask excludes as the kernel
    # does and has a backward on CUDA
    return flex(q_TNH, k_TKH, v_TKH, packed, scale, window=window, **mods(None, softcap))


def pick_backend(device: torch.device, dtype: torch.dtype) -> str:
    """What `auto` runs: the fastest backend that can do the job on this device and dtype."""
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and varlen_kernel() is not None:
            return "flash_varlen"
        return "sdpa" if dtype in (torch.float16, torch.bfloat16) else "flex"
    return "sdpa"


# auto on a GPU with cuDNN's attention (compute capability 9.0 on, half precision): a pack whose longest document
# has at least this many tokens runs sdpa (cuDNN per run of equal-length documents), a shorter one the varlen kernel.
# Measured on an H100, torch 2.11, 32/8 heads of 128, fwd+bwd (bench_gpu.py --only attn, 2026-11-26): 32K tokens,
# 14 documents, the longest 8,192: sdpa 9.89 ms, varlen_attn 14.18 ms (1.43x); 8K tokens, 12 documents, the longest
# 2,801: varlen 1.91 ms, sdpa 2.34 ms. Where between 2,801 and 8,192 they cross is not measured yet
# (bench_gpu.py --only attnlen times both around it).
SDPA_LONGEST_DOC = 8192
CUDNN_CAPABILITY = (9, 0)  # cuDNN's fused attention, which sdpa picks for long documents, from Hopper on


def auto_choice(capability: tuple[int, int] | None, dtype: torch.dtype, longest: int, window: int | None = None,
                varlen: bool = True) -> str:
    """What `auto` runs for one pack: a pure function of the device's compute capability (None: not CUDA), the
    dtype, the pack's longest document and the window, given whether a varlen kernel is installed (`varlen`).
    Long documents go to sdpa where cuDNN serves it (one kernel per run of equal lengths costs little when the
    documents are long, and cuDNN's kernel is the faster there); windows stay on the varlen kernel (sdpa would
    build a band mask per run)."""
    if capability is None:
        return "sdpa"
    half = dtype in (torch.float16, torch.bfloat16)
    if not half:
        return "flex"
    if not varlen:
        return "sdpa"
    if window is None and capability >= CUDNN_CAPABILITY and longest >= SDPA_LONGEST_DOC:
        return "sdpa"
    return "flash_varlen"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def auto(q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
         window: int | None = None, causal: bool = True, *, sinks: Tensor | None = None,
         softcap: float | None = None) -> Tensor:
    """`auto_choice` for these tensors and this pack (on CPU: `pick_backend`'s sdpa)."""
    device = q_TNH.device
    if device.type != "cuda":
        name = pick_backend(device, q_TNH.dtype)
    else:
        name = auto_choice(_capability(device.index if device.index is not None else torch.cuda.current_device()),
                           q_TNH.dtype, packed.max_seqlen, window, varlen_kernel() is not None)
    return BACKENDS[name](q_TNH, k_TKH, v_TKH, packed, scale, window=window, **({} if causal else {"causal": False}),
                          **mods(sinks, softcap))


def attention_flops(seqlens: Sequence[int], n_heads: int, head_dim: int, causal: bool = True,
                    window: int | None = None) -> int:
    """Forward FLOPs of one attention layer over documents of these lengths: q k^T and p v, 2 FLOP per
    multiply-add, on the L(L+1)/2 (query, key) pairs of a causal document of length L, or L^2 when not causal;
    with a sliding `window` a query pairs with at most `window` keys (itself included)."""
    def causal_pairs(L: int) -> int:
        if window is None or L <= window:
            return L * (L + 1) // 2
        return window * (window + 1) // 2 + (L - window) * window

    pairs = sum(causal_pairs(L) for L in seqlens) if causal else sum(L * L for L in seqlens)
    return 2 * 2 * n_heads * head_dim * pairs


# eager and sdpa loop in Python over a pack's documents (one by one; runs of equal lengths): traced by torch.compile,
# the loop guards on the pack's structure, so every new one recompiled the block, and past dynamo's limit the block ran
# uncompiled. Inside a compiled block they run eagerly (zoo.core.internals.run_eagerly); the projections and the MLP
# around them stay compiled.
BACKENDS: dict[str, AttentionFn] = {
    "eager": run_eagerly(eager),
    "sdpa": run_eagerly(sdpa),
    "flex": flex,
    "flash_varlen": flash_varlen,
    "auto": auto,
}


def available_backends(device: torch.device | str) -> list[str]:
    """The backend names that run on `device` in this process (on CPU, flex runs forward only)."""
    device = torch.device(device)
    if device.type == "cuda" and varlen_kernel() is not None:
        return list(BACKENDS)
    return [name for name in BACKENDS if name != "flash_varlen"]


def describe(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """What each backend runs on `device` for `dtype` in this process, e.g. describe("cuda")["flash_varlen"]."""
    device = torch.device(device)
    kernel = varlen_kernel() if device.type == "cuda" else None
    flash = ("needs a CUDA device" if device.type != "cuda" else
             "unavailable: install flash-attn or use torch 2.10 or later" if kernel is None else
             f"{kernel.name}, GQA {kernel.gqa}, window "
             + ("in the kernel" if kernel.window else "on flex (windowed BlockMask): the kernel takes none")
             + "; softcap " + ("in the kernel" if kernel.softcap else "on flex (score_mod)")
             + "; sinks " + ("by torch's varlen kernels with lse (a softcap too: on flex)" if lse_kernels() is not None
                             else "on flex (lse correction)")
             + "; a pack with bidirectional blocks (Gemma 3's images) on flex with their BlockMask")
    out = {
        "eager": "reference: softmax(q k^T) v per document, fp32 softmax (softcap on the scores, sinks in the softmax)",
        "sdpa": "torch scaled_dot_product_attention per run of equal-length documents (is_causal; a window: "
        "a band mask per run; bidirectional blocks: a mask per run holding one); a layer with sinks or a softcap "
        "runs eager",
        "flex": "compiled FlexAttention, document-causal (windowed) BlockMask from cu_seqlens; softcap as score_mod, "
        "sinks by the returned lse" + (" (forward only on CPU; with sinks uncompiled: CPU flex returns no lse)"
                                       if device.type == "cpu" else ""),
        "flash_varlen": flash,
    }
    out["auto"] = f"{pick_backend(device, dtype)} for {str(dtype).removeprefix('torch.')} on {device.type}"
    if out["auto"].startswith("flash_varlen"):
        out["auto"] += (f"; sdpa for a pack whose longest document has >= {SDPA_LONGEST_DOC} tokens where cuDNN "
                        f"serves it (compute capability >= {CUDNN_CAPABILITY[0]}.{CUDNN_CAPABILITY[1]})")
    return out


def get_attention(name: str | AttentionFn) -> AttentionFn:
    """Look up a backend by name (a callable with the backend signature passes through)."""
    if callable(name):
        return name
    if name not in BACKENDS:
        close = difflib.get_close_matches(str(name), BACKENDS, n=len(BACKENDS), cutoff=0.0)
        raise ZooError(f"unknown attn={name!r}; valid backends: {', '.join(close)}")
    return BACKENDS[name]
