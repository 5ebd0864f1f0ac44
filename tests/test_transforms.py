"""The FP16, BF16 and INT8 transforms: valid models, original names kept, nothing clamped silently."""

from __future__ import annotations

import numpy as np

import accudiff
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from accudiff.model.loading import load_model
from accudiff.runners.fp16_emulation import lower_fp16
from accudiff.runners.onnxrt import OnnxrtRunner
from accudiff.errors import AccudiffError
from accudiff.transforms import to_fp16, to_int8
from accudiff.transforms.fp16 import BF16, FP16
from accudiff.transforms.opset import at_forms_opset
from accudiff.transforms.int8 import QUANTIZED_OPS
from accudiff.model.inputs import generate_feeds, resolve_shapes
from conftest import FIXTURES, fixture

ALL_FIXTURES = sorted(p.stem for p in FIXTURES.glob("*.onnx"))
SHAPES = {"dynamic_batch": {"x": (2, 3, 8, 8)}}


def _produced(model: onnx.ModelProto) -> set[str]:
    return {o for node in model.graph.node for o in node.output}


def _io_types(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(v.name, v.type.tensor_type.elem_type) for v in [*model.graph.input, *model.graph.output]]


def _runs_in_onnxruntime(model: onnx.ModelProto, info, tmp_path) -> dict:
    path = tmp_path / "candidate.onnx"
    onnx.save(model, str(path))
    feed = generate_feeds(info.inputs, resolve_shapes(info.inputs, SHAPES.get(info.stem, {})))[0]
    with OnnxrtRunner(path, [t.name for t in info.tensors]) as runner:
        return {name: np.array(value) for name, value in runner.infer(feed).items()}


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fp16_model_is_valid_keeps_names_and_io_types(name, tmp_path):
    info = load_model(fixture(name))
    result = to_fp16(info.proto)
    onnx.checker.check_model(result.model, full_check=True)
    assert _io_types(result.model) == _io_types(info.proto)
    assert {t.name for t in info.tensors} <= _produced(result.model)
    outputs = _runs_in_onnxruntime(result.model, info, tmp_path)
    assert {t.name for t in info.tensors} <= set(outputs)


@pytest.mark.parametrize("kind", ["candidate", "isolated", "switchboard"])
@pytest.mark.parametrize("name", [n for n in ALL_FIXTURES if n != "if_model"])
def test_fp16_models_carry_the_types_shape_inference_would_give(name, kind, tmp_path):
    """The worker cuts and lowers the candidate, its isolated twin and the verification's switchboard without
    inferring their shapes again (0.2 s a model on the PP-OCRv4 recognizer): every value a node produces
    must already be typed, exactly as inference types it (the Casts and switches the transforms add included)."""
    from accudiff.model.shapes import infer_shapes_in_place
    from accudiff.execution.probes import largest_values
    from accudiff.model.samples import samples_from_feeds
    from accudiff.transforms.candidate import CandidateRecipe, CandidateVariants, transform_model
    from accudiff.transforms.isolate import isolate_in_place

    info = load_model(fixture(name))
    feed = generate_feeds(info.inputs, resolve_shapes(info.inputs, SHAPES.get(info.stem, {})))[0]
    transformed = transform_model(info, CandidateRecipe("fp16"), samples_from_feeds([feed], tmp_path / "samples.npz"), largest_values)
    model = transformed.model
    if kind == "isolated":
        types = {t.name: onnx.helper.np_dtype_to_tensor_dtype(t.dtype) for t in info.tensors if t.dtype is not None}
        isolate_in_place(model, types, transformed.storage_copies)
    elif kind == "switchboard":
        board = CandidateVariants(info, CandidateRecipe("fp16"), transformed).switchboard(transformed.converted)
        if board is None:  # only a node converted inside an If/Loop/Scan body has no switch
            top_level = {node.name for node in transformed.model.graph.node}
            assert not set(transformed.converted) <= top_level, name
            return
        model = board.model
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.value_info, *model.graph.output]}
    produced = [o for node in model.graph.node for o in node.output if o]
    assert all(declared.get(o) for o in produced), [o for o in produced if not declared.get(o)]
    inferred = onnx.ModelProto()
    inferred.CopyFrom(model)
    infer_shapes_in_place(inferred)
    shapes = {vi.name: vi.type.tensor_type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    ours = {vi.name: vi.type.tensor_type for vi in [*model.graph.value_info, *model.graph.output]}
    assert {o: ours[o].elem_type for o in produced if o in shapes} == {o: shapes[o].elem_type for o in produced if o in shapes}
    assert {o: str(ours[o].shape) for o in produced if o in shapes} == {o: str(shapes[o].shape) for o in produced if o in shapes}


def _has_quantizable_nodes(name: str) -> bool:
    return any(node.op_type in QUANTIZED_OPS for node in onnx.load(str(fixture(name))).graph.node)


@pytest.mark.parametrize("name", [n for n in ALL_FIXTURES if _has_quantizable_nodes(n)])
def test_int8_model_is_valid_and_keeps_names(name, tmp_path):
    info = load_model(fixture(name))
    feeds = generate_feeds(info.inputs, resolve_shapes(info.inputs, SHAPES.get(name, {})), iterations=2)
    result = to_int8(info.proto, feeds)
    onnx.checker.check_model(result.model)
    assert {t.name for t in info.tensors} <= _produced(result.model)
    _runs_in_onnxruntime(result.model, info, tmp_path)


@pytest.mark.parametrize("name", [n for n in ALL_FIXTURES if not _has_quantizable_nodes(n)])
def test_int8_of_a_model_with_nothing_to_quantize_is_refused(name):
    """No Conv/ConvTranspose/MatMul/Gemm: the INT8 candidate would be the model itself, a vacuous check."""
    info = load_model(fixture(name))
    feeds = generate_feeds(info.inputs, resolve_shapes(info.inputs, SHAPES.get(name, {})), iterations=1)
    with pytest.raises(AccudiffError, match="would compare it with itself"):
        to_int8(info.proto, feeds)


def test_fp16_converts_weights_without_clamping():
    info = load_model(fixture("overflow_constant"))
    result = to_fp16(info.proto, autokeep=False)
    converted = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer if i.data_type == TensorProto.FLOAT16}
    assert np.isinf(converted["bn.var__fp16"]).sum() == 1  # 1e8 became Inf, as FP16 would: not clamped to 1e4
    assert [kind for kind, _ in result.constant_findings["bn"]] == ["constant_overflow"]


def test_bf16_weights_round_to_nearest_even_as_ml_dtypes_does():
    """BF16 keeps FP32's top 16 bits after rounding to nearest, ties to even; NaN stays NaN, Inf stays Inf."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    ties = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.3895313e38], dtype=np.float32)  # halfway cases; near the top
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], dtype=np.float32)
    values = np.concatenate([rng.normal(0, 10, 500).astype(np.float32), ties, special])
    stored = BF16.values(values)
    expected = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = ~np.isnan(values)
    assert np.array_equal(stored[finite], expected[finite])
    assert np.isnan(stored[~finite].view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_a_constant_of_minus_infinity_is_no_reason_to_keep_a_node():
    """An attention mask's -inf is exact in FP16: the Add reading it converts (it was kept in FP32 as
    'beyond the FP16 maximum'), and no constant is reported as overflowing."""
    mask = np.where(np.tri(4, dtype=bool), 0.0, -np.inf).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "mask"], ["masked"], name="apply_mask"), onnx.helper.make_node("Softmax", ["masked"], ["y"], name="softmax")],
        "masked_softmax",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4])],
        [numpy_helper.from_array(mask, "mask")],
    )
    model = onnx.shape_inference.infer_shapes(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    for half in (FP16, BF16):
        result = to_fp16(model, half=half)
        assert not result.kept and result.converted == {"apply_mask", "softmax"} and not result.constant_findings


def _mask_and_epsilon_model() -> onnx.ModelProto:
    """An attention mask written as exporters write it, (1 - mask) * FP32's lowest, and a normalization whose
    epsilon is 1e-12: x / sqrt(mean(x^2) + eps)."""
    nodes = [
        onnx.helper.make_node("Sub", ["one", "mask"], ["hidden"], name="invert"),
        onnx.helper.make_node("Mul", ["hidden", "lowest"], ["bias"], name="fill"),
        onnx.helper.make_node("Add", ["x", "bias"], ["scores"], name="apply_mask"),
        onnx.helper.make_node("Mul", ["scores", "scores"], ["square"], name="square"),
        onnx.helper.make_node("ReduceMean", ["square"], ["variance"], name="mean", keepdims=1, axes=[-1]),
        onnx.helper.make_node("Add", ["variance", "eps"], ["guarded"], name="add_eps"),
        onnx.helper.make_node("Sqrt", ["guarded"], ["root"], name="root"),
        onnx.helper.make_node("Div", ["scores", "root"], ["y"], name="normalize"),
    ]
    graph = onnx.helper.make_graph(
        nodes, "mask_and_eps",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]), onnx.helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.float32(1), "one"), numpy_helper.from_array(np.float32(np.finfo(np.float32).min), "lowest"),
         numpy_helper.from_array(np.float32(1e-12), "eps")],
    )
    return onnx.shape_inference.infer_shapes(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))


def test_fp32s_lowest_as_a_mask_fill_becomes_minus_infinity_in_bf16_and_says_why():
    """BF16's largest finite value is (2 - 2^-7) * 2^127 = 3.3895e38, below FP32's: the fill exporters write
    rounds to -Inf (as ml_dtypes rounds it), and 0 x -Inf is NaN in the Mul. Autokeep keeps the Mul saying
    so (it treated BF16's range as FP32's, and kept nothing); without autokeep the finding says it."""
    import ml_dtypes

    assert BF16.maximum == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) == 3.3895313892515355e38
    assert np.isneginf(np.float32(np.finfo(np.float32).min).astype(ml_dtypes.bfloat16))
    model = _mask_and_epsilon_model()
    kept = to_fp16(model, half=BF16).kept
    assert [(k.node, k.autokept) for k in kept] == [("fill", True)]
    assert kept[0].reason == ("its constant 'lowest' holds -3.4028e+38 (FP32's lowest, which exporters write where a mask hides a position), "
                              "beyond BF16's largest finite value 3.3895e+38: in BF16 it would be -Inf; 0 × Inf is NaN, so the Mul would give "
                              "NaN wherever it multiplies that by 0")
    found = dict(to_fp16(model, half=BF16, autokeep=False).constant_findings["fill"])
    assert "in BF16 it became -Inf; 0 × Inf is NaN, so the Mul gives NaN wherever it multiplies that by 0" in found["constant_overflow"]


def test_an_epsilon_below_fp16s_smallest_subnormal_is_a_finding_that_names_the_denominator():
    """1e-12 is 0 in FP16 (half its smallest subnormal is 2.98e-8): the Add no longer guards the Sqrt."""
    found = to_fp16(_mask_and_epsilon_model(), half=FP16).constant_findings
    assert found["add_eps"] == [("constant_underflow", "its constant 'eps' holds 1e-12, below half FP16's smallest subnormal 5.96e-08: "
                                                      "in FP16 it became 0, so it no longer keeps the Sqrt 'root' that reads the sum away from 0")]
    assert "add_eps" not in to_fp16(_mask_and_epsilon_model(), half=BF16).constant_findings  # BF16 holds 1e-12


@pytest.mark.parametrize("name", ["per_channel_opset11_ir7", "clean"])
def test_bf16_converts_a_model_whose_opset_has_no_bf16_conv(name, tmp_path):
    """Conv, pooling and most activations gain BF16 forms at opset 22: an opset-11 or -17 model is compared
    at it in BF16 (said in a notice), names kept, and every node computes in BF16 (they were all kept in
    FP32, which made the BF16 check pass vacuously)."""
    info, notices = at_forms_opset(load_model(fixture(name)), "bf16", tmp_path)
    assert notices and "it is compared at opset 22 (converted by ONNX's version converter, names kept)" in notices[0]
    result = to_fp16(info.proto, half=BF16)
    onnx.checker.check_model(result.model, full_check=True)
    assert not result.kept and result.converted == {n.name for n in info.proto.graph.node if n.op_type != "Constant"}
    assert result.model.opset_import[0].version == 22
    lower_fp16(result.model)  # ONNX Runtime's CPU kernels have no BF16 Conv: it runs as accudiff emulates it
    assert {t.name for t in info.tensors} <= set(_runs_in_onnxruntime(result.model, info, tmp_path))


def test_a_half_candidate_that_converts_nothing_is_refused():
    """The only node reads a constant beyond FP16's range (autokeep keeps it): the FP16 candidate would be the
    model itself, a check that proves nothing. Kept by --keep-fp32 (a repair being checked), it is allowed."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "big"], ["y"], name="shift")], "shift",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])], [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.full(4, 1e6, np.float32), "big")],
    )
    model = onnx.shape_inference.infer_shapes(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    with pytest.raises(AccudiffError, match=r"^no node of the model can compute in FP16 \(4 values of its constant 'big' \(up to 1e\+06\), beyond FP16's largest finite value 65504: in FP16 they would be Inf\), so --fp16 would compare it with itself$"):
        to_fp16(model)
    assert to_fp16(model, keep_fp32=["shift"]).kept[0].reason == "selected by --keep-fp32 shift"


@pytest.mark.parametrize("pattern", ["conv2", "Conv", "conv[0-9]"])
def test_keep_fp32_by_name_op_type_or_regex(pattern):
    info = load_model(fixture("clean"))
    kept = {k.node for k in to_fp16(info.proto, keep_fp32=[pattern]).kept}
    assert kept == ({"conv2"} if pattern == "conv2" else {"conv1", "conv2"})


def test_int8_is_symmetric_qdq_with_per_channel_weights():
    info = load_model(fixture("clean"))
    result = to_int8(info.proto, generate_feeds(info.inputs, resolve_shapes(info.inputs, {}), iterations=2))
    ops = [n.op_type for n in result.model.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    zero_points = [numpy_helper.to_array(i) for i in result.model.graph.initializer if i.name.endswith("zero_point")]
    assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)
    weight_scales = [numpy_helper.to_array(i) for i in result.model.graph.initializer if i.name.startswith("c1.w") and "scale" in i.name]
    assert weight_scales and weight_scales[0].size == 8  # one scale per output channel
    assert result.quant_ranges["r1"].high == pytest.approx(127 * result.quant_ranges["r1"].scale)


def test_int8_quantizes_weights_held_by_constant_nodes_per_channel_too():
    """paddle2onnx writes every weight as a Constant node, and ONNX Runtime's quantizer takes such a weight for
    an activation: PP-OCRv4's recognizer got one calibrated scale for each of its 51 weights (a Conv whose
    two values of 22.5 set it rounded 53% of the rest to 0), where this module promises TensorRT's form, a
    scale per channel. The weights held by Constant nodes now get the same candidate as initializers do."""
    info = load_model(fixture("clean"))
    feeds = generate_feeds(info.inputs, resolve_shapes(info.inputs, {}), iterations=2)
    held = onnx.ModelProto()
    held.CopyFrom(info.proto)
    weights = [i for i in held.graph.initializer if i.name.startswith("c1.w")]
    for weight in weights:
        held.graph.initializer.remove(weight)
    held.graph.node.insert(0, onnx.helper.make_node("Constant", [], [weights[0].name], value=weights[0]))
    scales = lambda model: {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("c1.w") and "scale" in i.name}  # noqa: E731
    [(name, scale)] = scales(to_int8(held, feeds).model).items()
    assert scale.size == 8  # one scale per output channel, as of the weight held as an initializer
    assert np.array_equal(scale, scales(to_int8(info.proto, feeds).model)[name])


def test_int8_keep_list_leaves_nodes_unquantized():
    info = load_model(fixture("clean"))
    feeds = generate_feeds(info.inputs, resolve_shapes(info.inputs, {}))
    result = to_int8(info.proto, feeds, keep_fp32=["fc"])
    fc = next(n for n in result.model.graph.node if n.name == "fc")
    assert not any("DequantizeLinear" in i for i in fc.input)
    assert [k.node for k in result.kept] == ["fc"]


@pytest.mark.parametrize("name", [f"per_channel_opset{o}_ir{ir}" for o, ir in [(11, 7), (11, 10), (12, 8), (12, 9)]])
def test_old_opset_models_get_a_valid_int8_candidate_and_fp16_still_works(name, tmp_path):
    """Per-channel DequantizeLinear needs opset 13: the INT8 candidate of an opset 11/12 model is converted,
    and that is said; the FP16 candidate keeps the model's own opset."""
    int8 = accudiff.compare(fixture(name), "int8", candidate="onnxrt", report_dir=tmp_path / "int8")
    assert any("converted to opset 13" in notice for notice in int8.notices)
    candidate = onnx.load(str(tmp_path / "int8" / "candidate-int8.onnx"))
    assert next(o.version for o in candidate.opset_import if o.domain in ("", "ai.onnx")) == 13
    assert any(n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute) for n in candidate.graph.node)
    assert {"conv", "project", "fc"} <= int8.converted
    assert int8.passed and (int8.table["status"] == "pass").all()
    fp16 = accudiff.compare(fixture(name), "fp16", candidate="onnxrt")
    assert fp16.passed and not any("opset" in notice for notice in fp16.notices)
