"""What the error of a graph output does to the decision taken from it, and which tolerance it meets: per
sample, in figures that add up over samples, workers and machines.

An elementwise verdict says whether every element is within tolerance; a user needs to know what the
error changes. So for each graph output and sample:
* class scores (a float [batch, classes], or rows along the last axis that are probabilities): in how
  many score vectors the reference's top class is the candidate's top class, or among its five highest;
* a probability map (float values in [0, 1] that are not class scores): how many elements cross the
  output's threshold (0.5 unless set) on one side and not on the other, and the intersection and union
  of the two binarized maps (their IoU);
* any float output: the tolerance it meets, the smallest atol (at the run's rtol and stol) and the
  smallest rtol (at its atol and stol) under which every element would pass; and a sketch of each
  element's error in tolerances (|err| / (atol + rtol·|ref| + stol·absmax)), for its percentiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from accudiff.comparison.metrics import CHUNK, SKETCH_BITS, SKETCH_BUCKETS, SKETCH_LOW_EXPONENT, quantiles
from accudiff.comparison.tolerances import Tolerance

MAX_CLASSES = 1 << 20  # wider rows are not class scores (a [1, N] signal, say), and ranking them costs seconds
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class Decision:
    """One output on one sample (see the module's docstring); counts are 0 where a figure does not apply."""

    rows: int = 0
    top1: int = 0
    top5: int = 0
    top5_rows: int = 0  # score vectors of more than five classes: where top-5 agreement is not vacuous
    map_elements: int = 0
    flipped: int = 0
    intersection: int = 0
    union: int = 0
    atol_needed: float = 0.0
    rtol_needed: float = 0.0
    non_finite: int = 0  # elements NaN/Inf on one side and not the same on the other: their error is Inf


def decide(ref: np.ndarray, cand: np.ndarray, tolerance: Tolerance, threshold: float, absmax: float, ratios: np.ndarray) -> Decision:
    """The decision figures of one output on one sample (`absmax`: of its finite reference values); each
    element's error in tolerances is added to the sketch `ratios` (SKETCH_BUCKETS counts). Elements are
    read CHUNK at a time: memory stays bounded whatever the output's size."""
    if not np.issubdtype(ref.dtype, np.floating) or ref.shape != cand.shape or ref.size == 0:
        return Decision()
    rows, top1, top5, top5_rows = _class_agreement(ref, cand)
    r, c = np.asarray(ref).reshape(-1), np.asarray(cand).reshape(-1)
    is_map = not rows and _is_probability_map(r)
    counts = np.zeros(3, np.int64)  # flipped, intersection, union
    atol = rtol = 0.0
    non_finite = 0
    for start in range(0, r.size, CHUNK):
        part_r, part_c = r[start : start + CHUNK].astype(np.float64), c[start : start + CHUNK].astype(np.float64)
        if is_map:
            counts += _map_counts(part_r, part_c, threshold)
        part_atol, part_rtol, part_non_finite = _tolerance_needed(part_r, part_c, tolerance, absmax, ratios)
        atol, rtol, non_finite = max(atol, part_atol), max(rtol, part_rtol), non_finite + part_non_finite
    return Decision(rows, top1, top5, top5_rows, r.size if is_map else 0, *(int(n) for n in counts), atol, rtol, non_finite)


def _class_agreement(ref: np.ndarray, cand: np.ndarray) -> tuple[int, int, int, int]:
    """(rows, top-1 agreements, top-5 agreements, rows top-5 applies to) for class scores; zeros for anything
    else. Top-5 is counted only over more than five classes (over five or fewer it always agrees).

    Class scores: a float tensor of rank 2 ([batch, classes]), or of higher rank whose reference rows along
    the last axis are probabilities (non-negative, summing to 1: a softmax), with 2 to MAX_CLASSES classes.
    """
    if ref.ndim < 2 or not 2 <= ref.shape[-1] <= MAX_CLASSES:
        return 0, 0, 0, 0
    r = np.asarray(ref, np.float32).reshape(-1, ref.shape[-1])
    c = np.asarray(cand, np.float32).reshape(-1, ref.shape[-1])
    if ref.ndim > 2 and not (r.min() >= 0 and np.allclose(r.sum(axis=1), 1.0, atol=1e-3)):
        return 0, 0, 0, 0
    top = r.argmax(axis=1)
    decided = ~np.isnan(c).any(axis=1)  # scores with a NaN decide nothing (argmax would name the NaN's class)
    top1 = int(np.count_nonzero((c.argmax(axis=1) == top) & decided))
    if r.shape[1] <= 5:
        return r.shape[0], top1, 0, 0
    five = np.argpartition(-c, 4, axis=1)[:, :5]
    top5 = int(np.count_nonzero((five == top[:, None]).any(axis=1) & decided))
    return r.shape[0], top1, top5, r.shape[0]


def _is_probability_map(r: np.ndarray) -> bool:
    """Float values all in [0, 1] (no NaN): what a sigmoid or a softmax over a map gives."""
    low, high = np.min(r), np.max(r)
    return bool(np.isfinite(low) and np.isfinite(high) and low >= 0 and high <= 1)


def _map_counts(r: np.ndarray, c: np.ndarray, threshold: float) -> np.ndarray:
    """(elements on the other side of `threshold`, intersection, union) of the two binarized maps."""
    above_r, above_c = r > threshold, np.nan_to_num(c, nan=-np.inf) > threshold
    return np.array([np.count_nonzero(above_r != above_c), np.count_nonzero(above_r & above_c), np.count_nonzero(above_r | above_c)], np.int64)


def _tolerance_needed(r: np.ndarray, c: np.ndarray, tolerance: Tolerance, absmax: float, ratios: np.ndarray) -> tuple[float, float, int]:
    """(the smallest atol at the run's rtol and stol, the smallest rtol at its atol and stol) under which
    every element passes (infinite where none would: NaN/Inf on one side only, or an error where the
    reference is 0 for rtol), and the count of elements NaN/Inf on one side only (or Inf of the other
    sign); each element's error in tolerances goes into `ratios`."""
    same = (np.isnan(r) & np.isnan(c)) | (np.isinf(r) & (r == c))
    non_finite = int(np.count_nonzero(~(np.isfinite(r) & np.isfinite(c)) & ~same))
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.where(same, 0.0, np.nan_to_num(np.abs(c - r), nan=np.inf, posinf=np.inf))  # Inf stays Inf
    magnitude = np.abs(np.where(np.isfinite(r), r, 0.0))
    allowed = tolerance.atol + tolerance.rtol * magnitude + tolerance.stol * absmax
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        _add_to_sketch(ratios, np.where(allowed > 0, error / allowed, np.where(error > 0, np.inf, 0.0)))
        atol = float(np.max(error - tolerance.rtol * magnitude - tolerance.stol * absmax, initial=0.0))
        excess = error - tolerance.atol - tolerance.stol * absmax
        rtol = float(np.max(np.where(excess > 0, excess / magnitude, 0.0), initial=0.0))
    return max(atol, 0.0), rtol if not math.isnan(rtol) else math.inf, non_finite


def _add_to_sketch(sketch: np.ndarray, values: np.ndarray) -> None:
    """Count `values` (non-negative) into a sketch laid out as the kernel's error sketch: the float32
    exponent and top SKETCH_BITS mantissa bits; 0 and values below its lowest octave in bucket 0, Inf
    (and what overflows float32) in the last."""
    single = np.minimum(values, np.finfo(np.float32).max).astype(np.float32)
    bits = single.view(np.uint32).astype(np.int64)
    exponent = ((bits >> 23) & 0xFF) - 127 - SKETCH_LOW_EXPONENT
    bucket = (exponent << SKETCH_BITS) + ((bits >> (23 - SKETCH_BITS)) & ((1 << SKETCH_BITS) - 1))
    bucket = np.where(single > 0, np.clip(bucket, 0, SKETCH_BUCKETS - 1), 0)
    bucket = np.where(np.isinf(values), SKETCH_BUCKETS - 1, bucket)
    sketch += np.bincount(bucket, minlength=SKETCH_BUCKETS)


COUNTS = ("rows", "top1", "top5", "top5_rows", "map_elements", "flipped", "intersection", "union", "non_finite")  # what adds up over samples


def decision_figures(counts: dict, threshold: float | None = None) -> dict:
    """Class scores' top-1/top-5 agreement and a probability map's flipped share and IoU, from the COUNTS of
    an output added up over samples (figures that do not apply are left out)."""
    found: dict = {}
    if counts.get("rows"):
        vectors = int(counts["rows"])
        found.update(score_vectors=vectors, top1=float(counts["top1"] / vectors))
        if counts.get("top5_rows"):
            found["top5"] = float(counts["top5"] / counts["top5_rows"])
    if counts.get("map_elements"):
        elements, union = int(counts["map_elements"]), int(counts["union"])
        found.update(**({"threshold": threshold} if threshold is not None else {}), map_elements=elements,
                     flipped_share=float(counts["flipped"] / elements), iou=float(counts["intersection"] / union) if union else 1.0)
    return found


def summarize(rows, ratios: np.ndarray | None, errors: np.ndarray | None, threshold: float) -> dict:
    """An output's decision figures over every sample (`rows`: its per-sample outcomes, a DataFrame;
    `ratios` and `errors`: the sketches of its elements' errors in tolerances and in absolute terms)."""
    counts = rows[list(COUNTS)].sum().to_dict()
    found = decision_figures(counts, threshold)
    if errors is not None:
        errors = np.array(errors, np.int64)
        errors[-1] += int(counts["non_finite"])  # the kernel's sketch holds finite errors only; these are Inf
        found.update(zip(("p99_abs_err", "p999_abs_err"), _percentiles(errors)))
    if ratios is not None and ratios.sum():
        found.update(zip(("p99_tol_ratio", "p999_tol_ratio"), _percentiles(ratios)))
    return found


def _percentiles(sketch: np.ndarray) -> list[float]:
    """The 99th and 99.9th percentiles of a sketch, Inf where they fall in the last bucket (where Inf is counted)."""
    top = quantiles(np.eye(1, SKETCH_BUCKETS, SKETCH_BUCKETS - 1, dtype=np.int64), (0.5,))[0][0]
    return [math.inf if q[0] >= top else float(q[0]) for q in quantiles(sketch[None], (0.99, 0.999))]


def tolerance_met(rows) -> dict[str, float]:
    """The smallest atol (at the run's rtol and stol) and the smallest rtol (at its atol and stol) under
    which the output passes on every sample."""
    return {"atol": float(rows["atol_needed"].max()), "rtol": float(rows["rtol_needed"].max())}
