"""polygraphy's RunResults JSON both ways, with files polygraphy itself writes and reads: a candidate (or
reference) captured on another machine compared here, and accudiff's runs saved for polygraphy."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pandas as pd
import pytest

import accudiff
from accudiff.errors import AccudiffError
from accudiff.model.stores import ReferenceCache
from conftest import fixture

MODEL = fixture("layernorm_overflow")
COLUMNS = ["tensor", "status", "max_abs_err", "sqnr_db", "outside_share", "tol_ratio"]
pytestmark = pytest.mark.skipif(shutil.which("polygraphy", path=str(Path(sys.executable).parent)) is None, reason="polygraphy is not installed")


def _polygraphy(*args: str, cwd: Path) -> str:
    command = [str(Path(sys.executable).parent / "polygraphy"), *map(str, args)]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    """What a user brings from the GPU machine: the inputs, a mark-all run of the FP16 model, and a file
    with two runners over two iterations (ONNX Runtime stands in for TensorRT: the file format is the same;
    two runners on the FP32 model, whose outputs polygraphy can compare without infinities)."""
    folder = tmp_path_factory.mktemp("captured")
    _polygraphy("convert", MODEL, "--fp-to-fp16", "-o", "fp16.onnx", cwd=folder)
    _polygraphy("run", MODEL, "--onnxrt", "--onnxrt", "--onnx-outputs", "mark", "all", "--iterations", "2",
                "--save-inputs", "inputs.json", "--save-outputs", "two_runners.json", cwd=folder)
    _polygraphy("run", "fp16.onnx", "--onnxrt", "--onnx-outputs", "mark", "all", "--load-inputs", "inputs.json",
                "--save-outputs", "fp16.json", cwd=folder)
    return folder


def _compare(folder: Path, **options) -> accudiff.CompareResult:
    return accudiff.compare(MODEL, "fp16", inputs=folder / "inputs.json", **options)


def test_a_captured_candidate_is_compared_with_the_onnxrt_candidate_beside_it(captured, tmp_path):
    result = _compare(captured, load_candidate=captured / "fp16.json", report_dir=tmp_path / "report")
    assert result.candidate.startswith("polygraphy runner 'onnxrt-runner-N0")
    table = result.table.set_index("tensor")
    assert (table["status"] != "missing").all()  # every tensor of the model was in the file
    assert "onnxrt_sqnr_db" in table  # the three-way view: this precision run here too
    assert table.loc["squared", "status"] == "fail" and table.loc["squared", "onnxrt_status"] == "fail"  # the model's own overflow
    assert "isolated_status" not in table  # a captured candidate cannot be fed the reference's values
    assert "no isolated run here" in (tmp_path / "report" / "report.html").read_text()  # the chart does not describe a run that did not happen
    assert any("no tensor of the model" in n and "_cast_to_" in n for n in result.notices)  # polygraphy's own Casts


def test_runners_are_chosen_by_name_when_a_file_holds_several(captured):
    with pytest.raises(AccudiffError, match=r"holds the results of 2 runners; choose one with candidate_runner=: onnxrt-runner-N0.*, onnxrt-runner-N1"):
        _compare(captured, load_candidate=captured / "two_runners.json")
    runners = [name for name, _ in json.loads((captured / "two_runners.json").read_text())["lst"]]
    result = _compare(captured, load_candidate=captured / "two_runners.json", candidate_runner=runners[1])
    assert result.iterations == 2 and runners[1] in result.candidate
    with pytest.raises(AccudiffError, match="holds no runner 'nope'"):
        _compare(captured, load_candidate=captured / "two_runners.json", candidate_runner="nope")


def test_saved_runs_read_back_the_same_table_cause_and_repair_and_polygraphy_accepts_them(captured, tmp_path):
    live = _compare(captured, candidate="onnxrt", save_reference=tmp_path / "reference.json", save_candidate=tmp_path / "candidate.json")
    again = _compare(captured, load_reference=tmp_path / "reference.json", load_candidate=tmp_path / "candidate.json")
    pd.testing.assert_frame_equal(live.table[COLUMNS], again.table[COLUMNS])
    (was,), (now,) = live.output_failures, again.output_failures
    assert was.cause.verified and not was.cause.stand_in
    assert now.cause.verified and now.cause.stand_in == "ONNX Runtime's FP16 model"  # the captured run cannot run again here
    assert (now.cause.kind, now.cause.node, now.repair.keep) == (was.cause.kind, was.cause.node, was.repair.keep)
    log = _polygraphy("run", MODEL, "--onnxrt", "--onnx-outputs", "mark", "all", "--load-inputs", captured / "inputs.json",
                      "--load-outputs", tmp_path / "reference.json", cwd=tmp_path)
    assert "Passed: 2/2 iterations" in log and "accudiff-reference-onnxrt-fp32" in log


@pytest.mark.parametrize("damage, said", [
    ("truncate", "is not a polygraphy RunResults file: it is not whole, readable JSON"),
    ("other model", "no tensor in '.*' is a tensor of the model"),
    ("one iteration", r"holds 1 iteration\(s\) of runner '.*', but 2 sample\(s\) were given"),
    ("not run results", "is not a polygraphy RunResults file with results in it"),
])
def test_files_that_do_not_fit_are_one_sentence(damage, said, captured, tmp_path):
    document = json.loads((captured / "fp16.json").read_text())
    path = tmp_path / "damaged.json"
    if damage == "truncate":
        path.write_text((captured / "fp16.json").read_text()[:5000])
    else:
        if damage == "other model":
            for iteration in document["lst"][0][1]:
                iteration["outputs"] = {f"other_{name}": value for name, value in iteration["outputs"].items()}
        elif damage == "one iteration":
            del document["lst"][0][1][1:]
        else:
            document = {"x": []}
        path.write_text(json.dumps(document))
    with pytest.raises(AccudiffError, match=said):
        _compare(captured, load_candidate=path)


def test_an_output_that_fails_only_in_the_captured_candidate_is_not_verified_on_a_stand_in(tmp_path):
    """ONNX Runtime's FP16 model passes where the captured candidate fails (as when an engine's own kernel
    is wrong): no stand-in can speak for the captured engine there, and the report says so."""
    clean = fixture("clean")
    live = accudiff.compare(clean, "fp16", candidate="onnxrt", save_candidate=tmp_path / "candidate.json", report_dir=tmp_path / "live")
    assert live.passed
    document = json.loads((tmp_path / "candidate.json").read_text())
    outputs = document["lst"][0][1][0]["outputs"]
    output = live.table[live.table["is_output"]]["tensor"].iloc[0]
    wrapper = outputs[output]["values"] if "values" in outputs[output] else outputs[output]
    array = np.load(io.BytesIO(base64.b64decode(wrapper["array"])), allow_pickle=False)
    buffer = io.BytesIO()
    np.save(buffer, array * 2 + 1, allow_pickle=False)
    wrapper["array"] = base64.b64encode(buffer.getvalue()).decode()
    (tmp_path / "damaged_engine.json").write_text(json.dumps(document))
    result = accudiff.compare(clean, "fp16", inputs=tmp_path / "live" / "inputs.npz", load_candidate=tmp_path / "damaged_engine.json")
    (failure,) = result.output_failures
    assert not failure.cause.verified and failure.cause.stand_in is None
    assert any(f"'{output}' fail only in the captured candidate (ONNX Runtime's FP16 model meets the tolerance there)" in n for n in result.notices)


def _model_with_a_scalar_tensor(path: Path) -> Path:
    """y = x * x.shape[1]: the Gather of a shape gives a 0-d tensor, as YOLO-style heads do."""
    h = onnx.helper
    nodes = [
        h.make_node("Shape", ["x"], ["shape"], name="shape"),
        h.make_node("Gather", ["shape", "one"], ["width"], name="width", axis=0),
        h.make_node("Cast", ["width"], ["width_f"], name="width_f", to=onnx.TensorProto.FLOAT),
        h.make_node("Mul", ["x", "width_f"], ["y"], name="scale"),
    ]
    graph = h.make_graph(nodes, "scalar", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
                         [onnx.numpy_helper.from_array(np.array(1, np.int64), "one")])
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


def test_scalar_tensors_keep_their_shape_through_saved_runs_and_the_reference_cache(tmp_path):
    """0-d tensors were saved as 1-d (np.ascontiguousarray makes every array at least 1-d), so a replay
    found 'shape differs: reference (), candidate (1,)' on every scalar of a YOLO head."""
    model = _model_with_a_scalar_tensor(tmp_path / "scalar.onnx")
    live = accudiff.compare(model, "fp16", candidate="onnxrt", save_candidate=tmp_path / "candidate.json", report_dir=tmp_path / "live")
    again = accudiff.compare(model, "fp16", inputs=tmp_path / "live" / "inputs.npz", load_candidate=tmp_path / "candidate.json")
    assert (again.table.set_index("tensor").loc[["width", "width_f"], "status"] == "pass").all()
    pd.testing.assert_frame_equal(live.table[COLUMNS], again.table[COLUMNS])
    cache = ReferenceCache(tmp_path / "cache")
    first, replayed = (accudiff.compare(model, "fp16", candidate="onnxrt", reference_cache=cache) for _ in range(2))
    pd.testing.assert_frame_equal(first.table[COLUMNS], replayed.table[COLUMNS])


def test_a_captured_candidate_needs_the_inputs_it_was_made_from(captured):
    with pytest.raises(AccudiffError, match="load_candidate= needs the inputs its file was made from"):
        accudiff.compare(MODEL, "fp16", load_candidate=captured / "fp16.json")
