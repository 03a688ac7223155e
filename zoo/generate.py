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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.attention import AttentionFn
from zoo.contract import ZooModel
from zoo.errors import ZooError
from zoo.packing import Packed, pack


class KVCache:
    """Keys and values of every layer for n sequences, [n, capacity, K, H] per layer, allocated at first use."""

    def __init__(self, n: int, capacity: int) -> None:
        self.n, self.capacity = n, capacity
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.lengths = torch.zeros(n, dtype=torch.int64)  # rows filled per sequence (host copy, for positions)

    def layer_buffers(self, layer: int, like_TKH: Tensor) -> tuple[Tensor, Tensor]:
        if layer == len(self.k):
            shape = (self.n, self.capacity, *like_TKH.shape[1:])
            self.k.append(like_TKH.new_zeros(shape))
            self.v.append(like_TKH.new_zeros(shape))
        return self.k[layer], self.v[layer]


class CachedAttention:
    """The attention function `generate` installs: the model's backend for the prefill, cached rows for decoding."""

    def __init__(self, backend: AttentionFn, cache: KVCache) -> None:
        self.backend, self.cache = backend, cache
        self.decoding = False
        self._pack: Packed | None = None
        self._layer = 0

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed,
                 scale: float | None = None) -> Tensor:
        if packed is not self._pack:  # a new forward: the first layer again
            self._pack, self._layer = packed, 0
        layer, self._layer = self._layer, self._layer + 1
        k_cache, v_cache = self.cache.layer_buffers(layer, k_TKH)
        lengths = self.cache.lengths
        if not self.decoding:
            for i, (a, b) in enumerate(zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist())):
                k_cache[i, : b - a] = k_TKH[a:b]
                v_cache[i, : b - a] = v_TKH[a:b]
            return self.backend(q_TNH, k_TKH, v_TKH, packed, scale)
        rows = torch.arange(self.cache.n, device=k_TKH.device)
        at = lengths.to(k_TKH.device)
        k_cache[rows, at] = k_TKH
        v_cache[rows, at] = v_TKH
        return _attend_cached(q_TNH, k_cache, v_cache, at + 1, scale)


def _attend_cached(q_nNH: Tensor, k_nLKH: Tensor, v_nLKH: Tensor, lengths_n: Tensor, scale: float | None) -> Tensor:
    """One query per sequence against its first lengths[i] cached rows (every one: the query is the newest)."""
    L = int(lengths_n.max())
    k, v = k_nLKH[:, :L].transpose(1, 2), v_nLKH[:, :L].transpose(1, 2)  # [n, K, L, H]
    valid_n11L = (torch.arange(L, device=q_nNH.device)[None, :] < lengths_n[:, None])[:, None, None, :]
    o_nN1H = F.scaled_dot_product_attention(q_nNH[:, :, None], k, v, attn_mask=valid_n11L, scale=scale,
                                            enable_gqa=k.shape[1] != q_nNH.shape[1])
    return o_nN1H[:, :, 0]


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
             on_token: Callable[[Tensor], None] | None = None) -> list[Tensor]:
    """The new tokens of each prompt (1-D LongTensors), decoded with a KV cache.

    prompts: 1-D LongTensors of any lengths, prefilled together as one packed batch. temperature 0 is greedy;
    otherwise sampling, after top_k / top_p filtering, from a generator seeded with `seed`. A sequence stops after
    producing one of the `stop` ids (kept in its output; default: the checkpoint's `model.eos_token_ids`, [] for
    none) or after max_new_tokens. images: LLaVA's pixel values per prompt (as for zoo.pack), written into the
    prompt's placeholder tokens during the prefill. on_token: called after each step with its new tokens [n]
    (0 for sequences stopped earlier), e.g. to stream text.
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

    cache = KVCache(n, int(lengths.max()) + max_new_tokens)
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
        for step in range(max_new_tokens):
            token_n = _pick(logits_nV, temperature, top_k, top_p, generator)
            token_n = torch.where(done, torch.zeros_like(token_n), token_n)
            out[:, step] = token_n
            produced += (~done).long()
            done |= torch.isin(token_n, stop_ids)
            if on_token is not None:
                on_token(token_n)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            h_TD = model.hidden(decode_pack(token_n, cache.lengths.to(device)))
            logits_nV = F.linear(h_TD, model.head_weight)
            cache.lengths += 1
    finally:
        model.set_attention(backend)
    return [out[i, : int(produced[i])] for i in range(n)]


def decode_pack(token_n: Tensor, lengths_n: Tensor) -> Packed:
    """One new token per sequence, each its own document, at position = the sequence's length so far; doc_len is
    the length including it (what the RoPE of InternLM2's dynamic NTK is rescaled from)."""
    n = token_n.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=token_n.device)
    return Packed(token_n, cu, lengths_n, 1, doc_len=lengths_n + 1, doc_lens=[1] * n)


if __name__ == "__main__":  # python -m zoo.generate CKPT --prompt ... | --chat: the command line, in zoo/cli.py
    from zoo.cli import main

    raise SystemExit(main())
