"""Bidirectional blocks inside causal attention: the masks of `Packed.blocks` (Gemma 3's images), for the backends.

A block is a run of tokens of one document with the same id >= 0 in `packed.blocks` [T]. Its tokens see each other
both ways; everything else stays document-causal. This is transformers' composition for Gemma 3
(`create_masks_for_vision_model`): global layers OR(causal, blockwise), sliding layers AND(window, OR(causal,
blockwise)) -- so a block's later tokens are always seen, its earlier ones only within the window.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import Tensor

from zoo.core.packing import Packed

T_ = TypeVar("T_")


def document_mask(b_L: Tensor, window: int | None) -> Tensor:
    """[L, L] bool, True where query i of one document sees key j: causal or in the same block, then within the
    window (keys j > i - window; later keys of a block always are)."""
    pos_L = torch.arange(b_L.shape[0], device=b_L.device)
    q_L1, k_1L = pos_L[:, None], pos_L[None, :]
    allowed = (k_1L <= q_L1) | ((b_L[:, None] == b_L[None, :]) & (b_L[:, None] >= 0))
    return allowed if window is None else allowed & (k_1L > q_L1 - window)


def per_blocks(packed: Packed, key: Hashable, build: Callable[[], T_]) -> T_:
    """`build()` once per pack, key and `packed.blocks` tensor: the pack's memo is bound to cu_seqlens, which a copy
    with other blocks shares, so the blocks tensor is checked by identity as well."""
    held: list[Any] = packed.derived(("blocks", key), list)
    if not held or held[0] is not packed.blocks:
        held[:] = [packed.blocks, build()]
    return held[1]


def run_masks(packed: Packed, window: int | None, runs: list[tuple[int, int]]) -> list[Tensor | None]:
    """Per run of `count` equal-length documents of length L, its [count, 1, L, L] mask where it holds a block
    (sdpa's attn_mask), else None (the run keeps is_causal or its band)."""
    if packed.blocks is None:
        return [None] * len(runs)

    def build() -> list[Tensor | None]:
        assert packed.blocks is not None
        out: list[Tensor | None] = []
        for (L, count), b in zip(runs, packed.blocks.split([L * count for L, count in runs])):
            has = bool(b.ge(0).any())
            out.append(torch.stack([document_mask(b_L, window) for b_L in b.view(count, L)])[:, None] if has else None)
        return out

    return per_blocks(packed, ("sdpa masks", window), build)


def _padded(blocks: Tensor, length: int) -> Tensor:
    return torch.cat([blocks, blocks.new_full((length - blocks.shape[0],), -1)])


def last_key_tiles(blocks: Tensor, n: int, B: int) -> Tensor:
    """For FlexAttention's BlockMask over n tiles of B: per query tile the last key tile its rows see (the diagonal,
    or the tile holding the last token of a block one of its rows is in)."""
    T = blocks.shape[0]
    device = blocks.device
    block_P = _padded(blocks, n * B)
    ends = torch.zeros(int(blocks.max()) + 1, dtype=torch.long, device=device)
    index_T = torch.arange(T, device=device)
    ends.scatter_reduce_(0, blocks.clamp(min=0), torch.where(blocks >= 0, index_T, 0), "amax")  # each block's last
    last_P = torch.where(block_P >= 0, ends[block_P.clamp(min=0)], torch.arange(n * B, device=device))
    tile = torch.arange(n, device=device)
    return torch.maximum(tile, last_P.view(n, B).max(dim=1).values // B).clamp(max=n - 1)


def block_mask_mod(doc_P: Tensor, blocks: Tensor, window: int | None) -> Callable[..., Tensor]:
    """The mask_mod of a pack with blocks (doc_P: each token's document, padded to whole tiles): same document,
    causal or same block, within the window."""
    block_P = _padded(blocks, doc_P.shape[0])
    limit_t = torch.tensor(block_P.shape[0] + 1 if window is None else window, device=block_P.device)

    def document_blocks(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (block_P[q_idx] == block_P[kv_idx]) & (block_P[q_idx] >= 0)
        return (doc_P[q_idx] == doc_P[kv_idx]) & ((q_idx >= kv_idx) | same) & (q_idx - kv_idx < limit_t)

    return document_blocks
