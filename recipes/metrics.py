"""What a run reports, on rank 0: OUT/metrics.jsonl (one line per step), TensorBoard when installed, the progress
bar (or a printed line every --log-every steps), and OUT/loss.png at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path

from recipes.config import TrainConfig
from recipes.plot import plot_loss
from recipes.processes import Dist


class Metrics:
    """Open for the steps start+1 .. cfg.steps: `log(row)` once per step, `close()` after the last."""

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
            for k in ("loss", "lr", "tokens_per_s", "mfu", "grad_norm"):
                self.tb.add_scalar(f"train/{k}", row[k], row["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                 mfu=f"{row['mfu']:.1%}", refresh=False)
            self.bar.update(1)
        elif row["step"] % self.cfg.log_every == 0 or row["step"] == self.cfg.steps:
            print(f"step {row['step']:>6}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                  f"{row['tokens_per_s']:.0f} tok/s  {row['tflops']:.3g} TFLOP/s  MFU {row['mfu']:.1%}  "
                  f"grad_norm {row['grad_norm']:.3f}", flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.file.close()
        rows = [r for r in read_rows(self.out / "metrics.jsonl") if math.isfinite(r["loss"])]  # skipped steps: out
        plot_loss([r["step"] for r in rows], [r["loss"] for r in rows], self.out / "loss.png",
                  title=f"{self.out.name} loss")


def read_rows(path: Path) -> list[dict]:
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
