"""Load an ONNX model once and check it: everything downstream (inputs, transforms, runners, comparison)
works from the `ModelInfo` it returns (model/inventory.py), so the model is parsed, checked and
shape-inferred exactly once."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from accudiff.errors import AccudiffError, first_line
from accudiff.model.inventory import ModelInfo, describe, name_unnamed_nodes
from accudiff.model.shapes import SMALL_INITIALIZER_BYTES, clear_unknown_dims, infer_shapes_in_place
from accudiff.model.graph import UNCHECKED_TYPES, all_initializers, all_nodes, attribute_graphs, data_files, has_external_data, tensor_bytes
from accudiff.model.weights import data_file, is_external, mark_weights_folder, weight_values


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
    if not any(attribute_graphs(attr) for node in info.proto.graph.node for attr in node.attribute):
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
    mark_weights_folder(all_initializers(proto), Path(path).parent)
    return proto


def _keep_weights_in_their_files(proto: onnx.ModelProto, folder: Path) -> None:
    """Weights in data files stay there (weights.py reads them when needed), each checked to lie within its
    file; the small ones (shape arithmetic reads their values) and those of If/Loop/Scan bodies are read in."""
    main = len(proto.graph.initializer)
    for index, tensor in enumerate(all_initializers(proto)):
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
        if tensor.data_type in UNCHECKED_TYPES:
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
