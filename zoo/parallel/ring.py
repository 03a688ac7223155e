"""Ring attention over packed documents: K/V blocks travel around the ring, partial outputs merge by fp32 log-sum-exp.

Shapes: T query tokens of this rank, S key tokens of one block, N query heads, K KV heads, H head dim.
A block is the tokens of one ring member, each with its global index and document id (zoo.parallel.ring_blocks);
each step attends this member's queries to the block in hand with a kernel of zoo.parallel.ring_kernels.

The forward keeps (out, lse) per query row and merges each block's partial result into it. The backward sends the
K/V blocks around once more with their dK/dV accumulators riding along; after a full turn each accumulator is
passed one more hop, back to its owner. Per block it recomputes the probabilities from the final lse (the
flash-attention backward). Pairs of blocks with nothing to attend are skipped (`has_pairs`), and under a sliding
window the ring stops turning after the last step any member needs (`Ring.last_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from zoo.core.packing import Derived
from zoo.core.score_mods import sink_grad, sink_lse
from zoo.parallel.ring_blocks import BlockMeta, has_pairs
from zoo.parallel.ring_kernels import BlockBackward, BlockForward, block_kernels, merge

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

# bytes this process sent to other ranks, by kind; bench/bench_sp.py reads and resets it
COMM_BYTES: dict[str, int] = {"ring": 0, "all_to_all": 0}


class Ring:
    """One rank's view of its ring: the process group, its place in it, every member's BlockMeta, and which
    members' queries see which members' keys (active[i][j]). Built once per shard and never modified; what it
    derives per window is kept in its `memo` (a zoo.core.packing.Derived of its blocks' tensors)."""

    def __init__(self, group: ProcessGroup, me: int, size: int, blocks: Sequence[BlockMeta],
                 active: list[list[bool]]) -> None:
        self.group, self.me, self.size, self.blocks, self.active = group, me, size, list(blocks), active
        docs = torch.cat([b.doc_S.cpu() for b in self.blocks])
        self.longest = int(torch.bincount(docs).max()) if len(docs) else 0  # the longest document's tokens
        self.memo = Derived(tuple(t for b in self.blocks for t in (b.index_S, b.doc_S)))

    def peer(self, offset: int) -> int:
        """Global rank of the member `offset` places after this one."""
        return dist.get_global_rank(self.group, (self.me + offset) % self.size)

    def effective_window(self, window: int | None) -> int | None:
        """`window`, or None where no document is longer than it (then it cuts nothing)."""
        return None if window is None or window >= self.longest else window

    def active_for(self, window: int | None) -> list[list[bool]]:
        """`active` under a window: [i][j] is whether any query of member i sees a key of member j within it."""
        if window is None:
            return self.active
        return self.memo.get(("active", window), lambda: [
            [has_pairs(a, b, window) if act else False for b, act in zip(self.blocks, row)]
            for a, row in zip(self.blocks, self.active)])

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


class RingAttention(torch.autograd.Function):
    """out [T, N, H] of this ring member's queries against the keys of every member, document-causal (within
    `window` keys, the query included, when given). A `softcap` goes to the block kernels; `sinks` [N] join each
    query's denominator once, after the merge of every block (zoo.core.score_mods), and the backward's block kernels
    get the final out and lse with the sinks in them."""

    @staticmethod
    def forward(ctx: Any, q_TNH: Tensor, k_SKH: Tensor, v_SKH: Tensor, ring: Ring, scale: float,
                kernels: tuple[BlockForward, BlockBackward] | None = None, window: int | None = None,
                sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
        window = ring.effective_window(window)
        fwd, _ = block_kernels(q_TNH.device, q_TNH.dtype, kernels, window, softcap)
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
        if sinks is not None:
            o_TNH, lse_NT = sink_lse(o_TNH, lse_NT, sinks)
        out = o_TNH.to(q_TNH.dtype)
        # the output in the activations' dtype is all the backward needs (flash keeps the same): rowsum(dO * O)
        ctx.save_for_backward(q_TNH, k_SKH, v_SKH, out, lse_NT, sinks)
        ctx.ring, ctx.scale, ctx.kernels, ctx.window, ctx.softcap = ring, scale, kernels, window, softcap
        return out

    @staticmethod
    def backward(ctx: Any, do_TNH: Tensor) -> tuple[Tensor | None, ...]:
        q_TNH, k_SKH, v_SKH, o_TNH, lse_NT, sinks = ctx.saved_tensors
        ring, scale, window = ctx.ring, ctx.scale, ctx.window
        _, bwd = block_kernels(q_TNH.device, q_TNH.dtype, ctx.kernels, window, ctx.softcap)
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
        dsinks = None if sinks is None else sink_grad(sinks, lse_NT, delta_NT).to(sinks.dtype)
        return dq.to(q_TNH.dtype), dk_cur.to(k_SKH.dtype), dv_cur.to(v_SKH.dtype), None, None, None, None, dsinks, None
