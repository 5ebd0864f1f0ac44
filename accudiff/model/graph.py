"""Small graph utilities the transforms share: one index of a graph (producers, readers, types, constants),
copies without weights, typed declarations, every node including If/Loop/Scan bodies, topological order,
a tensor's size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import onnx

from accudiff.model.weights import PACKED_BITS, is_external

UNCHECKED_TYPES = {
    getattr(onnx.TensorProto, name)
    for name in ("UNDEFINED", "STRING", "COMPLEX64", "COMPLEX128", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
}


def cast_target(node: onnx.NodeProto) -> int | None:
    """The element type a Cast node converts to."""
    return next((attr.i for attr in node.attribute if attr.name == "to"), None)


def declare_like(graph: onnx.GraphProto, declared: Mapping[str, onnx.ValueInfoProto], name: str, source: str, elem_type: int) -> None:
    """Type a value a transform adds, `name`, with the shape of `source` (when `declared` has it) and
    `elem_type`: the models accudiff builds stay typed, so nothing runs shape inference on them again."""
    if source in declared:
        copy = graph.value_info.add()
        copy.CopyFrom(declared[source])
        copy.name, copy.type.tensor_type.elem_type = name, elem_type


def copy_without_initializers(proto: onnx.ModelProto, keep_node: Callable[[onnx.NodeProto], bool] | None = None) -> onnx.ModelProto:
    """A copy of everything but the weights: cheap, for analysis and for building transformed models.
    `keep_node`: which nodes of the main graph are copied (default: all)."""
    copy = onnx.ModelProto()
    for descriptor, value in proto.ListFields():
        if descriptor.name != "graph":
            _copy_field(copy, descriptor, value)
    for descriptor, value in proto.graph.ListFields():
        if descriptor.name == "node" and keep_node is not None:
            copy.graph.node.extend(node for node in value if keep_node(node))
        elif descriptor.name != "initializer":
            _copy_field(copy.graph, descriptor, value)
    return copy


def _copy_field(target, descriptor, value) -> None:
    if descriptor.is_repeated:
        getattr(target, descriptor.name).extend(value)
    elif descriptor.message_type is not None:
        getattr(target, descriptor.name).CopyFrom(value)
    else:
        setattr(target, descriptor.name, value)


def attribute_graphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def has_external_data(proto: onnx.ModelProto) -> bool:
    """Whether any weight of the model (bodies included) lives in a data file beside it."""
    return any(is_external(init) for init in all_initializers(proto))


def data_files(proto: onnx.ModelProto) -> list[str]:
    """The data files the model (bodies included) keeps its weights in, as written in it (relative)."""
    return list(dict.fromkeys(e.value for init in all_initializers(proto) for e in init.external_data if e.key == "location"))


def all_initializers(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    bodies = [body for node in all_nodes(proto.graph) for attr in node.attribute for body in attribute_graphs(attr)]
    return [init for graph in [proto.graph, *bodies] for init in graph.initializer]


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and, recursively, those inside its If/Loop/Scan bodies."""
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            for body in attribute_graphs(attr):
                nodes += all_nodes(body)
    return nodes


def all_node_outputs(graph: onnx.GraphProto) -> list[str]:
    names = []
    for node in graph.node:
        names.extend(o for o in node.output if o)
        for attr in node.attribute:
            for body in attribute_graphs(attr):
                names.extend(all_node_outputs(body))
    return names


def fresh_name(name: str, taken: set[str]) -> str:
    """`name`, lengthened until no value or node in `taken` has it; recorded as taken."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def writers_of(nodes: Iterable[onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
    """The node that writes each value."""
    return {out: node for node in nodes for out in node.output if out}


def readers_of(nodes: Iterable[onnx.NodeProto]) -> dict[str, list[onnx.NodeProto]]:
    """Every value's reading nodes, in graph order."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(node)
    return readers


def subgraph_outer_references(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    """Names that the If/Loop/Scan bodies of `nodes` read from the enclosing graph (their types must not change)."""
    refs: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for body in attribute_graphs(attr):
                defined = {i.name for i in body.input} | {i.name for i in body.initializer}
                defined |= set(all_node_outputs(body))
                for inner in body.node:
                    refs.update(n for n in inner.input if n and n not in defined)
                refs |= subgraph_outer_references(body.node) - defined
    return refs


def toposort(graph: onnx.GraphProto) -> None:
    """Order nodes so each follows the producers of everything it reads, subgraph outer reads included.

    Stable (each node placed right after whatever of its producers came later in the file): a sorted
    graph is left as it is. Tools leave graphs unsorted (the INT8 quantizer; ONNX Runtime's float16
    converter appends its input Casts last), ONNX Runtime sorts them as it loads, ONNX's checker refuses
    them. A cycle is left for the checker to report.
    """
    nodes = list(graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    needs = [[producer[name] for name in [*node.input, *sorted(subgraph_outer_references([node]))] if name in producer] for node in nodes]
    state, order = [0] * len(nodes), []  # 0 unseen, 1 on the path being placed, 2 placed
    for root in range(len(nodes)):
        if state[root]:
            continue
        state[root], path = 1, [(root, iter(needs[root]))]
        while path:
            index, pending = path[-1]
            later = next((j for j in pending if state[j] == 0), None)
            if later is None:
                path.pop()
                state[index] = 2
                order.append(index)
            else:
                state[later] = 1
                path.append((later, iter(needs[later])))
    if order != list(range(len(nodes))):
        copies = [onnx.NodeProto() for _ in order]
        for copy, i in zip(copies, order):
            copy.CopyFrom(nodes[i])
        del graph.node[:]
        graph.node.extend(copies)


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes a weight's values take, from its shape and type: reading its data field would copy it."""
    if tensor.data_type in PACKED_BITS:  # two or four values a byte: a referenced INT4 weight has no bytes to count
        return math.ceil(math.prod(tensor.dims) * PACKED_BITS[tensor.data_type] / 8)
    if tensor.data_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
        return tensor.ByteSize()
    return math.prod(tensor.dims) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def constant_values(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's constants by name: initializers and the values of Constant nodes."""
    found = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            found[node.output[0]] = node.attribute[0].t
    return found


def widened_constants(graph: onnx.GraphProto, narrow: Iterable[int]) -> dict[str, str]:
    """Values a Cast widens from a constant stored in a `narrow` type (weights kept FP16 and cast to FP32 as
    the model runs, as ONNX Runtime's FP16 converter leaves the nodes it blocks) -> that constant's name."""
    return _widened(graph, constant_values(graph), set(narrow))


def _widened(graph: onnx.GraphProto, constants: Mapping[str, onnx.TensorProto], narrow: set[int]) -> dict[str, str]:
    return {node.output[0]: node.input[0] for node in graph.node
            if node.op_type == "Cast" and node.input and node.input[0] in constants and constants[node.input[0]].data_type in narrow
            and cast_target(node) not in narrow}


def value_types(graph: onnx.GraphProto, constants: Mapping[str, onnx.TensorProto] | None = None) -> dict[str, int]:
    """The element type of every value the graph declares (inputs, outputs, value_info, constants: `constants`
    when they were read already)."""
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.value_info, *graph.output] if vi.type.HasField("tensor_type")}
    types.update((name, tensor.data_type) for name, tensor in (constant_values(graph) if constants is None else constants).items())
    return {name: kind for name, kind in types.items() if kind}


@dataclass(frozen=True)
class GraphIndex:
    """One graph's lookups, built once and handed to every reader of that graph: the node writing each value,
    every value's readers (graph order), the declared element types, the constants (initializers and
    Constant nodes' values), the graph outputs. For a graph nobody edits while it is read: a transform that
    edits a graph keeps its own records of what it added."""

    graph: onnx.GraphProto
    producer: dict[str, onnx.NodeProto]
    readers: dict[str, list[onnx.NodeProto]]
    types: dict[str, int]
    constants: dict[str, onnx.TensorProto]
    outputs: frozenset[str]

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> GraphIndex:
        constants = constant_values(graph)
        return cls(graph, writers_of(graph.node), readers_of(graph.node), value_types(graph, constants), constants, frozenset(o.name for o in graph.output))

    def only_reader(self, value: str) -> onnx.NodeProto | None:
        """The one node reading `value`, if it is read once and is no graph output."""
        readers = self.readers.get(value, [])
        return readers[0] if len(readers) == 1 and value not in self.outputs else None

    def made_by(self, value: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(value)
        return node if node is not None and node.op_type == op_type else None

    def widened_constants(self, narrow: Iterable[int]) -> dict[str, str]:
        """See `widened_constants`."""
        return _widened(self.graph, self.constants, set(narrow))
