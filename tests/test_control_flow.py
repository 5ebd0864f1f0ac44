"""Control flow: the branch an If takes is inlined and compared; bodies are converted to FP16; Loop bodies
stay listed as not observable, and a model mostly inside one never reads PASS."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import accudiff
from accudiff.model.inputs import save_feeds
from accudiff.transforms import to_fp16
from accudiff.transforms.inline_branches import inline_branches
from conftest import fixture

BRANCHY = fixture("branch_network")
FULL_PATH = ["full_hidden", "full_amplified", "full_scaled", "features_max", "any_positive"]


def _feed(full: bool, x: np.ndarray | None = None, seed: int = 0) -> dict:
    x = np.random.default_rng(seed).uniform(0, 1, (1, 16)).astype(np.float32) if x is None else x
    return {"x": x, "full": np.array(full)}


def test_the_taken_branch_is_compared_and_its_fault_named(tmp_path):
    result = accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[_feed(True)], report_dir=tmp_path / "r")
    table = result.table.set_index("tensor")
    assert set(FULL_PATH + ["full_rectified"]) <= set(table.index)  # names as the exporter wrote them
    assert result.verdict == "fail"
    assert result.output_failures[0].cause.node == "full_amplify"
    assert any("If 'choose_path' took its then_branch on every sample (1)" in n for n in result.notices)
    assert any("If 'full_sign' took its then_branch" in n for n in result.notices)  # nested, on a computed condition
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["branches"] == [{"samples": [0], "taken": {"choose_path": "then_branch", "full_sign": "then_branch"}}]
    assert summary["coverage"]["share"] == 1.0 and summary["verdict"] == "fail"


def test_the_other_branch_passes_and_the_nested_condition_follows_the_data():
    clean = accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[_feed(False)])
    assert clean.passed and "fast_hidden" in set(clean.table["tensor"]) and "full_hidden" not in set(clean.table["tensor"])
    zeros = accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[_feed(True, np.zeros((1, 16), np.float32))])
    assert "full_negated" in set(zeros.table["tensor"]) and "full_rectified" not in set(zeros.table["tensor"])
    assert any("If 'full_sign' took its else_branch" in n for n in zeros.notices)


def test_samples_that_take_different_branches_are_compared_per_group(tmp_path):
    feeds = [_feed(i % 2 == 0, seed=i) for i in range(4)]  # samples 0 and 2 take the faulty path
    save_feeds(feeds, tmp_path / "data.npz")
    result = accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=tmp_path / "data.npz", report_dir=tmp_path / "r")
    table = result.table.set_index("tensor")
    assert table.loc["features", "samples"] == 4
    assert table.loc["full_hidden", "samples"] == 2 and table.loc["fast_hidden", "samples"] == 2
    assert list(table.index).index("features") < list(table.index).index("full_hidden") < list(table.index).index("y")
    assert sorted(result.failing_samples["sample"]) == [0, 2]
    assert result.output_failures[0].cause.node == "full_amplify"
    assert any("took its then_branch on samples 0, 2 (2) and its else_branch on samples 1, 3 (2)" in n for n in result.notices)
    assert sorted(p.name for p in (tmp_path / "r").glob("candidate-*.onnx")) == ["candidate-fp16-group0.onnx", "candidate-fp16-group1.onnx"]
    one_by_one = [accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[feed]) for feed in feeds]
    for sample, alone in enumerate(one_by_one):
        row = alone.table.set_index("tensor").loc["y"]
        assert result.samples.set_index("sample").loc[sample, "max_abs_err"] == row["max_abs_err"]


def test_fp16_converts_if_bodies_and_keeps_the_boundary_types():
    model = onnx.load(str(BRANCHY))
    converted = to_fp16(onnx.shape_inference.infer_shapes(model)).model
    onnx.checker.check_model(converted)
    body = next(a.g for n in converted.graph.node if n.op_type == "If" for a in n.attribute if a.name == "else_branch")
    assert any(n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT16 for n in body.node)
    assert body.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = _feed(False)
    np.testing.assert_allclose(session.run(None, feed)[0], reference.run(None, feed)[0], atol=2e-2)


def test_inlined_node_names_never_clash_with_the_main_graph():
    then_graph = helper.make_graph([helper.make_node("Neg", ["x"], ["t_body"], name="neg")], "then", [], [helper.make_tensor_value_info("t_body", TensorProto.FLOAT, [2])])
    else_graph = helper.make_graph([helper.make_node("Abs", ["x"], ["e"], name="abs")], "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["t"], name="neg"),  # the main graph already has a node 'neg'
            helper.make_node("If", ["c"], ["out"], name="pick", then_branch=then_graph, else_branch=else_graph),
            helper.make_node("Add", ["out", "t"], ["y"], name="add"),
        ],
        "clash",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inlined = inline_branches(model, {"pick": True})
    onnx.checker.check_model(inlined, full_check=True)
    assert [n.name for n in inlined.graph.node] == ["neg", "pick/neg", "pick/out", "add"]
    assert [n.output[0] for n in inlined.graph.node] == ["t", "t_body", "out", "y"]
    x = np.array([1.5, -2.0], np.float32)
    run = lambda m, c: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "c": np.array(c)})[0]  # noqa: E731
    np.testing.assert_array_equal(run(inlined, True), run(model, True))


def _loop_model(path, body_nodes: int = 12):
    """A main graph of two nodes around a Loop whose body holds `body_nodes` Mul/Add steps."""
    steps, previous = [], "v_in"
    for k in range(body_nodes):
        op = "Mul" if k % 2 == 0 else "Add"
        steps.append(helper.make_node(op, [previous, "half" if op == "Mul" else "one"], [f"step{k}"], name=f"step{k}"))
        previous = f"step{k}"
    steps.append(helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"))
    body = helper.make_graph(
        steps,
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 8]),
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info(previous, TensorProto.FLOAT, [1, 8])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["start"], name="start"),
            helper.make_node("Loop", ["trips", "go", "start"], ["looped"], name="loop", body=body),
            helper.make_node("Sigmoid", ["looped"], ["y"], name="squash"),
        ],
        "looping",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [
            numpy_helper.from_array(np.array(3, np.int64), "trips"),
            numpy_helper.from_array(np.array(True), "go"),
            numpy_helper.from_array(np.array(0.5, np.float32), "half"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_loop_bodies_are_converted_and_listed_and_a_mostly_hidden_model_is_inconclusive(tmp_path, run_cli):
    model = _loop_model(tmp_path / "loop.onnx")
    candidate = tmp_path / "r"
    result = accudiff.compare(model, "fp16", candidate="onnxrt", report_dir=candidate)
    body = next(n for n in onnx.load(str(candidate / "candidate-fp16.onnx")).graph.node if n.op_type == "Loop").attribute[0].g
    assert any(n.op_type == "Cast" for n in body.node)  # the body runs in FP16 like the rest
    assert {"step0", "step11"} <= set(result.not_observable)
    assert not result.output_failures and result.verdict == "inconclusive" and not result.passed
    assert result.coverage == (3, 16)
    code, out, _ = run_cli("compare", str(model), "--fp16", "--candidate", "onnxrt", "-o", str(tmp_path / "cli"))
    assert code == 1
    assert "tensors compared: 3 of 16 (19%)" in out
    assert "verdict: INCONCLUSIVE (no graph output out of tolerance, but only 3 of the 16 tensors" in out
    small = _loop_model(tmp_path / "small.onnx", body_nodes=2)
    assert accudiff.compare(small, "fp16", candidate="onnxrt").passed  # 3 of 6: enough is observed


def test_a_keep_pattern_naming_only_the_if_is_refused():
    """The If is replaced by its branch, so a pattern that selected only the If would keep nothing."""
    with pytest.raises(accudiff.AccudiffError, match=r"keep_fp32=\['choose_path'\] matches no node"):
        accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[_feed(True)], keep_fp32=["choose_path"])
    kept = accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[_feed(True)], keep_fp32=["full_amplify"])
    assert [k.node for k in kept.kept] == ["full_amplify"]  # a node inside the branch can be kept
    assert kept.output_failures[0].cause.node == "full_rescale"  # which then reads its 2e5 output in FP16


def test_subgraph_bisect_cuts_inside_the_branch_the_samples_take(tmp_path, run_cli):
    """The cause sits inside an If body: the reproducer is cut from the model with the taken branches
    inlined, and its command fails when run from the result folder. Samples that take different
    branches cannot share one cut: one sentence."""
    save_feeds([_feed(True, seed=1), _feed(True, seed=2)], tmp_path / "full.npz")
    code, out, err = run_cli("bisect", "subgraph", BRANCHY, "--fp16", "--candidate", "onnxrt", "--load-inputs", tmp_path / "full.npz", "-o", "b")
    assert code == 1, err
    result = json.loads((tmp_path / "b" / "result.json").read_text())
    assert result["nodes"] == ["full_amplify"] and result["confirmed"]
    assert "every sample takes the same branches of 2 If node(s) (If 'choose_path' its then_branch, If 'full_sign' its then_branch)" in err
    reproducer = onnx.load(str(tmp_path / "b" / "subgraph.onnx"))
    assert [n.op_type for n in reproducer.graph.node] == ["Mul"]

    save_feeds([_feed(True, seed=1), _feed(False, seed=2)], tmp_path / "mixed.npz")
    code, out, err = run_cli("bisect", "subgraph", BRANCHY, "--fp16", "--candidate", "onnxrt", "--load-inputs", tmp_path / "mixed.npz", "-o", "m")
    assert code == 2 and err.count("\n") == 1 and "different" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def test_the_caller_runs_no_model_the_conditions_are_probed_in_a_worker(tmp_path, monkeypatch):
    """Backends run in worker processes only (a native crash there is one sentence, never the caller's end):
    the If conditions each sample takes, a nested one computed by the model, are probed in a worker. Any
    ONNX Runtime inference in this process fails the test; the workers are processes of their own."""

    def refused(*args, **kwargs):
        raise AssertionError("ONNX Runtime ran a model in the caller's process")

    monkeypatch.setattr(ort.InferenceSession, "run", refused)
    result = accudiff.compare(BRANCHY, "fp16", candidate="onnxrt", inputs=[_feed(True), _feed(False, seed=1)], report_dir=tmp_path / "r")
    assert any("If 'full_sign' took its then_branch" in n for n in result.notices)  # computed by the model: probed
    assert any("took its then_branch on sample" in n and "else_branch on sample" in n for n in result.notices)
