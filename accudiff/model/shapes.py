"""Shape inference without copying weights: large weights are declared as typed inputs to a light copy,
small ones (their values matter for shape arithmetic) go along."""

from __future__ import annotations

from typing import Iterable, Mapping

import onnx

from accudiff.model.contrib_ops import is_onnxruntime_op
from accudiff.model.graph import attribute_graphs, copy_without_initializers, tensor_bytes


# Initializers up to this size are kept for shape inference (shape arithmetic reads their values).
SMALL_INITIALIZER_BYTES = 4096


def clear_unknown_dims(proto: onnx.ModelProto) -> None:
    """Graph input and output sizes written as -1 or 0 mean "unknown" (Paddle and TensorFlow exports):
    make them plain unknown dimensions, so shape inference, the candidate model and TensorRT's parser
    see them as dynamic rather than as a fixed size."""
    for vi in [*proto.graph.input, *proto.graph.output]:
        for dim in vi.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value <= 0:
                dim.Clear()


def infer_shapes_unless_typed(proto: onnx.ModelProto) -> None:
    """`infer_shapes_in_place`, unless every value the graph's nodes produce already has its type: the
    models accudiff builds from an inferred one (candidates, their segments) carry their types, and
    inference on them again cost more than cutting them (0.1-0.25 s a model on the PP-OCRv4 recognizer)."""
    typed = {vi.name for vi in [*proto.graph.value_info, *proto.graph.output] if vi.type.tensor_type.elem_type}
    if any(o and o not in typed for node in proto.graph.node for o in node.output):
        infer_shapes_in_place(proto)


def infer_shapes_in_place(proto: onnx.ModelProto) -> None:
    """Replace `proto`'s value_info with inferred types and shapes, without copying its weights.

    Inference runs on a copy that holds the graph and the small weights (their values matter for shape
    arithmetic); large ones are declared as typed inputs (see `shape_inference_copy`). On failure the
    model keeps what it had: shapes are a convenience, and dtypes also come back from the runs themselves.
    """
    constants = _weight_constants(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(shape_inference_copy(proto), strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError):
        return
    found = {vi.name: vi for vi in _known(inferred.graph.value_info)}
    found.update((name, onnx.helper.make_tensor_value_info(name, w.data_type, list(w.dims))) for name, w in constants.items())
    found.update(_typed_by_onnxruntime(inferred, found))
    produced = [o for node in proto.graph.node for o in node.output if o in found]  # in the order inference gives them
    by_nodes = set(produced)
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(found[name] for name in [*(n for n in found if n not in by_nodes), *produced])
    _copy_body_value_info([node for node in proto.graph.node if not _is_one_of(node, constants)], inferred.graph.node)


def shape_inference_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for shape inference: the graph and the small weights (their values matter for shape
    arithmetic); the large ones, initializers or Constant nodes, declared as typed inputs (their shapes
    matter, their values are not copied: the PP-OCRv4 recognizer's 10 MB of Constants, copied, serialized
    and read back, made inference three times slower)."""
    constants = _weight_constants(proto)
    light = copy_without_initializers(proto, keep_node=lambda node: not _is_one_of(node, constants))
    declared = {i.name for i in light.graph.input}
    for init in proto.graph.initializer:
        if tensor_bytes(init) <= SMALL_INITIALIZER_BYTES:
            light.graph.initializer.append(init)
        elif init.name not in declared:
            light.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    light.graph.input.extend(onnx.helper.make_tensor_value_info(name, weight.data_type, list(weight.dims)) for name, weight in constants.items())
    return light


def _typed_by_onnxruntime(inferred: onnx.ModelProto, found: Mapping[str, onnx.ValueInfoProto]) -> dict[str, onnx.ValueInfoProto]:
    """Types and shapes ONNX's inference leaves out, as ONNX Runtime infers them: it knows its contrib ops
    (MatMulNBits, Attention, SkipLayerNormalization...), whose outputs, and everything after them, ONNX
    leaves untyped. A session is made, not run, on the weightless copy with those values as outputs
    (graph optimizations off: about 0.02 s on a transformer); {} when there are none, or when ONNX Runtime
    refuses the copy (the runs then say what is wrong)."""
    graph = inferred.graph
    typed = {*found, *(vi.name for vi in [*graph.input, *graph.output])}
    untyped = [o for node in graph.node for o in node.output if o and o not in typed]
    if not untyped or not any(is_onnxruntime_op(node) for node in graph.node):
        return {}
    import onnxruntime

    probe = onnx.ModelProto()
    probe.CopyFrom(inferred)
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in untyped)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # its own lines stay off the console
    try:
        session = onnxruntime.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - types are a convenience: the runs report what ONNX Runtime refuses, in one sentence
        return {}
    wanted = set(untyped)
    declared = {}
    for value in session.get_outputs():
        kind = ONNXRUNTIME_TYPES.get(value.type)
        if value.name in wanted and kind is not None:
            shape = [d if isinstance(d, int) else None for d in value.shape] if value.shape is not None else None
            declared[value.name] = onnx.helper.make_tensor_value_info(value.name, kind, shape)
    return declared


# ONNX Runtime's type strings ("tensor(float)") as ONNX element types.
ONNXRUNTIME_TYPES = {f"tensor({name})": kind for name, kind in {
    "float": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16, "double": onnx.TensorProto.DOUBLE,
    "int8": onnx.TensorProto.INT8, "uint8": onnx.TensorProto.UINT8, "int16": onnx.TensorProto.INT16, "uint16": onnx.TensorProto.UINT16,
    "int32": onnx.TensorProto.INT32, "uint32": onnx.TensorProto.UINT32, "int64": onnx.TensorProto.INT64, "uint64": onnx.TensorProto.UINT64,
    "bool": onnx.TensorProto.BOOL,
}.items()}


def _weight_constants(proto: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """The values of the main graph's Constant nodes that hold weights (larger than SMALL_INITIALIZER_BYTES,
    and not graph outputs), by the value's name: what Paddle's exports hold their weights in, instead of
    initializers."""
    outputs = {o.name for o in proto.graph.output}
    return {
        node.output[0]: node.attribute[0].t
        for node in proto.graph.node
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1 and node.attribute[0].name == "value"
        and node.output[0] not in outputs and tensor_bytes(node.attribute[0].t) > SMALL_INITIALIZER_BYTES
    }


def _is_one_of(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> bool:
    return node.op_type == "Constant" and node.output[0] in constants


def _known(value_info: Iterable[onnx.ValueInfoProto]) -> list[onnx.ValueInfoProto]:
    """Entries whose element type inference could not tell (0) say nothing, and ONNX Runtime refuses them."""
    return [vi for vi in value_info if not (vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == 0)]


def _copy_body_value_info(nodes: Iterable[onnx.NodeProto], inferred: Iterable[onnx.NodeProto]) -> None:
    """Inferred types inside If/Loop/Scan bodies too: the FP16 transform converts bodies by them."""
    for node, done in zip(nodes, inferred):
        for attr, attr_done in zip(node.attribute, done.attribute):
            for body, body_done in zip(attribute_graphs(attr), attribute_graphs(attr_done)):
                del body.value_info[:]
                body.value_info.extend(_known(body_done.value_info))
                _copy_body_value_info(body.node, body_done.node)
