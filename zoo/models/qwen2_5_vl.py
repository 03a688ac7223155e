"""Qwen2.5-VL: the native-resolution vision tower (zoo.models.qwen_vision), its merger, and Qwen2's language model
with multimodal RoPE, over a packed batch.

Shapes: T tokens of the pack, D language-model width, U image tokens (merged units) of the pack, V vocab.
A document holds each image as a run of `image_token_id` placeholders, one per merged unit (t*h*w / m^2 for an
image of grid (t, h, w)), between vision_start and vision_end: the processor's expansion. The pack's images
(`ImagePatches`: the patches of all of them and their grids) go through the tower in one call, and the merged
tokens replace the placeholders' embeddings in order.

Positions (M-RoPE, `mrope_positions`): each document's tokens get (temporal, height, width) positions as
transformers' get_rope_index gives that document alone: text counts up on all three, an image's tokens sit at
(start, start + row, start + column) on its merged grid, and the text after it starts at start + max(rows, columns),
one past the image's largest position. They restart at each document. A decode step's tokens continue from the
prompt: text position + the document's rope delta (its largest position + 1 - its length), `decode_offsets`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
from torch import Tensor, nn

from zoo.core.attention import AttentionFn, attention_flops
from zoo.core.contract import FamilyConfig
from zoo.core.layers import linear_params
from zoo.core.packing import ImagePatches, Packed, check_ids
from zoo.errors import ZooError
from zoo.models import qwen2, qwen_image, qwen_vision
from zoo.models.decoder import Decoder
from zoo.models.family import family, rename_plans
from zoo.models.llama import HF_NAMES as LLAMA_HF_NAMES
from zoo.models.qwen2 import Qwen2Config
from zoo.models.qwen_vision import QwenVision, QwenVisionConfig
from zoo.models.vlm import VisionLanguage, nested_config, write_rows

if TYPE_CHECKING:
    from PIL import Image

    from zoo.core.contract import DecoderConfig, ZooModel


@dataclass(frozen=True)
class Qwen25VLConfig:
    family: ClassVar[str] = "qwen2_5_vl"
    positive: ClassVar[frozenset[str]] = frozenset({"min_pixels", "max_pixels"})
    vision: QwenVisionConfig = field(default_factory=QwenVisionConfig)
    language: Qwen2Config = field(default_factory=lambda: Qwen2Config(mrope_section=(16, 24, 24)))
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    # the image processor's (preprocessor_config.json, or processor_config.json's image_processor); without either,
    # the published checkpoints' (transformers' processor class alone defaults to 28 * 28 * 1280 at most)
    min_pixels: int = 3136
    max_pixels: int = 12845056
    image_mean: tuple[float, ...] = qwen_image.CLIP_MEAN
    image_std: tuple[float, ...] = qwen_image.CLIP_STD

    def __post_init__(self) -> None:
        finish_vl(self, Qwen2Config)


def finish_vl(cfg: Any, language_cls: type) -> None:
    """A Qwen-VL config after construction: sub-configs from a zoo config.json's dicts, tuples, QwenVL's checks."""
    nested_config(cfg, QwenVisionConfig, language_cls)
    if not cfg.language.mrope_section:
        raise ZooError(f"a {cfg.family} language model turns its rotary by M-RoPE: mrope_section is missing")
    if cfg.vision.out_dim != cfg.language.dim:
        raise ZooError(f"the merger's width {cfg.vision.out_dim} differs from the language model's {cfg.language.dim}")
    if len(cfg.vision.deepstack_layers) > cfg.language.n_layers:
        raise ZooError(f"{len(cfg.vision.deepstack_layers)} DeepStack levels for a language model of "
                       f"{cfg.language.n_layers} layers")


class QwenVLConfig(FamilyConfig, Protocol):
    """What QwenVL reads of its config (Qwen25VLConfig, zoo.models.qwen3_vl's)."""

    @property
    def vision(self) -> QwenVisionConfig: ...
    @property
    def language(self) -> DecoderConfig: ...
    @property
    def image_token_id(self) -> int: ...
    @property
    def video_token_id(self) -> int: ...
    @property
    def min_pixels(self) -> int: ...
    @property
    def max_pixels(self) -> int: ...
    @property
    def image_mean(self) -> tuple[float, ...]: ...
    @property
    def image_std(self) -> tuple[float, ...]: ...


def mrope_positions(ids: list[int], grids: Sequence[Sequence[int]], image_token_id: int,
                    merge: int) -> tuple[Tensor, int]:
    """([3, L] positions, rope delta) of one document, as transformers' get_rope_index computes them for it alone;
    `grids` are its images' (t, h, w), one per run of placeholders, in order."""
    parts, pos, k = [], 0, 0
    for is_image, run in itertools.groupby(ids, lambda i: i == image_token_id):
        n = len(list(run))
        if not is_image:
            parts.append(torch.arange(pos, pos + n).expand(3, n))
            pos += n
            continue
        if k >= len(grids):
            raise ZooError(f"a document has more runs of image placeholders (id {image_token_id}) than images "
                           f"({len(grids)})")
        t, h, w = grids[k]
        lt, lh, lw = t, h // merge, w // merge
        if n != lt * lh * lw:
            raise ZooError(f"image {k} of a document has {n} placeholder tokens (id {image_token_id}), its grid "
                           f"{[t, h, w]} needs {lt * lh * lw}: expand each image to one placeholder per merged "
                           f"{merge}x{merge} patch block")
        tt, hh, ww = torch.meshgrid(torch.arange(lt), torch.arange(lh), torch.arange(lw), indexing="ij")
        parts.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
        pos += max(lh, lw)
        k += 1
    if k != len(grids):
        raise ZooError(f"a document brought {len(grids)} images but holds {k} runs of placeholders "
                       f"(id {image_token_id})")
    pos_3L = torch.cat(parts, dim=1)
    return pos_3L, int(pos_3L.max()) + 1 - len(ids)


class QwenVL(VisionLanguage):
    """A Qwen vision tower and a language model with M-RoPE: Qwen2.5-VL, and by their configs Qwen3-VL (DeepStack)
    and Qwen3.5 (zoo.models.qwen3_vl): `config` holds `vision`, `language` (a text family's config with an
    mrope_section), the placeholder token ids and the image processor's settings."""

    config: QwenVLConfig
    placeholder = "<|image_pad|>"  # the Qwen processors' image token (the tokenizer's)

    def __init__(self, config: QwenVLConfig, attn: str | AttentionFn = "auto") -> None:
        super().__init__()
        self.config = cfg = config
        self.vision = QwenVision(cfg.vision, attn if isinstance(attn, str) else "auto")
        self.language_model = Decoder(cfg.language, attn=attn)

    @property
    def family(self) -> str:
        return self.config.family

    def set_attention(self, attn: str | AttentionFn) -> None:
        """The language model's attention function; a backend by name is the tower's too (a wrapper, such as
        sequence parallelism's or the KV cache, belongs to the language model alone)."""
        self.language_model.set_attention(attn)
        if isinstance(attn, str):
            self.vision.set_attention(attn)

    def parts(self) -> dict[str, list[nn.Module]]:
        """The tower's patch embedding (and position table) and blocks, its patch merger and DeepStack mergers (the
        projector), the language model."""
        v = self.vision
        vision = [v.patch_embed, v.layers] + ([v.pos_embed] if v.pos_embed is not None else [])
        return {"vision": vision, "projector": [v.merger, v.deepstack], "language": [self.language_model]}

    def image_text(self, tokens: int) -> str:  # Qwen2.5-VL's and Qwen3-VL's processors: a <|image_pad|> per unit
        return self.placeholder * tokens

    def token_counts(self, images: ImagePatches) -> list[int]:  # t * h * w / merge^2 of each patch grid
        return [int(g.prod()) // self.config.vision.merge_size ** 2 for g in images.grid_thw]

    def image_tokens(self, height: int, width: int) -> int:
        """The merged units of the grid smart_resize gives an image of this size (one frame: t = 1)."""
        f = self.config.vision.patch_size * self.config.vision.merge_size  # a merged unit's side in pixels
        h, w = qwen_image.smart_resize(height, width, f, self.config.min_pixels, self.config.max_pixels)
        return (h // f) * (w // f)

    def encoder_flops(self, n_images: int, grids: Sequence[Sequence[int]] = ()) -> list[tuple[int, int, nn.Module]]:
        """The tower, then the merger, on images of these (t, h, w) patch grids (an image's cost depends on its
        size): the patch embedding and every block's products on each patch; attention within each window for the
        window blocks, within each frame for the `full_layers`; the merger on each merged unit."""
        if len(grids) != n_images:
            raise ZooError(f"{self.family}'s tower costs what each image's size makes it: {n_images} image(s) need "
                           f"their {n_images} (t, h, w) grids (packed.image_grid_thw), got {len(grids)}")
        v = self.config.vision
        grid_list = [[int(x) for x in g] for g in grids]
        P = sum(t * h * w for t, h, w in grid_list)
        frames = [h * w for t, h, w in grid_list for _ in range(t)]
        windows = qwen_vision.window_order(grid_list, v.merge_size, v.window_size // v.merge_size // v.patch_size)[1] \
            if v.windowed else frames  # Qwen3-VL's blocks all see the whole frame
        n_full = sum(i in v.full_layers or not v.windowed for i in range(v.n_layers))
        N, H = v.n_heads, v.dim // v.n_heads
        tower = nn.ModuleList([self.vision.patch_embed, self.vision.layers])
        linear = 2 * P * (v.patch_dim * v.dim + linear_params(self.vision.layers))
        attention = (n_full * attention_flops(frames, N, H, causal=False)
                     + (v.n_layers - n_full) * attention_flops(windows, N, H, causal=False))
        units = P // v.merge_size ** 2
        out = [(linear, attention, tower), (2 * units * linear_params(self.vision.merger), 0, self.vision.merger)]
        if v.deepstack_layers:  # Qwen3-VL's DeepStack levels: a merger each
            out.append((2 * units * linear_params(self.vision.deepstack), 0, self.vision.deepstack))
        return out

    def preprocess_images(self, images: Sequence[Image.Image]) -> ImagePatches:
        """The images as this checkpoint's processor prepares them (zoo.models.qwen_image, zoo.io.image.preprocess)."""
        cfg, v = self.config, self.config.vision
        return qwen_image.preprocess(images, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                                     patch_size=v.patch_size, merge_size=v.merge_size,
                                     temporal_patch_size=v.temporal_patch_size, mean=cfg.image_mean,
                                     std=cfg.image_std)

    # ---- images and positions ----

    def _positions(self, whole: Packed) -> tuple[Tensor, Tensor]:
        """([3, T] M-RoPE positions, [n] rope deltas) of a whole pack, per document; computed once per pack."""
        def build() -> tuple[Tensor, Tensor]:
            grids: list[list[int]] = [] if whole.image_grid_thw is None else whole.image_grid_thw.tolist()
            ids = whole.input_ids.tolist()
            if self.config.video_token_id in ids:
                raise ZooError(f"the pack holds video placeholders (id {self.config.video_token_id}): zoo's "
                               f"{self.family} reads images only")
            cu = whole.cu_seqlens.tolist()
            per_doc = whole.images_per_doc
            if per_doc is None:  # without zoo.pack's count: each document takes the grids its placeholder runs need
                tok = self.config.image_token_id
                per_doc = [sum(1 for is_img, _ in itertools.groupby(ids[a:b], tok.__eq__) if is_img)
                           for a, b in zip(cu[:-1], cu[1:])]
            if sum(per_doc) != len(grids):
                raise ZooError(f"the pack holds {sum(per_doc)} images' placeholders but {len(grids)} image grids; "
                               "pass the images with zoo.pack(docs, images=[zoo.io.image.preprocess(...)])")
            out, deltas, start = [], [], 0
            for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                try:
                    pos, delta = mrope_positions(ids[a:b], grids[start:start + per_doc[d]],
                                                 self.config.image_token_id, self.config.vision.merge_size)
                except ZooError as e:
                    raise ZooError(f"document {d}: {e}") from None
                out.append(pos)
                deltas.append(delta)
                start += per_doc[d]
            return torch.cat(out, dim=1).to(whole.device), torch.tensor(deltas, device=whole.device)

        return whole.derived("mrope positions", build)

    def decode_offsets(self, packed: Packed) -> Tensor | None:
        """[n] what each document's decoded tokens add to their text position in the rotary (its rope delta)."""
        return self._positions(packed)[1]

    def embed_inputs(self, packed: Packed) -> Tensor:
        """[T, D] token embeddings with the merged image tokens written into the placeholder rows."""
        return self._embed(packed)[0]

    def _embed(self, packed: Packed) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """(embed_inputs, DeepStack's (rows_R, [R, L*D] features at them) or None). A part of a pack (a
        sequence-parallel shard) encodes only the images its placeholders show; the tower runs even on none and its
        (empty) output is written to the (no) placeholder rows, so that every rank calls it once a step and every
        weight of it gets a gradient, zero where there was no image (FSDP reduces the same tensors on every rank)."""
        whole, index_T = packed.part_of() or (packed, None)
        tok, m2 = self.config.image_token_id, self.config.vision.merge_size ** 2
        is_image_T = packed.input_ids == tok
        check_ids(packed.input_ids, self.config.language.vocab_size)
        x_TD = self.language_model.embed(packed.input_ids)
        grid_I3 = whole.image_grid_thw
        if packed.pixel_values is not None and grid_I3 is None:
            raise ZooError(f"a {self.family} pack carries images as ImagePatches (zoo.io.image.preprocess), not as "
                           f"pixel tensors [{', '.join(map(str, packed.pixel_values.shape))}]")
        if packed.pixel_values is None or grid_I3 is None:
            if bool(is_image_T.any()):
                raise ZooError(f"the pack holds image placeholders (id {tok}) but no images; pass them with "
                               "zoo.pack(docs, images=...)")
            feats_UD = self.vision(x_TD.new_zeros(0, self.config.vision.patch_dim),
                                   torch.zeros(0, 3, dtype=torch.int64))
            return write_rows(x_TD, is_image_T.nonzero().squeeze(1), feats_UD)
        # placeholders numbered over the whole pack: placeholder r shows unit r - start[i] of image i
        is_image_G = whole.input_ids == tok
        ordinal_G = torch.cumsum(is_image_G, 0) - 1
        rows_R = is_image_T.nonzero().squeeze(1)
        ordinal_R = ordinal_G[rows_R] if index_T is None else ordinal_G[index_T[rows_R]]
        patches_I = grid_I3.prod(-1)
        units_end_I = torch.cumsum(patches_I // m2, 0)
        if int(is_image_G.sum()) != int(units_end_I[-1]):
            raise ZooError(f"the pack has {int(is_image_G.sum())} image placeholder tokens (id {tok}) but its images "
                           f"make {int(units_end_I[-1])} image tokens")
        image_R = torch.searchsorted(units_end_I, ordinal_R, right=True)
        needed_J = torch.unique(image_R)
        patch_end_I = torch.cumsum(patches_I, 0)
        spans = [(int(patch_end_I[i]) - int(patches_I[i]), int(patch_end_I[i])) for i in needed_J.tolist()]
        pixels = packed.pixel_values
        if len(needed_J) != len(grid_I3):
            pixels = torch.cat([pixels[a:b] for a, b in spans]) if spans else pixels[:0]
        feats_UD = self.vision(pixels, grid_I3[needed_J])
        # where each needed image's units start among the encoded ones
        start_J = torch.cumsum(patches_I[needed_J] // m2, 0) - patches_I[needed_J] // m2
        first_I = units_end_I - patches_I // m2
        which_R = torch.searchsorted(needed_J, image_R)
        return write_rows(x_TD, rows_R, feats_UD[start_J[which_R] + ordinal_R - first_I[image_R]])

    def hidden(self, packed: Packed) -> Tensor:
        """Final normed hidden states [T, D]: images in their placeholders, M-RoPE positions per document."""
        if packed.position_ids_3T is None:  # first: they check each document's placeholders against its images
            whole, index_T = packed.part_of() or (packed, None)
            pos_3G = self._positions(whole)[0]
            packed = dataclasses.replace(packed, position_ids_3T=pos_3G if index_T is None else pos_3G[:, index_T])
        x_TD, deepstack = self._embed(packed)
        return self.language_model.hidden(packed, x_TD=x_TD, adds=deepstack)


# ---- Hugging Face names and config ----
# The published layout (and what transformers 5 saves): model.* and lm_head.* for the language model, visual.* for
# the tower; transformers holds model.language_model.* and model.visual.* in memory.

HF_NAMES = [*qwen_vision.hf_names("vision.", "visual."),
            *((f"language_model.{z}", h) for z, h in LLAMA_HF_NAMES)]
plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)


def hf_spellings(name: str) -> list[str]:
    """A tensor's published name first, then transformers' in-memory one."""
    if name.startswith("visual."):
        return [name, "model." + name]
    if name.startswith("model."):
        return [name, "model.language_model." + name[len("model."):]]
    return [name]


def tied_head(config: Any) -> frozenset[str]:  # every Qwen-VL family's
    return frozenset({"lm_head.weight"}) if config.language.tie_embeddings else frozenset()


def text_from_hf(hf: dict[str, Any]) -> tuple[Qwen2Config, tuple[int, ...]]:
    """The language model's config (transformers 5's text_config, or the published flat layout's top-level keys with
    rope_scaling {type: mrope}) and its mrope_section."""
    text = dict(hf.get("text_config") or hf)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(rope.pop("mrope_section", ()) or ())
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ZooError(f"Qwen2.5-VL rope {rope.get('rope_type', rope.get('type'))!r} is not supported (expected "
                       "mrope)")
    text.pop("rope_scaling", None)
    text["rope_parameters"] = dict(rope_type="default", rope_theta=text.get("rope_theta", rope.get("rope_theta", 1e6)))
    if hf.get("tie_word_embeddings"):
        text["tie_word_embeddings"] = True
    text.setdefault("rms_norm_eps", 1e-6)
    return qwen2.config_from_hf(text), section


def config_from_hf(hf: dict[str, Any]) -> Qwen25VLConfig:
    lm, section = text_from_hf(hf)
    vision = qwen_vision.config_from_hf(dict(hf.get("vision_config") or {}))
    ip = dict(hf.get("image_processor") or {})  # zoo.io.config puts the processor's settings here
    size = dict(ip.get("size") or {})
    for key, ours in (("patch_size", vision.patch_size), ("merge_size", vision.merge_size),
                      ("temporal_patch_size", vision.temporal_patch_size)):
        if ip.get(key, ours) != ours:
            raise ZooError(f"the image processor's {key} {ip[key]} differs from the vision tower's {ours}")
    d = Qwen25VLConfig.__dataclass_fields__
    return Qwen25VLConfig(
        vision=vision, language=dataclasses.replace(lm, mrope_section=section),
        **{k: hf.get(k, d[k].default) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                "vision_end_token_id")},
        min_pixels=ip.get("min_pixels") or size.get("shortest_edge") or Qwen25VLConfig.min_pixels,
        max_pixels=ip.get("max_pixels") or size.get("longest_edge") or Qwen25VLConfig.max_pixels,
        image_mean=tuple(ip.get("image_mean", qwen_image.CLIP_MEAN)),
        image_std=tuple(ip.get("image_std", qwen_image.CLIP_STD)))


def config_to_hf(cfg: Qwen25VLConfig) -> dict[str, Any]:
    """transformers 5's nested layout."""
    text = {k: v for k, v in qwen2.config_to_hf(dataclasses.replace(cfg.language, mrope_section=())).items()
            if k not in ("architectures", "rope_scaling")}
    text["model_type"] = "qwen2_5_vl_text"
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "mrope_section": list(cfg.language.mrope_section)}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": text, "vision_config": qwen_vision.config_to_hf(cfg.vision),
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": cfg.language.tie_embeddings}


def image_processor_to_hf(cfg: QwenVLConfig) -> dict[str, Any]:
    """preprocessor_config.json as the published checkpoints write it."""
    v = cfg.vision
    return {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": cfg.min_pixels,
            "max_pixels": cfg.max_pixels, "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
            "merge_size": v.merge_size, "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std),
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}


def build(config: Any, attn: str | AttentionFn) -> ZooModel:  # every Qwen-VL family's
    return QwenVL(config, attn)


FAMILY = family("qwen2_5_vl", Qwen25VLConfig, ("qwen2_5_vl",), build=build, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"), text_config=lambda config: config.language,
                with_text_config=lambda config, lm: dataclasses.replace(config, language=cast(Qwen2Config, lm)),
                hf_spellings=hf_spellings, hf_tied=tied_head)
