"""Saving models: a model whose weights stay in their data files refers to them; weights past
protobuf's 2 GiB limit (or a side-file threshold) go to a data file beside the model, block by block."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import onnx
from onnx import numpy_helper

from accudiff.model.graph import all_initializers, copy_without_initializers, tensor_bytes
from accudiff.model.shapes import SMALL_INITIALIZER_BYTES
from accudiff.model.weights import (
    copy_bytes,
    data_file,
    external_entries,
    is_external,
    refer_in_place,
    refer_to,
    same_folder,
    weight_folder,
    without_folder,
)
from accudiff.model.wire import spans_in_file, write_with_weights


# Weights beyond this are saved beside the model: protobuf refuses to serialise messages past 2 GiB, and
# ONNX Runtime runs weights in a data file where they are, while a model held whole is copied again for
# every marked run (runners/onnxrt.py).
EXTERNAL_DATA_THRESHOLD = 256 << 20


EXTERNAL_DATA_MIN_TENSOR = 1024  # ... each weight of at least this many bytes


def save_model(proto: onnx.ModelProto, path: Path, move_weights: bool = False, side_file: bool = False, in_place: bool = False,
               one_file: bool = False) -> None:
    """Save a model, its weights in a side file (`<name>.data`) when it has weights in data files or
    protobuf's 2 GiB limit would be hit (see EXTERNAL_DATA_THRESHOLD). A weight already in a data file in
    `path`'s folder stays there; one elsewhere is copied in, block by block. `move_weights`: the weights
    written become, in `proto`, references to them in the side file or in the model file itself (their
    memory let go of), so a model saved again in the same folder writes only its graph (an isolated model
    shares its candidate's data).
    `side_file`: every weight of EXTERNAL_DATA_MIN_TENSOR or more in the side file, whatever the total
    (ONNX Runtime maps weights in a file, and copies those inside a model). `in_place`: a weight in a data
    file elsewhere (or in a model file holding its weights) stays there, the saved file naming that file's
    folder, as accudiff holds it in memory (weights.py): for models only accudiff reads, in its scratch
    folder, whose runners take them as a graph (`weights.in_one_folder`). ONNX's format has no such
    reference; a hard link instead would make ONNX's loader refuse the user's data file while it exists.
    `one_file`: a model a user takes away (a repaired model) holds its weights itself, read in from their
    data files, unless they pass EXTERNAL_DATA_THRESHOLD."""
    path = Path(path)
    if one_file and sum(tensor_bytes(init) for init in all_initializers(proto)) <= EXTERNAL_DATA_THRESHOLD:
        _write_one_file(proto, path)
        return
    if not side_file and not needs_data_file(proto):
        data = _write_whole(proto, path)
        if move_weights:  # the weights written become references to their bytes in the file (weights.py)
            refer_in_place(proto.graph.initializer, spans_in_file(data), path, SMALL_INITIALIZER_BYTES)
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
            if (not is_external(init) and tensor_bytes(init) < EXTERNAL_DATA_MIN_TENSOR) or (in_place and is_external(init)):
                light.graph.initializer.append(init)
                continue
            offset = data.tell()
            if is_external(init):
                length = copy_bytes(init, data)
            else:
                # Values held in a typed field are written as raw data holds them (4-bit ones two a byte)
                length = data.write(init.raw_data if init.HasField("raw_data") else numpy_helper.from_array(numpy_helper.to_array(init)).raw_data)
            reference = onnx.TensorProto(name=init.name, data_type=init.data_type, dims=init.dims)
            refer_to(reference, location, offset, length, path.parent)
            light.graph.initializer.append(without_folder(reference))
            written.append((init, location, offset, length))
    _write_whole(light, path)
    for init, file, offset, length in written if move_weights else ():
        refer_to(init, file, offset, length, path.parent)


def _write_one_file(proto: onnx.ModelProto, path: Path) -> None:
    """The model with every weight inside it: the main graph's weights in data files are copied into the file as
    it is written, a block at a time (read in and serialized, a 21 MB repaired MiniLM grew the caller by 46 MB);
    those of If/Loop bodies, read in."""
    light = copy_without_initializers(proto)
    for init in all_initializers(light):
        if is_external(init):
            stored = io.BytesIO()
            copy_bytes(init, stored)  # its bytes as stored (4-bit codes stay packed)
            del init.external_data[:]
            init.data_location = onnx.TensorProto.DEFAULT
            init.raw_data = stored.getvalue()
    weights = []
    for init in proto.graph.initializer:
        if not is_external(init):
            weights.append((init.SerializeToString(), 0, None))
            continue
        head = onnx.TensorProto()
        head.CopyFrom(init)
        for name in ("external_data", "data_location", "raw_data"):
            head.ClearField(name)
        weights.append((head.SerializeToString(), data_file(init)[2], lambda target, init=init: copy_bytes(init, target)))
    graph = light.graph.SerializeToString()
    light.ClearField("graph")
    with open(path, "wb") as target:
        write_with_weights(target, light.SerializeToString(), graph, weights)


def _write_whole(proto: onnx.ModelProto, path: Path) -> bytes:
    """The model's bytes written as they are: every weight the model refers to is already in its data file
    (onnx.save would walk every tensor, Constants' included, looking for data to write: 0.01 s a save on
    the PP-OCRv4 recognizer's 420 Constants, of four saves on the critical path)."""
    data = proto.SerializeToString()
    path.write_bytes(data)
    return data


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


def needs_data_file(proto: onnx.ModelProto) -> bool:
    """Whether the model's weights are saved beside it: it has weights in data files, or more than
    EXTERNAL_DATA_THRESHOLD of them."""
    initializers = proto.graph.initializer
    return any(is_external(init) for init in initializers) or sum(tensor_bytes(init) for init in initializers) > EXTERNAL_DATA_THRESHOLD
