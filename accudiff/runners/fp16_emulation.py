"""Emulate FP16 (and BF16) storage on ONNX Runtime's CPU provider, faithfully.

ONNX Runtime's CPU provider has almost no FP16 kernels. At session creation it rewrites every FP16 region
to FP32 and treats the Casts around it as precision-free, so intermediate values are never rounded to
FP16 (an FP16 overflow inside the region vanishes; even a Cast of a graph input to FP16 is dropped).

So the ONNX Runtime candidate runs a lowered copy of the FP16 model: every FP16 value becomes FP32 and
passes through an explicit Cast to FP16 and back. In an all-FP32 graph ONNX Runtime keeps such a pair,
so each value is really rounded (nearest-even, subnormals, overflow to Inf) while arithmetic stays FP32.
FP16 weights become the same values in FP32 (a Cast, folded at load when ONNX Runtime optimizes the
session). BF16 values are lowered the same way, through Casts to BF16 and back (ONNX Runtime's CPU provider
has them, and few BF16 kernels else).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from accudiff.model.graph import cast_target

from accudiff.model.shapes import infer_shapes_unless_typed

FP16, BF16 = TensorProto.FLOAT16, TensorProto.BFLOAT16
FP32 = TensorProto.FLOAT
HALF_TYPES = (FP16, BF16)


def lower_fp16(model: onnx.ModelProto) -> dict[str, str]:
    """Lower `model` in place to FP32 with FP16 (or BF16) rounding at every former FP16 (BF16) value; return,
    for each FP16 value, the name of its FP16 copy (`fp16_name`): marking that copy as output returns the
    value as FP16 at no extra cost (a BF16 value is returned as it is, rounded and held in FP32). Such graph
    inputs keep their type and are widened by a Cast inside the graph, so they are fed without a copy (a
    segment's boundary). A model without FP16 or BF16 values is left unchanged, and the mapping is empty.
    """
    infer_shapes_unless_typed(model)
    graph = model.graph
    halves = {vi.name: kind for vi in [*graph.value_info, *graph.output] if (kind := vi.type.tensor_type.elem_type) in HALF_TYPES}
    has_halves = halves or any(init.data_type in HALF_TYPES for init in graph.initializer) or any(
        node.op_type == "Cast" and cast_target(node) in HALF_TYPES for node in graph.node
    )
    if not has_halves:
        return {}
    half_inputs = {vi.name for vi in graph.input if vi.type.tensor_type.elem_type in HALF_TYPES}
    lowered: list[onnx.NodeProto] = [_cast(name, name + "__as_fp32", FP32) for name in half_inputs]
    for node in graph.node:
        node.input[:] = [name + "__as_fp32" if name in half_inputs else name for name in node.input]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in HALF_TYPES:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        if node.op_type == "Cast" and cast_target(node) in HALF_TYPES:
            lowered += _round_nodes(node.input[0], node.output[0], cast_target(node))
            continue
        if node.op_type == "Cast" and cast_target(node) == FP32 and node.input[0] in halves:
            lowered.append(helper.make_node("Identity", list(node.input), list(node.output), name=node.name))
            continue
        rounded = [o for o in node.output if o in halves]
        node.output[:] = [o + "__unrounded" if o in halves else o for o in node.output]
        lowered.append(node)
        for out in rounded:
            lowered += _round_nodes(out + "__unrounded", out, halves[out])
    del graph.node[:]
    graph.node.extend(_widen_half_weights(graph) + lowered)
    for vi in graph.output:  # such graph inputs keep their type: their values are fed as they are, and widened in the graph
        if vi.type.tensor_type.elem_type in HALF_TYPES:
            vi.type.tensor_type.elem_type = FP32
    del graph.value_info[:]  # stale shapes of renamed values would mislead the runtime
    return {name: fp16_name(name) for name, kind in halves.items() if kind == FP16}


def _widen_half_weights(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """FP16 and BF16 weights become FP32 by a Cast each (folded at load when ONNX Runtime optimizes the
    session; the Casts are returned): their data is never read or copied here, wherever it lives (a data
    file, or the model)."""
    casts = []
    for init in graph.initializer:
        if init.data_type in HALF_TYPES:
            casts.append(_cast(init.name + "__half", init.name, FP32))
            init.name += "__half"
    return casts


def fp16_name(value: str) -> str:
    return value + "__as_fp16"


def _round_nodes(source: str, target: str, half: int) -> list[onnx.NodeProto]:
    """`target` = `source` rounded to the nearest FP16 (BF16) value, and held in FP32."""
    stored = fp16_name(target) if half == FP16 else target + "__as_bf16"
    return [_cast(source, stored, half), _cast(stored, target, FP32)]


_CAST_TO = {to: helper.make_attribute("to", to) for to in (FP16, BF16, FP32)}


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    """A Cast node, built directly: a lowered model has one or two per value, and onnx.helper.make_node
    checks each attribute's type at several times the cost."""
    return onnx.NodeProto(op_type="Cast", input=[source], output=[target], attribute=[_CAST_TO[to]])
