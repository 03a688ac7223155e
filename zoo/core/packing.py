"""The packed batch: many documents in one token stream, no padding, no batch dimension.

A `Packed` is what every zoo model takes. Document boundaries travel with the tokens as `cu_seqlens`
(cumulative lengths, the flash-attn convention), positions restart at 0 in each document, and `labels` already
hold the next token inside the same document, so a loss never reaches across a document boundary.

Sequence parallelism (`zoo.parallel`) hands each rank a `Packed` holding only its tokens; the fields that
describe the global pack (`global_input_ids`, `token_index`, `doc_len`, `num_loss_tokens`) are filled in then and
left alone here. A model may read every public field; `shard_plan` belongs to the sequence-parallel attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zoo.errors import ZooError

if TYPE_CHECKING:
    from zoo.parallel.sequence import ShardPlan

IGNORE_INDEX = -100


@dataclass(eq=False)  # identity: a pack is one batch, and the attention backends key their caches on it
class Packed:
    """A packed batch of T tokens from n documents.

    input_ids     [T] int64
    cu_seqlens    [n+1] int32, document i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    position_ids  [T] int64, restarting at 0 in each document
    max_seqlen    longest document
    labels        [T] int64, next token in the same document or IGNORE_INDEX (-100)
    pixel_values  [I, C, H, W] images of the pack in order of their placeholders (LLaVA), or None
    doc_len       [T] int64, length of the document each token belongs to, when it differs from what cu_seqlens
                  says (a sequence-parallel shard holds pieces of documents); None means "from cu_seqlens"
    num_loss_tokens  how many labels the loss is averaged over; None means this pack's own count. A
                  sequence-parallel shard sets the global count so per-rank losses add up to the global mean.
    images_per_doc   how many images each document brought (zoo.pack with images), for error messages
    doc_lens      the document lengths as Python ints when whoever built the pack knows them (saves a host
                  sync); None: read from cu_seqlens on first use
    global_input_ids  [T_global] a sequence-parallel shard's whole pack of ids (LLaVA numbers its image
                  placeholders there); None: this pack is whole
    token_index   [T] a shard's global index of each of its tokens; None: this pack is whole
    shard_plan    how a shard's attention is distributed: read only by zoo.parallel's attention, never a model
    """

    input_ids: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    max_seqlen: int
    labels: Tensor | None = None
    pixel_values: Tensor | None = None
    doc_len: Tensor | None = None
    num_loss_tokens: int | None = None
    images_per_doc: list[int] | None = None
    doc_lens: list[int] | None = field(default=None, repr=False)
    global_input_ids: Tensor | None = field(default=None, repr=False)
    token_index: Tensor | None = field(default=None, repr=False)
    shard_plan: ShardPlan | None = field(default=None, repr=False)
    # packing.py's own, derived from the fields above; not an init field, so replace() starts a fresh one
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, init=False)

    @property
    def is_shard(self) -> bool:
        """A sequence-parallel shard: pieces of documents, attended only through the model sp.apply wrapped."""
        return self.shard_plan is not None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def seqlens(self) -> list[int]:
        """Document lengths as Python ints (`doc_lens`, or one host sync, then kept)."""
        if self.doc_lens is None:
            cu = self.cu_seqlens.tolist()
            self.doc_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return self.doc_lens

    def doc_len_per_token(self) -> Tensor:
        """[T] the full length of the document each token belongs to (dynamic RoPE scaling needs it)."""
        if self.doc_len is not None:
            return self.doc_len
        if "doc_len" not in self._cache:
            lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
            self._cache["doc_len"] = torch.repeat_interleave(lens, lens)
        return self._cache["doc_len"]

    def require_labels(self) -> Tensor:
        """labels [T], or a ValueError saying how to get them (a loss needs them)."""
        if self.labels is None:
            raise ZooError("this Packed has no labels; build it with zoo.pack(...) to get next-token labels")
        return self.labels

    def check_ids(self, vocab_size: int) -> None:
        """Every token id in [0, vocab_size), else a ZooError naming the id and the vocabulary (checked once per
        pack: one reduction and one host sync, not a bare IndexError deep inside the embedding)."""
        if self._cache.get("ids_checked") != vocab_size:
            check_ids(self.input_ids, vocab_size)
            self._cache["ids_checked"] = vocab_size

    def loss_denominator(self) -> int:
        """How many targets a loss over this pack averages over (`num_loss_tokens`, else the labels' count)."""
        if self.num_loss_tokens is not None:
            return self.num_loss_tokens
        return int((self.require_labels() != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Packed:
        """This pack with its tensors on `device` (copied without blocking the host)."""

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=True)

        def maybe(t: Tensor | None) -> Tensor | None:
            return None if t is None else move(t)

        return replace(
            self,
            input_ids=move(self.input_ids),
            cu_seqlens=move(self.cu_seqlens),
            position_ids=move(self.position_ids),
            labels=maybe(self.labels),
            pixel_values=maybe(self.pixel_values),
            doc_len=maybe(self.doc_len),
            global_input_ids=maybe(self.global_input_ids),
            token_index=maybe(self.token_index),
        )


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
    images: list[Tensor | None] | None = None,
) -> Packed:
    """Pack 1-D LongTensors of token ids into one `Packed`.

    label_masks: optional bool tensor per document, True where the token is a target to predict (SFT puts
    True on assistant tokens only). Without it every token after the first of its document is a target.
    images: optional pixel values per document (a [C, H, W] or [k, C, H, W] tensor, or None), concatenated
    in document order into `pixel_values`; the model checks them against its placeholder tokens.
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

    pixel_values = None
    if images is not None:
        if len(images) != len(docs):
            raise ZooError(f"pack(): got images for {len(images)} documents, expected one entry per document "
                             f"({len(docs)}; use None for a document without images)")
        per_doc = [im if im.dim() == 4 else im.unsqueeze(0) for im in images if im is not None]
        pixel_values = torch.cat(per_doc).to(device) if per_doc else None

    packed = Packed(
        input_ids=input_ids,
        cu_seqlens=cu_seqlens.to(device),
        position_ids=position_ids.to(device),
        max_seqlen=int(lens.max()),
        labels=labels,
        pixel_values=pixel_values,
        images_per_doc=None if images is None else [0 if im is None else (1 if im.dim() == 3 else im.shape[0])
                                                    for im in images],
        doc_lens=lens.tolist(),
    )
    return packed


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
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), torch.tensor(lens, device=input_ids.device))
    position_ids = torch.arange(T, device=input_ids.device) - starts
    return Packed(input_ids, cu_seqlens.to(torch.int32), position_ids, max(lens), doc_lens=lens)
