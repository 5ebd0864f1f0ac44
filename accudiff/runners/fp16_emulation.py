"""Emulate FP16 storage on ONNX Runtime's CPU provider, faithfully.

ONNX Runtime's CPU provider has almost no FP16 kernels. At session creation it rewrites every FP16 region
to FP32 and treats the Casts around it as precision-free, so intermediate values are never rounded to
FP16 (an FP16 overflow inside the region vanishes; even a Cast of a graph input to FP16 is dropped).

So the ONNX Runtime candidate runs a lowered copy of the FP16 model: every FP16 value becomes FP32 and
is rounded to the nearest FP16 value by plain FP32 arithmetic that no optimizer removes:
* normal range: Veltkamp splitting keeps the top 11 significant bits (t = 8193 v; v16 = t - (t - v));
* subnormal range (|v| < 2^-14): (v + 0.75) - 0.75 rounds to a multiple of 2^-24;
* |v| >= 65520 (which rounds past 65504), and Inf itself: +-Inf; NaN stays NaN.
FP16 weights become the same values in FP32. The result: FP16 storage at every tensor, FP32 arithmetic.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FP16 = TensorProto.FLOAT16
FP32 = TensorProto.FLOAT

_SPLITTER = 8193.0  # 2^(24 - 11) + 1
_SUBNORMAL_LIMIT = 2.0**-14
_SUBNORMAL_SHIFT = 0.75  # FP32 spacing in [0.5, 1) is 2^-24, FP16's subnormal step
# |v| >= 65520 (midway between 65504 and 2^16) rounds to Inf; the float32 just below 65520 is 65519.996.
_OVERFLOW_LIMIT = float(np.nextafter(np.float32(65520.0), np.float32(0.0)))
_CONSTANTS = {
    "splitter": _SPLITTER,
    "subnormal_limit": _SUBNORMAL_LIMIT,
    "subnormal_shift": _SUBNORMAL_SHIFT,
    "overflow_limit": _OVERFLOW_LIMIT,
    "infinity": np.inf,
}


def lower_fp16(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """An FP32 model that rounds every former FP16 value to FP16; also the names of those values.

    A model without FP16 values comes back unchanged, with an empty list.
    """
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    graph = inferred.graph
    fp16_values = {vi.name for vi in [*graph.value_info, *graph.output] if vi.type.tensor_type.elem_type == FP16}
    has_fp16 = fp16_values or any(init.data_type == FP16 for init in graph.initializer) or any(
        node.op_type == "Cast" and _cast_target(node) == FP16 for node in graph.node
    )
    if not has_fp16:
        return model, []
    prefix = "accudiff_fp16_emulation/"
    lowered: list[onnx.NodeProto] = []
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FP16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        if node.op_type == "Cast" and _cast_target(node) == FP16:
            lowered += _round_nodes(node.input[0], node.output[0], prefix)
            continue
        if node.op_type == "Cast" and _cast_target(node) == FP32 and node.input[0] in fp16_values:
            lowered.append(helper.make_node("Identity", list(node.input), list(node.output), name=node.name))
            continue
        rounded = [o for o in node.output if o in fp16_values]
        node.output[:] = [o + "__unrounded" if o in fp16_values else o for o in node.output]
        lowered.append(node)
        for out in rounded:
            lowered += _round_nodes(out + "__unrounded", out, prefix)
    del graph.node[:]
    graph.node.extend(lowered)
    for init in graph.initializer:
        if init.data_type == FP16:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    graph.initializer.extend(numpy_helper.from_array(np.array(v, np.float32), prefix + k) for k, v in _CONSTANTS.items())
    for vi in [*graph.value_info, *graph.input, *graph.output]:
        if vi.type.tensor_type.elem_type == FP16:
            vi.type.tensor_type.elem_type = FP32
    del graph.value_info[:]  # stale shapes of renamed values would mislead the runtime
    return inferred, sorted(fp16_values)


def _cast_target(node: onnx.NodeProto) -> int | None:
    return next((attr.i for attr in node.attribute if attr.name == "to"), None)


def _round_nodes(source: str, target: str, prefix: str) -> list[onnx.NodeProto]:
    """Nodes computing `target` = `source` rounded to the nearest FP16 value, in FP32 arithmetic."""
    c = lambda name: prefix + name  # noqa: E731 - shared constant initializers
    t = lambda name: f"{target}__round_{name}"  # noqa: E731 - this tensor's temporaries
    return [
        helper.make_node("Mul", [source, c("splitter")], [t("scaled")]),
        helper.make_node("Sub", [t("scaled"), source], [t("excess")]),
        helper.make_node("Sub", [t("scaled"), t("excess")], [t("normal")]),
        helper.make_node("Add", [source, c("subnormal_shift")], [t("shifted")]),
        helper.make_node("Sub", [t("shifted"), c("subnormal_shift")], [t("subnormal")]),
        helper.make_node("Abs", [source], [t("magnitude")]),
        helper.make_node("Less", [t("magnitude"), c("subnormal_limit")], [t("is_subnormal")]),
        helper.make_node("Where", [t("is_subnormal"), t("subnormal"), t("normal")], [t("finite")]),
        helper.make_node("Greater", [t("magnitude"), c("overflow_limit")], [t("overflows")]),
        helper.make_node("Mul", [source, c("infinity")], [t("infinite")]),
        helper.make_node("Where", [t("overflows"), t("infinite"), t("finite")], [target]),
    ]
