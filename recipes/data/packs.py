"""Packs by global index: pack g of a run is a pure function of (data, seed, g), each epoch in a new seeded
permutation; and first-fit-decreasing bins for data packed whole (chat samples)."""

from __future__ import annotations

from collections.abc import Mapping
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

    def describe(self) -> str:
        """`stats` as the recipes print it: "1 file, 88 documents, 190,213 tokens, 2,972 packs"."""
        return describe_stats(self.stats)


# what each count of a data set's stats is called: nouns (one, many), and what was done to some of them
_NOUNS = {"files": "file", "documents": "document", "tokens": "token", "samples": "sample", "pairs": "pair",
          "images": "image", "packs": "pack"}
_SOME = {"no_assistant": "without an assistant turn (skipped)", "empty": "empty (skipped)",
         "identical": "with chosen = rejected (skipped)", "truncated": "truncated to --seq-len",
         "dropped": "longer than --seq-len (dropped)", "used": "used"}


def describe_stats(stats: Mapping[str, int | float | str]) -> str:
    """A data set's stats as a sentence; counts of what was skipped are left out where there are none."""
    parts = []
    for key, value in stats.items():
        if key == "fill" and isinstance(value, float):
            parts.append(f"{value:.0%} full")
        elif key == "dataset":
            parts.append(f"from {value}")
        elif not isinstance(value, int):
            parts.append(f"{key} {value}")
        elif key in _NOUNS:
            parts.append(f"{value:,} {_NOUNS[key] if value == 1 else key}")
        elif key in _SOME:
            if value or key == "used":
                parts.append(f"{value:,} {_SOME[key]}")
        else:
            parts.append(f"{key.replace('_', ' ')} {value:,}")
    return ", ".join(parts)


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
