"""The BlockMasks FlexAttention runs a pack with (zoo.core.attention.flex, and flash_varlen where its kernel cannot
take a window or bidirectional blocks): built from the pack's cu_seqlens (and blocks) alone, tile by tile, so that no
T x T mask ever exists, and once per pack, shared by every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.core import blocks as bidi
from zoo.core.packing import Packed
from zoo.core.score_mods import check_window

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

FLEX_BLOCK = 128  # FlexAttention's default tile: a BlockMask marks which 128 x 128 tiles of q x k are computed


def document_block_mask(cu_seqlens: Tensor, num_tokens: int, block: int = FLEX_BLOCK,
                        window: int | None = None, blocks: Tensor | None = None) -> BlockMask:
    """The document-causal BlockMask of a pack, built from `cu_seqlens` alone: no T x T mask ever exists.

    Query tile i (rows i*B..) sees key tiles lo..i, where lo is the tile holding the first key its first row can
    see: the start of that row's document, or with a `window` the row's position - window + 1 if later (every
    other row of the tile sees no earlier key than the first row). Tiles strictly below the diagonal whose every
    (query, key) pair is allowed — all of tile i inside one document, and with a window the tile's last row within
    `window` keys of the tile's first key — are full (no mask evaluated); the others (lo up to those, and the
    diagonal) are partial and get the mask_mod. Tiles before lo are skipped. Memory: a few [tiles] vectors and the
    [tiles, tiles] index table FlexAttention itself keeps.
    """
    from torch.nn.attention.flex_attention import BlockMask

    check_window(window)
    device = cu_seqlens.device
    B, T = block, num_tokens
    n = -(-T // B)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    start_T = torch.repeat_interleave(cu_seqlens[:-1].long(), lens)  # first token of each token's document
    # padded to whole tiles with the last document's id, so mask_mod never indexes past the end; padded keys
    # sit after every real query, so causality keeps them out
    doc_P = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    doc_P = torch.cat([doc_P, doc_P[-1:].expand(n * B - T)])

    tile = torch.arange(n, device=device)
    first_key = start_T[tile * B]  # the first key a tile's first row can see
    if window is not None:
        first_key = torch.maximum(first_key, tile * B - window + 1)
    lo = first_key // B
    last_row = torch.clamp((tile + 1) * B, max=T) - 1
    # key tiles from first_full on lie inside the last row's document (clamped to the diagonal: then none are full);
    # a tile with padding rows is never full, as create_block_mask would have it
    first_full = torch.maximum((start_T[last_row] + B - 1) // B, lo)
    if window is not None:  # and begin no earlier than the last row's window: last_row - key < window for all
        first_full = torch.maximum(first_full, (torch.clamp(last_row - window + 1, min=0) + B - 1) // B)
    first_full = torch.minimum(first_full, tile)
    first_full = torch.where((tile + 1) * B > T, tile, first_full)
    hi = tile if blocks is None else bidi.last_key_tiles(blocks, n, B)  # the last key tile a query tile sees
    n_full = tile - first_full  # full tiles: first_full .. i-1
    n_below = first_full - lo  # partial tiles: lo .. first_full-1, then the diagonal .. hi
    n_partial = n_below + hi - tile + 1
    cols = torch.arange(n, device=device)
    partial = torch.where(cols < n_below[:, None], lo[:, None] + cols,
                          torch.minimum(tile[:, None] + cols - n_below[:, None], hi[:, None]))
    full = torch.clamp(first_full[:, None] + cols, max=n - 1)

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc_P[q_idx] == doc_P[kv_idx]) & (q_idx >= kv_idx)

    # the window as a tensor: a captured tensor is an input of the compiled kernel, an int would be a constant of
    # it, and every window its own compilation
    window_t = torch.tensor(0 if window is None else window, device=device)

    def document_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc_P[q_idx] == doc_P[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window_t)

    return BlockMask.from_kv_blocks(
        n_partial.to(torch.int32)[None, None], partial.to(torch.int32)[None, None],
        n_full.to(torch.int32)[None, None], full.to(torch.int32)[None, None], BLOCK_SIZE=B, seq_lengths=(T, T),
        mask_mod=(document_causal if window is None else document_window) if blocks is None else
        bidi.block_mask_mod(doc_P, blocks, window))


def causal_block_mask(packed: Packed, window: int | None = None) -> BlockMask:
    """The pack's document-causal (windowed; bidirectional within `packed.blocks`) BlockMask, built once per pack
    and window and shared by every layer."""
    if window is not None and window >= packed.max_seqlen:
        window = None  # no document is long enough for the window to cut it
    return bidi.per_blocks(packed, ("block mask", window), lambda: document_block_mask(
        packed.cu_seqlens, packed.num_tokens, window=window, blocks=packed.blocks))


def full_block_mask(packed: Packed) -> BlockMask:
    """Each token sees its whole document (causal=False): query tile i reads the key tiles from its first row's
    document start to its last row's document end, all partial (the mask_mod keeps documents apart)."""
    from torch.nn.attention.flex_attention import BlockMask

    def build() -> BlockMask:
        B, T, cu = FLEX_BLOCK, packed.num_tokens, packed.cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
        doc_P = torch.repeat_interleave(torch.arange(len(lens), device=packed.device), lens)
        n = -(-T // B)
        doc_P = torch.cat([doc_P, doc_P[-1:].expand(n * B - T)])  # padding rows: the last document's
        tile = torch.arange(n, device=packed.device)
        lo = cu[doc_P[tile * B]] // B
        hi = (cu[doc_P[torch.clamp((tile + 1) * B, max=T) - 1] + 1] - 1) // B
        cols = torch.clamp(lo[:, None] + tile, max=n - 1).to(torch.int32)
        return BlockMask.from_kv_blocks((hi - lo + 1).to(torch.int32)[None, None], cols[None, None], BLOCK_SIZE=B,
                                        mask_mod=lambda b, h, q, kv: doc_P[q] == doc_P[kv], seq_lengths=(T, T))

    return packed.derived("block mask full", build)
