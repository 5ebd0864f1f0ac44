"""Quantized ops as ONNX Runtime's tools write them (model/quantized_ops.py), on small models the real tools
quantize: quantize_dynamic (MatMul, Conv with a bias, Gather; and the fused forms ONNX Runtime makes of them
in a saved optimized model), MatMulNBitsQuantizer (2, 4 and 8 bits, with zero points or not, accuracy_level
4; Gathers as GatherBlockQuantized) and, with torch, quantize_dynamic's LSTM. For each: the op is
recognised and the run named in its format; keeping every op gives the float model back; its weights as
accudiff dequantizes them give ONNX Runtime's own kernel back; the switchboard is keep_in_float's variants,
bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from accudiff.model.formats import model_formats, precision_label
from accudiff.model.graph import GraphIndex
from accudiff.model.quantized_ops import find_quantized_ops
from accudiff.model.shapes import infer_shapes_in_place
from accudiff.transforms.keep_float import UNDO_ALL, keep_in_float
from accudiff.transforms.switches import build_candidate_switchboard
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import models  # noqa: E402

RNG = np.random.default_rng(3)
FEED = {"x": RNG.normal(size=(2, 5, 64)).astype(np.float32), "ids": RNG.integers(0, 100, (2, 5)).astype(np.int64),
        "image": RNG.normal(size=(1, 3, 8, 8)).astype(np.float32)}
OUTPUTS = ("y", "v", "e", "u", "z", "c")


def _float_model(path: Path) -> Path:
    """x @ W and x @ V (MatMuls reading one activation: ONNX Runtime fuses them into MatMulIntegerToFloat), a
    Gather from a table E and e @ U (reading the table's codes), y @ Z (alone on its activation:
    DynamicQuantizeMatMul), and a Conv with a bias: each op the quantizers take."""
    weights = {"W": RNG.normal(size=(64, 48)), "V": RNG.normal(size=(64, 16)), "E": RNG.normal(size=(100, 64)), "U": RNG.normal(size=(64, 8)), "Z": RNG.normal(size=(48, 8)),
               "C": RNG.normal(size=(8, 3, 3, 3)), "b": RNG.normal(size=8)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"), helper.make_node("MatMul", ["x", "V"], ["v"], name="mm2"),
             helper.make_node("Gather", ["E", "ids"], ["e"], name="emb"), helper.make_node("MatMul", ["e", "U"], ["u"], name="mm3"),
             helper.make_node("MatMul", ["y", "Z"], ["z"], name="mm4"),
             helper.make_node("Conv", ["image", "C", "b"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 64]), helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5]),
         helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in OUTPUTS],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


def _nbits(source: Path, target: Path, bits: int, symmetric: bool, accuracy_level: int | None) -> Path:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    with models._quiet():
        quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=bits, block_size=32, is_symmetric=symmetric, accuracy_level=accuracy_level,
                                         op_types_to_quantize=("MatMul", "Gather"), quant_axes=(("MatMul", 0), ("Gather", 1)))
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    return target


def _fused_dynamic(source: Path, target: Path) -> Path:
    """The dynamic candidate as ONNX Runtime's session optimizes it (DynamicQuantizeMatMul/MatMulIntegerToFloat), saved."""
    dynamic = models.onnxruntime_dynamic(source, target.with_name("dynamic-to-fuse.onnx"))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    ort.InferenceSession(str(dynamic), options, providers=["CPUExecutionProvider"])
    return target


ALL = {"mm", "mm2", "mm3", "mm4", "emb", "conv"}
CANDIDATES = {  # name -> (how it is made, the formats it holds, the float ops it quantizes, op types its tool wrote among them)
    "dynamic": (lambda s, t: models.onnxruntime_dynamic(s, t), ["int8-dynamic", "int8-weight"], ALL, {"MatMulInteger", "ConvInteger"}),
    "fused dynamic": (_fused_dynamic, ["int8-dynamic", "int8-weight"], ALL, {"MatMulIntegerToFloat", "DynamicQuantizeMatMul", "ConvInteger"}),
    "nbits 4 symmetric": (lambda s, t: _nbits(s, t, 4, True, None), ["int4-weight"], ALL - {"conv"}, {"MatMulNBits", "GatherBlockQuantized"}),
    "nbits 4 zero points": (lambda s, t: _nbits(s, t, 4, False, None), ["int4-weight"], ALL - {"conv"}, {"MatMulNBits", "GatherBlockQuantized"}),
    "nbits 8": (lambda s, t: _nbits(s, t, 8, False, None), ["int8-weight"], {"mm", "mm2", "mm3", "mm4"}, {"MatMulNBits"}),  # its Gathers take 4 bits only
    "nbits 2": (lambda s, t: _nbits(s, t, 2, False, None), ["int2-weight"], {"mm", "mm2", "mm3", "mm4"}, {"MatMulNBits"}),
    "nbits 4 accuracy level 4": (lambda s, t: _nbits(s, t, 4, True, 4), ["int8-dynamic", "int4-weight"], ALL - {"conv"}, {"MatMulNBits", "GatherBlockQuantized"}),
}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return _float_model(tmp_path_factory.mktemp("small") / "small.onnx")


def _run(model: onnx.ModelProto | Path, feed=FEED, outputs=OUTPUTS) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return session.run(list(outputs), {k: v for k, v in feed.items() if k in wanted})


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_each_form_is_recognised_named_and_undone(small, name, tmp_path):
    make, formats, quantized, op_types = CANDIDATES[name]
    candidate = make(small, tmp_path / f"{name.replace(' ', '-')}.onnx")
    proto, reference = onnx.load(str(candidate)), onnx.load(str(small))
    ops = find_quantized_ops(GraphIndex.of(proto.graph), GraphIndex.of(reference.graph))
    written = {n.op_type for n in proto.graph.node if n.name in {m for op in ops for m in op.members}}
    assert {op.node for op in ops} == quantized and op_types <= written, written  # named as the float model names them
    assert model_formats(proto.graph) == formats and precision_label(formats) == "+".join(formats)
    # Every op kept, with the float model's weights: the float model again.
    back = keep_in_float(proto, reference, [op.node for op in ops])
    for got, want in zip(_run(back), _run(small)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Every op as its float op on its own dequantized weights, activations float: ONNX Runtime's kernels where
    # they quantize nothing else (weights alone), the same to a few rounding of its scales.
    if "int8-dynamic" not in formats:
        own = keep_in_float(proto, None, [op.node for op in ops], UNDO_ALL - {"weights"})
        for got, want in zip(_run(own), _run(candidate)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["nbits 4 zero points", "dynamic"])
def test_weights_dequantized_into_a_value_file_compute_what_they_do_in_memory(small, name, tmp_path):
    """Verification's loss split keeps ops on their own dequantized weights: held in memory, MiniLM's were
    twice 21 MB of its caller at its peak (the array and its TensorProto). Written to a value file as they are
    made, the model refers to them there, computes the same, and the next variant reads the ones written."""
    from accudiff.model.saving import save_model
    from accudiff.model.value_file import ValueFile
    from accudiff.model.weights import is_external

    candidate = CANDIDATES[name][0](small, tmp_path / "candidate.onnx")
    proto, reference = onnx.load(str(candidate)), onnx.load(str(small))
    nodes = [op.node for op in find_quantized_ops(GraphIndex.of(proto.graph), GraphIndex.of(reference.graph))]
    undo = frozenset({"activations"}) if name == "dynamic" else UNDO_ALL - {"weights"}  # each keeps its weights quantized
    values = ValueFile(tmp_path / "trials")
    held = keep_in_float(proto, None, nodes, undo)
    written = keep_in_float(proto, None, nodes, undo, values)
    dequantized = [init for init in written.graph.initializer if init.name.endswith("__dequantized")]
    assert dequantized and all(is_external(init) for init in dequantized)
    size = (tmp_path / "trials" / values.name).stat().st_size
    save_model(written, tmp_path / "trials" / "variant.onnx")
    for got, want in zip(_run(tmp_path / "trials" / "variant.onnx"), _run(held)):
        np.testing.assert_array_equal(got, want)
    keep_in_float(proto, None, nodes[:1], undo, values)
    assert (tmp_path / "trials" / values.name).stat().st_size == size


@pytest.mark.parametrize("name", ["dynamic", "nbits 4 zero points", "fused dynamic"])
def test_the_switchboard_is_keep_in_float_bit_for_bit(small, name, tmp_path):
    make = CANDIDATES[name][0]
    candidate = onnx.load(str(make(small, tmp_path / "candidate.onnx")))
    reference = onnx.load(str(small))
    nodes = [op.node for op in find_quantized_ops(GraphIndex.of(candidate.graph), GraphIndex.of(reference.graph))]
    board = build_candidate_switchboard(candidate, reference, nodes)
    for keep in ([], nodes[:1], nodes):
        switched = {**FEED, **{k: np.asarray(v) for k, v in board.settings(keep).items()}}
        expected = _run(keep_in_float(candidate, reference, keep) if keep else candidate)
        for got, want in zip(_run(board.model, switched), expected):
            np.testing.assert_array_equal(got, want)


def test_quantize_dynamics_lstm_is_undone(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch (the LSTM is exported from torch)")
    path = tmp_path / "lstm.onnx"
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(16, 32, batch_first=True)
    with models._quiet(), torch.no_grad():
        torch.onnx.export(lstm, (torch.randn(1, 7, 16),), str(path), input_names=["x"], output_names=["y", "h", "c"], dynamo=False, opset_version=17)
    candidate = models.onnxruntime_dynamic(path, tmp_path / "lstm-dynamic.onnx")
    proto, reference = onnx.load(str(candidate)), onnx.load(str(path))
    [op] = find_quantized_ops(GraphIndex.of(proto.graph), GraphIndex.of(reference.graph))
    assert op.op_type == "LSTM" and model_formats(proto.graph) == ["int8-dynamic"]
    feed = {"x": RNG.normal(size=(1, 7, 16)).astype(np.float32)}
    back = keep_in_float(proto, reference, [op.node])
    for got, want in zip(_run(back, feed, ("y", "h", "c")), _run(path, feed, ("y", "h", "c"))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_onnx_runtime_types_what_onnx_leaves_untyped(small, tmp_path):
    """ONNX's shape inference does not know com.microsoft ops: everything after a MatMulNBits was untyped, and
    a segment cut there failed to load ('does not have type information')."""
    proto = onnx.load(str(_nbits(small, tmp_path / "nbits.onnx", 4, True, None)))
    infer_shapes_in_place(proto)
    typed = {vi.name: vi.type.tensor_type.elem_type for vi in proto.graph.value_info}
    produced = [o for node in proto.graph.node for o in node.output if o not in {g.name for g in proto.graph.output}]
    assert all(typed.get(o) for o in produced), [o for o in produced if not typed.get(o)]


@pytest.mark.parametrize("name", ["dynamic", "nbits 4 symmetric"])
def test_undoing_only_the_activations_leaves_weight_only_ops_as_they_are(small, name, tmp_path):
    """The loss split's "activations alone": an op that quantizes no activation (a quantized Gather, MatMulNBits
    at its default accuracy) has nothing to undo, so it stays as the model has it: its codes are not
    dequantized into a float table (MiniLM's embedding: 47 MB written for each split), and it computes as before."""
    from accudiff.transforms.keep_float import PARTS

    make = CANDIDATES[name][0]
    candidate = onnx.load(str(make(small, tmp_path / "candidate.onnx")))
    reference = onnx.load(str(small))
    ops = find_quantized_ops(GraphIndex.of(candidate.graph), GraphIndex.of(reference.graph))
    split = keep_in_float(candidate, reference, [op.node for op in ops], PARTS["activations"])
    weight_only = [op for op in ops if not op.quantizes_activation]
    assert weight_only
    assert all(m in {n.name for n in split.graph.node} for op in weight_only for m in op.members)
    assert not any("dequantized" in init.name for init in split.graph.initializer if any(init.name.startswith(op.weights[0].codes) for op in weight_only))
    unchanged = [OUTPUTS.index(op.outputs[0]) for op in weight_only if op.outputs[0] in OUTPUTS]
    for index, (got, want) in enumerate(zip(_run(split), _run(candidate))):
        if index in unchanged:
            np.testing.assert_array_equal(got, want)


def test_undoing_only_the_activations_of_matmulnbits_at_accuracy_level_4_keeps_its_own_weights(small, tmp_path):
    """MatMulNBits at accuracy_level 4 quantizes its activation to INT8: undoing that alone is the same node at
    accuracy_level 0 (its INT4 weights as they are, no copy of them), which computes what the float MatMul of
    its dequantized weights does."""
    from accudiff.transforms.keep_float import PARTS

    candidate = onnx.load(str(CANDIDATES["nbits 4 accuracy level 4"][0](small, tmp_path / "candidate.onnx")))
    reference = onnx.load(str(small))
    ops = [op for op in find_quantized_ops(GraphIndex.of(candidate.graph), GraphIndex.of(reference.graph)) if op.quantizes_activation]
    assert ops
    split = keep_in_float(candidate, reference, [op.node for op in ops], PARTS["activations"])
    nodes = {n.name: n for n in split.graph.node}
    for op in ops:
        node = nodes[op.node]
        assert node.op_type == "MatMulNBits" and next(a.i for a in node.attribute if a.name == "accuracy_level") == 0
    assert not any("dequantized" in init.name for init in split.graph.initializer)
    from accudiff.model.graph import constant_values
    from accudiff.model.quantized_weights import float_weight

    [x_w] = [op for op in ops if op.outputs[0] == "y"]  # x @ W
    expected = FEED["x"] @ float_weight(x_w.weights[0], constant_values(candidate.graph))
    np.testing.assert_allclose(_run(split)[OUTPUTS.index("y")], expected, rtol=1e-5, atol=1e-4)


def test_blocks_a_large_value_flattens_are_found_on_the_packed_codes(tmp_path):
    """A weight with one large value in most blocks of 32, quantized to 4 bits by MatMulNBitsQuantizer: the
    block_scale finding names the node; counted on the packed codes (no weight dequantized: a 1.1B decoder's
    took 22 s), each block's share of zeros is the dequantized weight's."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from accudiff.model.graph import constant_values
    from accudiff.model.quantized_weights import _nbits_zero_shares, float_weight, quantized_weight_findings, weight_values

    weight = RNG.normal(0, 0.01, (64, 32)).astype(np.float32)
    weight[::32][:, ::2] = 50.0  # the first row of each block of K, in half the columns: their step is set by it
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="spiky")], "g", [helper.make_tensor_value_info("x", 1, [2, 64])],
                              [helper.make_tensor_value_info("y", 1, [2, 32])], [numpy_helper.from_array(weight, "W")])
    quantizer = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), bits=4, block_size=32, is_symmetric=True)
    quantizer.process()
    quantized = quantizer.model.model
    [op] = find_quantized_ops(GraphIndex.of(quantized.graph), GraphIndex.of(graph))
    constants = constant_values(quantized.graph)
    fast = _nbits_zero_shares(op.weights[0], weight_values(constants[op.weights[0].codes]))
    values = float_weight(op.weights[0], constants)
    assert np.array_equal(fast, (values.T.reshape(32, -1, 32) == 0).mean(axis=-1))
    kind, said = quantized_weight_findings([op], GraphIndex.of(quantized.graph), GraphIndex.of(graph))()["spiky"]
    assert kind == "block_scale" and "32 of its 64 blocks" in said
