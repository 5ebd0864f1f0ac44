"""A fast sample of the robustness sweep (benchmarks/backend_sweep.py) over the test models the onnx wheel
ships: no traceback, crash, hang, foreign log line, failing FP32 self-compare, or refusal of a candidate
accudiff built, at any precision. The cases are ones the full sweep found defects in, and control flow."""

from __future__ import annotations

import sys
import tempfile

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
    "test_reduce_log_sum_default",  # an empty 'axes' input
    "test_slice_start_out_of_bounds",  # an empty intermediate tensor: its range and class scores
    "test_constantofshape_int_shape_zero",  # an empty integer tensor
    "test_identity_sequence",  # a sequence input: one sentence
    "test_split_to_sequence_1",  # nothing but sequences to compare: one sentence
    "test_attention_4d_fp16",  # an output the model already computes in FP16
    "test_linear_attention_linear_expanded",  # a Scan whose body leaves its carried state untyped
    "test_ELU",  # IR version 3: the INT8 candidate's calibration graph needs a newer IR
}


@pytest.mark.parametrize("name, outcome", [("test_reduce_log_sum_default", "pass"), ("test_slice_start_out_of_bounds", "refused")])
def test_empty_inputs_are_judged_by_what_the_comparison_covers(records, name, outcome):
    """An empty integer input (ReduceLogSum's 'axes': reduce over all) is a parameter and is compared;
    a model whose every output is empty on its inputs covers no element and is refused. (INT8 refuses
    both: neither has a node to quantize.)"""
    record = next(r for r in records if r["name"] == name)
    assert {backend_sweep.classify(record, p) for p in ("fp32", "fp16")} == {outcome}
    assert backend_sweep.classify(record, "int8") == "refused"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    cases = backend_sweep.collect(backend_sweep.SUITES, None, tmp_path_factory.mktemp("sweep"), SAMPLE)
    assert {case["name"] for case in cases} == SAMPLE
    return backend_sweep.sweep(cases, jobs=2, timeout=240, accudiff_path=None)  # CPU seconds a case: the machine's load does not count


def test_a_case_is_stopped_by_the_cpu_it_uses_not_by_the_wall_clock(tmp_path, monkeypatch):
    """A case spinning forever is a hang after `timeout` seconds of its own CPU (the kernel's limit), so a
    loaded machine, where a case gets less of a core, makes no case a hang."""
    import onnx
    from onnx import TensorProto, helper

    body = helper.make_graph([helper.make_node("Add", ["carried", "one"], ["next"]), helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("carried", TensorProto.FLOAT, [1])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("next", TensorProto.FLOAT, [1])],
                             [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    graph = helper.make_graph([helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body)], "spin",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                              [helper.make_tensor("trips", TensorProto.INT64, [], [10**15])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "spin.onnx"))
    case = {"name": "spin", "model": str(tmp_path / "spin.onnx"), "inputs": None}
    scratch = tmp_path / "scratch"  # the sweep's own: other sweeps (another xdist worker's, another suite's) come and go in /tmp
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    [record] = backend_sweep.sweep([case], jobs=1, timeout=2, accudiff_path=None, wall_per_cpu_second=10**4)  # only the CPU limit can stop it
    assert record["failure"] == "hang"
    assert list(scratch.glob("accudiff-sweep-*")) == []  # the stopped case's folder was removed (it was left behind)


@pytest.mark.parametrize("precision", backend_sweep.PRECISIONS)
def test_no_defect_in_the_sweep_sample(records, precision):
    defects = {r["name"]: backend_sweep.classify(r, precision) for r in records}
    assert {name: outcome for name, outcome in defects.items() if outcome in backend_sweep.DEFECTS} == {}
