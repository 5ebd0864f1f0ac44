"""The float form of a model that stores values narrow (Q/DQ pairs, FP16/BF16): the reference against which
such a model, given alone, is compared.

Every Q/DQ pair goes (the value is read from before it); a weight behind a DequantizeLinear with no
QuantizeLinear before it (ONNX Runtime's quantizer keeps only the quantized values) becomes its dequantized
values; an op computed in quantized arithmetic (dynamic INT8, MatMulNBits..., see quantized_ops.py) becomes
its float op, under its float name, reading its dequantized weights and its activation unquantized;
FP16/BF16 weights and values become FP32, and a Cast to FP16/BF16 a Cast to FP32, which changes nothing. Node and tensor names stay as they are, so the model aligns with its float form by name. What the
tool rounded in the weights cannot be undone: a notice says how many weights that is, and how to see it.
Weights are converted a block at a time into the float form's own data file (models past 2 GB included).
"""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from accudiff.errors import AccudiffError
from accudiff.model.formats import REDUCED_FLOATS, quant_ranges
from accudiff.model.graph import GraphIndex, copy_without_initializers, fresh_name
from accudiff.model.inventory import ModelInfo
from accudiff.model.loading import load_model
from accudiff.model.quantized_ops import find_quantized_ops, float_nodes, quantized_members
from accudiff.model.quantized_weights import float_weight
from accudiff.model.saving import EXTERNAL_DATA_MIN_TENSOR, save_model
from accudiff.model.weights import refer_to, weight_code_blocks, weight_values
from accudiff.transforms.keep_float import drop_unread_storage

INTEGER_ARITHMETIC = frozenset({
    "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
    "QAttention", "QGemm", "QEmbedLayerNormalization", "MatMulNBits",
})
FLOAT = TensorProto.FLOAT


def float_reference(info: ModelInfo, scratch: Path) -> tuple[ModelInfo, list[str]]:
    """The float form of a model given alone, saved in `scratch` under the model's own name (messages name
    it), and its inventory; with the notices of `write_float_form`."""
    target = scratch / "float-form" / info.path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    notices = write_float_form(info.proto, info.path, target)
    return load_model(target), notices


def write_float_form(model: onnx.ModelProto, source: Path, target: Path) -> list[str]:
    """Write the float form of `model` (read from `source`) to `target`; return the notices a reader needs
    (which weights it could only widen or dequantize, which activation quantization it took out). One
    sentence if the model holds quantized arithmetic of a form accudiff does not know (QLinear*, QAttention...)."""
    index = GraphIndex.of(model.graph)
    ops = find_quantized_ops(index)
    members = quantized_members(ops)
    known = {*members, *(op.activation_quantizer for op in ops)}
    integer = sorted({n.op_type for n in model.graph.node if (n.op_type in INTEGER_ARITHMETIC or n.op_type.startswith("QLinear")) and n.name not in known})
    if integer:
        raise AccudiffError(
            f"'{source.name}' computes in quantized arithmetic ({', '.join(integer)}), whose float form cannot be recovered from it: "
            f"compare the float model it was made from against it (accudiff compare float.onnx --candidate-model {source.name})"
        )
    graph = model.graph
    producer, constants = index.producer, index.constants
    form = copy_without_initializers(model)
    weights = _Weights(target)
    before_pair: dict[str, str] = {}  # a dequantized value -> the value its Q/DQ pair was fed
    nodes = []
    grids = quant_ranges(index)
    clip_inputs = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1) >= 11  # Clip's bounds as inputs
    folded_activations = 0
    taken = {name for node in graph.node for name in [*node.input, *node.output]} | set(constants)
    fresh = functools.partial(fresh_name, taken=taken)
    for node in form.graph.node:
        op = members.get(node.name)
        if op is not None:  # a quantized op's nodes: its float op in place of the last
            if op.outputs[0] in node.output:
                floats = {w.position: weights.dequantized_op_weight(fresh(f"{w.codes}__float"), float_weight(w, constants)) for w in op.weights}
                nodes += float_nodes(op, floats, fresh)
            continue
        feeder = producer.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if node.op_type == "DequantizeLinear" and feeder is not None and feeder.op_type == "QuantizeLinear":
            grid = grids.get(feeder.input[0])
            if grid is not None and grid.low == 0 and grid.format == "int8" and clip_inputs:
                # A grid starting at 0 is where an asymmetric quantizer (ONNX Runtime's default) folded a Relu or
                # a Clip into the pair, which now clips in its stead: the float form keeps that clipping.
                bounds = [weights.scalar(f"{node.output[0]}_low", 0.0), weights.scalar(f"{node.output[0]}_high", grid.high)]
                nodes.append(onnx.helper.make_node("Clip", [feeder.input[0], *bounds], [node.output[0]], name=node.name))
                folded_activations += 1
            else:
                before_pair[node.output[0]] = feeder.input[0]
        elif node.op_type == "DequantizeLinear" and node.input[0] in constants:
            weights.dequantize(node, constants)
        elif node.op_type != "QuantizeLinear":
            nodes.append(node)
    for node in nodes:
        node.input[:] = [_before_pairs(name, before_pair) for name in node.input]
        _widen_attributes(node)
    del form.graph.node[:]
    form.graph.node.extend(nodes)
    drop_unread_storage(form.graph)  # the activations' quantizers nobody reads any more
    nodes = list(form.graph.node)
    produced = {out for node in nodes for out in node.output}
    kept_types = [vi for vi in form.graph.value_info if vi.name in produced]  # the removed pairs' values are gone
    del form.graph.value_info[:]
    form.graph.value_info.extend(kept_types)
    for vi in [*form.graph.input, *form.graph.output, *form.graph.value_info]:
        if vi.type.tensor_type.elem_type in REDUCED_FLOATS:
            vi.type.tensor_type.elem_type = FLOAT
    for output in form.graph.output:  # a graph output a DequantizeLinear wrote is the value before its pair, under the output's name
        fed = _before_pairs(output.name, before_pair)
        if fed != output.name:
            form.graph.node.append(onnx.helper.make_node("Identity", [fed], [output.name], name=f"{output.name}_float_form"))
    read = {name for node in form.graph.node for name in node.input}
    for init in graph.initializer:
        if init.name in read:
            form.graph.initializer.append(weights.widened(init) if init.data_type in REDUCED_FLOATS else init)
    form.graph.initializer.extend(weights.made)
    weights.close()
    save_model(form, target)
    notices = weights.notices(source.name)
    run_time = sum(1 for op in ops if op.quantizes_activation)
    if run_time:
        notices.append(f"{run_time} of the ops of '{source.name}' quantize their activations as the model runs; its float form reads them unquantized")
    if folded_activations:
        notices.append(f"{folded_activations} of the Q/DQ pairs of '{source.name}' have grids that start at 0, where the quantizer folded a Relu or "
                       "a Clip into them: its float form keeps them clipping there (from 0 to the top of their range), so clipping at those pairs does not show")
    return notices


def _before_pairs(name: str, before_pair: dict[str, str]) -> str:
    while name in before_pair:
        name = before_pair[name]
    return name


def _widen_attributes(node: onnx.NodeProto) -> None:
    """Types written in attributes: a Cast's target, a constant tensor (Constant, ConstantOfShape), a dtype."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in REDUCED_FLOATS:
            attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype", "output_dtype") and attr.i in REDUCED_FLOATS:
            attr.i = FLOAT


class _Weights:
    """The float form's converted weights, written a block at a time into its data file (small ones stay
    in the model)."""

    def __init__(self, target: Path):
        self.target, self.location = target, target.name + ".float.data"
        self._file: io.BufferedWriter | None = None
        self.made: list[onnx.TensorProto] = []
        self.widened_count = self.dequantized_count = 0

    def scalar(self, name: str, value: float) -> str:
        self.made.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    def widened(self, weight: onnx.TensorProto) -> onnx.TensorProto:
        self.widened_count += 1
        return self._written(weight.name, list(weight.dims), (block.astype(np.float32) for block in weight_code_blocks(weight)))

    def dequantized_op_weight(self, name: str, values: np.ndarray) -> str:
        """A quantized op's weight, dequantized (quantized_ops.float_weight), written under `name`."""
        self.dequantized_count += 1
        self.made.append(self._written(name, list(values.shape), iter([values.reshape(-1)])))
        return name

    def dequantize(self, node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> None:
        """The DequantizeLinear of a constant replaced by its values (per tensor, per axis or blocked), in FP32."""
        weight = constants[node.input[0]]
        scale = weight_values(constants[node.input[1]]).astype(np.float32) if node.input[1] in constants else None
        zero = node.input[2] if len(node.input) > 2 and node.input[2] else None
        offset = weight_values(constants[zero]).astype(np.float32) if zero in constants else np.zeros(1, np.float32)
        if scale is None:
            raise AccudiffError(f"the DequantizeLinear '{node.name}' of weight '{weight.name}' reads a scale that is not a constant: its float form cannot be made")
        attributes = {a.name: a.i for a in node.attribute}
        shape = list(weight.dims)
        axis, block = attributes.get("axis", 1) % max(len(shape), 1), attributes.get("block_size", 0)
        self.dequantized_count += 1
        self.made.append(self._written(node.output[0], shape, _dequantized(weight_code_blocks(weight), shape, scale, offset, axis, block)))

    def _written(self, name: str, shape: list[int], blocks: Iterator[np.ndarray]) -> onnx.TensorProto:
        count = int(np.prod(shape, dtype=np.int64))
        if count * 4 < EXTERNAL_DATA_MIN_TENSOR:
            values = np.concatenate([b.reshape(-1) for b in blocks]) if count else np.zeros(0, np.float32)
            return numpy_helper.from_array(values.astype(np.float32).reshape(shape), name)
        if self._file is None:
            self._file = open(self.target.parent / self.location, "wb")
        offset = self._file.tell()
        for block in blocks:
            self._file.write(np.ascontiguousarray(block, dtype="<f4").tobytes())
        tensor = onnx.TensorProto(name=name, data_type=FLOAT, dims=shape)
        refer_to(tensor, self.location, offset, self._file.tell() - offset, self.target.parent)
        return tensor

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def notices(self, model: str) -> list[str]:
        parts = [f"{self.dequantized_count} weight(s) kept only quantized were dequantized" if self.dequantized_count else "",
                 f"{self.widened_count} FP16/BF16 weight(s) were widened" if self.widened_count else ""]
        said = " and ".join(p for p in parts if p)
        if not said:
            return []
        return [f"the reference is the float form of '{model}': {said}, so what rounding those weights cost does not show; "
                f"to see it, compare the float model it was made from against it (accudiff compare float.onnx --candidate-model {model})"]


def _dequantized(blocks: Iterator[np.ndarray], shape: list[int], scale: np.ndarray, offset: np.ndarray, axis: int, block: int) -> Iterator[np.ndarray]:
    """(value - zero point) * scale, a block of the flattened weight at a time: the scale and zero point
    are one number, one per index along `axis`, or (blocked) one per `block` consecutive indices along it."""
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64)) if shape else 1
    size = shape[axis] if shape else 1
    start = 0
    for values in blocks:
        values = values.reshape(-1).astype(np.float32)
        if scale.size == 1:
            yield (values - offset.reshape(-1)[0]) * scale.reshape(-1)[0]
        else:
            flat = np.arange(start, start + values.size, dtype=np.int64)
            along = (flat // inner) % size
            outer = flat // (inner * size)
            if block:
                index = (outer * scale.shape[axis] + along // block) * inner + flat % inner
            else:
                index = along
            zero = offset.reshape(-1)[index] if offset.size > 1 else offset.reshape(-1)[0]
            yield (values - zero) * scale.reshape(-1)[index]
        start += values.size

