"""LLaVA: a CLIP vision tower, a projector, and any zoo language model, over a packed batch.

Shapes: T tokens of the pack, D language-model width, I images, P image tokens per image, E vision width,
R placeholder tokens (R = I * P in a whole pack), V vocab.
Each image is one run of P placeholder tokens (`image_token_id`) in input_ids, already expanded (the llava-hf
convention; `zoo.io.image.expand_image_tokens` does it). The pack's images go through the tower in one call, the
projector maps their features to the language model's width, and those vectors replace the placeholders'
token embeddings in order. Under sequence parallelism a rank holds only some placeholders and encodes only the
images they belong to.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops
from zoo.core.contract import DecoderConfig
from zoo.core.layers import linear_params
from zoo.core.loss import linear_cross_entropy
from zoo.core.packing import IGNORE_INDEX, Packed, as_packed, check_ids
from zoo.errors import ZooError
from zoo.models import clip
from zoo.models.clip import CLIPVision, CLIPVisionConfig
from zoo.models.decoder import Decoder
from zoo.models.family import HF_TOKEN_ID_KEYS, Family, Plan, family, tied_head
from zoo.models.llama import LlamaConfig

if TYPE_CHECKING:
    from zoo.core.contract import ZooModel

PROJECTORS = ("mlp2x_gelu", "linear")
SELECT = ("default", "full")  # "default" drops the class token, "full" keeps it
ORIGINAL_IMAGE_TOKEN = -200  # the original LLaVA code's IMAGE_TOKEN_INDEX: not a vocabulary entry


# what can sit inside a LLaVA: every text family of the registry (zoo.models fills this in, as it lists them)
LANGUAGE_FAMILIES: dict[str, Family] = {}


def language_families() -> dict[str, Family]:
    return LANGUAGE_FAMILIES


@dataclass(frozen=True)
class LlavaConfig:
    family: ClassVar[str] = "llava"
    positive: ClassVar[frozenset[str]] = frozenset()  # its tower and language model are checked by their own
    vision: CLIPVisionConfig = field(default_factory=CLIPVisionConfig)
    language_family: str = "llama"  # a zoo family name (zoo.models.FAMILIES)
    language: DecoderConfig = field(default_factory=lambda: LlamaConfig(vocab_size=32064))
    projector: str = "mlp2x_gelu"
    projector_bias: bool = True
    feature_layer: int = -2  # which CLIP hidden state feeds the projector (HF hidden_states indexing)
    feature_select: str = "default"
    image_token_id: int = 32000
    image_tokens: int = 0  # derived: placeholder tokens per image

    def __post_init__(self) -> None:
        # a zoo checkpoint's config.json holds the sub-configs as plain dicts
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", CLIPVisionConfig(**self.vision))
        families = language_families()
        family = families.get(self.language_family)
        if family is None:
            what = "a LLaVA's language model cannot be a LLaVA" if self.language_family == "llava" else \
                f"unknown language model family {self.language_family!r}"
            raise ZooError(f"{what}; language_family is one of {', '.join(families)}")
        if isinstance(self.language, dict):
            object.__setattr__(self, "language", family.text_config(family.config_cls(**self.language)))
        if not isinstance(self.language, family.config_cls):
            raise TypeError(f"language config is a {type(self.language).__name__}, expected "
                             f"{family.config_cls.__name__} for family {self.language_family!r}")
        if self.projector not in PROJECTORS:
            raise ZooError(f"unknown projector {self.projector!r}; supported: {', '.join(PROJECTORS)}")
        if self.feature_select not in SELECT:
            raise ZooError(f"unknown feature_select {self.feature_select!r}; supported: {', '.join(SELECT)}")
        object.__setattr__(self, "image_tokens", self.vision.n_patches + (self.feature_select == "full"))


class Projector(nn.Module):
    """linear_1 -> GELU -> linear_2 (LLaVA-1.5's mlp2x_gelu), or linear_1 alone (LLaVA-1's linear)."""

    def __init__(self, kind: str, vision_dim: int, text_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias) if kind == "mlp2x_gelu" else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear_1(x)
        return x if self.linear_2 is None else self.linear_2(F.gelu(x))


# ---- Hugging Face spellings (read by zoo.io.load.hf_plan) ----
# llava-hf layout: language_model.<LM's HF names>, vision_tower.vision_model.<CLIP names>, multi_modal_projector.*

HF_VISION = "vision_tower.vision_model."
HF_PROJECTOR = "multi_modal_projector."
HF_LANGUAGE = "language_model."


def hf_spellings(name: str) -> list[str]:
    """Every spelling of a llava-hf tensor name in the checkpoints zoo reads, the llava-hf one first.

    transformers 5 saves `vision_tower.*` (no `vision_model.`) and holds `model.language_model.*`, `lm_head.*`,
    `model.vision_tower.*`, `model.multi_modal_projector.*` in memory; the original LLaVA repository writes the
    language model at the top (`model.layers.*`, `lm_head.*`), `model.mm_projector.{0,2}.*` (`.weight` alone for
    the linear projector) and `model.vision_tower.vision_tower.vision_model.*`.
    """
    out = [name]
    if name.startswith(HF_VISION):
        rest = name[len(HF_VISION):]
        out += [f"vision_tower.{rest}", f"model.vision_tower.{rest}", f"model.vision_tower.vision_model.{rest}",
                f"model.vision_tower.vision_tower.vision_model.{rest}"]
    elif name.startswith(HF_PROJECTOR):
        rest = name[len(HF_PROJECTOR):]
        out.append(f"model.multi_modal_projector.{rest}")
        layer, _, param = rest.partition(".")
        out += {"linear_1": [f"model.mm_projector.0.{param}", f"model.mm_projector.{param}"],
                "linear_2": [f"model.mm_projector.2.{param}"]}.get(layer, [])
    elif name.startswith(HF_LANGUAGE + "model."):
        rest = name[len(HF_LANGUAGE + "model."):]
        out += [f"model.language_model.{rest}", f"model.{rest}"]
    elif name.startswith(HF_LANGUAGE):
        out.append(name[len(HF_LANGUAGE):])  # lm_head.weight at the top
    return out


class Llava(nn.Module):
    family = "llava"

    def __init__(self, config: LlavaConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.vision = CLIPVision(cfg.vision)
        # every text family's model is the shared decoder; its config says which family it is
        self.language_model = Decoder(cfg.language, attn=attn)
        text_dim = self.language_model.embed.weight.shape[1]
        self.projector = Projector(cfg.projector, cfg.vision.dim, text_dim, cfg.projector_bias)

    # what recipes and zoo.parallel use on a language model, delegated to the one inside
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
        """The language model's attention function (the tower's attention is plain and per image)."""
        self.language_model.set_attention(attn)

    def fsdp_units(self) -> list[nn.Module]:
        """The tower and the projector: FSDP units of their own besides the language model's blocks (frozen or
        not), so a stage that freezes one never mixes trained and frozen parameters in one unit."""
        return [self.vision, self.projector]

    def encoder_flops(self, n_images: int) -> list[tuple[int, int, nn.Module]]:
        """The tower (the patch convolution and the blocks that run, up to `feature_layer`, with full attention
        over each image's positions), then the projector on each image's tokens."""
        v = self.config.vision
        run = self.vision.layers[: self.config.feature_layer % (v.n_layers + 1)]  # the blocks CLIPVision runs
        P = v.n_patches + 1  # positions per image: the patches and the class token
        conv = 2 * v.n_patches * self.vision.patch_embed.weight[0].numel() * v.dim
        tower = (n_images * (conv + 2 * P * linear_params(run)),
                 len(run) * attention_flops([P] * n_images, v.n_heads, v.dim // v.n_heads, causal=False))
        projector = 2 * n_images * self.config.image_tokens * linear_params(self.projector)
        return [(*tower, self.vision), (projector, 0, self.projector)]

    def decode_offsets(self, packed: Packed) -> Tensor | None:
        """None: decoded tokens take their text positions (the contract's)."""
        return None

    def freeze(self, vision: bool | None = None, projector: bool | None = None, language: bool | None = None) -> None:
        """Freeze (True) or unfreeze (False) parts; None leaves a part as it is.

        LLaVA's stage 1 trains the projector alone (`freeze(vision=True, projector=False, language=True)`),
        stage 2 the projector and the language model (`freeze(vision=True, projector=False, language=False)`).
        """
        for part, frozen in ((self.vision, vision), (self.projector, projector), (self.language_model, language)):
            if frozen is not None:
                part.requires_grad_(not frozen)

    # ---- images into the token stream ----

    def preprocess_images(self, images: list[Image.Image]) -> Tensor:
        """[I, 3, S, S] pixel values: CLIPImageProcessor's (the PIL one: shortest side to the tower's size, center
        crop), what llava-hf's processor runs; LLaVA-1.5's pad to a square is `clip.clip_preprocess(pad=True)`."""
        return torch.stack([clip.clip_preprocess(im, size=self.config.vision.image_size) for im in images])

    def image_features(self, pixel_values_ICSS: Tensor) -> Tensor:
        """[I, P, D] projected features of the images, the class token dropped unless feature_select is 'full'."""
        h_IPE = self.vision(pixel_values_ICSS, self.config.feature_layer)
        if self.config.feature_select == "default":
            h_IPE = h_IPE[:, 1:]
        return self.projector(h_IPE)

    def _slots(self, packed: Packed) -> tuple[Tensor, Tensor, Tensor]:
        """(rows_R, image_R, patch_R): each local placeholder's row and which image and patch it shows."""
        P = self.config.image_tokens
        n_images = 0 if packed.pixel_values is None else packed.pixel_values.shape[0]
        # a part of a pack (a sequence-parallel shard) numbers the placeholders over the whole, then keeps its rows
        whole, index_T = packed.part_of() or (packed, None)
        is_image_G = whole.input_ids == self.config.image_token_id
        n_slots = int(is_image_G.sum())
        if n_slots != n_images * P:
            self._explain_mismatch(whole, is_image_G, n_images)
        ordinal_G = torch.cumsum(is_image_G, 0) - 1  # placeholder number of each position of the whole pack
        if index_T is None:
            rows_R = is_image_G.nonzero().squeeze(1)
            ordinal_R = ordinal_G[rows_R]
        else:
            rows_R = is_image_G[index_T].nonzero().squeeze(1)
            ordinal_R = ordinal_G[index_T[rows_R]]
        return rows_R, ordinal_R // P, ordinal_R % P

    def _explain_mismatch(self, whole: Packed, is_image_G: Tensor, n_images: int) -> None:
        P, tok = self.config.image_tokens, self.config.image_token_id
        per_doc = whole.images_per_doc
        if per_doc is None and n_images == 0:
            per_doc = [0] * whole.num_docs
        if per_doc is not None:
            cu = whole.cu_seqlens.tolist()
            for d, (a, b) in enumerate(itertools.pairwise(cu)):
                have = int(is_image_G[a:b].sum())
                if have != per_doc[d] * P:
                    raise ZooError(
                        f"document {d} has {have} image placeholder tokens (id {tok}) but {per_doc[d]} image(s), "
                        f"which need {per_doc[d] * P} ({P} per image); expand each <image> token with "
                        "zoo.io.image.expand_image_tokens and pass one pixel tensor per image")
        raise ZooError(
            f"the pack has {int(is_image_G.sum())} image placeholder tokens (id {tok}) but {n_images} image(s), "
            f"which need {n_images * P} ({P} per image); expand each <image> token with "
            "zoo.io.image.expand_image_tokens and pass the images with zoo.pack(docs, images=...)")

    def embed_inputs(self, packed: Packed) -> Tensor:
        """[T, D] token embeddings with the projected image features written into the placeholder rows."""
        is_image_T = packed.input_ids == self.config.image_token_id
        # the placeholder id need not be a vocabulary entry (the original LLaVA's is -200)
        text_ids = packed.input_ids.masked_fill(is_image_T, 0)
        check_ids(text_ids, self.config.language.vocab_size)
        x_TD = self.language_model.embed(text_ids)
        rows_R, image_R, patch_R = self._slots(packed)
        # encode only the images this pack's placeholders show (all of them, unless this is an SP shard). The
        # tower runs even on no image: every rank then calls it once per step, as FSDP's collectives require.
        needed_J, which_R = torch.unique(image_R, sorted=True, return_inverse=True)
        pixels = packed.pixel_values
        if pixels is None:
            v = self.config.vision
            pixels = x_TD.new_zeros(0, v.n_channels, v.image_size, v.image_size)
        elif len(needed_J) != pixels.shape[0]:
            pixels = pixels[needed_J.to(pixels.device)]
        feats_JPD = self.image_features(pixels)
        return x_TD.index_put((rows_R,), feats_JPD[which_R, patch_R].to(x_TD.dtype))

    def labels(self, packed: Packed) -> Tensor:
        """packed.labels with every image-placeholder target ignored (an image is input, never a prediction)."""
        labels_T = packed.require_labels()
        return labels_T.masked_fill(labels_T == self.config.image_token_id, IGNORE_INDEX)

    def hidden(self, packed: Packed) -> Tensor:
        """Final normed hidden states [T, D] of the language model, the images written into their placeholders."""
        return self.language_model.hidden(packed, x_TD=self.embed_inputs(packed))

    def forward(self, packed: Packed | Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """logits [T, V] of a packed multimodal batch (or of input_ids [T] with cu_seqlens, text only)."""
        return F.linear(self.hidden(as_packed(packed, cu_seqlens)), self.head_weight)

    def loss(self, packed: Packed, *, denominator: int | None = None) -> Tensor:
        """Next-token cross-entropy over the text targets (image placeholders are never targets): their mean, or
        their sum over `denominator` (see ZooModel.loss)."""
        labels = packed.targets(self.labels)  # a shard's: the rule applied to its whole pack, then cut
        n = packed.count_targets(self.labels) if denominator is None else denominator
        return linear_cross_entropy(self.hidden(packed), self.head_weight, labels, n)


def as_llava(model: object, what: str) -> Llava:
    """`model` if it is a LLaVA, else a ZooError saying that `what` needs one."""
    if not isinstance(model, Llava):
        raise ZooError(f"{what} needs a LLaVA model, got {type(model).__name__}")
    return model


def as_llava_config(config: object, what: str) -> LlavaConfig:
    """`config` if it is a LLaVA's, else a ZooError: `what` is not a LLaVA model."""
    if not isinstance(config, LlavaConfig):
        raise ZooError(f"{what} is a {type(config).__name__} model, not LLaVA; use recipes.sft for language models")
    return config


# ---- Hugging Face names and config ----


def _prefixed_lm_plan(plan: Plan, target_prefix: str, source_prefix: str) -> Plan:
    return {target_prefix + t: (tuple(source_prefix + s for s in srcs), fn) for t, (srcs, fn) in plan.items()}


def plan_from_hf(cfg: LlavaConfig, zoo_names: list[str]) -> Plan:
    lm_names = [n[len("language_model."):] for n in zoo_names if n.startswith("language_model.")]
    lm_plan = language_families()[cfg.language_family].plan_from_hf(cfg.language, lm_names)
    plan = _prefixed_lm_plan(lm_plan, "language_model.", HF_LANGUAGE)
    for n in zoo_names:
        if n.startswith("vision."):
            plan[n] = ((HF_VISION + clip.hf_name(n[len("vision."):]),), None)
        elif n.startswith("projector."):
            plan[n] = ((HF_PROJECTOR + n[len("projector."):],), None)
    return plan


def plan_to_hf(cfg: LlavaConfig, zoo_names: list[str]) -> Plan:
    if cfg.projector != "mlp2x_gelu":
        raise ZooError(f"the llava-hf layout has only the mlp2x_gelu projector; this model's is {cfg.projector!r}")
    lm_names = [n[len("language_model."):] for n in zoo_names if n.startswith("language_model.")]
    lm_plan = language_families()[cfg.language_family].plan_to_hf(cfg.language, lm_names)
    plan = _prefixed_lm_plan(lm_plan, HF_LANGUAGE, "language_model.")
    for n in zoo_names:
        if n.startswith("vision."):
            plan[HF_VISION + clip.hf_name(n[len("vision."):])] = ((n,), None)
        elif n.startswith("projector."):
            plan[HF_PROJECTOR + n[len("projector."):]] = ((n,), None)
    return plan


# transformers' defaults for what llava-hf hub configs leave out. transformers 4 saved a LLaVA's text config as its
# difference from the default LlavaConfig's (a LlamaConfig): a value equal to both that Llama default and the text
# model's own class default is not written (llava-1.5's Vicuna width; BakLLaVA's Mistral-7B width, depth and heads),
# and transformers reads the gap back as its own class default. RoPE's base defaults to 10,000 in every one of them
# (zoo's Qwen families assume Qwen's 1,000,000 when a config.json names none, so the base is filled in too).
HF_LLAMA_DEFAULTS = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "intermediate_size": 11008, "vocab_size": 32000, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 2048}
_HF_QWEN_DEFAULTS = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                     "intermediate_size": 22016, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 32768}
HF_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": HF_LLAMA_DEFAULTS,
    "qwen2": _HF_QWEN_DEFAULTS,
    "qwen3": {**_HF_QWEN_DEFAULTS, "head_dim": 128},
    "mistral": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 32000, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 131072},
}
HF_ROPE_THETA = 10000.0
HF_LLAVA_VISION_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                            "num_attention_heads": 16, "image_size": 336, "patch_size": 14}


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ZooError(what)


def config_from_hf(hf: dict[str, Any]) -> LlavaConfig:
    if "mm_vision_tower" in hf or "mm_projector_type" in hf:
        return _config_from_original(hf)
    text = dict(hf.get("text_config") or {})
    text_type = text.get("model_type", "llama")
    family = next((f for f in language_families().values() if text_type in f.hf_model_types), None)
    if family is None:
        raise ZooError(f"LLaVA text model {text_type!r} is not a zoo language model family")
    if text_type in HF_TEXT_DEFAULTS:  # transformers' own classes (InternLM2 and OpenELM are remote code)
        text = {**HF_TEXT_DEFAULTS[text_type], **text}
        if "rope_theta" not in text and "rope_parameters" not in text:
            text["rope_theta"] = HF_ROPE_THETA
    # transformers 5 ties the head when the LLaVA's own config says so, whatever its text config says
    if hf.get("tie_word_embeddings"):
        text["tie_word_embeddings"] = True
    # special-token ids at the top (transformers 4's llava-hf configs; read_config puts generation_config.json's
    # there too) win over the text config's
    text.update({k: hf[k] for k in HF_TOKEN_ID_KEYS if hf.get(k) is not None})
    vision = hf.get("vision_config")
    vision = dict(HF_LLAVA_VISION_DEFAULTS) if vision is None else dict(vision)
    _check(vision.get("model_type", "clip_vision_model") == "clip_vision_model",
           f"LLaVA vision tower {vision.get('model_type')!r} is not supported (expected clip_vision_model)")
    _check(hf.get("projector_hidden_act", "gelu") == "gelu",
           f"projector_hidden_act {hf.get('projector_hidden_act')!r} is not supported (expected 'gelu')")
    layer = hf.get("vision_feature_layer", -2)
    _check(isinstance(layer, int), f"vision_feature_layer {layer!r}: only a single layer is supported")
    return LlavaConfig(
        vision=clip.config_from_hf(vision),
        language_family=family.name,
        language=family.text_config(family.config_from_hf(text)),
        projector="mlp2x_gelu",
        projector_bias=hf.get("multimodal_projector_bias", True),
        feature_layer=layer,
        feature_select=hf.get("vision_feature_select_strategy", "default"),
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 32000)),
    )


def _config_from_original(hf: dict[str, Any]) -> LlavaConfig:
    """The original LLaVA repository's config: a Llama config plus mm_* keys naming the tower and projector."""
    from zoo.models import llama  # the module, beside its config class: its config_from_hf

    tower = hf.get("mm_vision_tower")
    vision = clip.OPENAI_TOWERS.get(tower) if isinstance(tower, str) else None
    if vision is None:
        raise ZooError(f"mm_vision_tower {tower!r} is not a known CLIP tower; known: {', '.join(clip.OPENAI_TOWERS)}")
    _check(hf.get("mm_hidden_size", vision.dim) == vision.dim,
           f"mm_hidden_size {hf.get('mm_hidden_size')} does not match {tower}'s width {vision.dim}")
    select = {"patch": "default", "cls_patch": "full"}.get(hf.get("mm_vision_select_feature", "patch"))
    if select is None:
        raise ZooError(f"mm_vision_select_feature {hf.get('mm_vision_select_feature')!r} is not supported")
    return LlavaConfig(
        vision=vision,
        language_family="llama",
        language=llama.config_from_hf({**HF_LLAMA_DEFAULTS, **hf}),
        projector=hf.get("mm_projector_type", "linear"),
        feature_layer=hf.get("mm_vision_select_layer", -2),
        feature_select=select,
        image_token_id=ORIGINAL_IMAGE_TOKEN,
    )


def config_to_hf(cfg: LlavaConfig) -> dict[str, Any]:
    text = language_families()[cfg.language_family].config_to_hf(cfg.language)
    text.pop("architectures", None)
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": clip.config_to_hf(cfg.vision),
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": cfg.projector_bias,
        "vision_feature_layer": cfg.feature_layer,
        "vision_feature_select_strategy": cfg.feature_select,
        "image_token_index": cfg.image_token_id,
        "image_seq_length": cfg.image_tokens,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
    }


def _build(config: LlavaConfig, attn: str | AttentionFn) -> ZooModel:
    return Llava(config, attn)


def _tied_head(config: LlavaConfig) -> frozenset[str]:
    """The language model's tied head as a llava-hf checkpoint may spell it."""
    return frozenset(s for name in tied_head(config.language) for s in hf_spellings(HF_LANGUAGE + name))


FAMILY = family("llava", LlavaConfig, ("llava", "llava_llama"), build=_build, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=(),  # the LLaVA recipe adapts the language model by its family's targets
                text_config=lambda config: config.language,
                with_text_config=lambda config, lm: dataclasses.replace(config, language=lm),
                hf_spellings=hf_spellings, hf_tied=_tied_head)
