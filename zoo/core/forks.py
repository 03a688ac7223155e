"""Packs whose documents fork (`zoo.Packed.forks`): documents that share their start, laid out once.

A forked document is a run of pieces in token order; each piece either starts the document or continues from the
end of an earlier piece of it, as if it followed that piece's path alone. Each path from the document's start to a
piece that no other continues is one document as a model would see it alone; the pieces the paths share are laid
out (and run) once. recipes.dpo's shared prompt is the case: prompt, chosen, rejected, both answers continuing from
the prompt (a pair with no prompt: its two answers each start the document).

What a mixer does with it: attention attends each path as a document of its own (the plain backends refuse a
forked pack; recipes.dpo's SharedPromptAttention gathers the paths for the backend); a recurrence (zoo.core.deltanet)
runs the pieces level by level, each from the final state of the piece it continues, its convolution from the
inputs before it on its path. Sequence parallelism refuses a forked pack: a cut would separate what paths share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo.errors import ZooError


@dataclass(frozen=True)
class Forks:
    """The pieces of a forked pack, on the host (Python ints: no device sync to read them).

    lens     each piece's tokens, in token order (every one at least 1; together, every token of the pack)
    parents  the piece each continues from, an earlier piece of its document; -1: it starts its document
    """

    lens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.lens) != len(self.parents):
            raise ZooError(f"Forks: {len(self.lens)} piece lengths for {len(self.parents)} parents")
        for i, (n, p) in enumerate(zip(self.lens, self.parents)):
            if n < 1 or not -1 <= p < i:
                raise ZooError(f"Forks: piece {i} of {n} tokens continues piece {p}; expected at least 1 token, and "
                               "-1 (it starts its document) or an earlier piece")

    def starts(self) -> list[int]:
        """Each piece's first token in the pack."""
        out, at = [], 0
        for n in self.lens:
            out.append(at)
            at += n
        return out

    def levels(self) -> list[list[int]]:
        """The pieces by depth: those that start documents, then those continuing them, and so on (each level's
        pieces in token order)."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return [[i for i, d in enumerate(depth) if d == level] for level in range(max(depth, default=-1) + 1)]

    def before(self, width: int) -> list[list[int]]:
        """Per piece, the rows of the `width` tokens before it on its path, oldest first; -1 before its document's
        start (a convolution of width + 1 taps reads them)."""
        starts, out = self.starts(), list[list[int]]()
        for p in self.parents:
            rows = [] if p < 0 else out[p] + list(range(starts[p], starts[p] + self.lens[p]))
            rows = rows[max(len(rows) - width, 0):]
            out.append([-1] * (width - len(rows)) + rows)
        return out


class ForkRows:
    """A forked pack's pieces as a recurrent mixer gathers them (zoo.core.deltanet builds it once per pack):

    cu_pieces  [m+1] int32 the pieces' boundaries
    before_mW  [m, W] the rows of the W tokens before each piece on its path (-1: before its document's start)
    levels     per level (Forks.levels): [t] its pieces' tokens in order, [k+1] int32 their boundaries there, and
               [k] the row of each one's parent among the level before's (None at the first level)
    back_T     [T] where each token of the pack sits among the levels' tokens laid end to end
    """

    def __init__(self, forks: Forks, T: int, W: int, device: torch.device) -> None:
        if sum(forks.lens) != T:
            raise ZooError(f"a forked pack of {T} tokens names pieces of {sum(forks.lens)} tokens")
        starts = forks.starts()
        self.cu_pieces = torch.tensor([*starts, T], dtype=torch.int32, device=device)
        self.before_mW = torch.tensor(forks.before(W), dtype=torch.long, device=device).view(-1, W)
        self.levels: list[tuple[Tensor, Tensor, Tensor | None]] = []
        row: dict[int, int] = {}  # a piece's row among its level's
        for level in forks.levels():
            row.update((i, r) for r, i in enumerate(level))
            ix_t = torch.cat([torch.arange(starts[i], starts[i] + forks.lens[i]) for i in level]).to(device)
            cu = torch.tensor([0, *itertools.accumulate(forks.lens[i] for i in level)], dtype=torch.int32,
                              device=device)
            parents = None if forks.parents[level[0]] < 0 else torch.tensor(
                [row[forks.parents[i]] for i in level], device=device)
            self.levels.append((ix_t, cu, parents))
        self.back_T = torch.argsort(torch.cat([ix for ix, _, _ in self.levels]))
