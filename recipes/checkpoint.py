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
from recipes.metrics import read_rows
from recipes.processes import Dist
from zoo.errors import ZooError
from zoo.io.checkpoint import config_to_dict


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
    tensors, osd = _dcp_state(model, opt, trainable_only=bool(getattr(cfg, "lora_rank", 0)))
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


def complete(out: str | Path) -> list[Path]:
    """The complete checkpoints under OUT/checkpoints, oldest first (a save cut short left only a temporary
    directory, which has no trainer_state.json)."""
    return sorted(p for p in (Path(out) / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint under OUT/checkpoints."""
    done = complete(out)
    return done[-1] if done else None


def load(cfg: TrainConfig, d: Dist, model: nn.Module, opt, sched, data: PackedData, path: Path) -> int:
    """Restore model, optimizer, scheduler and RNG from `path`; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = json.loads((path / "trainer_state.json").read_text())
    have, want = state["identity"], _identity(cfg, model, data)
    # "base" came with checkpoints that leave the LoRA base out; older ones (which hold it) lack the key
    diff = [k for k in want if have.get(k) != want[k] and not (k == "base" and k not in have)]
    if diff:
        what = ", ".join(f"{k}: checkpoint {have.get(k)!r} vs now {want[k]!r}" for k in diff)
        raise ZooError(f"--resume: {path} was written by a different run ({what[:600]}); resume with the same "
                       "model, data, --seq-len, --batch-tokens and --seed, or start in a new --out")
    # the optimizer's hyperparameters come back with its state: a changed flag would be ignored, so say so
    saved = state.get("config", {})
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {getattr(cfg, k)}" for k in OPTIMIZER_FLAGS
               if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        raise ZooError(f"--resume: {', '.join(changed)}: the checkpoint's optimizer and schedule were saved with "
                       "the old values and would keep them; resume with the same values, or start a new --out")
    trainable_only = bool(getattr(cfg, "lora_rank", 0))
    tensors, osd = _dcp_state(model, opt, trainable_only)
    flat = _flat(tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path)))
    _unflat_into(tensors, flat)
    for g, saved in zip(osd["param_groups"], state["param_groups"], strict=True):
        g.update({k: _tuples(v) for k, v in saved.items()})
    set_state_dict(model, opt, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": osd["param_groups"]},
                   # the frozen base is not in a LoRA checkpoint (DCP's load already failed on any missing adapter)
                   options=StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only))
    sched.load_state_dict(state["scheduler"])
    rng_file = path / f"rng_rank{d.rank}.json"
    if rng_file.is_file():  # absent when resuming on more processes than saved; then the ranks keep their seeds
        rng = json.loads(rng_file.read_text())
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        random.setstate(_tuples(rng["python"]))
        if "cuda" in rng and d.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))
    return state["step"]


# saved with the optimizer and scheduler state, so a resumed run cannot change them
OPTIMIZER_FLAGS = ("lr", "min_lr_ratio", "warmup", "weight_decay", "beta1", "beta2")

# what a run writes in --out: --force removes these and nothing else
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "loss.png", "tensorboard", "model", "model-hf", "adapter")


def start_or_resume(cfg: TrainConfig, d: Dist, model: nn.Module, opt, sched, data: PackedData) -> int:
    """The step the run continues from: with --resume the newest checkpoint that loads (a damaged one is reported
    and the one before it tried), else 0 in an empty --out (or one --force clears of an earlier run's outputs)."""
    out = Path(cfg.out)
    for stale in sorted((out / "checkpoints").glob(".step_*.tmp")) if d.main else []:
        print(f"removing {stale}: a checkpoint save that an earlier run did not finish")
        shutil.rmtree(stale, ignore_errors=True)
    d.barrier()
    if not cfg.resume:
        _fresh_out(cfg, d, out)
        return 0
    candidates = complete(out)
    if not candidates:
        if d.main:
            print(f"--resume: no checkpoint in {out / 'checkpoints'}, starting from step 0")
        _fresh_out(cfg, d, out, resuming=True)
        return 0
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    damaged = []
    for ckpt in reversed(candidates):
        try:
            step = load(cfg, d, model, opt, sched, data, ckpt)
        except ZooError:
            raise  # a different run's checkpoint: not damage, and the older ones are that run's too
        except (Exception, CheckpointException) as e:  # a truncated shard or JSON: DCP raises on every rank alike
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            damaged.append(f"{ckpt.name} ({reason})")
            if d.main:
                print(f"--resume: {ckpt} is damaged ({reason}); trying the one before it", flush=True)
            continue
        if d.main:
            print(f"resumed from {ckpt} at step {step}" + (f" (skipped damaged: {', '.join(damaged)})"
                                                           if damaged else ""))
            metrics = out / "metrics.jsonl"
            if metrics.is_file():  # drop what the interrupted run logged after this checkpoint
                keep = [r for r in read_rows(metrics) if r["step"] <= step]
                metrics.write_text("".join(json.dumps(r) + "\n" for r in keep))
        d.barrier()
        return step
    raise ZooError(f"--resume: every checkpoint in {out / 'checkpoints'} is damaged: {'; '.join(damaged)}")


def _fresh_out(cfg: TrainConfig, d: Dist, out: Path, resuming: bool = False) -> None:
    """A new run needs an empty --out; --force (or --resume with nothing to resume) removes an earlier run's outputs,
    and only those, saying what. Every rank checks, so every rank raises alike."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    last = latest(out)
    if held and not (cfg.force or resuming):
        hint = f"; --resume continues its {last.name}" if last else ""
        raise ZooError(f"--out {out} is not empty (it holds {', '.join(held)[:300]}){hint}; --force starts afresh "
                       f"there, removing the earlier run's outputs")
    ours = [out / name for name in RUN_OUTPUTS if (out / name).exists()]
    if d.main and ours:
        lost = f" (its newest checkpoint, {last.name}, could have been resumed with --resume)" if last else ""
        print(f"{'--force' if cfg.force else '--resume'}: removing {', '.join(p.name for p in ours)} of an earlier "
              f"run from {out}{lost}")
        for p in ours:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    d.barrier()


def _identity(cfg: TrainConfig, model: nn.Module, data: PackedData) -> dict:
    """What a resumed run must share with the checkpoint."""
    identity = {"family": model.family, "model_config": json.loads(json.dumps(config_to_dict(model.config))),
                "data": data.fingerprint, "batch_tokens": cfg.batch_tokens, "seed": cfg.seed}
    if getattr(cfg, "lora_rank", 0):  # only then: checkpoints of full fine-tuning keep their identity
        identity["lora"] = {k: getattr(cfg, k) for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_rslora",
                                                          "lora_targets", "lora_vision", "lora_vision_targets")
                            if hasattr(cfg, k)}  # the tower's options: recipes.llava's only
        if getattr(cfg, "qlora", False):
            identity["lora"]["qlora"] = True
        identity["base"] = _weights_fingerprint(cfg.model)  # a LoRA checkpoint holds no base: it is read again
    return identity


def _weights_fingerprint(model: str) -> list | str:
    """What a LoRA checkpoint's frozen base must still be at --resume: the weight files of --model (names and
    sizes), or the preset's name."""
    root = Path(model)
    if not root.is_dir():
        return model
    return sorted([p.name, p.stat().st_size] for p in root.glob("*.safetensors"))


def _dcp_state(model: nn.Module, opt, trainable_only: bool = False) -> tuple[dict, dict]:
    """Tensors only: DCP stores anything else by pickling, and zoo never unpickles. The rest goes to JSON. With
    `trainable_only` (LoRA) the frozen base is left out: it is --model's, read again on --resume."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=trainable_only))
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
