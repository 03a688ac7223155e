"""Packs by global index: pack g of a run is a pure function of (data, seed, g), each epoch in a new seeded
permutation; and first-fit-decreasing bins for data packed whole (chat samples)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoo import Packed


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass
class PackedData:
    """Packs by global index; subclasses fill `items` (what pack i holds) and implement `_build`."""

    seed: int
    items: list[list[int]] = field(default_factory=list)  # a window's cuts, a bin's samples
    loss_tokens: list[int] = field(default_factory=list)  # targets in each pack
    fingerprint: str = ""
    stats: dict[str, int | float | str] = field(default_factory=dict)
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.items)

    def index(self, g: int) -> int:
        """Which pack the run's g-th pack is: epoch g // len, in that epoch's permutation."""
        epoch, i = divmod(g, len(self))
        if epoch not in self._perms:
            self._perms = {epoch: _permutation(len(self), self.seed, epoch)}
        return int(self._perms[epoch][i])

    def pack(self, g: int) -> Packed:
        return self._build(self.index(g))

    def num_loss_tokens(self, g: int) -> int:
        return self._loss_tokens(self.index(g))

    def _loss_tokens(self, i: int) -> int:
        return self.loss_tokens[i]

    def in_order(self, i: int) -> Packed:
        """Pack i itself, not the run's i-th (evaluation reads every pack once, in order)."""
        return self._build(i)

    def _build(self, i: int) -> Packed:
        raise NotImplementedError


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: longest first, each into the first bin it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}")
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins
