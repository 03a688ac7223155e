"""Safetensors checkpoints on disk, read and written as transformers does: sharded with a
`model.safetensors.index.json`, or in one `model.safetensors`. Reading is lazy (memory-mapped, one tensor at a
time); writing fills shards of a bounded size, then names them and writes the index. Pickle checkpoints (`*.bin`,
`*.pt`) are refused: unpickling runs code.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Protocol

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from zoo.errors import ZooError
from zoo.io.atomic import umask
from zoo.io.paths import inside, json_object, optional

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEFAULT_SHARD_BYTES = 2 << 30
SINGLE_FILE = "model.safetensors"  # an unsharded checkpoint's weights (transformers' SAFE_WEIGHTS_NAME)
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's {tensor: shard} map


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
            weight_map = json_object(index_file).get("weight_map")  # one line for bad JSON, nesting 200,000 deep too
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
                raise ZooError(f"{index}: expected a 'weight_map' object mapping tensor names to shard file names, "
                               f"got {type(weight_map).__name__ if weight_map is not None else 'none'}")
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
                raise ZooError(f"{index} lists tensors its shards do not hold: {some_names(absent)}")
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


def some_names(names: list[str], k: int = 12) -> str:
    """The first `k` names, and how many there are in all (for error messages)."""
    return ", ".join(names[:k]) + (f" ... ({len(names)} in all)" if len(names) > k else "")


# ---- writing ----


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
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:  # not an OSError: a full disk would escape every `except OSError` as a traceback
        raise as_os_error(e, path) from e
    os.chmod(path, 0o666 & ~umask())


def as_os_error(e: Exception, path: str | os.PathLike[str]) -> OSError:
    """safetensors' SafetensorError as the OSError it wraps: "IoError(Os { code: 28, ... })" as ENOSPC."""
    code = re.search(r"\bcode: (\d+)", str(e))
    if code is None:
        return OSError(f"cannot write {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return OSError(int(code[1]), os.strerror(int(code[1])), str(path))
