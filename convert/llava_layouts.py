"""python -m convert.llava_layouts XTUNER_DIR DST: an XTuner LLaVA save (pth_to_hf, "xtuner" format) into zoo.

XTuner (xtuner/model/llava.py, `LLaVAModel.to_hf`) saves a LLaVA as parts in one directory:
  llm/  or  llm_adapter/                    the language model in its Hugging Face layout, or a PEFT LoRA over it
                                             (a fully fine-tuned LLM saved by `to_xtuner_llava` sits at the root)
  visual_encoder/  or  visual_encoder_adapter/   a CLIPVisionModel, or a PEFT LoRA over the CLIP tower
  projector/                                 ProjectorModel: config (visual_hidden_size, llm_hidden_size, depth,
                                             hidden_act, bias) + weights model.0.* (, model.2.*)
A part saved as an adapter needs its base: --llm (e.g. internlm/internlm2-chat-7b) and --visual-encoder (e.g.
openai/clip-vit-large-patch14-336, a CLIPModel or CLIPVisionModel directory). LoRA weights are merged while
streaming: W + (lora_B @ lora_A) * lora_alpha / r (sqrt(r) with use_rslora), PEFT's definition. The tower
feature layer is not saved by XTuner (its configs use -2, the default here; see --feature-layer).
The original LLaVA repository's layout (model.mm_projector.*, mm_* config keys) needs no tool of its own:
`python -m convert.hf_to_zoo` reads it (see zoo/models/llava.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from convert.common import output_options, run_cli, write_checkpoint
from zoo.errors import ArgumentParser, ZooError
from zoo.io.config import read_config, zoo_config_json
from zoo.io.dtypes import DTYPES
from zoo.io.load import hf_plan
from zoo.io.safetensors import DEFAULT_SHARD_BYTES, SafetensorsDir
from zoo.models import clip
from zoo.models.llava import FAMILY, ORIGINAL_IMAGE_TOKEN, Llava, LlavaConfig
from zoo.train.lora import PEFT_DEFAULT_ALPHA, lora_scale, merge_weight


class LoRA:
    """A PEFT LoRA adapter directory: which base tensors it changes, and the merged tensor."""

    def __init__(self, path: Path):
        cfg_file = path / "adapter_config.json"
        if not cfg_file.exists():
            raise ZooError(f"{path}: not a PEFT adapter (no adapter_config.json)")
        cfg = json.loads(cfg_file.read_text())
        for key in ("rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                raise ZooError(f"{cfg_file}: per-module {key} is not supported; merge the adapter with PEFT first")
        if cfg.get("use_dora") or cfg.get("fan_in_fan_out"):
            raise ZooError(f"{cfg_file}: DoRA / fan_in_fan_out adapters are not supported; merge with PEFT first")
        # PEFT reads a config without lora_alpha with LoraConfig's default (8), not r
        self.scale = lora_scale(cfg["r"], cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA), bool(cfg.get("use_rslora")))
        self.reader = SafetensorsDir(path)
        self.pairs: dict[str, tuple[str, str]] = {}  # base tensor name -> (lora_A name, lora_B name)
        for name in self.reader.names():
            stem = name.removeprefix("base_model.model.")
            if stem.endswith(".lora_A.weight"):
                base = stem[: -len(".lora_A.weight")] + ".weight"
                self.pairs[base] = (name, name.replace(".lora_A.", ".lora_B."))
            elif not stem.endswith(".lora_B.weight"):
                raise ZooError(f"{path}: adapter tensor {name!r} is not a LoRA A/B matrix (modules_to_save?); "
                               "merge the adapter with PEFT first")
        self.path = path

    def merged(self, base_name: str, weight: Tensor) -> Tensor:
        a, b = self.pairs[base_name]
        return merge_weight(weight, self.reader.get(a), self.reader.get(b), self.scale)


class Parts:
    """The parts of an XTuner save as one reader: names prefixed "llm/", "vision/", "projector/"."""

    def __init__(self, readers: dict[str, SafetensorsDir], adapters: dict[str, LoRA], keep: dict[str, str]):
        self.path = Path(next(iter(readers.values())).path).parent
        self.readers, self.adapters = readers, adapters
        self._names = [f"{part}/{n}" for part, r in readers.items() for n in r.names() if n.startswith(keep[part])]
        for part, lora in adapters.items():
            absent = sorted(set(lora.pairs) - set(readers[part].names()))
            if absent:
                raise ZooError(f"{lora.path}: the adapter changes tensors its base does not hold: {absent[:4]}")

    def names(self) -> list[str]:
        return self._names

    def get(self, name: str) -> Tensor:
        part, _, inner = name.partition("/")
        t = self.readers[part].get(inner)
        lora = self.adapters.get(part)
        return lora.merged(inner, t) if lora is not None and inner in lora.pairs else t


def _part(root: Path, full: str, adapter: str, base: str | None, what: str) -> tuple[Path, LoRA | None]:
    if (root / full).is_dir():
        return root / full, None
    if full == "llm" and (root / "config.json").is_file() and not (root / adapter).is_dir():
        return root, None  # to_xtuner_llava's save of a fully fine-tuned LLM: the language model at the root
    if (root / adapter).is_dir():
        if base is None:
            raise ZooError(f"{root / adapter} is a LoRA adapter; pass its base {what} with --"
                           f"{'llm' if full == 'llm' else 'visual-encoder'} DIR")
        return Path(base), LoRA(root / adapter)
    if base is None:
        raise ZooError(f"{root} has neither {full}/ nor {adapter}/ (the {what} was frozen when saved); "
                       f"pass it with --{'llm' if full == 'llm' else 'visual-encoder'} DIR")
    return Path(base), None


def _vision_config(path: Path) -> clip.CLIPVisionConfig:
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") == "clip":
        raw = raw.get("vision_config") or {}
    elif raw.get("model_type") != "clip_vision_model":
        raise ZooError(f"{path}/config.json: expected a CLIP model (model_type clip or clip_vision_model), "
                       f"got {raw.get('model_type')!r}")
    return clip.config_from_hf(raw)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="XTuner save directory (llm/ or llm_adapter/, projector/, ...)")
    p.add_argument("dst", help="output zoo checkpoint directory")
    p.add_argument("--llm", help="base language model (HF layout) when SRC holds llm_adapter/ or no llm/")
    p.add_argument("--visual-encoder", help="base CLIP (CLIPModel or CLIPVisionModel) when SRC has no visual_encoder/")
    p.add_argument("--feature-layer", type=int, default=-2, help="CLIP hidden state fed to the projector")
    p.add_argument("--image-token-id", type=int, default=ORIGINAL_IMAGE_TOKEN, help="placeholder id (XTuner: -200)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--shard-size", type=float, default=DEFAULT_SHARD_BYTES / 2**30)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    root = Path(args.src)
    if not (root / "projector").is_dir():
        raise ZooError(f"{root} is not an XTuner LLaVA save: it has no projector/ directory")

    llm_dir, llm_lora = _part(root, "llm", "llm_adapter", args.llm, "language model")
    vis_dir, vis_lora = _part(root, "visual_encoder", "visual_encoder_adapter", args.visual_encoder, "CLIP tower")
    family, lm_config, fmt = read_config(llm_dir)
    if fmt != "hf" or family.name == "llava":
        raise ZooError(f"{llm_dir}: expected a Hugging Face language-model checkpoint, got a {fmt} {family.name}")
    proj = json.loads((root / "projector" / "config.json").read_text())
    depth, act = proj.get("depth", 2), proj.get("hidden_act", "gelu")
    if depth not in (1, 2) or (depth == 2 and act != "gelu"):
        raise ZooError(f"{root}/projector: depth {depth} with {act!r} is not supported (LLaVA's: depth 2, gelu)")
    config = LlavaConfig(vision=_vision_config(vis_dir), language_family=family.name,
                         language=family.text_config(lm_config),
                         projector="mlp2x_gelu" if depth == 2 else "linear", projector_bias=proj.get("bias", True),
                         feature_layer=args.feature_layer, feature_select="default",
                         image_token_id=args.image_token_id)

    with torch.device("meta"):
        model = Llava(config, attn="eager")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    readers = {"llm": SafetensorsDir(llm_dir), "vision": SafetensorsDir(vis_dir),
               "projector": SafetensorsDir(root / "projector")}
    adapters = {k: v for k, v in (("llm", llm_lora), ("vision", vis_lora)) if v is not None}
    # transformers 5 saves a CLIPVisionModel's tensors without the "vision_model." prefix that a CLIPModel and
    # transformers 4 have
    tower = "vision_model." if any(n.startswith("vision_model.") for n in readers["vision"].names()) else ""
    parts = Parts(readers, adapters, keep={"llm": "", "vision": tower, "projector": "model."})

    lm_names = [n.removeprefix("language_model.") for n in shapes if n.startswith("language_model.")]
    lm_plan, lm_tied = hf_plan(family, lm_config, lm_names, readers["llm"].names())
    plan = {f"language_model.{t}": (tuple(f"llm/{s}" for s in srcs), fn) for t, (srcs, fn) in lm_plan.items()}
    for n in shapes:
        if n.startswith("vision."):
            plan[n] = ((f"vision/{tower}{clip.hf_name(n.removeprefix('vision.'))}",), None)
        elif n.startswith("projector."):
            index = {"linear_1": 0, "linear_2": 2}[n.split(".")[1]]
            plan[n] = ((f"projector/model.{index}.{n.split('.')[2]}",), None)
    ignore = {f"llm/{name}" for name in lm_tied}
    candidates = (root / "llm", root / "llm_adapter", llm_dir)
    with_tokenizer = [d for d in candidates if (d / "tokenizer_config.json").exists()]
    tokenizer_dir = with_tokenizer[0] if with_tokenizer else llm_dir
    write_checkpoint(args.dst, plan, parts, zoo_config_json(FAMILY, config), tokenizer_from=tokenizer_dir,
                     shapes=shapes, ignore=ignore, **output_options(args))


if __name__ == "__main__":
    sys.exit(run_cli(main))
