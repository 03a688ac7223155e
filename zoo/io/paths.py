"""Files a checkpoint or tokenizer directory names: they stay inside it and are regular files."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from zoo.errors import ZooError


def inside(directory: Path, name: object, what: str = "file", where: str = "the checkpoint directory") -> Path:
    """`directory / name` when that is a regular file inside `directory`, else a ZooError: a checkpoint names its
    files (index shards, config, tokenizer), and none may reach outside it (`..`, an absolute name, a symlink out:
    only a Hugging Face cache snapshot's links into its own blobs are followed, `hub_blob`) or be anything but a
    regular file (a FIFO would block the reader forever, a device never ends). `where` names `directory` in the
    message (a dataset's "image folder")."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ZooError(f"{directory}: {what} {name!r} is not a plain file name inside {where}")
    path = directory / name
    real, root = path.resolve(), directory.resolve()
    if not real.is_relative_to(root) and not hub_blob(root, path, real):
        raise ZooError(f"{path}: {what} resolves to {real}, outside {where} {root}")
    if not path.exists():
        raise ZooError(f"{path}: {what} is missing")
    if not stat.S_ISREG(path.stat().st_mode):
        raise ZooError(f"{path}: {what} is not a regular file")
    return path


SHARED_BLOB = re.compile(r"[0-9a-f]{64}")  # huggingface_hub's cache-wide store: blobs/<hash[:2]>/<xet hash>


def hub_blob(root: Path, path: Path, real: Path) -> bool:
    """Whether `path`, in the checkpoint directory `root` (resolved), is a file of a Hugging Face cache snapshot as
    huggingface_hub links it: `root` is (inside) `models--ORG--NAME/snapshots/REV/`, `path` a symlink to
    `models--ORG--NAME/blobs/ETAG`, and that a regular file (`real`) or, in huggingface_hub's shared store (2.x: Xet
    files deduplicated across repositories), a symlink to `CACHE/blobs/HH/HASH` where `CACHE/blobs` holds the
    store's marker file. Nothing wider: a link into another repository's blobs, or anywhere else, stays refused."""
    snapshot = next((p for p in (root, *root.parents) if p.parent.name == "snapshots"
                     and p.parent.parent.name.startswith("models--")), None)
    if snapshot is None or not path.is_symlink() or not path.parent.resolve().is_relative_to(root):
        return False
    repo = snapshot.parent.parent
    blob = Path(os.path.normpath(path.parent.resolve() / os.readlink(path)))
    if blob.parent != repo / "blobs":
        return False
    if real == blob:  # the repository's own blob, no further link
        return True
    store = repo.parent / "blobs"
    target = Path(os.path.normpath(blob.parent / os.readlink(blob))) if blob.is_symlink() else None
    return (target == real and real.parent.parent == store and SHARED_BLOB.fullmatch(real.name) is not None
            and real.parent.name == real.name[:2] and (store / ".huggingface-shared-blobs").is_file())


def optional(directory: Path, name: str, what: str = "file") -> Path | None:
    """`inside(directory, name)` when something by that name is there (a dangling symlink counts), else None."""
    path = directory / name
    return inside(directory, name, what) if path.exists() or path.is_symlink() else None


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (a file `inside` its directory was checked to be), else a one-line ZooError."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ZooError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(data, dict):
        raise ZooError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
