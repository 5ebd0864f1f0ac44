"""Cut a model, in topological order, into segments whose marked tensors fit a memory budget.

Comparing every tensor means holding them: a model's intermediate tensors can exceed the machine's memory
while two plain runs of it fit easily. So the comparison runs the graph one segment at a time, each fed
the previous segments' boundary tensors, and drops a tensor as soon as no later segment reads it. A model
whose tensors fit the budget is one segment: the one-shot path.

Sizes come from shape inference with the inputs fixed to the shapes compared. A tensor whose size stays
unknown (data-dependent shapes) is estimated as large as the largest tensor its node reads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import onnx

from accudiff.errors import AccudiffError
from accudiff.model.inventory import ModelInfo
from accudiff.model.shapes import infer_shapes_in_place, shape_inference_copy

DEFAULT_MAX_MEMORY = 256 << 20
# A segment's compared tensors are held twice at once (the reference's and one pass's), beside the values
# later segments need and the statistics pass's buffers: a segment gets a third of the budget.
SEGMENTS_PER_BUDGET = 3
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def memory_budget(given: int | str | None = None) -> int:
    """Bytes the compared tensors may take: `given` (a number of bytes, or "512M", "2G", "1.5GB"), else
    256 MiB or a quarter of the memory available now, whichever is smaller."""
    if given is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else DEFAULT_MAX_MEMORY * 4
        return min(DEFAULT_MAX_MEMORY, available // 4)
    if isinstance(given, (int, float)):
        value = float(given)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)[iI]?[bB]?\s*", given)
        if not match:
            raise AccudiffError(f"--max-memory '{given}' is not a size such as 512M or 2G")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 16 << 20:
        raise AccudiffError(f"--max-memory {given} is below 16M, too little to compare anything")
    return int(value)


@dataclass(frozen=True)
class Segment:
    """Consecutive nodes (indices into the model's node list) and the bytes their outputs take."""

    nodes: range
    tensor_bytes: int


def tensor_sizes(info: ModelInfo, input_shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Bytes of every node output (and graph input) for inputs of the given shapes."""
    light = shape_inference_copy(info.proto)  # a large weight's shape is known, or its consumer would be sized like it
    initializers = {init.name: init for init in info.proto.graph.initializer}
    for vi in light.graph.input:
        if vi.name in input_shapes:
            shape = vi.type.tensor_type.shape
            del shape.dim[:]
            for size in input_shapes[vi.name]:
                shape.dim.add().dim_value = int(size)
    del light.graph.value_info[:]
    infer_shapes_in_place(light)
    sizes = {init.name: _bytes(init.data_type, init.dims) for init in initializers.values()}
    for vi in [*light.graph.input, *light.graph.value_info, *light.graph.output]:
        kind = vi.type.tensor_type
        if kind.elem_type and kind.HasField("shape") and all(d.HasField("dim_value") for d in kind.shape.dim):
            sizes[vi.name] = _bytes(kind.elem_type, [d.dim_value for d in kind.shape.dim])
    for node in info.proto.graph.node:  # unknown sizes: as large as the largest input
        largest = max((sizes.get(name, 0) for name in node.input if name), default=0)
        for out in node.output:
            if out and out not in sizes:
                sizes[out] = largest
    return sizes


def plan_segments(info: ModelInfo, sizes: Mapping[str, int], budget: int) -> list[Segment]:
    """Consecutive node ranges whose compared outputs take at most `budget` bytes each (a single node
    larger than that forms a segment of its own)."""
    compared = {t.name for t in info.tensors}
    segments, start, used = [], 0, 0
    for index, node in enumerate(info.proto.graph.node):
        size = sum(sizes.get(out, 0) for out in node.output if out in compared)
        if index > start and used + size > budget:
            segments.append(Segment(range(start, index), used))
            start, used = index, 0
        used += size
    segments.append(Segment(range(start, len(info.proto.graph.node)), used))
    return segments


def _bytes(elem_type: int, dims) -> int:
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize if elem_type else 4
    return int(np.prod([max(int(d), 0) for d in dims], dtype=np.int64)) * itemsize


def place_nodes(nodes: Sequence[onnx.NodeProto], node_segment: Mapping[str, int], count: int, produced_in: Mapping[str, int]) -> list[int]:
    """The segment of each node of a model (the reference's, or a candidate's) cut where the original model's
    nodes were (`node_segment`): its own for nodes of the original model; for a node of another name that
    writes a value the original model makes (a quantizer's `X_Q4` writing X's output), that value's; its
    first reader's for nodes a transform added (casts, Q/DQ), the last one for nodes only graph outputs
    read; never one before the segment of a node it reads."""
    placed = [node_segment.get(node.name, next((produced_in[o] for o in node.output if o in produced_in), -1)) for node in nodes]
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(index)
    for index in reversed(range(len(nodes))):
        if placed[index] < 0:
            segments = [placed[r] for o in nodes[index].output for r in readers.get(o, []) if placed[r] >= 0]
            placed[index] = min(segments) if segments else count - 1
    # A candidate made by another tool may compute a node of the model's later segment before one of an
    # earlier segment reads it: no node runs before what it reads (Constants come along with any cut).
    producer = {o: index for index, node in enumerate(nodes) if node.op_type != "Constant" for o in node.output if o}
    for index, node in enumerate(nodes):
        placed[index] = max([placed[index], *(placed[producer[name]] for name in node.input if name in producer)])
    return placed
