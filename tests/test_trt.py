"""TensorRT: parsing, marking, building, engine cache and partitions run for real with TensorRT-RTX (or
TensorRT) on a machine without a GPU. Inference tests need a supported GPU and skip, with the reason,
elsewhere; they make the same assertions as the ONNX Runtime candidate's tests."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import accudiff
from accudiff.errors import AccudiffError
from accudiff.model.loading import load_model
from accudiff.runners.trt_env import import_tensorrt, inference_unavailable_reason, missing_arithmetic
from conftest import FIXTURES, fixture
from test_fixtures import FAULTS

try:
    TRT = import_tensorrt()
except AccudiffError as exc:
    pytest.skip(str(exc), allow_module_level=True)

from accudiff.bisect.partition import partition  # noqa: E402
from accudiff.runners.trt_build import BuildSettings, build_engine, create_network  # noqa: E402
from accudiff.transforms import to_fp16, to_int8  # noqa: E402
from accudiff.transforms.fp16 import HALVES  # noqa: E402
from accudiff.model.inputs import generate_feeds, resolve_shapes  # noqa: E402

PARSEABLE = sorted(p.stem for p in FIXTURES.glob("*.onnx") if p.stem != "unsupported_op")
SHAPES = {"dynamic_batch": {"x": (2, 3, 8, 8)}}
NO_INFERENCE = inference_unavailable_reason()
needs_gpu = pytest.mark.skipif(NO_INFERENCE is not None, reason=f"TensorRT inference: {NO_INFERENCE}")


def _build(name: str, mark: str, tmp_path, **settings):
    info = load_model(fixture(name))
    tensors = [t.name for t in info.tensors]
    settings = BuildSettings(mark=mark, input_shapes=SHAPES.get(name, {}), **settings)
    return info, build_engine(TRT, info.path, tensors, settings, tmp_path / "cache")


@pytest.mark.parametrize("name", PARSEABLE)
def test_every_fixture_parses(name):
    _, network, _, _ = create_network(TRT, fixture(name))
    assert network.num_layers > 0


def test_parser_error_names_the_node():
    with pytest.raises(AccudiffError, match=r"cannot convert 'unsupported_op.onnx': node 2 'unique' \(Unique\)"):
        create_network(TRT, fixture("unsupported_op"))


def test_mark_all_builds_with_every_tensor_as_output(tmp_path):
    info, built = _build("layernorm_overflow", "all", tmp_path)
    assert built.plan and built.mark == "all"
    assert set(built.outputs) == {t.name for t in info.tensors}
    assert built.not_observable == {}
    assert any("prevents fusions" in notice for notice in built.notices)


def test_a_scratch_model_referring_to_the_users_weights_where_they_are_builds(tmp_path):
    """Verification's variants refer to the user's data file in its own folder (saving's `in_place`), which
    ONNX's format cannot say: TensorRT's parser is given the graph with every data file named from one
    folder, and builds the engine from the user's weights."""
    from accudiff.model.loading import load_graph
    from accudiff.model.saving import save_model

    model = onnx.load(fixture("layernorm_overflow"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.eye(64, dtype=np.float32), "eye"))  # 16 KB: left in its file
    model.graph.node.insert(0, onnx.helper.make_node("MatMul", ["x", "eye"], ["x_mixed"], name="mix"))
    model.graph.node[1].input[0] = "x_mixed"
    (tmp_path / "user").mkdir()
    onnx.save(model, str(tmp_path / "user" / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    (tmp_path / "trials").mkdir()
    variant = tmp_path / "trials" / "variant.onnx"
    save_model(load_graph(tmp_path / "user" / "model.onnx"), variant, in_place=True)
    assert sorted(p.name for p in variant.parent.iterdir()) == ["variant.onnx"]
    built = build_engine(TRT, variant, ["y"], BuildSettings(mark="outputs"), tmp_path / "cache")
    assert built.plan and built.outputs == ["y"]


def test_mark_all_lists_what_tensorrt_cannot_show(tmp_path):
    _, built = _build("if_model", "all", tmp_path)
    assert "loop or conditional" in built.not_observable["branch"]


@pytest.mark.parametrize("mark", ["unfused", "outputs"])
def test_unfused_and_outputs_modes_build_the_shipped_engine(mark, tmp_path):
    info, built = _build("clean", mark, tmp_path)
    assert built.plan and built.mark == mark
    assert built.outputs == info.output_names  # nothing forced to be an output: fusion is untouched


def test_dynamic_shapes_get_a_profile(tmp_path):
    _, built = _build("dynamic_batch", "all", tmp_path)
    assert built.plan
    with pytest.raises(AccudiffError, match="input 'x' is dynamic; give its shape"):
        build_engine(TRT, fixture("dynamic_batch"), ["y"], BuildSettings(), tmp_path / "other")


def test_second_build_comes_from_the_engine_cache(tmp_path):
    _, first = _build("clean", "all", tmp_path)
    _, second = _build("clean", "all", tmp_path)
    assert not first.from_cache and second.from_cache
    assert second.plan == first.plan
    _, other = _build("clean", "outputs", tmp_path)
    assert not other.from_cache  # other settings, other engine


@pytest.mark.parametrize("damage", ["flip a plan byte", "truncate the plan", "damage the description", "remove the description"])
def test_a_damaged_engine_cache_entry_is_rebuilt_with_a_notice(damage, tmp_path):
    """Was: a damaged description was an internal error, and a damaged plan would have been handed to TensorRT."""
    _, first = _build("clean", "outputs", tmp_path)
    [plan] = (tmp_path / "cache" / "engines").glob("*.plan")
    description = plan.with_suffix(".json")
    if damage == "flip a plan byte":
        data = bytearray(plan.read_bytes())
        data[len(data) // 2] ^= 0x10
        plan.write_bytes(bytes(data))
    elif damage == "truncate the plan":
        plan.write_bytes(plan.read_bytes()[:100])
    elif damage == "damage the description":
        description.write_text('{"mark": "outputs", "outp')
    else:
        description.unlink()
    _, again = _build("clean", "outputs", tmp_path)
    assert not again.from_cache and again.plan == first.plan
    assert any("could not be used" in n and "it was built again" in n for n in again.notices), again.notices
    _, third = _build("clean", "outputs", tmp_path)
    assert third.from_cache and not any("built again" in n for n in third.notices)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_strongly_typed_build_of_the_transformed_models(precision, tmp_path):
    info = load_model(fixture("clean"))
    if precision in HALVES:
        model = to_fp16(info.proto, half=HALVES[precision]).model
    else:
        model = to_int8(info.proto, generate_feeds(info.inputs, resolve_shapes(info.inputs, {}), iterations=2)).model
    path = tmp_path / f"clean-{precision}.onnx"
    onnx.save(model, str(path))
    built = build_engine(TRT, path, [t.name for t in info.tensors], BuildSettings(mark="all"), tmp_path / "cache")
    assert built.plan and "r1" in built.outputs


@pytest.mark.skipif(hasattr(TRT.BuilderFlag, "FP16"), reason="this TensorRT still has weakly typed builder flags")
def test_legacy_precision_fails_clearly_without_weak_typing(tmp_path):
    with pytest.raises(AccudiffError, match="--trt-legacy-precision needs TensorRT 10's weakly typed builder"):
        _build("clean", "outputs", tmp_path, legacy_precision="fp16")


def test_partition_saves_convertible_and_non_convertible_parts(tmp_path):
    parts = partition(fixture("unsupported_op"), tmp_path / "parts")
    assert [(p.start, p.end, p.supported) for p in parts] == [(0, 1, True), (2, 2, False), (3, 4, True)]
    assert [p.path.name for p in parts] == [
        "supported_subgraph-nodes-0-1.onnx",
        "unsupported_subgraph-nodes-2-2.onnx",
        "supported_subgraph-nodes-3-4.onnx",
    ]
    assert "Unique" in parts[1].reason and parts[1].op_types == "Unique"
    for part in parts:
        onnx.checker.check_model(onnx.load(str(part.path)), full_check=True)
    for part in (parts[0], parts[2]):
        create_network(TRT, part.path)  # each convertible part converts on its own
    assert (tmp_path / "parts" / "partitions.csv").read_text().count("\n") == 4


def test_partition_command(run_cli, tmp_path):
    code, out, err = run_cli("partition", fixture("unsupported_op"), "--report-dir", tmp_path / "parts")
    assert code == 0, err
    code, _, err = run_cli("partition", fixture("unsupported_op"), "-o", tmp_path / "parts")
    assert code == 2 and "already exists" in err  # never overwritten
    assert "2 convertible and 1 non-convertible part(s)" in out
    assert "nodes 2-2: NOT convertible: Unique" in out


def test_fully_convertible_model_is_one_part(tmp_path):
    [part] = partition(fixture("clean"), tmp_path / "parts")
    assert part.supported and (part.start, part.end) == (0, 6)


def _shape_input_model(path):
    """Reshape to a target shape given as a graph input: TensorRT reads that input as a shape tensor."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"), onnx.helper.make_node("Relu", ["r"], ["y"], name="relu")],
        "shape_input",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8]), onnx.helper.make_tensor_value_info("target", onnx.TensorProto.INT64, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 4])],
    )
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_shape_tensor_input_is_fixed_to_its_value_in_the_profile(tmp_path):
    """Without a profile value TensorRT refused to build ("Network has dynamic or shape inputs, but no
    optimization profile has been defined"); the sample's value now fixes it."""
    model = _shape_input_model(tmp_path / "shape_input.onnx")
    built = build_engine(TRT, model, ["r", "y"], BuildSettings(mark="all", shape_values={"target": [4, 4]}), tmp_path / "cache")
    assert built.plan and set(built.outputs) == {"r", "y"}
    with pytest.raises(AccudiffError, match="TensorRT reads input 'target' as a shape"):
        build_engine(TRT, model, ["r", "y"], BuildSettings(mark="all"), tmp_path / "cache")


@needs_gpu
def test_tensorrt_candidate_runs_a_model_with_a_shape_tensor_input(tmp_path):
    model = _shape_input_model(tmp_path / "shape_input.onnx")
    feed = {"x": np.random.default_rng(0).uniform(-1, 1, (2, 8)).astype(np.float32), "target": np.array([4, 4], np.int64)}
    result = accudiff.compare(model, "fp16", candidate="trt", inputs=[feed], trt=accudiff.TrtOptions(mark="all"))
    assert result.passed and result.table.set_index("tensor").loc["r", "shape"] == "4x4"


@needs_gpu
@pytest.mark.parametrize("name, precision, options, node, kind, first", FAULTS, ids=[f[0] for f in FAULTS])
def test_tensorrt_candidate_names_the_planted_causes(name, precision, options, node, kind, first):
    result = accudiff.compare(fixture(name), precision, candidate="trt", trt=accudiff.TrtOptions(mark="all"), **options)
    assert not result.passed and result.output_failures
    for failure in result.output_failures:
        assert failure.cause.kind == "local" and failure.cause.node == node
        assert kind in [f.kind for f in failure.cause.findings]


@needs_gpu
@pytest.mark.parametrize("mark", ["all", "unfused", "outputs"])
def test_tensorrt_candidate_passes_the_clean_model(mark, tmp_path):
    result = accudiff.compare(fixture("clean"), "fp16", candidate="trt", trt=accudiff.TrtOptions(mark=mark), report_dir=tmp_path / "r")
    assert result.passed
    assert (tmp_path / "r" / "engine_layers.json").exists()


@needs_gpu
def test_three_way_view_and_prebuilt_engine(tmp_path):
    result = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="trt", also="onnxrt", report_dir=tmp_path / "r")
    assert {"onnxrt_status", "onnxrt_sqnr_db"} <= set(result.table.columns)
    assert result.table.set_index("tensor").loc["squared", "onnxrt_status"] == "fail"
    info = load_model(fixture("clean"))
    built = build_engine(TRT, fixture("clean"), [t.name for t in info.tensors], BuildSettings(mark="outputs"), tmp_path / "cache")
    (tmp_path / "clean.plan").write_bytes(built.plan)
    prebuilt = accudiff.compare(fixture("clean"), candidate="trt", trt=accudiff.TrtOptions(engine=tmp_path / "clean.plan"))
    assert prebuilt.passed and list(prebuilt.outputs["status"]) == ["pass"]
    assert "only its graph outputs" in prebuilt.not_observable["c1"]


def test_engine_needs_the_tensorrt_candidate(run_cli, tmp_path):
    code, _, err = run_cli("compare", fixture("clean"), "--candidate", "onnxrt", "--engine", tmp_path / "x.plan")
    assert code == 2 and "--engine compares a TensorRT engine" in err


# The inference path, checked on the CPU as far as it can be without a GPU (issue: line-by-line review).


def _capsule(address: int):
    import ctypes

    api = ctypes.pythonapi
    api.PyCapsule_New.restype, api.PyCapsule_New.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return api.PyCapsule_New(address, None, None)


def test_a_debug_address_reads_as_an_integer_or_from_a_capsule():
    from accudiff.runners.trt import device_pointer

    array = np.arange(4, dtype=np.float32)
    assert device_pointer(array.ctypes.data) == array.ctypes.data
    assert device_pointer(_capsule(array.ctypes.data)) == array.ctypes.data


def test_the_listener_matches_the_installed_bindings_signature():
    import inspect

    from accudiff.runners.trt import debug_listener

    documented = TRT.IDebugListener.process_debug_tensor.__doc__.split("(", 1)[1].split(")", 1)[0]
    names = [part.split(":")[0].strip() for part in documented.split(",")]
    assert names == ["self", "addr", "location", "type", "shape", "name", "stream"]
    ours = list(inspect.signature(type(debug_listener(TRT)).process_debug_tensor).parameters)
    assert ours == names


def test_the_listener_reads_host_tensors_and_keeps_its_errors():
    """TensorLocation.HOST takes the same path as a device copy, minus CUDA: run it for real."""
    from accudiff.runners.trt import debug_listener

    listener = debug_listener(TRT)
    values = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    listener.process_debug_tensor(values.ctypes.data, TRT.TensorLocation.HOST, TRT.DataType.FLOAT, TRT.Dims([2, 3]), "as_int", 0)
    listener.process_debug_tensor(_capsule(values.ctypes.data), TRT.TensorLocation.HOST, TRT.DataType.FLOAT, TRT.Dims([2, 3]), "as_capsule", 0)
    np.testing.assert_array_equal(listener.tensors["as_int"], values)
    np.testing.assert_array_equal(listener.tensors["as_capsule"], values)
    listener.process_debug_tensor(values.ctypes.data, TRT.TensorLocation.HOST, TRT.DataType.INT4, TRT.Dims([2, 3]), "packed", 0)
    assert "packed" not in listener.tensors and "no numpy form" in listener.unreadable["packed"]
    listener.process_debug_tensor(object(), TRT.TensorLocation.HOST, TRT.DataType.FLOAT, TRT.Dims([2, 3]), "broken", 0)
    assert listener.errors and "debug tensor 'broken'" in listener.errors[0]  # kept for infer to raise, not printed


def test_every_tensorrt_type_has_a_defined_reading():
    from accudiff.runners.trt import host_reading

    kinds = [name for name in dir(TRT.DataType) if name.isupper()]
    readings = {name: host_reading(TRT, getattr(TRT.DataType, name)) for name in kinds}
    assert {"FLOAT", "HALF", "INT8", "INT32", "INT64", "BOOL", "UINT8", "BF16", "FP8"} <= {k for k, r in readings.items() if not isinstance(r, str)}
    assert all(isinstance(r, str) for k, r in readings.items() if k in ("INT4", "FP4", "E8M0"))


def test_a_gpu_without_the_formats_arithmetic_is_named():
    """BF16 needs compute capability 8.0, FP8 8.9: an older GPU would not compute in them at all."""
    assert missing_arithmetic("bf16", (7, 5)) == "this GPU (compute capability 7.5) has no BF16 arithmetic (TensorRT needs 8.0 or later for it)"
    assert "FP8" in missing_arithmetic("int8+fp8", (8, 6))
    assert missing_arithmetic("fp16", (7, 5)) is None and missing_arithmetic("fp8+bf16", (8, 9)) is None


def test_bf16_and_fp8_decode_exactly():
    from accudiff.runners.trt import bfloat16_to_float32, fp8_e4m3_to_float32

    wide = np.array([1.0, -2.5, 3.140625, 65280.0, 2.0**-126], np.float32)  # values BF16 holds exactly
    assert np.array_equal(bfloat16_to_float32((wide.view(np.uint32) >> 16).astype(np.uint16)), wide)
    codes = np.array([0x00, 0x01, 0x08, 0x38, 0x7E, 0xFE, 0x7F], np.uint8)
    decoded = fp8_e4m3_to_float32(codes)
    assert decoded[:6].tolist() == [0.0, 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0] and np.isnan(decoded[6])


def test_engine_layers_map_to_onnx_nodes_exactly():
    """Inspector JSON as TensorRT writes it at detailed verbosity: the ONNX parser's metadata per layer,
    several for a fused layer; a node 'conv1' is never matched by a layer built from 'conv10'."""
    from accudiff.runners.trt import layer_nodes

    nodes = {"conv1", "conv10", "relu1", "add | odd"}
    fused = {"Name": "conv10 + relu1", "Metadata": "[ONNX Layer: conv10]\x1e[ONNX Layer: relu1]"}
    assert layer_nodes(fused, nodes) == ["conv10", "relu1"]
    assert layer_nodes({"Name": "x", "Metadata": "[ONNX Layer: conv1 | Local Function: block]"}, nodes) == ["conv1"]
    assert layer_nodes({"Name": "Reformatting CopyNode for Input Tensor 0 to conv10", "Metadata": ""}, nodes) == []
    assert layer_nodes("conv10 + relu1", nodes) == ["conv10", "relu1"]  # layer names only (not detailed)
    assert layer_nodes("conv1", nodes) == ["conv1"]


def test_the_parser_writes_the_metadata_the_mapping_reads():
    _, network, _, _ = create_network(TRT, fixture("clean"))
    metadata = {network.get_layer(i).name: network.get_layer(i).metadata for i in range(network.num_layers)}
    assert metadata["conv1"] == "[ONNX Layer: conv1]"


def test_polygraphy_runs_the_same_tensorrt_module():
    from accudiff.runners.trt import polygraphy_runner

    runner = polygraphy_runner(TRT, None, None)
    import polygraphy.backend.trt.runner as module

    assert module.trt.__name__ == TRT.__name__ and runner.debug_listener is None


def test_doctor_says_what_it_verified(run_cli):
    code, out, _ = run_cli("doctor")
    assert "tensorrt-rtx" in out and "GPU" in out
    assert "[  ok   ] build the clean fixture, --trt-mark unfused" in out
    if NO_INFERENCE is None:
        assert code == 0 and "verdict: TensorRT inference verified end to end" in out
    else:
        assert code == 1 and f"verdict: TensorRT inference NOT verified here: {NO_INFERENCE}" in out


def test_an_engine_is_cached_under_its_weights_too(tmp_path):
    """Two models with the same graph and different weights in their data files are two engines: the
    cache key read only the model file, so the second was served the first's engine."""
    from test_weights import _mlp

    plans = []
    for scale in (1.0, 2.0):
        model = _mlp()
        for init in model.graph.initializer:
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * np.float32(scale), init.name))
        folder = tmp_path / str(scale)
        folder.mkdir()
        onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0)
        plans.append(build_engine(TRT, folder / "model.onnx", ["y"], BuildSettings(mark="outputs"), tmp_path / "cache").plan)
    assert plans[0] != plans[1]
