"""protobuf's wire format, walked where a model's weights are concerned: where the raw bytes of each main-graph
weight lie in a serialized model (`spans_in_file`), and the model's bytes without them (`without_raw_data`),
so that a model read from a file need never hold its large weights in memory: they stay in the file, and
weights.py reads them there when a value is needed. The other way, `write_with_weights` writes a model whose
weights are copied into it from their files as it is written, none of them held whole."""

from __future__ import annotations

from typing import BinaryIO, Callable, Iterator, Sequence

_GRAPH, _INITIALIZER, _NAME, _RAW_DATA = 7, 5, 8, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.name, .raw_data
_LENGTH_DELIMITED = 2


def spans_in_file(data) -> dict[str, tuple[int, int]]:
    """Where the bytes of each main-graph weight held as raw data lie in a serialized model (bytes, or any
    buffer: an mmap of the file): name -> (offset, length). Only the messages on the way are walked;
    nothing is copied."""
    view = memoryview(data)
    spans = {}
    for graph_start, graph_end in _fields(view, 0, len(view), _GRAPH):
        for start, end in _fields(view, graph_start, graph_end, _INITIALIZER):
            name, raw = _name_and_raw(view, start, end)
            if name is not None and raw is not None:
                spans[name] = (raw[0], raw[1] - raw[0])
    return spans


def without_raw_data(data, smallest: int) -> bytes:
    """The serialized model `data` without the raw data of its main-graph weights of more than `smallest`
    bytes (everything else as it is): parsed, it holds none of their bytes; `spans_in_file(data)` says
    where they are."""
    view = memoryview(data)
    out = bytearray()
    for number, wire, key_start, start, end in _all_fields(view, 0, len(view)):
        if number != _GRAPH or wire != _LENGTH_DELIMITED:
            out += view[key_start:end]
            continue
        graph = bytearray()
        for inner, inner_wire, inner_key, inner_start, inner_end in _all_fields(view, start, end):
            name, raw = _name_and_raw(view, inner_start, inner_end) if inner == _INITIALIZER and inner_wire == _LENGTH_DELIMITED else (None, None)
            if raw is None or raw[1] - raw[0] <= smallest:
                graph += view[inner_key:inner_end]
                continue
            tensor = b"".join(bytes(view[k:e]) for n, _, k, _, e in _all_fields(view, inner_start, inner_end) if n != _RAW_DATA)
            graph += _key(_INITIALIZER) + _encoded(len(tensor)) + tensor
        out += _key(_GRAPH) + _encoded(len(graph)) + graph
    return bytes(out)


def write_with_weights(target: BinaryIO, model: bytes, graph: bytes, weights: Sequence[tuple[bytes, int, Callable[[BinaryIO], int] | None]]) -> None:
    """Write a serialized ModelProto to the open file `target`: `model` (its fields but the graph), then the
    graph: `graph` (its fields but the weights), then each weight in order, a TensorProto whose `head` (its
    fields but the raw data) is followed by `length` bytes of raw data that `copy(target)` writes (without
    `copy`: `head` is the whole tensor). A field's place in its message is free to protobuf, which reads the
    weights as the graph's initializers in this order."""
    fields = [(_key(_INITIALIZER) + _encoded(len(head) + len(raw) + length) + head + raw, length, copy)
              for head, length, copy in weights for raw in [_key(_RAW_DATA) + _encoded(length) if copy is not None else b""]]
    target.write(model)
    target.write(_key(_GRAPH) + _encoded(len(graph) + sum(len(prefix) + (length if copy else 0) for prefix, length, copy in fields)))
    target.write(graph)
    for prefix, length, copy in fields:
        target.write(prefix)
        if copy is not None and copy(target) != length:
            raise ValueError("a weight's data file holds fewer bytes than it says")


def _name_and_raw(view: memoryview, start: int, end: int) -> tuple[str | None, tuple[int, int] | None]:
    """A TensorProto's name and the span of its raw data (a field written twice is its last value to protobuf too)."""
    name = next(reversed([bytes(view[a:b]).decode("utf-8", "replace") for a, b in _fields(view, start, end, _NAME)]), None)
    raw = next(reversed(list(_fields(view, start, end, _RAW_DATA))), None)
    return name, raw


def _fields(view: memoryview, start: int, end: int, wanted: int) -> Iterator[tuple[int, int]]:
    """The (start, end) of each length-delimited field numbered `wanted` in the message at view[start:end]."""
    for number, wire, _, value_start, value_end in _all_fields(view, start, end):
        if number == wanted and wire == _LENGTH_DELIMITED:
            yield value_start, value_end


def _all_fields(view: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Every field of the message at view[start:end]: (number, wire type, where its key starts, where its
    value starts, where it ends)."""
    position = start
    while position < end:
        key_start = position
        key, position = _varint(view, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value_start = position
            _, position = _varint(view, position)
        elif wire == 1:
            value_start, position = position, position + 8
        elif wire == 5:
            value_start, position = position, position + 4
        elif wire == _LENGTH_DELIMITED:
            length, value_start = _varint(view, position)
            position = value_start + length
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        if position > end:
            raise ValueError("a protobuf field runs past the end of its message")
        yield number, wire, key_start, value_start, position


def _varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _key(number: int) -> bytes:
    return _encoded(number << 3 | _LENGTH_DELIMITED)


def _encoded(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
