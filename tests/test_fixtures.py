"""Each fixture's planted fault is found at the right tensor, with the right diagnosis (real ORT runs)."""

from __future__ import annotations

import pytest

import accudiff
from conftest import fixture

FAULTS = [
    # fixture, precision, first failing tensor, finding kind expected there, verdict
    ("overflow_activation", "fp16", "amplified", "overflow", False),
    ("layernorm_overflow", "fp16", "squared", "overflow", False),
    ("underflow", "fp16", "restored", "underflow", False),
    ("nan_midgraph", "fp16", "ratio", "nan_inf_origin", False),
    ("int8_outlier_channel", "int8", "conv", "int8_resolution", False),
]


@pytest.mark.parametrize("name, precision, tensor, kind, passed", FAULTS, ids=[f[0] for f in FAULTS])
def test_planted_fault_is_found_and_diagnosed(name, precision, tensor, kind, passed):
    result = accudiff.compare(fixture(name), precision, candidate="onnxrt")
    assert result.passed is passed
    assert result.first_failure is not None
    assert result.first_failure.tensor == tensor
    assert kind in [f.kind for f in result.first_failure.findings]
    # Every graph output that fails points back to the planted fault.
    assert result.output_failures and all(f.origin == tensor for f in result.output_failures)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_clean_model_passes(precision):
    result = accudiff.compare(fixture("clean"), precision, candidate="onnxrt")
    assert result.passed
    assert result.first_failure is None
    assert (result.table["status"] == "pass").all()


def test_overflowing_constant_is_kept_in_fp32_and_passes():
    result = accudiff.compare(fixture("overflow_constant"), "fp16", candidate="onnxrt")
    assert result.passed
    [kept] = result.kept
    assert kept.node == "bn" and "bn.var" in kept.reason and "1e+08" in kept.reason


def test_overflowing_constant_without_autokeep_is_diagnosed():
    result = accudiff.compare(fixture("overflow_constant"), "fp16", candidate="onnxrt", autokeep=False)
    assert not result.passed
    assert result.first_failure.tensor == "bn"
    assert [f.kind for f in result.first_failure.findings] == ["constant_overflow"]
    assert any("became Inf" in notice for notice in result.notices)


def test_int8_clipping_when_calibrated_on_smaller_data(tmp_path):
    import numpy as np

    calibration = tmp_path / "calib.npz"
    rng = np.random.default_rng(0)
    np.savez(calibration, x=rng.uniform(0, 0.1, (1, 8, 6, 6)).astype(np.float32))
    result = accudiff.compare(fixture("int8_outlier_channel"), "int8", candidate="onnxrt", calib_data=calibration)
    kinds = [f.kind for f in result.first_failure.findings]
    assert "int8_clipping" in kinds
    assert not any("random data" in notice for notice in result.notices)


def test_random_calibration_warns_loudly():
    result = accudiff.compare(fixture("clean"), "int8", candidate="onnxrt")
    assert any("calibrated on random data" in notice for notice in result.notices)


def test_multi_input_multi_output_with_integer_tensors():
    result = accudiff.compare(fixture("multi_io"), "fp16", candidate="onnxrt")
    table = result.table.set_index("tensor")
    assert result.passed
    assert set(result.outputs["tensor"]) == {"sum", "best", "embedded"}
    assert table.loc["best", "dtype"] == "int64"
    assert table.loc["best", "outside_count"] == 0  # integers compare exactly
    assert table.loc["projected", "cand_dtype"] == "float16"


def test_if_bodies_are_listed_as_not_observable():
    result = accudiff.compare(fixture("if_model"), "fp16", candidate="onnxrt")
    assert set(result.not_observable) == {"doubled", "tripled"}
    assert all("subgraph" in reason for reason in result.not_observable.values())
    assert "branch" in set(result.table["tensor"])


def test_int8_clipping_of_a_graph_input_is_diagnosed(tmp_path):
    import numpy as np

    calibration = tmp_path / "calib.npz"
    np.savez(calibration, x=np.random.default_rng(0).uniform(0, 0.1, (1, 3, 16, 16)).astype(np.float32))
    result = accudiff.compare(fixture("clean"), "int8", candidate="onnxrt", calib_data=calibration)
    assert result.first_failure.tensor == "c1"
    [finding] = result.first_failure.findings
    assert finding.kind == "int8_clipping" and "its input 'x'" in finding.message
