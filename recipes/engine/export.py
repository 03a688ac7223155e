"""The trained model, for use outside the recipes: OUT/model in zoo format with the tokenizer, and OUT/model-hf in
the Hugging Face layout with --export-hf. Both carry the special-token ids generation needs (complete_token_ids), and
the run's tokenizer files as they are: transformers' AutoTokenizer reads them to the ids zoo encodes (one rule for
special tokens, the checkpoint's: zoo.io.tokenizer)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

import zoo
from recipes.engine.processes import Dist
from recipes.engine.sections import RecipeConfig
from zoo.errors import ZooError
from zoo.io.atomic import atomic_dir
from zoo.io.chat import pick_template
from zoo.io.chat_jinja import builtin_jinja
from zoo.io.config import complete_token_ids
from zoo.io.safetensors import save_safetensors
from zoo.io.tokenizer import Tokenizer
from zoo.models import FAMILIES, Model
from zoo.train.lora import LoRAConfig, adapter_config, adapter_state, merged_state, shared_a
from zoo.train.quant import dequantized


def export(cfg: RecipeConfig, d: Dist, model: Model, tok: Tokenizer, lora: LoRAConfig | None = None,
           template: str | None = None) -> Path:
    """OUT/model (and OUT/model-hf with --export-hf): every rank gathers the full weights, rank 0 writes them.
    With `lora`, OUT/model is the merged model and OUT/adapter the adapter in PEFT's layout. `template` is the
    chat template a chat recipe trained with (its end-of-turn token joins the eos ids); a built-in one is written
    beside the tokenizer as chat_template.jinja, which transformers' apply_chat_template and zoo read first."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(cfg.run.out) / "model"
    # LoRA from a checkpoint directory gathers only the adapters: the base is merged as --model holds it (its
    # dtype, not the bf16 or 4-bit copy the run computed with)
    from_disk = lora is not None and Path(cfg.model.name).is_dir()
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=from_disk))
    full = {name: t for name, t in gathered.items() if isinstance(t, Tensor)}  # full tensors: every entry
    if d.main:
        with torch.device("meta"):  # a plain copy: FSDP has swapped the model's class for a sharded one
            config = complete_token_ids(model.config, tok, template or "auto")
            plain = cast(Model, FAMILIES[model.family].build(config, "eager"))
        if lora is not None:
            full = with_base(full, zoo.load(cfg.model.name).state_dict() if from_disk else None,
                             list(model.state_dict()))
            a_from = shared_a(model)
            trained = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
            export_adapter(cfg.run.out, cfg.model.name, plain, full, lora, a_from, trained)
            full = merged_state(full, lora.scale, a_from)
        plain.load_state_dict(full, assign=True)
        zoo.save(plain, out, force=True, tokenizer_from=str(tok.dir))
        if template is not None and (name := pick_template(tok) if template == "auto" else template) != "checkpoint":
            # the model now answers in a built-in template the tokenizer files lack: it travels with the model
            (out / "chat_template.jinja").write_text(builtin_jinja(name, tok))
        if cfg.checkpoint.export_hf:
            from convert.zoo_to_hf import zoo_to_hf

            zoo_to_hf(out, Path(cfg.run.out) / "model-hf", force=True)
        print(f"saved {out}" + (f" and {Path(cfg.run.out) / 'model-hf'}" if cfg.checkpoint.export_hf else ""))
    d.barrier()
    return out


def with_base(state: dict[str, Tensor], base: dict[str, Tensor] | None, names: list[str]) -> dict[str, Tensor]:
    """A LoRA model's full state (`names`) from its gathered `state` and the `base` model's weights for what `state`
    lacks (a wrapped layer's `X.base.weight` is the base's `X.weight`); 4-bit weights of a run without a base on disk
    dequantized."""
    if base is None:
        return {n: dequantized(t) for n, t in state.items()}
    return {n: state[n] if n in state else base[n.replace(".base.", ".")] for n in names}


def export_adapter(run_out: str | Path, base: str, plain: Model, full: dict[str, Tensor], lora: LoRAConfig,
                   a_from: dict[str, str] | None = None, trained: Sequence[str] = ()) -> Path | None:
    """OUT/adapter (OUT: `run_out`) of a LoRA over `base` (--model): adapter_config.json and
    adapter_model.safetensors as PEFT saves them for the Hugging Face layout of the model
    (`peft.PeftModel.from_pretrained` on the --export-hf output loads it); InternLM2's wqkv and OpenELM's qkv_proj /
    proj_1 carry the shared-A adapters of their parts. None, said, when an adapted layer is
    only part of such a fused tensor (PEFT cannot address it); the merged model is written either way. A LLaVA's
    adapter also holds its fully trained projector, as PEFT saves `modules_to_save`; a Qwen2.5-VL's or Gemma 3's the
    parts `trained` names (zoo names of the parameters trained in full: a merger, a projector)."""
    family = FAMILIES[plain.family]
    names = list(plain.state_dict())
    paths = TRANSFORMERS_PATHS.get(plain.family)
    if paths is None and hasattr(plain, "preprocess_images"):
        # PEFT names a vision-language model's modules by transformers' in-memory paths, which differ by family
        print(f"note: no OUT/adapter for a {plain.family} model (where transformers holds its modules is not written "
              "here yet); OUT/model holds the merged weights")
        return None
    try:
        plan = family.plan_to_hf(plain.config, names)
    except ZooError as e:  # LLaVA-1's linear projector: no llava-hf layout, so no PEFT adapter over it
        print(f"note: no OUT/adapter: {e}; OUT/model holds the merged weights")
        return None
    llava = plain.family == "llava"
    if paths is not None:
        plan = {module_path(hf, paths): v for hf, v in plan.items()}
    hf_of = {srcs[0]: hf for hf, (srcs, fn) in plan.items() if len(srcs) == 1 and fn is None}
    try:
        tensors = adapter_state(full, plan, a_from)
    except KeyError as e:
        print(f"note: no OUT/adapter: the adapted {e.args[0]} is only part of a fused tensor in the Hugging Face "
              f"layout of {plain.family}, which a PEFT adapter cannot address (adapt all its parts, or the fused "
              f"module by its Hugging Face name); OUT/model holds the merged weights")
        return None
    targets = sorted({n.split(".")[-3] for n in tensors})  # "...q_proj.lora_A.weight" -> q_proj
    config = adapter_config(lora, targets, base)
    if llava:
        # the tower's and the language model's linear layers share names (q_proj, v_proj): a list of names would
        # adapt both, so the adapted modules are named by a pattern (PEFT full-matches a string target_modules).
        # PEFT saves a modules_to_save module's tensors under its plain name, and writes task_type null for
        # LlavaForConditionalGeneration
        modules = sorted({n.removeprefix("base_model.model.").rsplit(".", 2)[0] for n in tensors})
        config |= {"task_type": None, "target_modules": module_pattern(modules),
                   "modules_to_save": ["multi_modal_projector"]}
        tensors |= {f"base_model.model.{hf_of[n]}": full[n].contiguous() for n in names if n.startswith("projector.")}
    elif paths is not None:  # a natively multimodal model: its adapted modules by pattern, as LLaVA's
        modules = sorted({n.removeprefix("base_model.model.").rsplit(".", 2)[0] for n in tensors})
        # the parts trained in full (a merger, a projector, a tower without adapters), each as the module holding
        # them, saved whole as PEFT saves modules_to_save
        saved = {hf: (srcs, fn) for hf, (srcs, fn) in plan.items() if srcs and set(srcs) <= set(trained)}
        groups: dict[str, list[str]] = {}
        for hf, (srcs, _) in saved.items():
            groups.setdefault(srcs[0].split(".")[0], []).append(hf.rsplit(".", 1)[0])
        to_save = sorted(".".join(os.path.commonprefix([m.split(".") for m in group])) for group in groups.values())
        if not all(to_save):
            print(f"note: no OUT/adapter: the parts trained in full have no one module in {plain.family}'s "
                  "transformers layout; OUT/model holds the merged weights")
            return None
        config |= {"task_type": None, "target_modules": module_pattern(modules), "modules_to_save": to_save or None}
        for hf, (srcs, fn) in saved.items():
            whole = full[srcs[0]] if fn is None else fn([full[n] for n in srcs])
            tensors[f"base_model.model.{hf}"] = whole.contiguous()
    out = Path(run_out) / "adapter"
    with atomic_dir(out, force=True) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_safetensors(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    print(f"saved {out} (PEFT LoRA adapter over the Hugging Face layout of {base})")
    return out


# where transformers 5's LlavaForConditionalGeneration holds the tensors of a llava-hf file (its weight renaming in
# transformers.conversion_mapping): PEFT names adapter tensors by these module paths, not by the file's names
TRANSFORMERS_LLAVA = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                      ("vision_tower.vision_model.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector."))


# transformers 5's Qwen2_5_VLForConditionalGeneration and Gemma3ForConditionalGeneration alike (the published files'
# names on the left)
TRANSFORMERS_PATHS = {
    "llava": TRANSFORMERS_LLAVA,
    "qwen2_5_vl": (("model.", "model.language_model."), ("visual.", "model.visual.")),
    "gemma3_vision": (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                      ("vision_tower.vision_model.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector.")),
}


def module_path(hf: str, paths: tuple[tuple[str, str], ...]) -> str:
    """The module path of a Hugging Face file's tensor name in transformers' class, by `paths` (file prefix, module
    prefix)."""
    for file_prefix, module_prefix in paths:
        if hf.startswith(file_prefix):
            return module_prefix + hf[len(file_prefix):]
    return hf


def transformers_llava_name(hf: str) -> str:
    """The module path of a llava-hf tensor name in transformers' LlavaForConditionalGeneration."""
    return module_path(hf, TRANSFORMERS_LLAVA)


def module_pattern(modules: list[str]) -> str:
    """A regular expression matching exactly these modules, one alternative per kind with its layer indices listed
    (a LLaVA's tower is adapted only up to its feature layer, so "every layer" would be too many)."""
    forms: dict[tuple[str, ...], list[set[str]]] = {}
    for m in modules:
        parts = m.split(".")
        numbers = [p for p in parts if p.isdigit()]
        seen = forms.setdefault(tuple("" if p.isdigit() else p for p in parts), [set() for _ in numbers])
        for indices, n in zip(seen, numbers, strict=True):
            indices.add(n)

    def spell(form: tuple[str, ...], seen: list[set[str]]) -> str:
        numbers = iter(seen)
        return r"\.".join(re.escape(p) if p else f"(?:{'|'.join(sorted(next(numbers), key=int))})" for p in form)

    return "|".join(sorted(spell(form, seen) for form, seen in forms.items()))
