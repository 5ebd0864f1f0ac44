"""Load an ONNX model once and check it: everything downstream (inputs, transforms, runners, comparison)
works from the `ModelInfo` it returns (model/inventory.py), so the model is parsed, checked and
shape-inferred exactly once."""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import replace
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from accudiff.errors import AccudiffError, first_line, missing
from accudiff.model.contrib_ops import CHECKED_AS_DOMAIN, onnxruntime_default_domain_ops
from accudiff.model.decoder import model_file
from accudiff.model.inventory import ModelInfo, describe, name_unnamed_nodes
from accudiff.model.shapes import SMALL_INITIALIZER_BYTES, clear_unknown_dims, infer_shapes_in_place, shape_inference_copy
from accudiff.model.graph import UNCHECKED_TYPES, all_initializers, all_nodes, copy_without_initializers, data_files, has_external_data, tensor_bytes, toposort
from accudiff.model.weights import data_file, is_external, mark_weights_folder, reference_in_file, refer_to, weight_values
from accudiff.model.wire import spans_in_file, without_raw_data


def load_model(path: str | os.PathLike) -> ModelInfo:
    """Load, check and shape-infer `path` (a model file, or a GenAI folder: the model its config names);
    raise AccudiffError with one sentence on any problem."""
    path = model_file(Path(path))
    if not path.is_file():
        raise missing(path, f"model file '{path}'")
    try:
        proto, spans = _read_without_large_weights(path)
    except (DecodeError, ValueError, RuntimeError, IndexError) as exc:
        raise AccudiffError(f"'{path}' is not a readable ONNX model ({first_line(exc)})") from exc
    if len(proto.graph.node) == 0:
        raise AccudiffError(f"'{path}' is not a valid ONNX model: its graph has no nodes")
    undecodable = _undecodable_text(proto)
    if undecodable is not None:
        raise AccudiffError(f"'{path}' is not a valid ONNX model: a {undecodable} is not UTF-8 text")
    misshapen = _misshapen_weight(proto.graph, spans)
    if misshapen is not None:
        raise AccudiffError(f"'{path}' is not a valid ONNX model: {misshapen}")
    external = has_external_data(proto)  # data files of its own (the weights in the model file are referenced next)
    _refer_to_file(proto, spans, path)
    if external:
        _require_data_files(path, data_files(proto))
        try:
            _keep_weights_in_their_files(proto, path.parent)
        except (ValueError, RuntimeError, OSError) as exc:
            raise AccudiffError(f"'{path}' refers to external data that cannot be read: {first_line(exc)}") from exc
    in_file_order(proto)
    _check(path, _checked_as_onnxruntime_loads(proto, onnxruntime_default_domain_ops(proto.graph.node)))
    info = _inventory(path, proto)
    info.weights_in_file = spans
    return info


def _refer_to_file(proto: onnx.ModelProto, spans: dict[str, tuple[int, int]], path: Path) -> None:
    """The weights read without their bytes (`_read_without_large_weights`) referenced where they lie in
    the file `path`: weights.py reads them when a value is needed, ONNX Runtime maps them."""
    for tensor in proto.graph.initializer:
        if _stripped(tensor, spans):
            refer_to(tensor, path.name, *spans[tensor.name], path.parent)


def _stripped(tensor: onnx.TensorProto, spans: dict[str, tuple[int, int]]) -> bool:
    """A main-graph weight read without its raw data (it lies in the file, at `spans[tensor.name]`)."""
    return not tensor.HasField("raw_data") and not is_external(tensor) and tensor.name in spans and spans[tensor.name][1] > SMALL_INITIALIZER_BYTES


def _read_without_large_weights(path: Path) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
    """The model in `path`, its main-graph weights of more than SMALL_INITIALIZER_BYTES read without their
    bytes (they stay in the file, mapped and never read here: wire.py), and where each weight's raw data
    lies. Reading the file whole and then the model held both at once: MiniLM's caller grew by twice its
    69 MB of weights to load it."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return onnx.ModelProto(), {}
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            try:
                spans = spans_in_file(mapped)
                stripped, unreadable = without_raw_data(mapped, SMALL_INITIALIZER_BYTES), None
            except (ValueError, IndexError) as exc:  # said once the file is let go of (the traceback holds views of it)
                unreadable = ValueError(first_line(exc) if str(exc) else "its bytes end inside a message")
    if unreadable is not None:
        raise unreadable
    return onnx.load_model_from_string(stripped), spans


def _check(path: Path, model: str | bytes | onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise AccudiffError(f"'{path}' fails the ONNX checker: {first_line(exc)}") from exc


def _require_data_files(path: Path, names: list[str]) -> None:
    """Every data file a model names lies in its folder (or below) and exists: what ONNX's checker would
    say of them, without its refusal of a data file with several hard links, which ONNX Runtime loads (a
    package manager's store links files)."""
    folder = path.parent.resolve()
    for name in names:
        target = (path.parent / name).resolve()
        if Path(name).is_absolute() or folder not in target.parents:
            raise AccudiffError(f"'{path}' refers to external data outside its folder ('{name}'): ONNX Runtime and ONNX refuse such a location")
        if not target.is_file():
            raise AccudiffError(f"'{path}' refers to external data that is missing: {path.parent / name}")


def _checked_as_onnxruntime_loads(proto: onnx.ModelProto, ours: list[onnx.NodeProto]) -> onnx.ModelProto:
    """What ONNX's checker reads of a model: the graph without the bytes of its large weights (declared as
    inputs of their types and shapes: no weight is copied; `_misshapen_weight` checks their data, and
    `_require_data_files` and the reading of each weight those in data files). ONNX Runtime's own ops in
    the default domain (the GenAI builder's SimplifiedLayerNormalization) have no ONNX schema, and the
    checker would refuse a model ONNX Runtime loads and runs: they are shown to it in a domain of their
    own (which it skips)."""
    light = shape_inference_copy(proto)
    moved = {tuple(node.output) for node in ours}
    for node in light.graph.node:
        if tuple(node.output) in moved:
            node.domain = CHECKED_AS_DOMAIN
    if moved:
        light.opset_import.append(onnx.helper.make_opsetid(CHECKED_AS_DOMAIN, 1))
    return light


def remember_model(info: ModelInfo) -> None:
    """Keep `info`'s model as loaded, without the bytes of its weights (those in its file referenced there,
    see weights.py), before a transform changes or frees it: `read_again` hands it back without reading,
    checking or inferring it again (a 69 MB MiniLM: 0.07 s)."""
    light = copy_without_initializers(info.proto)
    for tensor in info.proto.graph.initializer:
        light.graph.initializer.add().CopyFrom(reference_in_file(tensor, info.weights_in_file, info.path, SMALL_INITIALIZER_BYTES) or tensor)
    info.remembered = light


def read_again(info: ModelInfo) -> ModelInfo:
    """`info` with its model as `load_model` read it (its weights referenced in their files): verification
    needs it after the transform let go of it."""
    if info.remembered is None:
        raise ValueError("read_again needs the model remembered (remember_model) before it was let go of")
    proto = onnx.ModelProto()
    proto.CopyFrom(info.remembered)
    return replace(info, proto=proto)


def _inventory(path: Path, proto: onnx.ModelProto) -> ModelInfo:
    """The inventory of a model read and checked: its nodes named, its types and shapes inferred."""
    clear_unknown_dims(proto)
    infer_shapes_in_place(proto)
    return describe(path, proto)


def in_file_order(proto: onnx.ModelProto) -> None:
    """Every node named (by its place in the file) and the graph sorted as ONNX Runtime sorts it: the
    names and order every reading of a model file gives, `load_model`'s and a worker's alike."""
    name_unnamed_nodes(proto)
    toposort(proto.graph)


def load_graph(path: Path) -> onnx.ModelProto:
    """A model file accudiff wrote (or checked) before, its weights left in their data files, and those the
    file holds itself referenced there (see weights.py): a worker's sessions read them where they are,
    and the model crosses to ONNX Runtime as a graph."""
    proto, spans = _read_without_large_weights(Path(path))
    in_file_order(proto)
    _refer_to_file(proto, spans, Path(path))
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


VALUE_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")  # and raw_data


def _misshapen_weight(graph: onnx.GraphProto, spans: dict[str, tuple[int, int]]) -> str | None:
    """The first weight (initializer or Constant) whose data does not hold as many values as its shape
    says (the checker lets that through; every later read of it fails), or holds them in two fields (the
    checker sees no large weight's data). Types packed below a byte,
    strings and complex numbers are not checked. `spans`: the raw data's place in the file, by weight
    (its length known, protobuf need not copy the bytes out to tell it)."""
    constants = [a.t for n in all_nodes(graph) if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    for tensor, span in [*((init, spans.get(init.name)) for init in graph.initializer), *((t, None) for t in constants)]:
        raw = tensor.HasField("raw_data") or (span is not None and _stripped(tensor, spans))  # read without its bytes: it has them in the file
        fields = [name for name in VALUE_FIELDS if len(getattr(tensor, name))] + (["raw_data"] if raw else [])
        if len(fields) > 1:
            return f"weight '{tensor.name}' holds values in {len(fields)} fields ({', '.join(fields)}); ONNX allows one"
        if tensor.data_type in UNCHECKED_TYPES:
            continue
        expected = math.prod(tensor.dims)
        if is_external(tensor):  # its length is written beside its location: nothing is read
            length = next((int(e.value) for e in tensor.external_data if e.key == "length" and e.value.isdigit()), None)
            held = expected if length is None else length / onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        elif raw:
            size = span[1] if span is not None else len(tensor.raw_data)
            held = size / onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        else:
            held = len(getattr(tensor, onnx.helper.tensor_dtype_to_field(tensor.data_type)))
        if held != expected:
            return f"weight '{tensor.name}' holds {held:g} values for shape {list(tensor.dims)} ({expected} values)"
    return None


TENSOR_TEXT_FIELDS = ("name", "doc_string", "external_data", "metadata_props")  # a TensorProto's text: the rest is data


def _undecodable_text(message) -> str | None:
    """The first string field of `message` (names, op types, domains, anywhere in the model) that is not
    valid UTF-8, as "NodeProto.input (b'c\\xe5ntered')"; protobuf hands such fields over as bytes, which
    every later step would trip on. Only the fields set are read, and of them only strings and messages:
    weights are never copied (of a tensor, its name, its text and its entries alone are read)."""
    if isinstance(message, onnx.TensorProto):
        fields = [(message.DESCRIPTOR.fields_by_name[name], getattr(message, name)) for name in TENSOR_TEXT_FIELDS]
    else:
        fields = message.ListFields()
    for spec, value in fields:
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
