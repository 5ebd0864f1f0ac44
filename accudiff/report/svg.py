"""A small SVG chart: axes with ticks, lines, markers, bars, a legend — what the report's plots need.

Drawn directly as text: no plotting library to import (matplotlib took 0.7 s of a 5 s compare on the
recognizer, most of it starting up), no JavaScript, nothing fetched. Every label goes through
`html.escape`: tensor and node names come from the model.
"""

from __future__ import annotations

import html
import math
from typing import Sequence

import numpy as np

MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 58, 14, 34, 40
AXIS_COLOUR, GRID_COLOUR, TEXT_COLOUR = "#616161", "#e0e0e0", "#212121"
MAX_LABEL = 48
# x ticks labelled by name: chars, px between ticks, and the bottom and left margins their slanted labels need
# (22 characters at -35 degrees reach 110 px left of their tick: the first one was cut off at the edge)
NAME_LABEL, NAME_TICK_SPACING, NAME_MARGIN, NAME_MARGIN_LEFT = 22, 70, 120, 112
# A label in the plot (font-size 11): the width its characters take on average, at most (Chromium here laid a
# 99-character node name out at 5.1 px a character; wider letters take more), how far it rises above its baseline
# and falls below, and the step by which it moves when the place it wants is taken.
LABEL_CHAR_WIDTH, LABEL_RISE, LABEL_FALL, LABEL_STEP = 6.3, 10, 4, 14
HALO = 'stroke="white" stroke-width="3" paint-order="stroke"'  # a label stays readable where it crosses a line or markers


class Chart:
    """One plot area with data coordinates: `x_range`/`y_range` are (low, high); `x_log` draws x in decades."""

    def __init__(self, width: int, height: int, x_range: tuple[float, float], y_range: tuple[float, float], x_log: bool = False):
        self.width, self.height, self.x_log = width, height, x_log
        self.x_low, self.x_high = _widen(*(np.log10(x_range) if x_log else x_range))
        self.y_low, self.y_high = _widen(*y_range)
        self.body: list[str] = []
        self.legend: list[tuple[str, str]] = []  # (label, the SVG of its swatch at the origin)
        self.title = self.x_label = self.y_label = ""
        self.x_names: Sequence[str] = ()  # with names, x is an index into them: its ticks are labelled by name, slanted (`name_x`)
        self.margin_bottom, self.margin_left = MARGIN_BOTTOM, MARGIN_LEFT
        self._labels: list[tuple[float, float, float, float]] = []  # (left, top, right, bottom) of each label placed in the plot

    def name_x(self, names: Sequence[str]) -> None:
        """x is an index into `names`: its ticks are labelled by (shortened) name, slanted, in margins that hold them."""
        self.x_names, self.margin_bottom, self.margin_left = names, NAME_MARGIN, NAME_MARGIN_LEFT

    # data to pixels
    def px(self, x: np.ndarray | float) -> np.ndarray:
        value = np.log10(x) if self.x_log else np.asarray(x, np.float64)
        return self.margin_left + (value - self.x_low) / (self.x_high - self.x_low) * (self.width - self.margin_left - MARGIN_RIGHT)

    def py(self, y: np.ndarray | float) -> np.ndarray:
        bottom, top = self.height - self.margin_bottom, MARGIN_TOP
        return bottom - (np.asarray(y, np.float64) - self.y_low) / (self.y_high - self.y_low) * (bottom - top)

    def line(self, xs: Sequence[float], ys: Sequence[float], colour: str, label: str = "", width: float = 1.2, dash: str = "") -> None:
        if len(xs) == 0:
            return
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(self.px(np.asarray(xs)), self.py(np.asarray(ys))))
        style = f' stroke-dasharray="{dash}"' if dash else ""
        self.body.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="{width}"{style}/>')
        if label:
            self.legend.append((label, f'<line x1="0" y1="0" x2="16" y2="0" stroke="{colour}" stroke-width="{width}"{style}/>'))

    def markers(self, xs: Sequence[float], ys: Sequence[float], colour: str, label: str = "", shape: str = "circle", size: float = 3) -> None:
        """`shape`: circle (filled), square (hollow) or cross."""
        if len(xs) == 0:
            return
        self.body.extend(_marker(shape, x, y, size, colour) for x, y in zip(self.px(np.asarray(xs)), self.py(np.asarray(ys))))
        if label:
            self.legend.append((label, _marker(shape, 8, 0, size, colour)))

    def bars(self, lefts: Sequence[float], rights: Sequence[float], heights: Sequence[float], colour: str) -> None:
        zero = float(self.py(max(self.y_low, 0.0)))
        for left, right, height in zip(self.px(np.asarray(lefts)), self.px(np.asarray(rights)), self.py(np.asarray(heights))):
            self.body.append(f'<rect x="{left:.1f}" y="{height:.1f}" width="{max(right - left - 1, 1):.1f}" height="{max(zero - height, 0):.1f}" fill="{colour}"/>')

    def vline(self, x: float, colour: str, text: str) -> None:
        """A dashed vertical line across the plot with `text` beside its top."""
        left = float(self.px(x))
        self.body.append(f'<line x1="{left:.1f}" y1="{MARGIN_TOP}" x2="{left:.1f}" y2="{self.height - self.margin_bottom}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="5,3"/>')
        self._label(left, MARGIN_TOP + 4 + LABEL_RISE, text, colour)

    def hover(self, xs: Sequence[float], ys: Sequence[float], titles: Sequence[str]) -> None:
        """Invisible targets over data points that show `titles` (a tensor's name and figures) on hover."""
        for x, y, title in zip(self.px(np.asarray(xs)), self.py(np.asarray(ys)), titles):
            self.body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="transparent"><title>{_text(title)}</title></circle>')

    def note(self, x: float, y: float, text: str, colour: str, title: str = "") -> None:
        """`text` just above the data point (x, y), or as near as the labels placed before leave room for (a line
        then leads to the point); `title`: what hovering it shows (a name said in full)."""
        left, top = float(self.px(x)), float(self.py(y))
        baseline = self._label(left, top - 7, text, colour, title)
        if abs(baseline - (top - 7)) >= LABEL_STEP:
            end = baseline - LABEL_RISE / 2 if baseline < top else baseline - LABEL_RISE
            self.body.append(f'<line x1="{left:.1f}" y1="{top:.1f}" x2="{left:.1f}" y2="{end:.1f}" stroke="{colour}" stroke-width="0.6"/>')

    def _label(self, x: float, baseline: float, text: str, colour: str, title: str = "") -> float:
        """`text` beside x (after it, or before it where it would pass the plot's right edge) at the first
        baseline, from `baseline` up, then down, whose box overlaps no label placed before and stays inside the
        plot: labels of nearby points (several ruled-out nodes of one block) are otherwise drawn over each
        other. Returns the baseline taken."""
        width = LABEL_CHAR_WIDTH * len(text)
        left_edge, right_edge, top_edge, bottom_edge = self.margin_left + 2, self.width - MARGIN_RIGHT - 2, MARGIN_TOP + 2, self.height - self.margin_bottom - 2
        start = x + 4 if x + 4 + width <= right_edge else max(x - 4 - width, left_edge)
        preferred = min(max(baseline, top_edge + LABEL_RISE), bottom_edge - LABEL_FALL)
        tries = [preferred - k * LABEL_STEP for k in range(int((preferred - top_edge) // LABEL_STEP) + 1)]
        tries += [preferred + k * LABEL_STEP for k in range(1, int((bottom_edge - preferred) // LABEL_STEP) + 1)]
        boxes = [(start, y - LABEL_RISE, start + width, y + LABEL_FALL) for y in tries]
        free = [y for y, box in zip(tries, boxes) if box[1] >= top_edge and box[3] <= bottom_edge and not any(_overlap(box, placed) for placed in self._labels)]
        chosen = free[0] if free else preferred
        self._labels.append((start, chosen - LABEL_RISE, start + width, chosen + LABEL_FALL))
        hover = f"<title>{_text(title)}</title>" if title else ""
        self.body.append(f'<text x="{start:.1f}" y="{chosen:.1f}" fill="{colour}" {HALO}>{hover}{_text(text)}</text>')
        return chosen

    def render(self) -> str:
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" viewBox="0 0 {self.width} {self.height}" '
            f'font-family="sans-serif" font-size="11" fill="{TEXT_COLOUR}">',
            *self._axes(),
            *self.body,
            *self._legend(),
            "</svg>",
        ]
        return "".join(parts)

    def _axes(self) -> list[str]:
        left, right, top, bottom = self.margin_left, self.width - MARGIN_RIGHT, MARGIN_TOP, self.height - self.margin_bottom
        parts = []
        for value, label in self._x_ticks():
            x = float(self.px(10**value if self.x_log else value))
            parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="{GRID_COLOUR}"/>')
            if self.x_names:
                parts.append(f'<text transform="translate({x + 3:.1f},{bottom + 10}) rotate(-35)" text-anchor="end">{_text(label)}</text>')
            else:
                parts.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{label}</text>')
        for value, label in _ticks(self.y_low, self.y_high, log=False, integer=False):
            y = float(self.py(value))
            parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="{GRID_COLOUR}"/>')
            parts.append(f'<text x="{left - 5}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        parts.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="{AXIS_COLOUR}"/>')
        if self.x_label:
            parts.append(f'<text x="{(left + right) / 2:.1f}" y="{self.height - 6}" text-anchor="middle">{_text(self.x_label)}</text>')
        if self.y_label:
            parts.append(f'<text transform="translate(13,{(top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle">{_text(self.y_label)}</text>')
        if self.title:
            parts.append(f'<text x="{(left + right) / 2:.1f}" y="14" text-anchor="middle">{_text(self.title)}</text>')
        return parts

    def _x_ticks(self) -> list[tuple[float, str]]:
        """Round values; with names, evenly spaced indices labelled by their (shortened) names."""
        if not self.x_names:
            return _ticks(self.x_low, self.x_high, self.x_log, integer=not self.x_log)
        count = max(2, min(len(self.x_names), (self.width - self.margin_left - MARGIN_RIGHT) // NAME_TICK_SPACING))
        indices = dict.fromkeys(np.linspace(0, len(self.x_names) - 1, count).round().astype(int).tolist())
        return [(float(i), short(self.x_names[i], NAME_LABEL)) for i in indices]

    def _legend(self) -> list[str]:
        """One row above the plot (below the title, if any), entries side by side."""
        parts, x, y = [], self.margin_left, MARGIN_TOP - 8 if not self.title else 26
        for label, swatch in self.legend:
            parts.append(f'<g transform="translate({x},{y - 4})">{swatch}</g><text x="{x + 20}" y="{y}">{_text(label)}</text>')
            x += 28 + 6 * len(label)
        return parts


def short(name: str, limit: int = MAX_LABEL) -> str:
    """A long tensor name cut from the left (its end says most)."""
    return name if len(name) <= limit else "..." + name[-(limit - 3):]


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _text(value: str) -> str:
    return html.escape(value, quote=True)


def _marker(shape: str, x: float, y: float, size: float, colour: str) -> str:
    if shape == "square":
        return f'<rect x="{x - size:.1f}" y="{y - size:.1f}" width="{2 * size}" height="{2 * size}" fill="none" stroke="{colour}" stroke-width="1.3"/>'
    if shape == "cross":
        return (f'<path d="M{x - size:.1f},{y - size:.1f}L{x + size:.1f},{y + size:.1f}M{x - size:.1f},{y + size:.1f}L{x + size:.1f},{y - size:.1f}" '
                f'stroke="{colour}" stroke-width="1.5"/>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{size}" fill="{colour}" fill-opacity="0.75"/>'


def _widen(low: float, high: float) -> tuple[float, float]:
    """A range with room: a single value gets a unit around it; others a 4% margin each side."""
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high)):
        return 0.0, 1.0
    if high <= low:
        return low - 0.5, high + 0.5
    pad = (high - low) * 0.04
    return low - pad, high + pad


def _ticks(low: float, high: float, log: bool, integer: bool, count: int = 6) -> list[tuple[float, str]]:
    """About `count` round values in [low, high] with their labels; in log mode the values are exponents."""
    if log:
        step = max(1, math.ceil((high - low) / count))
        return [(float(e), f"1e{e}") for e in range(math.ceil(low), math.floor(high) + 1, step)]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(step, 1)
    start = math.ceil(low / step) * step
    values = np.arange(start, high + step * 1e-9, step)
    return [(float(v), f"{v:.10g}") for v in values]
