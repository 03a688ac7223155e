"""JSONL input: the files of --data, and each line as a checked JSON object (a bad line names its file and line)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from zoo.errors import ZooError
from zoo.io.json_input import load_json_bounded

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
    what = "is not a regular file (a FIFO or device never ends)" if p.exists() else "does not exist"
    raise ZooError(f"data {p} {what}: expected a {'/'.join(suffixes)} file or a directory of them")


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a UTF-16 pair, not a character
BOM = b"\xef\xbb\xbf"  # what some editors write before a UTF-8 file's first line

# The longest line (one document, one sample) read, in bytes: a longer one is refused, found by reading at most this
# much of it. tokenizers holds about 170 bytes per token of a text it encodes (ids, offsets, strings), so 16 MiB of
# text already takes ~3 GB; a whole novel is ~1 MB.
MAX_LINE_BYTES = 16 << 20


def read_line(fh: IO[bytes], f: Path, n: int) -> bytes:
    """Line `n` of `f`, the next in `fh` (b"" at the end); one longer than MAX_LINE_BYTES is an error naming both,
    raised after reading no more than the limit of it."""
    raw = fh.readline(MAX_LINE_BYTES + 1)
    if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
        raise ZooError(f"{f}:{n}: expected a line (one document) of at most {MAX_LINE_BYTES:,} bytes, got a longer "
                       "one; split the document into several lines")
    return raw


def check_line(f: Path, n: int, raw: bytes) -> JSONObject | None:
    """The JSON object on line `n` of `f` (None for a blank line); a malformed line is an error naming both."""
    bom = n == 1 and raw.startswith(BOM)
    try:
        line = raw.decode("utf-8")[bom:]
    except UnicodeDecodeError as e:
        raise ZooError(f"{f}:{n}:{e.start + 1}: not UTF-8 (byte {raw[e.start]:#04x}); JSONL data must be "
                       "UTF-8 text") from e
    if not line.strip():
        return None
    try:
        obj = load_json_bounded(line, f"{f}:{n}")  # deep nesting and long integers refused in one line
    except json.JSONDecodeError as e:
        what = e.msg.removesuffix(" at")  # "Invalid control character at": name the character instead
        if what == "Invalid control character" and e.pos < len(line):
            what = f"unescaped control character {line[e.pos]!r} in a string"
        col = e.pos + 1 + bom  # the file's column, the BOM counted (e.colno restarts after the line's newline)
        raise ZooError(f"{f}:{n}:{col}: malformed JSON line ({what} at column {col}); "
                       "each line must be one JSON object") from e
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
            n = 1
            while raw := read_line(fh, f, n):
                obj = check_line(f, n, raw)
                if obj is not None:
                    yield f, n, obj
                n += 1
