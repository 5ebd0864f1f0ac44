"""Per-tensor error statistics as accumulators that merge exactly: over chunks of a tensor, over samples,
over processes and machines.

A `StatsSet` holds the accumulators of N tensors as one float64 array [N, fields] and one quantile
sketch array [N, buckets], so merging two sets (two samples, two workers) is a handful of vectorized
operations. `reduce_tensor` turns one sample of one tensor into one row, reading the arrays in chunks of
CHUNK elements (cache-sized, so the dozen numpy operations per chunk cost about one pass over memory, and
temporaries never grow with the tensor).

Definitions (also in the README):
* absolute error `|cand - ref|`; statistics over the elements finite on both sides;
* relative error `|cand - ref| / max(|ref|, REL_FLOOR * absmax(ref))`: the floor keeps near-zero
  reference elements from exploding the ratio;
* an element is *outside* tolerance unless `|cand - ref| <= atol + rtol * |ref| + stol * absmax(ref)`
  (absmax over the tensor in that sample; the reference is always the `|ref|` term), or both sides are
  the same non-finite value (NaN and NaN, or equal infinities);
* `tol_ratio` is the largest `|cand - ref| / (atol + rtol * |ref| + stol * absmax(ref))`: how many
  tolerances the worst element is away (above 1 means outside); it ranks tensors of any magnitude;
* NaN/Inf on one side only poison the tensor: max errors become Inf, cosine 0, SQNR -SQNR_CAP_DB;
* cosine similarity and SQNR `10 log10(sum ref^2 / sum (cand - ref)^2)` (capped at +-SQNR_CAP_DB;
  identical tensors give the cap) are pooled over every element of every sample; `worst_sample_sqnr_db`
  is the lowest SQNR of a single sample;
* median and p99 of the absolute error come from a log-bucket sketch (SKETCH_BITS mantissa bits per
  bucket): within 1.6% of the exact nearest-rank value; errors below 2^-40 (about 1e-12) count as 0;
* integer and bool tensors are compared exactly: every differing element is outside.
Counts, minima and maxima merge exactly; float64 sums merge up to the order of addition.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from accudiff.judging import _reduce
from accudiff.judging.tolerances import Tolerance
from accudiff.model.formats import QuantRange

REL_FLOOR = 1e-3
SQNR_CAP_DB = 200.0
FP16_SMALLEST_NORMAL = 6.103515625e-05
CHUNK = 1 << 16
# A tensor of twice this many elements or more is reduced in parts of this many (a multiple of the kernel's
# chunk), which threads run at once; a fixed size, so the result is the same on any number of cores.
PART_ELEMENTS = 1 << 22
PartMap = Callable[[Callable[[int], Any], Iterable[int]], Iterable[Any]]  # map(), or a thread pool's
# The (reference, candidate) element types the compiled kernel reads as they are; other pairs are widened to float64.
KERNEL_PAIRS = frozenset((np.dtype(r), np.dtype(c)) for r, c in ((np.float32, np.float32), (np.float32, np.float16), (np.float64, np.float64)))

# The accumulator layout: one float64 per field, merged by the rule of its group. The first fields are the
# compiled kernel's totals (_reduce.c), in its order.
KERNEL_FIELDS = (
    "finite", "outside_count", "ref_nan", "ref_inf", "cand_nan", "cand_inf", "below_fp16_normal", "flushed_to_zero",
    "beyond_int8_range", "below_int8_step", "abs_err_sum", "rel_err_sum", "ref_sq", "err_sq", "cand_sq", "ref_cand",
    "max_abs_err", "max_rel_err", "tol_ratio", "poisoned", "worst_distance", "worst_index", "worst_ref", "worst_cand",
)
FIELDS = KERNEL_FIELDS + ("elements", "samples", "ref_min", "ref_max", "ref_absmax", "worst_sample_sqnr_db", "exact", "worst_sample")
F = {name: index for index, name in enumerate(FIELDS)}
_SUM = np.array([F[n] for n in KERNEL_FIELDS[:16] + ("elements", "samples")])
_MIN = np.array([F[n] for n in ("ref_min", "worst_sample_sqnr_db")])
_MAX = np.array([F[n] for n in ("max_abs_err", "max_rel_err", "tol_ratio", "poisoned", "ref_max", "ref_absmax", "exact")])
_WORST = np.array([F[n] for n in ("worst_distance", "worst_index", "worst_ref", "worst_cand", "worst_sample")])  # kept with the largest distance
EMPTY_ROW = np.zeros(len(FIELDS))
EMPTY_ROW[_MIN] = np.inf
EMPTY_ROW[_MAX] = -np.inf
EMPTY_ROW[_WORST] = (-np.inf, -1, np.nan, np.nan, -1)

# The sketch (computed by the kernel): bucket = float32 exponent and top SKETCH_BITS mantissa bits of the
# error, over 80 octaves from 2^SKETCH_LOW_EXPONENT.
SKETCH_BITS = 5
SKETCH_LOW_EXPONENT = -40
SKETCH_BUCKETS = _reduce.SKETCH_BUCKETS

class StatsSet:
    """Mergeable statistics of `count` tensors (rows), in a fixed order known to whoever merges them."""

    def __init__(self, count: int):
        self.values = np.tile(EMPTY_ROW, (count, 1))
        self.sketch = np.zeros((count, SKETCH_BUCKETS), np.int64)

    def add(self, row: int, values: np.ndarray, sketch: np.ndarray) -> None:
        """Merge one tensor's reduction (one sample, or any accumulation) into row `row`."""
        self.add_rows([row], values[None, :], sketch[None, :])

    def add_rows(self, rows: Sequence[int], values: np.ndarray, sketch: np.ndarray | None) -> None:
        """Merge reductions of several tensors (rows `rows`, each once) at once. `sketch` None: their
        sketches were already added into this set's (the kernel adds into the rows it is given)."""
        rows = np.asarray(rows, dtype=np.intp)
        merged = self.values[rows]
        _merge_rows(merged, values)
        self.values[rows] = merged
        if sketch is not None:
            self.sketch[rows] += sketch

    def merge(self, other: "StatsSet") -> None:
        """Merge another set of the same tensors (other samples, another worker) into this one."""
        _merge_rows(self.values, other.values)
        self.sketch += other.sketch

    def seen(self, row: int) -> bool:
        return bool(self.values[row, F["samples"]] > 0)

    def row(self, row: int) -> dict[str, float]:
        """The table columns of one tensor (see the module docstring)."""
        return finish(self.values[row], self.sketch[row])

    def arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays, for transport between processes and machines (no pickle)."""
        return {"values": self.values, "sketch": self.sketch}

    @classmethod
    def from_arrays(cls, arrays) -> "StatsSet":
        stats = cls(0)
        stats.values, stats.sketch = np.array(arrays["values"]), np.array(arrays["sketch"])
        return stats


def _merge_rows(into: np.ndarray, new: np.ndarray) -> None:
    into[:, _SUM] += new[:, _SUM]
    into[:, _MIN] = np.minimum(into[:, _MIN], new[:, _MIN])
    into[:, _MAX] = np.maximum(into[:, _MAX], new[:, _MAX])
    newer = new[:, F["worst_distance"]] > into[:, F["worst_distance"]]
    if newer.any():
        into[np.ix_(newer, _WORST)] = new[np.ix_(newer, _WORST)]


def finish(v: np.ndarray, sketch: np.ndarray) -> dict[str, float]:
    """Derived columns of one accumulator row (see `finish_rows`), as plain numbers."""
    return {name: column[0].item() for name, column in finish_rows(v[None, :], sketch[None, :]).items()}


_COUNTS = ("outside_count", "ref_nan", "ref_inf", "cand_nan", "cand_inf", "below_fp16_normal", "flushed_to_zero", "beyond_int8_range", "below_int8_step")


def finish_rows(v: np.ndarray, sketch: np.ndarray | None) -> dict[str, np.ndarray]:
    """Derived columns of accumulator rows `v` (one per tensor) and their sketches: a column each, computed
    for every row at once (the table of a model's every tensor, built row by row, took 0.05 s a pass).
    Without sketches, the error's median and p99 are left out (a sample's own figures need neither)."""
    column = {name: v[:, F[name]] for name in FIELDS}
    elements, finite = column["elements"].astype(np.int64), column["finite"]
    exact, poisoned = column["exact"] > 0, column["poisoned"] > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        rows = {
            "elements": elements,
            "samples": column["samples"].astype(np.int64),
            "ref_min": column["ref_min"].copy(),
            "ref_max": column["ref_max"].copy(),
            "ref_absmax": np.maximum(column["ref_absmax"], 0.0),
            "max_abs_err": np.maximum(column["max_abs_err"], 0.0),
            "tol_ratio": np.maximum(column["tol_ratio"], 0.0),
            "mean_abs_err": np.where(finite != 0, column["abs_err_sum"] / finite, 0.0),
            **(dict(zip(("median_abs_err", "p99_abs_err"), quantiles(sketch, (0.5, 0.99)))) if sketch is not None else {}),
            "max_rel_err": np.maximum(column["max_rel_err"], 0.0),
            "mean_rel_err": np.where(finite != 0, column["rel_err_sum"] / finite, 0.0),
            "cosine": np.where(exact, np.nan, _cosines(column["ref_cand"], column["ref_sq"], column["cand_sq"])),
            "sqnr_db": np.where(exact, np.nan, sqnr_db(column["ref_sq"], column["err_sq"])),
            "worst_sample_sqnr_db": np.where(exact, np.nan, np.minimum(column["worst_sample_sqnr_db"], SQNR_CAP_DB)),
        }
        rows.update({name: column[name].astype(np.int64) for name in _COUNTS})
        rows["outside_share"] = np.where(elements != 0, rows["outside_count"] / np.maximum(elements, 1), 0.0)
    has_worst = rows["outside_count"] > 0
    rows["worst_index"] = np.where(has_worst, column["worst_index"], -1).astype(np.int64)
    rows["worst_sample"] = np.where(has_worst, column["worst_sample"], -1).astype(np.int64)
    rows["worst_ref"] = np.where(has_worst, column["worst_ref"], np.nan)
    rows["worst_cand"] = np.where(has_worst, column["worst_cand"], np.nan)
    # NaN/Inf where the other side differs poison the tensor: say so in every error metric.
    for name, value in (("max_abs_err", np.inf), ("max_rel_err", np.inf), ("tol_ratio", np.inf), ("cosine", 0.0),
                        ("sqnr_db", -SQNR_CAP_DB), ("worst_sample_sqnr_db", -SQNR_CAP_DB)):
        rows[name][poisoned] = value
    return rows


def reduce_tensor(
    ref: np.ndarray,
    cand: np.ndarray,
    tol: Tolerance,
    quant: QuantRange | None = None,
    sample: int = 0,
    ref_range: tuple[float, float] | None = None,
    out: tuple[np.ndarray, np.ndarray] | None = None,
    map_parts: PartMap = map,
) -> tuple[np.ndarray, np.ndarray]:
    """One sample of one tensor as an accumulator row and its sketch (shapes must already match): the
    reference's finite range first (the tolerance scales with its absmax; `ref_range` when already known
    from `reference_range`), then the fused pass of the compiled kernel. `out`: an empty row to fill and a
    sketch to add to (rows of a caller's arrays: a zeroed one, or a running total), else new ones. A
    tensor of twice PART_ELEMENTS or more is reduced in parts of PART_ELEMENTS through `map_parts` (a
    thread pool's `map` runs them on every core: the kernel releases the GIL) and the parts are merged in
    order, so the row does not depend on how many threads ran them."""
    values, sketch = out if out is not None else (EMPTY_ROW.copy(), np.zeros(SKETCH_BUCKETS, np.int64))
    r, c = np.ascontiguousarray(ref).reshape(-1), np.ascontiguousarray(cand).reshape(-1)
    values[F["elements"]], values[F["samples"]] = r.size, 1
    if r.size == 0:
        return values, sketch
    if not (r.dtype.kind == "f" or c.dtype.kind == "f"):  # as np.issubdtype(..., np.floating), at a tenth of the cost
        _reduce_exact(r, c, values, sample)
        return values, sketch
    if (r.dtype, c.dtype) not in KERNEL_PAIRS:  # rare pairs: compared in float64
        r, c = r.astype(np.float64), c.astype(np.float64)
    low, high = ref_range if ref_range is not None else reference_range(r, map_parts)
    absmax = 0.0
    if low <= high:
        values[F["ref_min"]], values[F["ref_max"]] = low, high
        values[F["ref_absmax"]] = absmax = max(-float(low), float(high))
    base, floor = tol.atol + tol.stol * absmax, max(REL_FLOOR * absmax, _TINY[r.dtype.itemsize])
    quant_args = (*q.clipped_beyond, q.step / 2) if (q := quant) is not None else None
    if r.size < 2 * PART_ELEMENTS:
        _reduce.reduce(r, c, tol.rtol, base, floor, quant_args, 0, values[: len(KERNEL_FIELDS)], sketch, _scratch())
    else:
        def reduce_part(start: int) -> tuple[np.ndarray, np.ndarray]:
            part, part_sketch = EMPTY_ROW.copy(), np.zeros(SKETCH_BUCKETS, np.int64)
            stop = start + PART_ELEMENTS
            _reduce.reduce(r[start:stop], c[start:stop], tol.rtol, base, floor, quant_args, start, part[: len(KERNEL_FIELDS)], part_sketch, _scratch())
            return part, part_sketch

        for part, part_sketch in map_parts(reduce_part, range(0, r.size, PART_ELEMENTS)):
            _merge_rows(values[None, :], part[None, :])  # in order: an earlier part's worst element wins a tie, as in one pass
            sketch += part_sketch
    if values[F["worst_index"]] >= 0:
        values[F["worst_sample"]] = sample
    values[F["worst_sample_sqnr_db"]] = -SQNR_CAP_DB if values[F["poisoned"]] > 0 else sqnr_db(values[F["ref_sq"]], values[F["err_sq"]])
    return values, sketch


_RANGE_ONLY = Tolerance(atol=1.0, rtol=0.0)  # for a tensor compared with itself: no error, only its range


def range_rows(values: Sequence[np.ndarray], quant: Sequence[QuantRange | None], sample: int) -> tuple[np.ndarray, np.ndarray]:
    """Accumulator rows and sketches of values compared with themselves (a sample's graph inputs: each is its own
    candidate, and only its range counts), made at once to be merged at once (one by one, a small decoder's 18
    inputs took a seventh of its generation)."""
    rows, sketches = np.tile(EMPTY_ROW, (len(values), 1)), np.zeros((len(values), SKETCH_BUCKETS), np.int64)
    for row, value in enumerate(values):
        reduce_tensor(value, value, _RANGE_ONLY, quant[row], sample, out=(rows[row], sketches[row]))
    return rows, sketches


def reference_range(ref: np.ndarray, map_parts: PartMap = map) -> tuple[float, float]:
    """The smallest and largest finite reference values (low > high when none is finite); a tensor of
    twice PART_ELEMENTS or more in parts, through `map_parts` (see `reduce_tensor`)."""
    if ref.size == 0:
        return math.inf, -math.inf
    if ref.ndim == 1 and ref.size >= 2 * PART_ELEMENTS:
        parts = list(map_parts(lambda start: reference_range(ref[start : start + PART_ELEMENTS]), range(0, ref.size, PART_ELEMENTS)))
        return min(low for low, _ in parts), max(high for _, high in parts)
    if ref.dtype.kind != "f":  # as np.issubdtype(..., np.floating), at a tenth of the cost
        return float(ref.min()), float(ref.max())
    if ref.dtype == np.float32 and ref.flags.c_contiguous:
        found = _reduce.range(ref)
        if found is not None:
            return found
    low, high = np.min(ref), np.max(ref)
    if not (np.isfinite(low) and np.isfinite(high)):
        finite = ref[np.isfinite(ref)]
        if not finite.size:
            return np.inf, -np.inf
        low, high = finite.min(), finite.max()
    return float(low), float(high)


_TINY = {4: float(np.finfo(np.float32).tiny), 8: float(np.finfo(np.float64).tiny)}  # the kernel's two element types
_thread = threading.local()


def _scratch() -> np.ndarray:
    """The kernel's scratch memory, one per thread (the kernel runs without the GIL)."""
    if not hasattr(_thread, "scratch"):
        _thread.scratch = np.empty(_reduce.SCRATCH_BYTES, np.uint8)
    return _thread.scratch


def _reduce_exact(r: np.ndarray, c: np.ndarray, v: np.ndarray, sample: int) -> None:
    """Integer and bool tensors: every differing element is outside."""
    wide_r, wide_c = r.astype(np.float64), c.astype(np.float64)
    err = np.abs(wide_c - wide_r)
    v[F["exact"]] = 1.0
    v[F["finite"]] = r.size
    v[F["outside_count"]] = int(np.count_nonzero(err))
    v[F["ref_min"]], v[F["ref_max"]] = float(wide_r.min()), float(wide_r.max())
    v[F["ref_absmax"]] = float(np.abs(wide_r).max())
    v[F["max_abs_err"]] = float(err.max())
    v[F["abs_err_sum"]] = float(err.sum())
    v[F["tol_ratio"]] = np.inf if v[F["outside_count"]] else 0.0
    if v[F["outside_count"]]:
        index = int(np.argmax(err))
        v[_WORST] = (float(err[index]), index, float(wide_r[index]), float(wide_c[index]), sample)


def quantiles(sketch: np.ndarray, qs: Sequence[float]) -> list[np.ndarray]:
    """Nearest-rank quantiles of each row's sketch: the geometric middle of its bucket (0 for the lowest,
    and for an empty sketch)."""
    total, cumulative = sketch.sum(axis=1), np.cumsum(sketch, axis=1)
    found = []
    for q in qs:
        rank = np.ceil(q * (total - 1)).astype(np.int64) + 1
        bucket = (cumulative < rank[:, None]).sum(axis=1)
        exponent, mantissa = np.divmod(bucket, 1 << SKETCH_BITS)
        scale = 2.0 ** (exponent + SKETCH_LOW_EXPONENT).astype(np.float64)
        low, high = scale * (1 + mantissa / (1 << SKETCH_BITS)), scale * (1 + (mantissa + 1) / (1 << SKETCH_BITS))
        found.append(np.where((total == 0) | (bucket == 0), 0.0, np.sqrt(low * high)))
    return found


def error_histogram(sketch: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The absolute error's distribution from a sketch, one bin per octave: (bin edges, counts, errors
    counted as 0), the occupied octaves only. Every element is in it, not a sample."""
    buckets = np.asarray(sketch, np.int64)
    per_octave = buckets.reshape(-1, 1 << SKETCH_BITS).sum(axis=1)
    zeros = int(buckets[0])
    per_octave[0] -= zeros
    occupied = np.flatnonzero(per_octave)
    if not occupied.size:
        return np.array([]), np.array([], np.int64), zeros
    first, last = occupied[0], occupied[-1] + 1
    edges = 2.0 ** (np.arange(first, last + 1) + SKETCH_LOW_EXPONENT)
    return edges, per_octave[first:last], zeros


def _cosines(dot: np.ndarray, ref_energy: np.ndarray, cand_energy: np.ndarray) -> np.ndarray:
    """Cosine similarity from the sums (1 when both sides are all zero, 0 when one is)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = np.clip(dot / np.sqrt(ref_energy * cand_energy), -1.0, 1.0)
    return np.where((ref_energy == 0) & (cand_energy == 0), 1.0, np.where((ref_energy == 0) | (cand_energy == 0), 0.0, cosine))


def sqnr_db(signal: float | np.ndarray, noise: float | np.ndarray) -> float | np.ndarray:
    """`10 log10(signal / noise)`, capped at +-SQNR_CAP_DB (identical tensors give the cap); of numbers, or
    of arrays element by element."""
    if isinstance(signal, (float, np.floating)) and isinstance(noise, (float, np.floating)):
        # One tensor's (every tensor of every sample): no array machinery, 8 -> 1 us. numpy's log10, as the
        # arrays get (math's differs in the last bit); a Python division overflows to Inf without a warning.
        if noise == 0:  # no error at all
            return SQNR_CAP_DB
        ratio = float(signal) / float(noise)
        if ratio == 0:  # no signal, or one too small beside the error to tell from none
            return -SQNR_CAP_DB
        value = float(10 * np.log10(ratio))
        return value if math.isnan(value) else min(max(value, -SQNR_CAP_DB), SQNR_CAP_DB)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        value = np.clip(10 * np.log10(np.divide(signal, noise)), -SQNR_CAP_DB, SQNR_CAP_DB)
    value = np.where(np.equal(noise, 0), SQNR_CAP_DB, np.where(np.equal(signal, 0), -SQNR_CAP_DB, value))
    return value if value.ndim else float(value)


BULK_SHARE = 0.999  # the share of a tensor's values whose span is "what the bulk needs"


def run_time_range(ref: np.ndarray, levels: int) -> list[float]:
    """What sets one sample's range of a tensor quantized per tensor as the model runs (its own [min, max],
    0 included, in `levels` steps): [1 sample, elements, values beyond half the range's largest magnitude
    (the few that set it), low, high, and the span 99.9% of its values need (0 included)]. Mergeable with
    `merge_run_time_ranges`."""
    values = np.asarray(ref, np.float64).reshape(-1)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return [1, 0, 0, 0.0, 0.0, 0.0, 0.0]
    low, high = min(float(values.min()), 0.0), max(float(values.max()), 0.0)
    setting = int(np.count_nonzero(np.abs(values) > max(-low, high) / 2))
    tail = (1 - BULK_SHARE) / 2
    bulk_low, bulk_high = np.quantile(values, [tail, 1 - tail])
    return [1, values.size, setting, low, high, min(float(bulk_low), 0.0), max(float(bulk_high), 0.0)]


def merge_run_time_ranges(into: list[float] | None, new: list[float]) -> list[float]:
    """Two records of `run_time_range` as one: samples, elements and the values setting ranges added up; the
    sample whose range is widest against its bulk's span kept."""
    if into is None:
        return list(new)
    widest = max((into, new), key=widening)
    return [into[0] + new[0], into[1] + new[1], into[2] + new[2], *widest[3:]]


def widening(record: list[float]) -> float:
    """How many times wider a sample's range is than the span its bulk needs (1: no outliers)."""
    low, high, bulk_low, bulk_high = record[3:7]
    return (high - low) / (bulk_high - bulk_low) if bulk_high > bulk_low else (1.0 if high == low else math.inf)


POINTS_PER_SAMPLE = 512  # (reference, candidate) pairs of each graph output kept per sample, for plots


def sample_points(sample: int, ref: np.ndarray, cand: np.ndarray, worst: int, room: int) -> list[list[float]]:
    """Up to min(POINTS_PER_SAMPLE, room) [sample, reference, candidate] triples, evenly strided, the worst
    element first: what the report's scatter plot shows of a graph output (the sample number orders the
    points of several workers as one worker would have kept them)."""
    if room <= 0 or not np.issubdtype(np.asarray(ref).dtype, np.floating):
        return []
    r, c = np.asarray(ref).reshape(-1), np.asarray(cand).reshape(-1)
    count = min(POINTS_PER_SAMPLE, room, r.size)
    picked = np.unique(np.linspace(0, r.size - 1, count).astype(np.int64))
    if 0 <= worst < r.size:
        picked = np.concatenate([[worst], picked[picked != worst]])[:count]
    return np.stack([np.full(picked.size, float(sample)), r[picked].astype(np.float64), c[picked].astype(np.float64)], axis=1).tolist()
