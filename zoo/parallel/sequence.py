"""Sequence parallelism over packed documents: Ulysses, ring, and both (hybrid), exact against one process.

Shapes: T tokens (of this rank unless said), N query heads, K KV heads, H head dim; U ulysses size, G ring size,
U * G ranks; R KV heads after repeating them to lcm(K, U), h heads on one Ulysses member (N / U or R / U).
A rank is (ring position g, ulysses position u) = divmod(rank, U).

Which tokens each rank holds and what it knows of the whole pack: zoo.parallel.shard (`balanced_layout`, `Shard`).
Uneven parts travel as uneven all-to-all splits and uneven ring blocks.

Attention of one layer on a rank:
1. Ulysses (U > 1): one all-to-all turns [T_rank, heads] into [T_group, heads / U] for q, k and v together. KV
   heads are first repeated to lcm(K, U) heads — only as much as needed so that each member gets whole groups.
2. G == 1: the group holds the whole pack in global order, so the model's own backend (sdpa, eager, flash
   varlen...) runs on the global documents. G > 1: ring attention across the G groups (zoo.parallel.ring).
   A sliding `window` goes to the backend, or to the ring, which applies it from global token indices and skips
   the blocks it excludes.
3. Ulysses: the reverse all-to-all back to [T_rank, N].
Models are untouched: `apply` installs the wrapper with `model.set_attention` and hands each mixer of the model
(`zoo.core.mixer.Mixer`) the exchange of its own channels (`MixerExchange`: Gated DeltaNet's recurrence runs the
group's documents for a share of the heads, and under ring continues those that cross ring members,
zoo.parallel.carry); `shard` returns a `Shard`, a Packed of the rank's tokens whose plan the wrapper reads (a model
asks it only what any Packed answers).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from zoo.core.attention import AttentionFn, check_window
from zoo.core.contract import ZooModel
from zoo.core.packing import Packed
from zoo.core.score_mods import check_mods, mods
from zoo.errors import ZooError
from zoo.parallel.carry import carry, halo, pieces_of
from zoo.parallel.ring import COMM_BYTES, Ring, RingAttention
from zoo.parallel.ring_blocks import BlockMeta, has_pairs
from zoo.parallel.shard import Shard, ShardPlan, balanced_layout, cut

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

M = TypeVar("M", bound=ZooModel)

MODES = ("ring", "ulysses", "hybrid")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: ProcessGroup) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: Tensor, send: list[int], recv: list[int], group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send, group=group)
    row = x[0].numel() * x.element_size() if len(x) else 0
    COMM_BYTES["all_to_all"] += (sum(send) - send[dist.get_rank(group)]) * row
    return out


class SequenceParallelAttention:
    """The attention function `SequenceParallel.apply` installs: the wrapped backend, distributed over the group,
    with the backend signature (a sliding `window` included).

    A Packed that is no Shard (not made by `shard`) goes straight to the wrapped backend.
    """

    def __init__(self, parallel: SequenceParallel, backend: AttentionFn) -> None:
        self.parallel, self.backend = parallel, backend

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed,
                 scale: float | None = None, window: int | None = None, *, sinks: Tensor | None = None,
                 softcap: float | None = None) -> Tensor:
        if not isinstance(packed, Shard):
            return self.backend(q_TNH, k_TKH, v_TKH, packed, scale, window=window, **mods(sinks, softcap))
        plan = packed.plan
        check_window(window)
        check_mods(sinks, softcap, q_TNH.shape[1])
        sp = self.parallel
        if plan.owner is not sp:
            raise ZooError("this Packed was sharded by a different SequenceParallel than the one applied to the "
                           "model; shard with the same `sp` whose `apply` wrapped the model")
        if plan.ring is not None and packed.blocks is not None:
            raise ZooError(f"{sp.mode} sequence parallel cannot run bidirectional blocks (Gemma 3's image tokens): "
                           "the ring's blocks are causal; use mode='ulysses' (its attention runs whole documents)")
        T, N, H = q_TNH.shape
        scale = H**-0.5 if scale is None else scale
        U = sp.ulysses_size
        if U > 1:
            q_TNH, k_TKH, v_TKH = self._scatter_heads(q_TNH, k_TKH, v_TKH, plan)
            if sinks is not None:  # this member's query heads (_scatter_heads: member u gets heads u*N/U..)
                sinks = sinks.view(U, N // U)[sp.ulysses_pos]
        if plan.ring is not None:
            # the ring applies the window from each token's global index (BlockMeta) and skips blocks outside it;
            # a softcap in its block kernels, sinks once per query after the merge of all blocks
            o_TNH = RingAttention.apply(q_TNH, k_TKH, v_TKH, plan.ring, scale, None, window, sinks, softcap)
        else:  # the group holds the whole pack in global order (of some heads): the backend's own, window included
            o_TNH = self.backend(q_TNH, k_TKH, v_TKH, packed.whole, scale, window=window, **mods(sinks, softcap))
        if U > 1:
            o_TNH = self._gather_heads(o_TNH, plan, T, N)
        return o_TNH

    def _scatter_heads(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor,
                       plan: ShardPlan) -> tuple[Tensor, Tensor, Tensor]:
        """[T_rank, heads] -> [T_group, heads / U] for q, k, v in one all-to-all."""
        sp, U = self.parallel, self.parallel.ulysses_size
        T, N, H = q_TNH.shape
        K = k_TKH.shape[1]
        if N % U:
            good = [d for d in range(1, sp.size + 1) if sp.size % d == 0 and N % d == 0]
            raise ZooError(
                f"Ulysses sequence parallel splits the {N} query heads of this layer over {U} ranks, and {N} is "
                f"not divisible by {U}; use mode='ring' (any head count), or mode='hybrid' with ulysses_size in "
                f"{good} (dividing both {N} heads and the {sp.size} ranks)")
        R = math.lcm(K, U)  # each member needs whole KV heads for its query heads: repeat only up to lcm(K, U)
        if R != K:
            k_TKH, v_TKH = k_TKH.repeat_interleave(R // K, dim=1), v_TKH.repeat_interleave(R // K, dim=1)
        qkv_TUhH = torch.cat([q_TNH.view(T, U, N // U, H), k_TKH.view(T, U, R // U, H), v_TKH.view(T, U, R // U, H)],
                             dim=2)
        send = qkv_TUhH.transpose(0, 1).reshape(U * T, -1)  # rows grouped by destination member
        recv = _AllToAll.apply(send, [T] * U, plan.group_sizes, sp.ulysses_group)  # rows by source = group order
        qkv_ThH = recv.view(recv.shape[0], -1, H)
        q_ThH, k_ThH, v_ThH = qkv_ThH.split([N // U, R // U, R // U], dim=1)
        return q_ThH, k_ThH, v_ThH

    def _gather_heads(self, o_ThH: Tensor, plan: ShardPlan, T: int, N: int) -> Tensor:
        """[T_group, N / U] -> [T_rank, N], the reverse all-to-all."""
        U, H = self.parallel.ulysses_size, o_ThH.shape[-1]
        back = _AllToAll.apply(o_ThH.reshape(o_ThH.shape[0], -1), plan.group_sizes, [T] * U,
                               self.parallel.ulysses_group)
        return back.view(U, T, N // U, H).transpose(0, 1).reshape(T, N, H)


class MixerExchange:
    """The `HeadExchange` `SequenceParallel.apply` hands every mixer (zoo.core.mixer.Mixer), for a mixer whose
    state runs along documents (Gated DeltaNet's recurrence and convolution): the Ulysses all-to-all of its own
    channels between tokens and heads (U > 1), and where documents cross ring members (ring, hybrid), the windows
    and state maps that let each member's pieces continue them (zoo.parallel.carry)."""

    def __init__(self, parallel: SequenceParallel) -> None:
        self.parallel = parallel

    @property
    def size(self) -> int:
        return self.parallel.ulysses_size

    @property
    def position(self) -> int:
        return self.parallel.ulysses_pos

    def holds(self, packed: Packed) -> bool:
        if not isinstance(packed, Shard):
            return False
        if packed.plan.owner is not self.parallel:
            raise ZooError("this Packed was sharded by a different SequenceParallel than the one applied to the "
                           "model; shard with the same `sp` whose `apply` wrapped the model")
        return True

    def scatter(self, x_TUc: Tensor, packed: Packed) -> tuple[Tensor, Packed]:
        assert isinstance(packed, Shard)
        sp, plan = self.parallel, packed.plan
        U, T = sp.ulysses_size, x_TUc.shape[0]
        if U > 1:
            send = x_TUc.transpose(0, 1).reshape(U * T, -1)  # rows grouped by destination member
            recv = _AllToAll.apply(send, [T] * U, plan.group_sizes, sp.ulysses_group)  # rows by source: group order
        else:
            recv = x_TUc.reshape(T, -1)
        return recv, packed.whole if plan.ring is None else pieces_of(plan.ring, packed.whole).packed

    def gather(self, o_tc: Tensor, packed: Packed) -> Tensor:
        assert isinstance(packed, Shard)
        sp, plan = self.parallel, packed.plan
        U, T = sp.ulysses_size, packed.num_tokens
        if U == 1:
            return o_tc.view(T, 1, -1)
        back = _AllToAll.apply(o_tc, plan.group_sizes, [T] * U, sp.ulysses_group)
        return back.view(U, T, -1).transpose(0, 1)

    def crosses(self, packed: Packed) -> bool:
        assert isinstance(packed, Shard)
        return packed.plan.ring is not None

    def halo(self, x_tc: Tensor, width: int, packed: Packed) -> Tensor:
        assert isinstance(packed, Shard) and packed.plan.ring is not None
        return halo(packed.plan.ring, packed.whole, x_tc, width)

    def carry(self, A_nXKK: Tensor, B_nXKV: Tensor, packed: Packed) -> Tensor:
        assert isinstance(packed, Shard) and packed.plan.ring is not None
        return carry(packed.plan.ring, packed.whole, A_nXKK, B_nXKV)


class SequenceParallel:
    """Split one packed sequence over the ranks of `group` (default: the world).

    mode "ulysses": all-to-all between tokens and heads; query heads must divide by the group size.
    mode "ring": K/V blocks around the ring with zigzag causal balance; any head count, any group size.
    mode "hybrid": Ulysses inside groups of `ulysses_size` consecutive ranks x ring across the groups.
    Construct it on every rank of `group` (hybrid creates two subgroups per rank, synchronised within them only).

        sp = SequenceParallel(group, mode="ring")
        model = sp.apply(model)
        local = sp.shard(zoo.pack(docs))      # every rank passes the same global pack
        model.loss(local).backward()          # then all-reduce SUM the gradients over the SP group
    """

    def __init__(self, group: ProcessGroup | None = None, mode: str = "ring", ulysses_size: int = 2) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ZooError("SequenceParallel needs torch.distributed initialised (dist.init_process_group) first")
        if mode not in MODES:
            raise ZooError(f"unknown sequence-parallel mode {mode!r}; valid modes: {', '.join(MODES)}")
        if group is None:
            group = dist.group.WORLD
            assert group is not None  # init_process_group (checked above) sets it
        self.group: ProcessGroup = group
        self.mode = mode
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        U = {"ring": 1, "ulysses": self.size, "hybrid": ulysses_size}[mode]
        if not isinstance(U, int) or U < 1 or self.size % U:
            good = [d for d in range(1, self.size + 1) if self.size % d == 0]
            raise ZooError(f"hybrid sequence parallel needs ulysses_size dividing the group size {self.size}, got "
                           f"{ulysses_size!r}; choose one of {good}")
        self.ulysses_size, self.ring_size = U, self.size // U
        self.ring_pos, self.ulysses_pos = divmod(self.rank, U)
        ranks = dist.get_process_group_ranks(self.group)
        # where the all-to-alls and the ring run: the whole group, unless hybrid splits it both ways (a group of
        # size 1 is never used, so pure ring and pure Ulysses leave the other one at the whole group)
        self.ulysses_group, self.ring_group = self.group, self.group
        if U > 1 and self.ring_size > 1:
            # each rank creates only the two subgroups it is in, synchronising with their members alone, so SP
            # groups of different data-parallel replicas need not create anything together
            G = self.ring_size
            self.ulysses_group = dist.new_group([ranks[self.ring_pos * U + u] for u in range(U)],
                                                use_local_synchronization=True)
            self.ring_group = dist.new_group([ranks[g * U + self.ulysses_pos] for g in range(G)],
                                             use_local_synchronization=True)

    def __repr__(self) -> str:
        return f"SequenceParallel(mode={self.mode!r}, size={self.size}, ulysses={self.ulysses_size}, " \
               f"ring={self.ring_size})"

    def apply(self, model: M) -> M:
        """Install the sequence-parallel attention around the model's current backend, and hand every mixer the
        exchange of its channels (zoo.core.mixer.Mixer.sequence_parallel: a mixer that cannot run in this mode refuses
        it here); returns the model."""
        exchange, mixers = MixerExchange(self), model.decoder.mixers()
        try:
            for mixer in mixers:
                mixer.sequence_parallel(exchange, self.mode)
        except ZooError:
            for mixer in mixers:  # nothing half-installed
                mixer.sequence_parallel(None, self.mode)
            raise
        backend = model.attend
        if isinstance(backend, SequenceParallelAttention):
            backend = backend.backend
        model.set_attention(SequenceParallelAttention(self, backend))
        return model

    def shard(self, packed: Packed) -> Shard:
        """This rank's part of the global pack, a `Shard` (zoo.parallel.shard): every rank of the group passes the
        same pack. Before or after `apply`: the model's target rule is applied to the whole pack when the loss
        asks the shard for its targets."""
        if packed.part_of() is not None:
            raise ZooError("this Packed is already a sequence-parallel shard; shard the global pack from zoo.pack")
        if packed.forks() is not None:
            raise ZooError("this Packed's documents fork (they share their start, laid out once: zoo.core.forks), "
                           "which a cut over ranks would separate; lay each path out as a document of its own")
        T, G, U = packed.num_tokens, self.ring_size, self.ulysses_size
        if T < 2 * self.size:
            raise ZooError(f"a pack of {T} tokens is too short to split over {self.size} ranks (at least "
                           f"{2 * self.size} tokens needed); pack more documents or use fewer ranks")
        self._check_same_pack(packed)
        device = packed.device
        layout = [idx.to(device) for idx in balanced_layout(packed.seqlens(), G, U)]
        ring = None
        if G > 1:
            lens = torch.tensor(packed.seqlens(), device=device)
            doc_T = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
            groups = [torch.cat(layout[g * U : (g + 1) * U]) for g in range(G)]
            blocks = [BlockMeta(ix, doc_T[ix]) for ix in groups]
            active = [[has_pairs(a, b) for b in blocks] for a in blocks]
            ring = Ring(self.ring_group, self.ring_pos, G, blocks, active)
        group_sizes = [len(ix) for ix in layout[self.ring_pos * U : (self.ring_pos + 1) * U]]
        return cut(packed, layout[self.rank], ShardPlan(self, group_sizes, ring))

    def _check_same_pack(self, packed: Packed) -> None:
        """Every rank must shard the same global pack; a mismatch would silently mix documents. One small
        all-gather of a fingerprint (token count, documents, two checksums of the ids) catches it on every rank."""
        ids = packed.input_ids.long()
        weights = torch.arange(1, len(ids) + 1, device=ids.device) % 65521
        mine = torch.stack([torch.tensor(len(ids), device=ids.device), torch.tensor(packed.num_docs, device=ids.device),
                            ids.sum(), (ids * weights).sum() % 2147483647])
        if dist.get_backend(self.group) == "nccl":
            mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        if any(not torch.equal(e, every[0]) for e in every):
            # the counts can agree while the ids differ: the checksum tells those ranks apart
            shapes = ", ".join(f"rank {r}: {int(e[0])} tokens in {int(e[1])} documents, ids checksum {int(e[3])}"
                               for r, e in enumerate(every))
            raise ZooError(f"the ranks of a sequence-parallel group sharded different packs ({shapes}); every rank "
                           f"of the group must call shard() with the same global pack (same data, same order)")
