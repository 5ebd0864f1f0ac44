"""Load an ONNX model once, check it, and describe every tensor the comparison can observe.

Everything downstream (inputs, transforms, runners, comparison) works from a `ModelInfo`, so the model
is parsed, checked and shape-inferred exactly once.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper
from google.protobuf.message import DecodeError

from accudiff.errors import AccudiffError, first_line
from accudiff.model.weights import (
    copy_bytes,
    data_file,
    external_entries,
    is_external,
    mark_weights_folder,
    refer_to,
    same_folder,
    stored_dtype,
    weight_folder,
    weight_values,
    without_folder,
)

# Weights beyond this are saved beside the model: protobuf refuses to serialise messages past 2 GiB, and
# ONNX Runtime runs weights in a data file where they are, while a model held whole is copied again for
# every marked run (runners/onnxrt.py).
EXTERNAL_DATA_THRESHOLD = 256 << 20
EXTERNAL_DATA_MIN_TENSOR = 1024  # ... each weight of at least this many bytes
# Initializers up to this size are kept for shape inference (shape arithmetic reads their values).
SMALL_INITIALIZER_BYTES = 4096

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
    types: onnx.GraphProto | None = None  # the inferred value_info, kept by remember_types for read_again

    @property
    def stem(self) -> str:
        return self.path.stem


def load_model(path: str | os.PathLike) -> ModelInfo:
    """Load, check and shape-infer `path`; raise AccudiffError with one sentence on any problem."""
    path = Path(path)
    if not path.is_file():
        raise AccudiffError(f"model file '{path}' does not exist")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise AccudiffError(f"'{path}' is not a readable ONNX model ({first_line(exc)})") from exc
    if len(proto.graph.node) == 0:
        raise AccudiffError(f"'{path}' is not a valid ONNX model: its graph has no nodes")
    undecodable = _undecodable_text(proto)
    if undecodable is not None:
        raise AccudiffError(f"'{path}' is not a valid ONNX model: a {undecodable} is not UTF-8 text")
    misshapen = _misshapen_weight(proto.graph)
    if misshapen is not None:
        raise AccudiffError(f"'{path}' is not a valid ONNX model: {misshapen}")
    external = has_external_data(proto)
    missing = next((name for name in data_files(proto) if not (path.parent / name).is_file()), None) if external else None
    if missing is not None:
        raise AccudiffError(f"'{path}' refers to external data that is missing: {path.parent / missing}")
    try:  # checked from its file (the checker reads its data files too): serializing the model again cost more
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise AccudiffError(f"'{path}' fails the ONNX checker: {first_line(exc)}") from exc
    if external:
        try:
            _keep_weights_in_their_files(proto, path.parent)
        except (ValueError, RuntimeError, OSError) as exc:
            raise AccudiffError(f"'{path}' refers to external data that cannot be read: {first_line(exc)}") from exc
    return _inventory(path, proto)


def remember_types(info: ModelInfo) -> None:
    """Keep a copy of the types inference found in `info`'s model (its value_info, without the weights),
    before a transform changes or frees the model, so that `read_again` need not infer them again. A
    model with If/Loop/Scan bodies keeps none: their types are inferred again."""
    if not any(_attribute_graphs(attr) for node in info.proto.graph.node for attr in node.attribute):
        info.types = onnx.GraphProto()
        info.types.value_info.extend(info.proto.graph.value_info)


def read_again(info: ModelInfo) -> ModelInfo:
    """`info` with its model read again from its file (checked earlier in this run), as `load_model` read
    it: verification needs it after the transform let go of it. With the types remembered, inference does
    not run again (0.02-0.05 s on the PP-OCRv4 recognizer)."""
    proto = onnx.load(str(info.path), load_external_data=False)
    _keep_weights_in_their_files(proto, info.path.parent)
    name_unnamed_nodes(proto)
    clear_unknown_dims(proto)
    if info.types is None:
        infer_shapes_in_place(proto)
    else:
        proto.graph.value_info.extend(info.types.value_info)
    return replace(info, proto=proto)


def _inventory(path: Path, proto: onnx.ModelProto) -> ModelInfo:
    """The inventory of a model read and checked: its nodes named, its types and shapes inferred."""
    name_unnamed_nodes(proto)
    clear_unknown_dims(proto)
    infer_shapes_in_place(proto)
    return describe(path, proto)


def load_graph(path: Path) -> onnx.ModelProto:
    """A model file accudiff wrote (or checked) before, its weights left in their data files (see weights.py)."""
    proto = onnx.load(str(path), load_external_data=False)
    mark_weights_folder(_all_initializers(proto), Path(path).parent)
    return proto


def _keep_weights_in_their_files(proto: onnx.ModelProto, folder: Path) -> None:
    """Weights in data files stay there (weights.py reads them when needed), each checked to lie within its
    file; the small ones (shape arithmetic reads their values) and those of If/Loop/Scan bodies are read in."""
    main = len(proto.graph.initializer)
    for index, tensor in enumerate(_all_initializers(proto)):
        if not is_external(tensor):
            continue
        mark_weights_folder([tensor], folder)
        file, offset, length = data_file(tensor)
        if offset + length > file.stat().st_size:
            raise ValueError(f"weight '{tensor.name}' lies past the end of {file.name}")
        if tensor_bytes(tensor) <= SMALL_INITIALIZER_BYTES or index >= main:
            tensor.raw_data = weight_values(tensor).tobytes()
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _misshapen_weight(graph: onnx.GraphProto) -> str | None:
    """The first weight (initializer or Constant) whose data does not hold as many values as its shape
    says (the checker lets that through; every later read of it fails). Types packed below a byte,
    strings and complex numbers are not checked."""
    tensors = [*graph.initializer, *(a.t for n in all_nodes(graph) if n.op_type == "Constant" for a in n.attribute if a.name == "value")]
    for tensor in tensors:
        if tensor.data_type in _UNCHECKED_TYPES:
            continue
        expected = math.prod(tensor.dims)
        if is_external(tensor):  # its length is written beside its location: nothing is read
            length = next((int(e.value) for e in tensor.external_data if e.key == "length" and e.value.isdigit()), None)
            held = expected if length is None else length / onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        elif tensor.HasField("raw_data"):
            held = len(tensor.raw_data) / onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        else:
            held = len(getattr(tensor, onnx.helper.tensor_dtype_to_field(tensor.data_type)))
        if held != expected:
            return f"weight '{tensor.name}' holds {held:g} values for shape {list(tensor.dims)} ({expected} values)"
    return None


_UNCHECKED_TYPES = {
    getattr(onnx.TensorProto, name)
    for name in ("UNDEFINED", "STRING", "COMPLEX64", "COMPLEX128", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
}


def _undecodable_text(message) -> str | None:
    """The first string field of `message` (names, op types, domains, anywhere in the model) that is not
    valid UTF-8, as "NodeProto.input (b'c\\xe5ntered')"; protobuf hands such fields over as bytes, which
    every later step would trip on. Only the fields set are read, and of them only strings and messages:
    weights are never copied."""
    for spec, value in message.ListFields():
        if spec.type not in (spec.TYPE_STRING, spec.TYPE_MESSAGE):
            continue
        repeated = spec.is_repeated if hasattr(spec, "is_repeated") else spec.label == spec.LABEL_REPEATED
        for item in value if repeated else (value,):
            if spec.type == spec.TYPE_STRING:
                if isinstance(item, bytes):
                    return f"{message.DESCRIPTOR.name}.{spec.name} ({item[:40]!r})"
            else:
                found = _undecodable_text(item)
                if found is not None:
                    return found
    return None


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
            for body in _attribute_graphs(attr):
                for inner in _all_node_outputs(body):
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
            text = f"subgraph ({sum(len(g.node) for g in _attribute_graphs(attr))} nodes)"
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


def clear_unknown_dims(proto: onnx.ModelProto) -> None:
    """Graph input and output sizes written as -1 or 0 mean "unknown" (Paddle and TensorFlow exports):
    make them plain unknown dimensions, so shape inference, the candidate model and TensorRT's parser
    see them as dynamic rather than as a fixed size."""
    for vi in [*proto.graph.input, *proto.graph.output]:
        for dim in vi.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value <= 0:
                dim.Clear()


def save_model(proto: onnx.ModelProto, path: Path, move_weights: bool = False, side_file: bool = False) -> None:
    """Save a model, its weights in a side file (`<name>.data`) when it has weights in data files or
    protobuf's 2 GiB limit would be hit (see EXTERNAL_DATA_THRESHOLD). A weight already in a data file in
    `path`'s folder stays there; one elsewhere is copied in, block by block. `move_weights`: the weights
    written to the side file become, in `proto`, references to it (their memory let go of), so the model
    saved again in the same folder writes only its graph (an isolated model shares its candidate's data).
    `side_file`: every weight of EXTERNAL_DATA_MIN_TENSOR or more in the side file, whatever the total
    (ONNX Runtime maps weights in a file, and copies those inside a model)."""
    path = Path(path)
    if not side_file and not needs_data_file(proto):
        _write_whole(proto, path)
        return
    light = copy_without_initializers(proto)
    kept = {external_entries(init).get("location") for init in proto.graph.initializer if is_external(init) and same_folder(weight_folder(init), path.parent)}
    location = next(name for k in range(len(kept) + 1) if (name := path.name + (f".{k}" if k else "") + ".data") not in kept)  # never over a file it keeps
    written = []
    with _LazyFile(path.parent / location) as data:
        for init in proto.graph.initializer:
            if is_external(init) and same_folder(weight_folder(init), path.parent):
                light.graph.initializer.append(without_folder(init))
                continue
            if not is_external(init) and tensor_bytes(init) < EXTERNAL_DATA_MIN_TENSOR:
                light.graph.initializer.append(init)
                continue
            offset = data.tell()
            if is_external(init):
                length = copy_bytes(init, data)
            else:
                length = data.write(init.raw_data if init.HasField("raw_data") else numpy_helper.to_array(init).astype(stored_dtype(init)).tobytes())
            reference = onnx.TensorProto(name=init.name, data_type=init.data_type, dims=init.dims)
            refer_to(reference, location, offset, length, path.parent)
            light.graph.initializer.append(without_folder(reference))
            written.append((init, offset, length))
    _write_whole(light, path)
    for init, offset, length in written if move_weights else ():
        refer_to(init, location, offset, length, path.parent)


def _write_whole(proto: onnx.ModelProto, path: Path) -> None:
    """The model's bytes written as they are: every weight the model refers to is already in its data file
    (onnx.save would walk every tensor, Constants' included, looking for data to write: 0.01 s a save on
    the PP-OCRv4 recognizer's 420 Constants, of four saves on the critical path)."""
    path.write_bytes(proto.SerializeToString())


def link_model(source: Path, target: Path) -> None:
    """Put a saved model (and its side file) at `target` too, under the same name: a hard link, or a copy
    where the two folders are on different file systems."""
    assert source.name == target.name, "a model's side file is named after it"
    for name in (source.name, source.name + ".data"):
        if (source.parent / name).exists():
            try:
                os.link(source.parent / name, target.parent / name)
            except OSError:
                shutil.copyfile(source.parent / name, target.parent / name)


class _LazyFile:
    """A data file created by its first write (a model whose weights all stay where they are has none)."""

    def __init__(self, path: Path):
        self.path, self._file = path, None

    def _open(self):
        if self._file is None:
            self._file = open(self.path, "wb")
        return self._file

    def tell(self) -> int:
        return self._file.tell() if self._file is not None else 0

    def write(self, data: bytes) -> int:
        return self._open().write(data)

    def __enter__(self) -> "_LazyFile":
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()


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
            for body, body_done in zip(_attribute_graphs(attr), _attribute_graphs(attr_done)):
                del body.value_info[:]
                body.value_info.extend(_known(body_done.value_info))
                _copy_body_value_info(body.node, body_done.node)


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


def _attribute_graphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def has_external_data(proto: onnx.ModelProto) -> bool:
    """Whether any weight of the model (bodies included) lives in a data file beside it."""
    return any(is_external(init) for init in _all_initializers(proto))


def data_files(proto: onnx.ModelProto) -> list[str]:
    """The data files the model (bodies included) keeps its weights in, as written in it (relative)."""
    return list(dict.fromkeys(e.value for init in _all_initializers(proto) for e in init.external_data if e.key == "location"))


def _all_initializers(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    bodies = [body for node in all_nodes(proto.graph) for attr in node.attribute for body in _attribute_graphs(attr)]
    return [init for graph in [proto.graph, *bodies] for init in graph.initializer]


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and, recursively, those inside its If/Loop/Scan bodies."""
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            for body in _attribute_graphs(attr):
                nodes += all_nodes(body)
    return nodes


def _all_node_outputs(graph: onnx.GraphProto) -> list[str]:
    names = []
    for node in graph.node:
        names.extend(o for o in node.output if o)
        for attr in node.attribute:
            for body in _attribute_graphs(attr):
                names.extend(_all_node_outputs(body))
    return names


def subgraph_outer_references(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    """Names that the If/Loop/Scan bodies of `nodes` read from the enclosing graph (their types must not change)."""
    refs: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for body in _attribute_graphs(attr):
                defined = {i.name for i in body.input} | {i.name for i in body.initializer}
                defined |= set(_all_node_outputs(body))
                for inner in body.node:
                    refs.update(n for n in inner.input if n and n not in defined)
                refs |= subgraph_outer_references(body.node) - defined
    return refs


def toposort(graph: onnx.GraphProto) -> None:
    """Order nodes so each follows the producers of everything it reads, subgraph outer reads included.

    Stable: nodes already in order keep it. Tools we call (the INT8 quantizer) may leave a graph unsorted.
    """
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    nodes = list(graph.node)
    reads = [set(node.input) | subgraph_outer_references([node]) for node in nodes]
    pending, order = list(range(len(nodes))), []
    while pending:
        ready = [i for i in pending if reads[i] <= available]
        if not ready:
            order += pending  # reads of names nothing produces: leave them for the checker to report
            break
        for i in ready:
            available.update(nodes[i].output)
        order += ready
        done = set(ready)
        pending = [i for i in pending if i not in done]
    if order != list(range(len(nodes))):
        copies = [onnx.NodeProto() for _ in order]
        for copy, i in zip(copies, order):
            copy.CopyFrom(nodes[i])
        del graph.node[:]
        graph.node.extend(copies)


def needs_data_file(proto: onnx.ModelProto) -> bool:
    """Whether the model's weights are saved beside it: it has weights in data files, or more than
    EXTERNAL_DATA_THRESHOLD of them."""
    initializers = proto.graph.initializer
    return any(is_external(init) for init in initializers) or sum(tensor_bytes(init) for init in initializers) > EXTERNAL_DATA_THRESHOLD


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes a weight's values take, from its shape and type: reading its data field would copy it."""
    if tensor.data_type in _UNCHECKED_TYPES:
        return tensor.ByteSize()
    return math.prod(tensor.dims) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
