"""Ring attention over packed documents: K/V blocks travel around the ring, partial outputs merge by fp32 log-sum-exp.

Shapes: T query tokens of this rank, S key tokens of one block, N query heads, K KV heads (query head i reads
KV head i // G, with G = N / K query heads per KV head), H head dim.
A block is the tokens of one ring member. Every token carries its global index and global document id, so the
document-causal mask between any two blocks is `same document and key index <= query index` — documents may cross
block boundaries, be shorter than the ring, or span all of it.

The forward keeps (out, lse) per query row and merges each block's partial result into it. The backward sends the
K/V blocks around once more with their dK/dV accumulators riding along; after a full turn each accumulator is
passed one more hop, back to its owner. Per block it recomputes P = exp(q k^T * scale - lse) from the final lse,
the flash-attention backward: dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K, dK = dS^T Q.

A block is cut into per-document segments (`segments`): with zoo's layouts a document's valid pairs between two
blocks form one rectangle (a suffix of its queries x a prefix of its keys, full attention), or one causal
triangle on the diagonal block, so every block is a varlen call. The varlen kernels with LSE: flash varlen
on CUDA (bf16/fp16; zoo.core.kernels.lse_kernels), torch's fused CPU flash kernel on CPU, and a dense fp32
version (`math_varlen_lse`) for anything else. `math_forward`/`math_backward` do a whole block with the mask
from global indices; they are the reference the tests hold the others to.

A sliding window (`window` keys, the query included) is applied from the same global indices: within one document
global indices are consecutive, so a query at index i sees keys j of its document with i - window < j <= i. Pairs
of blocks with no pair inside the window are skipped (`has_pairs`), and the ring stops turning after the last step
any member needs (`Ring.last_step`). With a window a block is cut into `window_segments`: per pair of contiguous
pieces, a band flash varlen kernels express as `window_size=(left, right)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from zoo.core.kernels import lse_kernels, require_lse_kernels

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

# bytes this process sent to other ranks, by kind; bench/bench_sp.py reads and resets it
COMM_BYTES: dict[str, int] = {"ring": 0, "all_to_all": 0}

# (q rows, k rows, q lengths, k lengths, causal) of a pair of blocks: see `segments`
Segments = tuple[Tensor, Tensor, list[int], list[int], bool]
# (q rows, k rows, q lengths, k lengths, (left, right)): one varlen call of a windowed block, see `window_segments`
WindowSegments = tuple[Tensor, Tensor, list[int], list[int], tuple[int, int]]
# the varlen contract of the block kernels, on gathered segment rows:
# (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None) -> (out, lse [N, rows]); `window=(left, right)`
# replaces `causal` by flash's band: query row r of a segment of Lq x Lk sees key column c when
# -left <= c - r - (Lk - Lq) <= right (-1: unbounded), which is causal within left + 1 keys for (left, 0)
VarlenLse = Callable[..., tuple[Tensor, Tensor]]
# (do, q, k, v, out, lse, delta, cu_q, cu_k, max_q, max_k, causal, scale, window=None) -> (dq, dk, dv)
VarlenLseBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


@dataclass
class BlockMeta:
    """The tokens of one ring member: global index and document id of each, in that member's local order."""

    index_S: Tensor
    doc_S: Tensor
    _segments: dict[tuple[Any, ...] | str, Any] = field(default_factory=dict, repr=False)  # per-block structures

    @property
    def size(self) -> int:
        return self.index_S.shape[0]


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


def _window_cuts(q: BlockMeta, k: BlockMeta, window: int) -> bool:
    """Does the window exclude any (query, key) pair of the block that document-causality allows?"""
    if q.size == 0 or k.size == 0:
        return False
    n_docs = int(max(q.doc_S.max(), k.doc_S.max())) + 1
    big = torch.iinfo(torch.int64).max
    first_k = torch.full((n_docs,), big, dtype=torch.int64).scatter_reduce(0, k.doc_S.cpu(), k.index_S.cpu(), "amin")
    last_q = torch.full((n_docs,), -1, dtype=torch.int64).scatter_reduce(0, q.doc_S.cpu(), q.index_S.cpu(), "amax")
    return bool(((first_k <= last_q) & (last_q - first_k >= window)).any())


# ---- the math kernel: dense, fp32, any device ----


def _mask_TS(q: BlockMeta, k: BlockMeta, window: int | None = None) -> Tensor:
    allowed = (q.doc_S[:, None] == k.doc_S[None, :]) & (k.index_S[None, :] <= q.index_S[:, None])
    if window is not None:  # one document's global indices are consecutive: their difference is the distance
        allowed &= q.index_S[:, None] - k.index_S[None, :] < window
    return allowed


def _grouped(q_TNH: Tensor, k_SKH: Tensor) -> tuple[Tensor, Tensor]:
    """q as [K, G, T, H] and k as [K, 1, S, H], fp32: query head i reads KV head i // G, no K/V repeat."""
    T, N, H = q_TNH.shape
    K = k_SKH.shape[1]
    return (q_TNH.float().view(T, K, N // K, H).permute(1, 2, 0, 3),
            k_SKH.float().permute(1, 0, 2).unsqueeze(1))


def dense_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, allowed_TS: Tensor | None,
                  scale: float) -> tuple[Tensor, Tensor]:
    """(out [T, N, H] fp32, lse [N, T] fp32) of q against k/v where allowed (None: everywhere).

    Rows with no allowed key get out 0 and lse -inf, so merging them changes nothing."""
    T, N, H = q_TNH.shape
    q_KGTH, k_K1SH = _grouped(q_TNH, k_SKH)
    v_K1SH = v_SKH.float().permute(1, 0, 2).unsqueeze(1)
    s_KGTS = (q_KGTH @ k_K1SH.transpose(-1, -2)) * scale
    if allowed_TS is not None:
        s_KGTS = s_KGTS.masked_fill(~allowed_TS, float("-inf"))
    lse_KGT = torch.logsumexp(s_KGTS, dim=-1)
    p_KGTS = torch.exp(s_KGTS - _finite(lse_KGT)[..., None])
    o_KGTH = p_KGTS @ v_K1SH
    return o_KGTH.reshape(N, T, H).transpose(0, 1), lse_KGT.reshape(N, T)


def dense_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, lse_NT: Tensor, do_TNH: Tensor, delta_NT: Tensor,
                   allowed_TS: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [T, N, H], dk [S, K, H], dv [S, K, H]) fp32, given the final lse and rowsum(dO * O) of the queries."""
    T, N, H = q_TNH.shape
    K = k_SKH.shape[1]
    q_KGTH, k_K1SH = _grouped(q_TNH, k_SKH)
    v_K1SH = v_SKH.float().permute(1, 0, 2).unsqueeze(1)
    do_KGTH = do_TNH.float().view(T, K, N // K, H).permute(1, 2, 0, 3)
    s_KGTS = (q_KGTH @ k_K1SH.transpose(-1, -2)) * scale
    if allowed_TS is not None:
        s_KGTS = s_KGTS.masked_fill(~allowed_TS, float("-inf"))
    p_KGTS = torch.exp(s_KGTS - lse_NT.view(K, N // K, T, 1))
    dv_KSH = (p_KGTS.transpose(-1, -2) @ do_KGTH).sum(1)
    dp_KGTS = do_KGTH @ v_K1SH.transpose(-1, -2)
    ds_KGTS = p_KGTS * (dp_KGTS - delta_NT.view(K, N // K, T, 1)) * scale
    dq_KGTH = ds_KGTS @ k_K1SH
    dk_KSH = (ds_KGTS.transpose(-1, -2) @ q_KGTH).sum(1)
    return dq_KGTH.reshape(N, T, H).transpose(0, 1), dk_KSH.transpose(0, 1), dv_KSH.transpose(0, 1)


def math_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta,
                 scale: float, window: int | None = None) -> tuple[Tensor, Tensor]:
    """One whole block with the document-causal (windowed) mask from global indices: the reference, any layout."""
    return dense_forward(q_TNH, k_SKH, v_SKH, _mask_TS(q, k, window), scale)


def math_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, lse_NT: Tensor, do_TNH: Tensor, delta_NT: Tensor,
                  q: BlockMeta, k: BlockMeta, scale: float, window: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of math_forward's block, given the final lse and delta = rowsum(dO * O) of the queries.

    Unlike the flash kernels it needs no output: delta carries all it would read from it."""
    return dense_backward(q_TNH, k_SKH, v_SKH, lse_NT, do_TNH, delta_NT, _mask_TS(q, k, window), scale)


def _finite(lse: Tensor) -> Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(o_TNH: Tensor, lse_NT: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax results of the same queries over disjoint key sets (fp32)."""
    lse = torch.logaddexp(lse_NT, lse_b)
    safe = _finite(lse)
    w_a = torch.exp(lse_NT - safe).T[..., None]
    w_b = torch.exp(lse_b - safe).T[..., None]
    return o_TNH * w_a + o_b * w_b, lse


# ---- the varlen kernel: flash varlen with LSE (CUDA) ----


def segments(q: BlockMeta, k: BlockMeta, diagonal: bool) -> Segments:
    """The block as per-document rectangles: (q rows, k rows, q lengths, k lengths, causal).

    With the zoo layouts the tokens of one document inside one block are contiguous, and between two different
    blocks a document's valid pairs form a full rectangle (a suffix of its queries x a prefix of its keys); on the
    diagonal block they form one causal triangle per document. Cached on the query block.
    """
    key = (id(k), diagonal)
    if key in q._segments:
        return q._segments[key]
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
    out: Segments = (torch.tensor(rows_q, dtype=torch.int64, device=device),
                     torch.tensor(rows_k, dtype=torch.int64, device=device), lens_q, lens_k, diagonal)
    q._segments[key] = out
    return out


def _pieces(meta: BlockMeta) -> list[tuple[int, int, int, int]]:
    """(document, first row, end row, global index of the first row): runs of a block's rows that are consecutive
    tokens of one document. zoo's layout gives a document at most two per block (zigzag pieces g and 2G-1-g)."""
    if "pieces" not in meta._segments:
        index, doc = meta.index_S.tolist(), meta.doc_S.tolist()
        out: list[tuple[int, int, int, int]] = []
        for r in range(len(index)):
            if out and doc[r] == out[-1][0] and index[r] == out[-1][3] + (r - out[-1][1]):
                out[-1] = (out[-1][0], out[-1][1], r + 1, out[-1][3])
            else:
                out.append((doc[r], r, r + 1, index[r]))
        meta._segments["pieces"] = out
    return meta._segments["pieces"]


def window_segments(q: BlockMeta, k: BlockMeta, diagonal: bool, window: int) -> list[WindowSegments]:
    """The block within `window` as varlen calls, each (q rows, k rows, q lengths, k lengths, (left, right)).

    Per pair of contiguous pieces of one document (`_pieces`): a piece with itself (diagonal block) is a causal
    band, window_size (window - 1, 0); keys wholly before the queries are a rectangle the window cuts from its far
    corner, trimmed to the queries that see a key and the keys a query sees, band (window - 1 - e, -1) with e how
    far the queries end past the keys (flash aligns a segment's last query with its last key). A call takes the
    segments of one band whose queries are distinct; the calls' results merge by LSE. Cached on the query block.
    """
    key = (id(k), diagonal, window)
    if key in q._segments:
        return q._segments[key]
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
    out = [(torch.tensor(rq, dtype=torch.int64, device=device), torch.tensor(rk, dtype=torch.int64, device=device),
            lq, lk, band) for band, group in calls.items() for rq, rk, lq, lk, _ in group]
    q._segments[key] = out
    return out


def _cu(lens: list[int], device: torch.device) -> Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return cu.to(device)


def varlen_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                   diagonal: bool, kernel: VarlenLse | None = None, window: int | None = None) -> tuple[Tensor, Tensor]:
    """Like math_forward, through a varlen kernel `kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    -> (out, lse [N, rows])` run on the gathered segment rows; default: torch's flash varlen (CUDA). With a
    window, one call per `window_segments` call, merged by LSE."""
    kernel = kernel or require_lse_kernels().forward
    T, N, H = q_TNH.shape
    o_TNH = torch.zeros(T, N, H, dtype=torch.float32, device=q_TNH.device)
    lse_NT = torch.full((N, T), float("-inf"), dtype=torch.float32, device=q_TNH.device)
    if window is not None:
        for rows_q, rows_k, lens_q, lens_k, band in window_segments(q, k, diagonal, window):
            o, lse = kernel(q_TNH[rows_q], k_SKH[rows_k], v_SKH[rows_k], _cu(lens_q, q_TNH.device),
                            _cu(lens_k, q_TNH.device), max(lens_q), max(lens_k), True, scale, window=band)
            o_TNH[rows_q], lse_NT[:, rows_q] = merge(o_TNH[rows_q], lse_NT[:, rows_q], o.float(), lse.float())
        return o_TNH, lse_NT
    rows_q, rows_k, lens_q, lens_k, causal = segments(q, k, diagonal)
    if not lens_q:
        return o_TNH, lse_NT
    o, lse = kernel(q_TNH[rows_q], k_SKH[rows_k], v_SKH[rows_k], _cu(lens_q, q_TNH.device),
                    _cu(lens_k, q_TNH.device), max(lens_q), max(lens_k), causal, scale)
    o_TNH[rows_q] = o.float()
    lse_NT[:, rows_q] = lse.float()
    return o_TNH, lse_NT


def varlen_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, o_TNH: Tensor, lse_NT: Tensor, do_TNH: Tensor,
                    delta_NT: Tensor, q: BlockMeta, k: BlockMeta, scale: float, diagonal: bool,
                    kernel_bwd: VarlenLseBackward | None = None,
                    window: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Like math_backward, through a varlen backward kernel fed the final out/lse (gathered segment rows); the
    kernel gets both out and delta = rowsum(dO * O), and uses either (flash recomputes delta from out)."""
    kernel_bwd = kernel_bwd or require_lse_kernels().backward
    dq = torch.zeros(q_TNH.shape, dtype=torch.float32, device=q_TNH.device)
    dk = torch.zeros(k_SKH.shape, dtype=torch.float32, device=q_TNH.device)
    dv = torch.zeros(v_SKH.shape, dtype=torch.float32, device=q_TNH.device)
    calls: list[tuple[Tensor, Tensor, list[int], list[int], bool, tuple[int, int] | None]]
    if window is not None:
        calls = [(rq, rk, lq, lk, True, band) for rq, rk, lq, lk, band in window_segments(q, k, diagonal, window)]
    else:
        rows_q, rows_k, lens_q, lens_k, causal = segments(q, k, diagonal)
        calls = [(rows_q, rows_k, lens_q, lens_k, causal, None)] if lens_q else []
    for rows_q, rows_k, lens_q, lens_k, causal, band in calls:
        # given the final lse, each call's gradient is its share: the shares of calls sharing rows add up
        dq_r, dk_r, dv_r = kernel_bwd(do_TNH[rows_q], q_TNH[rows_q], k_SKH[rows_k], v_SKH[rows_k], o_TNH[rows_q],
                                      lse_NT[:, rows_q].contiguous(), delta_NT[:, rows_q], _cu(lens_q, q_TNH.device),
                                      _cu(lens_k, q_TNH.device), max(lens_q), max(lens_k), causal, scale,
                                      **({} if band is None else {"window": band}))
        dq.index_add_(0, rows_q, dq_r.float())
        dk.index_add_(0, rows_k, dk_r.float())
        dv.index_add_(0, rows_k, dv_r.float())
    return dq, dk, dv


def _segment_pairs(cu_q: Tensor, cu_k: Tensor) -> Iterator[tuple[int, int, int, int]]:
    return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True)


def _allowed(n_q: int, n_k: int, causal: bool, window: tuple[int, int] | None, device: torch.device) -> Tensor | None:
    """A segment's [n_q, n_k] mask under the varlen contract (None: all allowed)."""
    if window is None:
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q) if causal else None
    left, right = window
    rel = torch.arange(n_k, device=device)[None, :] - torch.arange(n_q, device=device)[:, None] - (n_k - n_q)
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= rel >= -left
    if right >= 0:
        allowed &= rel <= right
    return allowed


def math_varlen_lse(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                    scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """The flash varlen contract done densely per segment: the CPU kernel, and the GPU kernel's stand-in in tests."""
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        allowed = _allowed(qb - qa, kb - ka, causal, window, q.device)
        o[qa:qb], lse[:, qa:qb] = dense_forward(q[qa:qb], k[ka:kb], v[ka:kb], allowed, scale)
    return o, lse


def math_varlen_lse_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, delta: Tensor,
                             cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                             scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """math_varlen_lse's gradients, densely per segment (from delta; `o` is part of the contract, unused here)."""
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        allowed = _allowed(qb - qa, kb - ka, causal, window, q.device)
        dq[qa:qb], dk[ka:kb], dv[ka:kb] = dense_backward(q[qa:qb], k[ka:kb], v[ka:kb], lse[:, qa:qb], do[qa:qb],
                                                         delta[:, qa:qb], allowed, scale)
    return dq, dk, dv


def _cpu_flash_ops() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return None
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


def _require_cpu_flash_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    ops = _cpu_flash_ops()
    if ops is None:
        raise RuntimeError(f"torch {torch.__version__} has no fused CPU flash attention with a backward; "
                           "the ring runs math_varlen_lse instead")
    return ops


def _heads_first(x_TnH: Tensor) -> Tensor:
    return x_TnH.transpose(0, 1)[None]


def _additive(n_q: int, n_k: int, window: tuple[int, int] | None, dtype: torch.dtype,
              device: torch.device) -> Tensor | None:
    """The fused CPU kernel's attn_mask for a windowed segment: 0 where allowed, -inf elsewhere."""
    if window is None:
        return None
    allowed = _allowed(n_q, n_k, True, window, device)
    assert allowed is not None
    return torch.zeros(n_q, n_k, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def cpu_flash_lse(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                  scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """The varlen contract through torch's fused CPU flash kernel (the one sdpa runs), one call per segment; a
    window goes in as an additive [Lq, Lk] mask (the kernel has no window of its own)."""
    fwd, _ = _require_cpu_flash_ops()
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        mask = _additive(qb - qa, kb - ka, window, q.dtype, q.device)
        o_1NLH, lse_1NL = fwd(_heads_first(q[qa:qb]), _heads_first(k[ka:kb]), _heads_first(v[ka:kb]), 0.0,
                              causal and window is None, attn_mask=mask, scale=scale)
        o[qa:qb], lse[:, qa:qb] = o_1NLH[0].transpose(0, 1), lse_1NL[0]
    return o, lse


def cpu_flash_lse_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, delta: Tensor,
                           cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                           scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """cpu_flash_lse's gradients through the fused CPU flash backward (from `o`; `delta` is unused here)."""
    _, bwd = _require_cpu_flash_ops()
    dq, dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v))
    do, o = do.to(q.dtype), o.to(q.dtype)
    lse = lse.to(torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)  # what the kernel keeps
    for qa, qb, ka, kb in _segment_pairs(cu_q, cu_k):
        mask = _additive(qb - qa, kb - ka, window, q.dtype, q.device)
        dq_, dk_, dv_ = bwd(_heads_first(do[qa:qb]), _heads_first(q[qa:qb]), _heads_first(k[ka:kb]),
                            _heads_first(v[ka:kb]), _heads_first(o[qa:qb]), lse[None, :, qa:qb], 0.0,
                            causal and window is None, attn_mask=mask, scale=scale)
        dq[qa:qb], dk[ka:kb], dv[ka:kb] = dq_[0].transpose(0, 1), dk_[0].transpose(0, 1), dv_[0].transpose(0, 1)
    return dq, dk, dv


# ---- the ring ----


@dataclass
class Ring:
    """One rank's view of its ring: the process group, its place in it, every member's BlockMeta, the kernels."""

    group: ProcessGroup
    me: int
    size: int
    blocks: list[BlockMeta]
    active: list[list[bool]]  # active[i][j]: queries of member i see keys of member j
    _by_window: dict[Any, Any] = field(default_factory=dict, repr=False)  # what a window derives, per window

    def peer(self, offset: int) -> int:
        """Global rank of the member `offset` places after this one."""
        return dist.get_global_rank(self.group, (self.me + offset) % self.size)

    def effective_window(self, window: int | None) -> int | None:
        """`window`, or None where no document is longer than it (then it cuts nothing)."""
        if window is None:
            return None
        if "longest" not in self._by_window:
            docs = torch.cat([b.doc_S.cpu() for b in self.blocks])
            self._by_window["longest"] = int(torch.bincount(docs).max()) if len(docs) else 0
        return None if window >= self._by_window["longest"] else window

    def active_for(self, window: int | None) -> list[list[bool]]:
        """`active` under a window: [i][j] is whether any query of member i sees a key of member j within it."""
        if window is None:
            return self.active
        if window not in self._by_window:
            self._by_window[window] = [[has_pairs(a, b, window) if act else False for b, act in zip(self.blocks, row)]
                                       for a, row in zip(self.blocks, self.active)]
        return self._by_window[window]

    def last_step(self, window: int | None) -> int:
        """The last ring step at which some member sees the block that reached it; every member computes the same
        number from the shared `active`, so all stop together (a window keeps blocks of far members unneeded)."""
        active = self.active_for(window)
        return max((step for step in range(self.size) for m in range(self.size)
                    if active[m][(m - step) % self.size]), default=0)


def _exchange(ring: Ring, send: list[Tensor], recv: list[Tensor], offset: int = 1) -> list[Work]:
    """Post sends of `send` to the member `offset` places on and receives into `recv` from `offset` places back."""
    ops = [dist.P2POp(dist.isend, t, ring.peer(offset), ring.group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, ring.peer(-offset), ring.group) for t in recv]
    COMM_BYTES["ring"] += sum(t.numel() * t.element_size() for t in send)
    return dist.batch_isend_irecv(ops)


def _wait(reqs: list[Work]) -> None:
    for r in reqs:
        r.wait()


# (q, k, v, q block, k block, scale, diagonal, window=None) -> (out, lse); the backward likewise, see varlen_backward
BlockForward = Callable[..., tuple[Tensor, Tensor]]
BlockBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _dense_where_cut_forward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                             diagonal: bool, window: int | None = None) -> tuple[Tensor, Tensor]:
    if window is not None and _window_cuts(q, k, window):
        return math_forward(q_TNH, k_SKH, v_SKH, q, k, scale, window)
    return varlen_forward(q_TNH, k_SKH, v_SKH, q, k, scale, diagonal)


def _dense_where_cut_backward(q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, o_TNH: Tensor, lse_NT: Tensor,
                              do_TNH: Tensor, delta_NT: Tensor, q: BlockMeta, k: BlockMeta, scale: float,
                              diagonal: bool, window: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if window is not None and _window_cuts(q, k, window):
        return math_backward(q_TNH, k_SKH, v_SKH, lse_NT, do_TNH, delta_NT, q, k, scale, window)
    return varlen_backward(q_TNH, k_SKH, v_SKH, o_TNH, lse_NT, do_TNH, delta_NT, q, k, scale, diagonal)


def _kernels(device: torch.device, dtype: torch.dtype, override: tuple[BlockForward, BlockBackward] | None,
             window: int | None = None) -> tuple[BlockForward, BlockBackward]:
    """(forward, backward) block kernels, all over per-document segments: flash varlen on CUDA in half precision
    (`zoo.core.kernels.lse_kernels`), torch's fused CPU flash kernel on CPU, dense fp32 math elsewhere."""
    if override is not None:
        return override
    lse = lse_kernels() if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) else None
    if lse is not None:  # flash kernels take half types only
        if window is None or lse.window:
            return varlen_forward, varlen_backward
        # a torch whose flash varlen kernels take no window: blocks the window cuts run the dense fp32 math kernel
        # ([T, S] scores per block: fine for the short blocks of tests, costly for long ones), the others flash
        return _dense_where_cut_forward, _dense_where_cut_backward
    fwd: VarlenLse
    bwd: VarlenLseBackward
    if _cpu_flash_ops() is not None and device.type == "cpu":
        fwd, bwd = cpu_flash_lse, cpu_flash_lse_backward
    else:
        fwd, bwd = math_varlen_lse, math_varlen_lse_backward
    return functools.partial(varlen_forward, kernel=fwd), functools.partial(varlen_backward, kernel_bwd=bwd)


class RingAttention(torch.autograd.Function):
    """out [T, N, H] of this ring member's queries against the keys of every member, document-causal (within
    `window` keys, the query included, when given)."""

    @staticmethod
    def forward(ctx: Any, q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, ring: Ring, scale: float,
                kernels: tuple[BlockForward, BlockBackward] | None = None, window: int | None = None) -> Tensor:
        window = ring.effective_window(window)
        fwd, _ = _kernels(q_TNH.device, q_TNH.dtype, kernels, window)
        T, N, H = q_TNH.shape
        me = ring.me
        active, last = ring.active_for(window), ring.last_step(window)
        o_TNH = torch.zeros(T, N, H, dtype=torch.float32, device=q_TNH.device)
        lse_NT = torch.full((N, T), float("-inf"), dtype=torch.float32, device=q_TNH.device)
        k_cur, v_cur = k_SKH.contiguous(), v_SKH.contiguous()
        for step in range(last + 1):  # blocks beyond `last` steps are outside every member's window: not sent
            src = (me - step) % ring.size  # whose keys are here now
            reqs: list[Work] = []
            if step < last:  # fetch the next block while this one computes
                nxt = ring.blocks[(src - 1) % ring.size].size
                k_nxt = k_cur.new_empty((nxt, *k_cur.shape[1:]))
                v_nxt = v_cur.new_empty((nxt, *v_cur.shape[1:]))
                reqs = _exchange(ring, [k_cur, v_cur], [k_nxt, v_nxt])
            if active[me][src]:
                o_b, lse_b = fwd(q_TNH, k_cur, v_cur, ring.blocks[me], ring.blocks[src], scale, src == me,
                                 window=window)
                o_TNH, lse_NT = merge(o_TNH, lse_NT, o_b, lse_b)
            _wait(reqs)
            if reqs:
                k_cur, v_cur = k_nxt, v_nxt
        out = o_TNH.to(q_TNH.dtype)
        # the output in the activations' dtype is all the backward needs (flash keeps the same): rowsum(dO * O)
        ctx.save_for_backward(q_TNH, k_SKH, v_SKH, out, lse_NT)
        ctx.ring, ctx.scale, ctx.kernels, ctx.window = ring, scale, kernels, window
        return out

    @staticmethod
    def backward(ctx: Any, do_TNH: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None, None]:
        q_TNH, k_SKH, v_SKH, o_TNH, lse_NT = ctx.saved_tensors
        ring, scale, window = ctx.ring, ctx.scale, ctx.window
        _, bwd = _kernels(q_TNH.device, q_TNH.dtype, ctx.kernels, window)
        me = ring.me
        active, last = ring.active_for(window), ring.last_step(window)
        delta_NT = (do_TNH.float() * o_TNH.float()).sum(-1).T.contiguous()
        dq = torch.zeros(q_TNH.shape, dtype=torch.float32, device=q_TNH.device)
        k_cur, v_cur = k_SKH.contiguous(), v_SKH.contiguous()
        dk_cur = torch.zeros(k_SKH.shape, dtype=torch.float32, device=k_SKH.device)
        dv_cur = torch.zeros_like(dk_cur)
        for step in range(last + 1):
            src = (me - step) % ring.size
            if active[me][src]:
                dq_b, dk_b, dv_b = bwd(q_TNH, k_cur, v_cur, o_TNH, lse_NT, do_TNH, delta_NT, ring.blocks[me],
                                       ring.blocks[src], scale, src == me, window=window)
                dq += dq_b
                dk_cur += dk_b
                dv_cur += dv_b
            if last == 0:  # no block left this member: the accumulators in hand are its own
                break
            if step < last:
                # pass this block's K/V (still needed downstream) and its gradient accumulators one hop on
                nxt = ring.blocks[(src - 1) % ring.size].size
                send = [dk_cur, dv_cur, k_cur, v_cur]
                recv = [t.new_empty((nxt, *t.shape[1:])) for t in send]
                _wait(_exchange(ring, send, recv))
                dk_cur, dv_cur, k_cur, v_cur = recv
            else:
                # the accumulators in hand belong to block src, `last` places back: send them home, and take this
                # member's own from `last` places on (after a full turn, last = size - 1, that is one hop on)
                mine = ring.blocks[me].size
                recv = [dk_cur.new_empty((mine, *dk_cur.shape[1:])), dv_cur.new_empty((mine, *dv_cur.shape[1:]))]
                _wait(_exchange(ring, [dk_cur, dv_cur], recv, offset=-last))
                dk_cur, dv_cur = recv
        return dq.to(q_TNH.dtype), dk_cur.to(k_SKH.dtype), dv_cur.to(v_SKH.dtype), None, None, None, None
