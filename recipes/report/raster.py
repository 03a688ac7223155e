"""A small RGB canvas for recipes.report.plot where matplotlib is missing: pixels, lines, a 5x7 bitmap font, PNG files.

Standard library only (PNG is zlib-compressed rows). The font holds the characters a loss plot writes: digits,
letters (capitals too, for run names), and the punctuation of numbers and file names; any other character is drawn
as a hollow box, so a title never fails to draw.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

RGB = tuple[int, int, int]

# 5x7 glyphs (g j p q y descend to an 8th row) as 5 column bytes, bit 0 the top row; hex for brevity
FONT = {
    " ": "0000000000", ".": "0060600000", ",": "0050300000", ":": "0036360000", "-": "0808080808",
    "_": "4040404040", "+": "08083e0808", "=": "1414141414", "/": "2010080402", "(": "001c224100",
    ")": "0041221c00", "%": "2313086462", "'": "0005030000", "#": "147f147f14", "?": "0201510906",
    "0": "3e5149453e", "1": "00427f4000", "2": "4261514946", "3": "2141454b31", "4": "1814127f10",
    "5": "2745454539", "6": "3c4a494930", "7": "0171090503", "8": "3649494936", "9": "064949291e",
    "a": "2054545478", "b": "7f48444438", "c": "3844444420", "d": "384444487f", "e": "3854545418",
    "f": "087e090102", "g": "18a4a4a47c", "h": "7f08040478", "i": "00447d4000", "j": "4080847d00",
    "k": "7f10284400", "l": "00417f4000", "m": "7c04180478", "n": "7c08040478", "o": "3844444438",
    "p": "fc24242418", "q": "18242418fc", "r": "7c08040408", "s": "4854545420", "t": "043f444020",
    "u": "3c4040207c", "v": "1c2040201c", "w": "3c4030403c", "x": "4428102844", "y": "1ca0a0a07c",
    "z": "4464544c44", "A": "7e1111117e", "B": "7f49494936", "C": "3e41414122", "D": "7f4141221c",
    "E": "7f49494941", "F": "7f09090901", "G": "3e4149497a", "H": "7f0808087f", "I": "00417f4100",
    "J": "2040413f01", "K": "7f08142241", "L": "7f40404040", "M": "7f020c027f", "N": "7f0408107f",
    "O": "3e4141413e", "P": "7f09090906", "Q": "3e4151215e", "R": "7f09192946", "S": "4649494931",
    "T": "01017f0101", "U": "3f4040403f", "V": "1f2040201f", "W": "3f4038403f", "X": "6314081463",
    "Y": "0708700807", "Z": "6151494543",
}
UNKNOWN = "7f4141417f"  # a hollow box
ADVANCE = 6  # a glyph's 5 columns and a blank one, in font pixels


class Canvas:
    """RGB rows on a white background; drawing outside it is clipped."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def put(self, x: int, y: int, rgb: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x : 3 * x + 3] = bytes(rgb)

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: RGB, fill: bool = True) -> None:
        """The rectangle with corners (x0, y0) and (x1, y1), inclusive; filled, or its outline."""
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                if fill or y in (y0, y1) or x in (x0, x1):
                    self.put(x, y, rgb)

    def line(self, points: list[tuple[int, int]], rgb: RGB, width: int = 1) -> None:
        """Straight segments through `points`, `width` pixels thick."""
        for (ax, ay), (bx, by) in zip(points, points[1:] or points, strict=False):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for i in range(n + 1):
                x, y = round(ax + (bx - ax) * i / n), round(ay + (by - ay) * i / n)
                for d in range(width):
                    self.put(x, y + d - width // 2, rgb)
                    self.put(x + d - width // 2, y, rgb)

    def text(self, x: int, y: int, s: str, rgb: RGB = (40, 40, 40), scale: int = 2, vertical: bool = False) -> None:
        """`s` with its top-left corner at (x, y), each font pixel `scale` pixels square; `vertical`: turned a quarter
        to the left (reading upwards, as a y-axis label), (x, y) then its bottom-left corner."""
        for k, ch in enumerate(s):
            columns = bytes.fromhex(FONT.get(ch, UNKNOWN))
            for c, bits in enumerate(columns):
                for r in range(8):
                    if bits >> r & 1:
                        u, v = (ADVANCE * k + c) * scale, r * scale  # along the text, down from its top
                        for dy in range(scale):
                            for dx in range(scale):
                                if vertical:
                                    self.put(x + v + dy, y - u - dx, rgb)
                                else:
                                    self.put(x + u + dx, y + v + dy, rgb)

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        raw = b"".join(b"\x00" + bytes(r) for r in self.rows)  # filter type 0 (none) on every row
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.png())


def text_width(s: str, scale: int = 2) -> int:
    """Pixels `s` spans along its line, without the blank column after the last glyph."""
    return max(ADVANCE * len(s) - 1, 0) * scale
