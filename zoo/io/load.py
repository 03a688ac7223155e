"""Loading: build on meta, then stream safetensors one tensor at a time through the family's weight plan into
place, names and shapes checked before anything is read.

A weight plan maps each target tensor to its source names in the checkpoint and how they combine (renames, the
splits of fused weights); zoo's own checkpoints need none, a Hugging Face one the family's `plan_from_hf`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from zoo.core.attention import AttentionFn
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.io.config import Format, config_diff, read_config
from zoo.io.dtypes import as_dtype
from zoo.io.fp8 import dequantizing
from zoo.io.hub import is_hub_id, missing, resolve
from zoo.io.safetensors import Reader, SafetensorsDir, some_names
from zoo.models import FAMILIES, Model, ModelConfig
from zoo.models.family import Family, Plan

IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # buffers old transformers saved

log = logging.getLogger(__name__)


def hf_plan(family: Family, config: ModelConfig, zoo_names: list[str],
            checkpoint_names: list[str]) -> tuple[Plan, frozenset[str]]:
    """family.plan_from_hf, with each source name spelled the way this checkpoint spells it; and the names zoo never
    reads and `stream` lets pass: a tied head (`family.hf_tied`), which some checkpoints save, and what lies under the
    family's `hf_left_out` prefixes (Gemma 3: a multimodal checkpoint's vision tower), said in one line.

    One architecture can reach us in several spellings (LLaVA: the hub's `vision_tower.vision_model.*`,
    transformers 5's `vision_tower.*`, the original repository's `model.mm_projector.*`). A family that knows
    such variants lists them in `family.hf_spellings(name)`; the first candidate the checkpoint holds is used.
    """
    plan = family.plan_from_hf(config, zoo_names)
    have = set(checkpoint_names)

    def spelled(name: str) -> str:
        return next((c for c in family.hf_spellings(name) if c in have), name)

    left_out = frozenset(n for n in checkpoint_names if n.startswith(family.hf_left_out(config)))  # () matches none
    if left_out:
        log.warning(family.left_out_why)
    return ({target: (tuple(spelled(s) for s in sources), combine) for target, (sources, combine) in plan.items()},
            family.hf_tied(config) | left_out)


def plan_for(family: Family, config: ModelConfig, fmt: Format, model: nn.Module,
             checkpoint_names: list[str]) -> tuple[Plan, frozenset[str]]:
    """{zoo name: (source names in the checkpoint, combine)} for loading a checkpoint of format `fmt`, and the
    checkpoint's names nothing reads (`hf_plan`)."""
    names = list(model.state_dict().keys())
    if fmt == "hf":
        return hf_plan(family, config, names, checkpoint_names)
    return {n: ((n,), None) for n in names}, frozenset()


def stream(reader: Reader, plan: Plan, shapes: dict[str, torch.Size] | None,
           ignore: Collection[str] = frozenset()) -> Iterator[tuple[str, Tensor]]:
    """Yield (target name, tensor) for each entry of `plan`, after checking names and shapes up front."""
    have = set(reader.names())
    needed = {s for sources, _ in plan.values() for s in sources}
    missing = sorted(needed - have)
    unexpected = sorted(n for n in have - needed if not IGNORED_HF_TENSORS.search(n) and n not in ignore)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {some_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {some_names(unexpected)}")
        raise ZooError(f"{reader.path}: checkpoint does not match the model; " + "; ".join(parts))
    held: dict[str, Tensor] = {}  # the previous target's sources: a stacked tensor split into many targets is read once
    for target, (sources, combine) in plan.items():
        held = {s: held[s] if s in held else reader.get(s) for s in sources}
        tensors = [held[s] for s in sources]
        quantized = getattr(combine, "quantized", False)  # a dequantiser (GPT-OSS's MXFP4 experts) reads bytes
        for s, x in zip(sources, tensors):  # each source: stacking an int32 expert among float ones would promote it
            if not x.is_floating_point() and not quantized:  # every weight is floating: an int header is damage
                raise ZooError(f"{reader.path}: tensor {s} has dtype {x.dtype}; a model weight must be a floating "
                               "point tensor (a damaged or hand-edited safetensors header?)")
        try:
            t = combine(tensors) if combine is not None else tensors[0]
        except (RuntimeError, ValueError, IndexError) as e:  # a fused tensor of the wrong size cannot be split
            got = ", ".join(f"{s} {list(x.shape)}" for s, x in zip(sources, tensors))
            want = f"; {target} should be {list(shapes[target])}" if shapes is not None else ""
            raise ZooError(f"{reader.path}: cannot make {target} from {got}{want} ({str(e).splitlines()[0]})") from e
        if shapes is not None and t.shape != shapes[target]:
            src = sources[0] if len(sources) == 1 else f"{sources} -> {target}"
            raise ZooError(f"{reader.path}: shape mismatch for {src}: expected {list(shapes[target])}, "
                           f"got {list(t.shape)}")
        yield target, t


def _assign(model: nn.Module, name: str, tensor: Tensor) -> None:
    """Put `tensor` itself (no copy) in place of the parameter or buffer `name` (a meta placeholder)."""
    mod_name, _, attr = name.rpartition(".")
    module = model.get_submodule(mod_name)
    old = getattr(module, attr)
    if isinstance(old, nn.Parameter):
        module.register_parameter(attr, nn.Parameter(tensor, requires_grad=old.requires_grad))
    else:
        module.register_buffer(attr, tensor)  # state_dict names only persistent buffers


# ---- the public load ----


def not_found(name: str, revision: str | None = None, flag: str = "download=True") -> ZooError:
    """A name that is neither a directory nor a preset nor a hub id in the local cache: for a hub id, what to run to
    get it (and the preset it is the source of); else where presets are listed."""
    if is_hub_id(name):
        return ZooError(missing(name, revision, flag))
    return ZooError(f"{name!r} is neither a checkpoint directory nor a preset name (python -m zoo presets lists "
                    "them) nor a Hugging Face hub id ORG/NAME")


def load(
    name_or_dir: str | os.PathLike[str],
    attn: str | AttentionFn = "auto",
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    checkpoint: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    download: bool = False,
) -> Model:
    """Build a model from a preset name or a checkpoint directory (zoo or Hugging Face layout).

    The model is built on the meta device; weights are then streamed from memory-mapped safetensors straight into
    place (cast to `dtype` on the way: a torch dtype or its name, "bfloat16" or "bf16"), so peak memory stays near
    one copy of the weights. A preset (its name in any case) without `checkpoint` gets random weights (or none at all
    on device="meta"). A Hugging Face hub id ("Qwen/Qwen3-0.6B") is its snapshot in the local cache (HF_HUB_CACHE,
    HF_HOME; `revision` a branch, tag or commit, default main), downloaded through huggingface_hub first with
    `download=True` (safetensors, configs and tokenizer files only; never with HF_HUB_OFFLINE set).
    """
    from zoo.models.presets import PRESETS, get_preset

    dtype = as_dtype(dtype)
    device = torch.device(device)
    weights: tuple[Path, Format] | None = None  # where to read the weights from, and its layout
    name = os.fspath(name_or_dir)
    if os.path.isdir(name) or is_hub_id(name):
        path = resolve(name, revision, download)
        family, config, fmt = read_config(path)
        weights = path, fmt
    else:
        if name.lower() not in PRESETS and ("/" in name or os.sep in name or name.startswith(".")):
            raise not_found(name)
        if revision is not None:
            raise ZooError(f"{name!r} is a preset name: a revision ({revision}) applies to a Hugging Face hub id only")
        preset = get_preset(name)
        family, config = FAMILIES[preset.family], preset.config
        if checkpoint is not None:
            ck_family, ck_config, fmt = read_config(checkpoint)
            if ck_family.name != family.name or ck_config != config:
                diff = config_diff(config, ck_config) if ck_family.name == family.name else "family"
                raise ZooError(f"checkpoint {checkpoint} is not a {name} checkpoint (differs in: {diff})")
            weights, config = (Path(checkpoint), fmt), ck_config  # equal but for the token ids, the checkpoint's

    with torch.device("meta"):
        model = cast(Model, family.build(config, attn))

    if weights is None:
        if device.type != "meta":
            model.to_empty(device=device)
            init_weights(model)
            if dtype is not None:
                model.to(dtype)
        elif dtype is not None:
            model.to(dtype)
        return model

    weights_dir, fmt = weights
    reader = dequantizing(SafetensorsDir(weights_dir), dtype)  # fp8 block-quantised weights multiplied out
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    plan, ignore = plan_for(family, config, fmt, model, reader.names())
    # buffers (the MoE router bias) stay fp32 whatever the dtype, as transformers keeps e_score_correction_bias: in
    # bf16 the bias would move the choice between close scores
    buffers = {n for n, _ in model.named_buffers()}
    for name, t in stream(reader, plan, shapes, ignore):
        if dtype is not None and t.is_floating_point():
            t = t.to(torch.float32 if name in buffers else dtype)
        _assign(model, name, t.to(device))
    return model
