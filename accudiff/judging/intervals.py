"""How sure a decision figure is: a 95% interval for each share and mean (top-1, top-5, neighbours kept; KL
divergence, Δp, ΔNLL, cosine; a map's flipped share and IoU; a detector's detections both sides make), and whether a required figure can be told
from its target with the data at hand.

The figures are measured over positions (or vectors, or elements), and positions of one sequence (one
sample, one prompt) are not independent: a quantized model that flips a prompt's tokens tends to flip
several. So the unit of resampling is the sequence: a seeded bootstrap over the units' totals. It cannot
see what no unit shows (twelve prompts that all agree everywhere give a bootstrap interval of [1, 1]), and
with few units it sees little, so the interval is the hull of the bootstrap's and of the interval over
positions as if they were independent (Wilson's for a share, the normal one for a mean), the latter with
the design effect the bootstrap measured (its variance over the independent one's, at least 1). With
fewer than MIN_UNITS units the spread between units cannot be measured: the interval is the one over
positions, said to assume them independent (likely too narrow). Intervals of extremes (the largest KL,
the lowest cosine) are not given: a worst case is what it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Mapping

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

CONFIDENCE = 0.95
Z = 1.959963984540054  # the standard normal's 97.5% quantile
RESAMPLES = 2000
MIN_UNITS = 5  # fewer units than this: their spread is not measured
SEED = 0

# figure -> (what it is made of: numerator, denominator, sum of squares or None, "share" or "mean", what a unit holds)
BOUNDS = {"kl": (0.0, math.inf), "delta_p": (-1.0, 1.0), "cosine": (-1.0, 1.0), "matched_iou": (0.0, 1.0)}  # a mean's possible values (a share's are 0 to 1)
FIGURES: dict[str, tuple[str, str, str | None, str, str]] = {
    "top1": ("top1", "rows", None, "share", "positions"),
    "top5": ("top5", "top5_rows", None, "share", "positions"),
    "kl": ("kl_sum", "rows", "kl_sq_sum", "mean", "positions"),
    "delta_p": ("dp_sum", "rows", "dp_sq_sum", "mean", "positions"),
    "delta_nll": ("nll_sum", "nll_rows", "nll_sq_sum", "mean", "positions"),
    "cosine": ("cosine_sum", "vectors", "cosine_sq_sum", "mean", "vectors"),
    "neighbors": ("neighbor_same", "neighbor_rows", None, "share", "rows"),
    "flipped_share": ("flipped", "map_elements", None, "share", "elements"),
    "iou": ("intersection", "union", None, "share", "elements"),
    "detections": ("det_matched", "det_union", None, "share", "detections"),
    "matched_iou": ("det_iou_sum", "det_matched", "det_iou_sq_sum", "mean", "detections"),
}
COLUMNS = tuple(dict.fromkeys(c for num, den, sq, _, _ in FIGURES.values() for c in (num, den, sq) if c is not None))  # the counts they are made of


@dataclass(frozen=True)
class Interval:
    """A figure's 95% interval, over how many units (sequences or samples) and positions it was measured,
    and whether the spread between units was measured (`clustered`) or positions were taken as independent."""

    low: float
    high: float
    units: int
    positions: int
    clustered: bool
    design_effect: float = 1.0
    kind: str = "share"  # a share or a mean
    spread: float = 0.0  # of a mean: its positions' variance
    def as_json(self) -> dict:
        return asdict(self)

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def intervals(rows: pd.DataFrame, units: pd.Series, figures: Mapping[str, float]) -> dict[str, Interval]:
    """The interval of each figure in `figures` that has one, from `rows` (per-sample COUNTS of one output,
    decisions.py) grouped into `units` (a unit per row: the sequence or sample it belongs to)."""
    totals = rows.groupby(units.to_numpy(), sort=True).sum(numeric_only=True)
    return unit_intervals({name: totals[name].to_numpy(np.float64) for name in COLUMNS if name in totals}, figures)


def unit_intervals(totals: Mapping[str, np.ndarray], figures: Mapping[str, float]) -> dict[str, Interval]:
    """`intervals` from each count's total per unit (the same units, in the same order, in every array):
    verification's trials, a few samples each, need no table for it."""
    found = {}
    for name in figures:
        if name not in FIGURES:
            continue
        numerator, denominator, squares, kind, _ = FIGURES[name]
        if numerator not in totals or denominator not in totals:
            continue
        num, den = np.asarray(totals[numerator], np.float64), np.asarray(totals[denominator], np.float64)
        used = den > 0
        num, den = num[used], den[used]
        if not used.any() or not np.isfinite(num).all():
            continue
        sq = np.asarray(totals[squares], np.float64)[used] if squares is not None else None
        span = interval_of(num, den, sq, kind)
        low, high = BOUNDS.get(name, (0.0, 1.0) if kind == "share" else (-math.inf, math.inf))
        found[name] = replace(span, low=max(span.low, low), high=min(span.high, high))
    return found


def interval_of(num: np.ndarray, den: np.ndarray, sq: np.ndarray | None, kind: str, seed: int = SEED) -> Interval:
    """The interval of sum(num) / sum(den) over units (each unit's totals; `sq`: its sum of squares, for a mean)."""
    n = float(den.sum())
    estimate = float(num.sum() / n)
    spread = max(float(sq.sum()) / n - estimate**2, 0.0) if kind == "mean" and sq is not None else 0.0
    iid_variance = estimate * (1 - estimate) / n if kind == "share" else spread / max(n - 1, 1)
    units = len(den)
    if units < MIN_UNITS:
        low, high = _iid_interval(estimate, n, iid_variance, kind, 1.0)
        return Interval(low, high, units, int(n), False, 1.0, kind, spread)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, units, size=(RESAMPLES, units))
    resampled = num[picks].sum(axis=1) / np.maximum(den[picks].sum(axis=1), np.finfo(np.float64).tiny)
    boot_low, boot_high = np.quantile(resampled, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    design = max(1.0, float(resampled.var()) / iid_variance) if iid_variance > 0 else 1.0
    low, high = _iid_interval(estimate, n, iid_variance, kind, design, t_quantile(units - 1))
    return Interval(min(low, float(boot_low)), max(high, float(boot_high)), units, int(n), True, design, kind, spread)


def _iid_interval(estimate: float, n: float, variance: float, kind: str, design: float, critical: float = Z) -> tuple[float, float]:
    """Wilson's interval for a share (on n / design positions), the normal one for a mean; `critical`: the
    quantile it spans (Student's t over the units, when their spread was measured)."""
    if kind == "share":
        return wilson(estimate, n / design, critical)
    half = critical * math.sqrt(variance * design)
    return estimate - half, estimate + half


def wilson(share: float, n: float, critical: float = Z) -> tuple[float, float]:
    """Wilson's score interval of a share measured on `n` independent trials."""
    if n <= 0:
        return 0.0, 1.0
    z2 = critical * critical
    centre = (share + z2 / (2 * n)) / (1 + z2 / n)
    half = critical * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (0.0 if share <= 0 else max(0.0, centre - half)), (1.0 if share >= 1 else min(1.0, centre + half))  # an edge the share sits on is exact


def t_quantile(freedom: int) -> float:
    """Student's t 97.5% quantile for `freedom` degrees of freedom (Cornish-Fisher's expansion about the
    normal's: within 0.2% from 4 degrees up)."""
    if freedom < 1:
        return math.inf
    z, v = Z, float(freedom)
    return z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)


def needed_units(estimate: float, target: float, found: Interval) -> float | None:
    """About how many units (of the units' mean size) would tell `estimate` from `target`: the interval
    then excludes the target, its width shrinking as 1/sqrt(n) at the measured design effect. None when no
    amount of data would (the figure equals the target)."""
    if estimate == target:
        return None
    per_unit = found.positions / max(found.units, 1)

    def modelled(n: float) -> tuple[float, float]:
        if found.kind == "share":
            return wilson(estimate, n / found.design_effect)
        half = Z * math.sqrt(found.spread * found.design_effect / max(n - 1, 1))
        return estimate - half, estimate + half

    # The interval found is wider than this model of it on the data at hand (a t quantile over few units, the
    # bootstrap's hull, a bound clipped to 1): each side is widened by as much, and the data at hand never suffices.
    low_now, high_now = modelled(found.positions)
    widen = [max(1.0, (estimate - found.low) / (estimate - low_now)) if estimate > low_now else 1.0,
             max(1.0, (found.high - estimate) / (high_now - estimate)) if high_now > estimate else 1.0]
    for scale in np.geomspace(1, 1e7, 400)[1:]:
        n = found.positions * scale
        low, high = modelled(n)
        if not estimate - (estimate - low) * widen[0] <= target <= estimate + (high - estimate) * widen[1]:
            return max(math.ceil(n / per_unit), found.units + 1)
    return math.inf


def best_case(found: Interval, perfect: float) -> Interval:
    """The interval the same data would give the figure were it `perfect` (every position agreeing, no error,
    no spread between units): the strictest target the data could ever show met (24 samples that all agree
    show a top-1 agreement of 84.9% at least, not 90%)."""
    if found.kind != "share":
        return replace(found, low=perfect, high=perfect)
    low, high = wilson(perfect, found.positions, t_quantile(found.units - 1) if found.clustered else Z)
    return replace(found, low=low, high=high)


def resolve(direction: str, target: float, estimate: float, found: Interval | None) -> str:
    """"met", "missed" or "unresolved": whether the figure's interval lies on the target's right side, its
    wrong side, or across it ("min": the figure must reach the target; "max": stay at most at it). A figure
    without an interval is judged by its value."""
    if found is None:
        return ("met" if estimate >= target else "missed") if direction == "min" else ("met" if estimate <= target else "missed")
    if direction == "min":
        return "met" if found.low >= target else "missed" if found.high < target else "unresolved"
    return "met" if found.high <= target else "missed" if found.low > target else "unresolved"
