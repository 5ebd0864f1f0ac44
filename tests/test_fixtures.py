"""Each fixture's planted fault is found at the right tensor, with the right diagnosis (real ORT runs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import accudiff
from conftest import fixture

FAULTS = [
    # fixture, precision, options, the node named as the cause, a finding kind at it, the first tensor out of tolerance
    ("overflow_activation", "fp16", {}, "amplify", "overflow", "amplified"),
    ("layernorm_overflow", "fp16", {}, "ln_square", "overflow", "squared"),
    ("nan_midgraph", "fp16", {}, "ratio", "nan_inf_origin", "ratio"),
    ("int8_outlier_channel", "int8", {}, "conv", "int8_resolution", "conv"),
    ("overflow_constant", "fp16", {"autokeep": False}, "bn", "constant_overflow", "bn"),
    # The first tensor out of tolerance is not the cause: 'bn' (FP32) amplifies its input's FP16 rounding,
    # and its FP16 consumer cannot hold its output.
    ("kept_feeds_fp16", "fp16", {"keep_fp32": ["bn"]}, "attenuate", "input_overflow", "centred"),
    # Rounding drifts over a chain first; the BatchNormalization whose variance became Inf breaks the output.
    ("drift_then_constant_overflow", "fp16", {"autokeep": False}, "bn", "constant_overflow", "acc_61"),
]


@pytest.mark.parametrize("name, precision, options, node, kind, first", FAULTS, ids=[f[0] for f in FAULTS])
def test_planted_fault_is_named_as_the_cause(name, precision, options, node, kind, first):
    """The rules' hypothesis (verification, which may name another node, is tested in test_causes_against_oracle.py)."""
    result = accudiff.compare(fixture(name), precision, candidate="onnxrt", verify=False, **options)
    assert not result.passed
    assert result.first_failure.tensor == first  # a fact, not the cause
    assert result.output_failures
    for failure in result.output_failures:
        assert failure.cause.kind == "local" and failure.cause.node == node
        assert kind in [f.kind for f in failure.cause.findings]
        assert failure.first_failing_upstream == first


def test_drift_without_a_failing_node_is_called_accumulated():
    result = accudiff.compare(fixture("drift_then_constant_overflow"), "fp16", candidate="onnxrt")
    [failure] = result.output_failures
    assert failure.cause.kind == "accumulated" and failure.cause.node is None
    assert failure.cause.contributors and all(c.node.startswith(("add_", "scale", "offset")) for c in failure.cause.contributors)


def test_underflow_inside_its_tolerance_is_shown_at_the_noisiest_contributor():
    """'restore' stays FP32 (its constant is beyond FP16) and reads 'tiny' as FP16 stored it: no node leaves
    its own tolerance, and the contributor that loses the bits says why."""
    result = accudiff.compare(fixture("underflow"), "fp16", candidate="onnxrt", verify=False)
    [failure] = result.output_failures
    assert failure.cause.kind == "accumulated"
    top = failure.cause.contributors[0]
    assert top.node == "shrink" and top.isolated_sqnr_db < 40
    assert [f.kind for f in top.findings] == ["underflow"]


def test_without_isolation_a_cause_needs_range_evidence():
    """--no-isolate: a range fault still names its node; rounding alone cannot, and the report says so."""
    overflow = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt", isolate=False)
    assert overflow.output_failures[0].cause.node == "ln_square"
    assert "isolated_status" not in overflow.table.columns
    drift = accudiff.compare(fixture("accumulated_drift"), "fp16", candidate="onnxrt", isolate=False, verify=False)
    assert drift.output_failures[0].cause.kind == "unknown"
    assert not any("on its own" in f.message for f in drift.first_failure.findings)


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


def test_overflowing_constant_without_autokeep_is_reported():
    result = accudiff.compare(fixture("overflow_constant"), "fp16", candidate="onnxrt", autokeep=False)
    assert [f.kind for f in result.first_failure.findings][0] == "constant_overflow"
    assert any("beyond FP16's largest finite value 65504: in FP16 it became +Inf" in notice for notice in result.notices)


def test_int8_clipping_when_calibrated_on_smaller_data(tmp_path):
    import numpy as np

    calibration = tmp_path / "calib.npz"
    rng = np.random.default_rng(0)
    np.savez(calibration, x=rng.uniform(0, 0.1, (1, 8, 6, 6)).astype(np.float32))
    result = accudiff.compare(fixture("int8_outlier_channel"), "int8", candidate="onnxrt", calib_data=calibration)
    kinds = [f.kind for f in result.output_failures[0].cause.findings]
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


def test_int8_clipping_of_a_graph_input_is_diagnosed(tmp_path):
    import numpy as np

    calibration = tmp_path / "calib.npz"
    np.savez(calibration, x=np.random.default_rng(0).uniform(0, 0.1, (1, 3, 16, 16)).astype(np.float32))
    result = accudiff.compare(fixture("clean"), "int8", candidate="onnxrt", calib_data=calibration, verify=False)
    assert result.first_failure.tensor == "c1"
    cause = result.output_failures[0].cause
    assert cause.node == "conv1"
    assert any(f.kind == "int8_clipping" and "its input 'x'" in f.message for f in cause.findings)


@pytest.mark.parametrize("grid", ["int8", "fp8"])
def test_only_values_beyond_half_a_step_past_the_range_are_counted_as_clipping(grid, tmp_path):
    """A value within half the grid's last step past its end rounds to the end, as any value rounds to its
    nearest: it loses no more than rounding. They were counted as clipping: a trained recognizer's input held
    34.6% of its values between -0.035 and -0.0296, its range's low end, and the finding said "they clip";
    none did. The count now is what QuantizeLinear's definition clips: an INT8 code rounded past -128..127;
    FP8 E4M3 beyond 448 by more than half its last step (32) saturates."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    zero = numpy_helper.from_array(np.array(0, np.int8), "z") if grid == "int8" else helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])

    def model(pair, path):
        nodes = [helper.make_node("Mul", ["x", "w"], ["h"], name="widen"), *pair, helper.make_node("Mul", [pair[-1].output[0] if pair else "h", "w"], ["y"], name="scale")]
        weights = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in [("w", 2.0), ("s", 0.1)]] + [zero]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])], weights)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
        return path

    reference = model([], tmp_path / "float.onnx")
    candidate = model([helper.make_node("QuantizeLinear", ["h", "s", "z"], ["q"], name="quantize"),
                       helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="dequantize")], tmp_path / "qdq.onnx")
    low, high, margin = (-12.8, 12.7, 0.05) if grid == "int8" else (-44.8, 44.8, 1.6)  # the ends, in the tensor's units, and half the last step
    rng = np.random.default_rng(0)
    h = np.concatenate([rng.uniform(high, high + 0.98 * margin, 1000), rng.uniform(low - 0.98 * margin, low, 1000),  # past the ends by less than half a step
                        rng.uniform(high + 1.2 * margin, high + 20 * margin, 30), rng.uniform(low - 20 * margin, low - 1.2 * margin, 20),
                        rng.uniform(low / 2, high / 2, 2046)]).astype(np.float32)[None]
    np.savez(tmp_path / "x.npz", x=h / np.float32(2))
    result = accudiff.compare(reference, candidate_model=candidate, inputs=tmp_path / "x.npz", verify=False)
    codes = np.round(h / np.float32(0.1)) if grid == "int8" else h / np.float32(0.1)
    clipped = (codes > 127) | (codes < -128) if grid == "int8" else np.abs(codes) > 448 + 16
    assert result.table.set_index("tensor").loc["h", "beyond_int8_range"] == np.count_nonzero(clipped) == 50

def test_an_overflow_to_minus_infinity_is_named_with_its_infinities(tmp_path):
    """A product below -65504 becomes -Inf in FP16. The kernel counted a -Inf as -1 Inf (C's isinf gave
    its sign), so the candidate seemed to have fewer Inf than the reference and the NaN/Inf rule missed it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in [("up", 300.0), ("down", -300.0), ("small", 1e-5)]]
    nodes = [
        helper.make_node("Mul", ["x", "up"], ["a"], name="scale_up"),
        helper.make_node("Mul", ["x", "down"], ["b"], name="scale_down"),
        helper.make_node("Mul", ["a", "b"], ["product"], name="product"),  # down to -90000
        helper.make_node("Mul", ["product", "small"], ["y"], name="shrink"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 64]) for n in ("x", "y")]
    path = tmp_path / "negative_overflow.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", io[:1], io[1:], weights), opset_imports=[helper.make_opsetid("", 17)]), str(path))
    result = accudiff.compare(path, "fp16", candidate="onnxrt", verify=False)
    [failure] = result.output_failures
    assert failure.cause.node == "product"
    assert "nan_inf_origin" in [f.kind for f in failure.cause.findings]
    row = result.table.set_index("tensor").loc["product"]
    assert row["cand_inf"] > 0 and row["ref_inf"] == 0


def _graph_model(name: str, nodes: list, shape: list[int], out_shape: list[int], constants: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_residual_absorbed_by_a_large_value_is_named_with_the_cancellation_that_exposes_it(tmp_path):
    """BF16 spaces values near 2000 by 8: a residual under 0.5 added there is lost, and subtracting the large
    part again leaves only rounding. The cause is the cancellation; what it lost is named beside it."""
    model = _graph_model("absorbed_residual", [
        helper.make_node("Mul", ["x", "wide"], ["large"], name="widen"),
        helper.make_node("Add", ["large", "base"], ["big"], name="raise"),
        helper.make_node("Mul", ["x", "small"], ["residual"], name="shrink"),
        helper.make_node("Add", ["big", "residual"], ["total"], name="add_residual"),
        helper.make_node("Sub", ["total", "big"], ["y"], name="recover"),
    ], [1, 256], [1, 256], {"wide": np.float32(1000), "base": np.float32(1024), "small": np.float32(0.5)})
    onnx.save(model, str(tmp_path / "absorbed.onnx"))
    [failure] = accudiff.compare(tmp_path / "absorbed.onnx", "bf16", candidate="onnxrt").output_failures
    assert (failure.cause.kind, failure.cause.node) == ("local", "recover")
    [lost] = [f for f in failure.cause.findings if f.kind == "absorption"]
    assert lost.message.startswith("Add 'add_residual': its operand 'residual' (absmax 0.499) is below half a BF16 ulp of its operand 'big' at its largest (4 at 2.02e+03)")


def test_a_long_sum_of_cancelling_terms_is_named_as_accumulation(tmp_path):
    """4096 terms near ±100 that cancel: each stored in BF16 is off by up to 0.25, together by ~sqrt(4096)
    times that, where the sums themselves reach ~34. Keeping the sum alone cannot help (its terms are already
    rounded): only with the nodes computing them."""
    model = _graph_model("alternating_sum", [
        helper.make_node("Add", ["x", "offset"], ["lifted"], name="lift"),
        helper.make_node("Mul", ["lifted", "sign"], ["terms"], name="alternate"),
        helper.make_node("ReduceSum", ["terms", "axes"], ["y"], name="total", keepdims=0),
    ], [1, 8, 4096], [1, 8], {"offset": np.float32(100), "sign": np.tile(np.float32([1, -1]), 2048), "axes": np.array([-1], np.int64)})
    onnx.save(model, str(tmp_path / "alternating.onnx"))
    [failure] = accudiff.compare(tmp_path / "alternating.onnx", "bf16", candidate="onnxrt").output_failures
    assert failure.cause.kind == "several" and {failure.cause.node, *(c.node for c in failure.cause.co_causes)} == {"lift", "alternate", "total"}
    [finding] = [f for f in failure.cause.findings if f.kind == "accumulation"]
    assert finding.message.startswith("each of its values sums 4096 terms of up to 101 stored in BF16")
