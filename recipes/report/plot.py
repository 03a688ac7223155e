"""The loss curve as a PNG: matplotlib when installed (the `plot` extra), else the same figure drawn here on a small
canvas (recipes.report.raster): title, axes with numbered ticks and labels, the raw and smoothed training loss,
the eval loss as points, a legend."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from recipes.report.raster import Canvas, text_width


def plot_loss(steps: list[int], losses: list[float], path: str | Path, title: str = "training loss",
              eval_steps: list[int] | None = None, eval_losses: list[float] | None = None) -> None:
    """The training loss (blue) and, when given, the eval loss (orange) over the steps."""
    if not steps:
        return
    eval_steps, eval_losses = eval_steps or [], eval_losses or []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        draw_plot(steps, losses, title, eval_steps, eval_losses).save(path)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    smooth = _ema(losses)
    ax.plot(steps, losses, alpha=0.35 if len(losses) > 10 else 1.0, label="train")
    if len(losses) > 10:  # the trend through the step-to-step noise
        ax.plot(steps, smooth, color="C0", label="train (smoothed)")
        ax.legend()
    if eval_steps:
        ax.plot(eval_steps, eval_losses, marker="o", label="eval")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ema(values: Sequence[float], alpha: float = 0.1) -> list[float]:
    """An exponential moving average, started at the first value."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else (1 - alpha) * out[-1] + alpha * v)
    return out


TRAIN, TRAIN_RAW, EVAL = (31, 119, 180), (174, 199, 232), (255, 127, 14)  # matplotlib's C0, C0 faded, C1
INK, GRID, FRAME = (40, 40, 40), (228, 228, 228), (120, 120, 120)


def draw_plot(steps: Sequence[float], losses: Sequence[float], title: str, eval_steps: Sequence[float] = (),
              eval_losses: Sequence[float] = (), width: int = 720, height: int = 450) -> Canvas:
    """The matplotlib figure's content drawn by hand: the title, axes with numbered ticks and labels, gridlines, the
    training loss (faded) with its moving average over it where there are more than 10 steps, the eval loss as
    points joined by a line, and a legend."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 92, width - 20, 44, height - 58
    series = [("train", steps, losses, TRAIN if len(losses) <= 10 else TRAIN_RAW, 1, False)]
    if len(losses) > 10:  # the trend through the step-to-step noise
        series.append(("train (smoothed)", steps, _ema(losses), TRAIN, 3, False))
    if eval_steps:
        series.append(("eval", eval_steps, eval_losses, EVAL, 2, True))

    xs = [x for _, sx, *_ in series for x in sx]
    ys = [y for _, _, sy, *_ in series for y in sy]
    x0, x1 = _padded(min(xs), max(xs), 0.0)
    y0, y1 = _padded(min(ys), max(ys), 0.05)

    def at(x: float, y: float) -> tuple[int, int]:
        px = left + (x - x0) / (x1 - x0) * (right - left)
        return round(px), round(bottom - (y - y0) / (y1 - y0) * (bottom - top))

    for y, label in _ticks(y0, y1):
        _, py = at(x0, y)
        canvas.line([(left, py), (right, py)], GRID)
        canvas.line([(left - 4, py), (left, py)], FRAME)
        canvas.text(left - 8 - text_width(label), py - 7, label, INK)
    for x, label in _ticks(x0, x1, integers=True):
        px, _ = at(x, y0)
        canvas.line([(px, top), (px, bottom)], GRID)
        canvas.line([(px, bottom), (px, bottom + 4)], FRAME)
        canvas.text(px - text_width(label) // 2, bottom + 9, label, INK)
    canvas.rect(left, top, right, bottom, FRAME, fill=False)
    canvas.text((left + right - text_width("step")) // 2, bottom + 32, "step", INK)
    canvas.text(8, (top + bottom + text_width("loss")) // 2, "loss", INK, vertical=True)
    scale = 2 if text_width(title) <= width - 20 else 1  # a long run name: the small font, then cut
    title = title[: (width - 20) // (6 * scale)]
    canvas.text((width - text_width(title, scale)) // 2, 14, title, INK, scale)

    for _, sx, sy, rgb, thick, points in series:
        pts = [at(x, y) for x, y in zip(sx, sy, strict=True)]
        canvas.line(pts, rgb, thick)
        for px, py in pts if points else []:
            canvas.rect(px - 3, py - 3, px + 3, py + 3, rgb)

    # the legend, in the top right corner (a loss falls: that corner is where the curves are not)
    box_w = 50 + max(text_width(name) for name, *_ in series)
    bx, by = right - 10 - box_w, top + 10
    canvas.rect(bx, by, bx + box_w, by + 8 + 22 * len(series), (255, 255, 255))
    canvas.rect(bx, by, bx + box_w, by + 8 + 22 * len(series), FRAME, fill=False)
    for k, (name, _, _, rgb, thick, points) in enumerate(series):
        cy = by + 15 + 22 * k
        canvas.line([(bx + 8, cy), (bx + 36, cy)], rgb, max(thick, 2))
        if points:
            canvas.rect(bx + 19, cy - 3, bx + 25, cy + 3, rgb)
        canvas.text(bx + 44, cy - 7, name, INK)
    return canvas


def _padded(lo: float, hi: float, margin: float) -> tuple[float, float]:
    """[lo, hi] widened by `margin` of its span on each side; a single value gets a span of its own."""
    if hi - lo <= 1e-12:
        half = max(abs(lo) * 0.05, 0.5)
        return lo - half, hi + half
    pad = (hi - lo) * margin
    return lo - pad, hi + pad


def _ticks(lo: float, hi: float, integers: bool = False) -> list[tuple[float, str]]:
    """Four to seven round values in [lo, hi] (steps of 1, 2 or 5 times a power of ten) with their labels, printed to
    the step's decimals."""
    raw = (hi - lo) / 6
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    if integers:
        step = max(step, 1.0)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    first = math.ceil(lo / step - 1e-9)
    return [(k * step, f"{k * step:.{decimals}f}") for k in range(first, math.floor(hi / step + 1e-9) + 1)]
