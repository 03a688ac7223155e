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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops
from zoo.core.contract import DecoderConfig
from zoo.core.layers import linear_params
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models import clip
from zoo.models.clip import CLIPVision, CLIPVisionConfig
from zoo.models.decoder import Decoder
from zoo.models.family import HF_TOKEN_ID_KEYS, Family, Plan, family, tied_head
from zoo.models.llama import LlamaConfig
from zoo.models.vlm import VisionLanguage, n_images, splice_fixed

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


class Llava(VisionLanguage):
    family = "llava"
    config: LlavaConfig

    def __init__(self, config: LlavaConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.vision = CLIPVision(cfg.vision)
        # every text family's model is the shared decoder; its config says which family it is
        self.language_model = Decoder(cfg.language, attn=attn)
        text_dim = self.language_model.embed.weight.shape[1]
        self.projector = Projector(cfg.projector, cfg.vision.dim, text_dim, cfg.projector_bias)

    def encoder_flops(self, n_images: int, grids: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, nn.Module]]:
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

    def parts(self) -> dict[str, list[nn.Module]]:
        return {"vision": [self.vision], "projector": [self.projector], "language": [self.language_model]}

    def image_text(self, tokens: int) -> str:
        """`<image>` once per image token."""
        return self.placeholder * tokens

    def token_counts(self, images: Tensor) -> list[int]:
        return [self.config.image_tokens] * n_images(images)

    def image_tokens(self, height: int, width: int) -> int:
        """LlavaProcessor's (h / patch) * (w / patch) + num_additional_image_tokens (1, the class token, in llava-hf's
        processors), less one under the "default" feature selection: fixed, as every image is cropped to the tower's
        square."""
        return self.config.image_tokens

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

    def embed_inputs(self, packed: Packed) -> Tensor:
        """[T, D] token embeddings with the projected image features written into the placeholder rows (the
        original LLaVA's placeholder id, -200, is no vocabulary entry)."""
        v = self.config.vision
        return splice_fixed(packed, self.language_model.embed, self.config.language.vocab_size,
                            self.config.image_token_id, self.config.image_tokens, self.image_features,
                            (v.n_channels, v.image_size, v.image_size))

    def hidden(self, packed: Packed) -> Tensor:
        """Final normed hidden states [T, D] of the language model, the images written into their placeholders."""
        return self.language_model.hidden(packed, x_TD=self.embed_inputs(packed))


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
