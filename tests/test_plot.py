"""The loss plot without matplotlib (recipes.report.plot's own drawing): a PNG that decodes, with a title, numbered
axes, axis labels, a legend, the raw and the smoothed training loss and the eval points, each where the figure puts
it."""

from __future__ import annotations

import math
import struct
import sys
import zlib

from recipes.report.plot import EVAL, INK, TRAIN, TRAIN_RAW, plot_loss


def read_png(path) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB PNG whose rows are unfiltered, as recipes.report.raster writes it."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, dict[bytes, bytes]()
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == height * stride and all(raw[i * stride] == 0 for i in range(height))
    return width, height, [raw[i * stride + 1 : (i + 1) * stride] for i in range(height)]


def count(rows, rgb, x0, y0, x1, y1) -> int:
    """Pixels of colour `rgb` in the box [x0, x1) x [y0, y1)."""
    px = bytes(rgb)
    return sum(row[3 * x : 3 * x + 3] == px for row in rows[y0:y1] for x in range(x0, x1))


def test_the_fallback_draws_a_whole_figure(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    steps = list(range(1, 61))
    losses = [6 * math.exp(-s / 20) + 2 + 0.3 * math.sin(3 * s) for s in steps]  # a falling, noisy loss
    evals = [10, 20, 30, 40, 50, 60]
    plot_loss(steps, losses, tmp_path / "loss.png", title="run loss", eval_steps=evals,
              eval_losses=[6 * math.exp(-s / 20) + 2.3 for s in evals])
    width, height, rows = read_png(tmp_path / "loss.png")
    assert (width, height) == (720, 450)
    left, right, top, bottom = 92, width - 20, 44, height - 58  # recipes.report.plot's plot area
    assert count(rows, INK, 0, 0, width, top - 6) > 40  # the title
    assert count(rows, INK, 30, top, left - 6, bottom) > 60  # the y-axis numbers
    assert count(rows, INK, 0, top, 28, bottom) > 20  # the y-axis label
    assert count(rows, INK, left, bottom + 6, right, bottom + 28) > 40  # the x-axis numbers
    assert count(rows, INK, left, bottom + 30, right, height) > 20  # the x-axis label
    legend = (right - 260, top + 4, right, top + 80)
    assert count(rows, INK, *legend) > 150  # three names: train, train (smoothed), eval
    for rgb in (TRAIN_RAW, TRAIN, EVAL):  # each series' sample line in the legend, and its curve in the plot
        assert count(rows, rgb, *legend) > 20, rgb
        assert count(rows, rgb, left + 1, top + 90, right, bottom) > 100, rgb
    assert count(rows, INK, 0, 0, width, top - 6) != _title_ink(tmp_path, monkeypatch, "a longer title, step 60")


def _title_ink(tmp_path, monkeypatch, title: str) -> int:
    """The title band's ink for another title (the title is text that was drawn, not a fixed picture)."""
    plot_loss([1, 2, 3], [3.0, 2.5, 2.4], tmp_path / "other.png", title=title)
    width, _, rows = read_png(tmp_path / "other.png")
    return count(rows, INK, 0, 0, width, 38)


def test_few_steps_draw_one_curve_and_a_single_value_draws(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    plot_loss([1, 2, 3], [3.0, 2.5, 2.4], tmp_path / "few.png")
    _, _, rows = read_png(tmp_path / "few.png")
    assert count(rows, TRAIN, 0, 0, 720, 450) > 100 and count(rows, TRAIN_RAW, 0, 0, 720, 450) == 0  # no smoothing
    plot_loss([5], [2.0], tmp_path / "one.png")  # one step: a span of its own, no division by zero
    _, _, rows = read_png(tmp_path / "one.png")
    assert count(rows, INK, 0, 0, 720, 450) > 100
