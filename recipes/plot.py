"""The loss curve as a PNG: matplotlib when installed, else a small line plot drawn here and written with zlib."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path


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
        write_png(path, draw_curve(steps, losses, extra=(eval_steps, eval_losses)))
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


# 3x5 pixel digits for the axis labels, one row string per glyph row
GLYPHS = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"), "-": ("000", "000", "111", "000", "000"),
}


def draw_curve(xs: Sequence[float], ys: Sequence[float], width: int = 640, height: int = 400,
               extra: tuple[Sequence[float], Sequence[float]] = ([], [])) -> list[bytearray]:
    """RGB rows: white background, grey axes and gridlines labelled with their values, the curve in blue, `extra`
    (xs, ys) in orange on the same axes."""
    rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    left, right, top, bottom = 60, width - 20, 20, height - 30

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            rows[y][3 * x : 3 * x + 3] = bytes(rgb)

    def text(x: int, y: int, s: str, scale: int = 2) -> None:
        for k, ch in enumerate(s):
            for r, line in enumerate(GLYPHS.get(ch, ("000",) * 5)):
                for c, bit in enumerate(line):
                    if bit == "1":
                        for dy in range(scale):
                            for dx in range(scale):
                                put(x + (4 * k + c) * scale + dx, y + r * scale + dy, (60, 60, 60))

    for k in range(5):  # horizontal gridlines
        y = top + k * (bottom - top) // 4
        for x in range(left, right + 1):
            put(x, y, (225, 225, 225))
    for y in range(top, bottom + 1):
        put(left, y, (90, 90, 90))
    for x in range(left, right + 1):
        put(x, bottom, (90, 90, 90))
    x0, x1 = min(xs), max(xs)
    y0, y1 = min([*ys, *extra[1]]), max([*ys, *extra[1]])
    for k in range(5):
        text(4, top + k * (bottom - top) // 4 - 5, f"{y1 - k * (y1 - y0) / 4:.2f}")
    text(left, bottom + 8, f"{x0:g}")
    text(right - 8 * len(f"{x1:g}"), bottom + 8, f"{x1:g}")
    sx = (right - left) / max(x1 - x0, 1e-9)
    sy = (bottom - top) / max(y1 - y0, 1e-9)
    for cx, cy, rgb in ((xs, ys, (31, 119, 180)), (*extra, (255, 127, 14))):
        pts = [(round(left + (x - x0) * sx), round(bottom - (y - y0) * sy)) for x, y in zip(cx, cy, strict=True)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:] or pts, strict=False):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for i in range(n + 1):  # a 2-pixel-thick straight segment
                x, y = round(ax + (bx - ax) * i / n), round(ay + (by - ay) * i / n)
                put(x, y, rgb)
                put(x, y + 1, rgb)
    return rows


def write_png(path: str | Path, rows: list[bytearray]) -> None:
    height, width = len(rows), len(rows[0]) // 3

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + bytes(r) for r in rows)  # filter type 0 per row
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)
