"""zoo on one GPU: correctness against an fp64 reference first, then time against transformers and fused kernels.

Sections (`--only a,b`; env always runs first):
  env      device, torch/CUDA/transformers/triton versions, which kernels import, the bf16 matmul peak (an 8192^3
           matmul, median of CUDA-event timings) that MFU is measured against, and the device-to-device copy
           bandwidth (4 GiB, bytes read + written) that decoding is held against
  correct  a small GQA Llama with random fp64 weights: zoo fp64 is the reference; zoo bf16 (every backend that
           trains here) and transformers bf16 (packed through position_ids, sdpa) against it: relative error of the
           logits, the loss and all gradients; transformers fp64 must agree with the reference (else its packing
           is not document-isolated); a zoo row more than 25% worse than transformers is flagged
  loss     output head + cross-entropy forward+backward, h [T, D] and W [V, D] bf16: zoo.core.loss.linear_cross_entropy
           (its default: on CUDA each chunk's softmax gradient from zoo's Triton kernel; also from eager ops, and
           from those torch.compile'd: zoo.core.loss.TRITON_SOFTMAX, COMPILED_SOFTMAX),
           F.cross_entropy(F.linear(h, w).float(), y) eager and compiled, Liger and Cut Cross-Entropy when they
           import; ms, extra peak memory (above the inputs; the gradients of h and W included), errors of the loss
           and of both gradients against a chunked fp32 reference
  step     forward+backward of the loss, a Llama-3-8B-shaped stack (16 layers by default) on one packed batch
           (8192 tokens, 12 log-normal documents): zoo with each training backend vs transformers packed (sdpa,
           position_ids), the same weights (shared tensors) and documents, alternating; tokens/s, TFLOP/s
           (zoo.train.flops.step_flops: model FLOPs), MFU against the measured peak, peak memory; `--compile` adds zoo
           with every block torch.compile'd
  compiled the step section's model and pack with every zoo block torch.compile'd, transformers again beside it
           (what `step --compile` adds, as a section of its own; not in the default list)
  long     4 layers of that shape on 32768 tokens (median ~2000, longest 8192): zoo packed vs transformers one
           document at a time; then a 131072-token pack, zoo only, with activation checkpointing: fits or not
  lora     fine-tuning that Llama-3-8B-shaped stack (16 layers, 8192 tokens) with LoRA (r=16, every linear
           layer of the blocks, fp32 adapters under bf16 autocast): zoo with a bf16 base, transformers + PEFT on
           the same weights (if peft imports), then zoo QLoRA (the block linears in 4-bit NF4 through torchao, if
           it imports) on a freshly built model; weights GiB (all parameters on the device), ms, tokens/s, peak
           GiB above the weights; TFLOP/s counts 4 x matmul params x tokens (no weight gradients) + attention
  attn     the attention kernels alone, fwd+bwd, GQA 32/8 heads of 128, on 8K short and 32K long documents: each
           zoo backend that trains here, TFLOP/s (causal pairs only) and output error against fp32
  attnlen  the varlen kernel against sdpa (cuDNN) on 32K-token packs whose longest document is 2K..16K tokens, and
           what `auto` picks for each (zoo.core.attention.SDPA_LONGEST_DOC): where they cross (not in the default list)
  fp8      fp8 training (zoo.train.fp8, torchao float8: tensorwise and rowwise scaling) against bf16, the step's layer
           shape with 8 layers, one 8192-token pack of learnable documents, 50 AdamW steps each from the same
           weights, blocks compiled: ms, MFU, peak memory, speedup (goal >= 1.25x), the loss curve and whether its
           tail is within the bf16 run's spread; where fp8 cannot run, its one-line refusal (on CPU: the refusal,
           then the path with torchao's emulated fp8 products; not in the default list)
  loss also reports its targets: ms over Liger's, extra memory over Cut Cross-Entropy's, errors over Liger's, and
           the time of the three GEMMs (h W^T, G W, G^T h) it sits above
Each section catches its own failures (out of memory is reported as such, as a result) and the run goes on; the JSON
(--out) is rewritten after every section, so a run cut short keeps what it measured. The exit status is 1 when a
section or variant failed other than by running out of memory.

    python bench/bench_gpu.py --out bench-gpu.json                 # everything, ~5-7 min on an H100 (estimate)
    python bench/bench_gpu.py --only loss --size loss_tokens=8192  # one section, smaller
    python bench/bench_gpu.py --smoke                              # tiny shapes: every path in seconds (CPU too)
Liger and Cut Cross-Entropy are optional: put their wheels on PYTHONPATH (see ../shared/gpu/README.md).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import (  # noqa: E402
    copy_bandwidth,
    cuda_peak_growth,
    lognormal_lengths,
    time_alternating,
    time_call,
    zoo_llama_sharing,
)

import zoo  # noqa: E402
from zoo.core.attention import BACKENDS, pick_backend  # noqa: E402
from zoo.core.loss import linear_cross_entropy  # noqa: E402
from zoo.parallel.fsdp import apply_activation_checkpointing, apply_compile  # noqa: E402
from zoo.train.flops import attention_flops, matmul_peak, step_flops  # noqa: E402

GiB = 2**30


@dataclass
class Sizes:
    """Every shape and repetition count; `--size name=value` overrides one (lists comma-separated)."""

    peak_n: int = 8192
    copy_mib: int = 4096
    # correct: a small GQA Llama, documents of these lengths (a 1-token one included)
    c_layers: int = 4
    c_dim: int = 512
    c_heads: int = 8
    c_kv_heads: int = 2
    c_ffn: int = 1536
    c_vocab: int = 8000
    c_lens: tuple[int, ...] = (1, 517, 3, 1024, 250, 64, 189)
    # loss head
    loss_tokens: tuple[int, ...] = (8192, 32768)
    loss_dim: int = 4096
    loss_vocab: int = 128256
    loss_reps: int = 7
    # the Llama-3-8B layer shape of step and long
    dim: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    step_layers: int = 16
    step_tokens: int = 8192  # log-normal median 600, cap 8192, seed 0: 12 documents, the longest 2801
    step_median: int = 600
    step_cap: int = 8192
    step_reps: int = 10
    long_layers: int = 4
    long_tokens: int = 32768  # median 2000, cap 8192: 14 documents, the longest 8192
    long_median: int = 2000
    long_cap: int = 8192
    long_reps: int = 5
    huge_tokens: int = 131072
    huge_median: int = 8000
    huge_cap: int = 65536
    huge_reps: int = 3
    # attention kernels alone
    attn_heads: int = 32
    attn_kv_heads: int = 8
    attn_head_dim: int = 128
    attn_short: tuple[int, ...] = (8192, 600, 8192)  # tokens, median, cap
    attn_long: tuple[int, ...] = (32768, 2000, 8192)
    attn_reps: int = 10
    lora_rank: int = 16
    # fp8: the step's layer shape, this many layers, one pack of learnable documents, AdamW for this many steps
    fp8_layers: int = 8
    fp8_tokens: int = 8192
    fp8_steps: int = 50
    # attnlen: packs of this many tokens whose longest document is each of these, varlen against sdpa
    attnlen_tokens: int = 32768
    attnlen_longest: tuple[int, ...] = (2048, 4096, 8192, 16384)
    attnlen_reps: int = 5
    warmup: int = 1  # extra warm-up calls after the first (checked) one


SMOKE: dict[str, Any] = dict(
    peak_n=256, copy_mib=16, c_layers=2, c_dim=64, c_heads=8, c_kv_heads=2, c_ffn=96, c_vocab=300,
    c_lens=(1, 30, 5, 60, 32),
    loss_tokens=(64,), loss_dim=32, loss_vocab=512, loss_reps=2,
    dim=64, heads=4, kv_heads=2, ffn=96, vocab=300, step_layers=2, step_tokens=256, step_median=40, step_cap=128,
    step_reps=1, long_layers=2, long_tokens=384, long_median=60, long_cap=256, long_reps=1,
    huge_tokens=512, huge_median=60, huge_cap=256, huge_reps=1,
    attn_heads=4, attn_kv_heads=2, attn_head_dim=16, attn_short=(192, 30, 192), attn_long=(384, 100, 256),
    attn_reps=1, fp8_layers=2, fp8_tokens=256, fp8_steps=3, attnlen_tokens=512, attnlen_longest=(32, 64, 256),
    attnlen_reps=1, warmup=0,
)


def parse_sizes(overrides: list[str], smoke: bool) -> Sizes:
    sizes = Sizes(**(SMOKE if smoke else {}))
    kinds = {f.name: f.type for f in fields(Sizes)}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in kinds or not value:
            raise SystemExit(f"--size {item!r}: expected name=value with name one of {', '.join(kinds)}")
        parsed = tuple(int(v) for v in value.split(",")) if "tuple" in str(kinds[name]) else int(value)
        setattr(sizes, name, parsed)
    return sizes


@dataclass
class Run:
    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    compile: bool
    compile_backend: str
    out: Path | None
    results: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    peak_flops: float | None = None
    default_backend: str = "auto"  # what long and --compile run: auto, or sdpa where auto's pick cannot train

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def train_backends(self) -> list[str]:
        """zoo backends that run forward+backward here (flex cannot train on CPU, flash_varlen is CUDA-only)."""
        return ["flash_varlen", "sdpa", "flex"] if self.cuda else ["sdpa", "eager"]

    def label(self, backend: str) -> str:
        if backend == "auto":
            backend = pick_backend(self.device, self.dtype)
        return f"{backend} (= auto)" if backend == pick_backend(self.device, self.dtype) else backend

    def save(self) -> None:
        if self.out is not None:
            tmp = self.out.with_suffix(self.out.suffix + ".tmp")
            tmp.write_text(json.dumps(self.results, indent=1, default=str))
            os.replace(tmp, self.out)


# ---- helpers ----


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


R = TypeVar("R")


def attempt(run: Run, what: str, fn: Callable[[], R]) -> tuple[R | None, str | None]:
    """(fn(), None), or (None, error): out of memory is a result; any other error also counts as a failure."""
    try:
        return fn(), None
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0][:160]}"
    except Exception as e:  # a broken variant must not take the others down
        traceback.print_exc()
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        run.failures.append(f"{what}: {error}")
    free()
    print(f"  {what}: {error}", flush=True)
    return None, error


def scalar(fn: Callable[[], torch.Tensor]) -> float:
    """fn()'s one value (a loss), read back: on a GPU, where an asynchronous error surfaces."""
    return float(fn())


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref||, in the reference's precision."""
    return float((a.to(ref.dtype) - ref).norm() / ref.norm())


def table(rows: dict[str, dict], cols: list[tuple[str, str, str]]) -> None:
    """Print rows (name -> values) under (key, header, format) columns; a row with an error prints it instead."""
    width = max([len(n) for n in rows] + [8])
    print(f"  {'':<{width}}" + "".join(f" {h:>12}" for _, h, _ in cols))
    for name, row in rows.items():
        if row.get("error"):
            print(f"  {name:<{width}} {row['error']}")
            continue
        cells = []
        for key, _, fmt in cols:
            v = row.get(key)
            cells.append(f" {'-' if v is None else format(v, fmt) if fmt else str(v):>12}")
        print(f"  {name:<{width}}" + "".join(cells))


def module_version(name: str) -> str | None:
    """The version of an importable module (None when it does not import; its error is not needed here)."""
    try:
        module = importlib.import_module(name)
    except Exception:
        return None
    version = getattr(module, "__version__", None)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            version = "?"
    return str(version)


def hf_llama(run: Run, dtype: torch.dtype, layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int):
    """A random-weight transformers LlamaForCausalLM built on the device in `dtype` the way from_pretrained builds
    it (its RoPE buffers stay fp32), sdpa attention."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False)
    # RoPE theta left at its default: how it is spelled changed within transformers 5, and zoo reads it back
    # from this config either way (the speed does not depend on it)
    with torch.device(run.device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def hf_packed_inputs(packed: zoo.Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, labels) [1, T] for transformers: positions restart per document, and the first
    token of every later document is no target of the token before it (transformers shifts labels itself)."""
    labels = packed.input_ids.clone()
    labels[packed.cu_seqlens[1:-1].long()] = -100
    return packed.input_ids[None], packed.position_ids[None], labels[None]


def random_docs(lens: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def zoo_step(model, packed: zoo.Packed, backend: str) -> Callable[[], torch.Tensor]:
    def step():
        model.set_attention(backend)
        model.zero_grad(set_to_none=True)
        loss = model.loss(packed)
        loss.backward()
        return loss.detach()

    return step


def hf_packed_step(hf, packed: zoo.Packed) -> Callable[[], torch.Tensor]:
    ids, pos, labels = hf_packed_inputs(packed)

    def step():
        hf.zero_grad(set_to_none=True)
        # use_cache=False: with a cache transformers skips its packed-sequence detection and attends across documents
        loss = hf(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach()

    return step


def hf_per_doc_step(hf, docs: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    n_targets = sum(len(d) - 1 for d in docs)

    def step():
        hf.zero_grad(set_to_none=True)
        total = 0.0
        for d in docs:
            if len(d) > 1:
                loss = hf(input_ids=d[None], labels=d[None], use_cache=False).loss * ((len(d) - 1) / n_targets)
                loss.backward()
                total = total + loss.detach()
        return total

    return step


def measure_steps(run: Run, variants: dict[str, Callable[[], torch.Tensor]], reps: int, tokens: int, flops: int,
                  model) -> dict[str, dict]:
    """Check each variant once (its loss; compilation happens here), time the ones that ran alternating, then
    the peak memory of one more step each, from no gradients held (the variants share `model`'s parameters).
    Rows carry ms, tokens/s, TFLOP/s, MFU and peak GiB above the weights."""
    rows: dict[str, dict[str, Any]] = {}
    ok: dict[str, Callable[[], torch.Tensor]] = {}
    for name, step in variants.items():
        loss, error = attempt(run, name, partial(scalar, step))
        rows[name] = {"error": error} if error else {"loss": loss}
        if not error:
            ok[name] = step
    times, error = attempt(run, "timing", lambda: time_alternating(ok, reps, run.sizes.warmup, run.device))
    if times is None:
        return {**rows, "timing": {"error": error}}
    for name, t in times.items():
        s = statistics.median(t)
        row = rows[name]
        row.update(ms=s * 1e3, ms_min=min(t) * 1e3, ms_max=max(t) * 1e3, tokens_per_s=tokens / s,
                   tflops=flops / s / 1e12)
        if run.peak_flops:
            row["mfu"] = flops / s / run.peak_flops
        if run.cuda:
            model.zero_grad(set_to_none=True)
            peak, _ = attempt(run, f"{name} memory", partial(cuda_peak_growth, ok[name]))
            row["peak_gib"] = None if peak is None else peak / GiB
    return rows


STEP_COLS = [("ms", "ms", ".1f"), ("ms_min", "min", ".1f"), ("ms_max", "max", ".1f"),
             ("tokens_per_s", "tokens/s", ",.0f"), ("tflops", "TFLOP/s", ".1f"), ("mfu", "MFU", ".1%"),
             ("peak_gib", "peak GiB", ".2f"), ("loss", "loss", ".4f"), ("speedup", "vs HF", ".2f")]


def add_speedups(rows: dict[str, dict], baseline: str) -> None:
    base = rows.get(baseline, {}).get("ms")
    for row in rows.values():
        if base and row.get("ms"):
            row["speedup"] = base / row["ms"]


# ---- sections ----


def section_env(run: Run) -> dict:
    import transformers

    info = {
        "device": torch.cuda.get_device_name(run.device) if run.cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": module_version("triton"),
        "flash_attn": module_version("flash_attn"),  # zoo's flash_varlen calls it when it imports
        "liger_kernel": module_version("liger_kernel"),
        "cut_cross_entropy": module_version("cut_cross_entropy"),
        "memory_gib": torch.cuda.get_device_properties(run.device).total_memory / GiB if run.cuda else None,
        "auto_backend": pick_backend(run.device, run.dtype),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    info["flash_varlen_kernel"] = zoo.core.attention.describe(run.device, run.dtype)["flash_varlen"]
    info["gated_deltanet_kernel"] = zoo.core.deltanet.describe(run.device, run.dtype)
    error = probe_backend(run, info["auto_backend"])
    info["auto_trains"] = error or "yes"
    if error:
        run.default_backend = "sdpa"
        print(f"  zoo's auto backend ({info['auto_backend']}) cannot train here: {error}\n"
              f"  long and --compile run sdpa instead")
    n = run.sizes.peak_n
    run.peak_flops = matmul_peak(run.device, run.dtype, n)
    info["matmul_peak_tflops"] = run.peak_flops / 1e12
    info["matmul_peak_shape"] = f"{n}^3 {str(run.dtype).removeprefix('torch.')}"
    info["copy_tb_per_s"] = copy_bandwidth(run.device, run.sizes.copy_mib * 2**20) / 1e12
    info["copy_shape"] = f"{run.sizes.copy_mib} MiB device-to-device, bytes read + written"
    for k, v in info.items():
        print(f"  {k:<26} {v:.1f}" if isinstance(v, float) else f"  {k:<26} {v}")
    return info


def probe_backend(run: Run, backend: str) -> str | None:
    """None if `backend` runs forward and backward on a tiny GQA pack here, else the error."""
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in (5, 1, 10)]).to(run.device)
    q = torch.randn(16, 4, 64, device=run.device, dtype=run.dtype, requires_grad=True)
    k = torch.randn(16, 2, 64, device=run.device, dtype=run.dtype, requires_grad=True)
    v = torch.randn(16, 2, 64, device=run.device, dtype=run.dtype, requires_grad=True)
    try:
        BACKENDS[backend](q, k, v, packed).sum().backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class Outcome:
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def _outcome(loss: torch.Tensor, logits: torch.Tensor, hf) -> Outcome:
    # zoo models share their parameters with `hf`, so every gradient is read under its transformers name
    grads = {n: p.grad.double() for n, p in hf.named_parameters()}
    return Outcome(loss.detach().double(), logits.detach().double(), grads)


def reference_outcome(model, packed: zoo.Packed, hf) -> Outcome:
    """The model's fp64 logits and an fp64 cross-entropy on them (model.loss computes its head in fp32)."""
    model.zero_grad(set_to_none=True)
    logits, labels = model(packed), packed.labels
    if labels is None:
        raise ValueError("the reference loss needs a pack with labels")
    keep = labels != -100
    loss = F.cross_entropy(logits[keep], labels[keep])
    loss.backward()
    return _outcome(loss, logits, hf)


def zoo_outcome(model, packed: zoo.Packed, hf) -> Outcome:
    model.zero_grad(set_to_none=True)
    loss = model.loss(packed)
    loss.backward()
    with torch.no_grad():
        logits = model(packed)
    return _outcome(loss, logits, hf)


def hf_outcome(hf, packed: zoo.Packed) -> Outcome:
    ids, pos, labels = hf_packed_inputs(packed)
    hf.zero_grad(set_to_none=True)
    out = hf(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    out.loss.backward()
    return _outcome(out.loss, out.logits[0], hf)


def errors(got: Outcome, ref: Outcome) -> dict:
    num = math.sqrt(sum(float((got.grads[n] - r).norm()) ** 2 for n, r in ref.grads.items()))
    den = math.sqrt(sum(float(r.norm()) ** 2 for r in ref.grads.values()))
    worst = max(ref.grads, key=lambda n: rel(got.grads[n], ref.grads[n]))
    return {"logits": rel(got.logits, ref.logits), "loss": abs(float(got.loss - ref.loss)) / abs(float(ref.loss)),
            "grads": num / den, "worst_grad": rel(got.grads[worst], ref.grads[worst]), "worst_grad_name": worst}


def section_correct(run: Run) -> dict:
    s = run.sizes
    shape = dict(layers=s.c_layers, dim=s.c_dim, heads=s.c_heads, kv_heads=s.c_kv_heads, ffn=s.c_ffn, vocab=s.c_vocab)
    packed = zoo.pack(random_docs(list(s.c_lens), s.c_vocab)).to(run.device)
    print(f"  Llama {s.c_layers} layers, d={s.c_dim}, {s.c_heads}/{s.c_kv_heads} heads, vocab {s.c_vocab}; "
          f"{packed.num_docs} documents, {packed.num_tokens} tokens: {list(s.c_lens)}")
    hf64 = hf_llama(run, torch.float64, **shape)
    torch.manual_seed(0)
    with torch.no_grad():  # weights that make attention matter: unit-scale activations, random norm scales
        for name, p in hf64.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1)
            else:
                p.normal_(0, p.shape[1] ** -0.5)
    zoo64 = zoo_llama_sharing(hf64, attn="sdpa")
    ref = reference_outcome(zoo64, packed, hf64)
    rows = {"transformers fp64 packed": errors(hf_outcome(hf64, packed), ref)}
    hf16 = hf_llama(run, run.dtype, **shape)
    hf16.load_state_dict(hf64.state_dict())
    del zoo64, hf64
    zoo16 = zoo_llama_sharing(hf16)
    low = str(run.dtype).removeprefix("torch.")
    hf_name = f"transformers {low} packed sdpa"
    rows[hf_name] = errors(hf_outcome(hf16, packed), ref)
    backends = run.train_backends() + (["eager"] if run.cuda else [])
    for b in backends:
        zoo16.set_attention(b)
        got, error = attempt(run, f"zoo {b}", lambda: errors(zoo_outcome(zoo16, packed, hf16), ref))
        rows[f"zoo {low} {run.label(b)}"] = got if got else {"error": error}
    hf_row = rows[hf_name]
    for name, row in rows.items():
        if name.startswith("zoo") and "error" not in row:
            ratio = max(row["logits"] / hf_row["logits"], row["grads"] / hf_row["grads"])
            row["vs_hf"] = ratio
            row["flag"] = "WORSE than transformers" if ratio > 1.25 else ""
    rows["transformers fp64 packed"]["flag"] = (
        "" if rows["transformers fp64 packed"]["logits"] < 1e-6 else "DISAGREES with the fp64 reference")
    print("  relative error against zoo fp64 (sdpa; norm statistics and RoPE tables in fp32 as in transformers, "
          "fp64 cross-entropy on its logits);\n  loss: |loss - ref| / ref; grads: all parameters together")
    table(rows, [("logits", "logits", ".2e"), ("loss", "loss", ".2e"), ("grads", "grads", ".2e"),
                 ("worst_grad", "worst grad", ".2e"), ("vs_hf", "zoo/HF", ".2f"), ("flag", "flag", "")])
    return {"lens": list(s.c_lens), "rows": rows}


def ce_reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 4096):
    """Mean cross-entropy of h @ w^T against y, and its gradients for h and w, all in fp32 (IEEE, no TF32),
    a chunk of rows at a time."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        h32, w32 = h.detach().float(), w.detach().float()
        T = h32.shape[0]
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        grad_h, grad_w = torch.empty_like(h32), torch.zeros_like(w32)
        for s in range(0, T, chunk):
            logits = h32[s : s + chunk] @ w32.T
            y_c = y[s : s + chunk]
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y_c[:, None])[:, 0]).double().sum()
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(len(y_c), device=y.device), y_c] -= 1.0
            g /= T
            grad_h[s : s + chunk] = g @ w32
            grad_w.addmm_(g.T, h32[s : s + chunk])
        return float(total / T), grad_h, grad_w
    finally:
        torch.set_float32_matmul_precision(precision)


_compiled_naive: dict[str, Callable[..., torch.Tensor]] = {}


def loss_candidates(run: Run) -> tuple[dict[str, Callable], dict[str, str]]:
    """(name -> fn(h, w, y) returning the mean loss, name -> why it is missing)."""
    def naive(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y)

    if run.compile_backend not in _compiled_naive:
        _compiled_naive[run.compile_backend] = torch.compile(naive, backend=run.compile_backend)
    def zoo_compiled_softmax(h, w, y):  # zoo.core.loss with each chunk's softmax gradient compiled (off by default)
        import zoo.core.loss

        zoo.core.loss.COMPILED_SOFTMAX, zoo.core.loss.COMPILE_BACKEND = True, run.compile_backend
        zoo.core.loss.TRITON_SOFTMAX = False
        try:
            return linear_cross_entropy(h, w, y)
        finally:
            zoo.core.loss.COMPILED_SOFTMAX, zoo.core.loss.TRITON_SOFTMAX = False, None

    def zoo_eager_softmax(h, w, y):  # zoo.core.loss with each chunk's softmax gradient from eager ops
        import zoo.core.loss

        zoo.core.loss.TRITON_SOFTMAX = False
        try:
            return linear_cross_entropy(h, w, y)
        finally:
            zoo.core.loss.TRITON_SOFTMAX = None

    # "zoo" is the default: on CUDA each chunk's softmax gradient is zoo's Triton kernel (zoo.core.loss_kernel)
    cands = {"zoo": linear_cross_entropy, "zoo eager softmax": zoo_eager_softmax,
             "zoo compiled softmax": zoo_compiled_softmax, "naive": naive,
             "naive compiled": _compiled_naive[run.compile_backend]}
    missing = {}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        cands["liger"] = lambda h, w, y: liger(w, h, y)
    except Exception as e:
        missing["liger"] = f"not importable ({type(e).__name__}: {e})"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        cands["cut cross-entropy"] = cce
    except Exception as e:
        missing["cut cross-entropy"] = f"not importable ({type(e).__name__}: {e})"
    if not run.cuda:  # both are triton kernels
        for name in ("liger", "cut cross-entropy"):
            if cands.pop(name, None) is not None:
                missing[name] = "needs CUDA"
    return cands, missing


def loss_at(run: Run, T: int, cands: dict[str, Callable], missing: dict[str, str]) -> dict:
    s = run.sizes
    D, V = s.loss_dim, s.loss_vocab
    torch.manual_seed(0)
    h = (torch.randn(T, D, device=run.device, dtype=run.dtype) * 0.5).requires_grad_()
    w = (torch.randn(V, D, device=run.device, dtype=run.dtype) * 0.02).requires_grad_()
    y = torch.randint(0, V, (T,), device=run.device)
    ref_loss, ref_gh, ref_gw = ce_reference(h, w, y)
    rows: dict[str, dict] = {name: {"skipped": why} for name, why in missing.items()}

    for name, fn in cands.items():
        def once(fn=fn):
            h.grad = w.grad = None
            loss = fn(h, w, y)
            loss.backward()
            return loss.detach()

        def measure(once=once):
            for _ in range(1 + s.warmup):  # the first call compiles where there is compiling to do
                once()
            h.grad = w.grad = None
            peak = cuda_peak_growth(once) / GiB if run.cuda else None
            times = [time_call(once, run.device) for _ in range(s.loss_reps)]
            loss = float(once())
            return {"ms": median_ms(times), "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
                    "peak_gib": peak, "loss_err": abs(loss - ref_loss), "grad_h_err": rel(h.grad, ref_gh),
                    "grad_w_err": rel(w.grad, ref_gw)}

        row, error = attempt(run, f"loss {name} T={T}", measure)
        rows[name] = row if row else {"error": error}
        h.grad = w.grad = None
        free()
    print(f"  T={T}, D={D}, V={V}, {str(run.dtype).removeprefix('torch.')}; reference loss {ref_loss:.6f} (fp32)")
    table({k: v for k, v in rows.items() if "skipped" not in v},
          [("ms", "ms", ".2f"), ("ms_min", "min", ".2f"), ("ms_max", "max", ".2f"), ("peak_gib", "extra GiB", ".2f"),
           ("loss_err", "loss err", ".1e"), ("grad_h_err", "grad h err", ".1e"), ("grad_w_err", "grad W err", ".1e")])
    gemm_ms, _ = attempt(run, f"loss three GEMMs T={T}", partial(three_gemms_ms, run, h, w))
    targets = loss_targets(rows, gemm_ms)
    print("  targets: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in targets.items()))
    return {"ref_loss": ref_loss, "rows": rows, "targets": targets}


def three_gemms_ms(run: Run, h: torch.Tensor, w: torch.Tensor) -> float:
    """Median ms of the three products a loss head cannot avoid, in the inputs' dtype: logits h W^T [T, V], then
    grad h = G W and grad W = G^T h (the logits standing in for G): the floor of its time."""
    h, w = h.detach(), w.detach()

    def once():
        g = h @ w.T
        return (g @ w, g.T @ h)

    once()
    return median_ms([time_call(once, run.device) for _ in range(run.sizes.loss_reps)])


def loss_targets(rows: dict[str, dict], gemm_ms: float | None) -> dict[str, Any]:
    """zoo against the targets: faster than Liger (ms ratio < 1), at most 2x Cut Cross-Entropy's extra memory, loss
    and gradient errors no worse than Liger's; and what remains above the three GEMMs' time."""
    zoo_row, liger, cce = rows.get("zoo", {}), rows.get("liger", {}), rows.get("cut cross-entropy", {})
    out: dict[str, Any] = {"three_gemms_ms": gemm_ms}

    def ratio(a: dict, b: dict, key: str) -> float | None:
        return a[key] / b[key] if a.get(key) is not None and b.get(key) else None

    out["ms_vs_liger"] = ratio(zoo_row, liger, "ms")  # target < 1
    out["extra_memory_vs_cce"] = ratio(zoo_row, cce, "peak_gib")  # target <= 2
    for key in ("loss_err", "grad_h_err", "grad_w_err"):
        out[f"{key}_vs_liger"] = ratio(zoo_row, liger, key)  # target <= 1
    if gemm_ms is not None and zoo_row.get("ms"):
        out["zoo_ms_above_gemms"] = zoo_row["ms"] - gemm_ms
    errors = [out[f"{k}_vs_liger"] for k in ("loss_err", "grad_h_err", "grad_w_err")]
    # None where the baseline did not run here (Liger and Cut Cross-Entropy need CUDA and their wheels)
    out["met"] = {"faster_than_liger": None if out["ms_vs_liger"] is None else out["ms_vs_liger"] < 1,
                  "memory_within_2x_cce": None if out["extra_memory_vs_cce"] is None
                  else out["extra_memory_vs_cce"] <= 2,
                  "errors_within_liger": None if None in errors else all(e <= 1 for e in errors)}
    return out


def section_loss(run: Run) -> dict:
    cands, missing = loss_candidates(run)
    for name, why in missing.items():
        print(f"  {name}: skipped, {why}")
    out = {}
    for T in run.sizes.loss_tokens:
        row, error = attempt(run, f"loss T={T}", partial(loss_at, run, T, cands, missing))
        out[str(T)] = row if row else {"error": error}
        free()
    return out


def big_llama(run: Run, layers: int):
    s = run.sizes
    torch.manual_seed(0)
    hf = hf_llama(run, run.dtype, layers=layers, dim=s.dim, heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn,
                  vocab=s.vocab)
    return hf, zoo_llama_sharing(hf)


def describe(lens: list[int]) -> str:
    return (f"{len(lens)} documents, {sum(lens)} tokens, median {statistics.median(lens):.0f}, "
            f"longest {max(lens)}")


def step_setup(run: Run):
    """(transformers model, zoo model sharing its weights, lengths, pack, FLOPs) of the step section's shape."""
    s = run.sizes
    hf, model = big_llama(run, s.step_layers)
    lens = lognormal_lengths(s.step_tokens, s.step_median, s.step_cap, seed=0)
    packed = zoo.pack(random_docs(lens, s.vocab)).to(run.device)
    flops = step_flops(model, lens)
    print(f"  Llama {s.step_layers} layers x (d={s.dim}, {s.heads}/{s.kv_heads} heads, ffn {s.ffn}), vocab {s.vocab}; "
          f"{describe(lens)}; {flops / 1e12:.1f} TFLOP per step")
    return hf, model, lens, packed, flops


def section_step(run: Run) -> dict:
    s = run.sizes
    hf, model, lens, packed, flops = step_setup(run)
    variants = {f"zoo {run.label(b)}": zoo_step(model, packed, b) for b in run.train_backends()}
    hf_name = "transformers packed sdpa"
    variants[hf_name] = hf_packed_step(hf, packed)
    rows = measure_steps(run, variants, s.step_reps, len(packed.input_ids), flops, model)
    add_speedups(rows, hf_name)
    table(rows, STEP_COLS)
    out = {"lens": lens, "flops": flops, "rows": rows}
    if run.compile:
        out["compiled"] = compiled_rows(run, model, packed, flops, hf_name, variants[hf_name])
    return out


def compiled_rows(run: Run, model, packed: zoo.Packed, flops: int, hf_name: str,
                  hf_step: Callable[[], torch.Tensor]) -> dict[str, dict]:
    """zoo with every block torch.compile'd, transformers again as the baseline."""
    auto = run.default_backend
    print(f"  every block torch.compile'd (backend {run.compile_backend}); transformers again as the baseline")
    if run.compile_backend == "inductor":
        apply_compile(model)
    else:  # what apply_compile does, with another backend (the smoke run traces without inductor)
        for block in model.layers:
            block.compile(backend=run.compile_backend)
    rows = measure_steps(run, {f"zoo {run.label(auto)} compiled": zoo_step(model, packed, auto), hf_name: hf_step},
                         run.sizes.step_reps, len(packed.input_ids), flops, model)
    add_speedups(rows, hf_name)
    table(rows, STEP_COLS)
    return rows


def section_compiled(run: Run) -> dict:
    """The step section's shape with every zoo block compiled, against transformers (a section of its own, so that
    a GPU session can run it apart from the uncompiled step)."""
    hf, model, lens, packed, flops = step_setup(run)
    hf_name = "transformers packed sdpa"
    return {"lens": lens, "flops": flops,
            "rows": compiled_rows(run, model, packed, flops, hf_name, hf_packed_step(hf, packed))}


def lora_step(model, packed: zoo.Packed, backend: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A LoRA training step as the recipes run it on one GPU: fp32 adapters, the forward under bf16 autocast."""
    step = zoo_step(model, packed, backend)

    def autocast_step():
        with torch.autocast(packed.input_ids.device.type, dtype=dtype):
            return step()

    return autocast_step


def weights_gib(model) -> float:
    """Bytes of every parameter (an NF4 tensor counts its packed codes and scales)."""
    from zoo.train.quant import is_nf4

    total = 0
    for p in model.parameters():
        inner = [getattr(p, name) for name in p.__tensor_flatten__()[0]] if is_nf4(p) else [p]
        total += sum(t.numel() * t.element_size() for t in inner)
    return total / GiB


def section_lora(run: Run) -> dict:
    from zoo.train.lora import LoRAConfig, apply_lora

    s = run.sizes
    lens = lognormal_lengths(s.step_tokens, s.step_median, s.step_cap, seed=0)
    packed = zoo.pack(random_docs(lens, s.vocab)).to(run.device)
    cfg = LoRAConfig(rank=s.lora_rank, alpha=2 * s.lora_rank, targets=("all-linear",))
    hf, model = big_llama(run, s.step_layers)
    flops = step_flops(model, lens) * 4 // 6  # frozen weights: activation gradients only (attention is small here)
    print(f"  Llama {s.step_layers} layers x (d={s.dim}, {s.heads}/{s.kv_heads} heads, ffn {s.ffn}), vocab {s.vocab}; "
          f"{describe(lens)}; LoRA r={cfg.rank} on every block linear layer")
    apply_lora(model, cfg)
    variants = {"zoo LoRA, bf16 base": lora_step(model, packed, run.default_backend, run.dtype)}
    sizes = {"zoo LoRA, bf16 base": weights_gib(model)}
    peft_name = "transformers + PEFT LoRA packed sdpa"
    try:
        import peft

        hf = peft.get_peft_model(hf, peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules="all-linear"))
        plain = hf_packed_step(hf, packed)

        def peft_step():
            with torch.autocast(run.device.type, dtype=run.dtype):
                return plain()

        variants[peft_name] = peft_step
        sizes[peft_name] = weights_gib(hf)
    except ImportError as e:
        print(f"  no PEFT row: {e}")
    rows = measure_steps(run, variants, s.step_reps, len(packed.input_ids), flops, model)
    del hf, model, variants
    free()
    try:
        from zoo.core.layers import init_weights
        from zoo.train.quant import quantize_nf4

        torch.manual_seed(0)
        config = zoo.models.llama.LlamaConfig(dim=s.dim, n_layers=s.step_layers, n_heads=s.heads,
                                             n_kv_heads=s.kv_heads, ffn_dim=s.ffn, vocab_size=s.vocab)
        with torch.device("meta"):
            q = zoo.models.llama.Llama(config)
        q.to_empty(device=run.device)
        init_weights(q)
        q.to(run.dtype)
        apply_lora(q, cfg)
        done, total = quantize_nf4(q)
        print(f"  QLoRA: {done} of {total} block linear layers in NF4")
        name = "zoo QLoRA, NF4 base"
        rows |= measure_steps(run, {name: lora_step(q, packed, run.default_backend, run.dtype)}, s.step_reps,
                              len(packed.input_ids), flops, q)
        sizes[name] = weights_gib(q)
        del q
    except zoo.ZooError as e:
        print(f"  no QLoRA row: {e}")
    for name, gib in sizes.items():
        rows.setdefault(name, {})["weights_gib"] = gib
    add_speedups(rows, peft_name)
    table(rows, [("weights_gib", "weights GiB", ".2f"), *STEP_COLS])
    return {"lens": lens, "flops": flops, "rank": cfg.rank, "rows": rows}


def section_long(run: Run) -> dict:
    s = run.sizes
    hf, model = big_llama(run, s.long_layers)
    auto = run.default_backend
    lens = lognormal_lengths(s.long_tokens, s.long_median, s.long_cap, seed=0)
    docs = [d.to(run.device) for d in random_docs(lens, s.vocab)]
    packed = zoo.pack(docs)
    flops = step_flops(model, lens)
    print(f"  Llama {s.long_layers} layers of the step shape; {describe(lens)}; {flops / 1e12:.1f} TFLOP per step")
    hf_name = "transformers one document at a time"
    rows = measure_steps(run, {f"zoo {run.label(auto)} packed": zoo_step(model, packed, auto),
                               hf_name: hf_per_doc_step(hf, docs)}, s.long_reps, sum(lens), flops, model)
    add_speedups(rows, hf_name)
    table(rows, STEP_COLS)
    del docs, packed, hf
    free()

    lens_h = lognormal_lengths(s.huge_tokens, s.huge_median, s.huge_cap, seed=0)
    packed_h = zoo.pack(random_docs(lens_h, s.vocab)).to(run.device)
    flops_h = step_flops(model, lens_h)
    print(f"  zoo alone with activation checkpointing; {describe(lens_h)}; {flops_h / 1e12:.1f} TFLOP per step "
          "(model FLOPs: the recomputed forward is not counted)")
    apply_activation_checkpointing(model)
    rows_h = measure_steps(run, {f"zoo {run.label(auto)} + activation checkpointing": zoo_step(model, packed_h, auto)},
                           s.huge_reps, sum(lens_h), flops_h, model)
    table(rows_h, STEP_COLS)
    fits = all("error" not in r or not r["error"].startswith("out of memory") for r in rows_h.values())
    print(f"  {sum(lens_h)} tokens {'fit' if fits else 'do NOT fit'}")
    return {"lens": lens, "flops": flops, "rows": rows, "huge": {"lens": lens_h, "flops": flops_h, "rows": rows_h,
                                                                  "fits": fits}}


def attn_at(run: Run, T: int, median: int, cap: int) -> dict:
    s = run.sizes
    N, K, H = s.attn_heads, s.attn_kv_heads, s.attn_head_dim
    lens = lognormal_lengths(T, median, cap, seed=0)
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens]).to(run.device)
    torch.manual_seed(0)
    q = torch.randn(T, N, H, device=run.device, dtype=run.dtype, requires_grad=True)
    k = torch.randn(T, K, H, device=run.device, dtype=run.dtype, requires_grad=True)
    v = torch.randn(T, K, H, device=run.device, dtype=run.dtype, requires_grad=True)
    do = torch.randn(T, N, H, device=run.device, dtype=run.dtype)
    with torch.no_grad():
        ref = BACKENDS["sdpa"](q.float(), k.float(), v.float(), packed)
    flops = 3 * attention_flops(lens, N, H)
    print(f"  {describe(lens)}; {N}/{K} heads of {H}; {flops / 1e12:.2f} TFLOP fwd+bwd (causal pairs)")
    rows = {}
    for b in run.train_backends():
        fn = BACKENDS[b]

        def call(fn=fn):
            q.grad = k.grad = v.grad = None
            o = fn(q, k, v, packed)
            o.backward(do)
            return o.detach()

        def measure(call=call):
            err = rel(call(), ref)
            for _ in range(2 + s.warmup):
                call()
            times = [time_call(call, run.device) for _ in range(s.attn_reps)]
            t = statistics.median(times)
            return {"ms": t * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3, "tflops": flops / t / 1e12,
                    "out_err": err}

        row, error = attempt(run, f"attn {b} T={T}", measure)
        rows[run.label(b)] = row if row else {"error": error}
    table(rows, [("ms", "ms", ".2f"), ("ms_min", "min", ".2f"), ("ms_max", "max", ".2f"), ("tflops", "TFLOP/s", ".1f"),
                 ("out_err", "out err", ".1e")])
    return {"lens": lens, "flops": flops, "rows": rows}


def section_attn(run: Run) -> dict:
    out = {}
    for name, (T, median, cap) in (("short", run.sizes.attn_short), ("long", run.sizes.attn_long)):
        row, error = attempt(run, f"attn {name}", partial(attn_at, run, T, median, cap))
        out[name] = row if row else {"error": error}
        free()
    return out


def learnable_docs(lens: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Documents a model can learn within a few dozen steps: each a random phrase of 8-64 tokens repeated, so the
    loss falls (from ln V towards 0) and an fp8 run's curve can be held against bf16's."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lens:
        phrase = torch.randint(0, vocab, (int(torch.randint(8, 65, (1,), generator=g)),), generator=g)
        docs.append(phrase.repeat(-(-n // len(phrase)))[:n])
    return docs


def fp8_run(run: Run, state: dict[str, torch.Tensor], recipe: str | None, packed: zoo.Packed, flops: int,
            cfg) -> dict:
    """One training run from `state`: bf16 (recipe None) or fp8 with `recipe` (converted without the capability
    check where the run is --smoke on CPU: torchao emulates the fp8 products there), every block compiled; AdamW,
    `fp8_steps` steps on one pack. Losses per step, median ms of the steps after the first 3, MFU, peak memory."""
    from zoo.train.fp8 import convert_fp8

    s = run.sizes
    with torch.device("meta"):
        model = zoo.models.llama.Llama(cfg, attn=run.default_backend)
    model.to_empty(device=run.device)
    model.load_state_dict(state)
    converted = None
    if recipe is not None:
        converted = convert_fp8(model, recipe, run.device, run.dtype, check=run.cuda)
    if run.compile_backend == "inductor":
        apply_compile(model)
    else:
        for block in model.layers:
            block.compile(backend=run.compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, foreach=True)

    def step() -> torch.Tensor:
        loss = model.loss(packed)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses, times = [], []
    peak = None
    for i in range(s.fp8_steps):
        if run.cuda and i == 3:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loss_box: list[torch.Tensor] = []
        t = time_call(partial(lambda box: box.append(step()), loss_box), run.device)
        if run.cuda and i == 3:
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
        losses.append(float(loss_box[0]))
        if i >= 3 or s.fp8_steps <= 3:
            times.append(t)
    ms = median_ms(times)
    row: dict[str, Any] = {"ms": ms, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
                           "tokens_per_s": packed.num_tokens / (ms / 1e3), "tflops": flops / (ms / 1e3) / 1e12,
                           "peak_gib": peak, "losses": losses, "converted": converted}
    if run.peak_flops:
        row["mfu"] = flops / (ms / 1e3) / run.peak_flops
    return row  # the model and its optimizer go with this frame (section_fp8 frees the memory)


def section_fp8(run: Run) -> dict:
    """fp8 training (zoo.train.fp8: torchao float8, tensorwise and rowwise) against bf16 on the step shape with
    `fp8_layers` layers, every block compiled: step time, MFU (against the bf16 peak), memory, and the loss over
    `fp8_steps` AdamW steps from the same weights; where fp8 cannot run here, the one-line refusal."""
    from zoo.train.fp8 import RECIPES, fp8_problem

    s = run.sizes
    refusals = {r: fp8_problem(r, run.device, run.dtype) for r in RECIPES}
    for r, why in refusals.items():
        if why:
            print(f"  fp8 {r}: refused here: {why}")
    recipes = [r for r, why in refusals.items() if why is None or not run.cuda]  # CPU: emulated, the path runs
    if not run.cuda:
        print("  (CPU: the fp8 products run emulated, for the code path; the timings mean nothing)")
    cfg = zoo.models.llama.LlamaConfig(dim=s.dim, n_layers=s.fp8_layers, n_heads=s.heads, n_kv_heads=s.kv_heads,
                                       ffn_dim=s.ffn, vocab_size=s.vocab)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = zoo.models.llama.Llama(cfg)
    model.to_empty(device=run.device)
    from zoo.core.layers import init_weights

    init_weights(model)
    model.to(run.dtype)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    lens = lognormal_lengths(s.fp8_tokens, s.step_median, s.step_cap, seed=0)
    packed = zoo.pack(learnable_docs(lens, s.vocab)).to(run.device)
    with torch.device("meta"):
        flops = step_flops(zoo.models.llama.Llama(cfg), lens)
    print(f"  Llama {s.fp8_layers} layers x (d={s.dim}, {s.heads}/{s.kv_heads} heads, ffn {s.ffn}), vocab {s.vocab}; "
          f"{describe(lens)}; {flops / 1e12:.1f} TFLOP per step; {s.fp8_steps} AdamW steps (lr 3e-4), blocks "
          "compiled")
    rows: dict[str, dict] = {}
    for recipe in [None, *recipes]:
        name = "bf16" if recipe is None else f"fp8 {recipe}"
        row, error = attempt(run, f"fp8 {name}", partial(fp8_run, run, state, recipe, packed, flops, cfg))
        rows[name] = row if row else {"error": error}
        free()
    base = rows["bf16"]
    last = max(1, min(10, s.fp8_steps // 2))  # the curve's tail: the bf16 run's spread there is its noise
    if "losses" in base:
        tail = base["losses"][-last:]
        noise = statistics.pstdev(tail) if len(tail) > 1 else 0.0
        base["loss_tail_mean"], base["loss_tail_std"] = statistics.fmean(tail), noise
        for name, row in rows.items():
            if name == "bf16" or "losses" not in row:
                continue
            row["speedup"] = base["ms"] / row["ms"]  # target >= 1.25
            if base.get("peak_gib") and row.get("peak_gib"):
                row["memory_vs_bf16"] = row["peak_gib"] / base["peak_gib"]
            mean = statistics.fmean(row["losses"][-last:])
            row["loss_tail_mean"] = mean
            row["loss_tail_diff"] = mean - base["loss_tail_mean"]
            # within the bf16 run's noise: the tail means apart by at most twice bf16's spread there (+0.5%)
            row["within_noise"] = abs(row["loss_tail_diff"]) <= 2 * noise + 0.005 * abs(base["loss_tail_mean"])
    table(rows, [("ms", "ms", ".1f"), ("tokens_per_s", "tokens/s", ",.0f"), ("mfu", "MFU", ".1%"),
                 ("peak_gib", "peak GiB", ".2f"), ("speedup", "vs bf16", ".2f"), ("loss_tail_mean", "last loss", ".4f"),
                 ("loss_tail_diff", "vs bf16", "+.4f"), ("within_noise", "in noise", "")])
    for name, row in rows.items():
        if "losses" in row:
            every = max(1, len(row["losses"]) // 10)
            print(f"  {name} losses (every {every}): {' '.join(f'{x:.3f}' for x in row['losses'][::every])}")
    return {"lens": lens, "flops": flops, "refusals": refusals, "rows": rows}


def attnlen_at(run: Run, longest: int) -> dict:
    """One pack of `attnlen_tokens` tokens whose longest document is `longest` (log-normal, median longest / 4, one
    document exactly `longest`): fwd+bwd of the varlen kernel and of sdpa, and what auto picks for it."""
    from zoo.core.attention import auto_choice

    s = run.sizes
    T = s.attnlen_tokens
    N, K, H = s.attn_heads, s.attn_kv_heads, s.attn_head_dim
    rest = lognormal_lengths(T - longest, max(1, longest // 4), longest, seed=1) if T > longest else []
    lens = [longest, *rest]
    packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens]).to(run.device)
    torch.manual_seed(0)
    q = torch.randn(T, N, H, device=run.device, dtype=run.dtype, requires_grad=True)
    k = torch.randn(T, K, H, device=run.device, dtype=run.dtype, requires_grad=True)
    v = torch.randn(T, K, H, device=run.device, dtype=run.dtype, requires_grad=True)
    do = torch.randn(T, N, H, device=run.device, dtype=run.dtype)
    capability = torch.cuda.get_device_capability(run.device) if run.cuda else None
    pick = auto_choice(capability, run.dtype, longest)
    rows: dict[str, dict] = {}
    for b in (["flash_varlen", "sdpa"] if run.cuda else ["sdpa", "eager"]):
        fn = BACKENDS[b]

        def call(fn=fn):
            q.grad = k.grad = v.grad = None
            fn(q, k, v, packed).backward(do)

        def measure(call=call):
            for _ in range(2 + s.warmup):
                call()
            return median_ms([time_call(call, run.device) for _ in range(s.attnlen_reps)])

        ms, error = attempt(run, f"attnlen {b} longest={longest}", measure)
        rows[b] = {"ms": ms} if ms is not None else {"error": error}
    timed = {b: r["ms"] for b, r in rows.items() if "ms" in r}
    faster = min(timed, key=timed.__getitem__) if timed else None
    names = list(timed)  # CUDA: varlen's ms over sdpa's (above 1: sdpa is faster)
    ratio = timed[names[0]] / timed[names[1]] if len(names) == 2 else None
    return {"documents": len(lens), "auto_picks": pick, "faster": faster, "rows": rows, "ms_ratio": ratio}


def section_attnlen(run: Run) -> dict:
    """Where the varlen kernel and sdpa (cuDNN) cross as a pack's longest document grows: the numbers behind
    zoo.core.attention.SDPA_LONGEST_DOC."""
    from zoo.core.attention import SDPA_LONGEST_DOC

    s = run.sizes
    print(f"  packs of {s.attnlen_tokens} tokens, {s.attn_heads}/{s.attn_kv_heads} heads of {s.attn_head_dim}, "
          f"fwd+bwd; auto's threshold now: longest >= {SDPA_LONGEST_DOC} runs sdpa")
    out: dict[str, Any] = {"threshold": SDPA_LONGEST_DOC, "packs": {}}
    for longest in s.attnlen_longest:
        row, error = attempt(run, f"attnlen {longest}", partial(attnlen_at, run, longest))
        out["packs"][str(longest)] = row if row else {"error": error}
        if row:
            cells = "  ".join(f"{b} {r['ms']:.2f} ms" if "ms" in r else f"{b} {r['error']}"
                              for b, r in row["rows"].items())
            print(f"  longest {longest:>6} ({row['documents']} documents): {cells}; faster {row['faster']}, "
                  f"auto picks {row['auto_picks']}")
        free()
    sdpa_wins = [int(n) for n, r in out["packs"].items() if r.get("faster") == "sdpa"]
    out["sdpa_faster_from"] = min(sdpa_wins) if sdpa_wins else None
    print(f"  sdpa faster from a longest document of {out['sdpa_faster_from']} (threshold {SDPA_LONGEST_DOC})")
    return out


SECTIONS = {"correct": section_correct, "loss": section_loss, "step": section_step, "long": section_long,
            "attn": section_attn, "lora": section_lora, "compiled": section_compiled, "fp8": section_fp8,
            "attnlen": section_attnlen}
DEFAULT = ["correct", "loss", "step", "long", "attn", "lora"]  # what runs without --only ("compiled": step --compile)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--only", default=",".join(DEFAULT), help="comma-separated sections (env always runs)")
    p.add_argument("--out", type=Path, help="write the results as JSON here (rewritten after every section)")
    p.add_argument("--size", action="append", default=[], metavar="NAME=VALUE", help="override one size (see Sizes)")
    p.add_argument("--compile", action="store_true", help="step: also time zoo with every block torch.compile'd")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; smoke: eager)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: every code path in seconds, CPU or GPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS and s != "env"]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; known: env, {', '.join(SECTIONS)}")
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: these shapes are for a GPU; use --smoke for a quick run of every code path here")
    run = Run(device=device, dtype=torch.bfloat16, sizes=parse_sizes(args.size, args.smoke), compile=args.compile,
              compile_backend=args.compile_backend or ("eager" if args.smoke else "inductor"), out=args.out)
    run.results["args"] = {"only": only, "smoke": args.smoke, "compile": args.compile,
                           "sizes": {f.name: getattr(run.sizes, f.name) for f in fields(Sizes)}}
    for name in ["env"] + [s for s in SECTIONS if s in only]:  # in SECTIONS' order
        print(f"\n== {name} ==", flush=True)
        t0 = time.perf_counter()
        result, error = attempt(run, name, partial(section_env, run) if name == "env" else partial(SECTIONS[name], run))
        run.results[name] = {**(result or {"error": error}), "seconds": time.perf_counter() - t0}
        print(f"  ({run.results[name]['seconds']:.1f} s)", flush=True)
        run.save()
        free()
    if run.failures:
        print("\nfailed:\n  " + "\n  ".join(run.failures))
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
