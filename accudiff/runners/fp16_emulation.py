"""Emulate FP16 storage on ONNX Runtime's CPU provider, faithfully.

ONNX Runtime's CPU provider has almost no FP16 kernels. At session creation it rewrites every FP16 region
to FP32 and treats the Casts around it as precision-free, so intermediate values are never rounded to
FP16 (an FP16 overflow inside the region vanishes; even a Cast of a graph input to FP16 is dropped).

So the ONNX Runtime candidate runs a lowered copy of the FP16 model: every FP16 value becomes FP32 and
passes through an explicit Cast to FP16 and back. In an all-FP32 graph ONNX Runtime keeps such a pair,
so each value is really rounded (nearest-even, subnormals, overflow to Inf) while arithmetic stays FP32.
FP16 weights become the same values in FP32 (a Cast, folded at load when ONNX Runtime optimizes the
session).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from accudiff.model.loading import cast_target, infer_shapes_unless_typed

FP16 = TensorProto.FLOAT16
FP32 = TensorProto.FLOAT


def lower_fp16(model: onnx.ModelProto) -> dict[str, str]:
    """Lower `model` in place to FP32 with FP16 rounding at every former FP16 value; return, for each such
    value, the name of its FP16 copy (`fp16_name`): marking that copy as output returns the value as FP16
    at no extra cost. FP16 graph inputs keep their type and are widened by a Cast inside the graph, so
    FP16 values (a segment's boundary) are fed without a copy. A model without FP16 values is left
    unchanged, and the mapping is empty.
    """
    infer_shapes_unless_typed(model)
    graph = model.graph
    fp16_values = {vi.name for vi in [*graph.value_info, *graph.output] if vi.type.tensor_type.elem_type == FP16}
    has_fp16 = fp16_values or any(init.data_type == FP16 for init in graph.initializer) or any(
        node.op_type == "Cast" and cast_target(node) == FP16 for node in graph.node
    )
    if not has_fp16:
        return {}
    fp16_inputs = {vi.name for vi in graph.input if vi.type.tensor_type.elem_type == FP16}
    lowered: list[onnx.NodeProto] = [_cast(name, name + "__as_fp32", FP32) for name in fp16_inputs]
    for node in graph.node:
        node.input[:] = [name + "__as_fp32" if name in fp16_inputs else name for name in node.input]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FP16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        if node.op_type == "Cast" and cast_target(node) == FP16:
            lowered += _round_nodes(node.input[0], node.output[0])
            continue
        if node.op_type == "Cast" and cast_target(node) == FP32 and node.input[0] in fp16_values:
            lowered.append(helper.make_node("Identity", list(node.input), list(node.output), name=node.name))
            continue
        rounded = [o for o in node.output if o in fp16_values]
        node.output[:] = [o + "__unrounded" if o in fp16_values else o for o in node.output]
        lowered.append(node)
        for out in rounded:
            lowered += _round_nodes(out + "__unrounded", out)
    del graph.node[:]
    graph.node.extend(_widen_fp16_weights(graph) + lowered)
    for vi in graph.output:  # FP16 graph inputs stay FP16: FP16 values are fed as they are, and widened in the graph
        if vi.type.tensor_type.elem_type == FP16:
            vi.type.tensor_type.elem_type = FP32
    del graph.value_info[:]  # stale shapes of renamed values would mislead the runtime
    return {name: fp16_name(name) for name in fp16_values}


def _widen_fp16_weights(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """FP16 weights become FP32 by a Cast each (folded at load when ONNX Runtime optimizes the session; the
    Casts are returned): their data is never read or copied here, wherever it lives (a data file, or the
    model)."""
    casts = []
    for init in graph.initializer:
        if init.data_type == FP16:
            casts.append(_cast(init.name + "__fp16", init.name, FP32))
            init.name += "__fp16"
    return casts


def fp16_name(value: str) -> str:
    return value + "__as_fp16"


def _round_nodes(source: str, target: str) -> list[onnx.NodeProto]:
    """`target` = `source` rounded to the nearest FP16 value, and held in FP32."""
    return [_cast(source, fp16_name(target), FP16), _cast(fp16_name(target), target, FP32)]


_CAST_TO = {to: helper.make_attribute("to", to) for to in (FP16, FP32)}


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    """A Cast node, built directly: a lowered model has one or two per value, and onnx.helper.make_node
    checks each attribute's type at several times the cost."""
    return onnx.NodeProto(op_type="Cast", input=[source], output=[target], attribute=[_CAST_TO[to]])
