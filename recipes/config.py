"""Recipe options: one dataclass per recipe, read from defaults < a TOML/YAML file (--config) < the command line.

Every field is a flag (`seq_len` -> `--seq-len`, booleans also as `--no-...`), listed with its help by --help.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from zoo.errors import ZooError
from zoo.io.tokenizer import TEMPLATES
from zoo.train.lora import ALL_LINEAR, LoRAConfig


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """What pretraining needs; SFT and LLaVA add their fields in subclasses."""

    model: str = opt("debug", "preset name or checkpoint directory (zoo or Hugging Face layout)")
    tokenizer: str | None = opt(None, "tokenizer directory or file (default: the model's directory; the bundled "
                                      "one for the debug preset)")
    data: str | None = opt(None, "JSONL file or directory of them, or a dataset directory written by "
                                 "python -m recipes.tokenize (default: the bundled corpus)")
    out: str = opt("out/pretrain", "output directory: metrics.jsonl, loss.png, checkpoints/, model/")
    steps: int = opt(120, "optimizer steps")
    seq_len: int = opt(512, "tokens per packed micro-batch (per data-parallel rank, before sequence sharding)")
    batch_tokens: int = opt(4096, "global batch in tokens per optimizer step, whatever the number of processes")
    lr: float = opt(3e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate of the cosine decay, as a fraction of --lr")
    warmup: int = opt(10, "linear warmup steps")
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)")
    seed: int = opt(0, "seed of the weights and of the data order")
    save_every: int = opt(50, "write a resumable checkpoint every N steps (0: only at the end)")
    keep: int = opt(2, "checkpoints to keep")
    resume: bool = opt(False, "continue from the latest intact checkpoint in OUT/checkpoints")
    force: bool = opt(False, "start afresh in an --out that holds an earlier run, removing its checkpoints and "
                             "metrics (without it, such an --out is refused unless --resume)")
    nonfinite: str = opt("stop", "a step whose loss or gradient norm is NaN/inf: stop (keep and export the weights "
                                 "before it) or skip it (weights unchanged, training goes on)", ("stop", "skip"))
    dp: int = opt(0, "data-parallel size (0: world size / sp)")
    sp: int = opt(1, "sequence-parallel size")
    sp_mode: str = opt("ulysses", "sequence-parallel attention", ("ulysses", "ring", "hybrid"))
    ulysses_size: int = opt(2, "Ulysses group size inside --sp-mode hybrid (ring across the groups)")
    device: str = opt("auto", "where to train: auto is cuda when this machine has a GPU for each of its processes, "
                              "cpu without CUDA, an error with too few GPUs; cpu trains on CPU (gloo) even where "
                              "CUDA exists", ("auto", "cpu", "cuda"))
    attn: str = opt("auto", "attention backend (zoo.BACKENDS)")
    dtype: str = opt("auto", "training dtype: auto is bf16 mixed precision on GPU, fp32 on CPU",
                     ("auto", "float32", "bfloat16"))
    activation_checkpointing: bool = opt(False, "recompute each block in backward to save memory")
    compile: bool = opt(False, "torch.compile each block")
    eval_data: str | None = opt(None, "held-out data in --data's format: its loss (the token mean over all of it) "
                                      "is logged as eval_loss every --eval-every steps and at the end")
    eval_every: int = opt(0, "evaluate on --eval-data every N steps (0: only after the last step)")
    export_hf: bool = opt(False, "also write OUT/model-hf in the Hugging Face layout")
    log_every: int = opt(1, "print a metrics line every N steps when there is no progress bar")
    progress: bool = opt(True, "tqdm progress bar on rank 0 when stderr is a terminal (else a line every "
                               "--log-every steps, no carriage returns in a log file)")


def config_fields(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _read_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ZooError(f"config file {p} not found")
    text = p.read_text()
    if p.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
            import tomli as tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ZooError(f"{p}: not valid TOML ({e})") from e
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ZooError(f"{p}: reading YAML needs PyYAML (pip install pyyaml), or write the config as TOML") from e
        return yaml.safe_load(text) or {}
    if p.suffix == ".json":
        return json.loads(text)
    raise ZooError(f"{p}: config files are .toml, .yaml/.yml or .json, got {p.suffix!r}")


T = TypeVar("T")


def parse(cls: type[T], argv: list[str] | None = None, description: str = "") -> T:
    """defaults < --config FILE < flags."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", help="TOML or YAML file of options (flags given too override it)")
    types = {}
    for f in config_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default) if f.default is not None else str
        types[f.name] = kind
        help = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            p.add_argument(flag, type=kind, default=f.default, help=help, choices=f.metadata.get("choices"))
    if known.config:
        values = _read_file(known.config)
        names = {f.name for f in config_fields(cls)}
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ZooError(f"{known.config}: unknown options {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        for k, v in values.items():
            if v is None:
                continue
            if types[k] is bool and not isinstance(v, bool):
                raise ZooError(f"{known.config}: option {k} must be true or false, got {v!r}")
            if types[k] in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ZooError(f"{known.config}: option {k} must be a number, got {v!r}")
            if types[k] is str and not isinstance(v, str):
                raise ZooError(f"{known.config}: option {k} must be a string, got {v!r}")
        p.set_defaults(**values)
    args = vars(p.parse_args(argv))
    args.pop("config")
    for f in config_fields(cls):  # a config file's values skip argparse's choices: check every source here
        choices = f.metadata.get("choices")
        if choices and args[f.name] not in choices:
            raise ZooError(f"option {f.name} must be one of {', '.join(map(str, choices))}, got {args[f.name]!r}")
    cfg = cls(**args)
    check_ranges(cfg)
    return cfg


AT_LEAST_1 = ("steps", "seq_len", "batch_tokens", "sp", "ulysses_size", "log_every")
AT_LEAST_0 = ("warmup", "save_every", "keep", "dp", "seed", "lora_rank", "eval_every")
POSITIVE = ("lr",)
FRACTIONS = ("min_lr_ratio", "beta1", "beta2")  # 0 <= x <= 1
NON_NEGATIVE = ("weight_decay", "grad_clip")


def check_ranges(cfg: Any) -> None:
    """Every number in range, named by its flag: a zero batch or a NaN learning rate would "train" silently."""
    def bad(name: str, want: str) -> ZooError:
        return ZooError(f"--{name.replace('_', '-')} must be {want}, got {getattr(cfg, name)!r}")

    for name in AT_LEAST_1:
        if getattr(cfg, name) < 1:
            raise bad(name, "at least 1")
    for name in AT_LEAST_0:
        if hasattr(cfg, name) and getattr(cfg, name) < 0:
            raise bad(name, "at least 0")
    for name in POSITIVE + FRACTIONS + NON_NEGATIVE:
        value = getattr(cfg, name)
        if not math.isfinite(value) or (name in POSITIVE and value <= 0) or value < 0:
            raise bad(name, "a finite number above 0" if name in POSITIVE else "a finite number, at least 0")
        if name in FRACTIONS and value > 1:
            raise bad(name, "between 0 and 1")


def cli(main: Callable[[], Any]) -> None:
    """A recipe's `__main__`: bad input (a ZooError) is one line `error: ...` on stderr and exit code 2."""
    try:
        main()
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk while saving: the checkpoint being written stays a temporary directory
        print(f"error: {e.strerror or e} ({e.filename or 'writing the run'}); the last complete checkpoint is "
              f"intact (--resume)", file=sys.stderr)
        sys.exit(2)


@dataclass
class SFTConfig(TrainConfig):
    model: str = opt("auto", "preset or checkpoint directory; auto: out/pretrain/model when it exists, else the "
                             "debug preset from scratch")
    data: str | None = opt(None, "JSONL chat file or directory: {\"messages\": [{\"role\", \"content\"}]} per line "
                                 "(default: the bundled chat set)")
    out: str = opt("out/sft", "output directory: metrics.jsonl, loss.png, checkpoints/, model/")
    steps: int = opt(60, "optimizer steps")
    seq_len: int = opt(512, "token budget of one packed micro-batch; samples are packed whole into it")
    batch_tokens: int = opt(2048, "global batch in tokens (packs x seq_len) per optimizer step")
    lr: float = opt(1e-3, "peak learning rate")
    warmup: int = opt(5, "linear warmup steps")
    weight_decay: float = opt(0.0, "AdamW weight decay (matrices and embeddings only)")
    save_every: int = opt(50, "write a resumable checkpoint every N steps (0: only at the end)")
    chat_template: str = opt("auto", "chat template; auto: the tokenizer's own (chat_template.jinja or "
                             "tokenizer_config.json), else the built-in one its tokens suggest", TEMPLATES)
    overlong: str = opt("truncate", "samples longer than --seq-len: truncate or drop (counted either way)",
                        ("truncate", "drop"))
    lora_rank: int = opt(0, "LoRA rank r: train low-rank adapters on a frozen model (0: full fine-tuning); writes "
                            "OUT/adapter in PEFT's layout and the merged model to OUT/model")
    lora_alpha: float = opt(8.0, "LoRA alpha: the update is scaled by alpha / r (PEFT's LoraConfig default, 8; "
                                 "XTuner's configs often use 2 x r)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA branch's input (PEFT's default, 0)")
    lora_rslora: bool = opt(False, "rank-stabilized LoRA: scale by alpha / sqrt(r) (PEFT's use_rslora)")
    lora_targets: str = opt("auto", "comma-separated linear layers of each block to adapt (zoo names: "
                                    "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or the Hugging Face "
                                    "module names of the family, e.g. InternLM2's wqkv), or all-linear (every one; "
                                    "the output head is never adapted); auto: PEFT's default for Llama, q_proj,v_proj, "
                                    "and the fused q/k/v tensor where upstream has one (InternLM2 wqkv, OpenELM "
                                    "qkv_proj)")
    qlora: bool = opt(False, "QLoRA: the frozen base's block linear layers in 4-bit NF4 (torchao, pip install "
                             "'zoo[qlora]'), the adapters as --lora-* in fp32; needs --lora-rank")

    def lora(self) -> LoRAConfig | None:
        """The LoRA of --lora-*, None for full fine-tuning."""
        if self.lora_rank == 0:
            if self.qlora:
                raise ZooError("--qlora trains LoRA adapters over a 4-bit base: it needs --lora-rank (e.g. 16)")
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_rslora, targets)


CLIP_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")  # zoo's names in a CLIP block


@dataclass
class LlavaRecipeConfig(SFTConfig):
    model: str = opt("debug-llava", "LLaVA preset or checkpoint directory; debug-llava: a tiny CLIP tower + the "
                                    "debug language model (from --language)")
    language: str = opt("auto", "debug-llava only: zoo checkpoint of its language model; auto: out/pretrain/model "
                                "when it exists, else random weights")
    data: str | None = opt(None, "LLaVA-Instruct .json (or .jsonl) with conversations and image; default: the "
                                 "built-in synthetic shapes")
    image_folder: str | None = opt(None, "folder the samples' image paths are relative to (default: next to --data)")
    stage: int = opt(1, "1: train the projector only; 2: projector and language model (the tower stays frozen)",
                     (1, 2))
    out: str = opt("out/llava", "output directory: metrics.jsonl, loss.png, checkpoints/, model/")
    steps: int = opt(40, "optimizer steps")
    seq_len: int = opt(256, "token budget of one packed micro-batch; samples are packed whole into it")
    batch_tokens: int = opt(1024, "global batch in tokens (packs x seq_len) per optimizer step")
    lr: float = opt(2e-3, "peak learning rate")
    overlong: str = opt("drop", "samples longer than --seq-len: drop, or truncate (only after the image)",
                        ("truncate", "drop"))
    lora_rank: int = opt(0, "stage 2 only: LoRA rank r on the language model's blocks (the projector still trains "
                            "fully, the tower stays frozen; 0: full stage 2); writes OUT/adapter in PEFT's layout "
                            "for the llava-hf model and the merged model to OUT/model")
    lora_vision: bool = opt(False, "with --lora-rank: LoRA on the vision tower's blocks too (XTuner's "
                                   "visual_encoder_lora), same rank, alpha and dropout")
    lora_vision_targets: str = opt(ALL_LINEAR, "with --lora-vision: comma-separated linear layers of each CLIP block "
                                               f"to adapt ({','.join(CLIP_LINEAR)}), or {ALL_LINEAR}")

    def lora_vision_names(self) -> tuple[str, ...]:
        """The tower's --lora-vision-targets, checked against the CLIP block's linear layers."""
        names = tuple(t.strip() for t in self.lora_vision_targets.split(",") if t.strip())
        unknown = [n for n in names if n not in (*CLIP_LINEAR, ALL_LINEAR)]
        if unknown or not names:
            raise ZooError(f"--lora-vision-targets {','.join(unknown) or repr(self.lora_vision_targets)}: expected "
                           f"linear layers of a CLIP block ({','.join(CLIP_LINEAR)}) or {ALL_LINEAR}")
        return names
