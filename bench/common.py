"""What the bench scripts share: peak memory of one step, read from the process's resident set."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def peak_rss_growth(step: Callable[[], None]) -> int:
    """Peak growth of the resident set while `step()` runs, sampled every millisecond (CPU has no allocator stats)."""
    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    step()
    done.set()
    t.join()
    return max(peak[0], rss_bytes()) - base


def time_alternating(steps: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    """Seconds per call of each step, after one warm-up each, run alternating so drift hits all alike."""
    for step in steps.values():  # warm-up: allocations, optimizer state
        step()
    times = {v: [] for v in steps}
    for _ in range(reps):
        for v, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[v].append(time.perf_counter() - t0)
    return times


def memory_in_fresh_processes(script: str, variants: list[str], args: list[str]) -> dict[str, int]:
    """Peak step memory of each variant, each measured by `script --memory-of VARIANT ARGS` in its own process
    (which prints {"peak": bytes} last)."""
    mem = {}
    for v in variants:
        out = subprocess.run([sys.executable, script, "--memory-of", v, *args],
                             capture_output=True, text=True, check=True).stdout
        mem[v] = json.loads(out.strip().splitlines()[-1])["peak"]
    return mem
