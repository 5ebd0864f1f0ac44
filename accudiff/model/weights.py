"""Weights where they lie: a model's data files are read when a value is needed, block by block, and never
loaded whole into the model.

A weight kept in a data file carries, in memory, the folder its file is in (the `basepath` entry of its
external data, a key onnx reserves for this; it is never written to a saved model). So a model built from
another one (a candidate, a segment, an extracted subgraph) knows where each of its weights is, wherever
it is saved (`saving.save_model`): a weight whose data file is in the target's folder stays there, any
other is copied block by block into the target's own data file.

A weight stored inside the model file itself is such a weight too, once read: its bytes lie at a known
offset of that file (wire.py walks protobuf's wire format to find it), so a model read for a
worker refers to them there (`refer_in_place`) instead of holding a copy, and ONNX Runtime reads them
where they are, as from any data file.
"""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import onnx
from onnx import numpy_helper

FOLDER_KEY = "basepath"
BLOCK_BYTES = 64 << 20  # what one read of a data file holds in memory
COPY_BLOCK_BYTES = 8 << 20  # ... when its bytes are only copied to another file (no faster for larger)


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def external_entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def mark_weights_folder(tensors: Iterable[onnx.TensorProto], folder: Path) -> None:
    """Note on each weight kept in a data file the folder that file is in (unless it already says)."""
    where = str(Path(folder).resolve())
    for tensor in tensors:
        if is_external(tensor) and FOLDER_KEY not in external_entries(tensor):
            tensor.external_data.add(key=FOLDER_KEY, value=where)


def data_file(tensor: onnx.TensorProto) -> tuple[Path, int, int]:
    """Where a weight's bytes are: (file, offset, length)."""
    entries = external_entries(tensor)
    if not entries.get(FOLDER_KEY):  # a model read without `loading.load_graph`: its files' folder is unknown
        raise ValueError(f"weight '{tensor.name}' does not say which folder its data file is in")
    folder = Path(entries[FOLDER_KEY])
    length = entries.get("length")
    size = int(np.prod(tensor.dims, dtype=np.int64)) * stored_dtype(tensor).itemsize
    return folder / entries["location"], int(entries.get("offset") or 0), int(length) if length else size


def weight_folder(tensor: onnx.TensorProto) -> Path | None:
    """The folder a weight's data file is in, when it says."""
    value = external_entries(tensor).get(FOLDER_KEY)
    return Path(value) if value else None


def weight_blocks(tensor: onnx.TensorProto, block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
    """A weight's values, flattened, a block at a time: from its data file, block by block (so memory
    holds one block, not the weight), or from the model itself."""
    dtype = stored_dtype(tensor)
    if not is_external(tensor):
        values = numpy_helper.to_array(tensor).reshape(-1)
        for start in range(0, max(values.size, 1), max(block_bytes // dtype.itemsize, 1)):
            yield values[start : start + block_bytes // dtype.itemsize]
        return
    path, offset, length = data_file(tensor)
    count = length // dtype.itemsize
    per_block = max(block_bytes // dtype.itemsize, 1)
    with open(path, "rb") as file:
        file.seek(offset)
        for start in range(0, count, per_block):
            block = np.empty(min(per_block, count - start), dtype)
            if file.readinto(memoryview(block).cast("B")) != block.nbytes:
                raise ValueError(f"the data file of weight '{tensor.name}' ends before its values do")
            yield block


def weight_values(tensor: onnx.TensorProto) -> np.ndarray:
    """A weight's values (read whole: for the small weights whose values decide something, such as a
    condition or a shape, and for the codes of quantized ones: 4-bit types come back as int8 or uint8)."""
    if tensor.data_type in PACKED_4BIT:
        return next(weight_code_blocks(tensor)).reshape(tuple(tensor.dims))
    if not is_external(tensor):
        return numpy_helper.to_array(tensor)
    path, offset, length = data_file(tensor)
    values = np.empty(length // stored_dtype(tensor).itemsize, stored_dtype(tensor))  # read into its place: blocks joined were twice the weight
    with open(path, "rb") as file:
        file.seek(offset)
        if values.nbytes and file.readinto(memoryview(values).cast("B")) != values.nbytes:
            raise ValueError(f"the data file of weight '{tensor.name}' ends before its values do")
    return values.reshape(tuple(tensor.dims))


PACKED_4BIT = {onnx.TensorProto.INT4: True, onnx.TensorProto.UINT4: False}  # two values a byte, signed or not
PACKED_BITS = {getattr(onnx.TensorProto, name): bits for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
               if hasattr(onnx.TensorProto, name)}  # every type stored below a byte, by its width


def weight_code_blocks(weight: onnx.TensorProto) -> Iterator[np.ndarray]:
    """A weight's values, flattened, a block at a time, with 4-bit types unpacked (two values a byte, the
    low nibble first) into int8 or uint8 in one block."""
    if weight.data_type not in PACKED_4BIT:
        yield from weight_blocks(weight)
        return
    signed = PACKED_4BIT[weight.data_type]
    if not is_external(weight):
        yield numpy_helper.to_array(weight).reshape(-1).astype(np.int8 if signed else np.uint8)
        return
    data = io.BytesIO()
    copy_bytes(weight, data)
    values = unpack_codes(np.frombuffer(data.getvalue(), np.uint8), 4, int(np.prod(weight.dims, dtype=np.int64)))
    yield (np.where(values > 7, values.astype(np.int16) - 16, values).astype(np.int8)) if signed else values


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """`count` codes of `bits` bits (2, 4 or 8) packed low bits first into the bytes `packed`, as uint8."""
    packed = np.ascontiguousarray(packed, np.uint8).reshape(-1)
    if bits == 8:
        return packed[:count]
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count].astype(np.uint8)


def copy_bytes(tensor: onnx.TensorProto, target) -> int:
    """Append a weight's bytes from its data file to the open file `target`, a block at a time (one block's
    memory, read into again); returns how many bytes were written."""
    path, offset, length = data_file(tensor)
    block = memoryview(bytearray(min(COPY_BLOCK_BYTES, length)))
    written = 0
    with open(path, "rb") as source:
        source.seek(offset)
        while written < length:
            read = source.readinto(block[: min(len(block), length - written)])
            if not read:
                raise ValueError(f"the data file of weight '{tensor.name}' ends before its values do")
            target.write(block[:read])
            written += read
    return written


# protobuf's field numbers on the way to a weight's bytes: ModelProto.graph, GraphProto.initializer,
# TensorProto.name and TensorProto.raw_data (onnx.proto).
def reference_in_file(tensor: onnx.TensorProto, spans: dict[str, tuple[int, int]], path: Path, smallest: int) -> onnx.TensorProto | None:
    """A reference to the bytes of `tensor` (held as raw data) in the model file `path`, where `spans`
    (wire.spans_in_file) says where they lie; None for one of at most `smallest` bytes (shape arithmetic reads
    the small ones) or one whose place is unknown. Its length is read off the file: protobuf does not copy
    the bytes out."""
    span = spans.get(tensor.name)
    if span is None or not tensor.HasField("raw_data") or span[1] <= smallest:
        return None
    reference = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    refer_to(reference, Path(path).name, span[0], span[1], Path(path).parent)
    return reference


def refer_in_place(tensors: Iterable[onnx.TensorProto], spans: dict[str, tuple[int, int]], path: Path, smallest: int) -> None:
    """Each of `tensors` that `reference_in_file` can refer to becomes that reference (its memory let go of)."""
    for tensor in tensors:
        reference = reference_in_file(tensor, spans, path, smallest)
        if reference is not None:
            tensor.CopyFrom(reference)


def refer_to(tensor: onnx.TensorProto, location: str, offset: int, length: int, folder: Path) -> None:
    """Make `tensor` a reference to `length` bytes at `offset` of `folder/location` (its values in memory,
    if any, are let go of)."""
    name, dims, data_type = tensor.name, list(tensor.dims), tensor.data_type
    tensor.Clear()
    tensor.name, tensor.data_type = name, data_type
    tensor.dims.extend(dims)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length)), (FOLDER_KEY, _real_path(str(folder)))):
        tensor.external_data.add(key=key, value=value)


def without_folder(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A copy of a reference as a saved model holds it: its location relative to the model's folder."""
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    kept = [(e.key, e.value) for e in tensor.external_data if e.key != FOLDER_KEY]
    del copy.external_data[:]
    for key, value in kept:
        copy.external_data.add(key=key, value=value)
    return copy


def in_one_folder(tensors: Iterable[onnx.TensorProto]) -> Path | None:
    """Make each of `tensors` (a model's weights) that lies in a data file refer to it from one folder, the
    deepest holding every such file, and give that folder (None: none is in a data file): ONNX Runtime and
    TensorRT take a model as bytes and resolve its data files from one folder, and accudiff's models refer
    to files in several (the user's weights where they are, its own in its scratch folder), which are
    neither copied nor linked. Raises ValueError where no folder holds them all (two drives)."""
    external = [init for init in tensors if is_external(init)]
    files = [os.path.realpath(data_file(init)[0]) for init in external]  # as ONNX Runtime checks them: links resolved
    if not files:
        return None
    folder = os.path.commonpath([os.path.dirname(file) for file in files])
    for init, file in zip(external, files):
        kept = [(e.key, e.value) for e in init.external_data if e.key not in (FOLDER_KEY, "location")]
        del init.external_data[:]
        init.external_data.add(key="location", value=os.path.relpath(file, folder))
        for key, value in kept:
            init.external_data.add(key=key, value=value)
    return Path(folder)


def same_folder(a: Path | None, b: Path) -> bool:
    return a is not None and _real_path(str(a)) == _real_path(str(b))


@functools.lru_cache(maxsize=256)
def _real_path(path: str) -> str:
    """A folder's real path, asked once per folder: a model saved asks it of each of its weights."""
    return os.path.realpath(path)


def stored_dtype(tensor: onnx.TensorProto) -> np.dtype:
    """The dtype a weight's bytes are in: ONNX stores them little-endian."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
