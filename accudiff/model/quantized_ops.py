"""Float ops a model computes in quantized arithmetic with nodes of their own, as ONNX Runtime's tools write
them: each recognised as the float op it stands for, so that labelling a candidate, keeping a node, making
a float form and judging a weight never depend on which form a tool chose.

A registry, one recogniser a form (the shape of ONNX Runtime's quantization registry):

| form                                                        | written by                           | format          |
|-------------------------------------------------------------|--------------------------------------|-----------------|
| DynamicQuantizeLinear, MatMulInteger/ConvInteger, Cast, Mul | `quantize_dynamic`                   | int8-dynamic    |
| DynamicQuantizeMatMul, MatMulIntegerToFloat                 | ONNX Runtime's fusion of the above   | int8-dynamic    |
| DynamicQuantizeLSTM                                         | `quantize_dynamic` (LSTM)            | int8-dynamic    |
| MatMulNBits                                                 | `MatMulNBitsQuantizer`               | int{2,4,8}-weight (+ int8-dynamic at accuracy_level 4) |
| GatherBlockQuantized                                        | `MatMulNBitsQuantizer` (Gather)      | int4-weight     |
| Gather of codes, DequantizeLinear                           | `quantize_dynamic` (Gather)          | int8-weight     |

Static Q/DQ pairs and a DequantizeLinear on a weight stay what they are (keep_float.py undoes them input by
input). An op is named as the float model names it: by the tool's naming (`X_quant`, `X_Q4`) or, given
the float model, by the node that writes its output there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

import onnx
from onnx import TensorProto, helper

from accudiff.model.graph import GraphIndex

DYNAMIC_INT8 = "int8-dynamic"
UINT8_LEVELS = 255  # DynamicQuantizeLinear: UINT8 over [min(x, 0), max(x, 0)]
INTEGER_CODES = {TensorProto.INT8: (8, "INT8"), TensorProto.UINT8: (8, "UINT8"), TensorProto.INT4: (4, "INT4"), TensorProto.UINT4: (4, "UINT4")}
ORT_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight an op holds as codes, and how to read it back as floats in the float op's layout.

    `layout`: "axis" (DequantizeLinear's rules: one scale, one per index along `axis`, or one per `block_size`
    indices along it), "nbits" (MatMulNBits: codes of `bits` bits packed along K in blocks, one scale a block
    and column; the float weight is [K, N]), "lstm" (DynamicQuantizeLSTM: [directions, input, 4 x hidden],
    the float LSTM's is transposed), or "runtime" (a float constant the model quantizes as it runs: the
    float weight is the constant itself)."""

    position: int
    codes: str
    scale: str | None = None
    zero_point: str | None = None
    layout: str = "axis"
    axis: int = 0
    block_size: int = 0
    bits: int = 8
    extra: tuple[tuple[str, int], ...] = ()  # nbits: K, N; g_idx is `group_index`
    group_index: str | None = None
    scale_divisor: str | None = None  # the scale is `scale` / this constant (an optimizer folded the activation's scale into it)

    @property
    def blocks(self) -> str:
        return f"{self.bits}-bit codes in blocks of {self.block_size}" if self.block_size else f"{self.bits}-bit codes"


@dataclass(frozen=True)
class QuantizedOp:
    """A float op (`op_type` named `node`, reading `inputs`, writing `outputs`) that the model computes with
    its `members`: quantized codes of `weights`, and, where `quantizes_activation`, its activation input
    (`inputs[0]`) quantized as the model runs (by the shared DynamicQuantizeLinear `activation_quantizer`,
    or inside a member). `also` names the float model's other nodes it took in (a bias Add it fused)."""

    node: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    members: tuple[str, ...]
    weights: tuple[QuantizedWeight, ...]
    formats: tuple[str, ...]
    tool: str
    form: str
    attributes: tuple[onnx.AttributeProto, ...] = ()
    bias: str | None = None  # a float constant added to the single output (the float model's Add)
    quantizes_activation: bool = False
    activation_quantizer: str | None = None
    also: tuple[str, ...] = ()
    run_time_levels: int = 0  # its activation's grid is each sample's own range, per tensor, in this many steps (0: none, or not per tensor)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a keep-list may give it: its own, and the float model's nodes it took in."""
        return (self.node, *self.also)


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _input(node: onnx.NodeProto, index: int) -> str | None:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _stem(name: str, suffixes: Iterable[str]) -> str:
    """The float model's node name under a tool's naming of the node that replaced it."""
    for suffix in suffixes:
        if suffix and name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# --- the recognisers: each takes a node and the view, and returns the op the node starts, or None -------


def _integer_chain(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """quantize_dynamic's MatMul and Conv: MatMulInteger/ConvInteger(activation codes, weight codes) -> Cast
    -> Mul(scales) [-> Add(Reshape(bias)) for a Conv]. The activation's codes come from a
    DynamicQuantizeLinear (quantized per tensor as the model runs), or are a quantized Gather's, which a
    DequantizeLinear also reads (the table's scale serves: its float value is that DequantizeLinear's)."""
    activation = view.made_by(node.input[0], "DynamicQuantizeLinear")
    if activation is not None:
        read, activation_scale = activation.input[0], activation.output[1]
    else:
        dequantize = next((n for n in view.readers.get(node.input[0], []) if n.op_type == "DequantizeLinear"), None)
        if dequantize is None or _input(dequantize, 2) != _input(node, 2):
            return None
        read, activation_scale = dequantize.output[0], dequantize.input[1]
    cast = view.only_reader(node.output[0])
    scaled = view.only_reader(cast.output[0]) if cast is not None and cast.op_type == "Cast" else None
    if scaled is None or scaled.op_type != "Mul":
        return None
    product = next(n for n in scaled.input if n != cast.output[0])
    scales = view.made_by(product, "Mul")
    members = [node.name, cast.name, scaled.name]
    weight = _integer_weight(node, 1, _input(node, 3), scales or product, activation_scale, view, axis=-1 if node.op_type == "MatMulInteger" else 0)
    if weight is None:
        return None
    weight_quantizer, weight = weight
    members += [n for n in (weight_quantizer, scales.name if scales is not None and view.only_reader(scales.output[0]) is scaled else None) if n]
    inputs, outputs = [read, weight.codes], [scaled.output[0]]
    bias_add = view.only_reader(scaled.output[0])
    reshape = next((view.made_by(n, "Reshape") for n in bias_add.input if n != scaled.output[0]), None) if bias_add is not None and bias_add.op_type == "Add" else None
    if node.op_type == "ConvInteger" and reshape is not None and reshape.input[0] in view.constants and bias_add.name == bias_add.output[0] + "_bias_add":
        inputs.append(reshape.input[0])
        outputs = [bias_add.output[0]]
        members += [bias_add.name] + ([reshape.name] if view.only_reader(reshape.output[0]) is bias_add else [])
    op_type = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
    attributes = tuple(node.attribute) if op_type == "Conv" else ()
    run_time = activation is not None
    how = "activations quantized per tensor as the model runs" if run_time else "reading a quantized table's codes"
    return QuantizedOp(_stem(node.name, ["_quant"]), op_type, tuple(inputs), tuple(outputs), tuple(members), (weight,), (DYNAMIC_INT8,),
                       "quantize_dynamic", f"{node.op_type} (INT8, {how})", attributes, quantizes_activation=run_time,
                       activation_quantizer=activation.name if run_time else None, run_time_levels=UINT8_LEVELS if run_time else 0)


def _integer_weight(node, position: int, zero_point: str | None, scales, activation_scale: str, view: GraphIndex, axis: int):
    """An integer op's weight: codes in a constant (their scale is the factor beside the activation's,
    `activation_scale`, in the `scales` Mul, or that product folded into a constant by an optimizer), or a
    float constant quantized as the model runs by a DynamicQuantizeLinear of its own. (that quantizer's name
    or None, the weight) or None."""
    codes = node.input[position]
    runtime = view.made_by(codes, "DynamicQuantizeLinear")
    if runtime is not None and runtime.input[0] in view.constants:
        return (runtime.name if len(view.readers.get(codes, [])) == 1 else None), QuantizedWeight(position, runtime.input[0], layout="runtime")
    if codes not in view.constants or (zero_point is not None and zero_point not in view.constants):
        return None
    if isinstance(scales, str):  # folded: the product of two constants
        return (None, QuantizedWeight(position, codes, scales, zero_point, axis=axis, scale_divisor=activation_scale)
                if {scales, activation_scale} <= view.constants.keys() else None)
    scale = next((n for n in scales.input if n != activation_scale), None) if scales is not None and activation_scale in scales.input else None
    if scale not in view.constants:
        return None
    return None, QuantizedWeight(position, codes, scale, zero_point, axis=axis)


def _dynamic_quantize_matmul(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """ONNX Runtime's fused DynamicQuantizeMatMul(A, B codes, b_scale, b_zero_point, bias)."""
    codes, scale, zero = node.input[1], node.input[2], _input(node, 3)
    if not {codes, scale, *([zero] if zero else [])} <= view.constants.keys():
        return None
    weight = QuantizedWeight(1, codes, scale, zero, axis=-1)
    return QuantizedOp(_stem(node.name, ["_quant"]), "MatMul", (node.input[0], codes), (node.output[0],), (node.name,), (weight,), (DYNAMIC_INT8,),
                       "quantize_dynamic", "DynamicQuantizeMatMul (INT8, activations quantized per tensor as the model runs)",
                       bias=_input(node, 4), quantizes_activation=True, run_time_levels=UINT8_LEVELS)


def _matmul_integer_to_float(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """ONNX Runtime's fused MatMulIntegerToFloat(A codes, B codes, a_scale, b_scale, a_zero, b_zero, bias)."""
    activation = view.made_by(node.input[0], "DynamicQuantizeLinear")
    codes, scale, zero = node.input[1], node.input[3], _input(node, 5)
    if activation is None or not {codes, scale, *([zero] if zero else [])} <= view.constants.keys():
        return None
    weight = QuantizedWeight(1, codes, scale, zero, axis=-1)
    return QuantizedOp(_stem(node.name, ["_quant"]), "MatMul", (activation.input[0], codes), (node.output[0],), (node.name,), (weight,), (DYNAMIC_INT8,),
                       "quantize_dynamic", "MatMulIntegerToFloat (INT8, activations quantized per tensor as the model runs)",
                       bias=_input(node, 6), quantizes_activation=True, activation_quantizer=activation.name, run_time_levels=UINT8_LEVELS)


def _dynamic_quantize_lstm(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """quantize_dynamic's LSTM: DynamicQuantizeLSTM(X, W codes, R codes, B, lengths, h0, c0, P, W scale,
    W zero point, R scale, R zero point), weights [directions, input, 4 x hidden]."""
    needed = [node.input[i] for i in (1, 2, 8, 9, 10, 11) if _input(node, i)]
    if len(needed) < 6 or not set(needed) <= view.constants.keys():
        return None
    weights = (QuantizedWeight(1, node.input[1], node.input[8], node.input[9], layout="lstm"),
               QuantizedWeight(2, node.input[2], node.input[10], node.input[11], layout="lstm"))
    inputs = tuple(node.input[:8])
    return QuantizedOp(_stem(node.name, ["_quant"]), "LSTM", inputs, tuple(node.output), (node.name,), weights, (DYNAMIC_INT8,), "quantize_dynamic",
                       "DynamicQuantizeLSTM (INT8 weights, activations quantized per tensor as the model runs)", tuple(node.attribute), quantizes_activation=True,
                       run_time_levels=UINT8_LEVELS)


def _matmul_nbits(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """MatMulNBits(A, B packed, scales, zero_points, g_idx, bias): Y = A x dequantized(B)^T (+ bias)."""
    parts = [node.input[1], node.input[2], *(n for n in (_input(node, 3), _input(node, 4)) if n)]
    if not set(parts) <= view.constants.keys():
        return None
    bits, block = int(_attr(node, "bits", 4)), int(_attr(node, "block_size"))
    level = int(_attr(node, "accuracy_level", 0))
    weight = QuantizedWeight(1, node.input[1], node.input[2], _input(node, 3), "nbits", block_size=block, bits=bits,
                             extra=(("K", int(_attr(node, "K"))), ("N", int(_attr(node, "N")))), group_index=_input(node, 4))
    acts = level == 4  # ONNX Runtime's CPU kernel then quantizes A to INT8, a block at a time
    formats = (*((DYNAMIC_INT8,) if acts else ()), f"int{bits}-weight")
    form = f"MatMulNBits ({bits}-bit weights in blocks of {block}{', activations quantized to INT8 a block at a time (accuracy_level 4)' if acts else ''})"
    return QuantizedOp(_stem(node.name, [f"_Q{bits}"]), "MatMul", (node.input[0], node.input[1]), (node.output[0],), (node.name,), (weight,), formats,
                       "MatMulNBitsQuantizer", form, bias=_input(node, 5), quantizes_activation=acts)


def _gather_block_quantized(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """GatherBlockQuantized(data codes, indices, scales, zero_points): a Gather of a table quantized in blocks."""
    parts = [node.input[0], node.input[2], *([_input(node, 3)] if _input(node, 3) else [])]
    if not set(parts) <= view.constants.keys():
        return None
    bits, block = int(_attr(node, "bits", 4)), int(_attr(node, "block_size", 128))
    data = view.constants[node.input[0]]
    weight = QuantizedWeight(0, node.input[0], node.input[2], _input(node, 3), "axis", int(_attr(node, "quantize_axis", len(data.dims) - 1)), block,
                             bits, extra=(("packed", int(data.data_type == TensorProto.UINT8 and bits < 8)),))
    gather_axis = helper.make_attribute("axis", int(_attr(node, "gather_axis", 0)))
    return QuantizedOp(_stem(node.name, [f"_Q{bits}"]), "Gather", (node.input[0], node.input[1]), (node.output[0],), (node.name,), (weight,),
                       (f"int{bits}-weight",), "MatMulNBitsQuantizer", f"GatherBlockQuantized ({bits}-bit table in blocks of {block})", (gather_axis,))


def _gathered_codes(node: onnx.NodeProto, view: GraphIndex) -> QuantizedOp | None:
    """quantize_dynamic's Gather: Gather(codes, indices) -> DequantizeLinear(scale, zero point), with one
    scale. An integer op may read the gathered codes too (then the Gather is not the op's alone)."""
    readers = view.readers.get(node.output[0], [])
    dequantize = next((n for n in readers if n.op_type == "DequantizeLinear"), None)
    codes = node.input[0]
    if dequantize is None or codes not in view.constants or view.constants[codes].data_type not in INTEGER_CODES:
        return None
    scale, zero = dequantize.input[1], _input(dequantize, 2)
    if scale not in view.constants or (zero and zero not in view.constants) or math.prod(view.constants[scale].dims) != 1:
        return None
    bits, grid = INTEGER_CODES[view.constants[codes].data_type]
    weight = QuantizedWeight(0, codes, scale, zero, bits=bits)
    members = (node.name, dequantize.name) if len(readers) == 1 else (dequantize.name,)
    return QuantizedOp(node.name, "Gather", tuple(node.input), (dequantize.output[0],), members, (weight,), (f"int{bits}-weight",),
                       "quantize_dynamic", f"Gather of a table stored in {grid} with one scale", tuple(node.attribute))


RECOGNISERS: dict[str, Callable[[onnx.NodeProto, GraphIndex], QuantizedOp | None]] = {
    "MatMulInteger": _integer_chain,
    "ConvInteger": _integer_chain,
    "DynamicQuantizeMatMul": _dynamic_quantize_matmul,
    "MatMulIntegerToFloat": _matmul_integer_to_float,
    "DynamicQuantizeLSTM": _dynamic_quantize_lstm,
    "MatMulNBits": _matmul_nbits,
    "GatherBlockQuantized": _gather_block_quantized,
    "Gather": _gathered_codes,
}


def modelopt_pattern(node: str) -> str:
    """A regular expression ModelOpt's `--nodes_to_exclude` selects exactly `node` by: it matches from the start
    of a name (re.match), so 'p2o\\.Conv\\.1' alone would exclude p2o.Conv.16 too."""
    return re.escape(node) + "$"


GENAI_BUILDER = "the ONNX Runtime GenAI model builder"
# How each tool is told to leave nodes unquantized, in its own words: the node names as a Python list and as
# one comma-separated shell word (each written out, or read from a file) -> the option.
TOOL_OPTIONS: dict[str, Callable[[str, str], str]] = {
    "quantize_dynamic": lambda python_list, _: f"ONNX Runtime quantize_dynamic(..., nodes_to_exclude={python_list})",
    "MatMulNBitsQuantizer": lambda python_list, _: f"ONNX Runtime MatMulNBitsQuantizer(..., nodes_to_exclude={python_list})",
    GENAI_BUILDER: lambda _, commas: ("python -m onnxruntime_genai.models.builder -i <the Hugging Face folder> -o <a new folder> -p int4 -e cpu "
                                      f"--extra_options nodes_to_exclude={commas}"),
}


def op_types_option(nodes: Iterable[str], quantized_by: Mapping[str, str], op_types: Sequence[str]) -> str | None:
    """How the tools that quantized `nodes` (`quantized_by`; a node it does not name, a Q/DQ quantizer) are
    made to quantize only `op_types`; None where one of them has no such option."""
    tools = {quantized_by.get(node, "Q/DQ") for node in nodes}
    if not tools <= {"Q/DQ", "quantize_dynamic"}:
        return None
    listed = f"[{', '.join(map(repr, op_types))}]"
    if "quantize_dynamic" in tools:
        return f"ONNX Runtime quantize_dynamic(..., op_types_to_quantize={listed})"
    return f"ModelOpt --op_types_to_quantize {' '.join(op_types)}; ONNX Runtime quantize_static(..., op_types_to_quantize={listed})"


def per_channel_option(tool: str | None, held_by_constants: bool) -> str:
    """How `tool` (None: a Q/DQ quantizer) is made to scale each weight per output channel; a weight a
    Constant node holds is quantized as an activation is, with one scale, whatever the option."""
    if tool == "quantize_dynamic":
        return ("ONNX Runtime quantize_dynamic(..., per_channel=True) quantizes them so; on an x86 CPU without VNNI add reduce_range=True "
                "(7-bit codes): ONNX Runtime's INT8 kernels there can saturate on codes that span the whole grid")
    if held_by_constants:
        return "held as initializers instead of Constant nodes, ModelOpt's quantizer and ONNX Runtime quantize_static(..., per_channel=True) quantize them so"
    return "ONNX Runtime quantize_static(..., per_channel=True) quantizes them so"


def find_quantized_ops(view: GraphIndex, reference: GraphIndex | None = None) -> list[QuantizedOp]:
    """The quantized ops of a main graph (`view`), in its node order. With the float model's `reference`,
    each is named as that model names the node writing its output, where the tool's naming does not find
    one of the same op type."""
    found = []
    for node in view.graph.node:
        recognise = RECOGNISERS.get(node.op_type)
        if recognise is None or node.domain not in ("", "ai.onnx", ORT_DOMAIN):
            continue
        op = recognise(node, view)
        if op is not None:
            found.append(op)
    if reference is None or not found:
        return found
    nodes = {node.name: node for node in reference.graph.node}
    return [_named(op, nodes, reference.producer) for op in found]


def _named(op: QuantizedOp, nodes: Mapping[str, onnx.NodeProto], writer: Mapping[str, onnx.NodeProto]) -> QuantizedOp:
    """`op` named after the float model (its `nodes`, and the `writer` of each value): its tool's name where
    the float model has a node of that name and op type, else the float model's node of that type writing
    its output; the float model's other writer of the output (a bias Add it fused) is in `also`."""
    writers = list({id(w): w for out in op.outputs if (w := writer.get(out)) is not None}.values())
    name = op.node if op.node in nodes and nodes[op.node].op_type == op.op_type else next((n.name for n in writers if n.op_type == op.op_type), op.node)
    also = tuple(n.name for n in writers if n.name != name)
    return replace(op, node=name, also=also)


def with_float_activation(op: QuantizedOp, node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The op's own node computing with its weights as they are and its activation in float, where one
    attribute says so: a MatMulNBits at accuracy_level 4 (INT8 activations) at accuracy_level 0 (FP32
    activations, the weights dequantized a block at a time). Its weights are not copied: a loss split of a
    1.1B-parameter decoder dequantized and wrote 4.4 GB for what this one attribute does. None for any other."""
    if node.op_type != "MatMulNBits" or not op.quantizes_activation:
        return None
    float_activation = onnx.NodeProto()
    float_activation.CopyFrom(node)
    for attribute in float_activation.attribute:
        if attribute.name == "accuracy_level":
            attribute.i = 0
    float_activation.name = op.node
    return float_activation


def quantized_members(ops: Iterable[QuantizedOp]) -> dict[str, QuantizedOp]:
    """Each member node's op."""
    return {member: op for op in ops for member in op.members}


def by_name(ops: Iterable[QuantizedOp]) -> dict[str, QuantizedOp]:
    """Each op under every name a keep-list may give it."""
    return {name: op for op in ops for name in op.names}


def float_nodes(op: QuantizedOp, weights: Mapping[int, str], fresh: Callable[[str], str], quantized_activation: bool = False) -> list[onnx.NodeProto]:
    """The float op `op` stands for, reading `weights` (the float weight's name at each weight position), as
    nodes that write its outputs. With `quantized_activation`, its activation input is read
    through a DynamicQuantizeLinear and a DequantizeLinear first (its weights alone undone). `fresh` makes a
    new value name from a wanted one."""
    inputs = list(op.inputs)
    for position, name in weights.items():
        inputs[position] = name
    nodes = []
    if quantized_activation:
        codes, scale, zero, read = (fresh(f"{op.node}__activation_{part}") for part in ("codes", "scale", "zero_point", "dequantized"))
        nodes += [helper.make_node("DynamicQuantizeLinear", [inputs[0]], [codes, scale, zero], name=codes),
                  helper.make_node("DequantizeLinear", [codes, scale, zero], [read], name=read)]
        inputs[0] = read
    written = list(op.outputs)
    main = fresh(f"{written[0]}__unbiased") if op.bias else written[0]
    core = helper.make_node(op.op_type, inputs, [main, *written[1:]], name=op.node)
    core.attribute.extend(a for a in op.attributes if a.name in _FLOAT_ATTRIBUTES.get(op.op_type, {a.name}))
    nodes.append(core)
    if op.bias:
        nodes.append(helper.make_node("Add", [main, op.bias], [written[0]], name=f"{op.node}__bias"))
    return nodes


# The attributes an integer op shares with its float op (ConvInteger has no auto_pad or strides beyond Conv's).
_FLOAT_ATTRIBUTES = {
    "Conv": {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"},
    "LSTM": {"activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size", "input_forget", "layout"},
    "Gather": {"axis"},
}
