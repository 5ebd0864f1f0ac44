"""The number formats a candidate stores values in, and what each can hold.

A candidate computes in FP32 except where it stores values in a narrower format: FP16 or BF16 (a Cast, or
a weight or value of that type), or a grid behind a QuantizeLinear/DequantizeLinear pair (INT8, FP8,
INT4...). A run's precision names those formats, quantized ones first: "fp16", "int8", "int8+fp16",
"fp8+fp16". The tolerances, the range findings and the wording follow the formats a run's precision names.
"""

from __future__ import annotations

import functools
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from accudiff.model.graph import GraphIndex
from accudiff.model.quantized_ops import find_quantized_ops, quantized_members
from accudiff.model.weights import weight_values

FP16_MAX = 65504.0
REDUCED_FLOATS = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
# Quantized formats first: static grids (Q/DQ pairs on activations and weights), activations quantized as the
# model runs (`-dynamic`), weights alone (`-weight`: activations stay float); then the narrow floats.
FORMAT_ORDER = ("int8", "int8-dynamic", "fp8", "int4", "fp4", "int8-weight", "int4-weight", "int2-weight", "fp16", "bf16")
QUANTIZED_FORMATS = frozenset(FORMAT_ORDER[:-2])
WEIGHT_ONLY = {"int8": "int8-weight", "int4": "int4-weight"}  # a grid only weights are stored on


@dataclass(frozen=True)
class Grid:
    """A quantized element type: its codes run from `low` to `high`, and the smallest nonzero magnitude it
    holds is `smallest` (1 for integers; a subnormal for the small floats, which saturate at `high`)."""

    format: str
    name: str
    low: float
    high: float
    smallest: float = 1.0
    top_step: float = 1.0  # the step below `high`: a value within half of it past an end rounds to the end

    @property
    def is_float(self) -> bool:
        return self.format in ("fp8", "fp4")


GRIDS = {
    TensorProto.INT8: Grid("int8", "INT8", -128, 127),
    TensorProto.UINT8: Grid("int8", "UINT8", 0, 255),
    TensorProto.INT4: Grid("int4", "INT4", -8, 7),
    TensorProto.UINT4: Grid("int4", "UINT4", 0, 15),
    TensorProto.FLOAT8E4M3FN: Grid("fp8", "FP8 E4M3", -448, 448, 2.0**-9, 32),
    TensorProto.FLOAT8E4M3FNUZ: Grid("fp8", "FP8 E4M3 (FNUZ)", -240, 240, 2.0**-10, 16),
    TensorProto.FLOAT8E5M2: Grid("fp8", "FP8 E5M2", -57344, 57344, 2.0**-16, 8192),
    TensorProto.FLOAT8E5M2FNUZ: Grid("fp8", "FP8 E5M2 (FNUZ)", -57344, 57344, 2.0**-17, 8192),
}
if hasattr(TensorProto, "FLOAT4E2M1"):
    GRIDS[TensorProto.FLOAT4E2M1] = Grid("fp4", "FP4 E2M1", -6, 6, 0.5, 2)

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
    become 0. `scale` is the quantizer's scale; `grid` names the element type ("INT8", "FP8 E4M3").
    `levels` > 0: a grid the model sets as it runs, each sample's own range (0 included) in that many steps
    (ONNX Runtime's dynamic quantization); its other fields are then those of no sample."""

    scale: float
    low: float
    high: float
    step: float
    grid: str = "INT8"
    levels: int = 0

    @classmethod
    def at_run_time(cls, levels: int, grid: str) -> QuantRange:
        return cls(0.0, 0.0, 0.0, 0.0, grid, levels)

    def of_sample(self, low: float, high: float) -> QuantRange:
        """A run-time grid as one sample's range [low, high] sets it."""
        low, high = min(low, 0.0), max(high, 0.0)
        step = (high - low) / self.levels
        return QuantRange(step, low, high, step, self.grid)

    @property
    def format(self) -> str:
        return next(g.format for g in GRIDS.values() if g.name == self.grid)

    @property
    def clipped_beyond(self) -> tuple[float, float]:
        """The values that clip (or saturate, FP8): those more than half the grid's last step past either end
        (nearer, a value rounds to the end as any value rounds to its nearest, losing no more). A trained
        recognizer's input range of -0.0296..7.53 held 34.6% of its values below -0.0296, none below
        -0.035: read as "they clip", though none did."""
        margin = self.scale * next(g.top_step for g in GRIDS.values() if g.name == self.grid) / 2
        return self.low - margin, self.high + margin


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
    """The formats a (shape-inferred) graph stores values in: its quantized ops' (quantized_ops.py), its Q/DQ
    grids (an integer grid only weights are read from, by nodes whose activations stay float, is that
    grid's `-weight` format), and FP16/BF16 wherever a weight, a value or a Cast has that type."""
    index = GraphIndex.of(graph)
    types = index.types
    ops = find_quantized_ops(index)
    members = quantized_members(ops)
    found = {f for op in ops for f in op.formats}
    weight_only = _weight_only_dequantizers(index)
    for node in graph.node:
        kind = grid_type(node, types) if node.name not in members else None
        if kind in GRIDS:
            grid = GRIDS[kind].format
            found.add(WEIGHT_ONLY.get(grid, grid) if node.name in weight_only else grid)
    found |= {REDUCED_FLOATS[kind] for kind in types.values() if kind in REDUCED_FLOATS}
    found |= {REDUCED_FLOATS[a.i] for node in graph.node if node.op_type == "Cast" for a in node.attribute if a.name == "to" and a.i in REDUCED_FLOATS}
    return [f for f in FORMAT_ORDER if f in found]


def _weight_only_dequantizers(index: GraphIndex) -> set[str]:
    """The DequantizeLinear nodes of weights (constants, or constants behind a QuantizeLinear) read only by
    nodes that read no other dequantized value: their activations stay float."""
    constants, producer = index.constants, index.producer

    def dequantizer(name: str) -> tuple[onnx.NodeProto | None, bool]:
        node = producer.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            return None, False
        source = producer.get(node.input[0])
        quantized = source.input[0] if source is not None and source.op_type == "QuantizeLinear" else node.input[0]
        return node, quantized in constants

    weights, readers_of_activations = {}, set()
    for node in index.graph.node:
        read = [dequantizer(name) for name in node.input]
        if any(d is not None and not is_weight for d, is_weight in read):
            readers_of_activations.update(d.name for d, _ in read if d is not None)
        for d, is_weight in read:
            if d is not None and is_weight:
                weights[d.name] = d
    return set(weights) - readers_of_activations


def quant_ranges(index: GraphIndex) -> dict[str, QuantRange]:
    """The grid of every tensor a QuantizeLinear quantizes with one scale (per-channel scales are weights'),
    by the name of the value it quantizes."""
    constants, types = index.constants, index.types
    ranges: dict[str, QuantRange] = {}
    for node in index.graph.node:
        kind = grid_type(node, types) if node.op_type == "QuantizeLinear" else None
        if kind not in GRIDS or node.input[1] not in constants:
            continue
        scale = weight_values(constants[node.input[1]]).astype(np.float64)
        if scale.size != 1:
            continue
        grid, step = GRIDS[kind], float(scale.reshape(()))
        zero_point = constants.get(node.input[2]) if len(node.input) > 2 else None
        offset = 0.0 if zero_point is None or grid.is_float else float(weight_values(zero_point).astype(np.float64).reshape(-1)[0])
        ranges[node.input[0]] = QuantRange(step, (grid.low - offset) * step, (grid.high - offset) * step, grid.smallest * step, grid.name)
    return ranges


# Ops ONNX Runtime's tools write that TensorRT's ONNX parser does not take (besides every com.microsoft op).
NOT_FOR_TENSORRT = frozenset({"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"})


def file_formats(path: str | Path) -> list[str]:
    """The formats the model file at `path` stores values in (read without its weights' data files and
    without shape inference: weights, Casts and Q/DQ nodes tell); [] for a file that is not a model (the
    loading stage says what is wrong with it)."""
    return list(_file_facts(path)[0])


def onnxruntime_only_ops(path: str | Path) -> list[str]:
    """The op types of the model file at `path` that only ONNX Runtime runs (its com.microsoft ops, dynamic
    quantization's integer ops): TensorRT's ONNX parser takes none of them."""
    return list(_file_facts(path)[1])


def _file_facts(path: str | Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    path = Path(path)
    try:
        found = path.stat()
    except OSError:
        return (), ()
    if not stat.S_ISREG(found.st_mode):  # a device or a pipe is read without end (/dev/zero filled 24 GB)
        return (), ()
    return _read_file_facts(str(path.resolve()), found.st_mtime_ns, found.st_size)


@functools.lru_cache(maxsize=8)
def _read_file_facts(path: str, modified: int, size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - any unreadable file: the loading stage says why, in one sentence
        return (), ()
    ours = sorted({n.op_type for n in proto.graph.node if n.domain == "com.microsoft" or (n.domain in ("", "ai.onnx") and n.op_type in NOT_FOR_TENSORRT)})
    return tuple(model_formats(proto.graph)), tuple(ours)
