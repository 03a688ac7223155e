"""Writing a directory atomically: into a temporary directory beside it, renamed when complete, with the modes any
directory and file written here get. A killed write leaves only its temporary directory, which the next write of
the same destination removes."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from glob import escape as glob_escape
from pathlib import Path

from zoo.errors import ZooError


@contextlib.contextmanager
def atomic_dir(dst: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """A temporary directory beside `dst`, renamed to `dst` only when the block succeeds."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():  # --force replaces a directory; a file (or /dev/null) is no output of ours
        raise ZooError(f"{dst} exists and is not a directory: expected a new or earlier output directory, not a "
                       f"{'file' if dst.is_file() else 'special file'}; write elsewhere")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ZooError(f"{dst} exists and is not empty; pass --force (force=True) to replace it")
    if dst.parent.exists() and not dst.parent.is_dir():
        raise ZooError(f"cannot write {dst}: its parent {dst.parent} is a file, not a directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{os.getpid()}-", dir=dst.parent))
    tmp.chmod(0o777 & ~umask())  # mkdtemp makes it 0700; the result should look like any directory made here
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
        if not pid.isdigit() or alive(int(pid)) or not stale.is_dir():
            continue
        print(f"removing {stale}: left by an earlier write of {dst.name} that was killed", file=sys.stderr)
        shutil.rmtree(stale, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether a process of that id runs on this machine (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
