"""python -m zoo presets: the presets zoo knows (name, family, parameters, Hugging Face source).

Text generation is `python -m zoo.generate`. Bad input is one line on stderr (`error: ...`) and exit code 2.
"""

from __future__ import annotations

import os
import sys

from zoo.errors import did_you_mean
from zoo.models.presets import list_presets


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if argv != ["presets"]:
        hint = did_you_mean(argv[0], ["presets"]) if argv else ""
        print(f"error: expected `python -m zoo presets`, got {' '.join(argv) or 'no command'}{hint} (text generation: "
              "python -m zoo.generate)", file=sys.stderr)
        return 2
    rows = [(p["name"], p["family"], _params(p["params"]), p["hf_source"] or "-") for p in list_presets()]
    widths = [max(len(r[i]) for r in [("name", "family", "params", "source"), *rows]) for i in range(3)]
    for r in [("name", "family", "params", "Hugging Face source"), *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m zoo presets | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
