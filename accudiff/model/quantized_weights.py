"""A quantized op's weights as floats, and what their grids lose: the arithmetic behind keeping, the float
form and the weight findings of the ops quantized_ops.py recognises. Dequantization is (code - zero point)
x scale in FP32, as ONNX Runtime computes it."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np
import onnx

from accudiff.model.graph import GraphIndex
from accudiff.model.quantized_ops import QuantizedOp, QuantizedWeight
from accudiff.text import percent
from accudiff.model.weights import PACKED_4BIT, is_external, stored_dtype, unpack_codes, weight_blocks, weight_values


def float_weight(weight: QuantizedWeight, constants: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    """The weight's values as floats, in the float op's layout: (code - zero point) x scale, in FP32 as
    ONNX Runtime dequantizes."""
    if weight.layout == "runtime":
        return weight_values(constants[weight.codes]).astype(np.float32)
    codes = weight_values(constants[weight.codes])
    scale = weight_values(constants[weight.scale]).astype(np.float32)
    if weight.scale_divisor:
        scale = scale / weight_values(constants[weight.scale_divisor]).astype(np.float32)
    if weight.layout == "nbits":
        return _nbits(weight, codes, scale, constants)
    if dict(weight.extra).get("packed"):
        codes = unpack_codes(codes, weight.bits, codes.size * (8 // weight.bits)).reshape(*codes.shape[:-1], -1)
    zero = weight_values(constants[weight.zero_point]).astype(np.float32) if weight.zero_point else _default_zero(weight, codes)
    if scale.size == 1 and zero.size == 1 and codes.dtype.itemsize == 1 and weight.layout != "lstm":
        # One scale and zero point: the at most 256 values the codes stand for, looked up (the same FP32
        # arithmetic, one pass over an embedding table instead of three).
        byte = np.arange(256, dtype=np.uint8)
        stood_for = byte.view(np.int8) if codes.dtype.kind == "i" else byte  # the code each byte holds
        table = (stood_for.astype(np.float32) - zero.reshape(())) * scale.reshape(())
        return table[codes.view(np.uint8)]
    values = codes.astype(np.float32)
    if weight.layout == "lstm":  # one scale, or one per direction, or one per direction and gate row: along the last axis
        shape = (scale.shape[0], 1, -1) if scale.size > 1 else ()
        return np.ascontiguousarray(((values - zero.reshape(shape)) * scale.reshape(shape)).transpose(0, 2, 1), np.float32)
    return ((values - _along(zero, values, weight)) * _along(scale, values, weight)).astype(np.float32)


def _default_zero(weight: QuantizedWeight, codes: np.ndarray) -> np.ndarray:
    """A missing zero point: 0 for signed codes, the grid's middle for unsigned ones read as a block table."""
    unsigned = codes.dtype.kind == "u" and weight.block_size
    return np.array(2.0 ** (weight.bits - 1) if unsigned else 0.0, np.float32)


def _along(factor: np.ndarray, values: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """A scale or zero point broadcast over the codes: one number, one per index along the axis, or one per
    block of indices along it."""
    if factor.size == 1:
        return factor.reshape(())
    axis = weight.axis % values.ndim
    if weight.block_size:
        return np.repeat(factor, weight.block_size, axis=axis).take(np.arange(values.shape[axis]), axis=axis)
    shape = [1] * values.ndim
    shape[axis] = -1
    return factor.reshape(shape)


def _nbits(weight: QuantizedWeight, packed: np.ndarray, scale: np.ndarray, constants: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    """MatMulNBits' B as the [K, N] float weight: codes packed low bits first along K, a scale (and zero
    point: packed codes, floats, or the grid's middle) per block of K and column."""
    sizes = dict(weight.extra)
    k, n, block = sizes["K"], sizes["N"], weight.block_size
    blocks = -(-k // block)
    codes = unpack_codes(packed, weight.bits, packed.size * (8 // weight.bits)).reshape(n, -1)[:, :k].astype(np.float32)
    scale = scale.reshape(n, blocks)
    if weight.zero_point is None:
        zero = np.full((n, blocks), 2.0 ** (weight.bits - 1), np.float32)
    else:
        stored = weight_values(constants[weight.zero_point])
        zero = (stored.astype(np.float32).reshape(n, blocks) if stored.dtype.kind == "f"
                else unpack_codes(stored, weight.bits, stored.size * (8 // weight.bits)).reshape(n, -1)[:, :blocks].astype(np.float32))
    index = weight_values(constants[weight.group_index]).astype(np.int64) if weight.group_index else np.arange(k) // block
    return np.ascontiguousarray(((codes - zero[:, index]) * scale[:, index]).T, np.float32)


CHANNEL_BLOCK_BYTES = 8 << 20  # a weight's channels are measured this much of it at a time
BLOCK_FINDING_SHARE = 0.01  # blocks that lose most of their values: below this share of them, noise


def quantized_weight_findings(ops: Iterable[QuantizedOp], graph: GraphIndex, reference: GraphIndex) -> Callable[[], dict[str, tuple[str, str]]]:
    """What the ops' weight grids lose, by op: a weight with one scale whose step zeroes whole output
    channels ("per_tensor_scale"), or blocks whose step, set by their largest values, rounds most of their
    values to 0 ("block_scale"). The float weight judged is the reference's where it has one. Returned as the
    measuring still to do, reading its own copies of the tensors it needs (their values stay in their files),
    so it may run on a thread while the graphs change (see deferred.py)."""
    theirs = reference.constants
    nodes = {node.name: node for node in reference.graph.node}
    checks = []
    for op in ops:
        for weight in op.weights:
            original = nodes.get(op.node)
            name = original.input[weight.position] if original is not None and weight.position < len(original.input) else None
            checks.append((op, weight, weight_constants(weight, graph.constants), copied(theirs.get(name)) if name else None))

    def measure() -> dict[str, tuple[str, str]]:
        found = {}
        for op, weight, constants, original in checks:
            if op.node not in found and (said := _weight_finding(op, weight, constants, original)) is not None:
                found[op.node] = said
        return found

    return measure


def weight_constants(weight: QuantizedWeight, constants: Mapping[str, onnx.TensorProto]) -> dict[str, onnx.TensorProto]:
    """Copies of the constants a quantized weight is read back from (its codes, scale, zero point...)."""
    names = (weight.codes, weight.scale, weight.zero_point, weight.group_index, weight.scale_divisor)
    return {name: copied(constants[name]) for name in names if name and name in constants}


def copied(tensor: onnx.TensorProto | None) -> onnx.TensorProto | None:
    """A copy of `tensor` (a weight in a data file: only where its bytes lie)."""
    if tensor is None:
        return None
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    return copy


def _weight_finding(op: QuantizedOp, weight: QuantizedWeight, constants: Mapping[str, onnx.TensorProto], original: onnx.TensorProto | None) -> tuple[str, str] | None:
    if weight.layout == "nbits" and weight.zero_point is None and weight.group_index is None:
        return _said_of_blocks(weight, _nbits_zero_shares(weight, weight_values(constants[weight.codes])))
    if weight.block_size or weight.layout == "nbits":
        return _zeroed_blocks(op, weight, float_weight(weight, constants))
    if weight.layout == "lstm":
        return None
    if weight.layout == "runtime":
        values = weight_values(constants[weight.codes])
        step = (max(float(values.max()), 0.0) - min(float(values.min()), 0.0)) / 255
        said = per_tensor_loss(values, op.op_type, step, "UINT8 (its range taken as the model runs)", weight.codes)
        return ("per_tensor_scale", said) if said else None
    scale = weight_values(constants[weight.scale])
    if scale.size != 1 or original is None:
        return None
    said = per_tensor_loss(original, op.op_type, float(scale.reshape(())), f"{weight.bits}-bit codes", original.name)
    return ("per_tensor_scale", said) if said else None


ZEROED_SHARE = 0.1  # a weight's nonzero values that one scale rounds to 0: from this share on, a finding


def per_tensor_loss(weight: onnx.TensorProto | np.ndarray, op_type: str, step: float, grid: str, name: str) -> str | None:
    """What a weight quantized with one scale (a step of `step`) loses: its nonzero values below half a
    step, which become 0 (said from ZEROED_SHARE of them on: a few large values set a step the rest fall
    under), and the output channels (along the axis per-channel quantization would use) that hold only
    such values; beside it, what a scale per channel (the same grid fitted to each channel's largest
    value) would zero. None when neither. A weight in its data file is read a block at a time."""
    shape = tuple(weight.dims) if isinstance(weight, onnx.TensorProto) else weight.shape
    if not shape or 0 in shape:
        return None
    axis = channel_axis(shape, op_type)
    if shape[axis] < 2:
        return None
    magnitude = _channel_magnitudes(weight, shape, axis)
    largest = float(magnitude.max())
    if largest == 0:
        return None
    lost = (magnitude > 0) & (magnitude < step / 2)
    nonzero, zeroed, per_channel, setting = _zero_counts(weight, shape, axis, step, step * magnitude / largest, largest)
    share = zeroed / max(nonzero, 1)
    if not lost.any() and share < ZEROED_SHARE:
        return None
    said = f"its weight '{name}' is quantized to {grid} with one scale (a step of {step:.3g}) for all its {shape[axis]} channels along axis {axis}"
    held = f"(the largest {float(magnitude[lost].max()):.3g})" if lost.any() else ""
    if share < ZEROED_SHARE:
        return f"{said}: {int(lost.sum())} of them hold only values below half a step {held} and become 0; per-channel scales would keep them"
    said += (f", a step its largest values set ({setting} of its {nonzero} nonzero values lie beyond half its largest magnitude, {largest:.3g}): "
             f"{percent(share)} of them lie below half a step and become 0 (with a scale per channel, {percent(per_channel / max(nonzero, 1))})")
    return said + (f"; {int(lost.sum())} of its channels hold only such values {held}, which per-channel scales would keep" if lost.any() else "")


PER_CHANNEL_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})  # the ops whose weights quantizers scale per output channel


def channel_axis(shape: tuple[int, ...], op_type: str) -> int:
    """The axis of a weight's output channels, along which per-channel quantization gives each index its
    own scale: by the op reading it, else (an elementwise weight) its longest axis."""
    axis = {"Conv": 0, "ConvTranspose": 1 % len(shape), "MatMul": len(shape) - 1, "Gemm": len(shape) - 1}.get(op_type)
    return int(np.argmax(shape)) if axis is None else axis


def per_channel_grid(values: np.ndarray, op_type: str, bits: int) -> np.ndarray:
    """`values` quantized with a scale per output channel and read back: symmetric signed codes of `bits`,
    each channel's step its largest magnitude over the largest code (as ONNX Runtime's quantizers scale a
    weight with per_channel=True), codes rounded half to even; what per-channel scales would make of it."""
    axis = channel_axis(values.shape, op_type)
    largest = 2 ** (bits - 1) - 1
    others = tuple(i for i in range(values.ndim) if i != axis)
    magnitude = np.abs(values).max(axis=others, keepdims=True).astype(np.float32)
    step = np.where(magnitude > 0, magnitude / np.float32(largest), np.float32(1))
    return (np.clip(np.rint(values / step), -largest, largest) * step).astype(np.float32)


def _slices(weight: onnx.TensorProto | np.ndarray, shape: tuple[int, ...]) -> Iterable[np.ndarray]:
    """A weight's values in blocks of whole slices along its first axis, about CHANNEL_BLOCK_BYTES each: of
    a weight in its data file, read a block at a time (an embedding table read whole was 47 MB of
    MiniLM's caller at its peak); of one in memory, views."""
    if isinstance(weight, np.ndarray) or weight.data_type in PACKED_4BIT or not is_external(weight):
        values = weight if isinstance(weight, np.ndarray) else weight_values(weight)
        rows = max(CHANNEL_BLOCK_BYTES // max(values[:1].nbytes, 1), 1)
        return (values[start : start + rows] for start in range(0, values.shape[0], rows))
    per_slice = int(np.prod(shape[1:], dtype=np.int64)) * stored_dtype(weight).itemsize
    return (block.reshape(-1, *shape[1:]) for block in weight_blocks(weight, max(CHANNEL_BLOCK_BYTES // max(per_slice, 1), 1) * per_slice))


def _channel_magnitudes(weight: onnx.TensorProto | np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """The largest magnitude along `axis`, index by index."""
    found = None
    for values in _slices(weight, shape):
        others = tuple(i for i in range(values.ndim) if i != axis)  # reduced in place: no copy of a weight moved or widened
        magnitude = np.maximum(values.max(axis=others).astype(np.float64), -values.min(axis=others).astype(np.float64))
        found = magnitude if found is None else np.concatenate([found, magnitude]) if axis == 0 else np.maximum(found, magnitude)
    return found


def _zero_counts(weight: onnx.TensorProto | np.ndarray, shape: tuple[int, ...], axis: int, step: float, channel_steps: np.ndarray,
                 largest: float) -> tuple[int, int, int, int]:
    """Of a weight's values: how many are nonzero, how many of those lie below half of `step` (one scale),
    below half of their channel's step (`channel_steps` along `axis`), and beyond half of `largest`."""
    nonzero = zeroed = per_channel = setting = 0
    start = 0
    for values in _slices(weight, shape):
        size = np.abs(values)
        steps = channel_steps[start : start + len(values)] if axis == 0 else channel_steps
        start += len(values)
        along = [1] * values.ndim
        along[axis] = -1
        zeros = int(np.count_nonzero(size == 0))
        nonzero += size.size - zeros
        zeroed += int(np.count_nonzero(size < step / 2)) - zeros
        per_channel += int(np.count_nonzero(size < (steps / 2).reshape(along))) - zeros
        setting += int(np.count_nonzero(size > largest / 2))
    return nonzero, zeroed, per_channel, setting


def _nbits_zero_shares(weight: QuantizedWeight, packed: np.ndarray) -> np.ndarray | None:
    """Per block of a symmetric MatMulNBits weight (its zero point the grid's middle), the share of its values
    that are 0, counted on the packed codes (a code equal to the zero point is 0 whatever the scale): no
    weight is unpacked or dequantized (a 1.1B-parameter decoder's were 22 s). None where K does not fill
    its blocks, or a block is not whole bytes."""
    sizes = dict(weight.extra)
    k, n, block, bits = sizes["K"], sizes["N"], weight.block_size, weight.bits
    per_byte = 8 // bits
    if block < 2 or k % block or block % per_byte or bits not in (2, 4, 8):
        return None
    byte = np.arange(256, dtype=np.uint16)
    zero = 2 ** (bits - 1)
    zeros_in = sum(((byte >> (bits * i)) & ((1 << bits) - 1)) == zero for i in range(per_byte)).astype(np.uint8)  # zero codes each byte holds
    rows = packed.reshape(n, -1, block // per_byte)
    return zeros_in[rows].sum(axis=-1, dtype=np.uint16) / block


def _zeroed_blocks(op: QuantizedOp, weight: QuantizedWeight, values: np.ndarray) -> tuple[str, str] | None:
    """Blocks of a weight quantized in blocks (along K for MatMulNBits, along the quantized axis otherwise)
    in which more than half of the values became 0: one large value set a step that flattens the rest."""
    axis = 0 if weight.layout == "nbits" else weight.axis % values.ndim
    block = weight.block_size
    along = np.moveaxis(values, axis, -1)
    if block < 2 or along.shape[-1] % block:
        return None
    return _said_of_blocks(weight, (along.reshape(*along.shape[:-1], -1, block) == 0).mean(axis=-1))


def _said_of_blocks(weight: QuantizedWeight, zeros: np.ndarray | None) -> tuple[str, str] | None:
    """The block_scale finding from each block's share of zeros, where enough blocks lose most of their values."""
    if zeros is None:
        return None
    flattened = zeros > 0.5
    if flattened.mean() < BLOCK_FINDING_SHARE:
        return None
    return ("block_scale", f"its weight '{weight.codes}' is stored in {weight.blocks}: {int(flattened.sum())} of its {flattened.size} blocks "
                           f"({flattened.mean():.1%}) round more than half of their values to 0 (in the worst, {zeros.max():.0%}), their step set by a few "
                           "large values; smaller blocks, or keeping the node, would keep them")
