"""Tiny dependency-free line plots written as PNG (numpy + zlib only).

Enough for training curves and gain-vs-depth plots: panels with axes, ticks,
linear or log y, lines with optional markers, dashed horizontal references,
titles and legends, in a built-in 5x7 bitmap font (capitals only). No matplotlib needed.

    fig = Figure(900, 500)
    ax = fig.panel(title="loss", xlabel="tokens", ylabel="nats")
    ax.line(x, y, color=(31, 119, 180), label="train")
    fig.save("loss.png")
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["Figure", "Panel", "write_png", "PALETTE"]

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]

# 5x7 glyphs, one string of 7 rows of 5 columns ('#' = ink). Lowercase letters draw as small capitals.
_GLYPHS = {
    " ": ".....|.....|.....|.....|.....|.....|.....",
    "0": ".###.|#...#|#..##|#.#.#|##..#|#...#|.###.",
    "1": "..#..|.##..|..#..|..#..|..#..|..#..|.###.",
    "2": ".###.|#...#|....#|...#.|..#..|.#...|#####",
    "3": "#####|...#.|..#..|...#.|....#|#...#|.###.",
    "4": "...#.|..##.|.#.#.|#..#.|#####|...#.|...#.",
    "5": "#####|#....|####.|....#|....#|#...#|.###.",
    "6": "..##.|.#...|#....|####.|#...#|#...#|.###.",
    "7": "#####|....#|...#.|..#..|.#...|.#...|.#...",
    "8": ".###.|#...#|#...#|.###.|#...#|#...#|.###.",
    "9": ".###.|#...#|#...#|.####|....#|...#.|.##..",
    "A": ".###.|#...#|#...#|#####|#...#|#...#|#...#",
    "B": "####.|#...#|#...#|####.|#...#|#...#|####.",
    "C": ".###.|#...#|#....|#....|#....|#...#|.###.",
    "D": "###..|#..#.|#...#|#...#|#...#|#..#.|###..",
    "E": "#####|#....|#....|####.|#....|#....|#####",
    "F": "#####|#....|#....|####.|#....|#....|#....",
    "G": ".###.|#...#|#....|#.###|#...#|#...#|.####",
    "H": "#...#|#...#|#...#|#####|#...#|#...#|#...#",
    "I": ".###.|..#..|..#..|..#..|..#..|..#..|.###.",
    "J": "..###|...#.|...#.|...#.|...#.|#..#.|.##..",
    "K": "#...#|#..#.|#.#..|##...|#.#..|#..#.|#...#",
    "L": "#....|#....|#....|#....|#....|#....|#####",
    "M": "#...#|##.##|#.#.#|#.#.#|#...#|#...#|#...#",
    "N": "#...#|#...#|##..#|#.#.#|#..##|#...#|#...#",
    "O": ".###.|#...#|#...#|#...#|#...#|#...#|.###.",
    "P": "####.|#...#|#...#|####.|#....|#....|#....",
    "Q": ".###.|#...#|#...#|#...#|#.#.#|#..#.|.##.#",
    "R": "####.|#...#|#...#|####.|#.#..|#..#.|#...#",
    "S": ".####|#....|#....|.###.|....#|....#|####.",
    "T": "#####|..#..|..#..|..#..|..#..|..#..|..#..",
    "U": "#...#|#...#|#...#|#...#|#...#|#...#|.###.",
    "V": "#...#|#...#|#...#|#...#|#...#|.#.#.|..#..",
    "W": "#...#|#...#|#...#|#.#.#|#.#.#|#.#.#|.#.#.",
    "X": "#...#|#...#|.#.#.|..#..|.#.#.|#...#|#...#",
    "Y": "#...#|#...#|.#.#.|..#..|..#..|..#..|..#..",
    "Z": "#####|....#|...#.|..#..|.#...|#....|#####",
    ".": ".....|.....|.....|.....|.....|.##..|.##..",
    ",": ".....|.....|.....|.....|.##..|..#..|.#...",
    ":": ".....|.##..|.##..|.....|.##..|.##..|.....",
    ";": ".....|.##..|.##..|.....|.##..|..#..|.#...",
    "-": ".....|.....|.....|#####|.....|.....|.....",
    "+": ".....|..#..|..#..|#####|..#..|..#..|.....",
    "=": ".....|.....|#####|.....|#####|.....|.....",
    "_": ".....|.....|.....|.....|.....|.....|#####",
    "/": ".....|....#|...#.|..#..|.#...|#....|.....",
    "\\": ".....|#....|.#...|..#..|...#.|....#|.....",
    "(": "...#.|..#..|.#...|.#...|.#...|..#..|...#.",
    ")": ".#...|..#..|...#.|...#.|...#.|..#..|.#...",
    "[": ".###.|.#...|.#...|.#...|.#...|.#...|.###.",
    "]": ".###.|...#.|...#.|...#.|...#.|...#.|.###.",
    "%": "##...|##..#|...#.|..#..|.#...|#..##|...##",
    "*": ".....|..#..|#.#.#|.###.|#.#.#|..#..|.....",
    "<": "...#.|..#..|.#...|#....|.#...|..#..|...#.",
    ">": ".#...|..#..|...#.|....#|...#.|..#..|.#...",
    "'": "..#..|..#..|.#...|.....|.....|.....|.....",
    '"': ".#.#.|.#.#.|.....|.....|.....|.....|.....",
    "!": "..#..|..#..|..#..|..#..|..#..|.....|..#..",
    "?": ".###.|#...#|....#|...#.|..#..|.....|..#..",
    "#": ".#.#.|.#.#.|#####|.#.#.|#####|.#.#.|.#.#.",
    "|": "..#..|..#..|..#..|..#..|..#..|..#..|..#..",
    "~": ".....|.....|.#...|#.#.#|...#.|.....|.....",
    "^": "..#..|.#.#.|#...#|.....|.....|.....|.....",
}
_LOWER = {c: c.upper() for c in "abcdefghijklmnopqrstuvwxyz"}  # drawn as capitals


def _glyph_bitmap(ch: str) -> np.ndarray:
    key = ch if ch in _GLYPHS else _LOWER.get(ch, "?")
    return np.array([[c == "#" for c in r] for r in _GLYPHS[key].split("|")], dtype=bool)


_FONT = {c: _glyph_bitmap(c) for c in list(_GLYPHS) + list(_LOWER)}


def write_png(path: str | os.PathLike, rgb: np.ndarray) -> Path:
    """Write an ``[H, W, 3]`` uint8 image as PNG (8-bit RGB), atomically."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(png)
    os.replace(tmp, path)
    return path


class _Canvas:
    def __init__(self, width: int, height: int):
        self.img = np.full((height, width, 3), 255, dtype=np.uint8)
        self.h, self.w = height, width

    def rect(self, x0, y0, x1, y1, color, fill=True):
        x0, x1 = sorted((int(round(x0)), int(round(x1))))
        y0, y1 = sorted((int(round(y0)), int(round(y1))))
        x0, y0 = max(x0, 0), max(y0, 0)
        x1, y1 = min(x1, self.w - 1), min(y1, self.h - 1)
        if x0 > x1 or y0 > y1:
            return
        if fill:
            self.img[y0 : y1 + 1, x0 : x1 + 1] = color
        else:
            self.img[y0, x0 : x1 + 1] = color
            self.img[y1, x0 : x1 + 1] = color
            self.img[y0 : y1 + 1, x0] = color
            self.img[y0 : y1 + 1, x1] = color

    def line(self, x0, y0, x1, y1, color, width=2, clip=None, dash=0):
        """Anti-aliasing-free thick line, sampled densely (clip = (x0, y0, x1, y1) box)."""
        n = int(max(abs(x1 - x0), abs(y1 - y0)) * 2) + 1
        t = np.linspace(0.0, 1.0, n)
        xs, ys = x0 + (x1 - x0) * t, y0 + (y1 - y0) * t
        if dash:
            along = np.hypot(xs - x0, ys - y0)
            keep = (along // dash) % 2 == 0
            xs, ys = xs[keep], ys[keep]
        self.points(xs, ys, color, width, clip)

    def points(self, xs, ys, color, width=2, clip=None):
        xs = np.round(np.asarray(xs, dtype=np.float64)).astype(np.int64)
        ys = np.round(np.asarray(ys, dtype=np.float64)).astype(np.int64)
        lo, hi = -(width // 2), width - width // 2
        cx0, cy0, cx1, cy1 = clip if clip else (0, 0, self.w - 1, self.h - 1)
        for dx in range(lo, hi):
            for dy in range(lo, hi):
                x, y = xs + dx, ys + dy
                ok = (x >= cx0) & (x <= cx1) & (y >= cy0) & (y <= cy1)
                self.img[y[ok], x[ok]] = color

    def text(self, x, y, s, color=(0, 0, 0), scale=2, anchor="left", vertical=False):
        """Draw ``s`` with its top-left at (x, y); anchor 'center'/'right' shifts it horizontally."""
        adv = 6 * scale
        width = adv * len(s) - scale
        if vertical:
            h = width
            if anchor == "center":
                y -= h / 2
            glyph_block = np.zeros((7 * scale, max(width, 1)), dtype=bool)
            for i, ch in enumerate(s):
                bm = np.kron(_FONT.get(ch, _FONT["?"]), np.ones((scale, scale), dtype=bool))
                glyph_block[:, i * adv : i * adv + 5 * scale] = bm
            rot = np.rot90(glyph_block)  # reads bottom-to-top
            self._blit(int(round(x)), int(round(y)), rot, color)
            return
        if anchor == "center":
            x -= width / 2
        elif anchor == "right":
            x -= width
        for i, ch in enumerate(s):
            bm = np.kron(_FONT.get(ch, _FONT["?"]), np.ones((scale, scale), dtype=bool))
            self._blit(int(round(x + i * adv)), int(round(y)), bm, color)

    def _blit(self, x, y, mask, color):
        h, w = mask.shape
        x0, y0 = max(x, 0), max(y, 0)
        x1, y1 = min(x + w, self.w), min(y + h, self.h)
        if x0 >= x1 or y0 >= y1:
            return
        sub = mask[y0 - y : y1 - y, x0 - x : x1 - x]
        region = self.img[y0:y1, x0:x1]
        region[sub] = color


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], start
    while v <= hi + 1e-9 * step:
        ticks.append(0.0 if abs(v) < 1e-12 * step else v)
        v += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        m, e = f"{v:.1e}".split("e")
        return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
    if a >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.4g}"


def _dash_path(pts, dash: float):
    """Points along a polyline, keeping alternate ``dash``-pixel stretches."""
    xs, ys, run = [], [], 0.0
    for (a0, b0), (a1, b1) in zip(pts, pts[1:]):
        seg = math.hypot(a1 - a0, b1 - b0)
        n = int(seg * 2) + 1
        for i in range(n):
            t = i / n
            if (run + t * seg) // dash % 2 == 0:
                xs.append(a0 + (a1 - a0) * t)
                ys.append(b0 + (b1 - b0) * t)
        run += seg
    return xs, ys


class Panel:
    """One set of axes. Add series with :meth:`line` and :meth:`hline`."""

    def __init__(self, title: str = "", xlabel: str = "", ylabel: str = "", logy: bool = False, include_y: Sequence[float] = ()):
        self.title, self.xlabel, self.ylabel, self.logy = title, xlabel, ylabel, logy
        self.include_y = [float(v) for v in include_y]  # y values the axis must show
        self.series: list[dict] = []
        self.hlines: list[dict] = []

    def line(
        self,
        x: Sequence[float],
        y: Sequence[float],
        color=None,
        label: str = "",
        markers: bool = False,
        width: int = 2,
        dashed: bool = False,
    ):
        color = color or PALETTE[len(self.series) % len(PALETTE)]
        self.series.append(
            {
                "x": list(map(float, x)),
                "y": list(map(float, y)),
                "color": color,
                "label": label,
                "markers": markers,
                "width": width,
                "dashed": dashed,
            }
        )

    def hline(self, y: float, color=(120, 120, 120), label: str = "", dashed: bool = True):
        self.hlines.append({"y": float(y), "color": color, "label": label, "dashed": dashed})

    def _ty(self, v: float) -> float:
        return math.log10(v) if self.logy else v

    def draw(self, cv: _Canvas, box: tuple[int, int, int, int]) -> None:
        bx0, by0, bx1, by1 = box
        px0, py0, px1, py1 = bx0 + 78, by0 + 36, bx1 - 14, by1 - 58  # plot area
        xs = [v for s in self.series for v in s["x"] if math.isfinite(v)]
        ys = [self._ty(v) for s in self.series for v in s["y"] if math.isfinite(v) and (v > 0 or not self.logy)]
        ys += [self._ty(h["y"]) for h in self.hlines if math.isfinite(h["y"]) and (h["y"] > 0 or not self.logy)]
        ys += [self._ty(v) for v in self.include_y if math.isfinite(v) and (v > 0 or not self.logy)]
        xlo, xhi = (min(xs), max(xs)) if xs else (0.0, 1.0)
        ylo, yhi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if xhi <= xlo:
            xlo, xhi = xlo - 0.5, xhi + 0.5
        min_span = max(abs(ylo), abs(yhi)) * 0.02 or 1.0
        if yhi - ylo < min_span:  # a flat series: centre it in a band of +-1%
            mid = (ylo + yhi) / 2
            ylo, yhi = mid - min_span / 2, mid + min_span / 2
        pad = (yhi - ylo) * 0.05
        ylo, yhi = ylo - pad, yhi + pad

        def X(v):
            return px0 + (v - xlo) / (xhi - xlo) * (px1 - px0)

        def Y(v):
            return py1 - (self._ty(v) - ylo) / (yhi - ylo) * (py1 - py0)

        grid, axis = (232, 232, 232), (60, 60, 60)
        xticks = _nice_ticks(xlo, xhi, 6)
        if xs and all(float(v).is_integer() for v in xs) and xhi - xlo < 6:
            xticks = [float(v) for v in range(math.ceil(xlo), math.floor(xhi) + 1)]
        for t in xticks:
            cv.line(X(t), py0, X(t), py1, grid, width=1)
            cv.line(X(t), py1, X(t), py1 + 5, axis, width=1)
            cv.text(X(t), py1 + 9, _fmt(t), axis, anchor="center")
        if self.logy:
            yticks = [float(e) for e in range(math.floor(ylo), math.ceil(yhi) + 1) if ylo <= e <= yhi]
            if len(yticks) < 2:
                yticks = [math.log10(v) for v in _nice_ticks(10**ylo, 10**yhi, 5) if v > 0]
            labels = [(_fmt(10**t), t) for t in yticks]
        else:
            labels = [(_fmt(t), t) for t in _nice_ticks(ylo, yhi, 5)]
        for s, t in labels:
            yy = py1 - (t - ylo) / (yhi - ylo) * (py1 - py0)
            cv.line(px0, yy, px1, yy, grid, width=1)
            cv.line(px0 - 5, yy, px0, yy, axis, width=1)
            cv.text(px0 - 8, yy - 7, s, axis, anchor="right")
        cv.rect(px0, py0, px1, py1, axis, fill=False)
        clip = (px0 + 1, py0 + 1, px1 - 1, py1 - 1)
        for h in self.hlines:
            if math.isfinite(h["y"]) and (h["y"] > 0 or not self.logy):
                cv.line(px0, Y(h["y"]), px1, Y(h["y"]), h["color"], width=2, clip=clip, dash=8 if h["dashed"] else 0)
        for s in self.series:
            pts = [(X(a), Y(b)) for a, b in zip(s["x"], s["y"]) if math.isfinite(a) and math.isfinite(b) and (b > 0 or not self.logy)]
            if s["dashed"]:
                xs_, ys_ = _dash_path(pts, 8)
                cv.points(xs_, ys_, s["color"], width=s["width"], clip=clip)
            else:
                for (a0, b0), (a1, b1) in zip(pts, pts[1:]):
                    cv.line(a0, b0, a1, b1, s["color"], width=s["width"], clip=clip)
            if s["markers"] or len(pts) == 1:
                for a, b in pts:
                    cv.rect(a - 3, b - 3, a + 3, b + 3, s["color"])
        cv.text((px0 + px1) / 2, by0 + 8, self.title, (0, 0, 0), anchor="center")
        cv.text((px0 + px1) / 2, py1 + 32, self.xlabel, (0, 0, 0), anchor="center")
        cv.text(bx0 + 6, (py0 + py1) / 2, self.ylabel + (" (log)" if self.logy else ""), (0, 0, 0), vertical=True, anchor="center")
        entries = [(s["label"], s["color"]) for s in self.series if s["label"]]
        entries += [(h["label"], h["color"]) for h in self.hlines if h["label"]]
        if entries:
            wmax = max(len(e[0]) for e in entries) * 12 + 34
            lx1, ly0 = px1 - 6, py0 + 6
            lx0 = lx1 - wmax
            cv.rect(lx0, ly0, lx1, ly0 + 20 * len(entries) + 6, (255, 255, 255))
            cv.rect(lx0, ly0, lx1, ly0 + 20 * len(entries) + 6, (180, 180, 180), fill=False)
            for i, (lab, col) in enumerate(entries):
                yy = ly0 + 6 + i * 20
                cv.rect(lx0 + 6, yy + 5, lx0 + 24, yy + 8, col)
                cv.text(lx0 + 30, yy, lab, (0, 0, 0))


class Figure:
    """Panels side by side (``cols`` per row), saved as one PNG."""

    def __init__(self, width: int = 900, height: int = 520, cols: int = 0):
        self.width, self.height, self.cols = width, height, cols
        self.panels: list[Panel] = []

    def panel(self, **kwargs) -> Panel:
        p = Panel(**kwargs)
        self.panels.append(p)
        return p

    def render(self) -> np.ndarray:
        cols = self.cols or len(self.panels) or 1
        rows = math.ceil(max(len(self.panels), 1) / cols)
        pw, ph = self.width, self.height
        cv = _Canvas(pw * cols, ph * rows)
        for i, p in enumerate(self.panels):
            r, c = divmod(i, cols)
            p.draw(cv, (c * pw, r * ph, (c + 1) * pw - 1, (r + 1) * ph - 1))
        return cv.img

    def save(self, path: str | os.PathLike) -> Path:
        return write_png(path, self.render())
