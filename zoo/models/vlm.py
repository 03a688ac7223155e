"""What every vision-language model shares: a vision part below `language_model` (zoo's shared Decoder), the
members of the contract delegated to that language model once, the loss over text targets, and the processor's
placeholder expansion at the text level.

Shapes: T tokens of the pack, D language-model width, V vocab.
A family's class (LLaVA, Qwen2.5-VL, Gemma 3) builds `vision` (and a projector where it has one) and
`language_model`, and says how images enter the token stream (`hidden`, `preprocess_images`, `image_text`);
recipes, zoo.parallel and zoo.generate use the language model's members through the ones here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.attention import AttentionFn
from zoo.core.packing import IGNORE_INDEX, Packed, as_packed, check_ids
from zoo.errors import ZooError
from zoo.models.decoder import Decoder, routed_loss


class LanguageConfig(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class VisionLanguageConfig(Protocol):
    """What the shared part reads of a vision-language family's config."""

    @property
    def language(self) -> LanguageConfig: ...

    @property
    def image_token_id(self) -> int: ...


def nested_config(cfg: Any, vision_cls: type, language_cls: type) -> None:
    """A vision-language config after construction: its sub-configs built from the plain dicts a zoo checkpoint's
    config.json holds, its image mean and std as tuples."""
    if isinstance(cfg.vision, dict):
        object.__setattr__(cfg, "vision", vision_cls(**cfg.vision))
    if isinstance(cfg.language, dict):
        object.__setattr__(cfg, "language", language_cls(**cfg.language))
    for name in ("image_mean", "image_std"):
        object.__setattr__(cfg, name, tuple(getattr(cfg, name)))


def n_images(images: Any) -> int:
    """How many images a model's preprocessed images hold (pixel values [I, ...], `ImagePatches`, a list; None: 0)."""
    return 0 if images is None else len(images)


class VisionLanguage(nn.Module):
    """A vision part and a language model; the rest of zoo sees the language model's members through these."""

    config: VisionLanguageConfig
    language_model: Decoder
    # the text that marks an image in a prompt before the processor expands it (the checkpoint tokenizer's token)
    placeholder: str = "<image>"

    # ---- the language model's members (the contract), delegated to the one inside ----
    @property
    def decoder(self) -> Decoder:
        return self.language_model

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def attend(self) -> AttentionFn:
        return self.language_model.attend

    @property
    def head_weight(self) -> Tensor:
        return self.language_model.head_weight

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.language.eos_token_ids

    def set_attention(self, attn: str | AttentionFn) -> None:
        """The language model's attention function (a tower whose attention is plain and per image keeps its own)."""
        self.language_model.set_attention(attn)

    def decode_offsets(self, packed: Packed) -> Tensor | None:
        """None: decoded tokens take their text positions (the contract's)."""
        return None

    # ---- the parts ----
    def fsdp_units(self) -> list[nn.Module]:
        """Every part besides the language model (the tower, a projector): FSDP units of their own besides the
        language model's blocks, so a stage that freezes one never mixes trained and frozen parameters in a unit."""
        return [m for m in self.children() if m is not self.language_model]

    def parts(self) -> dict[str, list[nn.Module]]:
        """The trainable parts by name (`freeze`): the tower, what maps its features to the language model's width,
        the language model."""
        raise NotImplementedError

    def freeze(self, vision: bool | None = None, projector: bool | None = None, language: bool | None = None) -> None:
        """Freeze (True) or unfreeze (False) parts; None leaves a part as it is.

        LLaVA's stage 1 trains the projector alone (`freeze(vision=True, projector=False, language=True)`),
        stage 2 the projector and the language model (`freeze(vision=True, projector=False, language=False)`).
        Qwen2.5-VL's projector is its tower's patch merger.
        """
        parts = self.parts()
        for name, frozen in (("vision", vision), ("projector", projector), ("language", language)):
            if frozen is not None:
                for part in parts[name]:
                    part.requires_grad_(not frozen)

    # ---- images in the prompt's text ----
    def image_tokens(self, height: int, width: int) -> int:
        """How many placeholder tokens the checkpoint's processor writes for an image of height x width pixels,
        from its size alone: a sample's length is known before any of its pixels is decoded."""
        raise NotImplementedError

    def token_counts(self, images: Any) -> list[int]:
        """Each of the model's preprocessed images' placeholder token counts (zoo.io.image.preprocess's output)."""
        raise NotImplementedError

    def image_text(self, tokens: int) -> str:
        """What the checkpoint's processor writes in place of the placeholder of an image of `tokens` tokens."""
        raise NotImplementedError

    def expand_placeholders(self, text: str, images: Any) -> str:
        """`text` with each image's placeholder (`placeholder`, one per image, in order) expanded as the checkpoint's
        processor expands it before tokenizing; `images` are the model's preprocessed images
        (zoo.io.image.preprocess). The result tokenizes to the ids zoo.pack takes."""
        return self._expand(text, [] if images is None else self.token_counts(images))

    def expand_for_sizes(self, text: str, sizes: Sequence[tuple[int, int]]) -> str:
        """`expand_placeholders` for images of these (height, width) pixels, none of them decoded or preprocessed:
        the same text (the tokens of each image are `image_tokens`)."""
        bad = next((s for s in sizes if len(s) != 2 or min(s) < 1), None)
        if bad is not None:
            raise ZooError(f"image sizes are (height, width) in pixels, each at least 1: got {tuple(bad)}")
        return self._expand(text, [self.image_tokens(h, w) for h, w in sizes])

    def _expand(self, text: str, counts: list[int]) -> str:
        found = text.count(self.placeholder)
        if found != len(counts):
            raise ZooError(f"the text holds {found} image placeholder(s) {self.placeholder!r} but {len(counts)} "
                           "image(s) came: put one placeholder where each image goes")
        pieces = text.split(self.placeholder)
        return "".join(p + (self.image_text(counts[i]) if i < found else "") for i, p in enumerate(pieces))

    # ---- the pack through the language model ----
    def hidden(self, packed: Packed) -> Tensor:
        """Final normed hidden states [T, D] of the language model, the images written into their placeholders."""
        raise NotImplementedError

    def labels(self, packed: Packed) -> Tensor:
        """packed.labels with every image-placeholder target ignored (an image is input, never a prediction)."""
        labels_T = packed.require_labels()
        return labels_T.masked_fill(labels_T == self.config.image_token_id, IGNORE_INDEX)

    def forward(self, packed: Packed | Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """logits [T, V] of a packed multimodal batch (or of input_ids [T] with cu_seqlens, text only)."""
        return F.linear(self.hidden(as_packed(packed, cu_seqlens)), self.head_weight)

    def loss(self, packed: Packed, *, denominator: int | None = None, aux_loss_coef: float = 0.0,
             aux_loss: str = "batch", z_loss_coef: float = 0.0, parts: dict[str, Tensor] | None = None) -> Tensor:
        """Next-token cross-entropy over the text targets (image placeholders are never targets): their mean, or
        their sum over `denominator` (see ZooModel.loss). A shard's labels are the rule applied to its whole pack.
        A Mixture-of-Experts language model (Qwen3.5-MoE's) adds its balancing terms over every token of the pack,
        image tokens included, as transformers' model does (zoo.models.decoder.Decoder.loss's arguments)."""
        return routed_loss(self.decoder, packed, lambda: self.hidden(packed), self.labels, denominator=denominator,
                           aux_loss_coef=aux_loss_coef, aux_loss=aux_loss, z_loss_coef=z_loss_coef, parts=parts)


# ---- a fixed number of tokens per image (LLaVA, Gemma 3): pixel values [I, C, S, S], M placeholders each ----


def fixed_slots(packed: Packed, image_token_id: int, per_image: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows_R, image_R, token_R): each local placeholder's row and which image and which of its M tokens it shows.
    A part of a pack (a sequence-parallel shard) numbers the placeholders over the whole, then keeps its rows."""
    M = per_image
    n = 0 if packed.pixel_values is None else packed.pixel_values.shape[0]
    whole, index_T = packed.part_of() or (packed, None)
    is_image_G = whole.input_ids == image_token_id
    if int(is_image_G.sum()) != n * M:
        _explain_mismatch(whole, is_image_G, n, image_token_id, M)
    ordinal_G = torch.cumsum(is_image_G, 0) - 1  # placeholder number of each position of the whole pack
    rows_R = (is_image_G if index_T is None else is_image_G[index_T]).nonzero().squeeze(1)
    ordinal_R = ordinal_G[rows_R if index_T is None else index_T[rows_R]]
    return rows_R, ordinal_R // M, ordinal_R % M


def _explain_mismatch(whole: Packed, is_image_G: Tensor, n: int, tok: int, M: int) -> None:
    per_doc = whole.images_per_doc or ([0] * whole.num_docs if n == 0 else None)
    if per_doc is not None:
        cu = whole.cu_seqlens.tolist()
        for d in range(whole.num_docs):
            have = int(is_image_G[cu[d]:cu[d + 1]].sum())
            if have != per_doc[d] * M:
                raise ZooError(f"document {d} has {have} image placeholder tokens (id {tok}) but {per_doc[d]} "
                               f"image(s), which need {per_doc[d] * M} ({M} per image); expand the text's "
                               "placeholders with model.expand_placeholders and pass one pixel tensor per image")
    raise ZooError(f"the pack has {int(is_image_G.sum())} image placeholder tokens (id {tok}) but {n} image(s), "
                   f"which need {n * M} ({M} per image); expand the text's placeholders with "
                   "model.expand_placeholders and pass the images with zoo.pack(docs, images=...)")


def splice_fixed(packed: Packed, embed: Callable[[Tensor], Tensor], vocab_size: int, image_token_id: int,
                 per_image: int, encode: Callable[[Tensor], Tensor], pixel_shape: Sequence[int]) -> Tensor:
    """[T, D] token embeddings (`embed`) with the images' features (`encode`: pixels [J, C, S, S] -> [J, M, D])
    written into the placeholder rows. Only the images this pack's placeholders show are encoded (all of them,
    unless this is a sequence-parallel shard); the tower runs even on none (an empty batch of `pixel_shape`), so
    every rank calls it once per step, as FSDP's collectives require."""
    is_image_T = packed.input_ids == image_token_id
    text_ids = packed.input_ids.masked_fill(is_image_T, 0)  # the placeholder id need not be in the vocabulary
    check_ids(text_ids, vocab_size)
    x_TD = embed(text_ids)
    rows_R, image_R, token_R = fixed_slots(packed, image_token_id, per_image)
    needed_J, which_R = torch.unique(image_R, sorted=True, return_inverse=True)
    pixels = packed.pixel_values
    if pixels is None:
        pixels = x_TD.new_zeros(0, *pixel_shape)
    elif len(needed_J) != pixels.shape[0]:
        pixels = pixels[needed_J.to(pixels.device)]
    feats_JMD = encode(pixels)
    return x_TD.index_put((rows_R,), feats_JMD[which_R, token_R].to(x_TD.dtype))


def write_rows(x_TD: Tensor, rows_R: Tensor, feats_RD: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """Image tokens' features [R, D or more] written into their rows of x_TD; what lies beyond D (DeepStack's levels)
    returned beside, with the rows. Written even to no rows, the tower that made them stays in the graph."""
    D, feats_RD = x_TD.shape[1], feats_RD.to(x_TD.dtype)
    deepstack = (rows_R, feats_RD[:, D:]) if feats_RD.shape[1] > D else None
    return x_TD.index_put((rows_R,), feats_RD[:, :D]), deepstack
