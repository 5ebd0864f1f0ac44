"""FP32 -> explicit INT8 Q/DQ, in the form TensorRT accepts, through ONNX Runtime's quantization tool.

Settings and why:
* QDQ format, symmetric INT8 activations and weights (zero point 0), per-channel weights: the form
  TensorRT builds from explicit quantization (TensorRT 11 has no implicit INT8 any more);
* only the inputs of Conv/ConvTranspose/MatMul/Gemm are quantized, as TensorRT's INT8 kernels are there:
  not their outputs (the quantizer would add Q/DQ after them by default), and only those ops read the
  quantized copy (the quantizer shares one DQ output with every consumer of a tensor; the other
  consumers are pointed back at the float tensor, so an Add or a Concat never reads INT8 values);
* biases stay FP32 (TensorRT does not read INT32 DequantizeLinear biases).
Node outputs keep their names: ONNX Runtime adds Q/DQ pairs beside the float tensors it quantizes, so
the tensor `x` still holds the producing node's own result and the DQ output carries a new name.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Iterable

import onnx

from accudiff.errors import AccudiffError, first_line
from accudiff.model.inputs import Feed
from accudiff.model.graph import GraphIndex, toposort, writers_of
from accudiff.model.saving import needs_data_file, save_model
from accudiff.model.formats import quant_ranges
from accudiff.transforms.base import KeptNode, NodeSelector, TransformResult
from accudiff.transforms.keep_float import UNDO_ALL, keep_in_float
from accudiff.transforms.opset import with_opset

QUANTIZED_OPS = ["Conv", "ConvTranspose", "MatMul", "Gemm"]
PREQUANTIZED_OPS = frozenset({  # besides QLinear*: what an already-quantized model holds
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "ConvInteger", "MatMulInteger", "DynamicQuantizeLSTM",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "QGemm", "QEmbedLayerNormalization",
})
PER_CHANNEL_OPSET = 13
# What INT8 scales were calibrated on, without --calib-data: random floating inputs, or (a model with none to draw:
# a decoder's prefill is its prompt's tokens and an empty past) the first sample itself.
CALIBRATION_WARNINGS = {
    "random": "INT8 scales were calibrated on random data (integer and bool inputs as in the first sample): pass --calib-data with real "
              "samples, or clipping and resolution errors will not match deployment",
    "first": "INT8 scales were calibrated on the first sample alone (it has no floating-point input to draw at random: a decoder's prefill "
             "is its prompt's tokens): pass --calib-data with more samples (a decoder's: prompts, as --prompts takes them), or clipping and "
             "resolution errors will not match deployment",
}


def to_int8(
    model: onnx.ModelProto,
    calibration_feeds: list[Feed],
    keep_fp32: Iterable[str] = (),
    calibrated_on: str | None = None,
) -> TransformResult:
    """Quantize `model` with Q/DQ nodes calibrated (min/max) on `calibration_feeds`; `calibrated_on`: a key of
    CALIBRATION_WARNINGS where they are not the user's."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class FeedReader(CalibrationDataReader):
        def __init__(self, feeds: list[Feed]):
            self._feeds = iter(feeds)

        def get_next(self) -> Feed | None:
            return next(self._feeds, None)

    import onnxruntime

    onnxruntime.set_default_logger_severity(4)  # the quantizer's calibration sessions log warnings and errors otherwise (errors still raise)
    selector = NodeSelector(keep_fp32)
    excluded = [node.name for node in model.graph.node if selector.matches(node) is not None]
    already = _what_remains_to_quantize(model, excluded)  # before the opset upgrade, which a model with nothing to quantize may not survive
    model, upgraded = with_opset(_weights_as_initializers(model), PER_CHANNEL_OPSET, "per-channel INT8 quantization")
    notices = [*already, *upgraded, *([CALIBRATION_WARNINGS[calibrated_on]] if calibrated_on else [])]
    with tempfile.TemporaryDirectory(prefix="accudiff-int8-") as tmp:
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        save_model(model, source)  # its weights beside it past the threshold: protobuf stops at 2 GB
        try:
            with warnings.catch_warnings(), quiet_root_logger():
                warnings.simplefilter("ignore")
                quantize_static(
                    str(source),
                    str(target),
                    FeedReader(calibration_feeds),
                    quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=QUANTIZED_OPS,
                    per_channel=True,
                    activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    nodes_to_exclude=excluded,
                    use_external_data_format=needs_data_file(model),
                    extra_options={
                        "ActivationSymmetric": True,
                        "WeightSymmetric": True,
                        "QuantizeBias": False,
                        "OpTypesToExcludeOutputQuantization": QUANTIZED_OPS,
                    },
                )
        except Exception as exc:  # the quantizer raises bare exceptions of many kinds
            raise AccudiffError(f"ONNX Runtime's quantization tool could not quantize the model: {first_line(exc)}") from exc
        quantized = onnx.load(str(target))
    toposort(quantized.graph)
    converted = _unshare_quantized_activations(quantized.graph)
    kept = [KeptNode(n.name, n.op_type, f"selected by --keep-fp32 {selector.matches(n)}") for n in model.graph.node if n.name in excluded]
    return TransformResult(
        model=quantized,
        precision="int8",
        kept=kept,
        converted=converted,
        quant_ranges=quant_ranges(GraphIndex.of(quantized.graph)),
        warnings=notices,
    )


def _what_remains_to_quantize(model: onnx.ModelProto, excluded: list[str]) -> list[str]:
    """Check that the INT8 candidate will differ from the model: some float Conv/ConvTranspose/MatMul/Gemm
    is left to quantize, else one sentence says why not. A model with Q/DQ pairs is refused: its own
    quantization is what to measure (without --int8, or with --candidate-model). In a model quantized
    dynamically (ConvInteger, MatMulInteger...), those parts stay as they are on both sides; the notice
    that says so is returned."""
    found: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in PREQUANTIZED_OPS or node.op_type.startswith("QLinear"):
            found[node.op_type] = found.get(node.op_type, 0) + 1
    if found.get("QuantizeLinear") or found.get("DequantizeLinear"):
        pairs = max(found.get("QuantizeLinear", 0), found.get("DequantizeLinear", 0))
        raise AccudiffError(
            f"the model is already quantized ({pairs} Q/DQ nodes): --int8 would quantize only what it left in float and compare that with "
            "the quantized model itself, leaving out what its own quantization costs; to measure that, compare it without --int8 (against "
            "its float form) or against the float model it was made from (accudiff compare float.onnx --candidate-model quantized.onnx)"
        )
    candidates = [node for node in model.graph.node if node.op_type in QUANTIZED_OPS]
    remaining = [node.name for node in candidates if node.name not in excluded]
    ops = "/".join(QUANTIZED_OPS)
    what = ", ".join(f"{count} {op}" for op, count in sorted(found.items(), key=lambda item: -item[1]))
    if not remaining and any(node.name in excluded and node.op_type in QUANTIZED_OPS for node in candidates) and not found:
        return [f"every {ops} node is kept in FP32 (--keep-fp32): the INT8 candidate has nothing quantized"]  # a repair being checked
    if not remaining:
        if found:
            reason = f"is already quantized ({what}) and has no float {ops} left to quantize"
        else:
            reason = f"has no {ops} node (the only nodes --int8 quantizes, as TensorRT's INT8 kernels are there)"
        raise AccudiffError(
            f"the model {reason}, so --int8 would compare it with itself"
            + ("; to measure what its quantization costs, compare the FP32 model it was made from with --int8 --calib-data" if found else "")
        )
    if not found:
        return []
    return [f"the model is already quantized ({what}): those parts run as they are on both sides, and only its {len(remaining)} float {ops} node(s) left were quantized"]


def _unshare_quantized_activations(graph: onnx.GraphProto) -> set[str]:
    """Point every consumer of a quantized activation that is not a quantized op back at the float tensor;
    return the nodes that read quantized values (the quantized ops)."""
    _restore_graph_output_names(graph)
    producer = writers_of(graph.node)
    float_of = {}  # DQ output of an activation -> the float tensor it quantizes
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in producer and producer[node.input[0]].op_type == "QuantizeLinear":
            float_of[node.output[0]] = producer[node.input[0]].input[0]
    converted = set()
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if node.op_type in QUANTIZED_OPS:
            if any(name in float_of or _is_dequantized_weight(name, producer) for name in node.input):
                converted.add(node.name)
            continue
        node.input[:] = [float_of.get(name, name) for name in node.input]
    return converted


def _restore_graph_output_names(graph: onnx.GraphProto) -> None:
    """Where the quantizer quantized a graph output, it renamed the producer's output and gave the output's
    name to the DQ: give the name back to the producer, so the output holds the node's own result."""
    producer = writers_of(graph.node)
    outputs = {o.name for o in graph.output}
    for dequantize in [n for n in graph.node if n.op_type == "DequantizeLinear" and n.output[0] in outputs]:
        quantize = producer.get(dequantize.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear":
            continue
        name, renamed = dequantize.output[0], quantize.input[0]
        dequantized = f"{name}_DequantizeLinear_Output"
        for node in graph.node:
            node.input[:] = [dequantized if i == name else name if i == renamed else i for i in node.input]
            node.output[:] = [name if o == renamed else o for o in node.output]
        dequantize.output[0] = dequantized


def _is_dequantized_weight(name: str, producer: dict[str, onnx.NodeProto]) -> bool:
    node = producer.get(name)
    return node is not None and node.op_type == "DequantizeLinear" and node.input[0] not in producer


@contextlib.contextmanager
def quiet_root_logger():
    """The quantizer logs advice on the root logger; accudiff's own notices say what matters."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _weights_as_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with the weights that Constant nodes hold (paddle2onnx writes every weight so) as initializers
    of the same names: ONNX Runtime's quantizer takes a weight for an activation unless it is an
    initializer, and quantizes it per tensor on its calibrated range, where TensorRT's form (and this
    module's) is a scale per channel. Returned as it is where there are none."""
    weights = {node.input[1] for node in model.graph.node if node.op_type in QUANTIZED_OPS and len(node.input) > 1}
    held = [node for node in model.graph.node if node.op_type == "Constant" and node.output[0] in weights
            and len(node.attribute) == 1 and node.attribute[0].name == "value"]
    if not held:
        return model
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    names = {node.output[0] for node in held}
    for node in held:
        tensor = onnx.TensorProto()
        tensor.CopyFrom(node.attribute[0].t)
        tensor.name = node.output[0]
        moved.graph.initializer.append(tensor)
    kept = [node for node in moved.graph.node if not (node.op_type == "Constant" and node.output[0] in names)]
    del moved.graph.node[:]
    moved.graph.node.extend(kept)
    return moved


def leave_unquantized(quantized: TransformResult, fp32: onnx.ModelProto, nodes: Iterable[str], reason: str, undo: frozenset[str] = UNDO_ALL) -> TransformResult:
    """`quantized` with `nodes` reading their float inputs again, as `to_int8(keep_fp32=nodes)` would make
    it without calibrating anew (calibration runs on the FP32 model, so the other nodes' scales are the
    same): each node reads from before its Q/DQ pairs, its weights `fp32`'s (keep_float.py); of `undo`,
    only its "weights'" pairs, or only its "activations'"."""
    leave = set(nodes) & quantized.converted
    model = keep_in_float(quantized.model, fp32, leave, undo)
    ops = {node.name: node.op_type for node in fp32.graph.node if node.name in leave}
    kept = quantized.kept + [KeptNode(name, ops[name], reason) for name in sorted(leave)]
    return TransformResult(
        model=model, precision="int8", kept=kept, converted=quantized.converted - leave, quant_ranges=quant_ranges(GraphIndex.of(model.graph)), warnings=quantized.warnings
    )
