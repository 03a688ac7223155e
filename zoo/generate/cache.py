"""The KV cache of generation and the attention function that reads and writes it, installed per layer.

Shapes: n sequences, N query heads, K KV heads, H head dim, L rows a step's queries see, C the cache's capacity.

The cache never enters a model module. `generate` installs a `CachedAttention` through the model contract's
`set_attention` (the way sequence parallelism wraps attention) and restores the model's own function afterwards.
It is a `PerLayerAttention`: the model gives layer i the function `for_layer(i)`, so each layer reads and writes
its own rows by its own index, never by the order of the calls.

- prefill: the prompts are one `Packed` (document-causal, any backend); every layer's K/V rows are written into
  a cache of [n, K, capacity, H] per layer;
- decode: a `Packed` of one token per sequence (`decode_pack`), each its own document, at position = the
  sequence's length so far; its `doc_len` is the length including the new token, so InternLM2's dynamic NTK
  rescales its RoPE base from the current sequence length as upstream does with its cache (earlier keys keep the
  rotation they were cached with). The new token's K/V are appended and its query attends over the cached rows
  of its own sequence;
- other mixers (zoo.core.mixer.Mixer: Gated DeltaNet's recurrent state and convolution window) keep their
  state in the same cache, handed to each through the contract's `use_cache` (`KVCache.keep` / `kept`), filled
  by the prefill and advanced one token a decode step (in place, eager or compiled);
- static decode (the compiled step): the same over the whole capacity with a mask built on the device, so shapes
  never change from step to step and nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core.attention import AttentionFn, check_window
from zoo.core.packing import Packed, with_seqlens
from zoo.core.score_mods import check_mods, dense, mods


class KVCache:
    """Keys and values of every layer for n sequences, [n, K, capacity, H] per layer (head-major: a decode step
    reads each head's rows of a sequence contiguously), allocated at a layer's first use. `begin_step` prepares,
    once per decoding step, what every layer's attention needs, so the layers themselves never wait on the host."""

    def __init__(self, n: int, capacity: int) -> None:
        self.n, self.capacity = n, capacity
        self.k: dict[int, Tensor] = {}  # by layer index
        self.v: dict[int, Tensor] = {}
        self.lengths = torch.zeros(n, dtype=torch.int64)  # rows filled per sequence (a host copy)
        self.positions = torch.zeros(n, dtype=torch.int64)  # this step's row per sequence, on the device
        self.valid_n11L = torch.zeros(n, 1, 1, 1, dtype=torch.bool)  # the rows this step's queries see
        self._windowed: dict[int, Tensor] = {}  # valid_n11L within a sliding window, per window, this step
        self.rows = torch.arange(n)
        # other mixers' state (zoo.core.mixer.MixerCache), by (layer index, the mixer's name for it): Gated
        # DeltaNet's last conv_kernel - 1 inputs [n, K - 1, C] and delta-rule state [n, Hv, Dk, Dv] of each sequence
        self.states: dict[tuple[int, str], Tensor] = {}

    def layer_buffers(self, layer: int, like_TKH: Tensor) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s (k, v) buffers, made to fit `like_TKH`'s heads, dtype and device."""
        shape = (self.n, like_TKH.shape[1], self.capacity, like_TKH.shape[2])
        k = self.k.get(layer)
        if k is None or (k.shape, k.dtype, k.device) != (shape, like_TKH.dtype, like_TKH.device):
            # new, or taken over from an earlier call (`static_cache`) and not fitting this model's layer
            self.k[layer], self.v[layer] = like_TKH.new_zeros(shape), like_TKH.new_zeros(shape)
        return self.k[layer], self.v[layer]

    def buffers(self) -> list[Tensor]:
        """Every layer's k and v buffers and every mixer's state."""
        return [*self.k.values(), *self.v.values(), *self.states.values()]

    def kept(self, layer: int, name: str) -> Tensor:
        """What layer `layer`'s mixer kept under `name` (zoo.core.mixer.MixerCache)."""
        return self.states[layer, name]

    def keep(self, layer: int, name: str, value: Tensor) -> None:
        """Keep `value` as layer `layer`'s `name`, copied into the buffer already there when it fits (a compiled
        call's buffers stay at their addresses: CUDA graphs replay there)."""
        buf = self.states.get((layer, name))
        if buf is not None and (buf.shape, buf.dtype, buf.device) == (value.shape, value.dtype, value.device):
            buf.copy_(value)
        else:
            self.states[layer, name] = value.clone()

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
    """The attention function `generate` installs (a `PerLayerAttention`): the model's backend for the prefill,
    cached rows for decoding. Layer i calls `for_layer(i)`, which reads and writes the cache of layer i."""

    def __init__(self, backend: AttentionFn, cache: KVCache) -> None:
        self.backend, self.cache = backend, cache
        self.decoding = False
        # the compiled decode step: attention spans the whole capacity (see static_decode_attention)
        self.static = False

    def for_layer(self, layer: int) -> AttentionFn:
        """The attention function of layer `layer`."""
        return LayerAttention(self, layer)

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed,
                 scale: float | None = None, window: int | None = None, *, layer: int, sinks: Tensor | None = None,
                 softcap: float | None = None) -> Tensor:
        check_window(window)
        check_mods(sinks, softcap, q_TNH.shape[1])
        if self.static:  # the prefill allocated them; checking their shapes against the ints n and capacity
            # would make those constants of the compiled graph, and each batch size its own compilation
            return static_decode_attention(q_TNH, k_TKH, v_TKH, self.cache.k[layer], self.cache.v[layer],
                                           packed.position_ids, scale, window, sinks=sinks, softcap=softcap)
        k_cache, v_cache = self.cache.layer_buffers(layer, k_TKH)
        if not self.decoding:
            start = 0
            for i, n in enumerate(packed.seqlens()):
                k_cache[i, :, :n] = k_TKH[start : start + n].transpose(0, 1)
                v_cache[i, :, :n] = v_TKH[start : start + n].transpose(0, 1)
                start += n
            return self.backend(q_TNH, k_TKH, v_TKH, packed, scale, window=window, **mods(sinks, softcap))
        cache = self.cache
        k_cache[cache.rows, :, cache.positions] = k_TKH
        v_cache[cache.rows, :, cache.positions] = v_TKH
        L = cache.valid_n11L.shape[-1]
        if sinks is not None or softcap is not None:  # sdpa has no score modifier: the scores written out
            n, N, H = q_TNH.shape
            K = k_TKH.shape[1]
            o_nKG1H = dense(q_TNH.view(n, K, N // K, 1, H), k_cache[:, :, None, :L], v_cache[:, :, None, :L],
                            cache.visible(window)[:, :, :, None], scale, sinks, softcap)
            return o_nKG1H.reshape(n, N, H)
        o_nN1H = F.scaled_dot_product_attention(q_TNH[:, :, None], k_cache[:, :, :L], v_cache[:, :, :L],
                                                attn_mask=cache.visible(window), scale=scale,
                                                enable_gqa=k_TKH.shape[1] != q_TNH.shape[1])
        return o_nN1H[:, :, 0]


class LayerAttention:
    """One layer's view of a CachedAttention: the attention function that layer calls."""

    def __init__(self, cached: CachedAttention, layer: int) -> None:
        self.cached, self.layer = cached, layer

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed,
                 scale: float | None = None, window: int | None = None, **options: Any) -> Tensor:
        return self.cached(q_TNH, k_TKH, v_TKH, packed, scale, window, layer=self.layer, **options)


def static_decode_attention(q_nNH: Tensor, k_nKH: Tensor, v_nKH: Tensor, k_cache: Tensor, v_cache: Tensor,
                            position_n: Tensor, scale: float | None, window: int | None = None, *,
                            sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
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
    if sinks is not None or softcap is not None:  # sdpa has no score modifier: the scores written out
        o_nKG1H = dense(q_nNH.view(n, K, N // K, 1, H), k_cache[:, :, None], v_cache[:, :, None],
                        valid_n11C[:, :, :, None], scale, sinks, softcap)
        return o_nKG1H.reshape(n, N, H)
    # the N/K query heads of a KV head (heads j*N/K.. share KV head j) attend as N/K queries of one head: GQA
    # without expanding the cache to N heads, which a kernel taking a mask would otherwise do every layer
    o_nKGH = F.scaled_dot_product_attention(q_nNH.view(n, K, N // K, H), k_cache, v_cache, attn_mask=valid_n11C,
                                            scale=scale)
    return o_nKGH.reshape(n, N, H)


_last_static: list[KVCache] = []  # the last compiled call's cache (see static_cache)


def static_cache(n: int, capacity: int) -> KVCache:
    """A compiled call's cache: the previous compiled call's buffers again, zeroed, when n and the capacity match.
    CUDA graphs replay at fixed addresses: fresh buffers every call would re-record the graph every call. Those of
    the last compiled call stay allocated until the next (generate is not meant for concurrent calls)."""
    cache = KVCache(n, capacity)
    if _last_static and (_last_static[0].n, _last_static[0].capacity) == (n, capacity):
        cache.k, cache.v = _last_static[0].k, _last_static[0].v
        cache.states = _last_static[0].states
        for buf in cache.buffers():
            buf.zero_()
    _last_static[:] = [cache]
    return cache


def decode_pack(token_n: Tensor, lengths_n: Tensor) -> Packed:
    """One new token per sequence, each its own document, at position = the sequence's length so far; doc_len is
    the length including it (what the RoPE of InternLM2's dynamic NTK is rescaled from)."""
    n = token_n.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=token_n.device)
    return with_seqlens(Packed(token_n, cu, lengths_n, 1, doc_len=lengths_n + 1), [1] * n)
