"""What the bench scripts share: timing (perf_counter on CPU, CUDA events on GPU), peak memory, document lengths."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from zoo.train.quant import import_torchao

try:  # transformers imports torchao where installed: imported first, it prints no load warnings
    import_torchao()
except ImportError:
    pass

if TYPE_CHECKING:
    from zoo.models.decoder import Decoder


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


def time_call(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds one call of `fn` takes: CUDA events around it on a CUDA device (GPU time of the stream, host
    launches included), time.perf_counter elsewhere."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_alternating(steps: Mapping[str, Callable[[], object]], reps: int, warmup: int = 1,
                     device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Seconds per call of each step, after `warmup` calls each, run alternating so drift hits all alike."""
    for step in steps.values():  # warm-up: allocations, optimizer state, compilation
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(reps):
        for v, step in steps.items():
            times[v].append(time_call(step, device))
    return times


def copy_bandwidth(device: torch.device | str, nbytes: int = 4 << 30) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (bytes read plus bytes written; median of 10 after 3
    warm-ups): the memory-bandwidth ceiling that decoding is held against."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []

    def copy() -> None:
        dst.copy_(src)

    for i in range(13):
        t = time_call(copy, device)
        if i >= 3:
            times.append(t)
    return 2 * nbytes / statistics.median(times)


def cuda_peak_growth(fn: Callable[[], object]) -> int:
    """Bytes the CUDA caching allocator held at its peak during `fn()` beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def lognormal_lengths(total: int, median: float, cap: int, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """Document lengths drawn log-normal (median `median`, log-sd `sigma`, at most `cap`) until they fill exactly
    `total` tokens, the last one cut to fit. Seeded: the same arguments give the same documents everywhere."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        n = int(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item()))
        lens.append(max(1, min(n, cap, left)))
        left -= lens[-1]
    return lens


def memory_in_fresh_processes(script: str, variants: list[str], args: list[str]) -> dict[str, int]:
    """Peak step memory of each variant, each measured by `script --memory-of VARIANT ARGS` in its own process
    (which prints {"peak": bytes} last)."""
    mem = {}
    for v in variants:
        out = subprocess.run([sys.executable, script, "--memory-of", v, *args],
                             capture_output=True, text=True, check=True).stdout
        mem[v] = json.loads(out.strip().splitlines()[-1])["peak"]
    return mem


def zoo_llama_sharing(hf_model, attn: str = "auto") -> Decoder:
    """A zoo Llama whose parameters ARE those of a transformers LlamaForCausalLM: the same tensors (and so the same
    .grad), no copy and no checkpoint on disk, so both sides of a comparison run bit-identical weights."""
    from zoo.models import llama

    cfg = llama.config_from_hf(hf_model.config.to_dict())
    with torch.device("meta"):
        model = llama.Llama(cfg, attn=attn)
    hf_params = dict(hf_model.named_parameters(remove_duplicate=False))
    for name, ((source,), convert) in llama.plan_from_hf(cfg, [n for n, _ in model.named_parameters()]).items():
        if convert is not None:  # a Llama checkpoint is a rename; anything else cannot be shared
            raise ValueError(f"{name} is converted from {source}, it cannot share its storage")
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, hf_params[source])
    return model
