"""Isolated error: what each node gets wrong by itself, when fed the reference's values.

One model does it for every node at once: in a copy of the candidate model, every read of a compared
tensor is redirected to a new graph input `<tensor>__reference`, fed with the reference's value and read
in the type that node reads it in (an FP16 node reads it rounded to FP16, an FP32 node reads it exact; an
INT8 node reads it through its Q/DQ pair). Each node then computes from exact inputs, so its output's error is
its own, as if it alone ran in reduced precision — one extra candidate run, not one per node.
Accumulated error (the normal run) next to isolated error tells inherited error from local error.
"""

from __future__ import annotations

from typing import Mapping

import onnx

from accudiff.model.graph import declare_like

from accudiff.model.shapes import infer_shapes_unless_typed

SUFFIX = "__reference"


def isolate_in_place(candidate: onnx.ModelProto, tensors: Mapping[str, int], storage_copies: Mapping[str, str] | None = None) -> dict[str, str]:
    """Redirect the candidate's node inputs to reference-fed graph inputs, in place.

    `tensors`: the compared tensors and their element type in the reference. Each becomes a graph input
    `<tensor>__reference` of that type, fed the reference's value as it is; a node that reads the tensor
    in another type (its candidate storage, or a copy the transform made: `storage_copies`, e.g. the FP16
    copy of a value an FP32 node produced) reads it through a Cast in the graph, so it sees exactly what
    it sees in the candidate. Returns, for each new input, the reference tensor it is fed from.
    """
    infer_shapes_unless_typed(candidate)
    graph = candidate.graph
    source_of = {name: name for name in tensors}
    source_of.update({copy: source for copy, source in (storage_copies or {}).items() if source in tensors})
    values = {vi.name: vi for vi in [*graph.value_info, *graph.output, *graph.input]}
    declared = {name: vi.type.tensor_type for name, vi in values.items()}
    types = {name: kind.elem_type for name, kind in declared.items()}
    fed: dict[str, str] = {}
    casts: dict[tuple[str, int], str] = {}
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name not in source_of or not types.get(name):
                continue
            source = source_of[name]
            reference_input = source + SUFFIX
            fed[reference_input] = source
            read_type = types[name]
            if read_type == tensors[source]:
                node.input[index] = reference_input
                continue
            if (source, read_type) not in casts:
                casts[(source, read_type)] = f"{reference_input}_as_{onnx.TensorProto.DataType.Name(read_type).lower()}"
                new_nodes.append(onnx.helper.make_node("Cast", [reference_input], [casts[(source, read_type)]], to=read_type))
                declare_like(graph, values, casts[(source, read_type)], source, read_type)
            node.input[index] = casts[(source, read_type)]
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)  # each Cast sits right before its first reader
    for name, source in fed.items():  # shaped as the value it replaces: a Scan reading it needs the shape
        shape = declared[source].shape if source in declared and declared[source].HasField("shape") else None
        reference_input = onnx.helper.make_tensor_value_info(name, tensors[source], None)
        if shape is not None:
            reference_input.type.tensor_type.shape.CopyFrom(shape)
        graph.input.append(reference_input)
    return fed
