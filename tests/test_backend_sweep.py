"""A fast sample of the robustness sweep (benchmarks/backend_sweep.py) over the test models the onnx wheel
ships: no traceback, crash, hang, foreign log line, failing FP32 self-compare, or refusal of a candidate
accudiff built, at any precision. The cases are ones the full sweep found defects in, and control flow."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import backend_sweep  # noqa: E402

SAMPLE = {
    "test_expand_shape_model1",  # integer shape input: random calibration must not invent shapes
    "light_bvlc_alexnet",  # unnamed nodes, weights made at run time: segmented comparison
    "light_inception_v1",  # old opset: INT8 candidate's inferred value_info
    "test_Conv2d",
    "test_operator_pow",
    "test_if",
    "test_loop11",
    "test_scan9_sum",
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    cases = backend_sweep.collect(backend_sweep.SUITES, None, tmp_path_factory.mktemp("sweep"), SAMPLE)
    assert {case["name"] for case in cases} == SAMPLE
    return backend_sweep.sweep(cases, jobs=2, timeout=240, accudiff_path=None)


@pytest.mark.parametrize("precision", backend_sweep.PRECISIONS)
def test_no_defect_in_the_sweep_sample(records, precision):
    defects = {r["name"]: backend_sweep.classify(r, precision) for r in records}
    assert {name: outcome for name, outcome in defects.items() if outcome in backend_sweep.DEFECTS} == {}
