"""The contract between zoo's models, the packed batch and parallelism: what every model exposes, and nothing more.

`zoo.parallel` (sequence parallel, FSDP, activation checkpointing, compile), the recipes, the converters and
`zoo.train.flops` touch a model only through `ZooModel`; they never ask which family it is or probe its attributes.
A model, in turn, reads the fields of `zoo.Packed` and asks it the rest through its methods (`targets`,
`count_targets`, `doc_len_per_token`, `part_of`): a sequence-parallel shard is a Packed (its own tokens) that
answers them from the whole pack, so a model never learns how a pack was cut, and never imports torch.distributed.
Per-layer state goes through declared seams only: attention's through `set_attention` (`PerLayerAttention`), every
other mixer's through `LanguageModel.mixers()` and the `zoo.core.mixer.Mixer` protocol each keeps.

Every text family runs `zoo.models.decoder.Decoder`; it and LLaVA satisfy this, which `zoo.models` checks with the
type checker. What generic code needs to know about a family beyond its model (names, conversions, LoRA defaults)
is its `zoo.models.family.Family` record, found by `model.family` in `zoo.models.FAMILIES`.
The specs a family's config gives the shared decoder (`DecoderSpec` and its parts) live in `zoo.core.specs`; they
are re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor, nn
from typing_extensions import TypeIs  # torch depends on it; in typing from Python 3.13

from zoo.core.attention import AttentionFn
from zoo.core.mixer import Mixer
from zoo.core.packing import Packed
from zoo.core.specs import (
    PLACEMENTS,
    ROPE_LAYOUTS,
    Activation,
    AttentionSpec,
    DecoderSpec,
    GatedDeltaNetSpec,
    LayerSpec,
    MLASpec,
    MLPSpec,
    MoESpec,
    NormSpec,
    Placement,
    QKNorm,
    Rope,
    RopeLayout,
    RotaryFn,
    Scoring,
)

# the specs a family's config gives the decoder: their home is zoo.core.specs, re-exported here, where the families
# import them
__all__ = ["PLACEMENTS", "ROPE_LAYOUTS", "Activation", "AttentionSpec", "DecoderSpec", "GatedDeltaNetSpec", "LayerSpec",
           "MLASpec", "MLPSpec", "MoESpec", "NormSpec", "Placement", "QKNorm", "Rope", "RopeLayout", "RotaryFn",
           "Scoring"]


@runtime_checkable
class PerLayerAttention(Protocol):
    """An attention function that keeps state per layer (generation's KV cache). `set_attention` installs
    `for_layer(i)` in layer i, so each layer's own index, never the order of the calls, picks its state."""

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, scale: float | None = None,
                 window: int | None = None, *, layer: int, sinks: Tensor | None = None,
                 softcap: float | None = None) -> Tensor: ...

    def for_layer(self, layer: int) -> AttentionFn:
        """The attention function of layer `layer` (indexed as in `ZooModel.layers`)."""
        ...


class FamilyConfig(Protocol):
    """Every family's config: a frozen dataclass whose class names its family and the fields that must be above 0
    (sizes positive integers, eps and RoPE bases finite and positive), which `zoo.models.family.check_config`
    checks with each field's declared type before anything is built."""

    family: ClassVar[str]
    positive: ClassVar[frozenset[str]]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


class HasTokenIds(Protocol):
    """The checkpoint's special-token ids a config carries (eos: where generation stops)."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def pad_token_id(self) -> int | None: ...


class DecoderConfig(FamilyConfig, HasTokenIds, Protocol):
    """What a text family's config tells the decoder (and generic code: the vocabulary, the token ids)."""

    @property
    def dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def norm_eps(self) -> float: ...

    @property
    def tie_embeddings(self) -> bool: ...

    @property
    def max_seq_len(self) -> int | None: ...  # the longest document the family supports, None: no limit

    def decoder_spec(self) -> DecoderSpec:
        """The blocks, rotaries, final norm and embedding scale the decoder is built from."""
        ...


class TextModel(Protocol):
    """A language model as generation and the FLOP counter use it (`ZooModel.decoder`): zoo.models.decoder.Decoder."""

    @property
    def config(self) -> DecoderConfig: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def head_weight(self) -> Tensor: ...

    @property
    def embed(self) -> nn.Embedding: ...

    @property
    def final_softcap(self) -> float | None:
        """The soft-cap of the logits h @ head_weight^T (DecoderSpec.final_softcap), None for none."""
        ...

    def hidden(self, packed: Packed, x_TD: Tensor | None = None) -> Tensor:
        """[T, D] final normed hidden states; x_TD replaces the token embeddings."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def attention_flops(self, seqlens: Sequence[int]) -> int:
        """Forward FLOPs of every layer's attention over documents of these lengths."""
        ...


class LanguageModel(TextModel, Protocol):
    """A text model as the rest of zoo uses it (`ZooModel.decoder`, zoo.models.decoder.Decoder): a TextModel, its
    mixers (their per-layer state, zoo.core.mixer.Mixer), its loss with the Mixture-of-Experts terms and the
    router logits it records. A decode step's stand-in (zoo.generate.fused) is a TextModel only."""

    def mixers(self) -> list[Mixer]:
        """Every block's token mixer, in layer order."""
        ...

    def loss(self, packed: Packed, x_TD: Tensor | None = None, *, denominator: int | None = None,
             aux_loss_coef: float = 0.0, aux_loss: str = "batch", z_loss_coef: float = 0.0,
             parts: dict[str, Tensor] | None = None) -> Tensor:
        """ZooModel.loss, plus a Mixture-of-Experts model's balancing terms from the same forward (zoo.models.decoder
        .Decoder.loss says how they are weighted) and, in `parts`, the terms without their coefficients."""
        ...

    def recording_router(self) -> AbstractContextManager[list[list[Tensor]]]:
        """While open, each forward appends every MoE layer's router logits [T, E] to that layer's list (one list a
        MoE layer, in order; none for a dense model)."""
        ...


class ZooModel(Protocol):
    """What a zoo model is to the rest of zoo.

    Attention: every layer calls one attention function, `attend(q_TNH, k_TKH, v_TKH, packed) -> o_TNH`
    (zoo.core.attention's signature). `set_attention` installs another (a backend name, or a wrapper such as the
    sequence-parallel one, or a `PerLayerAttention`, one function per layer); models never edit it themselves.

    Targets: `labels(packed)` is the target rule, the labels the loss counts (-100 elsewhere). Text models count
    every next-token label of the pack; LLaVA never counts an image placeholder. The loss asks the pack for its
    targets under the rule (`packed.targets(self.labels)`, `packed.count_targets(self.labels)`): a sequence-
    parallel shard applies it to the whole pack before keeping its own tokens, so shards and the global target
    count agree with one process.

    Units: `layers` are the blocks, each its own unit for activation checkpointing, compile and FSDP;
    `fsdp_units()` names the other submodules FSDP shards on their own (LLaVA's tower and projector). The root
    holds the rest (embeddings, final norm, head).
    """

    @property
    def family(self) -> str:
        """The family's name: its key in zoo.models.FAMILIES and in zoo checkpoints' config.json."""
        ...

    @property
    def config(self) -> FamilyConfig:
        """The config the model was built from."""
        ...

    @property
    def decoder(self) -> LanguageModel:
        """The language model: the model itself for a text family, LLaVA's language model. Generation decodes
        with it alone (the images went in with the prefill) and the FLOP counter counts its layers."""
        ...

    @property
    def layers(self) -> nn.ModuleList:
        """The blocks, in order."""
        ...

    @property
    def attend(self) -> AttentionFn:
        """The attention function every layer calls now."""
        ...

    @property
    def head_weight(self) -> Tensor:
        """[V, D] the output head (the embedding matrix when tied)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's end-of-sequence ids (its config's; a LLaVA's language model's): where generation stops
        by default. Empty when the checkpoint does not say."""
        ...

    def set_attention(self, attn: str | AttentionFn) -> None:
        """Install an attention function in every layer: a backend name (zoo.core.attention.BACKENDS) or a function
        (a `PerLayerAttention` gives layer i its `for_layer(i)`)."""
        ...

    def hidden(self, packed: Packed) -> Tensor:
        """[T, D] final normed hidden states of the pack."""
        ...

    def forward(self, input_ids: Tensor | Packed, cu_seqlens: Tensor | None = None, /) -> Tensor:
        """[T, V] logits of a Packed (or of input_ids [T] with cu_seqlens [n+1])."""
        ...

    def loss(self, packed: Packed, *, denominator: int | None = None) -> Tensor:
        """Next-token cross-entropy summed over `packed.targets(self.labels)` and divided by `denominator` (a
        recipe's count over its whole step), by default `packed.count_targets(self.labels)`: the pack's mean, or
        for a sequence-parallel shard its share of the whole pack's mean."""
        ...

    def labels(self, packed: Packed) -> Tensor:
        """[T] the targets the loss counts: the model's target rule applied to packed.labels."""
        ...

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules FSDP shards as units of their own, besides the blocks in `layers`."""
        ...

    def encoder_flops(self, n_images: int, grids: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, nn.Module]]:
        """What runs below the decoder for `n_images` images, bottom up (LLaVA's tower, then its projector): each
        part's forward FLOPs in matrix products with weights, in attention, and the module (whose parameters say
        whether it trains). `grids`: each image's (t, h, w) patch grid, for a tower whose cost depends on the
        image's size (Qwen2.5-VL's needs them; towers at one resolution ignore them). Empty for a text model. See
        zoo.train.flops."""
        ...

    def decode_offsets(self, packed: Packed) -> Tensor | None:
        """[n] what each document of a prefilled pack adds to its decoded tokens' text positions in the rotary
        (Qwen2.5-VL's M-RoPE rope deltas: generation passes position + offset as `position_ids_3T`); None for a
        model whose rotary reads the text positions alone."""
        ...


# every member of the contract, read off the Protocol's body (its properties and methods)
_ZOO_MEMBERS = tuple(sorted(n for n in vars(ZooModel) if not n.startswith("_")))


def is_zoo_model(obj: object) -> TypeIs[ZooModel]:
    """Does `obj` have every member of `ZooModel`? Asked with getattr, as nn.Module answers it: from Python 3.12 on
    `isinstance` against a runtime-checkable Protocol looks attributes up statically and so misses a module's
    submodules and parameters (`layers`), which is why ZooModel is not runtime-checkable."""
    return all(hasattr(obj, name) for name in _ZOO_MEMBERS)
