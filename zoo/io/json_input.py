"""JSON the user hands zoo (a --tools file, --chat-template-kwargs, a line of SFT data), read within bounds: a file
that is not a regular file (a FIFO never ends, /dev/zero never stops) or is larger than its purpose needs is refused
before it is read, and so is JSON nested deeper than any schema or chat needs (Python's decoder would recurse into
a RecursionError, a chat template after it) or holding an integer longer than Python converts (a ValueError); and
template switches that name an argument render() takes itself."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from itertools import accumulate
from pathlib import Path
from typing import Any

from zoo.errors import ZooError
from zoo.io.chat import RESERVED

# Arrays and objects inside one another: a tool's JSON schema or a chat sample with tool calls nests a dozen deep;
# Python's decoder and jinja's tojson recurse once per level, and 1,000 levels are a RecursionError.
MAX_JSON_DEPTH = 100
STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (brackets inside it nest nothing)
NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON `text` nest (0: a scalar), counted without recursion."""
    brackets = NOT_BRACKET.sub("", STRING.sub("", text))
    if len(brackets) <= MAX_JSON_DEPTH:
        return len(brackets)  # an upper bound, and within the limit
    return max(accumulate(1 if c in "[{" else -1 for c in brackets))


def load_json_bounded(text: str, what: str) -> Any:
    """json.loads(text), nested at most MAX_JSON_DEPTH deep, its integers of at most sys.get_int_max_str_digits()
    digits; either refused in one line naming `what`. Malformed JSON raises json.JSONDecodeError, for the caller to
    word (with its line and column)."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ZooError(f"{what}: expected JSON nested at most {MAX_JSON_DEPTH} deep, got {depth} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # int("9" * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        raise ZooError(f"{what}: expected integers of at most {sys.get_int_max_str_digits()} digits, got a longer "
                       "one") from e
    except RecursionError as e:  # not reached within MAX_JSON_DEPTH; kept so that no traceback can come of it
        raise ZooError(f"{what}: JSON nested too deeply") from e


def read_bounded(path: Path, what: str, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them: a FIFO, a device (/dev/zero) or a directory is
    refused before it is opened, a larger file without reading it (and one grown since, after `limit` + 1 bytes)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ZooError(f"{what} {path}: cannot be read ({e.strerror or e})") from e
    if not stat.S_ISREG(st.st_mode):
        raise ZooError(f"{what} {path}: expected a regular file, got {_kind(st.st_mode)} (which may never end)")
    if st.st_size > limit:
        raise ZooError(f"{what} {path}: expected a file of at most {limit:,} bytes, got {st.st_size:,}")
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise ZooError(f"{what} {path}: cannot be read ({e.strerror or e})") from e
    if len(data) > limit:
        raise ZooError(f"{what} {path}: expected a file of at most {limit:,} bytes, got a longer one")
    return data


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


# what render() and encode_chat() take by name: a template switch of one of these names would be a TypeError
ARGUMENTS = ("messages", "template", "tok", "add_generation_prompt", "tools", "image")


def check_switches(switches: dict[str, Any], what: str) -> None:
    """Template switches (--chat-template-kwargs, a sample's chat_template_kwargs) naming none of what render() and
    encode_chat() take themselves or give a template; one that does is refused naming it."""
    clash = sorted(k for k in switches if k in RESERVED or k in ARGUMENTS)
    if clash:
        raise ZooError(f"{what}: expected template switches such as enable_thinking, got {clash[0]!r}, which zoo "
                       "sets itself")
