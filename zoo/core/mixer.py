"""What a block's token mixer offers the code around the model (`Mixer`), and what that code hands it: where to keep
its generation state (`MixerCache`, zoo.generate's cache) and how to trade tokens for heads and continue documents
across ranks under sequence parallelism (`HeadExchange`, zoo.parallel's). Attention's `set_attention` /
`PerLayerAttention` (zoo.core.contract) is the model of it: the state a mixer keeps (a KV or latent cache, a
recurrent state, what passes between ranks) is offered through these, so that generic code never names a mixer's
class nor swaps its methods. A new mixer is a spec, a module keeping `Mixer`, and its entry in
zoo.models.decoder.MIXERS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from zoo.core.packing import Packed


class MixerCache(Protocol):
    """Where a mixer keeps its per-sequence generation state, by its layer index and a name of its own
    (zoo.generate.cache.KVCache): what the prefill leaves (a recurrent state, a convolution's last inputs, a latent
    cache) and each decode step advances in place. Buffers stay at their addresses from step to step (a compiled
    step's CUDA graph replays there), so `keep` copies into the buffer already kept where it fits. `capacity`: the
    tokens a sequence may reach (a latent cache allocates its rows for all of them at the prefill)."""

    @property
    def capacity(self) -> int: ...

    def kept(self, layer: int, name: str) -> Tensor:
        """The buffer layer `layer` kept under `name` (a KeyError before the prefill kept it)."""
        ...

    def keep(self, layer: int, name: str, value: Tensor) -> None:
        """Keep `value` as layer `layer`'s `name`: copied into the buffer there when shape, dtype and device fit."""
        ...


class HeadExchange(Protocol):
    """Sequence parallelism as a mixer whose state runs along documents (a recurrence, a convolution) uses it in its
    forward (zoo.parallel.sequence): the ranks of a Ulysses group trade tokens for heads, so that each holds every
    token of the group for its share of the heads; under ring (and hybrid) a document also crosses from ring
    member to ring member, and each member's pieces of it continue from the earlier pieces' last inputs (`halo`)
    and recurrent state (`carry`). Attention needs none of this (the installed attention function does it)."""

    @property
    def size(self) -> int:
        """U, the ranks that share a token's heads (the Ulysses group; 1 under pure ring)."""
        ...

    @property
    def position(self) -> int:
        """u, this rank's share: heads u * (heads / U) onwards."""
        ...

    def holds(self, packed: Packed) -> bool:
        """Is `packed` a shard this exchange cut (else: a whole pack, run as without sequence parallelism)?
        A shard cut by another SequenceParallel is a ZooError."""
        ...

    def scatter(self, x_TUc: Tensor, packed: Packed) -> tuple[Tensor, Packed]:
        """[T_rank, U, c] (the c channels each rank gets of each token: rank u's at [:, u]) -> ([t, c] the group's
        tokens in their global order, this rank's channels, and the pack they form: whole documents, or where
        documents cross ring members (`crosses`), the group's pieces of them, one document of the pack each)."""
        ...

    def gather(self, o_tc: Tensor, packed: Packed) -> Tensor:
        """The reverse of `scatter`: [t, c] -> [T_rank, U, c]."""
        ...

    def crosses(self, packed: Packed) -> bool:
        """Do documents of this shard cross from ring member to ring member (ring, hybrid), so that `scatter`'s
        pieces continue through `halo` and `carry`?"""
        ...

    def halo(self, x_tc: Tensor, width: int, packed: Packed) -> Tensor:
        """[n, width, c] the `width` rows of x (as `scatter` gives it) before each of the n pieces in its document,
        zeros before the document's start, from whichever ranks hold them (differentiable)."""
        ...

    def carry(self, A_nXKK: Tensor, B_nXKV: Tensor, packed: Packed) -> Tensor:
        """[n, ..., K, V] each piece's state at its start, given every piece's map of a linear recurrence's state
        over its own tokens, S_end = A S_start + B (A [n, ..., K, K], B [n, ..., K, V]): the maps of its document's
        earlier pieces composed in order from a zero state, one exchange, no chain of waits (differentiable)."""
        ...


@runtime_checkable
class Mixer(Protocol):
    """What a block's token mixer (the module at `layers[i].attn`: softmax attention, a Gated DeltaNet, or any
    other) offers the code around the model: its per-layer state, declared, so that `zoo.generate` and
    `zoo.parallel` never ask which mixer a layer holds nor swap its methods. Softmax attention keeps its state in
    the attention function the model installs (`set_attention`, a `PerLayerAttention` for generation, the
    sequence-parallel wrapper), and so answers the state hooks with nothing to do; a recurrent or latent-cache mixer
    keeps it in the `MixerCache` and trades heads through the `HeadExchange`."""

    layer: int  # the block's index in the decoder

    def generation_bytes(self, n: int, capacity: int, itemsize: int) -> int:
        """Memory its generation state takes for n sequences of up to `capacity` tokens, activations of `itemsize`
        bytes (what generation checks fits before it allocates)."""
        ...

    def use_cache(self, cache: MixerCache | None) -> None:
        """Generation: read and write its state in `cache` from the next forward on (the prefill is a pack of
        whole prompts, a decode step a pack with `doc_len`, one token a sequence); None: back to whole documents."""
        ...

    def sequence_parallel(self, exchange: HeadExchange | None, mode: str) -> None:
        """Run under sequence parallelism of `mode` ("ring", "ulysses", "hybrid"), trading heads through
        `exchange`; a ZooError in one line where it cannot (a mode or a head count it does not take). None: off."""
        ...

    def kernel_choice(self, device: torch.device, dtype: torch.dtype) -> str:
        """What runs its mixing on `device` in `dtype` in this process, and why (the benches' environment line, and
        how a user sees a kernel choice that depends on what is installed)."""
        ...

    def mixing_flops(self, seqlens: Sequence[int]) -> int:
        """Forward FLOPs of its mixing beyond its nn.Linear projections (zoo.train.flops counts those) over
        documents of these lengths: a recurrence, a convolution. Softmax attention's q.k and p.v products are
        counted from the specs by the language model's `attention_flops`, so attention answers 0 here."""
        ...
