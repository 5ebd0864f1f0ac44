"""What a loaded model holds, as the comparison sees it: its inputs, every tensor a node of the main graph
produces (in topological order), what each node reads, and the nodes in short for the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from accudiff.errors import AccudiffError
from accudiff.model.graph import all_node_outputs, attribute_graphs


SUBGRAPH_OPS_REASON = "inside the '{attr}' body of {op} node '{node}': subgraph tensors cannot be marked as graph outputs"


@dataclass(frozen=True)
class InputSpec:
    """A graph input: its element type and shape, with dynamic dimensions given as strings or None."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor produced by a node of the main graph, in topological order."""

    name: str
    node: str
    op_type: str
    dtype: np.dtype | None
    is_output: bool


@dataclass(frozen=True)
class NodeSummary:
    """A node as a report shows it (kept after the weights are freed): op, wiring, attributes in short."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[tuple[str, str], ...]


@dataclass
class ModelInfo:
    path: Path
    proto: onnx.ModelProto
    inputs: list[InputSpec]
    output_names: list[str]
    tensors: list[TensorInfo]
    upstream: dict[str, list[str]] = field(default_factory=dict)  # tensor -> tensors and graph inputs its node reads
    not_observable: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, NodeSummary] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)  # weight -> "float32[64x3x3x3]"
    weights_in_file: dict[str, tuple[int, int]] = field(default_factory=dict)  # a weight held in the model file -> (offset, length) of its bytes
    remembered: onnx.ModelProto | None = None  # the model as loaded, its weights referenced in their files (loading.remember_model)

    @property
    def stem(self) -> str:
        return self.path.stem


def describe(path: Path, proto: onnx.ModelProto) -> ModelInfo:
    """Build the tensor inventory of an already loaded, shape-inferred model."""
    graph = proto.graph
    initializer_names = {init.name for init in graph.initializer}
    dtypes = _value_dtypes(graph)
    for vi in graph.input:
        kind = dtypes.get(vi.name, "value of no declared type")  # a string for a sequence, map or optional
        if vi.name not in initializer_names and isinstance(kind, str):
            raise AccudiffError(f"input '{vi.name}' is a {kind}, which accudiff cannot feed: it compares models whose inputs are tensors")
    inputs = [
        InputSpec(vi.name, _np_dtype(vi.type.tensor_type.elem_type), _shape(vi))
        for vi in graph.input
        if vi.name not in initializer_names
    ]
    output_names = [o.name for o in graph.output]
    outputs = set(output_names)
    tensors: list[TensorInfo] = []
    not_observable: dict[str, str] = {}
    for node in graph.node:
        for out in node.output:
            if not out or node.op_type == "Constant":
                continue  # constants are weights, not computed: comparing them would only add noise
            kind = dtypes.get(out)
            if isinstance(kind, str):
                not_observable[out] = f"produced by {node.op_type} '{node.name}' as a {kind}, not a tensor"
                continue
            tensors.append(TensorInfo(out, node.name, node.op_type, kind, out in outputs))
        for attr in node.attribute:
            for body in attribute_graphs(attr):
                for inner in all_node_outputs(body):
                    not_observable[inner] = SUBGRAPH_OPS_REASON.format(attr=attr.name, op=node.op_type, node=node.name)
    produced = {t.name for t in tensors}
    produced |= {spec.name for spec in inputs}  # graph inputs too: INT8 quantizes them like any tensor
    upstream = {out: [name for name in node.input if name in produced] for node in graph.node for out in node.output if out}
    nodes = {node.name: _summary(node) for node in graph.node}
    weights = {init.name: f"{_np_dtype(init.data_type)}[{'x'.join(map(str, init.dims))}]" for init in graph.initializer}
    return ModelInfo(path, proto, inputs, output_names, tensors, upstream, not_observable, nodes, weights)


def _summary(node: onnx.NodeProto) -> NodeSummary:
    attributes = []
    for attr in node.attribute:
        if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            text = f"subgraph ({sum(len(g.node) for g in attribute_graphs(attr))} nodes)"
        elif attr.type == onnx.AttributeProto.TENSOR:
            text = f"tensor {_np_dtype(attr.t.data_type)}[{'x'.join(map(str, attr.t.dims))}]"
        else:
            value = onnx.helper.get_attribute_value(attr)
            text = value.decode(errors="replace") if isinstance(value, bytes) else repr(value)
        attributes.append((attr.name, text if len(text) <= 120 else text[:117] + "..."))
    return NodeSummary(node.name, node.op_type, tuple(node.input), tuple(node.output), tuple(attributes))


def name_unnamed_nodes(proto: onnx.ModelProto) -> None:
    """Give every unnamed node a stable name (`<op>_<index>`), so reports and keep-lists can name it."""
    taken = {n.name for n in proto.graph.node if n.name}
    for index, node in enumerate(proto.graph.node):
        if not node.name:
            candidate = f"{node.op_type}_{index}"
            while candidate in taken:
                candidate += "_"
            node.name = candidate
            taken.add(candidate)


def _value_dtypes(graph: onnx.GraphProto) -> dict[str, np.dtype | str | None]:
    """Element dtype of each known value; a string for non-tensor values (sequence, map, optional)."""
    result: dict[str, np.dtype | str | None] = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        which = vi.type.WhichOneof("value")
        if which == "tensor_type":
            elem = vi.type.tensor_type.elem_type
            result[vi.name] = _np_dtype(elem) if elem else None
        elif which is not None:
            result[vi.name] = which.replace("_type", "")
    for init in graph.initializer:
        result[init.name] = _np_dtype(init.data_type)
    return result


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def _shape(vi: onnx.ValueInfoProto) -> tuple[int | str | None, ...]:
    """Fixed sizes as ints, named dynamic dimensions as their name, unnamed ones as None. Exporters write
    "unknown" several ways: no value, `dim_value: -1` or `0` (Paddle, TensorFlow), `dim_param: "?"` or ""."""
    dims: list[int | str | None] = []
    for dim in vi.type.tensor_type.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param.strip() not in ("", "?"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return tuple(dims)
