"""Gemma 3 with its eyes (Gemma3ForConditionalGeneration): a SigLIP tower, a pooling projector, the Gemma 3 language
model, over a packed batch.

Shapes: T tokens of the pack, D language-model width, I images, P patches per image, E vision width,
M soft tokens per image (`mm_tokens_per_image`), R placeholder tokens (R = I * M in a whole pack), V vocab.
An image is `\\n\\n<start_of_image>` + M image tokens (`image_token_id`) + `<end_of_image>\\n\\n` in input_ids, as
Gemma3Processor writes it. The pack's images go through the SigLIP tower (zoo.models.clip configured as SigLIP) in
one call; the projector average-pools each image's P patches to M, normalises them with Gemma's (1 + w) RMSNorm and
multiplies by `mm_input_projection_weight`; those vectors replace the placeholders' (already sqrt(D)-scaled) token
embeddings in order. Inside the causal language model each image's run of M image tokens attends to itself both
ways (`Packed.blocks`, zoo.core.blocks): transformers does so when the processor's token_type_ids are passed (1 on
the image tokens only, not on boi/eoi), on global and sliding layers alike (the window still bounds the past).
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops
from zoo.core.layers import RMSNorm, linear_params
from zoo.core.packing import Packed, runs_of
from zoo.errors import ZooError
from zoo.models import clip, gemma3
from zoo.models.clip import CLIPVision, CLIPVisionConfig
from zoo.models.decoder import Decoder
from zoo.models.family import HF_TOKEN_ID_KEYS, Plan, family
from zoo.models.gemma3 import Gemma3Config
from zoo.models.vlm import VisionLanguage, n_images, nested_config, splice_fixed

if TYPE_CHECKING:
    from zoo.core.contract import ZooModel

# google/gemma-3-4b-it's tower: SigLIP So400m/14 at 896 pixels, no pooling head
SIGLIP_SO400M_896 = CLIPVisionConfig(dim=1152, n_layers=27, n_heads=16, ffn_dim=4304, image_size=896, patch_size=14,
                                     norm_eps=1e-6, act="gelu_pytorch_tanh", class_token=False, pre_norm=False,
                                     patch_bias=True)
# the Gemma 3 tokenizer's boi_token, image_token and eoi_token (Gemma3Processor reads them off the tokenizer)
BOI, IMAGE_SOFT_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
MEAN = STD = (0.5, 0.5, 0.5)  # Gemma3ImageProcessor's (IMAGENET_STANDARD_MEAN / STD)


@dataclass(frozen=True)
class Gemma3VisionConfig:
    family: ClassVar[str] = "gemma3_vision"
    positive: ClassVar[frozenset[str]] = frozenset({"mm_tokens_per_image"})
    vision: CLIPVisionConfig = field(default_factory=lambda: SIGLIP_SO400M_896)
    language: Gemma3Config = field(default_factory=Gemma3Config)
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    # the image processor's (preprocessor_config.json, or processor_config.json's image_processor)
    image_mean: tuple[float, ...] = MEAN
    image_std: tuple[float, ...] = STD

    def __post_init__(self) -> None:
        nested_config(self, CLIPVisionConfig, Gemma3Config)
        side, per_side = self.vision.image_size // self.vision.patch_size, round(self.mm_tokens_per_image ** 0.5)
        if per_side * per_side != self.mm_tokens_per_image or side % per_side:
            raise ZooError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides the "
                           f"tower's {side} patches per side (the projector average-pools {side} x {side} patches)")


class Projector(nn.Module):
    """Gemma3MultiModalProjector: average pooling of each image's patch grid to M soft tokens, the (1 + w) RMSNorm
    `mm_soft_emb_norm`, then x @ `mm_input_projection_weight` [E, D] (a matrix, not a Linear: the checkpoint's)."""

    def __init__(self, cfg: Gemma3VisionConfig, text_dim: int) -> None:
        super().__init__()
        v = cfg.vision
        self.side = v.image_size // v.patch_size
        self.kernel = self.side // round(cfg.mm_tokens_per_image ** 0.5)
        self.norm = RMSNorm(v.dim, eps=v.norm_eps, offset=1.0, cast_first=False)
        self.proj = ProjectionWeight(v.dim, text_dim)

    def forward(self, h_IPE: Tensor) -> Tensor:
        I, _, E = h_IPE.shape
        grid_IEss = h_IPE.transpose(1, 2).reshape(I, E, self.side, self.side)
        pooled_IME = F.avg_pool2d(grid_IEss, self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return (self.norm(pooled_IME) @ self.proj.weight).type_as(h_IPE)


class ProjectionWeight(nn.Module):
    """The projection matrix as its own leaf, so that zoo's init finds it (N(0, 0.02) as a Linear's)."""

    def __init__(self, vision_dim: int, text_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vision_dim, text_dim))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Gemma3Vision(VisionLanguage):
    family = "gemma3_vision"
    config: Gemma3VisionConfig
    placeholder = BOI  # Gemma3Processor's image token in a prompt: the tokenizer's boi token

    def __init__(self, config: Gemma3VisionConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.vision = CLIPVision(cfg.vision)
        self.language_model = Decoder(cfg.language, attn=attn)
        self.projector = Projector(cfg, cfg.language.dim)

    def encoder_flops(self, n_images: int, grids: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, nn.Module]]:
        """The tower (the patch convolution and every block, full attention over each image's patches), then the
        projector's matrix on each image's soft tokens (zoo.train.flops)."""
        v, P = self.config.vision, self.config.vision.n_patches
        conv = 2 * P * self.vision.patch_embed.weight[0].numel() * v.dim
        tower = (n_images * (conv + 2 * P * linear_params(self.vision.layers)),
                 v.n_layers * attention_flops([P] * n_images, v.n_heads, v.dim // v.n_heads, causal=False))
        projector = 2 * n_images * self.config.mm_tokens_per_image * self.projector.proj.weight.numel()
        return [(*tower, self.vision), (projector, 0, self.projector)]

    def parts(self) -> dict[str, list[nn.Module]]:
        return {"vision": [self.vision], "projector": [self.projector], "language": [self.language_model]}

    # ---- images ----

    def image_text(self, tokens: int) -> str:
        """Gemma3Processor's full image sequence (pan-and-scan off, its default): the boi token between blank lines
        holding M image soft tokens and the eoi token."""
        return f"\n\n{BOI}{IMAGE_SOFT_TOKEN * tokens}{EOI}\n\n"

    def token_counts(self, images: Tensor) -> list[int]:
        return [self.config.mm_tokens_per_image] * n_images(images)

    def image_tokens(self, height: int, width: int) -> int:
        """M soft tokens whatever the size: every image is resized to the tower's square."""
        return self.config.mm_tokens_per_image

    def preprocess_images(self, images: list[Image.Image]) -> Tensor:
        """[I, 3, S, S] pixel values as transformers' default (fast, torchvision) Gemma3ImageProcessor makes them:
        RGB, an antialiased bilinear resize of the uint8 image to the tower's side, (x - 127.5) / 127.5 in fp32
        (rescale by 1/255 and normalise with mean and std 0.5, fused as it fuses them). Pan-and-scan is off, as by
        default."""
        S = self.config.vision.image_size
        out = []
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ZooError(f"image {i} is a {type(image).__name__}, expected a PIL image")
            out.append(resize_uint8(image, S))
        x_ICSS = torch.stack(out).float()
        mean_C = torch.tensor(self.config.image_mean) * (1.0 / (1 / 255))  # the fused rescale and normalise
        std_C = torch.tensor(self.config.image_std) * (1.0 / (1 / 255))
        return ((x_ICSS - mean_C[:, None, None]) / std_C[:, None, None]).contiguous()

    def image_features(self, pixel_values_ICSS: Tensor) -> Tensor:
        """[I, M, D] the soft tokens of the images."""
        return self.projector(self.vision.last_hidden(pixel_values_ICSS))

    def image_blocks(self, packed: Packed) -> Tensor:
        """[T] each run of image tokens of a document numbered over the pack (-1 elsewhere): the blocks that attend
        both ways, as transformers' token_type_ids make them (image tokens only; boi and eoi stay causal)."""
        return runs_of(packed.input_ids == self.config.image_token_id, packed.cu_seqlens)

    def embed_inputs(self, packed: Packed) -> Tensor:
        """[T, D] scaled token embeddings with the images' soft tokens written into the placeholder rows."""
        v = self.config.vision
        return splice_fixed(packed, self.language_model.embed, self.config.language.vocab_size,
                            self.config.image_token_id, self.config.mm_tokens_per_image, self.image_features,
                            (v.n_channels, v.image_size, v.image_size))

    def hidden(self, packed: Packed) -> Tensor:
        """Final normed hidden states [T, D]: the images written into their placeholders, each image's tokens one
        bidirectional block of the attention."""
        x_TD = self.embed_inputs(packed)
        return self.language_model.hidden(packed.with_blocks(self.image_blocks), x_TD=x_TD)


def resize_uint8(image: Image.Image, side: int) -> Tensor:
    """[3, side, side] uint8: torchvision's antialiased bilinear resize of the RGB image (transparency composited
    onto white first, as transformers converts) as a uint8 tensor, what the fast image processors run: native uint8
    interpolation where torchvision takes it (x86 with AVX2, ARM), else in fp32, rounded back."""
    rgb = image.convert("RGB")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        rgb = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    w, h = rgb.size
    x_1CHW = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(1, h, w, 3).permute(0, 3, 1, 2)
    x_1CHW = x_1CHW.contiguous()
    if (h, w) == (side, side):
        return x_1CHW[0]
    native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    if native:
        return F.interpolate(x_1CHW, size=[side, side], mode="bilinear", align_corners=False, antialias=True)[0]
    out = F.interpolate(x_1CHW.float(), size=[side, side], mode="bilinear", align_corners=False, antialias=True)
    return out.round_().to(torch.uint8)[0]


# ---- Hugging Face names and config ----
# the published layout (google/gemma-3-*): vision_tower.vision_model.<SigLIP names>, multi_modal_projector.*,
# language_model.model.<Gemma3 names> (a tied head not saved). transformers 5 saves vision_tower.<SigLIP names>
# and holds model.vision_tower.*, model.multi_modal_projector.*, model.language_model.*, lm_head.* in memory.

HF_VISION = "vision_tower.vision_model."
HF_PROJECTOR = {"projector.norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
                "projector.proj.weight": "multi_modal_projector.mm_input_projection_weight"}
HF_LANGUAGE = "language_model."
# SigLIP's attention-pooling head (transformers' default vision_use_head=true): Gemma 3 never reads it
HF_LEFT_OUT = ("vision_tower.head.", "vision_tower.vision_model.head.", "model.vision_tower.head.",
               "model.vision_tower.vision_model.head.")


def hf_spellings(name: str) -> list[str]:
    """Every spelling of a published Gemma 3 tensor name in the checkpoints zoo reads, the published one first."""
    if name.startswith(HF_VISION):
        rest = name[len(HF_VISION):]
        return [name, f"vision_tower.{rest}", f"model.vision_tower.vision_model.{rest}", f"model.vision_tower.{rest}"]
    if name.startswith("multi_modal_projector."):
        return [name, "model." + name]
    if name.startswith(HF_LANGUAGE + "model."):
        return [name, "model.language_model." + name[len(HF_LANGUAGE + "model."):]]
    if name.startswith(HF_LANGUAGE):
        return [name, name[len(HF_LANGUAGE):]]  # an untied lm_head at the top
    return [name]


def _lm_plan(plan: Plan, target_prefix: str, source_prefix: str) -> Plan:
    return {target_prefix + t: (tuple(source_prefix + s for s in srcs), fn) for t, (srcs, fn) in plan.items()}


def plan_from_hf(cfg: Gemma3VisionConfig, zoo_names: list[str]) -> Plan:
    lm_names = [n[len("language_model."):] for n in zoo_names if n.startswith("language_model.")]
    plan = _lm_plan(gemma3.plan_from_hf(cfg.language, lm_names), "language_model.", HF_LANGUAGE)
    for n in zoo_names:
        if n.startswith("vision."):
            plan[n] = ((HF_VISION + clip.hf_name(n[len("vision."):]),), None)
        elif n in HF_PROJECTOR:
            plan[n] = ((HF_PROJECTOR[n],), None)
    return plan


def plan_to_hf(cfg: Gemma3VisionConfig, zoo_names: list[str]) -> Plan:
    lm_names = [n[len("language_model."):] for n in zoo_names if n.startswith("language_model.")]
    plan = _lm_plan(gemma3.plan_to_hf(cfg.language, lm_names), HF_LANGUAGE, "language_model.")
    for n in zoo_names:
        if n.startswith("vision."):
            plan[HF_VISION + clip.hf_name(n[len("vision."):])] = ((n,), None)
        elif n in HF_PROJECTOR:
            plan[HF_PROJECTOR[n]] = ((n,), None)
    return plan


# transformers' Gemma3Config defaults for what a hub config.json leaves out
HF_DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
               "image_token_index": 262_144}


def config_from_hf(hf: dict[str, Any]) -> Gemma3VisionConfig:
    """A Gemma3ForConditionalGeneration config ("gemma3"): its text config read as the Gemma 3 family reads it (the
    top-level tie and token ids win), its vision config as a SigLIP tower."""
    if hf.get("model_type") != "gemma3":
        raise ZooError(f"a Gemma 3 vision-language config has model_type 'gemma3', got {hf.get('model_type')!r}")
    top = {**HF_DEFAULTS, **hf}
    vision = clip.siglip_config_from_hf(dict(hf.get("vision_config") or {}))
    ip = _image_processor(dict(hf.get("image_processor") or {}), vision.image_size, top["mm_tokens_per_image"])
    return Gemma3VisionConfig(
        vision=vision, language=gemma3.config_from_hf(hf),
        mm_tokens_per_image=top["mm_tokens_per_image"], image_token_id=top["image_token_index"],
        boi_token_id=top["boi_token_index"], eoi_token_id=top["eoi_token_index"],
        image_mean=tuple(ip.get("image_mean") or MEAN), image_std=tuple(ip.get("image_std") or STD))


def _image_processor(ip: dict[str, Any], side: int, tokens: int) -> dict[str, Any]:
    """The image processor's settings (zoo.io.config puts the published preprocessor_config.json's, or transformers
    5's processor_config.json's, under "image_processor"), each checked against what zoo's preprocessing does."""
    size = ip.get("size") or {}
    if size and (size.get("height"), size.get("width")) != (side, side):
        raise ZooError(f"the image processor resizes to {size}, the vision tower takes {side} x {side} images")
    if ip.get("do_pan_and_scan"):
        raise ZooError("the image processor turns pan-and-scan on (do_pan_and_scan); zoo's Gemma 3 preprocessing "
                       "resizes each whole image, transformers' default")
    if ip.get("resample", 2) != 2:
        raise ZooError(f"the image processor's resample {ip['resample']} is not bilinear (2), which zoo runs")
    if ip.get("image_seq_length", tokens) != tokens:
        raise ZooError(f"the processor's image_seq_length {ip['image_seq_length']} differs from the model's "
                       f"mm_tokens_per_image {tokens}")
    return ip


def config_to_hf(cfg: Gemma3VisionConfig) -> dict[str, Any]:
    text = gemma3.config_to_hf(cfg.language)
    text.pop("architectures", None)
    ids = {k: text.pop(k) for k in HF_TOKEN_ID_KEYS}  # at the top too, where transformers reads them first
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {**text, **ids},
        "vision_config": clip.siglip_config_to_hf(cfg.vision),
        "mm_tokens_per_image": cfg.mm_tokens_per_image,
        "image_token_index": cfg.image_token_id,
        "boi_token_index": cfg.boi_token_id,
        "eoi_token_index": cfg.eoi_token_id,
        "tie_word_embeddings": cfg.language.tie_embeddings,
        **ids,
    }


def image_processor_to_hf(cfg: Gemma3VisionConfig) -> dict[str, Any]:
    """preprocessor_config.json as the published checkpoints (google/gemma-3-*) write it."""
    side = cfg.vision.image_size
    return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "image_seq_length": cfg.mm_tokens_per_image, "size": {"height": side, "width": side},
            "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std), "resample": 2,
            "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
            "do_convert_rgb": None, "do_pan_and_scan": None}


def _build(config: Gemma3VisionConfig, attn: str | AttentionFn) -> ZooModel:
    return Gemma3Vision(config, attn)


def _gemma3_config(lm: object) -> Gemma3Config:
    if not isinstance(lm, Gemma3Config):
        raise TypeError(f"a Gemma 3 vision model's language model is a Gemma3Config, got a {type(lm).__name__}")
    return lm


def _tied_head(config: Gemma3VisionConfig) -> frozenset[str]:
    if not config.language.tie_embeddings:
        return frozenset()
    return frozenset(hf_spellings(HF_LANGUAGE + "lm_head.weight"))


FAMILY = family("gemma3_vision", Gemma3VisionConfig, ("gemma3",), build=_build, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"),  # PEFT's for gemma3; LoRA adapts the language model
                text_config=lambda config: config.language,
                with_text_config=lambda config, lm: dataclasses.replace(config, language=_gemma3_config(lm)),
                hf_spellings=hf_spellings, hf_tied=_tied_head, hf_left_out=HF_LEFT_OUT,
                left_out_why="gemma3_vision: the SigLIP tower's attention-pooling head (vision_use_head) is left "
                             "out: Gemma 3 never reads it")
