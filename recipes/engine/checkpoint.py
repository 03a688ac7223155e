"""Resumable training checkpoints: OUT/checkpoints/step_N holds the tensors (model and optimizer state, through DCP
in safetensors shards) and JSON for the rest (step, scheduler, optimizer hyperparameters, each rank's RNG, what the
run must share to resume it). Nothing is pickled, so nothing is unpickled. The trained model itself is written by
recipes/engine/export.py.

torch.distributed.checkpoint is imported where it is used: it adds most of a second to start-up (--help, early errors).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from recipes.data import PackedData
from recipes.engine.config import flags, flat
from recipes.engine.metrics import read_rows
from recipes.engine.processes import Dist
from recipes.engine.sections import LoRASection, RecipeConfig
from zoo.errors import ZooError
from zoo.io.config import config_to_dict
from zoo.models import Model


def save(cfg: RecipeConfig, d: Dist, model: Model, opt: Optimizer, sched: LRScheduler, data: PackedData, step: int,
         lora: LoRASection | None = None) -> Path:
    """OUT/checkpoints/step_N, written to a temporary directory first and renamed when complete; keeps the last
    --keep. With `lora` (a rank), only what trains: the adapters and their optimizer state."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    root = Path(cfg.run.out) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    tensors, osd = _dcp_state(model, opt, trainable_only=_adapters_only(lora))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            # the safetensors storage of DCP: shards with offsets in their headers, metadata as JSON, no pickle
            dcp_save(_flat(tensors), storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
        rng: dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": _jsonable(random.getstate())}
        if d.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state().tolist()
        (tmp / f"rng_rank{d.rank}.json").write_text(json.dumps(rng))
        d.barrier()
        if d.main:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
            # "config": every option by its flat name, as checkpoints written before the options had sections
            state = {"step": step, "data_position": step * (cfg.data.batch_tokens // cfg.data.seq_len), "scheduler":
                     _jsonable(sched.state_dict()), "param_groups": _jsonable(groups), "world": d.world,
                     "identity": _identity(cfg, model, data, lora), "config": flat(cfg)}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    except (OSError, CheckpointException) as e:  # a full disk: DCP wraps the OSError of the rank that hit it
        shutil.rmtree(tmp, ignore_errors=True)
        kept = latest(cfg.run.out)
        raise ZooError(f"{final}: checkpoint not written ({_first_error(e)}); "
                       f"{f'the last complete one, {kept.name}, is kept' if kept else 'no earlier checkpoint'}"
                       ) from e
    if d.main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # the checkpoint exists only once it is complete
        keep = cfg.checkpoint.keep
        for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    d.barrier()
    return final


def _first_error(e: BaseException) -> str:
    """The first line of what went wrong, out of DCP's CheckpointException (a traceback per failed rank) too."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    return (f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror and e.filename
            else e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0] if str(e)
            else type(e).__name__)


def complete(out: str | Path) -> list[Path]:
    """The complete checkpoints under OUT/checkpoints, oldest first (a save cut short left only a temporary
    directory, which has no trainer_state.json)."""
    return sorted(p for p in (Path(out) / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint under OUT/checkpoints."""
    done = complete(out)
    return done[-1] if done else None


def load(cfg: RecipeConfig, d: Dist, model: Model, opt: Optimizer, sched: LRScheduler, data: PackedData, path: Path,
         lora: LoRASection | None = None) -> int:
    """Restore model, optimizer, scheduler and RNG from `path`; returns the step to continue from."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = json.loads((path / "trainer_state.json").read_text())
    step = state.get("step")
    # the step a run resumes at is the one in the directory's name: a "step" that is a string, negative, 1e12 or
    # another step's is damage (resuming at -2 would overwrite every later checkpoint), and the one before is tried
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step and path.name == f"step_{step:08d}"):
        raise ValueError(f"trainer_state.json has step {step!r}, the directory says {path.name}")
    have, want = state["identity"], _identity(cfg, model, data, lora)
    # "base" came with checkpoints that leave the LoRA base out; older ones (which hold it) lack the key
    diff = [k for k in want if have.get(k) != want[k] and not (k == "base" and k not in have)]
    if diff:
        what = ", ".join(f"{k}: checkpoint {have.get(k)!r} vs now {want[k]!r}" for k in diff)
        raise ZooError(f"--resume: {path} was written by a different run ({what[:600]}); resume with the same "
                       "model, data, --seq-len, --batch-tokens and --seed, or start in a new --out")
    # the optimizer's hyperparameters come back with its state: a changed flag would be ignored, so say so
    saved, now = state.get("config", {}), flags(cfg.optim)
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}" for k in OPTIMIZER_FLAGS
               if k in saved and saved[k] != now[k]]
    if changed:
        raise ZooError(f"--resume: {', '.join(changed)}: the checkpoint's optimizer and schedule were saved with "
                       "the old values and would keep them; resume with the same values, or start a new --out")
    trainable_only = _adapters_only(lora)
    tensors, osd = _dcp_state(model, opt, trainable_only)
    flat_tensors = _flat(tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(flat_tensors, storage_reader=HuggingFaceStorageReader(str(path)))
    _unflat_into(tensors, flat_tensors)
    for g, saved in zip(osd["param_groups"], state["param_groups"], strict=True):
        g.update({k: _tuples(v) for k, v in saved.items()})
    set_state_dict(model, opt, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": osd["param_groups"]},
                   # the frozen base is not in a LoRA checkpoint (DCP's load already failed on any missing adapter)
                   options=StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only))
    sched.load_state_dict(state["scheduler"])
    steps = state.get("config", {}).get("steps", cfg.run.steps)
    if steps != cfg.run.steps:
        # the schedule's function is this run's (LambdaLR saves no lambda), but the rate of the next step was
        # computed by the checkpoint's run, for its --steps: recomputed, so that every step follows the new schedule
        sched.last_epoch -= 1
        sched.step()
        if d.main:
            print(f"--resume: --steps {steps} -> {cfg.run.steps}: the learning-rate schedule (warmup "
                  f"{cfg.optim.warmup}, then cosine decay) now ends at step {cfg.run.steps}, and steps {step + 1} on "
                  "follow it", flush=True)
    rng_file = path / f"rng_rank{d.rank}.json"
    if rng_file.is_file():  # absent when resuming on more processes than saved; then the ranks keep their seeds
        rng = json.loads(rng_file.read_text())
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        random.setstate(_tuples(rng["python"]))
        if "cuda" in rng and d.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))
    return step


# saved with the optimizer and scheduler state, so a resumed run cannot change them
OPTIMIZER_FLAGS = ("lr", "min_lr_ratio", "warmup", "weight_decay", "beta1", "beta2")

# what a run writes in --out: --force removes these and nothing else
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "loss.png", "aux_loss.png", "tensorboard", "model", "model-hf",
               "adapter")


def start_or_resume(cfg: RecipeConfig, d: Dist, model: Model, opt: Optimizer, sched: LRScheduler, data: PackedData,
                    lora: LoRASection | None = None) -> int:
    """The step the run continues from: with --resume the newest checkpoint that loads (a damaged one is reported
    and the one before it tried), else 0 in an empty --out (or one --force clears of an earlier run's outputs)."""
    out = Path(cfg.run.out)
    check_shared(out, d)
    for stale in sorted((out / "checkpoints").glob(".step_*.tmp")) if d.main else []:
        print(f"removing {stale}: a checkpoint save that an earlier run did not finish")
        shutil.rmtree(stale, ignore_errors=True)
    d.barrier()
    if not cfg.checkpoint.resume:
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
            step = load(cfg, d, model, opt, sched, data, ckpt, lora)
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


def check_shared(out: Path, d: Dist) -> None:
    """Fail unless rank 0 sees what every rank writes in --out. Each rank writes its own shards and RNG state of
    every checkpoint there (DCP) and --resume reads them all: with --out on each node's own disk, training would run,
    but no checkpoint could be resumed (rank 0's lack the other nodes' shards). Like DCP, each rank creates a file
    and rank 0 looks for them all."""
    if not dist.is_initialized() or d.world == 1:
        return
    nonce = torch.tensor([int.from_bytes(os.urandom(7), "big") if d.main else 0], dtype=torch.int64, device=d.device)
    dist.broadcast(nonce, src=0)

    def probe(rank: int) -> Path:
        return out / f".rank{rank}-sees-out-{int(nonce.item()):x}"

    out.mkdir(parents=True, exist_ok=True)
    probe(d.rank).touch()
    d.barrier()
    unseen = torch.tensor([d.main and not probe(r).is_file() for r in range(d.world)], device=d.device)
    dist.broadcast(unseen, src=0)
    probe(d.rank).unlink()
    d.barrier()  # no rank lists --out (a new run needs it empty) while another's file is still there
    blind = [str(r) for r in range(d.world) if unseen[r]]
    if blind:
        ranks = f"rank{'s' if len(blind) > 1 else ''} {', '.join(blind)} of {d.world}"
        raise ZooError(f"--out {out}: rank 0 does not see what {ranks} wrote there; --out must be one directory that "
                       "every node sees (a shared filesystem: NFS, Lustre, ...): every rank writes its own shards of "
                       "each checkpoint into it, and --resume reads them all")


def check_out(cfg: RecipeConfig) -> None:
    """What the run would refuse of --out once its model and data are loaded (`start_or_resume`), refused before: a
    recipe calls this first, before any process writes there (a --resume with a checkpoint to continue passes)."""
    out = Path(cfg.run.out)
    if not (cfg.checkpoint.resume and complete(out)):
        _refused(cfg, out, cfg.checkpoint.resume)


def _fresh_out(cfg: RecipeConfig, d: Dist, out: Path, resuming: bool = False) -> None:
    """A new run needs an empty --out; --force (or --resume with nothing to resume) removes an earlier run's outputs,
    and only those, saying what. Every rank checks, so every rank raises alike."""
    ours = _refused(cfg, out, resuming)
    last, force = latest(out), cfg.checkpoint.force
    if d.main and ours:
        lost = f" (its newest checkpoint, {last.name}, could have been resumed with --resume)" if last else ""
        print(f"{'--force' if force else '--resume'}: removing {', '.join(p.name for p in ours)} of an earlier "
              f"run from {out}{lost}")
        for p in ours:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    d.barrier()


def _refused(cfg: RecipeConfig, out: Path, resuming: bool) -> list[Path]:
    """Raises where a new run may not start in --out; else returns the earlier run's outputs there, which --force
    (or --resume with nothing to resume) removes."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    last = latest(out)
    force = cfg.checkpoint.force
    if held and resuming and not force:  # nothing to resume: the exports of a finished run are not ours to remove
        raise ZooError(f"--resume: no checkpoint in {out / 'checkpoints'} to resume, and --out {out} holds "
                       f"{', '.join(held)[:300]}; --force starts afresh there, removing the earlier run's outputs")
    if held and not force:
        hint = f"; --resume continues its {last.name}" if last else ""
        raise ZooError(f"--out {out} is not empty (it holds {', '.join(held)[:300]}){hint}; --force starts afresh "
                       f"there, removing the earlier run's outputs")
    ours = [out / name for name in RUN_OUTPUTS if (out / name).exists()]
    ran_here = (out / "metrics.jsonl").is_file() or (out / "checkpoints").is_dir()
    if ours and not ran_here:  # model/ or adapter/ with no run's metrics or checkpoints beside them: the user's
        raise ZooError(f"--out {out} holds {', '.join(p.name for p in ours)} but no earlier run's metrics.jsonl or "
                       "checkpoints/: --force removes only a run's outputs; choose another --out")
    inputs = [v for v in (cfg.model.name, cfg.model.tokenizer, cfg.data.path, cfg.data.eval_data)
              if v and Path(v).exists()]
    for p in ours:  # --model out/sft/model --out out/sft --force: the run would delete what it reads
        for v in inputs:
            if Path(v).resolve().is_relative_to(p.resolve()):
                raise ZooError(f"--out {out}: --force would remove {p}, which holds this run's input {v}; copy it "
                               "elsewhere first, or choose another --out")
    return ours


def _adapters_only(lora: LoRASection | None) -> bool:
    """Whether a checkpoint holds only what trains: a LoRA run's adapters (its base is --model's)."""
    return lora is not None and lora.rank > 0


def _identity(cfg: RecipeConfig, model: Model, data: PackedData, lora: LoRASection | None) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint."""
    identity: dict[str, Any] = {
        "family": model.family, "model_config": json.loads(json.dumps(config_to_dict(model.config))),
        "data": data.fingerprint, "batch_tokens": cfg.data.batch_tokens, "seed": cfg.run.seed}
    if lora is not None and lora.rank > 0:  # only then: checkpoints of full fine-tuning keep their identity
        # every --lora-* option by its flat name (recipes.llava's tower options too), QLoRA only when on
        identity["lora"] = {k: v for k, v in flags(lora).items() if k != "qlora"}
        if lora.qlora:
            identity["lora"]["qlora"] = True
        identity["base"] = _weights_fingerprint(cfg.model.name)  # a LoRA checkpoint holds no base: read again
    return identity


def _weights_fingerprint(model: str) -> list[list[str | int]] | str:
    """What a LoRA checkpoint's frozen base must still be at --resume: the weight files of --model (names and
    sizes), or the preset's name."""
    root = Path(model)
    if not root.is_dir():
        return model
    return sorted([p.name, p.stat().st_size] for p in root.glob("*.safetensors"))


# a state dict's nesting: tensors (and numbers) under string keys, at any depth
Nested = dict[str, Any]


def _dcp_state(model: Model, opt: Optimizer, trainable_only: bool = False) -> tuple[Nested, Nested]:
    """Tensors only: DCP stores anything else by pickling, and zoo never unpickles. The rest goes to JSON. With
    `trainable_only` (LoRA) the frozen base is left out: it is --model's, read again on --resume."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=trainable_only))
    return {"model": msd, "optim": osd["state"]}, dict(osd)


def _flat(state: Nested, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflat_into(state: Nested, flat: dict[str, Any], prefix: str = "") -> None:
    for k, v in state.items():
        if isinstance(v, dict):
            _unflat_into(v, flat, f"{prefix}{k}.")
        else:
            state[k] = flat[f"{prefix}{k}"]


def _jsonable(x: Any) -> Any:
    """Lists, dicts and numbers of `x` (tuples as lists, tensors as their values): what JSON holds."""
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def _tuples(x: Any) -> Any:
    """`_jsonable`'s lists back as the tuples they were (an RNG state, betas)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
