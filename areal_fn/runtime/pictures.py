"""PNG pictures for ``areal-fn plan --png DIR``, with no plotting dependency.

- ``ranks.png``: one cell per rank, laid out as the layout's first mesh (the first
  axis down, the others across), coloured by the pipeline stage the rank serves
  (hue) and shaded by the bytes it holds (darker = more), labelled with its rank.
- ``stages.png``: one bar per pipeline chunk, height proportional to its load.

A tiny raster canvas, a 3x5 digit font and a PNG encoder (zlib + CRC) are all it needs.
"""

import colorsys
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

_DIGITS = {
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
}

RGB = tuple[int, int, int]


class Canvas:
    def __init__(self, width: int, height: int, background: RGB = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x: int, y: int, w: int, h: int, color: RGB) -> None:
        for yy in range(max(0, y), min(self.height, y + h)):
            row = self.pixels[yy]
            for xx in range(max(0, x), min(self.width, x + w)):
                row[3 * xx : 3 * xx + 3] = bytes(color)

    def text(self, x: int, y: int, digits: str, color: RGB = (0, 0, 0), scale: int = 2) -> None:
        for i, ch in enumerate(digits):
            glyph = _DIGITS.get(ch)
            if glyph is None:
                continue
            for gy, line in enumerate(glyph):
                for gx, bit in enumerate(line):
                    if bit == "1":
                        self.rect(x + (4 * i + gx) * scale, y + gy * scale, scale, scale, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.pixels)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + kind
                + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
            )

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def _color(stage: int, stages: int, shade: float) -> RGB:
    r, g, b = colorsys.hls_to_rgb(stage / max(1, stages), 0.85 - 0.45 * shade, 0.6)
    return (int(r * 255), int(g * 255), int(b * 255))


def rank_grid_png(
    rows: int, cols: int, stage_of: Sequence[int], bytes_of: Sequence[int], cell: int = 48
) -> bytes:
    """Ranks in a ``rows x cols`` grid (row-major rank order)."""
    stages = max(stage_of) + 1 if stage_of else 1
    most = max(bytes_of) if bytes_of else 1
    least = min(bytes_of) if bytes_of else 0
    canvas = Canvas(cols * cell + 1, rows * cell + 1)
    for r, (stage, nbytes) in enumerate(zip(stage_of, bytes_of, strict=True)):
        y, x = divmod(r, cols)
        shade = 0.0 if most == least else (nbytes - least) / (most - least)
        canvas.rect(x * cell + 1, y * cell + 1, cell - 1, cell - 1, _color(stage, stages, shade))
        canvas.text(x * cell + 5, y * cell + 5, str(r))
    return canvas.png()


def bar_chart_png(values: Sequence[float], *, width: int = 40, height: int = 200) -> bytes:
    """One bar per value, scaled to the largest; each labelled with its index."""
    top = max(values) if values else 1.0
    canvas = Canvas(len(values) * width + 1, height + 16)
    for i, v in enumerate(values):
        h = int(height * (v / top)) if top > 0 else 0
        canvas.rect(i * width + 4, height - h, width - 8, h, _color(i, len(values), 0.5))
        canvas.text(i * width + 6, height + 3, str(i))
    return canvas.png()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
