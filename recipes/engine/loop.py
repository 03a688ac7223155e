"""The training loop every recipe runs: optimizer, resume, the steps, metrics, checkpoints.

The averaging rule (DP x SP x gradient accumulation). One optimizer step sees P = batch_tokens / seq_len packs;
each data-parallel rank runs its P / dp of them one after another (accumulation), and each pack is split over the
sp ranks of its group. Every micro-batch's loss is computed with the denominator set to the number of target
tokens of the *whole step* (all packs, all ranks), so it is that micro-batch's share of the step's mean loss, and
the shares of all micro-batches on all ranks add up to it. Gradients must therefore be summed over ranks; FSDP
averages them over its mesh (dp x sp ranks), so each rank backpropagates `world * share`. The result is the
gradient of the global token-mean loss, whatever dp, sp and the accumulation count are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler

from recipes.data import PackedData
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.engine import checkpoint
from recipes.engine.build import autocast, build_optimizer, param_dtype
from recipes.engine.metrics import Metrics
from recipes.engine.moe import Balance
from recipes.engine.processes import Dist, Interrupted, StopSignals
from recipes.engine.sections import DataSection, LoRASection, RecipeConfig
from recipes.report.sample import Sampler, Unwrap
from zoo.errors import ZooError
from zoo.models import Model
from zoo.train.flops import matmul_peak, step_flops


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None where it means nothing: no measured peak (CPU), or a rate above the peak
    (the peak was measured low)."""
    return flops_per_s / peak if peak and flops_per_s <= peak else None

class StepFn(Protocol):
    """A step's forward and backward (forward_backward's signature and its four results); `balance`: the MoE
    balancing the model section asks for (None for a dense model), whose terms the step adds to its loss."""

    def __call__(self, d: Dist, model: Model, data: Any, step: int, accum: int,
                 context: AbstractContextManager[object], *, balance: Balance | None) -> tuple[Tensor, int, int, int]:
        ...


def train(cfg: RecipeConfig, d: Dist, model: Model, data: PackedData, eval_data: PackedData | None = None,
          lora: LoRASection | None = None, step_fn: StepFn | None = None,
          step_metrics: Callable[[], dict[str, float]] | None = None, unwrap: Unwrap | None = None) -> list[float]:
    """Train the parameters of `model` that require grad, from step 0 or (--resume) the latest checkpoint, to
    --steps; checkpoints every --save-every steps and at the end (of the adapters only, with `lora`); with
    `eval_data`, its loss every --eval-every steps and after the last. Returns the losses of the steps run.

    `step_fn` replaces `forward_backward` (recipes.dpo: a preference loss over pairs), and `step_metrics()`, called
    on every rank after each step, adds its own columns to the step's metrics row; `unwrap` takes off the attention
    wrapper the recipe installed for training where the sample generations of --sample-every run.

    SIGINT or SIGTERM (on any rank) stops every rank after the same step, writes that step's checkpoint and raises
    `Interrupted` (exit code 130 or 143); a second signal stops at once."""
    accum = packs_per_rank(cfg.data, d)
    m = cfg.model
    balance = Balance.for_model(model, m.aux_loss_coef, m.aux_loss, m.router_z_loss, m.router_bias_update_rate,
                                cfg.checkpoint.export_hf)
    step_fn = forward_backward if step_fn is None else step_fn
    opt, sched = build_optimizer(cfg.optim, cfg.run.steps, model)
    start = checkpoint.start_or_resume(cfg, d, model, opt, sched, data, lora)
    metrics = Metrics(cfg, d, start)
    sampler = sampler_for(cfg, unwrap)
    context = autocast(cfg.model, d)
    # MFU's denominator: this GPU's measured matmul rate in the compute dtype (one second or less, once). A CPU has
    # no such peak: measured under the load of the other processes it read 5x low (MFU 504.8%), so none is reported
    peak = matmul_peak(d.device, param_dtype(cfg.model, d) or torch.float32) if d.device.type == "cuda" else None
    losses: list[float] = []
    tokens_seen, last = start * cfg.data.batch_tokens, start
    with StopSignals() as signals:
        for step in range(start + 1, cfg.run.steps + 1):
            t0 = time.perf_counter()
            loss_sum, tokens, targets, flops = step_fn(d, model, data, step, accum, context, balance=balance)
            done = optimizer_step(cfg, d, model, opt, sched, step, loss_sum, tokens, targets, flops)
            losses.append(done.loss)
            tokens_seen += done.tokens
            row = done.row(tokens_seen, time.perf_counter() - t0, d.world, peak)
            if step_metrics is not None:
                row.update(step_metrics())
            if balance is not None:
                row.update(balance.end_step())
            if done.finite:
                row.update(evaluate_and_sample(cfg, d, model, eval_data, sampler, context, step))
            metrics.log(row)
            if not done.finite and stop_on_nonfinite(cfg, d, done):
                break
            last = step
            save_on_cadence_or_signal(cfg, d, model, opt, sched, data, step, lora, signals, metrics)
        if last > start:  # after a stop: the weights before the bad step, which never reached the optimizer
            checkpoint.save(cfg, d, model, opt, sched, data, last, lora)
    metrics.close()
    return losses


@dataclass
class StepDone:
    """What an optimizer step did, summed over all ranks: its loss, the gradient norm before clipping, the learning
    rate it stepped with, its tokens, targets and model FLOPs, and whether it was finite (else it was skipped)."""

    step: int
    loss: float
    grad_norm: float
    lr: float | Tensor  # as the schedule gives it
    tokens: int
    targets: int
    flops: int

    @property
    def finite(self) -> bool:  # the same on every rank: both are global
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)

    def row(self, tokens_seen: int, dt: float, world: int, peak: float | None) -> dict[str, Any]:
        """The step's metrics row, `dt` seconds after it began."""
        per_device = self.flops / dt / world  # model FLOPs (zoo.train.flops) per second per process
        return {"step": self.step, "loss": self.loss, "lr": self.lr, "tokens": tokens_seen,
                "tokens_per_s": self.tokens / dt, "tflops": per_device / 1e12, "mfu": mfu(per_device, peak),
                "grad_norm": self.grad_norm, "loss_tokens": self.targets, "skipped": not self.finite}


def optimizer_step(cfg: RecipeConfig, d: Dist, model: Model, opt: torch.optim.Optimizer, sched: LRScheduler,
                   step: int, loss_sum: Tensor, tokens: int, targets: int, flops: int) -> StepDone:
    """After the forwards and backwards of `step` (this rank's summed loss shares, tokens and FLOPs, the targets of
    the whole step): the gradients clipped, the loss and counts summed over the ranks, the optimizer and schedule
    stepped where the loss and the gradient norm are finite, the gradients cleared."""
    grad_norm = clip_gradients(cfg.optim.grad_clip, d, model)
    lr = sched.get_last_lr()[0]
    if dist.is_initialized():
        counts = torch.tensor([tokens, flops], dtype=torch.float64, device=d.device)
        dist.all_reduce(loss_sum)
        dist.all_reduce(counts)
        # the sp ranks of a group all counted the same packs
        tokens, flops = int(counts[0].item()) // d.sp, int(counts[1].item()) // d.sp
    done = StepDone(step, loss_sum.item(), float(grad_norm), lr, tokens, targets, flops)
    if targets == 0 and d.main:
        print(f"step {step}: no token of its batch is a target (every label masked), so its loss is 0 and it "
              "teaches nothing; check the data's label masks", flush=True)
    if done.finite:
        opt.step()
        sched.step()
    opt.zero_grad(set_to_none=True)
    return done


def clip_gradients(grad_clip: float, d: Dist, model: Model) -> Tensor:
    """The norm of the trained parameters' gradients, clipped to --grad-clip (0: not clipped), as one tensor."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if d.expert_parallel is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip if grad_clip > 0 else math.inf)
    else:  # the experts' gradients: summed over their replicas, on a mesh of their own
        from zoo.parallel.expert import clip_grad_norm_

        d.expert_parallel.reduce_expert_grads(model, scale=1 / d.world)
        grad_norm = clip_grad_norm_(trained, grad_clip if grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def evaluate_and_sample(cfg: RecipeConfig, d: Dist, model: Model, eval_data: PackedData | None,
                        sampler: Sampler | None, context: AbstractContextManager[object], step: int) -> dict[str, Any]:
    """The columns of a finite step's row that --eval-every and --sample-every add when due (and after the last
    step): eval_loss and its perplexity, the samples."""
    row: dict[str, Any] = {}
    every = cfg.data.eval_every
    if eval_data is not None and (step == cfg.run.steps or (every and step % every == 0)):
        eval_loss = evaluate(d, model, eval_data, context)
        row["eval_loss"] = eval_loss
        row["eval_ppl"] = math.exp(min(eval_loss, 700.0))  # its perplexity (capped below a float's overflow)
    if sampler is not None and sampler.due(step, cfg.run.steps):
        row["samples"] = sampler(model, d.device, d.fsdp_mesh is not None)  # every rank: the same forwards (FSDP)
    return row


def stop_on_nonfinite(cfg: RecipeConfig, d: Dist, done: StepDone) -> bool:
    """Whether the run stops at a step whose loss or gradient norm is not finite (--nonfinite stop), saying so."""
    what = f"step {done.step}: loss {done.loss}, gradient norm {done.grad_norm}"
    if cfg.run.nonfinite == "stop":
        if d.main:
            print(f"{what}: stopping with the weights of step {done.step - 1} (--nonfinite skip would skip such steps)",
                  flush=True)
        return True
    if d.main:
        print(f"{what}: step skipped, weights unchanged (--nonfinite skip)", flush=True)
    return False


def save_on_cadence_or_signal(cfg: RecipeConfig, d: Dist, model: Model, opt: torch.optim.Optimizer,
                              sched: LRScheduler, data: PackedData, step: int, lora: LoRASection | None,
                              signals: StopSignals, metrics: Metrics) -> None:
    """The checkpoint of --save-every after `step` (not after the last: the loop saves that one), and on a signal
    that step's checkpoint, then `Interrupted`. Every rank asks at every step, so all stop after the same one; a
    signal during the last step changes nothing, the run is complete. The checkpoint is --save-every's, so --resume
    continues exactly."""
    save_every = cfg.checkpoint.save_every
    saved = None
    if save_every and step % save_every == 0 and step < cfg.run.steps:
        saved = checkpoint.save(cfg, d, model, opt, sched, data, step, lora)
    signum = signals.agreed(d)
    if signum and step < cfg.run.steps:
        path = saved or checkpoint.save(cfg, d, model, opt, sched, data, step, lora)
        metrics.close()
        if d.main:
            print(f"interrupted at step {step} of {cfg.run.steps}: checkpoint {path} written; resume with the same "
                  "command and --resume", flush=True)
        raise Interrupted(signum)


def sampler_for(cfg: RecipeConfig, unwrap: Unwrap | None = None) -> Sampler | None:
    """The run's sampler, None with --sample-every 0 (the default)."""
    if not cfg.log.sample_every:
        return None
    tok = find_tokenizer(cfg.model.tokenizer, cfg.model.name)
    return Sampler(tok, cfg.data.template(), cfg.log.sample_every, cfg.log.sample_tokens, cfg.log.sample_prompts,
                   unwrap)


def evaluate(d: Dist, model: Model, data: PackedData, context: AbstractContextManager[object]) -> float:
    """The token-mean loss over every pack of `data`, without gradients or dropout. Pack i goes to data-parallel
    rank i % dp (cut over its sp group); every rank runs the same number of forwards, since FSDP's gather is
    collective, the extra ones on a repeated pack counted zero times. Each share is divided by the targets of all
    packs, so the shares summed over all ranks are the mean, as in training."""
    n, targets = len(data), max(sum(data.loss_tokens), 1)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=d.device)
    with torch.no_grad():
        for k in range(math.ceil(n / d.dp)):
            i = k * d.dp + d.dp_rank
            packed = data.in_order(i % n)
            if d.sequence_parallel is not None:
                packed = d.sequence_parallel.shard(packed)
            with context:
                loss = model.loss(packed.to(d.device), denominator=targets)
            total += loss.float() * (i < n)
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item()


def packs_per_rank(cfg: DataSection, d: Dist) -> int:
    """Packs per data-parallel rank per step (the gradient accumulation count)."""
    per_step, rest = divmod(cfg.batch_tokens, cfg.seq_len)
    if rest or per_step % d.dp:
        raise ZooError(f"--batch-tokens {cfg.batch_tokens} must be a multiple of --seq-len {cfg.seq_len} x "
                       f"dp {d.dp} = {cfg.seq_len * d.dp}")
    return per_step // d.dp


def forward_backward(d: Dist, model: Model, data: PackedData, step: int, accum: int,
                     context: AbstractContextManager[object], *,
                     balance: Balance | None = None) -> tuple[Tensor, int, int, int]:
    """Forward and backward of this rank's `accum` packs of `step`, gradients accumulating. Returns this rank's
    summed loss shares, its token count, the target count of the whole step, and its packs' model FLOPs. A
    Mixture-of-Experts model's loss takes `balance`'s terms, whose parts it sums for the step's metrics."""
    per_step = accum * d.dp
    first = (step - 1) * per_step
    step_targets = sum(data.num_loss_tokens(first + j) for j in range(per_step))
    tokens = flops = 0
    loss_sum = torch.zeros((), device=d.device)
    fsdp = None
    if d.fsdp_mesh is not None:  # imported only where FSDP runs: it adds half a second to every start
        from torch.distributed.fsdp import FSDPModule

        fsdp = model if isinstance(model, FSDPModule) else None
    for a in range(accum):
        packed = data.pack(first + d.dp_rank * accum + a)
        tokens += packed.num_tokens
        # images: Qwen-VL's grids (its pixel_values are patches), else pixel tensors [I, C, S, S]
        grids = packed.image_grid_thw if packed.image_grid_thw is not None else packed.pixel_values
        images = 0 if grids is None else grids.shape[0]
        flops += step_flops(model, packed.seqlens(), images,
                            () if packed.image_grid_thw is None else packed.image_grid_thw.tolist())
        if d.sequence_parallel is not None:  # the sp ranks of a group hold the same global pack; keep one's part
            packed = d.sequence_parallel.shard(packed)
        packed = packed.to(d.device)
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(a == accum - 1)
        with context:  # the loss's denominator: the whole step's targets, not this pack's (the averaging rule above)
            if balance is None:
                loss = model.loss(packed, denominator=max(step_targets, 1))
            else:
                loss = balance.loss(model, packed, max(step_targets, 1))
        (loss * d.world).backward()
        loss_sum += loss.detach()
    return loss_sum, tokens, step_targets, flops
