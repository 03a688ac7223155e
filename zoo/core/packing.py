"""The packed batch: many documents in one token stream, no padding, no batch dimension.

A `Packed` is what every zoo model takes. Document boundaries travel with the tokens as `cu_seqlens`
(cumulative lengths, the flash-attn convention), positions restart at 0 in each document, and `labels` already
hold the next token inside the same document, so a loss never reaches across a document boundary.

A Packed holds the pack and nothing else (but `memo`, below). What a model needs beyond its fields it asks through
methods: `doc_len_per_token()`, `targets(rule)` and `count_targets(rule)`, `part_of()`, which says whether it
is a part of a larger pack, and `forks()`, whether its documents share their start (zoo.core.forks). A part (a
sequence-parallel shard, `zoo.parallel.Shard`, a subclass) answers them from the whole pack it was cut from;
zoo.core knows nothing of how it was cut.

What zoo derives from a pack (its document lengths as ints, document runs, attention masks) is computed once and
kept in its `memo`, a `Derived` bound to the tensor it comes from (cu_seqlens), never to the Packed object: a copy
of a pack (`dataclasses.replace`, `.to()` onto its own device, FSDP's input cast, which rebuilds every dataclass
argument field by field) holds the same tensor and shares it; a copy with other boundaries starts its own. A ring
block of sequence parallelism keeps what is derived from it the same way (zoo.parallel.ring_blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from zoo.core.forks import Forks
from zoo.errors import ZooError

IGNORE_INDEX = -100

T_ = TypeVar("T_")
P = TypeVar("P", bound="Packed")


class Derived:
    """What is derived from some tensors (`sources`), computed once by key and kept: zoo's one kind of cache. Its
    holder (a Packed, a ring block) passes it on to its copies, which hold the same tensors, and starts a new one
    when its tensors are others (`bound`). Tensors are never modified in place, so a tensor stands for its values;
    the sources are compared by identity, and the cache goes with its holders."""

    __slots__ = ("sources", "values")

    def __init__(self, sources: tuple[Tensor, ...]) -> None:
        self.sources = sources
        self.values: dict[Hashable, Any] = {}

    @staticmethod
    def bound(held: Derived | None, sources: tuple[Tensor, ...]) -> Derived:
        """`held` if it was derived from exactly these tensors, else a new, empty one."""
        if held is not None and len(held.sources) == len(sources) and all(
                a is b for a, b in zip(held.sources, sources)):
            return held
        return Derived(sources)

    def get(self, key: Hashable, build: Callable[[], T_]) -> T_:
        """`build()`, once per key."""
        if key not in self.values:
            self.values[key] = build()
        return self.values[key]


# a model's target rule (ZooModel.labels): the labels a loss counts, -100 elsewhere
TargetRule = Callable[["Packed"], Tensor]


@dataclass(eq=False)  # by identity: tensors have no single truth value (and no cache depends on a pack's identity)
class Packed:
    """A packed batch of T tokens from n documents.

    input_ids     [T] int64
    cu_seqlens    [n+1] int32, document i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    position_ids  [T] int64, each token's position in its document (restarting at 0 in each)
    max_seqlen    longest document
    labels        [T] int64, next token in the same document or IGNORE_INDEX (-100)
    pixel_values  [I, C, H, W] images of the pack in order of their placeholders (LLaVA), or the patches of all
                  of them [P, C*t*p*p] (Qwen-VL: `ImagePatches`), or None
    image_grid_thw   [I, 3] each image's (t, h, w) grid of patches, where pixel_values are patches (Qwen-VL)
    position_ids_3T  [3, T] M-RoPE's (temporal, height, width) positions of these tokens, where the caller gives
                  them (a decode step: the text position plus the prompt's rope delta); None: a Qwen-VL model
                  derives them per document from input_ids and the grids
    doc_len       [T] int64, the length of the whole document each token belongs to, where the pack holds only
                  part of it: like position_ids, it places each token in its whole document (a sequence-parallel
                  shard holds pieces of documents; a decode step holds each sequence's newest token, the earlier
                  ones being in the KV cache). None: the documents are whole, cu_seqlens says it.
    images_per_doc   how many images each document brought (zoo.pack with images), for error messages
    blocks        [T] int64, or None: tokens of one block (the same id >= 0) attend to each other both ways, within
                  their document; -1 and None: causal (Gemma 3's image tokens: `with_blocks`, which a model calls)
    memo          what is derived from cu_seqlens (a `Derived`: built on first use, shared with every copy that keeps
                  the same cu_seqlens); leave it out
    """

    input_ids: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    max_seqlen: int
    labels: Tensor | None = None
    pixel_values: Tensor | None = None
    doc_len: Tensor | None = None
    images_per_doc: list[int] | None = None
    image_grid_thw: Tensor | None = None
    position_ids_3T: Tensor | None = None
    blocks: Tensor | None = None
    memo: Derived | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.memo = Derived.bound(self.memo, (self.cu_seqlens,))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def derived(self, key: Hashable, build: Callable[[], T_]) -> T_:
        """`build()` once per pack and key: a structure derived from the document boundaries (see `Derived`)."""
        self.memo = Derived.bound(self.memo, (self.cu_seqlens,))  # a no-op unless cu_seqlens was assigned since
        return self.memo.get(key, build)

    def seqlens(self) -> list[int]:
        """Document lengths as Python ints (known to whoever built the pack, else one host sync, then kept)."""
        return self.derived("seqlens", lambda: _lengths(self.cu_seqlens.tolist()))

    def doc_len_per_token(self) -> Tensor:
        """[T] the full length of the document each token belongs to (dynamic RoPE scaling needs it)."""
        if self.doc_len is not None:
            return self.doc_len

        def build() -> Tensor:
            lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
            return torch.repeat_interleave(lens, lens)

        return self.derived("doc_len", build)

    def part_of(self) -> tuple[Packed, Tensor] | None:
        """None: this pack is whole. A part of a larger pack (a sequence-parallel shard) gives that pack and where
        each of its tokens sits in it, [T] indices: a model that numbers something over the whole pack (LLaVA its
        image placeholders) asks here, and attention over a part alone would be wrong (the backends refuse it)."""
        return None

    def forks(self) -> Forks | None:
        """None: every document runs straight through. A pack whose documents fork (documents sharing their start,
        laid out once: recipes.dpo's shared prompt) gives its pieces (zoo.core.forks), which its mixers follow."""
        return None

    def with_blocks(self, rule: Callable[[Packed], Tensor]) -> Packed:
        """This pack with `blocks` = `rule(whole pack)`: the bidirectional blocks (a model's rule: Gemma 3's runs of
        image tokens) numbered over the whole pack. A part of a pack (a sequence-parallel shard) gets its own tokens'
        and its whole pack gets them too, which the attention over the whole (Ulysses) reads. None where the pack has
        no block (every token causal: the backends keep their causal fast paths)."""
        blocks_T = rule(self)
        return replace(self, blocks=blocks_T if blocks_T.ge(0).any() else None)

    def sum_over_parts(self, t: Tensor) -> Tensor:
        """`t` (a statistic of this pack's tokens, no gradient) summed over every part of the whole pack this one
        was cut from: a sequence-parallel shard's all-reduce over its group (MoE balancing counts over the whole
        pack). A whole pack: `t`."""
        return t

    def require_labels(self) -> Tensor:
        """labels [T], or a ValueError saying how to get them (a loss needs them)."""
        if self.labels is None:
            raise ZooError("this Packed has no labels; build it with zoo.pack(...) to get next-token labels")
        return self.labels

    def targets(self, rule: TargetRule | None = None) -> Tensor:
        """[T] the labels a loss over this pack counts: a model's target `rule` (`ZooModel.labels`) applied to the
        pack, or its labels. A part of a pack applies the rule to the whole pack and keeps its own tokens', so a
        rule sees what it sees in one process."""
        part = self.part_of()
        if part is not None:
            whole, index_T = part
            return whole.targets(rule)[index_T]
        return self.require_labels() if rule is None else rule(self)

    def count_targets(self, rule: TargetRule | None = None) -> int:
        """How many targets a loss over this pack averages over: those of `targets(rule)`; a part of a pack counts
        its whole pack's, so that the parts' losses add up to the whole pack's mean."""
        part = self.part_of()
        if part is not None:
            return part[0].count_targets(rule)
        return int((self.targets(rule) != IGNORE_INDEX).sum())

    def check_ids(self, vocab_size: int) -> None:
        """Every token id in [0, vocab_size), else a ZooError naming the id and the vocabulary (checked once per
        pack: one reduction and one host sync, not a bare IndexError deep inside the embedding)."""
        checked: list[Tensor] = self.derived(("ids checked", vocab_size), list)  # the input_ids checked last
        if not checked or checked[0] is not self.input_ids:
            check_ids(self.input_ids, vocab_size)
            checked[:] = [self.input_ids]

    def to(self, device: torch.device | str) -> Packed:
        """This pack with its tensors on `device` (copied without blocking the host)."""

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=True)

        def maybe(t: Tensor | None) -> Tensor | None:
            return None if t is None else move(t)

        moved = replace(
            self,
            input_ids=move(self.input_ids),
            cu_seqlens=move(self.cu_seqlens),
            position_ids=move(self.position_ids),
            labels=maybe(self.labels),
            pixel_values=maybe(self.pixel_values),
            doc_len=maybe(self.doc_len),
            image_grid_thw=maybe(self.image_grid_thw),
            position_ids_3T=maybe(self.position_ids_3T),
            blocks=maybe(self.blocks),
        )
        if self.cu_seqlens.device.type == "cpu":  # the lengths as ints come along: no host sync on the device
            moved.derived("seqlens", self.seqlens)
        return moved


@dataclass(frozen=True)
class ImagePatches:
    """Images cut into patches at their own sizes (Qwen-VL, `zoo.io.image.preprocess`): `pixel_values` [P, C*t*p*p]
    the patches of every image in order, `grid_thw` [I, 3] each image's (t, h, w) grid (t*h*w patches each)."""

    pixel_values: Tensor
    grid_thw: Tensor

    def __len__(self) -> int:
        return self.grid_thw.shape[0]


def _lengths(cu: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def runs_of(is_T: Tensor, cu_seqlens: Tensor) -> Tensor:
    """[T] int64: each maximal run of True in `is_T` within one document numbered 0, 1, ... over the pack; -1
    where False (Gemma 3's bidirectional image blocks, as transformers' token_type_ids make them)."""
    T = is_T.shape[0]
    starts_T = torch.zeros(T, dtype=torch.bool, device=is_T.device)
    starts_T[cu_seqlens[:-1].long()] = True  # a document's first token starts a run when it is one
    new_T = is_T.clone()
    new_T[1:] &= ~is_T[:-1] | starts_T[1:]
    return torch.where(is_T, torch.cumsum(new_T, 0) - 1, -1)


def with_seqlens(packed: P, lens: list[int]) -> P:
    """`packed`, its document lengths known as the ints `lens` (whoever builds a pack knows them: saves a sync)."""
    packed.derived("seqlens", lambda: lens)
    return packed


def check_ids(ids: Tensor, vocab_size: int) -> None:
    """A ZooError naming the first id found outside [0, vocab_size), if any."""
    if ids.numel():
        low, high = torch.stack([ids.min(), ids.max()]).tolist()  # one host sync for both
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise ZooError(f"token id {bad} is outside the model's vocabulary of {vocab_size} (ids 0.."
                           f"{vocab_size - 1}); was the text tokenized with another model's tokenizer?")


def pack(
    docs: list[Tensor],
    *,
    label_masks: list[Tensor] | None = None,
    images: Sequence[Tensor | ImagePatches | None] | None = None,
) -> Packed:
    """Pack 1-D LongTensors of token ids into one `Packed`.

    label_masks: optional bool tensor per document, True where the token is a target to predict (SFT puts
    True on assistant tokens only). Without it every token after the first of its document is a target.
    images: optional pixel values per document (a [C, H, W] or [k, C, H, W] tensor, or None), concatenated
    in document order into `pixel_values`; or `ImagePatches` per document (Qwen-VL), whose patches and grids are
    concatenated into `pixel_values` and `image_grid_thw`. The model checks them against its placeholder tokens.
    """
    if not isinstance(docs, (list, tuple)) or len(docs) == 0:
        raise ZooError(f"pack() expects a non-empty list of 1-D token tensors, got {type(docs).__name__}")
    for i, d in enumerate(docs):
        if not isinstance(d, Tensor) or d.dim() != 1 or d.numel() == 0:
            got = f"shape {tuple(d.shape)}" if isinstance(d, Tensor) else type(d).__name__
            raise ZooError(f"pack(): document {i} must be a non-empty 1-D tensor of token ids, got {got}")
        if d.dtype.is_floating_point or d.dtype == torch.bool:
            raise ZooError(f"pack(): document {i} must hold integer token ids, got dtype {d.dtype}")
    device = docs[0].device
    lens = torch.tensor([d.numel() for d in docs], dtype=torch.int64)
    input_ids = torch.cat([d.to(torch.int64) for d in docs]).to(device)
    cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lens, 0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens)
    position_ids = torch.arange(int(lens.sum())) - starts

    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = input_ids[1:]
    labels[(cu_seqlens[1:] - 1).long().to(device)] = IGNORE_INDEX  # no target across a document boundary
    if label_masks is not None:
        if len(label_masks) != len(docs):
            raise ZooError(f"pack(): got {len(label_masks)} label masks for {len(docs)} documents")
        for i, (m, d) in enumerate(zip(label_masks, docs)):
            if m.shape != d.shape:
                raise ZooError(f"pack(): label mask {i} has shape {tuple(m.shape)}, document has {tuple(d.shape)}")
        is_target = torch.cat([m.to(torch.bool) for m in label_masks]).to(device)
        keep = torch.zeros_like(is_target)
        keep[:-1] = is_target[1:]  # label at t predicts token t+1
        labels = torch.where(keep, labels, torch.full_like(labels, IGNORE_INDEX))

    pixel_values = grid_thw = None
    if images is not None:
        if len(images) != len(docs):
            raise ZooError(f"pack(): got images for {len(images)} documents, expected one entry per document "
                             f"({len(docs)}; use None for a document without images)")
        patches = [im for im in images if isinstance(im, ImagePatches)]
        pixels = [im for im in images if isinstance(im, Tensor)]
        if patches and pixels:
            raise ZooError("pack(): images are either pixel tensors (LLaVA) or ImagePatches (Qwen-VL) for every "
                           "document, not a mix")
        if patches:
            pixel_values = torch.cat([im.pixel_values for im in patches]).to(device)
            grid_thw = torch.cat([im.grid_thw for im in patches]).to(device)
        elif pixels:
            pixel_values = torch.cat([im if im.dim() == 4 else im.unsqueeze(0) for im in pixels]).to(device)

    packed = Packed(
        input_ids=input_ids,
        cu_seqlens=cu_seqlens.to(device),
        position_ids=position_ids.to(device),
        max_seqlen=int(lens.max()),
        labels=labels,
        pixel_values=pixel_values,
        images_per_doc=None if images is None else [0 if im is None else len(im) if isinstance(im, ImagePatches)
                                                    else (1 if im.dim() == 3 else im.shape[0]) for im in images],
        image_grid_thw=grid_thw,
    )
    return with_seqlens(packed, lens.tolist())


def as_packed(input_ids: Tensor | Packed, cu_seqlens: Tensor | None = None) -> Packed:
    """What model forwards accept: a Packed, or input_ids [T] with cu_seqlens [n+1] (None: one document)."""
    if isinstance(input_ids, Packed):
        return input_ids
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 1:
        got = f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
        hint = " (zoo has no batch dimension: pack documents with zoo.pack)" if isinstance(input_ids, Tensor) else ""
        raise ZooError(f"expected input_ids of shape [T] or a Packed, got {got}{hint}")
    T = input_ids.shape[0]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=input_ids.device)
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        got = f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, Tensor) else \
            type(cu_seqlens).__name__
        raise ZooError(f"cu_seqlens must be a 1-D integer tensor [n+1] (int32), got {got}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b <= a for a, b in zip(cu[:-1], cu[1:])):
        raise ZooError(f"cu_seqlens must rise strictly from 0 to T={T}, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    lens = _lengths(cu)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), torch.tensor(lens, device=input_ids.device))
    position_ids = torch.arange(T, device=input_ids.device) - starts
    return with_seqlens(Packed(input_ids, cu_seqlens.to(torch.int32), position_ids, max(lens)), lens)
