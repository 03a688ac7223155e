"""The processes of a run: the device, the torchrun job (gloo on CPU, nccl on GPU) and its meshes.

Ranks form a dp x sp grid, sp fastest: rank = dp_rank * sp + sp_rank. The ("dp", "sp") mesh gives each rank its
place and its sequence-parallel group; FSDP shards over a second, one-dimensional mesh of all dp x sp ranks (sp
ranks hold the same weights too, as in torchtitan). Both are built with `init_device_mesh`, the public API.

On several machines torchrun numbers the ranks node by node (global rank = node's rank x --nproc_per_node + local
rank), so an sp group of a size that divides --nproc_per_node lies within one node: the per-layer all-to-all or ring
stays on the node's links, and only FSDP's gathers and reductions cross nodes. Global rank 0 (`Dist.main`) alone
writes the run's shared files; LOCAL_RANK only picks the GPU.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recipes.engine.sections import ParallelSection
from zoo.errors import ZooError
from zoo.parallel import SequenceParallel

if TYPE_CHECKING:
    from zoo.parallel.expert import ExpertParallel


@dataclass(frozen=True)
class Dist:
    """This process's place in the run; the defaults are a single CPU process without FSDP."""

    rank: int = 0
    world: int = 1
    dp: int = 1
    sp: int = 1
    dp_rank: int = 0
    sp_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None  # ("dp", "sp")
    fsdp_mesh: DeviceMesh | None = None  # ("dp_sp",): every rank; None: no FSDP
    sequence_parallel: SequenceParallel | None = None  # over the "sp" dimension (sp ranks), when sp > 1
    expert_parallel: ExpertParallel | None = None  # over groups of --ep consecutive ranks, when ep > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


def choose_device(choice: str, local_procs: int) -> str:
    """'cuda' or 'cpu' for --device `choice` with `local_procs` processes on this machine, each needing its own GPU:
    auto takes CUDA only when there are enough GPUs for them, and says so when there are too few."""
    if choice == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        if choice == "auto":
            return "cpu"
        raise ZooError("--device cuda, but CUDA is not available here (torch.cuda.is_available() is False); "
                       "train on CPU with --device cpu (or auto)")
    if gpus < local_procs:
        raise ZooError(f"--device {choice}: {local_procs} processes on this machine but {gpus} GPU"
                       f"{'s' if gpus > 1 else ''}, and each process needs its own; start at most {gpus} (torchrun "
                       f"--nproc_per_node {gpus}) or train on CPU with --device cpu")
    return "cuda"


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it): one single-GPU process's rendezvous, which must not
    collide with another started beside it (a test suite's workers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def init_distributed(cfg: ParallelSection) -> Dist:
    """Join the torchrun job and build the meshes; a single CPU process needs neither."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = cfg.sp
    dp = cfg.dp or max(world // sp, 1)
    if dp * sp != world:
        started = f"{world} {'was' if world == 1 else 'were'} started"
        raise ZooError(f"--dp {dp} x --sp {sp} = {dp * sp} processes, but {started}; launch with "
                       f"torchrun --nproc_per_node {dp * sp}, or on N machines --nnodes N --nproc_per_node "
                       f"{dp * sp}/N (or change --dp/--sp)")
    if world % cfg.ep:
        raise ZooError(f"--ep {cfg.ep} must divide the {world} processes started (experts are spread over groups of "
                       f"--ep consecutive ranks); choose one of {[n for n in range(1, world + 1) if world % n == 0]}")
    cuda = choose_device(cfg.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) == "cuda"
    if world == 1 and not cuda:
        return Dist()
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world == 1:  # one GPU: a process group of one, so FSDP's mixed precision applies the same way
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
    # the same ranks as mesh["dp", "sp"] flattened, in the same order (row-major): built directly rather than
    # through DeviceMesh's private _flatten
    fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_sp",))
    sequence_parallel = None
    if sp > 1:
        sequence_parallel = SequenceParallel(mesh["sp"].get_group(), mode=cfg.sp_mode, ulysses_size=cfg.ulysses_size)
    expert_parallel = None
    if cfg.ep > 1:  # groups of ep consecutive ranks; the processes holding the same experts across them: replicas
        from zoo.parallel.expert import ExpertParallel

        ep_mesh = init_device_mesh(device.type, (world // cfg.ep, cfg.ep), mesh_dim_names=("ep_replica", "ep"))
        replicas = ep_mesh["ep_replica"].get_group() if world > cfg.ep else None
        expert_parallel = ExpertParallel(ep_mesh["ep"], replicas)
    return Dist(rank, world, dp, sp, mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank(), device, mesh,
                fsdp_mesh, sequence_parallel, expert_parallel)


@contextmanager
def distributed(cfg: ParallelSection) -> Iterator[Dist]:
    """`with distributed(cfg.parallel) as d:` the run's processes, its process group destroyed on the way out."""
    try:
        yield init_distributed(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Interrupted(SystemExit):
    """The run stopped on SIGINT or SIGTERM: a SystemExit with the shell's code for it (128 + the signal: 130, 143),
    so the process ends with that code and without a traceback."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM (a scheduler's notice before preemption) while training: the first only asks the loop to
    stop after its step (sets `signum`, which `agreed` shares), a second stops at once (raises `Interrupted`). Used
    as `with StopSignals() as signals:`; the previous handlers come back on the way out. Outside the main thread
    (where Python cannot set handlers) it does nothing."""

    # a repeat this soon after the first is the same signal arriving twice, not a second one: a scheduler signals
    # every process of the job (Slurm's scancel), torchrun's workers and torchrun, which then forwards it to them
    REPEAT_S = 0.5

    def __init__(self) -> None:
        self.signum = 0
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if not self.signum:
            self.signum, self._at = signum, time.monotonic()
            print(f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint (again to stop at "
                  "once)", file=sys.stderr, flush=True)
            return
        if time.monotonic() - self._at < self.REPEAT_S:
            return
        self._restore()
        print(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint of this step",
              file=sys.stderr, flush=True)
        raise Interrupted(signum)

    def agreed(self, d: Dist) -> int:
        """The signal that stops every rank after this step, 0 for none: any rank's (the highest number when they
        differ), so all stop at the same step. Collective when distributed: every rank calls it at every step."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
