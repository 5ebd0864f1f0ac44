"""Values whose types numpy cannot carry through ONNX Runtime's Python API.

ONNX Runtime refuses to return BF16 to Python, hands FP8 over as raw bytes and takes neither as an input.
A quantized or BF16 model still has such values: the outputs of its QuantizeLinear nodes, its BF16
activations, and so the boundaries of a segment cut between a QuantizeLinear and its DequantizeLinear.
So a marked run returns each such value in a type that holds every value of it exactly (formats.CARRIED_AS:
FP32 for BF16 and FP8, INT8/UINT8 for 4-bit integers), and a graph input of such a type is fed in that
type and narrowed back inside the graph, which is exact too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import onnx

from accudiff.model.formats import CARRIED_AS
from accudiff.model.graph import constant_values, declare_like, value_types
from accudiff.model.shapes import infer_shapes_unless_typed

CARRIED = "__carried"


@dataclass
class Carried:
    """What `carry_in_numpy` changed: the name to mark for each value wanted, the name to feed under for
    each graph input (both only where they differ)."""

    outputs: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)  # graph input of the model as changed -> the value it is fed


def carry_in_numpy(model: onnx.ModelProto, wanted: Sequence[str]) -> Carried:
    """In place: each value of `wanted` whose type numpy cannot carry gets a widening Cast, and each such
    graph input is fed widened under a new name. A model holding no such type anywhere is left as it is
    (and not shape-inferred)."""
    graph = model.graph
    if not _may_hold_uncarried(graph):
        return Carried()
    infer_shapes_unless_typed(model)
    types = value_types(graph)
    declared = {vi.name: vi for vi in [*graph.value_info, *graph.input, *graph.output]}
    front, back, carried = [], [], Carried()
    for vi in graph.input:
        kind = vi.type.tensor_type.elem_type
        if kind in CARRIED_AS:
            original = vi.name
            vi.name, vi.type.tensor_type.elem_type = original + CARRIED, CARRIED_AS[kind]
            carried.inputs[vi.name] = original
            front.append(onnx.helper.make_node("Cast", [vi.name], [original], to=kind))
            declare_like(graph, {original: vi}, original, original, kind)
    for name in wanted:
        kind = types.get(name)
        if kind in CARRIED_AS:
            carried.outputs[name] = name + CARRIED
            back.append(onnx.helper.make_node("Cast", [name], [carried.outputs[name]], to=CARRIED_AS[kind]))
            declare_like(graph, declared, carried.outputs[name], name, CARRIED_AS[kind])
    if front or back:
        nodes = [*front, *graph.node, *back]
        del graph.node[:]
        graph.node.extend(nodes)
    return carried


def _may_hold_uncarried(graph: onnx.GraphProto) -> bool:
    """Whether some value of the graph could be of a type numpy cannot carry (a cheap look, before any shape
    inference, which every session of a quantized model paid: 0.13 s of a MiniLM comparison's worker): a weight,
    input or Cast of one; a QuantizeLinear or DequantizeLinear with an `output_dtype` of one, or typed by a scale
    or zero point that is not a constant (one of those types is a weight of that type, seen here)."""
    constants = constant_values(graph)
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and any(name and name not in constants for name in node.input[1:]):
            return True
        if any(a.name == ("to" if node.op_type == "Cast" else "output_dtype") and a.i in CARRIED_AS for a in node.attribute):
            return True
    declared = [vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.value_info]]
    return any(kind in CARRIED_AS for kind in declared) or any(t.data_type in CARRIED_AS for t in constants.values())
