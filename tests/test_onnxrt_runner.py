"""The ONNX Runtime runner: crashes become clear errors; FP16 storage is really emulated."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import accudiff
from accudiff.errors import AccudiffError
from accudiff.runners.onnxrt import OnnxrtRunner
from conftest import fixture


CRASH_IN_FIRST_RUN = """
import os, signal
import accudiff.runners.onnxrt as onnxrt

def _crash(self, feed):
    os.kill(os.getpid(), signal.SIGSEGV)

onnxrt.OnnxrtRunner.infer = _crash
"""


@pytest.fixture
def temporary_files(tmp_path, monkeypatch) -> Path:
    """A folder of its own for every temporary file of this process and its children: what a failure
    leaves behind is then visible."""
    folder = tmp_path / "temporary"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def _left_behind(folder: Path) -> list[str]:
    """accudiff's files in `folder` (ONNX Runtime keeps one of its own there, '.ses')."""
    return [path.name for path in folder.iterdir() if path.name.startswith("accudiff")]


def test_native_crash_becomes_a_clear_error(tmp_path, monkeypatch, temporary_files):
    """Backends run in the comparison worker: a native crash there ends the worker, not accudiff, and is
    reported with the step it happened in. The worker (the only process this compare starts) loads a
    sitecustomize that makes its first ONNX Runtime run die of SIGSEGV: no race to find its pid. The
    crashed worker's temporary files do not outlive it. A spare worker an earlier test of this process
    started (without the sitecustomize) is discarded first."""
    from accudiff.execution.pool import discard_spares

    discard_spares()
    (tmp_path / "sitecustomize.py").write_text(CRASH_IN_FIRST_RUN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    with pytest.raises(AccudiffError) as error:
        accudiff.compare(fixture("accumulated_drift"), "fp16", candidate="onnxrt")
    assert re.search(r"crashed \(SIGSEGV\) while .+ of 'accumulated_drift.onnx'", str(error.value)), str(error.value)
    assert _left_behind(temporary_files) == []


def test_load_failure_names_model_and_step(tmp_path, temporary_files):
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="no.such.domain")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("no.such.domain", 1)], ir_version=8)
    onnx.save(model, str(tmp_path / "custom.onnx"))
    with pytest.raises(AccudiffError, match="ONNX Runtime failed while loading 'custom.onnx'"):
        OnnxrtRunner(tmp_path / "custom.onnx", ["y"]).activate()
    assert _left_behind(temporary_files) == []  # its scratch folder went with the failure


def test_a_session_given_its_model_as_bytes_writes_nothing(tmp_path, temporary_files):
    """A segmented comparison makes many sessions: one whose model goes to ONNX Runtime as bytes makes no
    scratch folder (creating and removing one per session cost the worker's main thread ~15 ms each, as
    it waited for the thread making the next session to let go of the GIL)."""
    with OnnxrtRunner(_chain(tmp_path), ["product", "y"], emulate_fp16=True) as runner:
        runner.infer({"x": np.ones(3, np.float32)})
        assert _left_behind(temporary_files) == []


def _chain(tmp_path) -> str:
    """x -> Mul(3e4) -> Mul(1e-4) -> y, all FP16 inside: the first product overflows FP16."""
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["x16", "big"], ["product"]),
        helper.make_node("Mul", ["product", "small"], ["y16"]),
        helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT),
    ]
    init = [onnx.numpy_helper.from_array(np.array(v, np.float16), n) for n, v in [("big", 3e4), ("small", 1e-4)]]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], init)
    path = tmp_path / "chain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_fp16_storage_is_emulated_at_every_tensor(tmp_path):
    feed = {"x": np.array([1.0, 3.0, 1.0 + 2**-12], np.float32)}
    with OnnxrtRunner(_chain(tmp_path), ["x16", "product", "y"], emulate_fp16=True) as runner:
        out = {k: np.array(v) for k, v in runner.infer(feed).items()}
    assert out["x16"].dtype == np.float16 and out["x16"][2] == 1.0  # rounded on storage
    assert np.isinf(out["product"][1])  # 9e4 overflows FP16 ...
    assert np.isinf(out["y"][1])  # ... and the Inf reaches the output, as on a GPU


def test_without_emulation_onnxruntime_hides_the_overflow(tmp_path):
    """Why the emulation exists: ONNX Runtime's CPU provider computes FP16 regions in FP32."""
    with OnnxrtRunner(_chain(tmp_path), ["y"]) as runner:
        y = np.array(runner.infer({"x": np.array([1.0, 3.0, 1.0], np.float32)})["y"])
    assert np.isfinite(y[1])


def test_nodes_nobody_reads_are_not_run(tmp_path):
    """ONNX Runtime runs every node of a graph: a runner asked for 'product' alone drops what follows it
    (the second Mul and the Cast to the output, lowered), and what it returns is unchanged."""
    from accudiff.model.subgraph import drop_unread_nodes

    feed = {"x": np.array([1.0, 3.0, 1.0], np.float32)}
    with OnnxrtRunner(_chain(tmp_path), ["product"], emulate_fp16=True) as runner:
        product = np.array(runner.infer(feed)["product"])
    assert product.dtype == np.float16 and np.isinf(product[1]) and product[0] == np.float16(3e4)
    # An If whose body reads an outer value keeps that value's producer; an unread chain goes.
    body = helper.make_graph([helper.make_node("Identity", ["outer"], ["inner"])], "body", [], [helper.make_tensor_value_info("inner", TensorProto.FLOAT, [1])])
    nodes = [
        helper.make_node("Relu", ["x"], ["outer"], name="read_by_body"),
        helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=body, name="if"),
        helper.make_node("Neg", ["x"], ["unread"], name="unread_1"),
        helper.make_node("Abs", ["unread"], ["unread_too"], name="unread_2"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    assert drop_unread_nodes(graph) == 2
    assert [node.name for node in graph.node] == ["read_by_body", "if"]


def _quantized_pair(zero_point: onnx.TensorProto | None, output_dtype: int | None = None) -> onnx.ModelProto:
    """x -> QuantizeLinear -> DequantizeLinear -> y, its scale a constant; with `zero_point`, or typed by `output_dtype`."""
    extra = {"output_dtype": output_dtype} if output_dtype is not None else {}
    inputs = ["x", "scale", "zero"] if zero_point is not None else ["x", "scale"]
    nodes = [helper.make_node("QuantizeLinear", inputs, ["q"], name="quantize", **extra), helper.make_node("DequantizeLinear", ["q", *inputs[1:]], ["y"], name="dequantize")]
    weights = [onnx.numpy_helper.from_array(np.array(0.05, np.float32), "scale"), *([zero_point] if zero_point is not None else [])]
    graph = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_an_int8_quantized_model_is_not_shape_inferred_to_carry_values_numpy_holds():
    """A QuantizeLinear's type is its zero point's (or its output_dtype's): an INT8 pair holds nothing numpy cannot
    carry, so its sessions are made without ONNX's shape inference (every session of a quantized model paid it),
    while a pair typed FP8 by its output_dtype alone, with no zero point, still has its codes carried."""
    from accudiff.runners.numpy_types import CARRIED, carry_in_numpy

    int8 = _quantized_pair(onnx.numpy_helper.from_array(np.array(0, np.int8), "zero"))
    assert not carry_in_numpy(int8, ["q", "y"]).outputs and not int8.graph.value_info  # left as it is, not inferred
    fp8 = _quantized_pair(None, TensorProto.FLOAT8E4M3FN)
    assert carry_in_numpy(fp8, ["q", "y"]).outputs == {"q": "q" + CARRIED}
