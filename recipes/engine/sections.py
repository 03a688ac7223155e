"""The sections of the recipes' configs: each a dataclass of options (`recipes.engine.config.opt`), one job each (model,
data, run, optim, checkpoint, parallel, log, LoRA, LLaVA). A recipe's config (`PretrainConfig` in recipes/pretrain.py,
`SFTConfig`, `LlavaRecipeConfig`) lists the sections it has, each with that recipe's defaults."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from recipes.engine.config import Section, a_directory, at_least, between, fraction, non_negative, opt
from recipes.engine.moe import check_coef
from zoo.errors import ZooError
from zoo.io.json_input import check_switches, load_json_bounded
from zoo.io.tokenizer import TEMPLATES
from zoo.train.lora import ALL_LINEAR, LoRAConfig


@dataclass
class ModelSection(Section):
    """What is trained and in what precision."""

    name: str = opt("debug", "preset name, checkpoint directory (zoo or Hugging Face layout), or Hugging Face hub id "
                             "ORG/NAME in the local cache (HF_HUB_CACHE, HF_HOME)", flag="--model")
    revision: str | None = opt(None, "--model as a hub id: the branch, tag or commit of its snapshot (default main)")
    download: bool = opt(False, "--model as a hub id not in the cache: download it through huggingface_hub "
                                "(safetensors, configs, tokenizer files; never with HF_HUB_OFFLINE set)")
    tokenizer: str | None = opt(None, "tokenizer directory or file (default: the model's directory; the bundled "
                                      "one for the debug preset)")
    attn: str = opt("auto", "attention backend (zoo.BACKENDS)")
    dtype: str = opt("auto", "training dtype: auto is bf16 mixed precision on GPU, fp32 on CPU",
                     ("auto", "float32", "bfloat16"))
    # a Mixture-of-Experts model's balancing (recipes/engine/moe.py); a dense model refuses them
    aux_loss_coef: str = opt("auto", "MoE: weight of the load-balancing loss added to the CE; auto: the checkpoint's "
                                     "router_aux_loss_coef (0 disables it)", check=check_coef)
    aux_loss: str = opt("batch", "MoE: the balance over every token of a pack (batch: transformers' "
                                 "load_balancing_loss_func) or within each document, averaged (per-document)",
                        ("batch", "per-document"))
    router_z_loss: float = opt(0.0, "MoE: weight of the router z-loss (ST-MoE; 1e-3 is usual; 0: off)",
                               check=non_negative)
    router_bias_update_rate: float = opt(0.0, "MoE: aux-loss-free balancing (DeepSeek-V3): after each step, move a "
                                              "per-expert bias on the router's choice by this much toward an even "
                                              "load (1e-3 is usual; 0: off); the model keeps the biases, so it "
                                              "exports to zoo's layout only", check=non_negative)


@dataclass
class DataSection(Section):
    """What a step reads: the data, its packs, the global batch; the held-out data and when it is evaluated."""

    path: str | None = opt(None, "JSONL file or directory of them, or a dataset directory written by "
                                 "python -m recipes.pretokenize (default: the bundled corpus)", flag="--data")
    seq_len: int = opt(512, "tokens per packed micro-batch (per data-parallel rank, before sequence sharding)",
                       check=at_least(1))
    batch_tokens: int = opt(1024, "global batch in tokens per optimizer step, whatever the number of processes",
                            check=at_least(1))
    eval_data: str | None = opt(None, "held-out data in --data's format: its loss (the token mean over all of it) "
                                      "is logged as eval_loss every --eval-every steps and at the end")
    eval_every: int = opt(0, "evaluate on --eval-data every N steps (0: only after the last step)", check=at_least(0))

    def template(self) -> str | None:
        """The chat template the samples are rendered with; None: raw text (pretraining)."""
        return None


# what --seq-len and --batch-tokens mean where samples are packed whole (recipes.sft, recipes.llava)
WHOLE_SAMPLES_HELP = {"seq_len": "token budget of one packed micro-batch; samples are packed whole into it",
                      "batch_tokens": "global batch in tokens (packs x seq_len) per optimizer step"}


@dataclass
class ChatDataSection(DataSection):
    """Chat data: how samples are rendered and what happens to those longer than --seq-len."""

    chat_template: str = opt("auto", "chat template; auto: the tokenizer's own (chat_template.jinja or "
                                     "tokenizer_config.json), else the built-in one its tokens suggest", TEMPLATES)
    overlong: str = opt("truncate", "samples longer than --seq-len: truncate or drop (counted either way)",
                        ("truncate", "drop"))

    def template(self) -> str | None:
        return self.chat_template


def a_json_object(v: str) -> str | None:
    """None for a JSON object of template switches, else what is wanted; one nested too deeply, holding too long an
    integer or setting a switch zoo sets itself is a ZooError saying so."""
    try:
        obj = load_json_bounded(v, "--chat-template-kwargs")
    except json.JSONDecodeError:
        return "a JSON object"
    if not isinstance(obj, dict):
        return "a JSON object"
    check_switches(obj, "--chat-template-kwargs")
    return None


@dataclass
class SFTDataSection(ChatDataSection):
    """Chat data for SFT, with the chat template's switches."""

    chat_template_kwargs: str = opt("{}", "switches for the chat template as a JSON object, e.g. "
                                          "'{\"enable_thinking\": false}' (a sample's own chat_template_kwargs win)",
                                    check=a_json_object)


@dataclass
class LlavaDataSection(ChatDataSection):
    """LLaVA-Instruct data: chats with images, found relative to a folder."""

    image_folder: str | None = opt(None, "folder the samples' image paths are relative to (default: next to --data)")


@dataclass
class RunSection(Section):
    """The run: where it writes, how long it trains, its seed, what a non-finite step does."""

    out: str = opt("out/pretrain", "output directory: metrics.jsonl, loss.png, checkpoints/, model/",
                   check=a_directory)
    steps: int = opt(1000, "optimizer steps", check=at_least(1))
    # below 2**32: each epoch's data order is seeded by seed * 1_000_003 + epoch, which torch takes up to 2**64 - 1
    seed: int = opt(0, "seed of the weights and of the data order", check=between(0, 2**32 - 1))
    nonfinite: str = opt("stop", "a step whose loss or gradient norm is NaN/inf: stop (keep and export the weights "
                                 "before it) or skip it (weights unchanged, training goes on)", ("stop", "skip"))


def a_rate(v: float) -> str | None:
    """--lr: a finite rate above 0, or 0 for the recipe to choose (recipes/engine/defaults.py)."""
    return None if math.isfinite(v) and v >= 0 else "a finite number above 0, or 0 to choose by what is trained"


@dataclass
class OptimSection(Section):
    """AdamW, linear warmup then cosine decay, gradient clipping. Saved with the optimizer's state: a resumed run
    keeps them."""

    lr: float = opt(5e-3, "peak learning rate (0: chosen by what is trained, recipes/engine/defaults.py)", check=a_rate)
    min_lr_ratio: float = opt(0.1, "final learning rate of the cosine decay, as a fraction of --lr", check=fraction)
    warmup: int = opt(30, "linear warmup steps", check=at_least(0))
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices and embeddings only)", check=non_negative)
    beta1: float = opt(0.9, "AdamW beta1", check=fraction)
    beta2: float = opt(0.95, "AdamW beta2", check=fraction)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", check=non_negative)


@dataclass
class CheckpointSection(Section):
    """Resumable checkpoints, starting over, and the Hugging Face export."""

    save_every: int = opt(50, "write a resumable checkpoint every N steps (0: only at the end)", check=at_least(0))
    keep: int = opt(2, "checkpoints to keep", check=at_least(0))
    resume: bool = opt(False, "continue from the latest intact checkpoint in OUT/checkpoints")
    force: bool = opt(False, "start afresh in an --out that holds an earlier run, removing its checkpoints and "
                             "metrics (without it, such an --out is refused unless --resume)")
    export_hf: bool = opt(False, "also write OUT/model-hf in the Hugging Face layout")


@dataclass
class ParallelSection(Section):
    """The processes (device, data x sequence parallel) and what is applied to the model's blocks."""

    device: str = opt("auto", "where to train: auto is cuda when this machine has a GPU for each of its processes, "
                              "cpu without CUDA, an error with too few GPUs; cpu trains on CPU (gloo) even where "
                              "CUDA exists", ("auto", "cpu", "cuda"))
    dp: int = opt(0, "data-parallel size (0: world size / sp)", check=at_least(0))
    sp: int = opt(1, "sequence-parallel size", check=at_least(1))
    sp_mode: str = opt("ulysses", "sequence-parallel attention", ("ulysses", "ring", "hybrid"))
    ulysses_size: int = opt(2, "Ulysses group size inside --sp-mode hybrid (ring across the groups)",
                            check=at_least(1))
    ep: int = opt(1, "expert-parallel size: each MoE layer's experts spread over this many processes (consecutive "
                     "ranks; it must divide the world size and the expert count), tokens sent to them by "
                     "all-to-all", check=at_least(1))
    activation_checkpointing: bool = opt(False, "recompute each block in backward to save memory")
    compile: bool = opt(False, "torch.compile each block")
    fp8: str = opt("off", "fp8 training of the blocks' linear layers (torchao float8, tensorwise or rowwise scaling; "
                          "pays with --compile): needs a CUDA GPU of compute capability >= 8.9 and bf16",
                   ("off", "tensorwise", "rowwise"))


@dataclass
class LogSection(Section):
    """What a run prints while it trains (metrics.jsonl gets every step whatever these say)."""

    log_every: int = opt(1, "print a metrics line every N steps when there is no progress bar", check=at_least(1))
    progress: bool = opt(True, "tqdm progress bar on rank 0 when stderr is a terminal (else a line every "
                               "--log-every steps, no carriage returns in a log file)")
    sample_every: int = opt(0, "every N steps (and after the last), print greedy continuations of fixed prompts "
                               "and write them to the step's row of metrics.jsonl as \"samples\" (0: off)",
                            check=at_least(0))
    sample_prompts: str | None = opt(None, "text file of sample prompts, one a line (default: two fixed ones; a chat "
                                           "recipe renders each as a user turn through its chat template)")
    sample_tokens: int = opt(32, "new tokens per sample (greedy)", check=at_least(1))
    wandb: bool = opt(False, "also log the TensorBoard scalars to Weights & Biases (pip install wandb; WANDB_MODE="
                             "offline logs without an account)")
    wandb_project: str = opt("zoo", "the Weights & Biases project of --wandb")
    tensorboard: bool = opt(False, "also write the scalars for TensorBoard to OUT/tensorboard (pip install "
                                   "'zoo[tensorboard]'; then tensorboard --logdir OUT/tensorboard)")


@dataclass
class LoRASection(Section):
    """LoRA (and QLoRA) adapters on the blocks of a frozen model; rank 0 is full fine-tuning."""

    rank: int = opt(0, "LoRA rank r: train low-rank adapters on a frozen model (0: full fine-tuning); writes "
                       "OUT/adapter in PEFT's layout and the merged model to OUT/model", flag="--lora-rank",
                    check=at_least(0))
    alpha: float = opt(8.0, "LoRA alpha: the update is scaled by alpha / r (PEFT's LoraConfig default, 8; XTuner's "
                            "configs often use 2 x r)", flag="--lora-alpha")
    dropout: float = opt(0.0, "dropout on the LoRA branch's input (PEFT's default, 0)", flag="--lora-dropout")
    rslora: bool = opt(False, "rank-stabilized LoRA: scale by alpha / sqrt(r) (PEFT's use_rslora)",
                       flag="--lora-rslora")
    targets: str = opt("auto", "comma-separated linear layers of each block to adapt (zoo names: "
                               "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or the Hugging Face "
                               "module names of the family, e.g. InternLM2's wqkv), or all-linear (every one; "
                               "the output head is never adapted); auto: PEFT's default for Llama, q_proj,v_proj, "
                               "and the fused q/k/v tensor where upstream has one (InternLM2 wqkv, OpenELM "
                               "qkv_proj)", flag="--lora-targets")
    qlora: bool = opt(False, "QLoRA: the frozen base's block linear layers in 4-bit NF4 (torchao, pip install "
                             "'zoo[qlora]'), the adapters as --lora-* in fp32; needs --lora-rank")

    def config(self) -> LoRAConfig | None:
        """The LoRA of --lora-*, None for full fine-tuning."""
        if self.rank == 0:
            if self.qlora:
                raise ZooError("--qlora trains LoRA adapters over a 4-bit base: it needs --lora-rank (e.g. 16)")
            return None
        targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        return LoRAConfig(self.rank, self.alpha, self.dropout, self.rslora, targets)


CLIP_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")  # zoo's names in a CLIP block


@dataclass
class VisionLoRASection(LoRASection):
    """LLaVA's LoRA: also on the vision tower's blocks, with their own targets."""

    vision: bool = opt(False, "with --lora-rank: LoRA on the vision tower's blocks too (XTuner's "
                              "visual_encoder_lora), same rank, alpha and dropout", flag="--lora-vision")
    vision_targets: str = opt(ALL_LINEAR, "with --lora-vision: comma-separated linear layers of each CLIP block to "
                                          f"adapt ({','.join(CLIP_LINEAR)}), or {ALL_LINEAR}",
                              flag="--lora-vision-targets")

    def vision_names(self) -> tuple[str, ...]:
        """The tower's --lora-vision-targets, checked against the CLIP block's linear layers."""
        names = tuple(t.strip() for t in self.vision_targets.split(",") if t.strip())
        unknown = [n for n in names if n not in (*CLIP_LINEAR, ALL_LINEAR)]
        if unknown or not names:
            raise ZooError(f"--lora-vision-targets {','.join(unknown) or repr(self.vision_targets)}: expected "
                           f"linear layers of a CLIP block ({','.join(CLIP_LINEAR)}) or {ALL_LINEAR}")
        return names


@dataclass
class LlavaSection(Section):
    """recipes.llava's own: which stage, and the built-in model's language model."""

    language: str = opt("auto", "debug-llava only: zoo checkpoint of its language model; auto: out/pretrain/model "
                                "when it exists, else random weights")
    stage: int = opt(1, "1: train the projector only; 2: projector and language model (the tower stays frozen)",
                     (1, 2))


class RecipeConfig(Protocol):
    """What the shared parts of the recipes (build, loop, checkpoint, metrics, export) read of a recipe's config:
    the sections every recipe has."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def model(self) -> ModelSection: ...

    @property
    def data(self) -> DataSection: ...

    @property
    def run(self) -> RunSection: ...

    @property
    def optim(self) -> OptimSection: ...

    @property
    def checkpoint(self) -> CheckpointSection: ...

    @property
    def parallel(self) -> ParallelSection: ...

    @property
    def log(self) -> LogSection: ...
