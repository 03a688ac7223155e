"""How long building a preset on the meta device takes (no weights), in a fresh process per preset.

    python bench/bench_load.py [llama-3-8b llama-3-70b ...]
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import time
t0 = time.perf_counter()
import zoo
t1 = time.perf_counter()
zoo.load({name!r}, device="meta")
t2 = time.perf_counter()
zoo.load({name!r}, device="meta")
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def main() -> None:
    names = sys.argv[1:] or ["llama-3-8b", "llama-3.1-70b", "internlm2-20b", "openelm-3b", "llava-1.5-13b"]
    print(f"{'preset':<16} {'import zoo s':>13} {'first build s':>14} {'next build s':>13}")
    for name in names:
        out = subprocess.run([sys.executable, "-c", CODE.format(name=name)], capture_output=True, text=True,
                             check=True).stdout.split()
        imp, first, again = map(float, out)
        print(f"{name:<16} {imp:>13.3f} {first:>14.3f} {again:>13.3f}")


if __name__ == "__main__":
    main()
