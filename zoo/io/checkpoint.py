"""Loading and saving: build on meta, stream safetensors one tensor at a time, write atomically.

A checkpoint directory is either zoo's own (config.json with `"format": "zoo"`, zoo tensor names) or a Hugging
Face one (config.json with `model_type`, HF tensor names); both are safetensors, sharded with a
`model.safetensors.index.json` or in one `model.safetensors` (the file names transformers reads and writes).
Pickle checkpoints (`*.bin`, `*.pt`) are refused: unpickling runs code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Collection, Iterator, Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from zoo.core.attention import AttentionFn
from zoo.core.contract import DecoderConfig
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.io.paths import inside, json_object, optional
from zoo.models import FAMILIES, HF_MODEL_TYPES, Model, ModelConfig
from zoo.models.family import HF_TOKEN_ID_KEYS, Family, Plan, check_config

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "generation_config.json",
    "preprocessor_config.json", "processor_config.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # buffers old transformers saved
DEFAULT_SHARD_BYTES = 2 << 30
SINGLE_FILE = "model.safetensors"  # an unsharded checkpoint's weights (transformers' SAFE_WEIGHTS_NAME)
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's {tensor: shard} map
Format = Literal["zoo", "hf"]  # a checkpoint directory's layout: zoo's names and config, or Hugging Face's


# ---- reading ----


class SafetensorsDir:
    """The tensors of a checkpoint directory, by name, read lazily (memory-mapped) from their shard.

    Which files: the shards `model.safetensors.index.json` names; without an index `model.safetensors` alone, as
    transformers reads it (other `*.safetensors` beside it are not part of the model); without either, every
    `*.safetensors` of the directory (a PEFT adapter's `adapter_model.safetensors`, hand-written checkpoints).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        index = self.path / INDEX_FILE
        weight_map: dict[str, str] | None = None
        index_file = optional(self.path, INDEX_FILE, "index")
        if index_file is not None:
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise ZooError(f"{index}: not a valid safetensors index (expected a 'weight_map' object): {e}") from e
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
                raise ZooError(f"{index}: 'weight_map' must map tensor names to shard file names")
            for f in set(weight_map.values()):  # each checked before any is opened (and before sorting mixed types)
                inside(self.path, f, "shard named in the index")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise ZooError(
                    f"{self.path} holds only pickle weights ({', '.join(pickles[:3])}); zoo refuses to load them "
                    "because unpickling can run arbitrary code. Convert them to safetensors with a tool you trust."
                )
            raise ZooError(f"no *.safetensors weights in {self.path}")
        self._handles: dict[str, safe_open] = {}
        self.file_of: dict[str, str] = {}
        if weight_map is not None:  # the index decides where each tensor is read from
            absent = sorted(n for n, f in weight_map.items() if n not in self._open(f).keys())
            if absent:
                raise ZooError(f"{index} lists tensors its shards do not hold: {_some(absent)}")
            self.file_of = dict(weight_map)
            return
        for f in files:
            for n in self._open(f).keys():
                if n in self.file_of:
                    raise ZooError(f"{self.path}: tensor {n!r} is in two files, {self.file_of[n]} and {f}, and no "
                                   f"{INDEX_FILE} says which one is the model's")
                self.file_of[n] = f

    def _open(self, fname: str) -> safe_open:
        if fname not in self._handles:
            p = inside(self.path, fname, "weights file")
            try:
                self._handles[fname] = safe_open(str(p), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers and short files
                raise ZooError(f"{p}: corrupt or truncated safetensors file ({e})") from e
        return self._handles[fname]

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self.file_of)

    def get(self, name: str) -> Tensor:
        """One tensor, read from its shard (memory-mapped: nothing is copied until it is used)."""
        try:
            return self._open(self.file_of[name]).get_tensor(name)
        except Exception as e:
            raise ZooError(f"{self.path / self.file_of[name]}: cannot read tensor {name!r} ({e})") from e

    def shape(self, name: str) -> list[int]:
        """One tensor's shape, from the shard's header alone."""
        return self._open(self.file_of[name]).get_slice(name).get_shape()


class Reader(Protocol):
    """What `stream` reads tensors from: a SafetensorsDir, or anything with these members (the converters' readers
    that merge several directories)."""

    path: Path

    def names(self) -> list[str]: ...

    def get(self, name: str) -> Tensor: ...


def _some(names: list[str], k: int = 12) -> str:
    return ", ".join(names[:k]) + (f" ... ({len(names)} in all)" if len(names) > k else "")


def read_config(path: str | os.PathLike[str]) -> tuple[Family, ModelConfig, Format]:
    """(family, config, "zoo" or "hf") of a checkpoint directory."""
    path = Path(path)
    cfg_file = path / "config.json"
    found = optional(path, cfg_file.name, "config")
    if found is None:
        raise ZooError(f"{cfg_file} not found: expected a zoo or Hugging Face checkpoint directory "
                       "(config.json + *.safetensors)")
    raw = json_object(found)
    if raw.get("format") == "zoo":
        name = raw.get("family")
        family = FAMILIES.get(name) if isinstance(name, str) else None  # a list or number is no family either
        if family is None:
            raise ZooError(f"{cfg_file}: unknown zoo family {raw.get('family')!r}; known: {', '.join(FAMILIES)}")
        try:
            config = config_from_dict(family, raw["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise ZooError(f"{cfg_file}: cannot read the {family.name} config ({type(e).__name__}: {e})") from e
        check_config(config, str(cfg_file))
        return family, config, "zoo"
    model_type = raw.get("model_type")
    family = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ZooError(f"{cfg_file}: unknown model_type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}")
    raw = {**raw, **generation_token_ids(path)}
    try:
        config = family.config_from_hf(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ZooError(f"{cfg_file}: cannot read the {model_type} config ({type(e).__name__}: {e})") from e
    check_config(config, str(cfg_file))
    return family, config, "hf"


def generation_token_ids(path: Path) -> dict[str, Any]:
    """The special-token ids of a Hugging Face checkpoint's generation_config.json, if it has one. They win over
    config.json's, as in transformers' generate: Llama-3-8B-Instruct's config.json names only <|end_of_text|>,
    its generation_config.json also <|eot_id|>, where each answer ends."""
    gen_file = optional(path, "generation_config.json", "generation config")
    if gen_file is None:
        return {}
    gen = json_object(gen_file)
    return {k: gen[k] for k in HF_TOKEN_ID_KEYS if gen.get(k) is not None}


def language_config(config: ModelConfig) -> DecoderConfig:
    """The config of the language model: the config itself, or a LLaVA's `language` (it holds the token ids)."""
    return FAMILIES[config.family].text_config(config)


def with_token_ids(config: ModelConfig, bos: int | None, eos: Sequence[int], pad: int | None) -> ModelConfig:
    """`config` with these special-token ids (in a LLaVA's language config)."""
    family = FAMILIES[config.family]
    lm = dataclasses.replace(family.text_config(config), bos_token_id=bos, eos_token_ids=tuple(eos), pad_token_id=pad)
    return family.with_text_config(config, lm)


def complete_token_ids(config: ModelConfig, tokenizer_dir: str | os.PathLike[str]) -> ModelConfig:
    """`config`, or where it names no eos id, with the ids of the tokenizer in `tokenizer_dir` (when there is one):
    its bos and pad where the config has none, and as eos its eos token plus the end-of-turn token of its chat
    template (<|im_end|>, <|eot_id|>: where a chat model's answer ends)."""
    lm = language_config(config)
    if lm.eos_token_ids or not any((Path(tokenizer_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return config
    from zoo.io.tokenizer import Tokenizer  # jinja2 and tokenizers: only where a tokenizer is read

    tok = Tokenizer(tokenizer_dir)
    bos = lm.bos_token_id if lm.bos_token_id is not None else tok.bos_id
    pad = lm.pad_token_id if lm.pad_token_id is not None else tok.pad_id
    return with_token_ids(config, bos, tok.stop_ids(), pad)


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """A family config (a dataclass) as the plain dict zoo checkpoints store under "config"."""
    return dataclasses.asdict(config)


def config_from_dict(family: Family, d: dict[str, Any]) -> ModelConfig:
    """Inverse of config_to_dict for a config of `family`."""
    return family.config_cls(**d)


def hf_plan(family: Family, config: ModelConfig, zoo_names: list[str], checkpoint_names: list[str]) -> Plan:
    """family.plan_from_hf, with each source name spelled the way this checkpoint spells it.

    One architecture can reach us in several spellings (LLaVA: the hub's `vision_tower.vision_model.*`,
    transformers 5's `vision_tower.*`, the original repository's `model.mm_projector.*`). A family that knows
    such variants lists them in `family.hf_spellings(name)`; the first candidate the checkpoint holds is used.
    """
    plan = family.plan_from_hf(config, zoo_names)
    have = set(checkpoint_names)

    def spelled(name: str) -> str:
        return next((c for c in family.hf_spellings(name) if c in have), name)

    return {target: (tuple(spelled(s) for s in sources), combine) for target, (sources, combine) in plan.items()}


def plan_for(family: Family, config: ModelConfig, fmt: Format, model: nn.Module, checkpoint_names: list[str]) -> Plan:
    """{zoo name: (source names in the checkpoint, combine)} for loading a checkpoint of format `fmt`."""
    names = list(model.state_dict().keys())
    if fmt == "hf":
        return hf_plan(family, config, names, checkpoint_names)
    return {n: ((n,), None) for n in names}


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
            parts.append(f"missing tensors: {_some(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_some(unexpected)}")
        raise ZooError(f"{reader.path}: checkpoint does not match the model; " + "; ".join(parts))
    for target, (sources, combine) in plan.items():
        tensors = [reader.get(s) for s in sources]
        try:
            t = combine(tensors) if combine is not None else tensors[0]
        except (RuntimeError, ValueError, IndexError) as e:  # a fused tensor of the wrong size cannot be split
            got = ", ".join(f"{s} {list(x.shape)}" for s, x in zip(sources, tensors))
            want = f"; {target} should be {list(shapes[target])}" if shapes is not None else ""
            raise ZooError(f"{reader.path}: cannot make {target} from {got}{want} ({str(e).splitlines()[0]})") from e
        if not t.is_floating_point():  # every weight of a zoo model is floating: an int header is damage
            raise ZooError(f"{reader.path}: tensor {sources[0]} has dtype {t.dtype}; a model weight must be a floating "
                           "point tensor (a damaged or hand-edited safetensors header?)")
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


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype, or its name: float32/bfloat16/float16 (also "torch.bfloat16") or fp32/bf16/fp16."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.removeprefix("torch.")]
    raise ZooError(f"dtype {dtype!r} is not one zoo loads weights in; use one of {', '.join(DTYPE_NAMES)} "
                   "(or torch.float32 / torch.bfloat16 / torch.float16)")


def _not_found(name: str) -> ZooError:
    """A name that is neither a directory nor a preset: a Hugging Face hub id says which preset and how to get the
    weights (zoo reads local files only)."""
    from zoo.models.presets import PRESETS

    hub = [n for n, p in PRESETS.items() if p.hf_source and p.hf_source.lower() == name.lower()]
    how = (f"download it (huggingface-cli download {name} --local-dir DIR) and pass DIR" if name.count("/") == 1
           else "pass a checkpoint directory")
    if hub:
        return ZooError(f"{name!r} is a Hugging Face hub id, not a directory: did you mean preset {hub[0]!r}? "
                        f"zoo reads local files only: {how} (zoo.load(DIR), or zoo.load({hub[0]!r}, "
                        "checkpoint=DIR) to check it is that model)")
    return ZooError(f"{name!r} is neither a checkpoint directory nor a preset name (python -m zoo presets lists "
                    f"them); if it is a Hugging Face hub id, zoo reads local files only: {how}")


def load(
    name_or_dir: str | os.PathLike[str],
    attn: str | AttentionFn = "auto",
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    checkpoint: str | os.PathLike[str] | None = None,
) -> Model:
    """Build a model from a preset name or a checkpoint directory (zoo or Hugging Face layout).

    The model is built on the meta device; weights are then streamed from memory-mapped safetensors straight into
    place (cast to `dtype` on the way: a torch dtype or its name, "bfloat16" or "bf16"), so peak memory stays near
    one copy of the weights. A preset without `checkpoint` gets random weights (or none at all on device="meta").
    """
    from zoo.models.presets import PRESETS, get_preset

    dtype = as_dtype(dtype)
    device = torch.device(device)
    weights: tuple[Path, Format] | None = None  # where to read the weights from, and its layout
    if os.path.isdir(name_or_dir):
        family, config, fmt = read_config(name_or_dir)
        weights = Path(name_or_dir), fmt
    else:
        name = str(name_or_dir)
        if name not in PRESETS and ("/" in name or os.sep in name or name.startswith(".")):
            raise _not_found(name)
        preset = get_preset(name)
        family, config = FAMILIES[preset.family], preset.config
        if checkpoint is not None:
            ck_family, ck_config, fmt = read_config(checkpoint)
            if ck_family.name != family.name or ck_config != config:
                diff = _config_diff(config, ck_config) if ck_family.name == family.name else "family"
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
    reader = SafetensorsDir(weights_dir)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    ignore = family.hf_tied(config) if fmt == "hf" else frozenset()
    for name, t in stream(reader, plan_for(family, config, fmt, model, reader.names()), shapes, ignore):
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        _assign(model, name, t.to(device))
    return model


def _config_diff(a: ModelConfig, b: ModelConfig) -> str:
    da, db = config_to_dict(a), config_to_dict(b)
    return ", ".join(f"{k}: {da[k]!r} vs {db.get(k)!r}" for k in da if da[k] != db.get(k)) or "nothing"


# ---- writing ----


@contextlib.contextmanager
def atomic_dir(dst: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """A temporary directory beside `dst`, renamed to `dst` only when the block succeeds."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not force:
        raise ZooError(f"{dst} exists and is not empty; pass --force (force=True) to replace it")
    if dst.parent.exists() and not dst.parent.is_dir():
        raise ZooError(f"cannot write {dst}: its parent {dst.parent} is a file, not a directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{os.getpid()}-", dir=dst.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; the result should look like any directory made here
    try:
        yield tmp
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temporaries(dst: Path) -> None:
    """Temporary directories an earlier write of `dst` left when it was killed (named after its process, which
    is gone): removed, and said so. Another live process's are left alone."""
    for stale in dst.parent.glob(f".{glob_escape(dst.name)}.tmp-*-*"):
        pid = stale.name[len(dst.name) + 6:].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)) or not stale.is_dir():
            continue
        print(f"removing {stale}: left by an earlier write of {dst.name} that was killed", file=sys.stderr)
        shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes`, then an index (HF naming)."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_SHARD_BYTES,
                 metadata: dict[str, str] | None = None) -> None:
        self.dir, self.max_bytes, self.metadata = directory, max_bytes, metadata or {"format": "pt"}
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: Tensor) -> None:
        """Queue one tensor (copied to CPU); a full shard is written out first."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().contiguous().cpu()
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        save_safetensors(self.pending, str(self.dir / f"shard-{len(self.shards):05d}.tmp"), metadata=self.metadata)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Write the last shard and name the files: model.safetensors alone, or numbered shards and an index."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.dir / "shard-00000.tmp", self.dir / SINGLE_FILE)
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f"shard-{i:05d}.tmp", self.dir / fname)
            weight_map.update({name: fname for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save_safetensors(tensors: dict[str, Tensor], path: str | os.PathLike[str],
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, the file then given the mode any file written here gets (0644 under umask 022):
    safetensors 0.8 writes through a temporary file of its own, which leaves it 0600, unreadable to the group
    and others who can read config.json beside it."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def copy_tokenizer_files(src: str | os.PathLike[str], dst: Path) -> list[str]:
    """Copy the tokenizer and processor files of `src` that exist into `dst`; returns their names."""
    copied = []
    for fname in TOKENIZER_FILES:
        # regular files inside src only: a tokenizer.json linked to /etc/passwd is refused, not copied
        path = optional(Path(src), fname, "tokenizer file")
        if path is not None:
            shutil.copyfile(path, dst / fname)
            copied.append(fname)
    return copied


def zoo_config_json(family: Family, config: ModelConfig) -> dict[str, Any]:
    """The config.json of a zoo checkpoint."""
    return {"format": "zoo", "family": family.name, "config": config_to_dict(config)}


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """state_dict with sharded (DTensor) parameters gathered into plain tensors."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def save(model: Model, out: str | os.PathLike[str], *, force: bool = False,
         tokenizer_from: str | os.PathLike[str] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a zoo checkpoint: config.json + sharded safetensors (+ tokenizer files), atomically. Where the model's
    config names no eos id, config.json takes the special-token ids of the tokenizer (`complete_token_ids`)."""
    family = FAMILIES[model.family]
    config = complete_token_ids(model.config, tokenizer_from) if tokenizer_from else model.config
    with atomic_dir(out, force=force) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for name, t in full_state_dict(model).items():
            writer.add(name, t)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(zoo_config_json(family, config), indent=2) + "\n")
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, tmp)
    return Path(out)
