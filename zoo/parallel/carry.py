"""Recurrent mixers under ring sequence parallelism: a document cut over the ring's members continues from member to
member, without the members waiting on each other in a chain.

A member runs its tokens as pieces of documents (runs of consecutive tokens of one document). A piece that does not
start its document needs the inputs just before it (a causal convolution's window: `halo`) and the recurrent state
at its start (`carry`). A linear recurrence's state after a piece is an affine map of the state before it,
S_end = A S_start + B, and the piece computes A and B from its own tokens alone; one all-gather of every piece's
(A, B) over the ring then lets each member compose, for each of its pieces, the maps of its document's earlier
pieces in order (zero state at the document's start). The windows come the same way: one all-gather of the rows
any member's windows read. Both are differentiable (the backward sends each member its rows' gradients), so the
loss and every gradient are one process's.

Shapes: n pieces of this member, W window rows, c channels; every member knows every member's tokens (the ring's
blocks: global indices and documents), so all sizes are known everywhere and nothing is padded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from zoo.core.internals import run_eagerly
from zoo.core.packing import Packed, with_seqlens

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from zoo.parallel.ring import Ring


class _GatherRows(torch.autograd.Function):
    """Every member's rows concatenated in member order (an all-gather of uneven row counts, as one
    all_to_all_single); the backward returns each member the gradients of its rows, summed over the members."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: list[int], me: int, group: ProcessGroup) -> Tensor:
        ctx.sizes, ctx.me, ctx.group = sizes, me, group
        x = x.contiguous()
        out = x.new_empty((sum(sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.repeat(len(sizes), *[1] * (x.dim() - 1)), sizes, [x.shape[0]] * len(sizes),
                               group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        G, n = len(ctx.sizes), ctx.sizes[ctx.me]
        back = grad.new_empty((G * n, *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), [n] * G, ctx.sizes, group=ctx.group)
        return back.view(G, n, *grad.shape[1:]).sum(0), None, None, None


class Pieces:
    """Every ring member's pieces (from the ring's blocks), and this member's as a pack (`packed`: a plain Packed
    whose documents are the pieces, the tokens in the member's order). Built once per shard (`pieces_of`)."""

    def __init__(self, ring: Ring, whole: Packed) -> None:
        device = ring.blocks[ring.me].index_S.device
        self.starts: list[list[int]] = []  # per member: each piece's first global index
        self.docs: list[list[int]] = []  # per member: each piece's document
        self.index: list[Tensor] = []  # per member: its tokens' global indices (CPU)
        cu: list[int] = []  # this member's pieces' bounds
        for g, block in enumerate(ring.blocks):
            idx, doc = block.index_S.cpu(), block.doc_S.cpu()
            first = torch.ones(len(idx), dtype=torch.bool)
            first[1:] = (idx[1:] != idx[:-1] + 1) | (doc[1:] != doc[:-1])
            self.starts.append(idx[first].tolist())
            self.docs.append(doc[first].tolist())
            self.index.append(idx)
            if g == ring.me:
                cu = [*first.nonzero().squeeze(1).tolist(), len(idx)]
        self.doc_starts = whole.cu_seqlens.tolist()[:-1]
        me = ring.me
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        local = self.index[me].to(device)
        self.packed = with_seqlens(Packed(
            input_ids=whole.input_ids[local], position_ids=whole.position_ids[local],
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            max_seqlen=max(lens)), lens)
        self.device = device
        self.carry_plan = self._carry_plan(me)

    def _carry_plan(self, me: int) -> tuple[Tensor, Tensor, list[int]]:
        """([n, J] the all-gathered rows of each of this member's pieces' earlier pieces, in document order, [n, J]
        which of them are real, every member's piece count)."""
        counts = [len(s) for s in self.starts]
        offsets = [sum(counts[:g]) for g in range(len(counts))]
        by_doc: dict[int, list[tuple[int, int]]] = {}
        for g, (starts, docs) in enumerate(zip(self.starts, self.docs)):
            for j, (s, d) in enumerate(zip(starts, docs)):
                by_doc.setdefault(d, []).append((s, offsets[g] + j))
        earlier = [[row for s, row in sorted(by_doc[d]) if s < start]
                   for start, d in zip(self.starts[me], self.docs[me])]
        J = max((len(e) for e in earlier), default=0)
        rows = torch.tensor([e + [0] * (J - len(e)) for e in earlier], dtype=torch.long).view(len(earlier), J)
        real = torch.tensor([[j < len(e) for j in range(J)] for e in earlier], dtype=torch.bool).view(len(earlier), J)
        return rows.to(self.device), real.to(self.device), counts

    def halo_plan(self, width: int, me: int) -> tuple[Tensor, list[int], Tensor, Tensor]:
        """(this member's rows that some member's windows read, every member's count of them, [n, W] each window
        row's place among the gathered rows, [n, W] which are in the document)."""
        wanted_nW, inside_nW = [], []
        for starts, docs in zip(self.starts, self.docs):
            at = torch.tensor(starts, dtype=torch.long)[:, None] - width + torch.arange(width)
            wanted_nW.append(at)
            inside_nW.append(at >= torch.tensor([self.doc_starts[d] for d in docs], dtype=torch.long)[:, None])
        needed = torch.unique(torch.cat([w[i] for w, i in zip(wanted_nW, inside_nW)]))
        send = [torch.isin(idx, needed).nonzero().squeeze(1) for idx in self.index]
        sizes = [len(s) for s in send]
        place = torch.full((int(needed.max()) + 1 if len(needed) else 1,), -1, dtype=torch.long)
        place[torch.cat([idx[s] for idx, s in zip(self.index, send)])] = torch.arange(sum(sizes))
        inside = inside_nW[me]
        rows = torch.where(inside, place[wanted_nW[me].clamp(min=0, max=len(place) - 1)], 0)
        return send[me].to(self.device), sizes, rows.to(self.device), inside.to(self.device)


def _pieces_of(ring: Ring, whole: Packed) -> Pieces:
    """The ring's pieces, built once per shard (kept in the ring's memo)."""
    return ring.memo.get("pieces", lambda: Pieces(ring, whole))


pieces_of = run_eagerly(_pieces_of)  # host-side bookkeeping: never traced inside a compiled block


def halo(ring: Ring, whole: Packed, x_tc: Tensor, width: int) -> Tensor:
    """[n, width, c] the `width` rows before each of this member's pieces in its document (zeros before the
    document's start), from whichever members hold them: one all-gather over the ring."""
    pieces = pieces_of(ring, whole)
    send, sizes, rows_nW, inside_nW = ring.memo.get(("halo", width), lambda: pieces.halo_plan(width, ring.me))
    if sum(sizes) == 0:  # every piece starts its document
        return x_tc.new_zeros(len(rows_nW), width, x_tc.shape[-1])
    table = _GatherRows.apply(x_tc[send], sizes, ring.me, ring.group)
    return torch.where(inside_nW[..., None], table[rows_nW], 0)


def carry(ring: Ring, whole: Packed, A_nXKK: Tensor, B_nXKV: Tensor) -> Tensor:
    """[n, ..., K, V] each of this member's pieces' state at its start, from every piece's map of its state
    (S_end = A S_start + B): one all-gather over the ring, then the maps of its document's earlier pieces composed
    in order from a zero state."""
    rows_nJ, real_nJ, counts = pieces_of(ring, whole).carry_plan
    n = A_nXKK.shape[0]
    table = _GatherRows.apply(torch.cat([A_nXKK.reshape(n, -1), B_nXKV.reshape(n, -1)], dim=1), counts, ring.me,
                              ring.group)
    A_all, B_all = table.split([A_nXKK.shape[1:].numel(), B_nXKV.shape[1:].numel()], dim=1)
    A_all, B_all = A_all.view(-1, *A_nXKK.shape[1:]), B_all.view(-1, *B_nXKV.shape[1:])
    S_nXKV = B_nXKV.new_zeros(B_nXKV.shape)
    for j in range(rows_nJ.shape[1]):  # the j-th earlier piece of each piece's document
        step = A_all[rows_nJ[:, j]] @ S_nXKV + B_all[rows_nJ[:, j]]
        S_nXKV = torch.where(real_nJ[:, j].view(n, *[1] * (S_nXKV.dim() - 1)), step, S_nXKV)
    return S_nXKV
