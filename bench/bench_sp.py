"""Sequence parallel: communication, activation memory and causal balance per rank, by mode and group size N.

Three parts, all on CPU:
  balance    max/min causal work per rank (and the ring's critical path) on packed batches of log-normal
             document lengths, T = 128K: zoo's per-document zigzag vs contiguous sharding vs a global zigzag
  analytic   per layer and per rank, Llama-3-8B (32 q / 8 kv heads, head dim 128, bf16) at 128K tokens: bytes sent
             (forward, backward) and attention activations kept for backward plus in-flight comm buffers
  measured   gloo process groups of N = 1, 2, 4 ranks on one Llama layer (16 q / 4 kv heads, fp32): bytes each rank
             really sent (counted by zoo's comm wrappers), checked against the analytic formulas, activation
             bytes saved for backward per rank (autograd's saved-tensor hooks) and the wall time of a step.
  inner      the ring's inner step at N = 1 (one member, no comm) vs the plain backend on the same tokens, forward
             + backward: flash varlen on CUDA; on CPU sdpa vs the per-document math kernel.

    python bench/bench_sp.py [--part balance|analytic|measured|inner|all] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zoo.parallel import balanced_layout  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


# ---- balance ----


def lognormal_pack(T: int, median: float, sigma: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < T:
        n = max(1, int(median * math.exp(sigma * torch.randn(1, generator=g).item())))
        n = min(n, T - total)
        lens.append(n)
        total += n
    return lens


def contiguous_layout(lens: list[int], N: int) -> list[torch.Tensor]:
    T = sum(lens)
    return [torch.arange(T * r // N, T * (r + 1) // N) for r in range(N)]


def global_zigzag_layout(lens: list[int], N: int) -> list[torch.Tensor]:
    T = sum(lens)
    b = [T * c // (2 * N) for c in range(2 * N + 1)]
    return [torch.cat([torch.arange(b[r], b[r + 1]), torch.arange(b[2 * N - 1 - r], b[2 * N - r])]) for r in range(N)]


def pair_work(lens: list[int], parts: list[torch.Tensor]) -> torch.Tensor:
    """[N, N] number of (query of rank i, key of rank j) pairs the document-causal mask allows."""
    doc_T = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    T = len(doc_T)
    N = len(parts)
    out = torch.zeros(N, N, dtype=torch.float64)
    for j, kp in enumerate(parts):
        # keys of rank j: for each global position, how many of them are at or before it in the same document
        mine = torch.zeros(T, dtype=torch.float64)
        mine[kp] = 1
        csum = torch.cumsum(mine, 0)
        starts = torch.cumsum(torch.tensor([0] + lens[:-1]), 0)
        before_doc = torch.cat([torch.zeros(1, dtype=torch.float64), csum])[starts][doc_T]
        visible_T = csum - before_doc
        for i, qp in enumerate(parts):
            out[i, j] = visible_T[qp].sum()
    return out


def balance_table(T: int = 131072) -> str:
    rows = ["| pack (T = 128K) | N | zoo max/min | contiguous max/min | global zigzag max/min | zoo ring critical path "
            "/ ideal | contiguous | global zigzag |", "|---|---|---|---|---|---|---|---|"]
    packs = [("log-normal median 2K, sigma 1", lognormal_pack(T, 2000, 1.0, 0)),
             ("log-normal median 500, sigma 1", lognormal_pack(T, 500, 1.0, 1)),
             ("log-normal median 8K, sigma 1.5", lognormal_pack(T, 8000, 1.5, 2)),
             ("one 128K document", [T])]
    for name, lens in packs:
        for N in (2, 4, 8, 16, 32):
            cells = []
            crit = []
            for parts in (balanced_layout(lens, N, 1), contiguous_layout(lens, N), global_zigzag_layout(lens, N)):
                W = pair_work(lens, parts)
                per_rank = W.sum(1)
                cells.append(f"{(per_rank.max() / per_rank.min()).item():.2f}")
                # ring step s: rank r works on the keys of rank r - s; the step lasts as long as its slowest rank
                steps = [max(W[r, (r - s) % N].item() for r in range(N)) for s in range(N)]
                crit.append(f"{sum(steps) / (W.sum().item() / N):.2f}")
            rows.append(f"| {name} ({len(lens)} docs) | {N} | " + " | ".join(cells + crit) + " |")
    return "\n".join(rows)


# ---- analytic ----


def comm_bytes(mode: str, P: int, T: int, Nq: int, K: int, H: int, B: int, U: int = 1) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer, on average over the ranks."""
    U = {"ring": 1, "ulysses": P, "hybrid": U}[mode]
    G = P // U
    R = math.lcm(K, U)
    fwd = bwd = 0.0
    if U > 1:  # q, k, v scattered to heads and the output gathered back; the backward mirrors both
        a2a = T * H * B * (U - 1) / U * (2 * Nq + 2 * R)
        fwd += a2a
        bwd += a2a
    if G > 1:  # K/V (R heads over U ring groups) hop G-1 times; backward: K/V again + fp32 dK/dV hopping G times
        kv = T * 2 * R * H
        fwd += kv * B * (G - 1)
        bwd += kv * (B * (G - 1) + 4 * G)
    return fwd / P, bwd / P


def attention_memory(mode: str, P: int, T: int, Nq: int, K: int, H: int, B: int, U: int = 1) -> tuple[float, float]:
    """(attention tensors kept for backward, peak in-flight comm buffers) per rank per layer, bytes."""
    U = {"ring": 1, "ulysses": P, "hybrid": U}[mode]
    G = P // U
    R = math.lcm(K, U)
    t = T / P
    kept = t * (2 * Nq + 2 * R) * H * B + t * Nq * 4  # q, k, v, out in the layout attention sees, fp32 lse
    buffers = 0.0
    if U > 1:
        buffers = max(buffers, 2 * t * (Nq + 2 * R) * H * B)  # send + receive copy of the q/k/v all-to-all
    if G > 1:  # backward: K/V of this hop and the next, fp32 dK/dV of this hop and the next, fp32 dQ
        per_hop = t * 2 * (R // U) * U * H
        buffers = max(buffers, 2 * per_hop * B + 2 * per_hop * 4 + t * Nq * H * 4)
    return kept, buffers


def analytic_table(T: int = 131072) -> str:
    Nq, K, H, B = 32, 8, 128, 2
    rows = ["| mode | N | needs | sent fwd / rank / layer | sent bwd | attention kept for bwd | in-flight buffers |",
            "|---|---|---|---|---|---|---|"]
    configs = [("ulysses", P, P) for P in (2, 4, 8, 16, 32)]
    configs += [("ring", P, 1) for P in (2, 4, 8, 16, 32, 64)]
    configs += [("hybrid", P, 8) for P in (16, 32, 64)]
    for mode, P, U in configs:
        f, b = comm_bytes(mode, P, T, Nq, K, H, B, U)
        kept, buf = attention_memory(mode, P, T, Nq, K, H, B, U)
        need = {"ulysses": f"{Nq} heads % {P} = 0; KV heads repeated to {math.lcm(K, P)}",
                "ring": "any N, any heads",
                "hybrid": f"ulysses_size {U} divides heads and N; KV repeated to {math.lcm(K, U)}"}[mode]
        name = mode if mode != "hybrid" else f"hybrid (ulysses {U} x ring {P // U})"
        rows.append(f"| {name} | {P} | {need} | {f / MiB:.0f} MiB | {b / MiB:.0f} MiB | {kept / MiB:.0f} MiB | "
                    f"{buf / MiB:.0f} MiB |")
    return "\n".join(rows)


# ---- measured (gloo, CPU) ----

BENCH_CFG: dict[str, Any] = dict(dim=256, n_layers=1, n_heads=16, n_kv_heads=4, head_dim=16, ffn_dim=512,
                                 vocab_size=256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, T: int, modes: list, out: str) -> None:
    import torch.distributed as dist

    import zoo
    from zoo.core.layers import init_weights
    from zoo.models.llama import Llama, LlamaConfig
    from zoo.parallel import SequenceParallel
    from zoo.parallel.ring import COMM_BYTES

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**BENCH_CFG), attn="sdpa")
    init_weights(model)
    lens = lognormal_pack(T, 300, 1.0, 3)
    g = torch.Generator().manual_seed(0)
    packed = zoo.pack([torch.randint(0, 256, (n,), generator=g) for n in lens])
    results = {}
    for mode, U in modes:
        sp = SequenceParallel(mode=mode, ulysses_size=U) if world > 1 else None
        if sp is not None:
            sp.apply(model)
        local = sp.shard(packed) if sp is not None else packed
        saved: dict[int, int] = {}

        def pack_hook(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        for key in COMM_BYTES:
            COMM_BYTES[key] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            loss = model.loss(local)
        sent_fwd = sum(COMM_BYTES.values())
        loss.backward()
        sent_bwd = sum(COMM_BYTES.values()) - sent_fwd
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()  # a second step for the time, past first-call costs
        model.loss(local).backward()
        dist.barrier()
        wall = time.perf_counter() - t0
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = sum(n for ptr, n in saved.items() if ptr not in params)
        row = torch.tensor([sent_fwd, sent_bwd, kept, wall, local.num_tokens], dtype=torch.float64)
        every = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(every, row)
        results[f"{mode}/{U}"] = [r.tolist() for r in every]
        model.zero_grad(set_to_none=True)
        if sp is not None:
            model.set_attention("sdpa")
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measured_table(T: int) -> str:
    import torch.multiprocessing as mp

    c = BENCH_CFG
    rows = ["| mode | N | tokens / rank | sent fwd / rank | formula | sent bwd / rank | formula | kept for bwd / rank "
            "(whole layer + head) | step wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for world, modes in ((1, [("ring", 1)]), (2, [("ring", 1), ("ulysses", 2)]),
                         (4, [("ring", 1), ("ulysses", 4), ("hybrid", 2)])):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            mp.spawn(_worker, args=(world, _free_port(), T, modes, str(out)), nprocs=world)
            results = json.loads(out.read_text())
        for mode, U in modes:
            per_rank = results[f"{mode}/{U}"]
            fwd = sum(r[0] for r in per_rank) / world
            bwd = sum(r[1] for r in per_rank) / world
            kept = max(r[2] for r in per_rank)
            wall = max(r[3] for r in per_rank)
            toks = "/".join(str(int(r[4])) for r in per_rank)
            f_fwd, f_bwd = comm_bytes(mode, world, T, c["n_heads"], c["n_kv_heads"], c["head_dim"], 4, U)
            name = "one process" if world == 1 else (mode if mode != "hybrid" else f"hybrid (ulysses {U})")
            rows.append(f"| {name} | {world} | {toks} | {fwd / 1024:.0f} KiB | {f_fwd / 1024:.0f} KiB | "
                        f"{bwd / 1024:.0f} KiB | {f_bwd / 1024:.0f} KiB | {kept / MiB:.2f} MiB | {wall:.2f} |")
    return "\n".join(rows)


# ---- the sequence-parallel tax: the ring's inner step at N = 1 vs the plain backend ----


def inner_step_table(T: int, reps: int = 5) -> str:
    """Forward + backward of one attention call on the same tokens: RingAttention with one member (all its
    bookkeeping: per-document segments, fp32 out/LSE merge, explicit backward) vs the plain backend — flash
    varlen on CUDA (bf16), sdpa on CPU (fp32)."""
    from zoo.core.attention import flash_varlen, sdpa
    from zoo.core.packing import pack
    from zoo.parallel.ring import BlockMeta, Ring, RingAttention

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    Nq, K, H = (32, 8, 128) if cuda else (8, 2, 64)
    lens = lognormal_pack(T, 2000 if cuda else 300, 1.0, 4)
    packed = pack([torch.zeros(n, dtype=torch.long) for n in lens]).to(device)
    doc_T = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    # a ring of one: it never communicates, so it has no process group
    ring = Ring(cast("ProcessGroup", None), 0, 1, [BlockMeta(torch.arange(T, device=device), doc_T)], [[True]])
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(T, n, H, device=device, dtype=dtype, generator=g).requires_grad_()
               for n in (Nq, K, K))
    do = torch.randn(T, Nq, H, device=device, dtype=dtype, generator=g)
    plain = flash_varlen if cuda else sdpa

    def once(fn):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.autograd.backward(fn(), do)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    fns = {"plain": lambda: plain(q, k, v, packed), "ring": lambda: RingAttention.apply(q, k, v, ring, H**-0.5, None)}
    best = {name: float("inf") for name in fns}
    for rep in range(reps + 1):  # alternating, best of reps after one warm-up each
        for name, fn in fns.items():
            t = once(fn)
            if rep:
                best[name] = min(best[name], t)
    t_plain, t_ring = best["plain"], best["ring"]
    name = "flash_varlen (bf16)" if cuda else "sdpa (fp32, CPU)"
    return ("| device | tokens | docs | heads q/kv x dim | plain | ring inner step (N = 1) | ratio |\n"
            "|---|---|---|---|---|---|---|\n"
            f"| {device} | {T} | {len(lens)} | {Nq}/{K} x {H} | {name} {t_plain * 1e3:.1f} ms | {t_ring * 1e3:.1f} ms "
            f"| {t_ring / t_plain:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", choices=["balance", "analytic", "measured", "inner", "all"])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the measured gloo runs")
    args = ap.parse_args()
    if args.part in ("balance", "all"):
        print("## causal work per rank (ring), T = 128K\n")
        print(balance_table() + "\n")
    if args.part in ("analytic", "all"):
        print("## Llama-3-8B layer, 128K tokens, bf16: per layer and per rank\n")
        print(analytic_table() + "\n")
    if args.part in ("measured", "all"):
        c = BENCH_CFG
        print(f"## measured, gloo on CPU: one Llama layer ({c['n_heads']} q / {c['n_kv_heads']} kv heads, head dim "
              f"{c['head_dim']}, dim {c['dim']}, fp32), {args.tokens} tokens of log-normal documents\n")
        print(measured_table(args.tokens) + "\n")
    if args.part in ("inner", "all"):
        T = 32768 if torch.cuda.is_available() else 4096
        print(f"## the ring's inner step at N = 1 vs the plain backend, forward + backward, {T} tokens\n")
        print(inner_step_table(T) + "\n")


if __name__ == "__main__":
    main()
