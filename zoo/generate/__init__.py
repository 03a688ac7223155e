"""Generation with a KV cache: prompts prefilled as one packed batch, then decoded together, one token each a step.

The cache never enters a model module. `generate` installs a `CachedAttention` through the model contract's
`set_attention` (the way sequence parallelism wraps attention) and restores the model's own function afterwards:

- prefill: the prompts are one `Packed` (document-causal, any backend); every layer's K/V rows are written into
  a cache of [sequences, capacity, K, H] per layer;
- decode: a `Packed` of one token per sequence, each its own document, at position = the sequence's length so
  far; `doc_len` is the length including the new token, so InternLM2's dynamic NTK rescales its RoPE base from
  the current sequence length as upstream does with its cache (earlier keys keep the rotation they were cached
  with). The new token's K/V are appended and its query attends over the cached rows of its own sequence.

A layer is told apart from the next by call order: all layers call the attention function once per forward, in
order, with the same `Packed`, so the n-th call with a given pack is layer n.

A decode step embeds its tokens itself and runs the language model alone: decoded tokens are text (LLaVA's
images went in with the prefill, so its vision tower never runs on zero images a step), and the ids come from the
model's own head, so the per-pack id check (a host sync) has nothing to find.

`compile=True` (by default on CUDA) runs the decode step through `torch.compile` (CUDA graphs on CUDA): its
shapes are static (the cache is preallocated at a capacity rounded up to `CAPACITY_STEP`, attention runs over all
of it with a mask built from the positions on the device) and it holds no host sync, so it is captured whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core.attention import AttentionFn, check_window
from zoo.core.contract import TextModel, ZooModel
from zoo.core.kernels import compile_copy
from zoo.core.packing import Packed, pack
from zoo.errors import ZooError

# a compiled step's cache capacity is rounded up to this, so that prompts of other lengths reuse its graph
CAPACITY_STEP = 256
STOP_CHECK_EVERY = 8  # compiled decoding: steps between host checks of whether every sequence has stopped


class KVCache:
    """Keys and values of every layer for n sequences, [n, K, capacity, H] per layer (head-major: a decode step
    reads each head's rows of a sequence contiguously), allocated at first use. `begin_step` prepares, once per
    decoding step, what every layer's attention needs, so the layers themselves never wait on the host."""

    def __init__(self, n: int, capacity: int) -> None:
        self.n, self.capacity = n, capacity
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.lengths = torch.zeros(n, dtype=torch.int64)  # rows filled per sequence (a host copy)
        self.positions = torch.zeros(n, dtype=torch.int64)  # this step's row per sequence, on the device
        self.valid_n11L = torch.zeros(n, 1, 1, 1, dtype=torch.bool)  # the rows this step's queries see
        self._windowed: dict[int, Tensor] = {}  # valid_n11L within a sliding window, per window, this step
        self.rows = torch.arange(n)

    def layer_buffers(self, layer: int, like_TKH: Tensor) -> tuple[Tensor, Tensor]:
        shape = (self.n, like_TKH.shape[1], self.capacity, like_TKH.shape[2])
        if layer == len(self.k):
            self.k.append(like_TKH.new_zeros(shape))
            self.v.append(like_TKH.new_zeros(shape))
        elif (self.k[layer].shape, self.k[layer].dtype, self.k[layer].device) != (shape, like_TKH.dtype,
                                                                                  like_TKH.device):
            # buffers taken over from an earlier call (`_static_cache`) that do not fit this model's layer
            self.k[layer], self.v[layer] = like_TKH.new_zeros(shape), like_TKH.new_zeros(shape)
        return self.k[layer], self.v[layer]

    def begin_step(self, device: torch.device) -> None:
        """One new token per sequence goes at row lengths[i]; it sees rows 0..lengths[i]."""
        L = int(self.lengths.max()) + 1
        self.positions = self.lengths.to(device, non_blocking=True)
        self.rows = self.rows.to(device)
        self.valid_n11L = (torch.arange(L, device=device)[None, :] <= self.positions[:, None])[:, None, None, :]
        self._windowed = {}

    def visible(self, window: int | None) -> Tensor:
        """[n, 1, 1, L] the rows this step's queries see: all up to their own, or with a sliding window the last
        `window` of those, their own included (rows > position - window); built once a step per window."""
        if window is None:
            return self.valid_n11L
        if window not in self._windowed:
            rows_L = torch.arange(self.valid_n11L.shape[-1], device=self.valid_n11L.device)
            recent_n11L = (rows_L[None, :] > self.positions[:, None] - window)[:, None, None, :]
            self._windowed[window] = self.valid_n11L & recent_n11L
        return self._windowed[window]


class CachedAttention:
    """The attention function `generate` installs: the model's backend for the prefill, cached rows for decoding."""

    def __init__(self, backend: AttentionFn, cache: KVCache) -> None:
        self.backend, self.cache = backend, cache
        self.decoding = False
        # the compiled decode step: its caller resets the layer count (`new_forward`) instead of comparing packs,
        # as a pack identity would be a guard that fails every step; attention spans the whole capacity
        self.static = False
        self._pack: Packed | None = None
        self._layer = 0

    def new_forward(self) -> None:
        """The next call is the first layer's (the static step's packs are made inside the compiled code)."""
        self._layer = 0

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed,
                 scale: float | None = None, window: int | None = None) -> Tensor:
        check_window(window)
        if not self.static and packed is not self._pack:  # a new forward: the first layer again
            self._pack, self._layer = packed, 0
        layer, self._layer = self._layer, self._layer + 1
        if self.static:  # the prefill allocated them; checking their shapes against the ints n and capacity
            # would make those constants of the compiled graph, and each batch size its own compilation
            return _static_decode_attention(q_TNH, k_TKH, v_TKH, self.cache.k[layer], self.cache.v[layer],
                                            packed.position_ids, scale, window)
        k_cache, v_cache = self.cache.layer_buffers(layer, k_TKH)
        if not self.decoding:
            start = 0
            for i, n in enumerate(packed.seqlens()):
                k_cache[i, :, :n] = k_TKH[start : start + n].transpose(0, 1)
                v_cache[i, :, :n] = v_TKH[start : start + n].transpose(0, 1)
                start += n
            return self.backend(q_TNH, k_TKH, v_TKH, packed, scale, window=window)
        cache = self.cache
        k_cache[cache.rows, :, cache.positions] = k_TKH
        v_cache[cache.rows, :, cache.positions] = v_TKH
        L = cache.valid_n11L.shape[-1]
        o_nN1H = F.scaled_dot_product_attention(q_TNH[:, :, None], k_cache[:, :, :L], v_cache[:, :, :L],
                                                attn_mask=cache.visible(window), scale=scale,
                                                enable_gqa=k_TKH.shape[1] != q_TNH.shape[1])
        return o_nN1H[:, :, 0]


def _static_decode_attention(q_nNH: Tensor, k_nKH: Tensor, v_nKH: Tensor, k_cache: Tensor, v_cache: Tensor,
                             position_n: Tensor, scale: float | None, window: int | None = None) -> Tensor:
    """One token per sequence at row position_n, attending over the whole capacity with a mask: shapes that never
    change from step to step, and nothing read back to the host. With a sliding window the mask keeps rows
    position_n - window < row <= position_n (`window` is a Python int: a constant of the compiled graph)."""
    n, N, H = q_nNH.shape
    K = k_nKH.shape[1]
    rows_n = torch.arange(n, device=position_n.device)
    k_cache[rows_n, :, position_n] = k_nKH
    v_cache[rows_n, :, position_n] = v_nKH
    rows_C = torch.arange(k_cache.shape[2], device=position_n.device)
    valid_nC = rows_C <= position_n[:, None]
    if window is not None:
        valid_nC = valid_nC & (rows_C > position_n[:, None] - window)
    valid_n11C = valid_nC[:, None, None]
    # the N/K query heads of a KV head (heads j*N/K.. share KV head j) attend as N/K queries of one head: GQA
    # without expanding the cache to N heads, which a kernel taking a mask would otherwise do every layer
    o_nKGH = F.scaled_dot_product_attention(q_nNH.view(n, K, N // K, H), k_cache, v_cache, attn_mask=valid_n11C,
                                            scale=scale)
    return o_nKGH.reshape(n, N, H)


_last_static: list[KVCache] = []  # the last compiled call's cache (see _static_cache)


def _static_cache(n: int, capacity: int) -> KVCache:
    """A compiled call's cache: the previous compiled call's buffers again, zeroed, when n and the capacity match.
    CUDA graphs replay at fixed addresses: fresh buffers every call would re-record the graph every call. Those of
    the last compiled call stay allocated until the next (generate is not meant for concurrent calls)."""
    cache = KVCache(n, capacity)
    if _last_static and (_last_static[0].n, _last_static[0].capacity) == (n, capacity):
        cache.k, cache.v = _last_static[0].k, _last_static[0].v
        for buf in (*cache.k, *cache.v):
            buf.zero_()
    _last_static[:] = [cache]
    return cache


def _decode_logits(lm: TextModel, token_n: Tensor, position_n: Tensor) -> Tensor:
    """[n, V] logits of one decoding step; the whole of what `compile` compiles."""
    n = token_n.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=token_n.device)
    # decode_pack's pack without doc_lens (nothing in a static step reads them): a list of n ints would make n a
    # constant of the graph, and every batch size its own compilation
    packed = Packed(token_n, cu, position_n, 1, doc_len=position_n + 1)
    return F.linear(lm.hidden(packed, x_TD=lm.embed(token_n)), lm.head_weight)


# torch.compile's backend for the decode step; tests on CPU may pick "aot_eager", which traces the same graph
# without inductor's C++ build (seconds instead of a quarter minute per model)
COMPILE_BACKEND = "inductor"
_COMPILED: dict[tuple[str, str, object], Callable[[TextModel, Tensor, Tensor], Tensor]] = {}


def _compiled_decode(device: torch.device, lm: TextModel) -> Callable[[TextModel, Tensor, Tensor], Tensor]:
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
        if not isinstance(p, Tensor) or p.dim() != 1 or p.numel() == 0 or p.dtype.is_floating_point:
            got = f"shape {tuple(p.shape)} {p.dtype}" if isinstance(p, Tensor) else type(p).__name__
            raise ZooError(f"generate(): prompt {i} must be a non-empty 1-D tensor of token ids, got {got}")


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


@torch.no_grad()
def generate(model: ZooModel, prompts: Sequence[Tensor], *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop: Sequence[int] | None = None,
             seed: int | None = None, images: Sequence[Tensor | None] | None = None,
             on_token: Callable[[Tensor], None] | None = None, compile: bool | None = None) -> list[Tensor]:
    """The new tokens of each prompt (1-D LongTensors), decoded with a KV cache.

    prompts: 1-D LongTensors of any lengths, prefilled together as one packed batch. temperature 0 is greedy;
    otherwise sampling, after top_k / top_p filtering, from a generator seeded with `seed`. A sequence stops after
    producing one of the `stop` ids (kept in its output; default: the checkpoint's `model.eos_token_ids`, [] for
    none) or after max_new_tokens. images: LLaVA's pixel values per prompt (as for zoo.pack), written into the
    prompt's placeholder tokens during the prefill. on_token: called after each step with its new tokens [n]
    (0 for sequences stopped earlier), e.g. to stream text. compile: run each decode step through torch.compile
    (CUDA graphs on CUDA); None compiles on CUDA only, where a step is bound by kernel launches and it pays. The
    first compiled call of a model and shape takes seconds (a second batch size or cache size compiles once more,
    then no more); greedy tokens equal the eager ones up to float rounding (attention then spans the whole cache
    with a mask). The compiled path keeps its last KV cache allocated, to reuse at the same addresses.
    """
    _check_prompts(prompts)
    if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1) or \
            (top_p is not None and not 0 < top_p <= 1):
        raise ZooError(f"generate(): expected max_new_tokens >= 0, temperature >= 0, top_k >= 1, 0 < top_p <= 1; "
                       f"got {max_new_tokens}, {temperature}, {top_k}, {top_p}")
    device = model.head_weight.device
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    stop = model.eos_token_ids if stop is None else stop
    stop_ids = torch.tensor(sorted(set(stop)), dtype=torch.int64, device=device)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    out = torch.zeros(n, max_new_tokens, dtype=torch.int64, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    produced = torch.zeros(n, dtype=torch.int64, device=device)
    if max_new_tokens == 0:
        return [out[i, :0] for i in range(n)]

    lm = model.decoder  # a decode step runs the language model alone (LLaVA's images went in with the prefill)
    compiled_lm = lm if (device.type == "cuda" if compile is None else compile) else None
    capacity = int(lengths.max()) + max_new_tokens
    if compiled_lm is not None:
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
    cache = KVCache(n, capacity) if compiled_lm is None else _static_cache(n, capacity)
    backend = model.attend
    cached = CachedAttention(backend, cache)
    model.set_attention(cached)
    try:
        packed = pack([p.to(device) for p in prompts], images=None if images is None else list(images))
        h_TD = model.hidden(packed)
        last = packed.cu_seqlens[1:].long() - 1
        logits_nV = F.linear(h_TD[last], model.head_weight)
        cache.lengths = lengths.clone()
        cached.decoding = True
        if compiled_lm is not None:
            step_fn = _compiled_decode(device, compiled_lm)
            cached.static = True
            position_n = lengths.to(device)
            if device.type == "cuda":
                # the caches are written in place by the step: CUDA graphs take that only of inputs at fixed
                # addresses (no guard: caches at new addresses re-record the graph rather than recompile it)
                for buf in (*cache.k, *cache.v):
                    torch._dynamo.mark_static_address(buf, guard=False)
        for step in range(max_new_tokens):
            token_n = _pick(logits_nV, temperature, top_k, top_p, generator)
            token_n = torch.where(done, torch.zeros_like(token_n), token_n)
            out[:, step] = token_n
            produced += (~done).long()
            done |= torch.isin(token_n, stop_ids)
            if on_token is not None:
                on_token(token_n)
            # whether all have stopped is the one host sync a step; the compiled step asks every STOP_CHECK_EVERY
            # steps, so the host runs ahead of the GPU in between (a stopped sequence only decodes 0s meanwhile)
            check = len(stop_ids) and (compiled_lm is None or step % STOP_CHECK_EVERY == STOP_CHECK_EVERY - 1)
            if step == max_new_tokens - 1 or (check and bool(done.all())):
                break
            if compiled_lm is not None:
                cached.new_forward()
                logits_nV = step_fn(compiled_lm, token_n, position_n)
                position_n = position_n + 1
                continue
            cache.begin_step(device)
            h_TD = lm.hidden(decode_pack(token_n, cache.positions), x_TD=lm.embed(token_n))
            logits_nV = F.linear(h_TD, model.head_weight)
            cache.lengths += 1
    finally:
        model.set_attention(backend)
    return [out[i, :k] for i, k in enumerate(produced.tolist())]  # one host sync for all


def decode_pack(token_n: Tensor, lengths_n: Tensor) -> Packed:
    """One new token per sequence, each its own document, at position = the sequence's length so far; doc_len is
    the length including it (what the RoPE of InternLM2's dynamic NTK is rescaled from)."""
    n = token_n.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=token_n.device)
    return Packed(token_n, cu, lengths_n, 1, doc_len=lengths_n + 1, doc_lens=[1] * n)
