"""The named cause of every failing output agrees with a brute-force oracle written separately (oracle.py):
on the fixtures, and on trained models fed realistic inputs (text drawn with PIL for the OCR models, a
drawn scene for the detector), in FP16 and INT8. Skipped, with the reason, where a model's package is
missing."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import accudiff
import oracle
from conftest import ROOT, fixture

sys.path.insert(0, str(ROOT))
from benchmarks import models, realistic_inputs  # noqa: E402

# Ops that only move or select values: they add no rounding of their own, so they are never the cause.
MOVES_VALUES = {"Clip", "Relu", "MaxPool", "Reshape", "Transpose", "Slice", "Gather", "Concat", "Resize", "Squeeze", "Unsqueeze", "Flatten", "Split", "Identity"}

FIXTURE_CASES = [
    ("overflow_activation", "fp16", {}),
    ("layernorm_overflow", "fp16", {}),
    ("nan_midgraph", "fp16", {}),
    ("underflow", "fp16", {}),
    ("kept_feeds_fp16", "fp16", {}),
    ("drift_then_constant_overflow", "fp16", {"autokeep": False}),
    ("drift_then_constant_overflow", "fp16", {}),
    ("overflow_constant", "fp16", {"autokeep": False}),
    ("accumulated_drift", "fp16", {}),
    ("int8_outlier_channel", "int8", {}),
]
TRAINED_CASES = [
    ("ppocr_det_v4", "fp16", {"autokeep": False}),  # the BatchNorm variance constant (9.8e7) becomes Inf
    ("ppocr_det_v4", "fp16", {}),
    ("ppocr_det_v4", "int8", {}),
    ("ppocr_rec_v4", "fp16", {}),
    ("ppocr_rec_v4", "int8", {}),
    ("nudenet_320n", "fp16", {}),
    ("nudenet_320n", "int8", {}),
]


def _check_against_oracle(path, feed, precision, result, candidate_path):
    tol = result.tolerances.default
    values = oracle.reference_values(path, feed)
    verdicts = oracle.node_verdicts(path, values, precision, (tol.atol, tol.rtol, tol.stol), {k.node for k in result.kept}, candidate_path)
    for failure in result.output_failures:
        expected = oracle.cause(path, failure.tensor, verdicts)
        named = failure.cause
        if expected is None:
            assert named.kind == "accumulated", f"{failure.tensor}: named {named.node}, the oracle finds no node failing alone"
        else:
            assert (named.kind, named.node) == ("local", expected.node), f"{failure.tensor}: oracle blames {expected.node}"
            assert named.op_type not in MOVES_VALUES


@pytest.mark.parametrize("name, precision, options", FIXTURE_CASES, ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_fixture_causes_agree_with_the_oracle(name, precision, options, tmp_path):
    result = accudiff.compare(fixture(name), precision, candidate="onnxrt", report_dir=tmp_path / "r", **options)
    assert result.output_failures
    with np.load(tmp_path / "r" / "inputs.npz") as saved:
        feed = {key.split("/", 1)[1]: saved[key] for key in saved.files}
    _check_against_oracle(fixture(name), feed, precision, result, tmp_path / "r" / f"candidate-{precision}.onnx")


@pytest.mark.parametrize("name, precision, options", TRAINED_CASES, ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_trained_model_causes_agree_with_the_oracle(name, precision, options, tmp_path):
    try:
        path = models.MODELS[name](tmp_path)
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    feed = realistic_inputs.FEEDS[name](0)
    calibration = None
    if precision == "int8":  # calibrated on other realistic samples, as a user would
        calibration = tmp_path / "calibration.npz"
        np.savez(calibration, **{f"{i}/{k}": v for i, sample in enumerate(realistic_inputs.dataset(name, 4, 100)) for k, v in sample.items()})
    result = accudiff.compare(path, precision, candidate="onnxrt", inputs=[feed], calib_data=calibration, report_dir=tmp_path / "r", **options)
    _check_against_oracle(path, feed, precision, result, tmp_path / "r" / f"candidate-{precision}.onnx")
    if name == "ppocr_det_v4" and options.get("autokeep") is False:
        [failure] = result.output_failures
        assert failure.cause.op_type == "BatchNormalization" and "constant_overflow" in [f.kind for f in failure.cause.findings]
        assert failure.first_failing_upstream != failure.cause.tensor  # the first drifting tensor is not the cause
