"""The pieces every recipe shares: processes and meshes, model and optimizer, the step loop, checkpoints, export.

The averaging rule (DP x SP x gradient accumulation). One optimizer step sees P = batch_tokens / seq_len packs;
each data-parallel rank runs its P / dp of them one after another (accumulation), and each pack is split over the
sp ranks of its group. Every micro-batch's loss is computed with the denominator set to the number of target
tokens of the *whole step* (all packs, all ranks), so it is that micro-batch's share of the step's mean loss, and
the shares of all micro-batches on all ranks add up to it. Gradients must therefore be summed over ranks; FSDP
averages them over its mesh (dp x sp ranks), so each rank backpropagates `world * share`. The result is the
gradient of the global token-mean loss, whatever dp, sp and the accumulation count are.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zoo
from recipes.config import TrainConfig
from recipes.data import PackedData
from recipes.plot import plot_loss
from recipes.tokenizer import Tokenizer
from zoo.checkpoint import config_to_dict
from zoo.errors import ZooError
from zoo.models import FAMILIES
from zoo.parallel.fsdp import parallelize

# ---- processes ----


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    dp: int = 1
    sp: int = 1
    dp_rank: int = 0
    sp_rank: int = 0
    mesh: object = None  # DeviceMesh ("dp", "sp"), None in a single process without FSDP
    device: torch.device = torch.device("cpu")
    seq: object = None  # zoo.parallel.SequenceParallel when sp > 1

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


def init_distributed(cfg: TrainConfig) -> Dist:
    """Join the torchrun job (gloo on CPU, nccl on GPU) and build the dp x sp mesh; a single CPU process needs
    neither."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = cfg.sp
    dp = cfg.dp or max(world // sp, 1)
    if dp * sp != world:
        raise ZooError(f"--dp {dp} x --sp {sp} = {dp * sp} processes, but {world} were started; launch with "
                       f"torchrun --nproc_per_node {dp * sp} (or change --dp/--sp)")
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
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
    return Dist(rank, world, dp, sp, mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank(), mesh, device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- model and optimizer ----


def model_config(cfg: TrainConfig):
    from zoo.checkpoint import read_config

    return read_config(cfg.model)[1] if Path(cfg.model).is_dir() else zoo.get_preset(cfg.model).config


def check_model(cfg: TrainConfig, tok: Tokenizer, config=None) -> None:
    """Fail before any data is read when model, tokenizer and --seq-len do not fit together."""
    config = config or model_config(cfg)
    tcfg = getattr(config, "language", config)  # LLaVA's language model
    if tok.vocab_size > tcfg.vocab_size:
        raise ZooError(f"the tokenizer {tok.path} has {tok.vocab_size} tokens but the model's vocabulary is "
                       f"{tcfg.vocab_size}; use the model's own tokenizer (--tokenizer)")
    max_len = getattr(tcfg, "max_seq_len", None)
    if max_len is not None and cfg.seq_len > max_len:
        raise ZooError(f"--seq-len {cfg.seq_len} is above what {cfg.model} supports ({max_len} positions); "
                       f"use --seq-len {max_len} or less")


def build_model(cfg: TrainConfig, d: Dist, tok: Tokenizer, config=None, adapt=None) -> nn.Module:
    """Load the preset or checkpoint (or build `config` with random weights; the same on every rank), let
    `adapt(model)` load or freeze parts, then parallelize."""
    check_model(cfg, tok, config)
    torch.manual_seed(cfg.seed)
    # a checkpoint under FSDP: built on meta and sharded first, then rank 0 reads the weights and scatters them,
    # so no rank ever holds a second full copy on the device
    sharded_load = d.mesh is not None and config is None and Path(cfg.model).is_dir()
    if sharded_load:
        from zoo.checkpoint import read_config

        family, ck_config, _ = read_config(cfg.model)
        with torch.device("meta"):
            model = family.model_cls(ck_config, attn=cfg.attn)
    elif config is None:
        model = zoo.load(cfg.model, attn=cfg.attn, device=d.device)
    else:
        from zoo.layers import init_weights

        with torch.device("meta"):
            family = next(f for f in FAMILIES.values() if isinstance(config, f.config_cls))
            model = family.model_cls(config, attn=cfg.attn)
        model.to_empty(device=d.device)
        init_weights(model)
    if adapt is not None:
        adapt(model)
    if d.sp > 1:
        from zoo.parallel import SequenceParallel

        d.seq = SequenceParallel(d.mesh["sp"].get_group(), mode=cfg.sp_mode, ulysses_size=cfg.ulysses_size)
        d.seq.apply(model)
    param_dtype = None
    if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and d.device.type == "cuda"):
        param_dtype = torch.bfloat16
    fsdp_mesh = None
    if d.mesh is not None:  # shard over all dp x sp ranks: sp ranks hold the same weights too (as torchtitan)
        fsdp_mesh = d.mesh["dp"] if d.sp == 1 else d.mesh["dp", "sp"]._flatten("dp_sp")
    parallelize(model, fsdp_mesh, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                param_dtype=param_dtype)
    if sharded_load:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=d.device)
        full = zoo.load(cfg.model).state_dict() if d.main else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    model.autocast_dtype = param_dtype if d.mesh is None else None  # bf16 without FSDP: autocast instead
    return model


def build_optimizer(cfg: TrainConfig, model: nn.Module):
    """AdamW (weight decay on matrices and embeddings, not on norms and biases), warmup + cosine."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ZooError("nothing to train: every parameter is frozen")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)

    def schedule(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


# ---- checkpoints ----


def _identity(cfg: TrainConfig, model: nn.Module, data: PackedData) -> dict:
    """What a resumed run must share with the checkpoint."""
    return {"family": model.family, "model_config": json.loads(json.dumps(config_to_dict(model.config))),
            "data": data.fingerprint, "batch_tokens": cfg.batch_tokens, "seed": cfg.seed}


def _dcp_state(model: nn.Module, opt) -> tuple[dict, dict]:
    """Tensors only: DCP stores anything else by pickling, and zoo never unpickles. The rest goes to JSON."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd["state"]}, osd


def _storage(path: Path, write: bool):
    # the safetensors storage of DCP: shards with offsets in their headers, metadata as JSON, no pickle
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    if write:
        return HuggingFaceStorageWriter(str(path), save_distributed=True)
    return HuggingFaceStorageReader(str(path))


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


def save_checkpoint(cfg: TrainConfig, d: Dist, model, opt, sched, data: PackedData, step: int) -> Path:
    """OUT/checkpoints/step_N, written to a temporary directory first and renamed when complete."""
    import torch.distributed.checkpoint as dcp

    root = Path(cfg.out) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    tensors, osd = _dcp_state(model, opt)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_flat(tensors), storage_writer=_storage(tmp, write=True))
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


def latest_checkpoint(out: str | Path) -> Path | None:
    done = sorted(p for p in (Path(out) / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(cfg: TrainConfig, d: Dist, model, opt, sched, data: PackedData, path: Path) -> int:
    """Restore model, optimizer, scheduler and RNG from `path`; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
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
        dcp.load(flat, storage_reader=_storage(path, write=False))
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


def start_or_resume(cfg: TrainConfig, d: Dist, model, opt, sched, data: PackedData) -> int:
    out = Path(cfg.out)
    ckpt = latest_checkpoint(out) if cfg.resume else None
    if cfg.resume and ckpt is None and d.main:
        print(f"--resume: no checkpoint in {out / 'checkpoints'}, starting from step 0")
    if ckpt is None:
        if d.main:  # a fresh run replaces what an earlier run left in OUT
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
        d.barrier()
        return 0
    step = load_checkpoint(cfg, d, model, opt, sched, data, ckpt)
    if d.main:
        print(f"resumed from {ckpt} at step {step}")
        metrics = out / "metrics.jsonl"
        if metrics.is_file():  # drop what the interrupted run logged after this checkpoint
            keep = [ln for ln in metrics.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            metrics.write_text("".join(ln + "\n" for ln in keep))
    return step


# ---- the loop ----


def check_batch(cfg: TrainConfig, d: Dist) -> int:
    """Packs per rank per step (the gradient accumulation count)."""
    per_step, rest = divmod(cfg.batch_tokens, cfg.seq_len)
    if rest or per_step % d.dp:
        raise ZooError(f"--batch-tokens {cfg.batch_tokens} must be a multiple of --seq-len {cfg.seq_len} x "
                       f"dp {d.dp} = {cfg.seq_len * d.dp}")
    return per_step // d.dp


class Metrics:
    """metrics.jsonl, TensorBoard when installed, the progress bar; rank 0 only."""

    def __init__(self, cfg: TrainConfig, d: Dist, start: int):
        self.cfg, self.active = cfg, d.main
        self.out = Path(cfg.out)
        self.tb = self.bar = None
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.file = (self.out / "metrics.jsonl").open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tensorboard"))
        except ImportError:
            pass
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=start, desc=Path(cfg.out).name, unit="step", dynamic_ncols=True)

    def log(self, row: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k in ("loss", "lr", "tokens_per_s", "grad_norm"):
                self.tb.add_scalar(f"train/{k}", row[k], row["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        elif row["step"] % self.cfg.log_every == 0 or row["step"] == self.cfg.steps:
            print(f"step {row['step']:>6}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                  f"{row['tokens_per_s']:.0f} tok/s  grad_norm {row['grad_norm']:.3f}", flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.file.close()
        rows = [json.loads(ln) for ln in (self.out / "metrics.jsonl").read_text().splitlines() if ln]
        plot_loss([r["step"] for r in rows], [r["loss"] for r in rows], self.out / "loss.png",
                  title=f"{self.out.name} loss")


def train(cfg: TrainConfig, d: Dist, model, opt, sched, data: PackedData, start: int) -> list[float]:
    """Steps start+1 .. cfg.steps; returns the losses of those steps."""
    accum = check_batch(cfg, d)
    per_step = accum * d.dp
    metrics = Metrics(cfg, d, start)
    losses, tokens_seen = [], start * cfg.batch_tokens
    autocast = (torch.autocast(d.device.type, dtype=model.autocast_dtype) if model.autocast_dtype is not None
                else nullcontext())
    fsdp = d.mesh is not None
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        first = (step - 1) * per_step
        step_targets = sum(data.num_loss_tokens(first + j) for j in range(per_step))
        step_tokens = 0
        loss_sum = torch.zeros((), device=d.device)
        for a in range(accum):
            g = first + d.dp_rank * accum + a
            packed = data.pack(g)
            step_tokens += packed.num_tokens
            packed.num_loss_tokens = max(step_targets, 1)
            if d.seq is not None:  # every rank of the sp group holds the same global pack; keep its own part
                packed = d.seq.shard(packed)
            packed = packed.to(d.device)
            if fsdp:
                model.set_requires_gradient_sync(a == accum - 1)
            with autocast:
                loss = model.loss(packed)
            (loss * d.world).backward()  # see the averaging rule at the top of this file
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if dist.is_initialized():
            counts = torch.tensor([step_tokens], dtype=torch.float64, device=d.device)
            dist.all_reduce(loss_sum)
            dist.all_reduce(counts)
            step_tokens = int(counts.item()) // d.sp
        loss_value = loss_sum.item()
        losses.append(loss_value)
        tokens_seen += step_tokens
        dt = time.perf_counter() - t0
        metrics.log({"step": step, "loss": loss_value, "lr": lr, "tokens": tokens_seen,
                     "tokens_per_s": step_tokens / dt, "grad_norm": float(grad_norm), "loss_tokens": step_targets})
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            save_checkpoint(cfg, d, model, opt, sched, data, step)
    if cfg.steps > start:
        save_checkpoint(cfg, d, model, opt, sched, data, cfg.steps)
    metrics.close()
    return losses


# ---- export ----


def export(cfg: TrainConfig, d: Dist, model: nn.Module, tok: Tokenizer) -> Path:
    """OUT/model in zoo format (and OUT/model-hf with --export-hf); every rank gathers, rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(cfg.out) / "model"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d.main:
        with torch.device("meta"):  # a plain copy: FSDP has swapped the model's class for a sharded one
            plain = FAMILIES[model.family].model_cls(model.config, attn="eager")
        plain.load_state_dict(full, assign=True)
        zoo.save(plain, out, force=True, tokenizer_from=str(tok.dir))
        if cfg.export_hf:
            from convert.zoo_to_hf import main as zoo_to_hf

            zoo_to_hf([str(out), str(Path(cfg.out) / "model-hf"), "--force", "--quiet"])
        print(f"saved {out}" + (f" and {Path(cfg.out) / 'model-hf'}" if cfg.export_hf else ""))
    d.barrier()
    return out
