"""Findings docs/causes.md lists that no other test reached, each planted in a small model and its figures
recomputed here with numpy: the INT4 and FP8 grid faults of a Q/DQ candidate (clipping and resolution), a
cancellation's amplifier, NaN carried in from an input, and what the rules say without the isolated run.
(FP4's variants are not here: ONNX Runtime's CPU provider has no FLOAT4E2M1 QuantizeLinear, so no FP4 Q/DQ
candidate runs on this machine.)"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import accudiff
from accudiff.model.inputs import save_feeds
from conftest import fixture

ZERO_POINT_TYPES = {"int4": TensorProto.INT4, "fp8": TensorProto.FLOAT8E4M3FN}


def _project(tmp_path, quantize: tuple[str, float] | None = None):
    """x [4, 64] @ W: the float model, or (`quantize`: format and scale) a candidate whose Q/DQ pair puts x
    on that grid, as a quantizer calibrated badly would."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="project")]
    weights = [numpy_helper.from_array(rng.standard_normal((64, 16)).astype(np.float32), "w")]
    if quantize is not None:
        fmt, scale = quantize
        weights += [numpy_helper.from_array(np.array(scale, np.float32), "s"), helper.make_tensor("zp", ZERO_POINT_TYPES[fmt], [], [0])]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q"),
                 helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq"),
                 helper.make_node("MatMul", ["xd", "w"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], weights)
    path = tmp_path / ("model.onnx" if quantize is None else f"{quantize[0]}-{quantize[1]:g}.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


@pytest.mark.parametrize("fmt, scale, kind", [("int4", 0.05, "int4_clipping"), ("int4", 10.0, "int4_resolution"),
                                              ("fp8", 0.001, "fp8_clipping"), ("fp8", 1000.0, "fp8_resolution")])
def test_a_grid_that_does_not_hold_the_input_is_named_with_its_share(fmt, scale, kind, tmp_path):
    """The share printed is the share of x the grid clips (INT4: a code rounded past -8..7; FP8 E4M3: beyond
    +-448 x the scale by more than half its last step, 32 x the scale), or below half its smallest step
    (INT4: the scale; FP8: its smallest subnormal, 2^-9 x the scale), counted here on the same input."""
    x = np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)
    save_feeds([{"x": x}], tmp_path / "x.npz")
    result = accudiff.compare(_project(tmp_path), candidate_model=_project(tmp_path, (fmt, scale)), inputs=tmp_path / "x.npz", candidate="onnxrt")
    (failure,) = result.output_failures
    assert failure.cause.node == "project" and failure.cause.verified
    (finding,) = [f for f in failure.cause.findings if f.kind == kind]
    low, high = (-8.5 * scale, 7.5 * scale) if fmt == "int4" else (-464 * scale, 464 * scale)
    smallest_step = scale * (1 if fmt == "int4" else 2.0**-9)
    share = np.mean((x < low) | (x > high)) if kind.endswith("clipping") else np.mean(np.abs(x) < smallest_step / 2)
    printed = float(re.search(r"([\d.]+)% of the values of its input 'x'", finding.message).group(1))
    assert printed == pytest.approx(100 * share, abs=0.05), (finding.message, share)


def test_a_cancellation_an_exp_amplifies_is_named_with_its_amplifier(tmp_path):
    """(x + 1000) - 1000 in FP16 keeps x to its step at 1000 (0.5); exp(4 * that) amplifies what it lost. The
    cause is the subtraction, with the cancellation's size and the Exp across which the SQNR falls."""
    nodes = [helper.make_node("Add", ["x", "big"], ["shifted"], name="shift"), helper.make_node("Sub", ["shifted", "big"], ["d"], name="unshift"),
             helper.make_node("Mul", ["d", "k"], ["scaled"], name="scale"), helper.make_node("Exp", ["scaled"], ["y"], name="grow")]
    weights = [numpy_helper.from_array(np.array(1000.0, np.float32), "big"), numpy_helper.from_array(np.array(4.0, np.float32), "k")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "amplified.onnx"))
    (failure,) = accudiff.compare(tmp_path / "amplified.onnx", "fp16", candidate="onnxrt").output_failures
    assert (failure.cause.kind, failure.cause.node) == ("local", "unshift") and failure.repair.verified
    kinds = [f.kind for f in failure.cause.findings]
    assert kinds[:2] == ["cancellation", "amplified"], kinds
    before, after = map(float, re.search(r"then amplified by Exp 'grow': accumulated SQNR ([\d.-]+) dB before it, ([\d.-]+) dB after",
                                         failure.cause.findings[1].message).groups())
    assert before - after >= 6


def test_nan_carried_in_from_an_input_is_said_to_come_from_it(tmp_path):
    """The planted NaN appears at 'ratio' (a division by a denominator FP16 flushes to 0); the output reads it:
    its findings say the NaN come from that input, with the counts of both sides."""
    result = accudiff.compare(fixture("nan_midgraph"), "fp16", candidate="onnxrt")
    (failure,) = result.output_failures
    (finding,) = [f for f in failure.findings if f.kind == "nan_inf_inherited"]
    elements = int(result.table.set_index("tensor").loc[failure.tensor, "elements"])
    assert finding.message == f"the candidate has {elements} NaN and 0 Inf where the reference has 0 and 0; they come from its input 'ratio'"


def test_without_the_isolated_run_the_rules_say_only_what_they_can(tmp_path):
    """--no-isolate --no-verify: an output whose input already fails is 'inherited', its cause 'unknown' (no
    range evidence); an output computed straight from the graph input, with no range fault, 'unexplained';
    contributors' own rounding ('own_error') needs the isolated run and is not claimed."""
    result = accudiff.compare(fixture("cancelling_layernorm"), "fp16", candidate="onnxrt", isolate=False, verify=False)
    (failure,) = result.output_failures
    assert [f.kind for f in failure.findings] == ["inherited"] and failure.cause.kind == "unknown"
    rng = np.random.default_rng(6)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="project")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              [numpy_helper.from_array((1 + rng.standard_normal((4096, 8)) * 1e-3).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "sum.onnx"))
    save_feeds([{"x": np.ones((1, 4096), np.float32)}], tmp_path / "ones.npz")
    plain = accudiff.compare(tmp_path / "sum.onnx", "fp16", candidate="onnxrt", inputs=tmp_path / "ones.npz", isolate=False, verify=False,
                             atol=1e-6, rtol=1e-6, stol=0.0)
    (failure,) = plain.output_failures
    assert [f.kind for f in failure.findings] == ["unexplained"] and "--no-isolate" in failure.findings[0].message
    isolated = accudiff.compare(tmp_path / "sum.onnx", "fp16", candidate="onnxrt", inputs=tmp_path / "ones.npz", atol=1e-6, rtol=1e-6, stol=0.0)
    assert [f.kind for f in isolated.output_failures[0].findings] == ["rounding"]
