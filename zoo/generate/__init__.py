"""Generation with a KV cache: prompts prefilled as one packed batch, then decoded together, one token each a step.

The cache (zoo.generate.cache) never enters a model module: `generate` installs its `CachedAttention` through
the model contract's `set_attention`, each layer getting the function of its own index, hands the cache to every
mixer that keeps state of its own through the contract's `Mixer.use_cache` (Gated DeltaNet's recurrent state),
and restores the model's own function afterwards (`_cache_installed`). The prefill (`_prefill`) runs the prompts
as one `Packed` through the model's backend, writing every layer's K/V rows; each decode step (`_decode_steps`)
runs one token per sequence (`decode_pack`) over the cached rows; `_Outputs` keeps what each sequence produced.

A decode step embeds its tokens itself and runs the language model alone: decoded tokens are text (LLaVA's
images went in with the prefill, so its vision tower never runs on zero images a step), and the ids come from the
model's own head, so the per-pack id check (a host sync) has nothing to find.

`compile=True` (by default on CUDA) runs the decode step through `torch.compile` (CUDA graphs on CUDA): its
shapes are static (the cache is preallocated at a capacity rounded up to `CAPACITY_STEP`, attention runs over all
of it with a mask built from the positions on the device) and it holds no host sync, so it is captured whole.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core.contract import TextModel, ZooModel
from zoo.core.internals import mark_static_address
from zoo.core.kernels import compile_copy
from zoo.core.packing import ImagePatches, Packed, pack
from zoo.core.score_mods import cap
from zoo.errors import ZooError
from zoo.generate.cache import CachedAttention, KVCache, decode_pack, static_cache
from zoo.generate.fused import decode_model

Images = Tensor | ImagePatches  # one prompt's images (zoo.pack's)

# a compiled step's cache capacity is rounded up to this, so that prompts of other lengths reuse its graph
CAPACITY_STEP = 256
STOP_CHECK_EVERY = 8  # compiled decoding: steps between host checks of whether every sequence has stopped


def _decode_logits(lm: TextModel, token_n: Tensor, position_n: Tensor, offset_n: Tensor | None = None) -> Tensor:
    """[n, V] logits of one decoding step; the whole of what `compile` compiles. offset_n: the model's
    `decode_offsets` (M-RoPE's positions continue from the prompt's images)."""
    n = token_n.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=token_n.device)
    # decode_pack's pack without its lengths as ints (nothing in a static step reads them): a list of n ints would
    # make n a constant of the graph, and every batch size its own compilation
    packed = Packed(token_n, cu, position_n, 1, doc_len=position_n + 1,
                    position_ids_3T=None if offset_n is None else (position_n + offset_n).expand(3, -1))
    return cap(F.linear(lm.hidden(packed, x_TD=lm.embed(token_n)), lm.head_weight), lm.final_softcap)


# torch.compile's backend for the decode step; tests on CPU may pick "aot_eager", which traces the same graph
# without inductor's C++ build (seconds instead of a quarter minute per model)
COMPILE_BACKEND = "inductor"
_COMPILED: dict[tuple[str, str, object], Callable[[TextModel, Tensor, Tensor, Tensor | None], Tensor]] = {}


def _compiled_decode(device: torch.device,
                     lm: TextModel) -> Callable[[TextModel, Tensor, Tensor, Tensor | None], Tensor]:
    """`_decode_logits` compiled whole (fullgraph: a graph break would be a host sync, so it is an error); on CUDA
    as CUDA graphs, since a small model's decode step is bound by kernel launches there.

    One copy of the step per model config: dynamo keeps its compilations per code object and stops (with fullgraph,
    fails) after `recompile_limit` (8) of them, which a process decoding with several models, batch sizes and
    cache sizes would reach. A copy with its own code object has its own count; models of one config share it."""
    mode = "reduce-overhead" if device.type == "cuda" and COMPILE_BACKEND == "inductor" else None
    key = (COMPILE_BACKEND, mode or "default", lm.config)
    if key not in _COMPILED:
        _COMPILED[key] = compile_copy(_decode_logits, fullgraph=True, backend=COMPILE_BACKEND, mode=mode)
    return _COMPILED[key]


def _check_prompts(prompts: Sequence[Tensor]) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ZooError(f"generate() takes a non-empty list of 1-D token tensors, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, Tensor) or p.dim() != 1 or p.numel() == 0 or p.dtype.is_floating_point or \
                p.dtype.is_complex or p.dtype == torch.bool:
            got = f"shape {tuple(p.shape)} {p.dtype}" if isinstance(p, Tensor) else type(p).__name__
            raise ZooError(f"generate(): prompt {i} must be a non-empty 1-D tensor of token ids, got {got}")


MIN_TEMPERATURE = 1e-3  # below it logits / temperature overflow to inf and the softmax is NaN: use 0 (greedy)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_options(model: ZooModel, max_new_tokens: int, temperature: float, top_k: int | None,
                   top_p: float | None, repetition_penalty: float, stop: Sequence[int] | None,
                   seed: int | None) -> None:
    """One ZooError for each option of the wrong type or range (the CLI turns it into exit code 2)."""
    vocab = model.head_weight.shape[0]
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ZooError(f"generate(): max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf \
            or 0 < temperature < MIN_TEMPERATURE:
        raise ZooError(f"generate(): temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got "
                       f"{temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ZooError(f"generate(): top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ZooError(f"generate(): top_p must be a number in (0, 1] or None, got {top_p!r}")
    if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, (int, float)) \
            or not 0 < repetition_penalty < math.inf:
        raise ZooError(f"generate(): repetition_penalty must be a finite number above 0 (1: none), got "
                       f"{repetition_penalty!r}")
    if stop is not None and (not isinstance(stop, (list, tuple, set, frozenset)) or
                             not all(_is_int(i) and 0 <= i < vocab for i in stop)):
        raise ZooError(f"generate(): stop must be a list of token ids in 0..{vocab - 1} (or None: the checkpoint's "
                       f"eos ids), got {stop!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise ZooError(f"generate(): seed must be an integer in 0..2**64-1 or None, got {seed!r}")


def _check_cache_fits(model: ZooModel, n: int, capacity: int, device: torch.device) -> None:
    """The generation state of n sequences of `capacity` rows fits in the device's memory (max_new_tokens=10**12
    would otherwise try to allocate terabytes): what each mixer says its state takes (zoo.core.mixer.Mixer)."""
    itemsize = model.head_weight.element_size()
    need = sum(m.generation_bytes(n, capacity, itemsize) for m in model.decoder.mixers())
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else need
    if need > have:
        raise ZooError(f"generate(): the KV cache for {n} prompt(s) of up to {capacity} tokens needs "
                       f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB this {device.type} has; "
                       f"lower max_new_tokens")


def _penalize(logits_nV: Tensor, seen_nV: Tensor | None, penalty: float) -> Tensor:
    """The CTRL paper's repetition penalty, as transformers applies it: the logit of each token already in the
    sequence (prompt or output) divided by `penalty` where positive, multiplied by it where negative."""
    if seen_nV is None:
        return logits_nV
    return torch.where(seen_nV, torch.where(logits_nV > 0, logits_nV / penalty, logits_nV * penalty), logits_nV)


def _pick(logits_nV: Tensor, temperature: float, top_k: int | None, top_p: float | None,
          generator: torch.Generator | None) -> Tensor:
    """The next token of each sequence: argmax at temperature 0, else a sample from the (top-k, top-p) softmax."""
    if temperature == 0.0:
        return logits_nV.argmax(dim=-1)
    logits_nV = logits_nV.float() / temperature
    if top_k is not None and top_k < logits_nV.shape[-1]:
        kth = logits_nV.topk(top_k, dim=-1).values[:, -1:]
        logits_nV = logits_nV.masked_fill(logits_nV < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_nV, order = logits_nV.sort(dim=-1, descending=True)
        probs = sorted_nV.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits_nV = logits_nV.scatter(-1, order, sorted_nV.masked_fill(drop, float("-inf")))
    probs_nV = logits_nV.softmax(-1)
    return torch.multinomial(probs_nV, 1, generator=generator)[:, 0]


@dataclass
class _Outputs:
    """What the decode loop keeps per sequence: its new tokens, whether it stopped, how many it produced, and which
    tokens it holds (for the repetition penalty; None without one)."""

    tokens_nS: Tensor
    done_n: Tensor
    produced_n: Tensor
    seen_nV: Tensor | None

    @staticmethod
    def start(prompts: Sequence[Tensor], max_new_tokens: int, vocab: int, penalize: bool,
              device: torch.device) -> _Outputs:
        n = len(prompts)
        seen_nV = None
        if penalize:
            seen_nV = torch.zeros(n, vocab, dtype=torch.bool, device=device)
            for i, p in enumerate(prompts):
                seen_nV[i, p[(p >= 0) & (p < vocab)].to(device)] = True  # not LLaVA's placeholder past it
        return _Outputs(torch.zeros(n, max_new_tokens, dtype=torch.int64, device=device),
                        torch.zeros(n, dtype=torch.bool, device=device),
                        torch.zeros(n, dtype=torch.int64, device=device), seen_nV)

    def add(self, step: int, token_n: Tensor, stop_ids: Tensor) -> Tensor:
        """Record this step's tokens (0 for sequences stopped earlier); returns them."""
        token_n = torch.where(self.done_n, torch.zeros_like(token_n), token_n)
        if self.seen_nV is not None:
            self.seen_nV.scatter_(1, token_n[:, None], True)
        self.tokens_nS[:, step] = token_n
        self.produced_n += (~self.done_n).long()
        self.done_n |= torch.isin(token_n, stop_ids)
        return token_n

    def result(self) -> list[Tensor]:
        return [self.tokens_nS[i, :k] for i, k in enumerate(self.produced_n.tolist())]  # one host sync for all


@contextmanager
def _cache_installed(model: ZooModel, cache: KVCache) -> Iterator[CachedAttention]:
    """The cache in every layer for the duration: the cached attention function through `set_attention`, every
    mixer's own state through the contract's `Mixer.use_cache`; the model's own function back after."""
    backend = model.attend
    cached = CachedAttention(backend, cache)
    mixers = model.decoder.mixers()
    model.set_attention(cached)
    for mixer in mixers:
        mixer.use_cache(cache)
    try:
        yield cached
    finally:
        model.set_attention(backend)
        for mixer in mixers:
            mixer.use_cache(None)


def _prefill(model: ZooModel, prompts: Sequence[Tensor], images: Sequence[Images | None] | None,
             device: torch.device) -> tuple[Tensor, Tensor | None]:
    """([n, V] the logits after each prompt, the model's decode offsets): the prompts as one packed batch through
    the whole model (the images written into their placeholders), filling every layer's cache."""
    packed = pack([p.to(device) for p in prompts], images=None if images is None else list(images))
    h_TD = model.hidden(packed)
    last = packed.cu_seqlens[1:].long() - 1
    return cap(F.linear(h_TD[last], model.head_weight), model.decoder.final_softcap), model.decode_offsets(packed)


def _decode_steps(model: ZooModel, lm: TextModel, cache: KVCache, cached: CachedAttention, lengths: Tensor,
                  compiled: bool, device: torch.device, offset_n: Tensor | None) -> Callable[[Tensor], Tensor]:
    """The decode step after the prefill: [n] tokens -> [n, V] logits of `lm` (the language model alone, fused
    or not), one token each sequence on. Compiled: the static step (`_decode_logits`, the positions on the device);
    else eager, the cache's rows read to the host."""
    cache.lengths = lengths.clone()
    cached.decoding = True
    if compiled:
        step_fn = _compiled_decode(device, lm)
        cached.static = True
        position = [lengths.to(device)]
        if device.type == "cuda":
            # the caches are written in place by the step: CUDA graphs take that only of inputs at fixed
            # addresses (no guard: caches at new addresses re-record the graph rather than recompile it)
            for buf in cache.buffers():
                mark_static_address(buf)

        def compiled_step(token_n: Tensor) -> Tensor:
            logits_nV = step_fn(lm, token_n, position[0], offset_n)
            position[0] = position[0] + 1
            return logits_nV

        return compiled_step

    def eager_step(token_n: Tensor) -> Tensor:
        cache.begin_step(device)
        packed = decode_pack(token_n, cache.positions)
        if offset_n is not None:
            packed.position_ids_3T = (cache.positions + offset_n).expand(3, -1)
        h_TD = lm.hidden(packed, x_TD=lm.embed(token_n))
        logits_nV = cap(F.linear(h_TD, model.head_weight), lm.final_softcap)
        cache.lengths += 1
        return logits_nV

    return eager_step


@torch.no_grad()
def generate(model: ZooModel, prompts: Sequence[Tensor], *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0,
             stop: Sequence[int] | None = None, seed: int | None = None, images: Sequence[Images | None] | None = None,
             on_token: Callable[[Tensor], None] | None = None, compile: bool | None = None,
             fuse: bool | None = None) -> list[Tensor]:
    """The new tokens of each prompt (1-D LongTensors), decoded with a KV cache.

    prompts: 1-D LongTensors of any lengths, prefilled together as one packed batch. temperature 0 is greedy;
    otherwise sampling, after top_k / top_p filtering, from a generator seeded with `seed` (None: torch's global
    generator, advanced as any draw advances it, never reseeded). Prompts are sampled together, one draw a step for
    the batch, so a prompt's sampled tokens depend on the rest of the batch. repetition_penalty (transformers'
    `repetition_penalty`, 1: none) scales down, before any of that, the logits of the tokens a sequence already
    holds (its prompt and output), which keeps greedy decoding of a small model out of loops. A sequence stops after
    producing one of the `stop` ids (kept in its output; default: the checkpoint's `model.eos_token_ids`, [] for
    none) or after max_new_tokens. images: the images per prompt as for zoo.pack (LLaVA's pixel values, Qwen2.5-VL's
    `ImagePatches` from zoo.io.image.preprocess), written into the prompt's placeholder tokens during the prefill;
    M-RoPE positions continue from each prompt's images while decoding. on_token: called after each step with its
    new tokens [n] (0 for sequences stopped earlier), e.g. to stream text. compile: run each decode step through
    torch.compile (CUDA graphs on CUDA); None compiles on CUDA only, where a step is bound by kernel launches and it
    pays. The first compiled call of a model and shape takes seconds (a second batch size or cache size compiles once
    more, then no more); greedy tokens equal the eager ones up to float rounding (attention then spans the whole cache
    with a mask). The compiled path keeps its last KV cache allocated, to reuse at the same addresses.
    fuse: decode steps run each layer's q/k/v and gate/up as one product each (zoo.generate.fused: concatenated
    copies of those weights, built at the call; the compiled path keeps them for the next call on the same weights);
    None fuses on CUDA only. Greedy tokens equal the unfused path's up to float rounding.
    """
    _check_prompts(prompts)
    _check_options(model, max_new_tokens, temperature, top_k, top_p, repetition_penalty, stop, seed)
    device = model.head_weight.device
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    _check_cache_fits(model, n, int(lengths.max()) + max_new_tokens, device)
    stop = model.eos_token_ids if stop is None else stop
    stop_ids = torch.tensor(sorted(set(stop)), dtype=torch.int64, device=device)
    generator = None  # seed None: torch's global generator, as transformers draws (and nothing reseeds it)
    if temperature > 0 and seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    outputs = _Outputs.start(prompts, max_new_tokens, model.head_weight.shape[0], repetition_penalty != 1.0, device)
    if max_new_tokens == 0:
        return outputs.result()

    compiled = device.type == "cuda" if compile is None else compile
    # a decode step runs the language model alone (LLaVA's images went in with the prefill), its q/k/v and gate/up
    # projections fused where `fuse` says (zoo.generate.fused: a copy of those weights, the model's untouched)
    lm = decode_model(model.decoder, fuse, device, compiled)
    capacity = int(lengths.max()) + max_new_tokens
    if compiled:
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
    cache = static_cache(n, capacity) if compiled else KVCache(n, capacity)
    with _cache_installed(model, cache) as cached:
        logits_nV, offset_n = _prefill(model, prompts, images, device)
        step = _decode_steps(model, lm, cache, cached, lengths, compiled, device, offset_n)
        for i in range(max_new_tokens):
            token_n = _pick(_penalize(logits_nV, outputs.seen_nV, repetition_penalty), temperature, top_k, top_p,
                            generator)
            token_n = outputs.add(i, token_n, stop_ids)
            if on_token is not None:
                on_token(token_n)
            # whether all have stopped is the one host sync a step; the compiled step asks every STOP_CHECK_EVERY
            # steps, so the host runs ahead of the GPU in between (a stopped sequence only decodes 0s meanwhile)
            check = len(stop_ids) and (not compiled or i % STOP_CHECK_EVERY == STOP_CHECK_EVERY - 1)
            if i == max_new_tokens - 1 or (check and bool(outputs.done_n.all())):
                break
            logits_nV = step(token_n)
    return outputs.result()
