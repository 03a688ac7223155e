"""What a run reports, on rank 0: OUT/metrics.jsonl (one line per step), TensorBoard with --tensorboard, Weights &
Biases with --wandb (the same scalars), the progress bar (or a printed line every --log-every steps), the sample
generations of --sample-every (recipes/report/sample.py), and OUT/loss.png at the end (and OUT/aux_loss.png for a
Mixture-of-Experts model)."""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from recipes.engine.moe import COLLAPSED_AFTER
from recipes.engine.processes import Dist
from recipes.engine.sections import RecipeConfig
from recipes.report.plot import plot_loss
from recipes.report.sample import sample_lines
from zoo.errors import ZooError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm


# what a Mixture-of-Experts run adds to each row (recipes/engine/moe.py)
MOE_COLUMNS = ("aux_loss", "z_loss", "expert_load_max", "expert_load_min", "experts_idle")
# what a preference run's line shows of its row, by TRL's names
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


class Metrics:
    """Open for the steps start+1 .. --steps: `log(row)` once per step, `close()` after the last."""

    tb: SummaryWriter | None = None
    wandb: Any = None  # a wandb Run (untyped)
    bar: tqdm[NoReturn] | None = None
    collapse_said = False

    def __init__(self, cfg: RecipeConfig, d: Dist, start: int):
        self.steps, self.log_every, self.active = cfg.run.steps, cfg.log.log_every, d.main
        self.out = Path(cfg.run.out)
        wandb = None
        if cfg.log.wandb:  # on every rank, before anything is written: a missing package is a refusal
            try:
                wandb = importlib.import_module("wandb")
            except ImportError:
                raise ZooError("--wandb logs to Weights & Biases, which is not installed: pip install wandb (or "
                               "leave --wandb out)") from None
        writer: type[SummaryWriter] | None = None
        if cfg.log.tensorboard:  # the same: a refusal on every rank before anything is written
            try:
                from torch.utils.tensorboard import SummaryWriter as found
            except ImportError:
                raise ZooError("--tensorboard writes OUT/tensorboard with TensorBoard, which is not installed: pip "
                               "install 'zoo[tensorboard]' (or tensorboard; or leave --tensorboard out)") from None
            writer = found
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        if wandb is not None:  # its mode from WANDB_MODE (offline: no account, synced later with `wandb sync`)
            self.wandb = wandb.init(project=cfg.log.wandb_project, name=self.out.name, dir=str(self.out),
                                    config={"steps": cfg.run.steps, "start": start})
        self.file = (self.out / "metrics.jsonl").open("a")
        if writer is not None:
            self.tb = writer(str(self.out / "tensorboard"))
        # a bar redraws itself with carriage returns: on a terminal only; a log file gets plain lines instead
        if cfg.log.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, initial=start, desc=self.out.name, unit="step", dynamic_ncols=True)

    def log(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        scalars = scalars_of(row)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                 **({} if row["mfu"] is None else {"mfu": f"{row['mfu']:.1%}"}),
                                 **{k.split("/")[-1]: f"{row[k]:.3g}" for k in ("rewards/margins", "aux_loss")
                                    if isinstance(row.get(k), float)}, refresh=False)
            self.bar.update(1)
            if "eval_loss" in row:
                self.bar.write(f"step {row['step']}: {_eval(row)}")
        elif row["step"] % self.log_every == 0 or row["step"] == self.steps:
            print(f"step {row['step']:>6}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                  f"{row['tokens_per_s']:.0f} tok/s  {row['tflops']:.3g} TFLOP/s  "
                  + ("" if row["mfu"] is None else f"MFU {row['mfu']:.1%}  ") +
                  f"grad_norm {row['grad_norm']:.3f}" + step_extras(row) + (f"  {_eval(row)}" if "eval_loss" in row
                                                                             else ""), flush=True)
        elif "eval_loss" in row:
            print(f"step {row['step']:>6}  {_eval(row)}", flush=True)
        if row.get("experts_idle") and not self.collapse_said:
            self.collapse_said = True
            say = print if self.bar is None else self.bar.write
            say(f"warning: step {row['step']}: {row['experts_idle']} expert{'s' if row['experts_idle'] > 1 else ''} "
                f"received no token for {COLLAPSED_AFTER} steps in a row: the router has collapsed onto the others "
                "(a larger --aux-loss-coef, or --router-bias-update-rate, balances it); experts_idle in "
                "metrics.jsonl counts them at every step")
        if row.get("samples"):
            lines = f"step {row['step']} samples:\n" + sample_lines(row["samples"])
            if self.bar is not None:
                self.bar.write(lines)
            else:
                print(lines, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.file.close()
        rows = [r for r in read_rows(self.out / "metrics.jsonl") if math.isfinite(r["loss"])]  # skipped steps: out
        evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float)) and math.isfinite(r["eval_loss"])]
        plot_loss([r["step"] for r in rows], [r["loss"] for r in rows], self.out / "loss.png",
                  title=f"{self.out.name} loss", eval_steps=[r["step"] for r in evals],
                  eval_losses=[r["eval_loss"] for r in evals])
        moe = [r for r in rows if isinstance(r.get("aux_loss"), (int, float)) and math.isfinite(r["aux_loss"])]
        if moe:  # a Mixture-of-Experts run: its balancing loss, and the most loaded expert's share (1.0: even)
            plot_loss([r["step"] for r in moe], [r["aux_loss"] for r in moe], self.out / "aux_loss.png",
                      title=f"{self.out.name} load-balancing loss (orange: most loaded expert x E)",
                      eval_steps=[r["step"] for r in moe], eval_losses=[r["expert_load_max"] for r in moe])


def step_extras(row: dict[str, Any]) -> str:
    """What a recipe adds to the printed step line: a preference run's rewards (TRL's names), a Mixture-of-Experts
    run's balancing loss and expert load (the least and most loaded expert's share x E: 1.00-1.00 is even)."""
    parts = [f"{k} {row[k]:.4f}" for k in REWARDS if isinstance(row.get(k), (int, float))]
    if isinstance(row.get("aux_loss"), (int, float)):
        parts.append(f"aux_loss {row['aux_loss']:.4f}  expert load {row['expert_load_min']:.2f}-"
                     f"{row['expert_load_max']:.2f}")
    return "".join(f"  {p}" for p in parts)


def scalars_of(row: dict[str, Any]) -> dict[str, float]:
    """The scalars of a row that TensorBoard and Weights & Biases get, by their names there."""
    found = {f"train/{k}": row[k] for k in ("loss", "lr", "tokens_per_s", "mfu", "grad_norm", *MOE_COLUMNS)
             if row.get(k) is not None}
    if "eval_loss" in row:
        found["eval/loss"] = row["eval_loss"]
        if "eval_ppl" in row:
            found["eval/perplexity"] = row["eval_ppl"]
    return found


def _eval(row: dict[str, Any]) -> str:
    """The eval loss of a row, and its perplexity where the recipe gives one (a preference loss has none)."""
    ppl = f" (perplexity {row['eval_ppl']:.4g})" if "eval_ppl" in row else ""
    return f"eval_loss {row['eval_loss']:.4f}{ppl}"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line cut short by a killed run (the last one) is left out."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("loss"), (int, float)):
            rows.append(row)
    return rows


@dataclass(frozen=True)
class Result:
    """What a recipe's `run(cfg)` returns (every process alike): where the run's outputs are (None where it wrote
    none), the losses of the steps it ran and the last row of its metrics."""

    out: Path
    model: Path | None  # OUT/model: the trained (for LoRA: merged) model in zoo's layout
    model_hf: Path | None  # OUT/model-hf (--export-hf)
    adapter: Path | None  # OUT/adapter in PEFT's layout (LoRA)
    metrics: Path
    losses: list[float]
    last: dict[str, Any]  # the last step's row of metrics.jsonl (loss, eval_loss, tokens_per_s, ...)

    @staticmethod
    def of(cfg: RecipeConfig, losses: list[float]) -> Result:
        out = Path(cfg.run.out)

        def made(name: str) -> Path | None:
            return out / name if (out / name).is_dir() else None

        rows = read_rows(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
        return Result(out, made("model"), made("model-hf"), made("adapter"), out / "metrics.jsonl", losses,
                      rows[-1] if rows else {})


def summary(cfg: RecipeConfig, d: Dist, losses: list[float], started: float, adapter: bool = False) -> str | None:
    """The line a run ends with (rank 0): steps run, first and last loss (and eval loss), wall time since
    `started` (time.perf_counter()), training tokens/s (tokens over the steps' own time), and where the outputs
    are (OUT/adapter too, for a LoRA run: `adapter`)."""
    if not d.main:
        return None
    out = Path(cfg.run.out)
    every = read_rows(out / "metrics.jsonl")
    rows = every[-len(losses):] if losses else []
    # `tokens` is the running total, which a run (or a resumed one) starts at (its first step - 1) x batch_tokens
    before = [(r["step"] - 1) * cfg.data.batch_tokens for r in rows[:1]] + [r["tokens"] for r in rows[:-1]]
    own = [r["tokens"] - b for r, b in zip(rows, before)]
    train_s = sum(t / r["tokens_per_s"] for t, r in zip(own, rows) if r["tokens_per_s"] > 0)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    parts = [f"done: {len(losses)} step{'' if len(losses) == 1 else 's'}"
             + (f" ({rows[0]['step']}-{rows[-1]['step']})" if rows else ""),
             f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step run",
             # after --resume: the whole run too, from its first step
             f"the whole run {every[0]['step']}-{every[-1]['step']}: loss {every[0]['loss']:.4f} -> "
             f"{every[-1]['loss']:.4f}" if rows and every[0]["step"] < rows[0]["step"] else "",
             f"eval_loss {evals[-1]:.4f}" if evals else "",
             f"{time.perf_counter() - started:.1f} s",
             f"{sum(own) / train_s:.0f} tokens/s" if train_s else "",
             f"model: {out / 'model'}",
             f"adapter: {out / 'adapter'}" if adapter and (out / "adapter").is_dir() else "",
             f"metrics: {out / 'metrics.jsonl'}", f"plot: {out / 'loss.png'}"]
    line = ", ".join(p for p in parts if p)
    print(line, flush=True)
    return line
