"""JSONL input: the files of --data, and each line as a checked JSON object (a bad line names its file and line)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zoo.errors import ZooError

JSONObject = dict[str, Any]  # one line of JSONL data


def list_files(data: str | Path, suffixes: tuple[str, ...] = (".jsonl",)) -> list[Path]:
    """A file, or every *.jsonl under a directory (sorted, so the order is the same on every machine)."""
    p = Path(data)
    if p.is_file():
        return [p]
    if p.is_dir():
        root = p.resolve()
        files = sorted(f for f in p.rglob("*") if f.suffix in suffixes and (f.is_file() or f.is_symlink()))
        for f in files:  # the directory the user named, and nothing a link inside it points to elsewhere
            if not f.resolve().is_relative_to(root) or not f.is_file():
                raise ZooError(f"{f}: resolves to {f.resolve()}, which is not a regular file inside {root}")
        if not files:
            raise ZooError(f"no {'/'.join(suffixes)} files under {p}")
        return files
    raise ZooError(f"data {p} does not exist: expected a {'/'.join(suffixes)} file or a directory of them")


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a UTF-16 pair, not a character


def check_line(f: Path, n: int, raw: bytes) -> JSONObject | None:
    """The JSON object on line `n` of `f` (None for a blank line); a malformed line is an error naming both."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ZooError(f"{f}:{n}:{e.start + 1}: not UTF-8 (byte {raw[e.start]:#04x}); JSONL data must be "
                       "UTF-8 text") from e
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ZooError(f"{f}:{n}:{e.colno}: malformed JSON line ({e.msg} at column {e.colno}); "
                       "each line must be one JSON object") from e
    except RecursionError as e:
        raise ZooError(f"{f}:{n}: JSON nested too deeply") from e
    if not isinstance(obj, dict):
        raise ZooError(f"{f}:{n}: expected a JSON object per line, got {type(obj).__name__}")
    if SURROGATE_ESCAPE.search(line):
        try:  # an escaped lone surrogate decodes to a str no tokenizer can encode
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ZooError(f"{f}:{n}: a lone surrogate escape (\\u{ord(e.object[e.start]):04x}) is "
                           "not text") from e
    return obj


def read_jsonl(files: list[Path]) -> Iterator[tuple[Path, int, JSONObject]]:
    """(file, line number, object) for every non-blank line; a malformed line is an error naming both."""
    for f in files:
        with f.open("rb") as fh:
            for n, raw in enumerate(fh, 1):
                obj = check_line(f, n, raw)
                if obj is not None:
                    yield f, n, obj
