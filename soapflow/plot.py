"""Tiny PNG charts without matplotlib: a line chart (search convergence) and a grouped bar chart (compare).

Owns an RGB `Canvas` with lines, rectangles and 5x7 bitmap text, the two chart layouts, and the PNG
encoder (zlib + struct: signature, IHDR, one IDAT of unfiltered rows, IEND; PNG spec, W3C 2003). Pure
Python; imports nothing from the rest of the project.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

Color = tuple[int, int, int]
WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (120, 120, 120), (225, 225, 225)
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                              (140, 86, 75), (227, 119, 194), (127, 127, 127))

# 5x7 glyphs, one string of 7 rows of 5 bits each; lower case letters draw as upper case.
_FONT_ROWS = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 10001 01010 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    ".": "00000 00000 00000 00000 00000 01100 01100", "-": "00000 00000 00000 11111 00000 00000 00000",
    "_": "00000 00000 00000 00000 00000 00000 11111", ":": "00000 01100 01100 00000 01100 01100 00000",
    "/": "00000 00001 00010 00100 01000 10000 00000", "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000", "%": "11000 11001 00010 00100 01000 10011 00011",
    ",": "00000 00000 00000 00000 01100 00100 01000", "=": "00000 00000 11111 00000 11111 00000 00000",
    "+": "00000 00100 00100 11111 00100 00100 00000", " ": "00000 00000 00000 00000 00000 00000 00000",
}
_FONT = {ch: tuple(int(row, 2) for row in rows.split()) for ch, rows in _FONT_ROWS.items()}
_UNKNOWN = (0b11111, 0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b11111)


class Canvas:
    """An RGB image, (0, 0) at the top left."""

    def __init__(self, width: int, height: int, background: Color = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        x0, x1 = sorted((max(0, x0), min(self.width - 1, x1)))
        y0, y1 = sorted((max(0, y0), min(self.height - 1, y1)))
        row = bytes(color) * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            i = 3 * (y * self.width + x0)
            self.pixels[i:i + len(row)] = row

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line, `width` pixels thick (a square brush)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        lo = -(width // 2)
        while True:
            for ox in range(lo, lo + width):
                for oy in range(lo, lo + width):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 1, anchor: str = "left") -> None:
        """Draw `s` with its top at y; `anchor` left, center or right places x."""
        w = text_width(s, scale)
        x -= {"left": 0, "center": w // 2, "right": w}[anchor]
        for ch in s:
            glyph = _FONT.get(ch.upper(), _UNKNOWN)
            for r, bits in enumerate(glyph):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale - 1, y + (r + 1) * scale - 1,
                                  color)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width:3 * (y + 1) * self.width])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_bytes(self.png())


def text_width(s: str, scale: int = 1) -> int:
    return max(0, 6 * len(s) - 1) * scale


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, max(last, first + 1) + 1)]


def _label(v: float) -> str:
    return f"{v:.4g}"


class _Frame:
    """The plot area of a chart and the mapping from data to pixels."""

    def __init__(self, canvas: Canvas, left: int, top: int, right: int, bottom: int,
                 x_ticks: Sequence[float], y_ticks: Sequence[float]):
        self.c, self.left, self.top, self.right, self.bottom = canvas, left, top, right, bottom
        self.x0, self.x1 = x_ticks[0], x_ticks[-1]
        self.y0, self.y1 = y_ticks[0], y_ticks[-1]

    def px(self, x: float) -> int:
        return round(self.left + (x - self.x0) / ((self.x1 - self.x0) or 1) * (self.right - self.left))

    def py(self, y: float) -> int:
        return round(self.bottom - (y - self.y0) / ((self.y1 - self.y0) or 1) * (self.bottom - self.top))


def _axes(c: Canvas, frame: _Frame, y_ticks: Sequence[float], x_ticks: Sequence[float] | None,
          title: str, x_label: str, y_label: str) -> None:
    for v in y_ticks:
        y = frame.py(v)
        c.line(frame.left, y, frame.right, y, LIGHT)
        c.text(frame.left - 6, y - 3, _label(v), GREY, anchor="right")
    for v in x_ticks or ():
        x = frame.px(v)
        c.line(x, frame.top, x, frame.bottom, LIGHT)
        c.text(x, frame.bottom + 6, _label(v), GREY, anchor="center")
    c.line(frame.left, frame.top, frame.left, frame.bottom, BLACK)
    c.line(frame.left, frame.bottom, frame.right, frame.bottom, BLACK)
    c.text(c.width // 2, 10, title, BLACK, scale=2, anchor="center")
    c.text((frame.left + frame.right) // 2, c.height - 14, x_label, BLACK, anchor="center")
    c.text(8, frame.top - 16, y_label, BLACK)


def _legend(c: Canvas, labels: Sequence[str], right: int, top: int) -> None:
    width = max(text_width(s) for s in labels) + 16
    for i, label in enumerate(labels):
        y = top + 12 * i
        c.rect(right - width, y, right - width + 8, y + 6, PALETTE[i % len(PALETTE)])
        c.text(right - width + 12, y, label)


def line_chart(path: str | os.PathLike, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], *,
               title: str, x_label: str, y_label: str, steps: bool = True,
               width: int = 720, height: int = 420) -> None:
    """Write a PNG line chart of (label, xs, ys) series; `steps` draws each as a staircase (a running best)."""
    xs = [x for _, sx, _ in series for x in sx]
    ys = [y for _, _, sy in series for y in sy]
    if not xs:
        raise ValueError("a line chart needs at least one point")
    c = Canvas(width, height)
    x_ticks, y_ticks = nice_ticks(min(0.0, min(xs)), max(xs)), nice_ticks(min(ys), max(ys))
    frame = _Frame(c, 80, 44, width - 24, height - 40, x_ticks, y_ticks)
    _axes(c, frame, y_ticks, x_ticks, title, x_label, y_label)
    for i, (_, sx, sy) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        points = list(zip(sx, sy, strict=True))
        if steps and points:
            points = [p for a, b in zip(points, points[1:], strict=False) for p in (a, (b[0], a[1]))] + \
                [points[-1], (max(xs), points[-1][1])]
        for (xa, ya), (xb, yb) in zip(points, points[1:], strict=False):
            c.line(frame.px(xa), frame.py(ya), frame.px(xb), frame.py(yb), color, width=2)
        for x, y in zip(sx, sy, strict=True):
            c.rect(frame.px(x) - 2, frame.py(y) - 2, frame.px(x) + 2, frame.py(y) + 2, color)
    if len(series) > 1:
        _legend(c, [s[0] for s in series], frame.right - 4, frame.top + 4)
    c.save(path)


def bar_chart(path: str | os.PathLike, categories: Sequence[str],
              groups: Sequence[tuple[str, Sequence[float | None]]], *, title: str, y_label: str,
              width: int = 720, height: int = 420) -> None:
    """Write a PNG grouped bar chart: one group of bars per category, one bar per (label, values) entry;
    a None value leaves its bar out."""
    values = [v for _, vs in groups for v in vs if v is not None]
    if not values:
        raise ValueError("a bar chart needs at least one value")
    c = Canvas(width, height)
    y_ticks = nice_ticks(0.0, max(values))
    frame = _Frame(c, 80, 44, width - 24, height - 40, [0.0, 1.0], y_ticks)
    _axes(c, frame, y_ticks, None, title, "", y_label)
    slot = (frame.right - frame.left) / max(1, len(categories))
    bar = max(2, int(slot * 0.8 / max(1, len(groups))))
    for k, category in enumerate(categories):
        x = frame.left + slot * k + slot * 0.1
        for i, (_, vs) in enumerate(groups):
            v = vs[k]
            if v is not None:
                x0 = round(x + i * bar)
                c.rect(x0, frame.py(v), x0 + bar - 2, frame.bottom - 1, PALETTE[i % len(PALETTE)])
        c.text(round(frame.left + slot * (k + 0.5)), frame.bottom + 6, category, BLACK, anchor="center")
    if len(groups) > 1:
        _legend(c, [g[0] for g in groups], frame.right - 4, frame.top + 4)
    c.save(path)
