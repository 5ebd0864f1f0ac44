"""Per-tensor error statistics, computed in one vectorized pass and aggregated over iterations.

Definitions (also in the README):
* absolute error `|cand - ref|`; statistics over elements where both sides are finite;
* relative error `|cand - ref| / max(|ref|, REL_FLOOR * absmax(ref))`: the floor keeps near-zero
  reference elements from exploding the ratio;
* `tol_ratio` is the largest `|cand - ref| / (atol + rtol * |ref| + stol * absmax(ref))`: how many
  tolerances the worst element is away (above 1 means outside); it ranks tensors of any magnitude;
* an element is *outside* tolerance unless `|cand - ref| <= atol + rtol * |ref| + stol * absmax(ref)` (the
  reference is always the `|ref|` term; `stol` scales with the tensor's own magnitude, see tolerances.py),
  or both sides are the same non-finite value (NaN and NaN, or equal infinities);
* NaN/Inf on one side only poison the tensor: max errors become Inf, cosine 0, SQNR -SQNR_CAP_DB; the
  other error statistics cover the elements finite on both sides;
* cosine similarity is 1 for two all-zero tensors and 0 when exactly one is all zero;
* SQNR is `10 log10(sum ref^2 / sum (cand - ref)^2)` in dB, capped at +-SQNR_CAP_DB (identical tensors
  give the cap);
* median and p99 of the absolute error are exact up to PERCENTILE_SAMPLE elements and estimated from an
  evenly strided sample above that (a full partition of every large tensor would dominate the run time);
* integer and bool tensors are compared exactly: every differing element is outside.
Iterations aggregate as worst case (max error, min cosine/SQNR) plus pooled means, so no iteration's
arrays are kept once its statistics are taken.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from accudiff.comparison.tolerances import Tolerance
from accudiff.transforms.base import QuantRange

REL_FLOOR = 1e-3
SQNR_CAP_DB = 200.0
PERCENTILE_SAMPLE = 1 << 15
FP16_SMALLEST_NORMAL = 6.103515625e-05


@dataclass
class TensorStats:
    """Statistics of one tensor over all iterations seen so far."""

    elements: int = 0
    ref_min: float = np.inf
    ref_max: float = -np.inf
    ref_absmax: float = 0.0
    max_abs_err: float = 0.0
    tol_ratio: float = 0.0
    mean_abs_err: float = 0.0
    median_abs_err: float = 0.0
    p99_abs_err: float = 0.0
    max_rel_err: float = 0.0
    mean_rel_err: float = 0.0
    cosine: float = 1.0
    sqnr_db: float = SQNR_CAP_DB
    outside_count: int = 0
    ref_nan: int = 0
    ref_inf: int = 0
    cand_nan: int = 0
    cand_inf: int = 0
    below_fp16_normal: int = 0
    flushed_to_zero: int = 0
    beyond_int8_range: int = 0
    below_int8_step: int = 0
    worst_index: int = -1
    worst_ref: float = np.nan
    worst_cand: float = np.nan
    worst_iteration: int = -1
    iterations: int = 0
    _abs_err_sum: float = 0.0
    _rel_err_sum: float = 0.0
    _finite_count: int = 0

    @property
    def outside_share(self) -> float:
        return self.outside_count / self.elements if self.elements else 0.0

    def as_row(self) -> dict[str, float | int]:
        row = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        row["outside_share"] = self.outside_share
        return row


def measure(ref: np.ndarray, cand: np.ndarray, tol: Tolerance, quant: QuantRange | None = None) -> TensorStats:
    """Statistics of one tensor for one iteration (shapes must already match).

    Works in the wider of the two float types (FP32 for FP32/FP16 pairs) with few passes over the data;
    sums are accumulated in FP64 where precision matters.
    """
    if not (np.issubdtype(ref.dtype, np.floating) or np.issubdtype(cand.dtype, np.floating)):
        return _measure_exact(ref, cand)
    dtype = np.result_type(ref.dtype, cand.dtype, np.float32)
    r = np.asarray(ref, dtype=dtype).reshape(-1)
    c = np.asarray(cand, dtype=dtype).reshape(-1)
    stats = TensorStats(elements=r.size, iterations=1)
    if r.size == 0:
        return stats
    abs_r = np.abs(r)
    with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf where both sides agree on Inf
        err = np.subtract(c, r)
        np.abs(err, out=err)
    any_nonfinite = not (np.isfinite(abs_r.max()) and np.isfinite(err.max()))
    if any_nonfinite:
        r_nan, c_nan, r_inf, c_inf = np.isnan(r), np.isnan(c), np.isinf(r), np.isinf(c)
        stats.ref_nan, stats.cand_nan = int(r_nan.sum()), int(c_nan.sum())
        stats.ref_inf, stats.cand_inf = int(r_inf.sum()), int(c_inf.sum())
        ref_finite = ~(r_nan | r_inf)
        finite_r, finite_abs_r = r[ref_finite], abs_r[ref_finite]
    else:
        finite_r, finite_abs_r = r, abs_r
    absmax = float(finite_abs_r.max()) if finite_abs_r.size else 0.0
    with np.errstate(invalid="ignore"):
        limit = abs_r * dtype.type(tol.rtol)
        limit += dtype.type(tol.atol + tol.stol * absmax)
        within = err <= limit
    if any_nonfinite:
        within |= (r_nan & c_nan) | (r_inf & c_inf & (np.sign(r) == np.sign(c)))
    stats.outside_count = int(within.size - np.count_nonzero(within))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.divide(err, limit, out=np.zeros_like(err), where=err > 0)
    if any_nonfinite:
        ratio[~within & np.isnan(err)] = np.inf
    stats.tol_ratio = float(ratio.max())
    del ratio
    if stats.outside_count:
        # The worst element: the one furthest from the reference (non-finite mismatches count as infinite).
        distance = np.where(within, -np.inf, np.nan_to_num(err, nan=np.inf)) if any_nonfinite else np.where(within, -np.inf, err)
        stats.worst_index = int(np.argmax(distance))
        stats.worst_ref, stats.worst_cand = float(r[stats.worst_index]), float(c[stats.worst_index])
    if finite_abs_r.size:
        stats.ref_min, stats.ref_max, stats.ref_absmax = float(finite_r.min()), float(finite_r.max()), absmax
        zeros = int(finite_abs_r.size - np.count_nonzero(finite_abs_r))
        stats.below_fp16_normal = int(np.count_nonzero(finite_abs_r < FP16_SMALLEST_NORMAL)) - zeros
        if quant is not None:
            stats.beyond_int8_range = int(np.count_nonzero((finite_r < quant.low) | (finite_r > quant.high)))
            stats.below_int8_step = int(np.count_nonzero(finite_abs_r < quant.scale / 2)) - zeros
    poisoned = any_nonfinite and bool((~within & ~np.isfinite(err)).any())
    if any_nonfinite:
        both = ~(r_nan | c_nan | r_inf | c_inf)
        r, c, err, abs_r = r[both], c[both], err[both], abs_r[both]
    c_zero = c == 0
    stats.flushed_to_zero = int(np.count_nonzero(c_zero) - np.count_nonzero(c_zero & (abs_r == 0)))
    if r.size:
        floor = max(REL_FLOOR * absmax, float(np.finfo(dtype).tiny))
        rel = err / np.maximum(abs_r, dtype.type(floor))
        stats._finite_count = r.size
        stats._abs_err_sum = float(np.sum(err, dtype=np.float64))
        stats._rel_err_sum = float(np.sum(rel, dtype=np.float64))
        stats.mean_abs_err = stats._abs_err_sum / r.size
        stats.mean_rel_err = stats._rel_err_sum / r.size
        stats.max_abs_err, stats.max_rel_err = float(err.max()), float(rel.max())
        stats.median_abs_err, stats.p99_abs_err = _median_p99(err)
        signal, noise = float(np.dot(r, r)), float(np.dot(err, err))
        stats.cosine = _cosine(float(np.dot(r, c)), signal, float(np.dot(c, c)))
        stats.sqnr_db = _sqnr_db(signal, noise)
    if poisoned:
        # NaN/Inf where the other side differs poison the tensor: say so in every error metric.
        stats.max_abs_err = stats.max_rel_err = np.inf
        stats.cosine, stats.sqnr_db = 0.0, -SQNR_CAP_DB
    return stats


def _median_p99(err: np.ndarray) -> tuple[float, float]:
    """Exact (nearest rank) up to PERCENTILE_SAMPLE elements; above, from an evenly strided sample of about that size."""
    sample = err[:: err.size // PERCENTILE_SAMPLE] if err.size > PERCENTILE_SAMPLE else err.copy()
    ranks = [(sample.size - 1) // 2, int(np.ceil(0.99 * (sample.size - 1)))]
    sample.partition(ranks)
    return float(sample[ranks[0]]), float(sample[ranks[1]])


def merge(total: TensorStats, new: TensorStats, iteration: int) -> TensorStats:
    """Fold one iteration's statistics into the running aggregate (worst case and pooled means)."""
    if total.iterations == 0:
        new.worst_iteration = iteration if new.outside_count else -1
        return new
    merged = TensorStats(
        elements=total.elements + new.elements,
        ref_min=min(total.ref_min, new.ref_min),
        ref_max=max(total.ref_max, new.ref_max),
        ref_absmax=max(total.ref_absmax, new.ref_absmax),
        max_abs_err=max(total.max_abs_err, new.max_abs_err),
        tol_ratio=max(total.tol_ratio, new.tol_ratio),
        median_abs_err=max(total.median_abs_err, new.median_abs_err),
        p99_abs_err=max(total.p99_abs_err, new.p99_abs_err),
        max_rel_err=max(total.max_rel_err, new.max_rel_err),
        cosine=min(total.cosine, new.cosine),
        sqnr_db=min(total.sqnr_db, new.sqnr_db),
        iterations=total.iterations + new.iterations,
        _abs_err_sum=total._abs_err_sum + new._abs_err_sum,
        _rel_err_sum=total._rel_err_sum + new._rel_err_sum,
        _finite_count=total._finite_count + new._finite_count,
    )
    for name in ("outside_count", "ref_nan", "ref_inf", "cand_nan", "cand_inf", "below_fp16_normal",
                 "flushed_to_zero", "beyond_int8_range", "below_int8_step"):
        setattr(merged, name, getattr(total, name) + getattr(new, name))
    if merged._finite_count:
        merged.mean_abs_err = merged._abs_err_sum / merged._finite_count
        merged.mean_rel_err = merged._rel_err_sum / merged._finite_count
    worst_is_new = new.outside_count and (not total.outside_count or abs(new.worst_cand - new.worst_ref) > abs(total.worst_cand - total.worst_ref))
    source, merged.worst_iteration = (new, iteration) if worst_is_new else (total, total.worst_iteration)
    merged.worst_index, merged.worst_ref, merged.worst_cand = source.worst_index, source.worst_ref, source.worst_cand
    return merged


def _measure_exact(ref: np.ndarray, cand: np.ndarray) -> TensorStats:
    r, c = np.asarray(ref).reshape(-1), np.asarray(cand).reshape(-1)
    stats = TensorStats(elements=r.size, iterations=1, cosine=np.nan, sqnr_db=np.nan)
    if r.size == 0:
        return stats
    differ = r != c
    stats.outside_count = int(differ.sum())
    stats.tol_ratio = np.inf if stats.outside_count else 0.0  # integers and bools must match exactly
    wide_r, wide_c = r.astype(np.float64), c.astype(np.float64)
    stats.ref_min, stats.ref_max = float(wide_r.min()), float(wide_r.max())
    stats.ref_absmax = float(np.abs(wide_r).max())
    err = np.abs(wide_c - wide_r)
    stats.max_abs_err = float(err.max())
    stats._abs_err_sum, stats._finite_count = float(err.sum()), r.size
    stats.mean_abs_err = stats._abs_err_sum / r.size
    if stats.outside_count:
        stats.worst_index = int(np.argmax(err))
        stats.worst_ref, stats.worst_cand = float(wide_r[stats.worst_index]), float(wide_c[stats.worst_index])
    return stats


def _cosine(dot: float, ref_energy: float, cand_energy: float) -> float:
    if ref_energy == 0 and cand_energy == 0:
        return 1.0
    if ref_energy == 0 or cand_energy == 0:
        return 0.0
    return float(np.clip(dot / np.sqrt(ref_energy * cand_energy), -1.0, 1.0))


def _sqnr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return SQNR_CAP_DB
    if signal == 0:
        return -SQNR_CAP_DB
    return float(np.clip(10 * np.log10(signal / noise), -SQNR_CAP_DB, SQNR_CAP_DB))
