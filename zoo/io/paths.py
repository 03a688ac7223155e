"""Files a checkpoint or tokenizer directory names: they stay inside it and are regular files."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from zoo.errors import ZooError


def inside(directory: Path, name: object, what: str = "file", where: str = "the checkpoint directory") -> Path:
    """`directory / name` when that is a regular file inside `directory`, else a ZooError: a checkpoint names its
    files (index shards, config, tokenizer), and none may reach outside it (`..`, an absolute name, a symlink out)
    or be anything but a regular file (a FIFO would block the reader forever, a device never ends). `where` names
    `directory` in the message (a dataset's "image folder")."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ZooError(f"{directory}: {what} {name!r} is not a plain file name inside {where}")
    path = directory / name
    real, root = path.resolve(), directory.resolve()
    if not real.is_relative_to(root):
        raise ZooError(f"{path}: {what} resolves to {real}, outside {where} {root}")
    if not path.exists():
        raise ZooError(f"{path}: {what} is missing")
    if not stat.S_ISREG(path.stat().st_mode):
        raise ZooError(f"{path}: {what} is not a regular file")
    return path


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
