"""The number formats a candidate stores values in, and what each can hold.

A candidate computes in FP32 except where it stores values in a narrower format: FP16 or BF16 (a Cast, or
a weight or value of that type), or a grid behind a QuantizeLinear/DequantizeLinear pair (INT8, FP8,
INT4...). A run's precision names those formats, quantized ones first: "fp16", "int8", "int8+fp16",
"fp8+fp16". The tolerances, the range findings and the wording follow the formats a run's precision names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

FP16_MAX = 65504.0
REDUCED_FLOATS = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
FORMAT_ORDER = ("int8", "fp8", "int4", "fp4", "fp16", "bf16")
QUANTIZED_FORMATS = frozenset(FORMAT_ORDER[:4])


@dataclass(frozen=True)
class Grid:
    """A quantized element type: its codes run from `low` to `high`, and the smallest nonzero magnitude it
    holds is `smallest` (1 for integers; a subnormal for the small floats, which saturate at `high`)."""

    format: str
    name: str
    low: float
    high: float
    smallest: float = 1.0

    @property
    def is_float(self) -> bool:
        return self.format in ("fp8", "fp4")


GRIDS = {
    TensorProto.INT8: Grid("int8", "INT8", -128, 127),
    TensorProto.UINT8: Grid("int8", "UINT8", 0, 255),
    TensorProto.INT4: Grid("int4", "INT4", -8, 7),
    TensorProto.UINT4: Grid("int4", "UINT4", 0, 15),
    TensorProto.FLOAT8E4M3FN: Grid("fp8", "FP8 E4M3", -448, 448, 2.0**-9),
    TensorProto.FLOAT8E4M3FNUZ: Grid("fp8", "FP8 E4M3 (FNUZ)", -240, 240, 2.0**-10),
    TensorProto.FLOAT8E5M2: Grid("fp8", "FP8 E5M2", -57344, 57344, 2.0**-16),
    TensorProto.FLOAT8E5M2FNUZ: Grid("fp8", "FP8 E5M2 (FNUZ)", -57344, 57344, 2.0**-17),
}
if hasattr(TensorProto, "FLOAT4E2M1"):
    GRIDS[TensorProto.FLOAT4E2M1] = Grid("fp4", "FP4 E2M1", -6, 6, 0.5)

# Element types numpy cannot carry through ONNX Runtime's Python API (it refuses BF16 and hands FP8 over
# as raw bytes), each with the type it is carried in: every value of the first is exactly a value of the second.
CARRIED_AS = {
    TensorProto.BFLOAT16: TensorProto.FLOAT,
    **{kind: TensorProto.FLOAT for kind, grid in GRIDS.items() if grid.is_float},
    TensorProto.INT4: TensorProto.INT8,
    TensorProto.UINT4: TensorProto.UINT8,
}


@dataclass(frozen=True)
class QuantRange:
    """The grid a tensor is quantized onto, in the tensor's own units: values beyond `low..high` clip (an
    integer grid) or saturate (FP8), and values below half of `step`, the smallest magnitude it holds,
    become 0. `scale` is the quantizer's scale; `grid` names the element type ("INT8", "FP8 E4M3")."""

    scale: float
    low: float
    high: float
    step: float
    grid: str = "INT8"

    @property
    def format(self) -> str:
        return next(g.format for g in GRIDS.values() if g.name == self.grid)


def precision_label(formats: Iterable[str]) -> str:
    """The precision of a candidate holding `formats` ("fp32" when it holds none)."""
    present = set(formats)
    return "+".join(f for f in FORMAT_ORDER if f in present) or "fp32"


def formats_of(precision: str) -> frozenset[str]:
    """The formats a precision names: "int8+fp16" -> {"int8", "fp16"}; "fp32" -> none."""
    return frozenset() if precision == "fp32" else frozenset(precision.split("+"))


def is_precision_label(text: str) -> bool:
    parts = text.split("+")
    return text == "fp32" or (all(p in FORMAT_ORDER for p in parts) and precision_label(parts) == text)


def constant_values(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's constants by name: initializers and the values of Constant nodes."""
    found = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            found[node.output[0]] = node.attribute[0].t
    return found


def value_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The element type of every value the graph declares (inputs, outputs, value_info, constants)."""
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.value_info, *graph.output] if vi.type.HasField("tensor_type")}
    types.update((name, tensor.data_type) for name, tensor in constant_values(graph).items())
    return {name: kind for name, kind in types.items() if kind}


def grid_type(node: onnx.NodeProto, types: Mapping[str, int]) -> int | None:
    """The quantized element type of a QuantizeLinear (its output) or DequantizeLinear (its input)."""
    if node.op_type == "DequantizeLinear":
        return types.get(node.input[0])
    if node.op_type != "QuantizeLinear":
        return None
    if len(node.input) > 2 and node.input[2] in types:
        return types[node.input[2]]
    return next((a.i for a in node.attribute if a.name == "output_dtype" and a.i), TensorProto.UINT8)


def model_formats(graph: onnx.GraphProto) -> list[str]:
    """The formats a (shape-inferred) graph stores values in: its Q/DQ grids, and FP16/BF16 wherever a
    weight, a value or a Cast has that type."""
    types = value_types(graph)
    found = {GRIDS[kind].format for node in graph.node if (kind := grid_type(node, types)) in GRIDS}
    found |= {REDUCED_FLOATS[kind] for kind in types.values() if kind in REDUCED_FLOATS}
    found |= {REDUCED_FLOATS[a.i] for node in graph.node if node.op_type == "Cast" for a in node.attribute if a.name == "to" and a.i in REDUCED_FLOATS}
    return [f for f in FORMAT_ORDER if f in found]


def quant_ranges(graph: onnx.GraphProto) -> dict[str, QuantRange]:
    """The grid of every tensor a QuantizeLinear quantizes with one scale (per-channel scales are weights'),
    by the name of the value it quantizes."""
    constants, types = constant_values(graph), value_types(graph)
    ranges: dict[str, QuantRange] = {}
    for node in graph.node:
        kind = grid_type(node, types) if node.op_type == "QuantizeLinear" else None
        if kind not in GRIDS or node.input[1] not in constants:
            continue
        scale = numpy_helper.to_array(constants[node.input[1]]).astype(np.float64)
        if scale.size != 1:
            continue
        grid, step = GRIDS[kind], float(scale.reshape(()))
        zero_point = constants.get(node.input[2]) if len(node.input) > 2 else None
        offset = 0.0 if zero_point is None or grid.is_float else float(numpy_helper.to_array(zero_point).astype(np.float64).reshape(-1)[0])
        ranges[node.input[0]] = QuantRange(step, (grid.low - offset) * step, (grid.high - offset) * step, grid.smallest * step, grid.name)
    return ranges


def file_formats(path: str | Path) -> list[str]:
    """The formats the model file at `path` stores values in (read without its weights' data files and
    without shape inference: weights, Casts and Q/DQ nodes tell); [] for a file that is not a model (the
    loading stage says what is wrong with it)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return []
    return list(_file_formats(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _file_formats(path: str, modified: int, size: int) -> tuple[str, ...]:
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - any unreadable file: the loading stage says why, in one sentence
        return ()
    return tuple(model_formats(proto.graph))
