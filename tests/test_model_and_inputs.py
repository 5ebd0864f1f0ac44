"""Loading models and preparing inputs: every bad input is one clear sentence, never a traceback."""

from __future__ import annotations

import numpy as np
import pandas as pd
import onnx
import pytest
from polygraphy.json import save_json

import accudiff
from accudiff.errors import AccudiffError
from accudiff.model.inputs import generate_feeds, parse_input_shapes, parse_val_ranges, resolve_shapes, save_feeds
from accudiff.model.samples import samples_from_path
from accudiff.model.loading import load_model, read_again, remember_model
from conftest import fixture


def test_missing_model(tmp_path):
    with pytest.raises(AccudiffError, match="does not exist"):
        load_model(tmp_path / "nope.onnx")


def test_corrupt_model(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a protobuf" * 10)
    with pytest.raises(AccudiffError, match="not a readable ONNX model|fails the ONNX checker|no nodes"):
        load_model(bad)


def test_external_data_is_loaded(tmp_path):
    import onnx

    model = onnx.load(str(fixture("clean")))
    onnx.save(model, str(tmp_path / "external.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    result = accudiff.compare(tmp_path / "external.onnx", "fp16", candidate="onnxrt")
    assert result.passed


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_weights_past_the_external_data_threshold_travel_beside_each_model(precision, tmp_path, monkeypatch):
    """A model whose weights pass the threshold (lowered here from 1.5 GB, as protobuf stops at 2 GiB) is
    saved with its weights beside it at every step: the candidate in the report, and the isolated model
    built from that candidate afterwards (once pointed at the candidate's data file, not beside it)."""
    import onnx

    from accudiff.model import saving

    folder = tmp_path / "a folder with spaces"
    folder.mkdir()
    model = onnx.load(str(fixture("int8_outlier_channel")))
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    whole = accudiff.compare(fixture("int8_outlier_channel"), precision, candidate="onnxrt", verify=False)
    monkeypatch.setattr(saving, "EXTERNAL_DATA_THRESHOLD", 100)
    monkeypatch.setattr(saving, "EXTERNAL_DATA_MIN_TENSOR", 0)
    result = accudiff.compare(folder / "model.onnx", precision, candidate="onnxrt", verify=False, report_dir=tmp_path / "r")
    assert result.coverage[0] == result.coverage[1]  # weights beside the model change nothing of what is compared
    pd.testing.assert_frame_equal(result.table.drop(columns=["note"], errors="ignore"), whole.table.drop(columns=["note"], errors="ignore"))
    [candidate] = result.candidate_models
    saved = onnx.load(str(result.report_dir / candidate), load_external_data=False)
    assert {e.value for init in saved.graph.initializer for e in init.external_data if e.key == "location"} == {f"{candidate}.data"}
    onnx.checker.check_model(str(result.report_dir / candidate))


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_no_model_past_the_threshold_is_saved_whole(precision, tmp_path, monkeypatch):
    """INT8 saved the model it hands ONNX Runtime's quantizer whole, and let the quantizer save whole too:
    past protobuf's 2 GB that was `internal error: EncodeError` (the 3 GiB MLP of benchmarks/big_weights.py).
    Here the threshold is lowered, and saving a model whole past it fails as protobuf would."""
    import onnx

    from accudiff.model import saving

    monkeypatch.setattr(saving, "EXTERNAL_DATA_THRESHOLD", 100)
    monkeypatch.setattr(saving, "EXTERNAL_DATA_MIN_TENSOR", 0)
    original = onnx.save_model

    def like_protobuf(proto, f, *args, save_as_external_data=False, **kwargs):
        if isinstance(proto, onnx.ModelProto) and not save_as_external_data:
            inline = sum(len(init.raw_data) for init in proto.graph.initializer)
            assert inline <= 100, f"a model with {inline} bytes of weights inside it was saved whole"
        return original(proto, f, *args, save_as_external_data=save_as_external_data, **kwargs)

    written_whole = []
    write_whole = saving._write_whole

    def accudiffs_own(proto, path):  # what accudiff calls to write a model's graph (onnx.save only in the quantizer)
        inline = sum(len(init.raw_data) for init in proto.graph.initializer)
        assert inline <= 100, f"a model with {inline} bytes of weights inside it was saved whole to {path}"
        written_whole.append(path)
        return write_whole(proto, path)

    monkeypatch.setattr(onnx, "save_model", like_protobuf)
    monkeypatch.setattr(onnx, "save", like_protobuf)
    monkeypatch.setattr(saving, "_write_whole", accudiffs_own)
    folder = tmp_path / "a folder with spaces"
    folder.mkdir()
    original(onnx.load(str(fixture("int8_outlier_channel"))), str(folder / "model.onnx"), save_as_external_data=True, size_threshold=0)
    result = accudiff.compare(folder / "model.onnx", precision, candidate="onnxrt", report_dir=tmp_path / "r")
    assert written_whole and result.candidate_models  # the spy saw accudiff's saves (the candidate's among them)


def test_weights_in_data_files_are_run_where_they_are(tmp_path, monkeypatch):
    """ONNX Runtime is handed the marked graph alone and reads the weights from the model's own data files
    (an FP16 model's too: widened by a Cast it folds), instead of a rewritten copy of every weight per run
    (37 s of a 47 s compare of 768 MB of weights); small weights inside a model go along in memory, large
    ones to a side file it maps. The numbers are those of the same model held whole."""
    import numpy as np
    import onnx

    import accudiff.runners.onnxrt
    from accudiff.runners.onnxrt import OnnxrtRunner
    from accudiff.transforms.fp16 import to_fp16

    folder = tmp_path / "a folder with spaces"
    folder.mkdir()
    model = to_fp16(onnx.load(str(fixture("layernorm_overflow")))).model
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in model.graph.initializer)
    [spec] = load_model(fixture("layernorm_overflow")).inputs
    feed = {spec.name: np.random.default_rng(0).standard_normal(spec.shape).astype(np.float32)}
    outputs = {}
    for kind, inline_up_to, written_files in (
        ("external", 1 << 20, []), ("whole", 1 << 20, []), ("large whole", -1, ["marked.onnx", "marked.onnx.data"])
    ):
        path = folder / f"{kind}.onnx"
        saved = onnx.ModelProto()
        saved.CopyFrom(model)  # onnx.save with external data turns the weights it is given into references to the file
        onnx.save(saved, str(path), save_as_external_data=kind == "external", location="weights.bin", size_threshold=0)
        monkeypatch.setattr(accudiff.runners.onnxrt, "INLINE_WEIGHTS_UP_TO", inline_up_to)
        runner = OnnxrtRunner(path, [o for n in model.graph.node for o in n.output], emulate_fp16=True)
        runner.activate()
        written = sorted(p.name for p in runner._scratch.iterdir()) if runner._scratch else []  # a folder only when something is written
        outputs[kind] = runner.infer(feed)
        runner.deactivate()
        assert written == written_files, kind
    for kind in ("whole", "large whole"):
        assert outputs[kind].keys() == outputs["external"].keys()
        for name in outputs["external"]:
            np.testing.assert_array_equal(outputs[kind][name], outputs["external"][name])


def test_dynamic_dimension_needs_a_shape():
    info = load_model(fixture("dynamic_batch"))
    with pytest.raises(AccudiffError, match=r"dynamic dimension 'batch'.*--input-shapes x:<batch>x3x8x8"):
        resolve_shapes(info.inputs, {})
    assert resolve_shapes(info.inputs, parse_input_shapes(["x:2x3x8x8"])) == {"x": (2, 3, 8, 8)}


def test_input_shape_errors_name_the_problem():
    info = load_model(fixture("dynamic_batch"))
    with pytest.raises(AccudiffError, match="does not have; its inputs are: x"):
        resolve_shapes(info.inputs, {"batch": (1,)})
    with pytest.raises(AccudiffError, match="expects batch x 3 x 8 x 8"):
        resolve_shapes(info.inputs, {"x": (2, 4, 8, 8)})
    with pytest.raises(AccudiffError, match="not of the form"):
        parse_input_shapes(["x=1x2"])


def test_random_feeds_are_seeded_and_respect_ranges():
    info = load_model(fixture("multi_io"))
    shapes = resolve_shapes(info.inputs, {})
    ranges = parse_val_ranges(["-2,2", "ids:0,1"])
    first = generate_feeds(info.inputs, shapes, seed=3, val_ranges=ranges, iterations=2)
    again = generate_feeds(info.inputs, shapes, seed=3, val_ranges=ranges, iterations=2)
    assert len(first) == 2
    for a, b in zip(first, again):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    assert first[0]["a"].min() >= -2 and first[0]["a"].max() <= 2 and first[0]["a"].min() < 0
    assert set(np.unique(first[0]["ids"])) <= {0, 1} and first[0]["ids"].dtype == np.int64
    assert not np.array_equal(first[0]["a"], first[1]["a"])


def test_feeds_round_trip_through_npz(tmp_path):
    info = load_model(fixture("multi_io"))
    feeds = generate_feeds(info.inputs, resolve_shapes(info.inputs, {}), iterations=3)
    save_feeds(feeds, tmp_path / "inputs.npz")
    loaded = list(samples_from_path(tmp_path / "inputs.npz", info.inputs))
    assert len(loaded) == 3
    for a, b in zip(feeds, loaded):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


def test_plain_npz_is_one_feed(tmp_path):
    info = load_model(fixture("clean"))
    np.savez(tmp_path / "x.npz", x=np.ones((1, 3, 16, 16), np.float32))
    [feed] = samples_from_path(tmp_path / "x.npz", info.inputs)
    assert feed["x"].shape == (1, 3, 16, 16)


def test_polygraphy_saved_inputs_load(tmp_path):
    info = load_model(fixture("clean"))
    arrays = [{"x": np.full((1, 3, 16, 16), i, np.float32)} for i in range(2)]
    save_json(arrays, str(tmp_path / "inputs.json"))
    feeds = list(samples_from_path(tmp_path / "inputs.json", info.inputs, scratch=tmp_path))
    assert [float(f["x"][0, 0, 0, 0]) for f in feeds] == [0.0, 1.0]


def test_a_file_stacking_batches_of_a_fixed_batch_input_is_that_many_samples(tmp_path):
    """As ModelOpt's calibration files hold them: 5 rows for an input of batch 1 are 5 samples (it was refused
    whole: 'the shape 5x3x16x16, but the model expects 1x3x16x16'), from an .npz or a one-input .npy."""
    info = load_model(fixture("clean"))
    rows = np.random.default_rng(0).normal(size=(5, 3, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "stacked.npz", x=rows)
    np.save(tmp_path / "stacked.npy", rows)
    for name in ("stacked.npz", "stacked.npy"):
        feeds = list(samples_from_path(tmp_path / name, info.inputs, scratch=tmp_path))
        assert [f["x"].shape for f in feeds] == [(1, 3, 16, 16)] * 5
        np.testing.assert_array_equal(np.concatenate([f["x"] for f in feeds]), rows)
    # Every input must stack as many batches; a dynamic batch takes the file whole, as one sample.
    multi = load_model(fixture("multi_io"))
    np.savez(tmp_path / "uneven.npz", a=np.ones((2, 16), np.float32), b=np.ones((3, 16), np.float32), ids=np.ones((2, 4), np.int64))
    with pytest.raises(AccudiffError, match="gives input 'a' the shape 2x16, but the model expects 1x16"):
        samples_from_path(tmp_path / "uneven.npz", multi.inputs)
    np.savez(tmp_path / "even.npz", a=np.ones((2, 16), np.float32), b=np.ones((2, 16), np.float32), ids=np.ones((2, 4), np.int64))
    assert len(samples_from_path(tmp_path / "even.npz", multi.inputs, scratch=tmp_path)) == 2
    dynamic = load_model(fixture("dynamic_batch"))
    np.save(tmp_path / "batch.npy", np.ones((4, 3, 8, 8), np.float32))
    [feed] = samples_from_path(tmp_path / "batch.npy", dynamic.inputs, scratch=tmp_path)
    assert feed["x"].shape == (4, 3, 8, 8)


def test_a_calibration_npy_and_stacked_inputs_run_from_the_command_line(tmp_path, run_cli):
    rows = np.random.default_rng(0).normal(size=(5, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "calib.npy", rows)
    np.savez(tmp_path / "inputs.npz", x=rows[:3])
    code, out, err = run_cli("compare", fixture("clean"), "--int8", "--calib-data", "calib.npy", "--load-inputs", "inputs.npz", "--no-verify")
    assert code in (0, 1), err
    assert "samples: 3," in out


def test_a_npy_file_needs_a_model_of_one_input(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((1, 16), np.float32))
    with pytest.raises(AccudiffError, match=r"holds one array and no input name, and the model has 3 inputs \(a, b, ids\): give them in an .npz"):
        samples_from_path(tmp_path / "a.npy", load_model(fixture("multi_io")).inputs)
    (tmp_path / "bad.npy").write_bytes(b"not an array")
    with pytest.raises(AccudiffError, match="input file .*bad.npy' could not be read as .npy"):
        samples_from_path(tmp_path / "bad.npy", load_model(fixture("clean")).inputs)
    np.save(tmp_path / "evil.npy", np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(AccudiffError, match="could not be read as .npy"):
        samples_from_path(tmp_path / "evil.npy", load_model(fixture("clean")).inputs)


def test_pickled_npz_is_refused(tmp_path):
    info = load_model(fixture("clean"))
    np.savez(tmp_path / "evil.npz", x=np.array([object()], dtype=object))
    with pytest.raises(AccudiffError, match="could not be read"):
        samples_from_path(tmp_path / "evil.npz", info.inputs)


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"y": np.ones((1, 3, 16, 16), np.float32)}, "does not have; its inputs are: x"),
        ({"x": np.ones((1, 3, 16, 16), np.float64)}, "as float64, but the model expects float32"),
        ({"x": np.ones((1, 3, 8, 8), np.float32)}, "the shape 1x3x8x8, but the model expects 1x3x16x16"),
        ({"x": np.float32(1)}, r"the shape \(\) \(a scalar\), but the model expects 1x3x16x16"),  # it read "the shape , but"
    ],
)
def test_loaded_inputs_are_validated(tmp_path, arrays, message):
    info = load_model(fixture("clean"))
    np.savez(tmp_path / "in.npz", **arrays)
    with pytest.raises(AccudiffError, match=message):
        samples_from_path(tmp_path / "in.npz", info.inputs)


def test_scalar_inputs_are_arrays():
    info = load_model(fixture("if_model"))
    [feed] = generate_feeds(info.inputs, resolve_shapes(info.inputs, {}))
    assert isinstance(feed["cond"], np.ndarray) and feed["cond"].shape == () and feed["cond"].dtype == np.bool_


@pytest.mark.parametrize("written", [{"dim_value": -1}, {"dim_value": 0}, {"dim_param": "?"}, {"dim_param": ""}, {}])
def test_unknown_dimensions_written_any_way_are_dynamic(written, tmp_path):
    """Paddle and TensorFlow exports write unknown sizes as -1 or 0: they take --input-shapes and loaded data."""
    import onnx

    model = onnx.load(str(fixture("dynamic_batch")))
    for vi in [*model.graph.input, *model.graph.output]:
        dim = vi.type.tensor_type.shape.dim[0]
        dim.Clear()
        for key, value in written.items():
            setattr(dim, key, value)
    path = tmp_path / "unknown_batch.onnx"
    onnx.save(model, str(path))
    assert load_model(path).inputs[0].shape == (None, 3, 8, 8)
    given = accudiff.compare(path, "fp16", candidate="onnxrt", input_shapes=["x:2x3x8x8"])
    assert given.passed and given.table.set_index("tensor").loc["y", "shape"] == "2x4"
    np.savez(tmp_path / "x.npz", x=np.ones((3, 3, 8, 8), np.float32))
    assert accudiff.compare(path, "fp16", candidate="onnxrt", inputs=tmp_path / "x.npz").passed
    with pytest.raises(AccudiffError, match=r"dynamic dimension '\?'; give its shape with input_shapes=\['x:<\?>x3x8x8'\]"):
        accudiff.compare(path, "fp16", candidate="onnxrt")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"keep_fp32": ["conv3"]}, r"keep_fp32=\['conv3'\] matches no node of the model; did you mean 'conv2', 'conv1', 'Conv'\?"),
        ({"keep_fp32": ["BatchNorm"]}, r"keep_fp32=\['BatchNorm'\] matches no node of the model"),
        ({"atol": ["inf"]}, r"atol=\['inf'\] is not finite"),
        ({"rtol": ["logits:nan"]}, r"rtol=\['logits:nan'\] is not finite"),
        ({"stol": ["nonexistent:0.1"]}, r"stol= names a tensor 'nonexistent' that the model does not compute"),
        ({"input_shapes": ["x:0x3x16x16"]}, r"has a dimension of size 0 or less: the comparison would cover no element"),
    ],
)
def test_options_that_would_check_nothing_are_refused(options, message):
    with pytest.raises(AccudiffError, match=message):
        accudiff.compare(fixture("clean"), "fp16", candidate="onnxrt", **options)


def test_empty_loaded_inputs_and_mismatched_calibration_are_refused(tmp_path):
    np.savez(tmp_path / "empty.npz", x=np.ones((0, 3, 8, 8), np.float32))
    with pytest.raises(AccudiffError, match="every graph output of 'dynamic_batch.onnx' is empty on these inputs"):
        accudiff.compare(fixture("dynamic_batch"), "fp16", candidate="onnxrt", inputs=tmp_path / "empty.npz")
    np.savez(tmp_path / "calib.npz", image=np.ones((1, 3, 16, 16), np.float32))
    with pytest.raises(AccudiffError, match=r"calibration file '.*calib.npz', sample 0 \('calib.npz'\) names an input 'image' that the model does not have"):
        accudiff.compare(fixture("clean"), "int8", candidate="onnxrt", calib_data=tmp_path / "calib.npz")


def test_a_folder_of_npz_files_is_a_dataset_read_one_sample_at_a_time(tmp_path):
    """Files holding one sample or several, in name order; each sample is checked as it is read."""
    info = load_model(fixture("clean"))
    folder = tmp_path / "dataset"
    folder.mkdir()
    np.savez(folder / "a.npz", x=np.full((1, 3, 16, 16), 0, np.float32))
    save_feeds([{"x": np.full((1, 3, 16, 16), i, np.float32)} for i in (1, 2)], folder / "b.npz")
    (folder / "notes.txt").write_text("not a sample")
    samples = samples_from_path(folder, info.inputs)
    assert len(samples) == 3 and [float(s["x"][0, 0, 0, 0]) for s in samples] == [0.0, 1.0, 2.0]
    np.savez(folder / "c.npz", x=np.ones((1, 3, 8, 8), np.float32))
    with pytest.raises(AccudiffError, match=r"sample 3 \('c.npz'\) gives input 'x' the shape 1x3x8x8"):
        list(samples_from_path(folder, info.inputs))
    with pytest.raises(AccudiffError, match="holds no .npz file"):
        samples_from_path(tmp_path, info.inputs)


def test_a_model_read_again_has_the_same_model_and_inventory(tmp_path):
    """Verification takes the FP32 model again after the transform let go of it (`read_again`): the model as
    it was remembered, its weights referenced where the file holds them rather than read, checked and
    inferred again. Graph, types, weights' values and inventory must be the ones the first reading gave,
    for weights in data files, inside the model file (large ones referenced at their offsets) and an If body."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from accudiff.model.graph import copy_without_initializers
    from accudiff.model.weights import is_external, weight_values

    external = tmp_path / "external.onnx"
    onnx.save(onnx.load(str(fixture("layernorm_overflow"))), str(external), save_as_external_data=True, location="w.bin", size_threshold=0)
    large = tmp_path / "large.onnx"
    weights = [numpy_helper.from_array(np.random.default_rng(k).standard_normal((64, 64)).astype(np.float32), f"w{k}") for k in range(2)]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w0"], ["h"], name="m0"), helper.make_node("MatMul", ["h", "w1"], ["y"], name="m1")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(large))
    for path in (fixture("layernorm_overflow"), fixture("two_faults_one_path"), fixture("if_model"), external, large):
        first, let_go = load_model(path), load_model(path)
        remember_model(let_go)
        let_go.proto = onnx.ModelProto()
        again = read_again(let_go)
        assert copy_without_initializers(again.proto) == copy_without_initializers(first.proto)
        for got, want in zip(again.proto.graph.initializer, first.proto.graph.initializer, strict=True):
            assert (got.name, got.data_type, list(got.dims)) == (want.name, want.data_type, list(want.dims))
            np.testing.assert_array_equal(weight_values(got), weight_values(want))
        assert (again.tensors, again.upstream, again.nodes, again.inputs) == (first.tensors, first.upstream, first.nodes, first.inputs)
    assert all(is_external(init) for init in again.proto.graph.initializer)  # the large ones: referenced in the file, not copied


def test_weights_held_in_constant_nodes_are_typed_as_inference_types_them():
    """Inference sees a large Constant (how Paddle's exports hold weights) as a typed input, not its values:
    every value's type and shape must be what inference on the whole model finds, a Constant that is a
    graph output and a small one that shape arithmetic reads included."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from accudiff.model.shapes import infer_shapes_in_place

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal((4, 48)).astype(np.float16), "b")  # small: stays whole
    nodes = [
        helper.make_node("Constant", [], ["weight"], value=weight),
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([-1, 48], np.int64), "s")),
        helper.make_node("Constant", [], ["exported"], value=numpy_helper.from_array(np.ones((40, 40), np.float32), "e")),
        helper.make_node("MatMul", ["x", "weight"], ["product"]),
        helper.make_node("Reshape", ["product", "shape"], ["flat"]),
        helper.make_node("Constant", [], ["bias"], value=bias),
        helper.make_node("Cast", ["flat"], ["half"], to=TensorProto.FLOAT16),
        helper.make_node("Add", ["half", "bias"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None), helper.make_tensor_value_info("exported", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    whole = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    infer_shapes_in_place(model)
    assert [vi.SerializeToString() for vi in model.graph.value_info] == [vi.SerializeToString() for vi in whole.graph.value_info]
    assert {vi.name for vi in model.graph.value_info} >= {"weight", "product", "flat", "half"}


def test_a_data_file_with_several_hard_links_loads_and_one_outside_the_folder_is_refused(tmp_path, run_cli):
    """ONNX's checker refuses a data file with several hard links ('a potential hardlink attack'), which
    ONNX Runtime loads: a package manager's store links files. A location outside the model's folder stays
    refused."""
    import os

    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [onnx.helper.make_tensor_value_info("x", 1, [2, 64])],
        [onnx.helper.make_tensor_value_info("y", 1, [2, 64])], [onnx.numpy_helper.from_array(np.eye(64, dtype=np.float32), "W")]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save(model, str(folder / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    os.link(folder / "m.data", tmp_path / "elsewhere.data")
    with pytest.raises(onnx.checker.ValidationError, match="hard links"):
        onnx.checker.check_model(str(folder / "m.onnx"))
    code, out, err = run_cli("compare", folder / "m.onnx", "--fp16")
    assert code == 0, err
    proto = onnx.load(str(folder / "m.onnx"), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../elsewhere.data"
    onnx.save(proto, str(folder / "outside.onnx"))
    code, _, err = run_cli("compare", folder / "outside.onnx")
    assert code == 2 and "outside its folder" in err
