"""Resumable training checkpoints: OUT/checkpoints/step_N holds the tensors (model and optimizer state, through DCP
in safetensors shards) and JSON for the rest (step, scheduler, optimizer hyperparameters, each rank's RNG, what the
run must share to resume it). Nothing is pickled, so nothing is unpickled. The trained model itself is written by
recipes/export.py.

torch.distributed.checkpoint is imported where it is used: it adds most of a second to start-up (--help, early errors).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from recipes.config import TrainConfig
from recipes.data import PackedData
from recipes.processes import Dist
from zoo.checkpoint import config_to_dict
from zoo.errors import ZooError


def save(cfg: TrainConfig, d: Dist, model: nn.Module, opt, sched, data: PackedData, step: int) -> Path:
    """OUT/checkpoints/step_N, written to a temporary directory first and renamed when complete; keeps the last
    --keep."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    root = Path(cfg.out) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    tensors, osd = _dcp_state(model, opt)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        # the safetensors storage of DCP: shards with offsets in their headers, metadata as JSON, no pickle
        dcp.save(_flat(tensors), storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    rng = {"torch": torch.get_rng_state().tolist(), "python": _jsonable(random.getstate())}
    if d.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state().tolist()
    (tmp / f"rng_rank{d.rank}.json").write_text(json.dumps(rng))
    d.barrier()
    if d.main:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
        state = {"step": step, "data_position": step * (cfg.batch_tokens // cfg.seq_len), "scheduler":
                 _jsonable(sched.state_dict()), "param_groups": _jsonable(groups), "world": d.world,
                 "identity": _identity(cfg, model, data), "config": asdict(cfg)}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # the checkpoint exists only once it is complete
        for old in sorted(root.glob("step_*"))[: -cfg.keep] if cfg.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    d.barrier()
    return final


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint under OUT/checkpoints (a save cut short left only a temporary directory)."""
    done = sorted(p for p in (Path(out) / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def load(cfg: TrainConfig, d: Dist, model: nn.Module, opt, sched, data: PackedData, path: Path) -> int:
    """Restore model, optimizer, scheduler and RNG from `path`; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = json.loads((path / "trainer_state.json").read_text())
    have, want = state["identity"], _identity(cfg, model, data)
    diff = [k for k in want if have.get(k) != want[k]]
    if diff:
        what = ", ".join(f"{k}: checkpoint {have.get(k)!r} vs now {want[k]!r}" for k in diff)
        raise ZooError(f"--resume: {path} was written by a different run ({what[:600]}); resume with the same "
                       "model, data, --seq-len, --batch-tokens and --seed, or start in a new --out")
    tensors, osd = _dcp_state(model, opt)
    flat = _flat(tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path)))
    _unflat_into(tensors, flat)
    for g, saved in zip(osd["param_groups"], state["param_groups"], strict=True):
        g.update({k: _tuples(v) for k, v in saved.items()})
    set_state_dict(model, opt, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": osd["param_groups"]})
    sched.load_state_dict(state["scheduler"])
    rng_file = path / f"rng_rank{d.rank}.json"
    if rng_file.is_file():  # absent when resuming on more processes than saved; then the ranks keep their seeds
        rng = json.loads(rng_file.read_text())
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        random.setstate(_tuples(rng["python"]))
        if "cuda" in rng and d.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))
    return state["step"]


def start_or_resume(cfg: TrainConfig, d: Dist, model: nn.Module, opt, sched, data: PackedData) -> int:
    """The step the run continues from: the latest checkpoint's with --resume, else 0, clearing what an earlier run
    left in OUT."""
    out = Path(cfg.out)
    ckpt = latest(out) if cfg.resume else None
    if cfg.resume and ckpt is None and d.main:
        print(f"--resume: no checkpoint in {out / 'checkpoints'}, starting from step 0")
    if ckpt is None:
        if d.main:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
        d.barrier()
        return 0
    step = load(cfg, d, model, opt, sched, data, ckpt)
    if d.main:
        print(f"resumed from {ckpt} at step {step}")
        metrics = out / "metrics.jsonl"
        if metrics.is_file():  # drop what the interrupted run logged after this checkpoint
            keep = [ln for ln in metrics.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            metrics.write_text("".join(ln + "\n" for ln in keep))
    return step


def _identity(cfg: TrainConfig, model: nn.Module, data: PackedData) -> dict:
    """What a resumed run must share with the checkpoint."""
    return {"family": model.family, "model_config": json.loads(json.dumps(config_to_dict(model.config))),
            "data": data.fingerprint, "batch_tokens": cfg.batch_tokens, "seed": cfg.seed}


def _dcp_state(model: nn.Module, opt) -> tuple[dict, dict]:
    """Tensors only: DCP stores anything else by pickling, and zoo never unpickles. The rest goes to JSON."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd["state"]}, osd


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflat_into(state: dict, flat: dict, prefix: str = "") -> None:
    for k, v in state.items():
        if isinstance(v, dict):
            _unflat_into(v, flat, f"{prefix}{k}.")
        else:
            state[k] = flat[f"{prefix}{k}"]


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
