"""The one exception zoo raises for bad input: its message says what was expected, what came, what to do; and the
argument parser of zoo's command lines, which turns bad flags into it."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn


class ZooError(ValueError):
    """Bad input to zoo (unknown name, wrong shape, corrupt or unsupported checkpoint)."""


def did_you_mean(given: str, known: Iterable[str]) -> str:
    """"; did you mean X?" with the known name closest to `given`, or "" when none is close."""
    close = difflib.get_close_matches(given, list(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse as every zoo command line uses it: no abbreviations (`--step 3` is an unknown flag, not `--steps 3`),
    and a bad command line is a one-line ZooError naming the closest flag (`unknown flag --step; did you mean
    --steps?`), which the CLIs print as `error: ...` with exit code 2, instead of the whole usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        for arg in args:  # before argparse's own checks: `--tokeniser x` is a typo, not a missing --tokenizer
            name = arg.split("=", 1)[0]
            if arg == "--":
                break
            if name.startswith("--") and name not in self._option_string_actions:
                flags = [f for f in self._option_string_actions if f.startswith("--")]
                raise ZooError(f"unknown flag {name}{did_you_mean(name, flags) or ' (see --help)'}")
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # a positional argument too many, or a short flag no option has
            what = "unknown flag" if extra[0].startswith("-") else "unexpected argument"
            raise ZooError(f"{what} {extra[0]} (see --help)")
        return parsed

    def error(self, message: str) -> NoReturn:
        raise ZooError(message)
