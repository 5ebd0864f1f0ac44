"""The statistics of one tensor, on hand-made arrays whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from accudiff.comparison.metrics import PERCENTILE_SAMPLE, SQNR_CAP_DB, TensorStats, measure, merge
from accudiff.comparison.tolerances import Tolerance, Tolerances
from accudiff.errors import AccudiffError

STRICT = Tolerance(atol=1e-6, rtol=0.0)


def test_identical_tensors_have_capped_sqnr_and_unit_cosine():
    ref = np.linspace(-1, 1, 100, dtype=np.float32)
    stats = measure(ref, ref.copy(), STRICT)
    assert stats.max_abs_err == 0 and stats.outside_count == 0
    assert stats.sqnr_db == SQNR_CAP_DB and stats.cosine == 1.0


def test_all_zero_tensors_agree():
    zeros = np.zeros(10, np.float32)
    stats = measure(zeros, zeros, STRICT)
    assert stats.cosine == 1.0 and stats.sqnr_db == SQNR_CAP_DB


def test_tolerance_is_measured_against_the_reference():
    ref = np.array([10.0], np.float32)
    # |cand - ref| = 1 <= 0 + 0.1 * |ref| passes; the same gap with the roles swapped would not.
    assert measure(ref, np.array([11.0], np.float32), Tolerance(0.0, 0.1)).outside_count == 0
    assert measure(np.array([11.0], np.float32), ref, Tolerance(0.0, 0.09)).outside_count == 1


def test_scale_tolerance_follows_the_tensor_magnitude():
    ref = np.array([500.0, 0.01], np.float32)
    cand = np.array([500.0, 0.26], np.float32)
    assert measure(ref, cand, Tolerance(1e-3, 1e-2, 0.0)).outside_count == 1
    assert measure(ref, cand, Tolerance(1e-3, 1e-2, 1e-3)).outside_count == 0


def test_relative_error_has_a_safe_denominator():
    ref = np.array([100.0, 0.0], np.float32)
    cand = np.array([100.0, 0.05], np.float32)
    stats = measure(ref, cand, STRICT)
    assert stats.max_rel_err == pytest.approx(0.05 / (1e-3 * 100.0))


def test_nan_and_inf_are_counted_and_poison_the_error_metrics():
    ref = np.array([1.0, 2.0, np.nan, np.inf], np.float32)
    cand = np.array([1.0, np.inf, np.nan, np.inf], np.float32)
    stats = measure(ref, cand, STRICT)
    assert (stats.ref_nan, stats.ref_inf, stats.cand_nan, stats.cand_inf) == (1, 1, 1, 2)
    assert stats.outside_count == 1  # matching NaN/NaN and Inf/Inf are not errors
    assert stats.max_abs_err == np.inf and stats.sqnr_db == -SQNR_CAP_DB
    assert stats.worst_index == 1 and stats.worst_cand == np.inf
    assert stats.ref_absmax == 2.0  # reference range over its finite values


def test_fp16_candidate_counts_underflow_and_flush_to_zero():
    ref = np.array([1e-7, 3e-5, 1.0, 0.0], np.float32)
    cand = ref.astype(np.float16)
    stats = measure(ref, cand, STRICT)
    assert stats.below_fp16_normal == 2
    assert stats.flushed_to_zero == 0 and cand[0] != 0  # 1e-7 is a subnormal, not zero
    stats = measure(np.array([1e-8], np.float32), np.array([1e-8], np.float32).astype(np.float16), STRICT)
    assert stats.flushed_to_zero == 1


def test_integer_tensors_compare_exactly():
    stats = measure(np.array([1, 2, 3]), np.array([1, 2, 4]), STRICT)
    assert stats.outside_count == 1 and stats.max_abs_err == 1 and np.isnan(stats.sqnr_db)


def test_percentiles_of_large_tensors_come_from_a_strided_sample():
    rng = np.random.default_rng(0)
    ref = np.zeros(PERCENTILE_SAMPLE * 4, np.float32)
    cand = rng.uniform(0, 1, ref.size).astype(np.float32)
    stats = measure(ref, cand, STRICT)
    assert stats.median_abs_err == pytest.approx(0.5, abs=0.01)
    assert stats.p99_abs_err == pytest.approx(0.99, abs=0.01)


def test_iterations_aggregate_to_worst_case_and_pooled_mean():
    ref = np.ones(4, np.float32)
    first = measure(ref, ref + 0.1, STRICT)
    second = measure(ref, ref + np.array([0.3, 0, 0, 0], np.float32), STRICT)
    total = merge(merge(TensorStats(), first, 0), second, 1)
    assert total.max_abs_err == pytest.approx(0.3)
    assert total.mean_abs_err == pytest.approx((0.4 + 0.3) / 8)
    assert total.outside_count == 5 and total.elements == 8
    assert total.sqnr_db == min(first.sqnr_db, second.sqnr_db)
    assert total.worst_iteration == 1 and total.worst_index == 0


def test_tolerance_options_parse_defaults_and_overrides():
    tolerances = Tolerances.build("fp16", atol=["1e-3", "logits:1e-2"], rtol=0.5)
    assert tolerances.for_tensor("logits").atol == 1e-2
    assert tolerances.for_tensor("other").atol == 1e-3
    assert tolerances.for_tensor("other").rtol == 0.5
    with pytest.raises(AccudiffError, match="not a number"):
        Tolerances.build("fp16", atol=["logits:big"])
