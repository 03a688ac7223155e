"""What one rank of a sequence-parallel group holds of a global pack: a `Shard`, and where its tokens come from.

A `Shard` is a `Packed` of this rank's tokens, the view a model runs (local `input_ids`, `cu_seqlens` of the local
pieces of documents, global `position_ids` and `doc_len`, `labels` shifted on the global sequence before the cut, so
no target is lost at a cut), plus what the rank knows of the whole: the global pack (`whole`), where each of its
tokens sits in it (`index`) and how its attention runs over the group (`plan`). The model never reads those: it asks
the pack (`part_of`, `targets`, `count_targets`), and a Shard answers from the whole pack. The sequence-parallel
attention reads the plan, and the backends refuse a shard run through a model `sp.apply` did not wrap.

Layout (`balanced_layout`). Causal work is per document: a token at position p of its document attends to p+1
keys. Cutting the global stream into 2G chunks (zigzag) balances one long document but not a real pack of many
(max/min work 5-29x on 8-32 ranks with log-normal lengths, see bench/bench_sp.py), so zoo zigzags each document:
a document of L >= 2G tokens is cut into 2G pieces and ring group g takes pieces g and 2G-1-g (an early, cheap
piece with a late, expensive one); shorter documents go whole to the group with the fewest tokens. The U members
of a group split its tokens (kept in global order) into U contiguous parts. Pure Ulysses (G = 1) is thus a plain
contiguous split. No padding is ever needed: every rank knows every part's size because every rank holds the
global pack when it shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from zoo.core.packing import Packed, with_seqlens

if TYPE_CHECKING:
    from zoo.parallel.ring import Ring


def balanced_layout(seqlens: list[int], ring_size: int, ulysses_size: int) -> list[Tensor]:
    """Global token indices of each rank (rank = g * ulysses_size + u), see the module docstring.

    Documents of at least 2G tokens are cut into 2G near-equal pieces and ring group g takes pieces g and 2G-1-g
    (per-document zigzag: equal tokens and equal causal work from every such document), the few tokens a 2G-way
    cut leaves over going to the groups holding fewest tokens; shorter documents, longest first, go whole to the
    group holding the fewest tokens, cut in order where they would overfill it. A group keeps its tokens in
    global order, so each document's tokens in a group are contiguous and the pairs of tokens two groups can
    attend between are, per document, one rectangle (the ring's varlen kernel relies on it).
    """
    G, U, T = ring_size, ulysses_size, sum(seqlens)
    if G == 1:
        groups = [torch.arange(T)]
    else:
        starts = [0]
        for n in seqlens[:-1]:
            starts.append(starts[-1] + n)
        tokens, target = [0] * G, [T // G + (g < T % G) for g in range(G)]
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(G)]
        for d in sorted(range(len(seqlens)), key=lambda d: (-seqlens[d], d)):
            L, s0 = seqlens[d], starts[d]
            while 0 < L < 2 * G:  # short: whole to the emptiest group, or cut in order where it would overflow
                g = min(range(G), key=lambda g: (tokens[g], g))
                n = L if target[g] - tokens[g] <= 0 else min(L, target[g] - tokens[g])
                ranges[g].append((s0, s0 + n))
                tokens[g] += n
                s0, L = s0 + n, L - n
            if L == 0:
                continue
            base, rem = divmod(L, 2 * G)
            extra = [0] * G  # the remainder, one token per piece, to the groups holding fewest tokens
            for _ in range(rem):
                g = min((g for g in range(G) if extra[g] < 2), key=lambda g: (tokens[g] + extra[g], g))
                extra[g] += 1
            sizes = [0] * (2 * G)
            for g in range(G):
                sizes[g], sizes[2 * G - 1 - g] = base + (extra[g] >= 1), base + (extra[g] >= 2)
            bounds = [s0]
            for n in sizes:
                bounds.append(bounds[-1] + n)
            for g in range(G):
                ranges[g] += [(bounds[g], bounds[g + 1]), (bounds[2 * G - 1 - g], bounds[2 * G - g])]
                tokens[g] += sizes[g] + sizes[2 * G - 1 - g]
        groups = [torch.cat([torch.arange(a, b) for a, b in sorted(r)]) for r in ranges]
    out = []
    for group_T in groups:
        n = len(group_T)
        out += [group_T[n * u // U : n * (u + 1) // U] for u in range(U)]
    return out


class ShardPlan:
    """How a shard's attention runs over the group: read by SequenceParallelAttention alone. Built once by `shard`
    and never modified; a plain class, not a dataclass, so that every copy of a Shard (dataclasses.replace, FSDP's
    input cast) holds this same plan instead of a field-by-field rebuild of it."""

    __slots__ = ("owner", "group_sizes", "ring")

    def __init__(self, owner: object, group_sizes: list[int], ring: Ring | None) -> None:
        self.owner = owner  # the SequenceParallel that cut the shard (by identity): only its wrapper may run it
        self.group_sizes = group_sizes  # tokens of each member of this rank's Ulysses group
        self.ring = ring  # ring size > 1: the ring's blocks; else the group holds whole documents of the pack


@dataclass(eq=False, kw_only=True)
class Shard(Packed):
    """This rank's tokens of a global pack (see the module docstring): a Packed a model runs as any other, plus

    whole   the global pack, the same on every rank of the group
    index   [T] where each of this shard's tokens sits in `whole`
    plan    how its attention runs over the group (SequenceParallelAttention's alone)
    """

    whole: Packed
    index: Tensor
    plan: ShardPlan

    def part_of(self) -> tuple[Packed, Tensor]:
        """The whole pack and this shard's place in it: what `targets`, `count_targets` and a model (LLaVA numbering
        its image placeholders) read, and why the plain backends refuse it."""
        return self.whole, self.index

    def with_blocks(self, rule: Callable[[Packed], Tensor]) -> Shard:
        """The blocks numbered over the whole pack (`rule(whole)`), set on the whole pack (which the attention over
        the whole reads) and cut to this shard's tokens."""
        whole = self.whole.with_blocks(rule)
        return replace(self, whole=whole, blocks=None if whole.blocks is None else whole.blocks[self.index])

    def sum_over_parts(self, t: Tensor) -> Tensor:
        """`t` summed over the shards of the group (an all-reduce, no gradient)."""
        out = t.detach().clone()
        owner: Any = self.plan.owner  # the SequenceParallel that cut this shard
        dist.all_reduce(out, group=owner.group)
        return out

    def to(self, device: torch.device | str) -> Shard:
        """This shard with its tensors, and its whole pack's, on `device`."""
        moved = super().to(device)
        assert isinstance(moved, Shard)  # dataclasses.replace keeps the class
        moved.whole, moved.index = self.whole.to(device), self.index.to(device, non_blocking=True)
        return moved


def cut(packed: Packed, index_T: Tensor, plan: ShardPlan) -> Shard:
    """The tokens `index_T` of `packed` as a Shard: its local pieces (cu_seqlens) are the runs of consecutive tokens
    of one document."""
    lens = torch.tensor(packed.seqlens(), device=packed.device)
    doc_T = torch.repeat_interleave(torch.arange(len(lens), device=packed.device), lens)[index_T]
    starts = torch.ones(len(index_T), dtype=torch.bool, device=packed.device)
    starts[1:] = (index_T[1:] != index_T[:-1] + 1) | (doc_T[1:] != doc_T[:-1])
    cu = torch.cat([starts.nonzero().squeeze(1), torch.tensor([len(index_T)], device=packed.device)])
    piece_lens = (cu[1:] - cu[:-1]).tolist()
    shard = Shard(
        input_ids=packed.input_ids[index_T],
        cu_seqlens=cu.to(torch.int32),
        position_ids=packed.position_ids[index_T],
        max_seqlen=max(piece_lens),
        labels=None if packed.labels is None else packed.labels[index_T],  # shifted globally: none lost
        pixel_values=packed.pixel_values,
        doc_len=packed.doc_len_per_token()[index_T],
        blocks=None if packed.blocks is None else packed.blocks[index_T],
        whole=packed,
        index=index_T,
        plan=plan,
    )
    return with_seqlens(shard, piece_lens)
