"""Several recipe runs in one torchrun job: `torchrun --nproc_per_node N tests/_recipe_runs.py RUNS.json`, RUNS a
JSON list of [name, module, argv], each run `module.main(argv)` in turn, as `torchrun -m module argv` would.

The runs are the separate launches they stand for, less the start-up each launch pays (torchrun, N interpreters
importing torch and the recipes, the rendezvous): the tests that compare many N-process runs with one process start
one job. Each run gets a process group of its own, over torchrun's store under a prefix of its own (a group made
anew on the bare store would take the names of the last run's, whose keys are still there); the recipe finds it
made (recipes.engine.processes.init_distributed builds its meshes on it) and destroys it on its way out, as it does
its own. Rank 0 prints `== run NAME ==` before each run's output (`outputs` splits it); the first run that fails
ends the job.
"""

import importlib
import json
import re
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

MARK = "== run {} =="


def outputs(stdout: str) -> dict[str, str]:
    """Rank 0's output of each run, by name."""
    parts = re.split(r"^== run (\S+) ==$", stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def main(path: str) -> None:
    store, rank, world = next(rendezvous("env://"))  # the store the env:// rendezvous uses (torchrun's agent's)
    for i, (name, module, argv) in enumerate(json.loads(Path(path).read_text())):
        if rank == 0:
            print(MARK.format(name), flush=True)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"run{i}/", store), rank=rank, world_size=world)
        importlib.import_module(module).main(argv)
        assert not dist.is_initialized(), f"{name}: the recipe left its process group"
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
