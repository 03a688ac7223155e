"""A ring block's tokens, and which of them two blocks attend between.

A block is the tokens of one ring member (zoo.parallel.ring). Every token carries its global index and global
document id, so the document-causal mask between any two blocks is `same document and key index <= query index` —
documents may cross block boundaries, be shorter than the ring, or span all of it. A sliding window (`window` keys,
the query included) is applied from the same global indices: within one document global indices are consecutive,
so a query at index i sees keys j of its document with i - window < j <= i.

What the varlen kernels (zoo.parallel.ring_kernels) run a pair of blocks as: `segments`, per-document rectangles
(with zoo's layouts a document's valid pairs between two blocks form one rectangle, a suffix of its queries x a
prefix of its keys, or one causal triangle on the diagonal block), and under a window `window_segments`, per pair
of contiguous pieces a band flash varlen kernels express as `window_size=(left, right)`. `has_pairs` tells blocks
with nothing to attend apart, so the ring skips them.

What is derived from a block, or from a pair of blocks, is computed once and kept in the query block's `Derived`
(zoo.core.packing), bound to its tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from zoo.core.packing import Derived

V = TypeVar("V")

# (q rows, k rows, q lengths, k lengths, causal) of a pair of blocks: see `segments`
Segments = tuple[Tensor, Tensor, list[int], list[int], bool]
# (q rows, k rows, q lengths, k lengths, (left, right)): one varlen call of a windowed block, see `window_segments`
WindowSegments = tuple[Tensor, Tensor, list[int], list[int], tuple[int, int]]


@dataclass(frozen=True, eq=False)
class BlockMeta:
    """The tokens of one ring member: global index and document id of each, in that member's local order; `memo`
    keeps what is derived from them (leave it out: it is bound to the two tensors)."""

    index_S: Tensor
    doc_S: Tensor
    memo: Derived | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memo", Derived.bound(self.memo, (self.index_S, self.doc_S)))

    @property
    def size(self) -> int:
        return self.index_S.shape[0]

    def derived(self, key: object, build: Callable[[], V]) -> V:
        """`build()` once per block and key."""
        assert self.memo is not None  # bound in __post_init__
        return self.memo.get(key, build)


def _of_pair(q: BlockMeta, k: BlockMeta, key: object, build: Callable[[], V]) -> V:
    """`build()` once per pair of blocks and key, kept by the query block (the key block named by its memo)."""
    return q.derived((key, k.memo), build)


def has_pairs(q: BlockMeta, k: BlockMeta, window: int | None = None) -> bool:
    """Does any query of block q see any key of block k (same document, key not later, within `window` keys)?"""
    if q.size == 0 or k.size == 0:
        return False
    # a document is a run of consecutive global indices, so the latest key at or before a query is in the query's
    # document iff any key of that document is, and it is the key nearest to the query, the one a window keeps last
    k_index, order = k.index_S.cpu().sort()
    k_doc = k.doc_S.cpu()[order]
    q_index, q_doc = q.index_S.cpu(), q.doc_S.cpu()
    at = torch.searchsorted(k_index, q_index, right=True) - 1
    found = at >= 0
    at = at.clamp(min=0)
    sees = found & (k_doc[at] == q_doc)
    if window is not None:
        sees &= q_index - k_index[at] < window
    return bool(sees.any())


def window_cuts(q: BlockMeta, k: BlockMeta, window: int) -> bool:
    """Does the window exclude any (query, key) pair of the block that document-causality allows?"""
    if q.size == 0 or k.size == 0:
        return False
    n_docs = int(max(q.doc_S.max(), k.doc_S.max())) + 1
    big = torch.iinfo(torch.int64).max
    first_k = torch.full((n_docs,), big, dtype=torch.int64).scatter_reduce(0, k.doc_S.cpu(), k.index_S.cpu(), "amin")
    last_q = torch.full((n_docs,), -1, dtype=torch.int64).scatter_reduce(0, q.doc_S.cpu(), q.index_S.cpu(), "amax")
    return bool(((first_k <= last_q) & (last_q - first_k >= window)).any())


def mask_TS(q: BlockMeta, k: BlockMeta, window: int | None = None) -> Tensor:
    allowed = (q.doc_S[:, None] == k.doc_S[None, :]) & (k.index_S[None, :] <= q.index_S[:, None])
    if window is not None:  # one document's global indices are consecutive: their difference is the distance
        allowed &= q.index_S[:, None] - k.index_S[None, :] < window
    return allowed


def segments(q: BlockMeta, k: BlockMeta, diagonal: bool) -> Segments:
    """The block as per-document rectangles: (q rows, k rows, q lengths, k lengths, causal).

    With the zoo layouts the tokens of one document inside one block are contiguous, and between two different
    blocks a document's valid pairs form a full rectangle (a suffix of its queries x a prefix of its keys); on the
    diagonal block they form one causal triangle per document. Computed once per pair of blocks.
    """
    return _of_pair(q, k, ("segments", diagonal), lambda: _segments(q, k, diagonal))


def _segments(q: BlockMeta, k: BlockMeta, diagonal: bool) -> Segments:
    qi, qd, ki, kd = (t.tolist() for t in (q.index_S, q.doc_S, k.index_S, k.doc_S))
    rows_q: list[int] = []
    rows_k: list[int] = []
    lens_q: list[int] = []
    lens_k: list[int] = []
    k_rows_of: dict[int, list[int]] = {}
    for r, d in enumerate(kd):
        k_rows_of.setdefault(d, []).append(r)
    q_rows_of: dict[int, list[int]] = {}
    for r, d in enumerate(qd):
        q_rows_of.setdefault(d, []).append(r)
    for d, qrows in q_rows_of.items():
        krows = k_rows_of.get(d)
        if not krows:
            continue
        if diagonal:
            sel_q, sel_k = qrows, krows
        else:
            sel_q = [r for r in qrows if qi[r] > ki[krows[0]]]
            sel_k = [r for r in krows if ki[r] < qi[qrows[-1]]]
            if not sel_q or not sel_k:
                continue
            if max(ki[r] for r in sel_k) > min(qi[r] for r in sel_q):
                raise AssertionError("ring block is not a rectangle per document; the layout broke an invariant")
        rows_q += sel_q
        rows_k += sel_k
        lens_q.append(len(sel_q))
        lens_k.append(len(sel_k))
    device = q.index_S.device
    return (torch.tensor(rows_q, dtype=torch.int64, device=device),
            torch.tensor(rows_k, dtype=torch.int64, device=device), lens_q, lens_k, diagonal)


def _pieces(meta: BlockMeta) -> list[tuple[int, int, int, int]]:
    """(document, first row, end row, global index of the first row): runs of a block's rows that are consecutive
    tokens of one document. zoo's layout gives a document at most two per block (zigzag pieces g and 2G-1-g)."""

    def build() -> list[tuple[int, int, int, int]]:
        index, doc = meta.index_S.tolist(), meta.doc_S.tolist()
        out: list[tuple[int, int, int, int]] = []
        for r in range(len(index)):
            if out and doc[r] == out[-1][0] and index[r] == out[-1][3] + (r - out[-1][1]):
                out[-1] = (out[-1][0], out[-1][1], r + 1, out[-1][3])
            else:
                out.append((doc[r], r, r + 1, index[r]))
        return out

    return meta.derived("pieces", build)


def window_segments(q: BlockMeta, k: BlockMeta, diagonal: bool, window: int) -> list[WindowSegments]:
    """The block within `window` as varlen calls, each (q rows, k rows, q lengths, k lengths, (left, right)).

    Per pair of contiguous pieces of one document (`_pieces`): a piece with itself (diagonal block) is a causal
    band, window_size (window - 1, 0); keys wholly before the queries are a rectangle the window cuts from its far
    corner, trimmed to the queries that see a key and the keys a query sees, band (window - 1 - e, -1) with e how
    far the queries end past the keys (flash aligns a segment's last query with its last key). A call takes the
    segments of one band whose queries are distinct; the calls' results merge by LSE. Computed once per pair of
    blocks and window.
    """
    return _of_pair(q, k, ("window segments", diagonal, window), lambda: _window_segments(q, k, diagonal, window))


def _window_segments(q: BlockMeta, k: BlockMeta, diagonal: bool, window: int) -> list[WindowSegments]:
    k_pieces: dict[int, list[tuple[int, int, int, int]]] = {}
    for piece in _pieces(k):
        k_pieces.setdefault(piece[0], []).append(piece)
    calls: dict[tuple[int, int], list[tuple[list[int], list[int], list[int], list[int], set[int]]]] = {}
    for d, qr0, qr1, qa in _pieces(q):
        qb = qa + qr1 - qr0
        for _, kr0, kr1, ka in k_pieces.get(d, []):
            kb = ka + kr1 - kr0
            if diagonal and kr0 == qr0:  # the piece against itself
                rows_q, rows_k, band = range(qr0, qr1), range(kr0, kr1), (window - 1, 0)
            elif kb <= qa:
                q_end = min(qb, kb + window - 1)  # later queries are window or more past every key
                if q_end <= qa:
                    continue
                k_start = max(ka, qa - window + 1)  # earlier keys are out of even the first query's window
                rows_q, rows_k = range(qr0, qr0 + q_end - qa), range(kr0 + k_start - ka, kr1)
                band = (window - 1 - (q_end - kb), -1)
            elif ka >= qb:  # keys after the queries
                continue
            else:
                raise AssertionError("ring block pieces overlap; the layout broke an invariant")
            group = calls.setdefault(band, [])
            call = next((c for c in group if qr0 not in c[4]), None)
            if call is None:
                call = ([], [], [], [], set())
                group.append(call)
            call[0].extend(rows_q)
            call[1].extend(rows_k)
            call[2].append(len(rows_q))
            call[3].append(len(rows_k))
            call[4].add(qr0)
    device = q.index_S.device
    return [(torch.tensor(rq, dtype=torch.int64, device=device), torch.tensor(rk, dtype=torch.int64, device=device),
             lq, lk, band) for band, group in calls.items() for rq, rk, lq, lk, _ in group]

