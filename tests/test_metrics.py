"""The statistics of one tensor: on hand-made arrays whose answers are known, against a plain numpy
computation of the same definitions (the compiled kernel's oracle), and merged over chunks and samples."""

from __future__ import annotations

import re

import warnings

import numpy as np
import pytest

from accudiff.judging import _reduce
from accudiff.judging.decisions import _add_to_sketch, _tolerance_needed
from accudiff.judging.metrics import CHUNK, SKETCH_BUCKETS, SQNR_CAP_DB, StatsSet, finish, reduce_tensor, sqnr_db
from accudiff.judging.tolerances import Tolerance, Tolerances
from accudiff.errors import AccudiffError

STRICT = Tolerance(atol=1e-6, rtol=0.0)
FP16 = Tolerance(atol=1e-3, rtol=1e-2, stol=2e-3)


def measure(ref, cand, tol, quant=None, sample=0) -> dict:
    return finish(*reduce_tensor(np.asarray(ref), np.asarray(cand), tol, quant, sample))


def test_identical_tensors_have_capped_sqnr_and_unit_cosine():
    ref = np.linspace(-1, 1, 100, dtype=np.float32)
    stats = measure(ref, ref.copy(), STRICT)
    assert stats["max_abs_err"] == 0 and stats["outside_count"] == 0
    assert stats["sqnr_db"] == SQNR_CAP_DB and stats["cosine"] == 1.0


def test_all_zero_tensors_agree():
    zeros = np.zeros(10, np.float32)
    stats = measure(zeros, zeros, STRICT)
    assert stats["cosine"] == 1.0 and stats["sqnr_db"] == SQNR_CAP_DB


def test_tolerance_is_measured_against_the_reference():
    ref = np.array([10.0], np.float32)
    # |cand - ref| = 1 <= 0 + 0.1 * |ref| passes; the same gap with the roles swapped would not.
    assert measure(ref, np.array([11.0], np.float32), Tolerance(0.0, 0.1))["outside_count"] == 0
    assert measure(np.array([11.0], np.float32), ref, Tolerance(0.0, 0.09))["outside_count"] == 1


def test_scale_tolerance_follows_the_tensor_magnitude():
    ref = np.array([500.0, 0.01], np.float32)
    cand = np.array([500.0, 0.26], np.float32)
    assert measure(ref, cand, Tolerance(1e-3, 1e-2, 0.0))["outside_count"] == 1
    assert measure(ref, cand, Tolerance(1e-3, 1e-2, 1e-3))["outside_count"] == 0


def test_relative_error_has_a_safe_denominator():
    ref = np.array([100.0, 0.0], np.float32)
    cand = np.array([100.0, 0.05], np.float32)
    assert measure(ref, cand, STRICT)["max_rel_err"] == pytest.approx(0.05 / (1e-3 * 100.0))


def test_tol_ratio_says_how_many_tolerances_the_worst_element_is_away():
    ref = np.array([1.0, 2.0], np.float32)
    cand = np.array([1.0, 2.5], np.float32)
    assert measure(ref, cand, Tolerance(0.1, 0.0))["tol_ratio"] == pytest.approx(5.0)
    assert measure(ref, ref, Tolerance(0.0, 0.0))["tol_ratio"] == 0.0  # limits of zero, and nothing wrong


def test_nan_and_inf_are_counted_and_poison_the_error_metrics():
    ref = np.array([1.0, 2.0, np.nan, np.inf], np.float32)
    cand = np.array([1.0, np.inf, np.nan, np.inf], np.float32)
    stats = measure(ref, cand, STRICT)
    assert (stats["ref_nan"], stats["ref_inf"], stats["cand_nan"], stats["cand_inf"]) == (1, 1, 1, 2)
    assert stats["outside_count"] == 1  # matching NaN/NaN and Inf/Inf are not errors
    assert stats["max_abs_err"] == np.inf and stats["sqnr_db"] == -SQNR_CAP_DB and stats["tol_ratio"] == np.inf
    assert stats["worst_index"] == 1 and stats["worst_cand"] == np.inf
    assert stats["ref_absmax"] == 2.0  # reference range over its finite values


def test_fp16_candidate_counts_underflow_and_flush_to_zero():
    ref = np.array([1e-7, 3e-5, 1.0, 0.0], np.float32)
    cand = ref.astype(np.float16)
    stats = measure(ref, cand, STRICT)
    assert stats["below_fp16_normal"] == 2
    assert stats["flushed_to_zero"] == 0 and cand[0] != 0  # 1e-7 is a subnormal, not zero
    assert measure(np.array([1e-8], np.float32), np.array([1e-8], np.float32).astype(np.float16), STRICT)["flushed_to_zero"] == 1


def test_integer_tensors_compare_exactly():
    stats = measure(np.array([1, 2, 3]), np.array([1, 2, 4]), STRICT)
    assert stats["outside_count"] == 1 and stats["max_abs_err"] == 1 and np.isnan(stats["sqnr_db"])


def _numpy_oracle(ref: np.ndarray, cand: np.ndarray, tol: Tolerance) -> dict:
    """The definitions of metrics.py, computed plainly in numpy (float64), for finite inputs."""
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    err = np.abs(c - r)
    absmax = np.abs(r).max()
    limit = tol.atol + tol.rtol * np.abs(r) + tol.stol * absmax
    outside = err > limit
    rel = err / np.maximum(np.abs(r), 1e-3 * absmax)
    ordered = np.sort(err)
    return {
        "outside_count": int(outside.sum()),
        "max_abs_err": err.max(),
        "mean_abs_err": err.mean(),
        "max_rel_err": rel.max(),
        "mean_rel_err": rel.mean(),
        "tol_ratio": (err / limit).max(),
        "sqnr_db": 10 * np.log10((r**2).sum() / (err**2).sum()),
        "cosine": (r * c).sum() / np.sqrt((r**2).sum() * (c**2).sum()),
        "worst_index": int(np.argmax(np.where(outside, err, -1))) if outside.any() else -1,
        "median_abs_err": ordered[int(np.ceil(0.5 * (err.size - 1)))],
        "p99_abs_err": ordered[int(np.ceil(0.99 * (err.size - 1)))],
        "below_fp16_normal": int(((np.abs(r) < 6.103515625e-05) & (r != 0)).sum()),
    }


@pytest.mark.parametrize("cand_dtype", [np.float32, np.float16])
def test_the_kernel_agrees_with_plain_numpy_across_chunk_boundaries(cand_dtype):
    rng = np.random.default_rng(0)
    size = 3 * _reduce.CHUNK + 17
    ref = (rng.standard_normal(size) * np.repeat(rng.uniform(0.01, 30, 100), size // 100 + 1)[:size]).astype(np.float32)
    ref[::997] = rng.uniform(-5e-5, 5e-5, ref[::997].size)  # values FP16 cannot hold with precision
    cand = (ref * (1 + rng.normal(0, 1e-2, size))).astype(cand_dtype)
    cand[123456] += 40.0  # one element far out: it must be the worst
    got, want = measure(ref, cand, FP16), _numpy_oracle(ref, cand.astype(np.float32), FP16)
    assert got["worst_index"] == want["worst_index"] == 123456
    assert got["outside_count"] == want["outside_count"] > 1
    assert got["below_fp16_normal"] == want["below_fp16_normal"] > 0
    for key in ("max_abs_err", "mean_abs_err", "max_rel_err", "mean_rel_err", "tol_ratio", "cosine"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], abs=1e-3)
    for key in ("median_abs_err", "p99_abs_err"):  # the sketch's documented bound
        assert got[key] == pytest.approx(want[key], rel=0.016), key


def _tolerance_needed_in_numpy(r: np.ndarray, c: np.ndarray, atol: float, rtol: float, spread: float) -> tuple[float, float, int, np.ndarray]:
    """The tolerance an output needs and its elements' errors in tolerances, by their definition in numpy (float64)."""
    r, c = r.astype(np.float64), c.astype(np.float64)
    same = (np.isnan(r) & np.isnan(c)) | (np.isinf(r) & (r == c))
    non_finite = int(np.count_nonzero(~(np.isfinite(r) & np.isfinite(c)) & ~same))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        error = np.where(same, 0.0, np.nan_to_num(np.abs(c - r), nan=np.inf, posinf=np.inf))
        magnitude = np.abs(np.where(np.isfinite(r), r, 0.0))
        allowed = atol + rtol * magnitude + spread
        ratios = np.where(allowed > 0, error / allowed, np.where(error > 0, np.inf, 0.0))
        needed_atol = float(np.max(error - rtol * magnitude - spread, initial=0.0))
        excess = error - atol - spread
        needed_rtol = float(np.max(np.where(excess > 0, excess / magnitude, 0.0), initial=0.0))
    sketch = np.zeros(SKETCH_BUCKETS, np.int64)
    _add_to_sketch(sketch, ratios)
    return needed_atol, needed_rtol, non_finite, sketch


@pytest.mark.parametrize("pair", [(np.float32, np.float32), (np.float32, np.float16), (np.float64, np.float64), (np.float32, np.float64)])
@pytest.mark.parametrize("atol, stol", [(0.05, 0.1), (0.0, 0.0)])
def test_the_tolerance_an_output_needs_is_the_numpy_definitions_to_the_last_bit(pair, atol, stol):
    """decisions.py's tolerance line (the atol and rtol an output needs, its non-finite elements, the sketch of
    its elements' errors in tolerances) comes from the compiled kernel; it must be what numpy computes,
    bit for bit, on every kind of element, for every pair of types (those the kernel does not read are
    widened a chunk at a time)."""
    rng = np.random.default_rng(5)
    size = 2 * CHUNK + 333
    ref = rng.standard_normal(size) * rng.choice([1e-30, 1e-3, 1.0, 300.0], size)
    cand = ref + rng.standard_normal(size) * rng.choice([0.0, 1e-6, 1e-2, 3.0], size)
    ref[::1001], cand[7::1003] = 0.0, 0.0
    for index, (r, c) in enumerate([(np.nan, np.nan), (np.inf, np.inf), (np.inf, -np.inf), (-np.inf, 1.0), (2.0, np.nan), (np.nan, 1.0), (0.0, 1e-3), (3e38, -3e38)]):
        ref[CHUNK - 4 + index], cand[CHUNK - 4 + index] = r, c  # across a chunk's boundary
    with np.errstate(over="ignore"):  # 3e38 is -Inf in FP16
        ref, cand = ref.astype(pair[0]), cand.astype(pair[1])
    absmax = float(np.nanmax(np.abs(ref[np.isfinite(ref)])))
    sketch = np.zeros(SKETCH_BUCKETS, np.int64)
    got = _tolerance_needed(ref, cand, Tolerance(atol, 0.25, stol), absmax, sketch)
    *want, want_sketch = _tolerance_needed_in_numpy(ref, cand, atol, 0.25, stol * absmax)
    assert got == tuple(want) and got[2] >= 4
    assert np.array_equal(sketch, want_sketch) and sketch.sum() == size


def test_an_fp16_candidate_is_read_as_numpy_widens_it_every_half_value():
    """The kernel widens an FP16 candidate itself (eight halves at a time where the CPU can, one by one for
    the rest): every half value, from an unaligned start, over a chunk boundary and a tail."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    cand = np.concatenate([halves, halves[:13]])[3:]
    ref = np.linspace(-70000, 70000, cand.size, dtype=np.float32)
    got, want = reduce_tensor(ref, cand, FP16), reduce_tensor(ref, cand.astype(np.float32), FP16)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_quantiles_are_not_fooled_by_periodic_error_patterns():
    """A strided sample sees one phase of a periodic pattern; the sketch counts every element."""
    ref = np.ones(1 << 18, np.float32)
    cand = ref.copy()
    cand[::64] += 1.0  # one element in 64 is far off, every other element is exact
    stats = measure(ref, cand, STRICT)
    assert stats["median_abs_err"] == 0.0
    assert stats["p99_abs_err"] == pytest.approx(1.0, rel=0.016)


def test_chunked_sample_by_sample_and_one_shot_reductions_agree():
    """Two samples reduced separately and merged (in either order, or in two workers' sets) give what one
    set fed both gives: counts, minima, maxima exactly; float64 sums up to the order of addition."""
    rng = np.random.default_rng(1)
    samples = [(r, (r + rng.normal(0, 0.05, r.size)).astype(np.float32)) for r in (rng.standard_normal(n).astype(np.float32) for n in (70_000, 200_000))]
    one = StatsSet(1)
    for index, (r, c) in enumerate(samples):
        one.add(0, *reduce_tensor(r, c, FP16, sample=index))
    first, second = StatsSet(1), StatsSet(1)
    first.add(0, *reduce_tensor(*samples[0], FP16, sample=0))
    second.add(0, *reduce_tensor(*samples[1], FP16, sample=1))
    for merged in (first, second):
        other = second if merged is first else first
        combined = StatsSet.from_arrays(merged.arrays())
        combined.merge(other)
        a, b = combined.row(0), one.row(0)
        for key in ("elements", "outside_count", "max_abs_err", "tol_ratio", "worst_index", "worst_sample", "ref_min", "ref_max", "samples"):
            assert a[key] == b[key], key
        for key in ("mean_abs_err", "sqnr_db", "cosine", "median_abs_err", "p99_abs_err"):
            assert a[key] == pytest.approx(b[key], rel=1e-12), key
    pooled = one.row(0)
    assert pooled["worst_sample_sqnr_db"] <= pooled["sqnr_db"] + 1e-9 and pooled["samples"] == 2


def test_the_worst_element_is_the_first_outside_with_the_largest_error():
    """The kernel looks for the worst element only in chunks whose largest error outside beats the worst so
    far: among equal errors the first outside wins, not an earlier one inside tolerance (a larger |ref|)."""
    rng = np.random.default_rng(3)
    size = 3 * _reduce.CHUNK
    ref = rng.standard_normal(size).astype(np.float32)
    cand = (ref * (1 + rng.normal(0, 1e-3, size))).astype(np.float32)
    inside, first, same_later, next_chunk = 100, 5000, 9000, _reduce.CHUNK + 7
    ref[inside], cand[inside] = 120.0, 121.0  # an error of 1 within tolerance: 1.2 for |ref| = 120
    for at in (first, same_later, next_chunk):
        ref[at], cand[at] = 0.5, 1.5  # an error of 1, outside
    got, want = measure(ref, cand, FP16), _numpy_oracle(ref, cand, FP16)
    assert got["worst_index"] == want["worst_index"] == first and got["max_abs_err"] == 1.0


def test_negative_infinities_count_as_infinities():
    """-Inf counted as -1 (C's isinf may return the sign) made a +Inf and a -Inf cancel out: a candidate
    that overflowed both ways read as one without Inf."""
    ref = np.array([1.0, -2.0, 3.0, -np.inf], np.float32)
    cand = np.array([np.inf, -np.inf, 3.0, -np.inf], np.float16)
    stats = measure(ref, cand, FP16)
    assert (stats["cand_inf"], stats["ref_inf"], stats["outside_count"]) == (3, 1, 2)


def test_a_tensor_reduced_in_parts_on_several_threads_gives_the_one_pass_row(monkeypatch):
    """A long tensor is reduced in parts on every core: its row is the one pass's (counts, extremes and the
    worst element's index exactly, float64 sums up to their order), and the same whatever ran the parts."""
    from concurrent.futures import ThreadPoolExecutor

    from accudiff.judging import metrics

    rng = np.random.default_rng(7)
    size = int(2.5 * metrics.PART_ELEMENTS)
    ref = rng.standard_normal(size).astype(np.float32)
    cand = (ref + rng.normal(0, 1e-3, size)).astype(np.float16)
    far = [metrics.PART_ELEMENTS + 5, 2 * metrics.PART_ELEMENTS + 9]  # the same large error in two parts
    ref[far], cand[far] = 0.5, np.float16(3.5)
    with ThreadPoolExecutor(max_workers=3) as pool:
        threaded = reduce_tensor(ref, cand, FP16, sample=4, map_parts=pool.map)
    serial = reduce_tensor(ref, cand, FP16, sample=4)
    assert np.array_equal(threaded[0], serial[0]) and np.array_equal(threaded[1], serial[1])
    monkeypatch.setattr(metrics, "PART_ELEMENTS", size)  # one pass
    whole = reduce_tensor(ref, cand, FP16, sample=4)
    parted, one = finish(*serial), finish(*whole)
    assert parted["worst_index"] == far[0] and parted["worst_sample"] == 4 and parted["samples"] == 1  # the tie: the first
    cand[-3] = np.float16(-np.inf)  # an Inf the reference does not have, in the last part: the worst, and poison
    monkeypatch.undo()
    poisoned = finish(*reduce_tensor(ref, cand, FP16))
    assert poisoned["worst_index"] == size - 3 and poisoned["cand_inf"] == 1 and poisoned["max_abs_err"] == np.inf
    for key in ("elements", "outside_count", "cand_inf", "max_abs_err", "tol_ratio", "worst_index", "ref_min", "ref_max", "median_abs_err", "p99_abs_err"):
        assert parted[key] == one[key], key
    for key in ("mean_abs_err", "sqnr_db", "worst_sample_sqnr_db", "cosine"):
        assert parted[key] == pytest.approx(one[key], rel=1e-9), key


def test_tolerance_options_parse_defaults_and_overrides():
    tolerances = Tolerances.build("fp16", atol=["1e-3", "logits:1e-2"], rtol=0.5)
    assert tolerances.for_tensor("logits").atol == 1e-2
    assert tolerances.for_tensor("other").atol == 1e-3
    assert tolerances.for_tensor("other").rtol == 0.5
    with pytest.raises(AccudiffError, match="not a number"):
        Tolerances.build("fp16", atol=["logits:big"])


def test_the_table_holds_each_tensors_row_and_says_what_was_not_measured():
    """The table is built for every tensor at once: each measured row is that tensor's own statistics
    (identical, poisoned, exact integer, out of tolerance), a tensor never measured is 'not observed'
    with no statistics, and a shape mismatch fails even without statistics."""
    from accudiff.judging.table import STATUS_FAIL, STATUS_MISSING, STATUS_PASS, build_table
    from accudiff.model.inventory import TensorInfo

    rng = np.random.default_rng(0)
    ref = rng.normal(size=1000).astype(np.float32)
    pairs = [
        (ref, ref.copy()),
        (np.array([1.0, 2.0, np.inf], np.float32), np.array([1.0, np.nan, np.inf], np.float32)),
        (np.arange(6, dtype=np.int64), np.array([0, 1, 2, 3, 4, 7], np.int64)),
        (ref, (ref + rng.normal(scale=0.05, size=1000)).astype(np.float16)),
    ]
    stats = StatsSet(len(pairs) + 2)
    for row, (r, c) in enumerate(pairs):
        stats.add(row, *reduce_tensor(r, c, FP16, sample=row))
    tensors = [TensorInfo(f"t{k}", f"n{k}", "Op", np.dtype(np.float32), k == 0) for k in range(len(pairs) + 2)]
    notes = {len(pairs) + 1: "shape differs: (2,) against (3,)"}
    table = build_table(tensors, stats, {}, notes, Tolerances.build("fp16"), {})
    for row in range(len(pairs)):
        expected = finish(stats.values[row], stats.sketch[row])
        got = table.iloc[row][list(expected)].to_dict()
        assert got == pytest.approx(expected, nan_ok=True, rel=0, abs=0), row
    assert list(table["status"]) == [STATUS_PASS, STATUS_FAIL, STATUS_FAIL, STATUS_FAIL, STATUS_MISSING, STATUS_FAIL]
    assert table.iloc[4][["max_abs_err", "elements", "sqnr_db"]].isna().all()
    assert table["tensor"].tolist() == [t.name for t in tensors] and table["is_output"].tolist() == [True] + [False] * 5


def test_one_tensors_sqnr_is_what_the_arrays_get():
    """One tensor's SQNR (every tensor of every sample) skips numpy's array machinery: it must equal the
    array path's, edge cases included (no error, no signal, a ratio beyond float64's range, NaN)."""
    rng = np.random.default_rng(0)
    signal = np.concatenate([rng.uniform(0, 1e6, 2000) * 10.0 ** rng.integers(-300, 300, 2000), [0, 1, 0, np.inf, 1e308, 1e-308, np.nan, 1, np.inf, 5e-324]])
    noise = np.concatenate([rng.uniform(0, 1, 2000) * 10.0 ** rng.integers(-300, 300, 2000), [0, 0, 1, 1, 1e-308, 1e308, 1, np.inf, np.inf, 1]])
    arrays = sqnr_db(signal, noise)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_by_one = np.array([sqnr_db(s, n) for s, n in zip(signal, noise)])
    assert np.array_equal(one_by_one, arrays, equal_nan=True)


def test_an_isolated_figure_nothing_defines_is_said_in_words():
    """A 1.1B decoder's cause printed 'max abs err nan, nan% of elements outside, SQNR nan dB'."""
    import pandas as pd

    from accudiff.diagnosis.rules import isolated_figures

    undefined = isolated_figures(pd.Series({"isolated_max_abs_err": float("nan"), "isolated_outside_share": float("nan"), "isolated_sqnr_db": float("nan")}))
    printed_nan = re.compile(r"\bnan\b(?!/)", re.IGNORECASE)  # a number printed as nan (not the words 'NaN/Inf')
    assert not printed_nan.search(undefined) and "could be compared" in undefined
    assert not printed_nan.search(isolated_figures(pd.Series({"isolated_max_abs_err": 0.0, "isolated_outside_share": 0.0, "isolated_sqnr_db": float("nan")})))


def test_a_tensor_none_of_whose_tolerances_is_overridden_gets_the_default_without_building_one():
    """Asked for every tensor of every sample: with no per-tensor override on the command line, the default
    itself (the options' empty override tables made it build a new one each time, and as a dict again in
    the worker); an overridden tensor gets its own, the rest the default."""
    for tolerances in (Tolerances.build("int4"), Tolerances.from_dict(Tolerances.build("int4").as_dict())):
        assert tolerances.for_tensor("logits") is tolerances.default
    named = Tolerances.build("int4", atol=["logits:0.2"])
    assert named.for_tensor("logits") == Tolerance(atol=0.2, rtol=named.default.rtol, stol=named.default.stol)
    assert named.for_tensor("hidden") == named.default
