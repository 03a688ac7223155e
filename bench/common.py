"""What the bench scripts share: peak memory of one step, read from the process's resident set."""

from __future__ import annotations

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
