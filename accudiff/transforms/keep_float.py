"""Keep chosen nodes of a reduced-precision model in FP32: the one edit behind verification's keeps, the
repairs `bisect precision` writes, `--keep-fp32` on a candidate model and the repaired candidate.

A model as a quantizer writes it stores values narrow in two ways: behind a QuantizeLinear/
DequantizeLinear pair (TensorRT folds the DequantizeLinear into the node that reads it, so that node runs
quantized) and in FP16/BF16 (Casts, and weights and values of those types). A node kept in FP32 reads each
input from before its Q/DQ pair and from before the Cast that narrowed it, computes in FP32, and hands its
result to the nodes that are not kept rounded to the type they read it in, under its own name, as before.
A weight stored narrow is taken from the reference model where the reference's node of the same name reads
a float one at the same input (ModelOpt keeps float weights behind their Q/DQ pairs, ONNX Runtime's
quantizer does not); otherwise its narrow values are read, widened.

A float op the model computes with nodes of its own (dynamic INT8, MatMulNBits... see quantized_ops.py) is
kept by replacing those nodes with the float op, under its float name, reading its activation as a float
and the reference's weights (or, with none, its own dequantized).

What a keep undoes can be narrowed (the loss split): the quantization of "activations" (Q/DQ pairs on
values, quantization as the model runs), of "weights" (their Q/DQ pairs and codes), and the "casts" to
FP16/BF16; or its weights' one scale replaced by one per output channel ("per_channel": the reference's
weight on the same grid, scaled per channel, what a quantizer's per_channel option makes of it).
"""

from __future__ import annotations

from functools import cached_property
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from accudiff.model.formats import REDUCED_FLOATS
from accudiff.model.graph import GraphIndex, declare_like, fresh_name
from accudiff.model.quantized_ops import QuantizedOp, QuantizedWeight, by_name, find_quantized_ops, float_nodes, quantized_members, with_float_activation
from accudiff.model.quantized_weights import float_weight, per_channel_grid
from accudiff.model.shapes import infer_shapes_unless_typed
from accudiff.model.value_file import ValueFile
from accudiff.model.weights import PACKED_4BIT, stored_dtype, weight_values

QUANTIZATION_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
STORAGE_OPS = QUANTIZATION_OPS | {"Cast", "Constant"}  # what only changes how a value is stored: never a node to keep
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, *REDUCED_FLOATS})
WIDE = "__fp32"
FOLDED_ACTIVATIONS = frozenset({"Relu", "Clip"})  # what ONNX Runtime's quantizer folds into a Q/DQ pair (see FloatInputs.refolded)
UNDO_ALL = frozenset({"activations", "weights", "casts"})
# What keeping undoes, by the name a loss split gives it (see CandidateVariants.with_kept); "per_channel" puts
# the reference's weights back on the weights' own grid with a scale per output channel instead of one.
PARTS = {"all": UNDO_ALL, "quantization": frozenset({"activations", "weights"}), "casts": frozenset({"casts"}),
         "activations": frozenset({"activations"}), "weights": frozenset({"weights"}), "per_channel": frozenset({"per_channel"})}


def keep_in_float(model: onnx.ModelProto, reference: onnx.ModelProto | None, nodes: Iterable[str], undo: frozenset[str] = UNDO_ALL,
                  values: ValueFile | None = None) -> onnx.ModelProto:
    """A copy of `model` with `nodes` computing in FP32 from float inputs: what `undo` names of their
    narrowing taken back (see the module's docstring); the Q/DQ pairs, Casts and weights nobody reads any
    more are dropped. `reference`: the float model whose weights a kept node reads where its own are stored
    narrow (nodes matched by name). `values`: where the weights it dequantizes are written (else the model
    holds them)."""
    kept = set(nodes)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    infer_shapes_unless_typed(result)
    edit = FloatInputs(graph, reference, undo, values)
    ops = {op.node: op for name, op in edit.ops.items() if name in kept}
    members = quantized_members(edit.ops.values())
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        op = members.get(node.name)
        if op is not None and op.node in ops and not undoes_anything(op, undo, edit.constants):
            rebuilt.append(node)  # (an embedding's quantized Gather when only activations are undone: as it is)
        elif op is not None and op.node in ops:
            if op.outputs[0] in node.output:  # its last node: the float op takes its place
                own = with_float_activation(op, node) if not undo & {"weights", "per_channel"} else None
                rebuilt += [own] if own is not None else edit.keep_op(op)
        elif node.name in ops:  # a node of a kept op that others read too (a quantized Gather's codes): it stays, renamed
            node.name = edit.fresh(f"{node.name}__codes")
            rebuilt.append(node)
        elif node.name in kept and node.op_type not in STORAGE_OPS:
            rebuilt += edit.keep(node)
        else:
            rebuilt.append(node)
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(edit.imported)
    drop_unread_storage(graph)
    return result


def narrowed_parts(model: onnx.ModelProto, reference: onnx.ModelProto | None, node: str) -> frozenset[str]:
    """What of `node`'s narrowing a keep can undo apart: its "activations'" quantization (a Q/DQ pair on a
    value it reads, or quantization as the model runs) and its "weights'" (a Q/DQ pair or codes of a
    constant it reads)."""
    edit = FloatInputs(model.graph, reference)
    op = edit.ops.get(node)
    if op is not None:
        return frozenset(["weights"] * bool(op.weights) + ["activations"] * op.quantizes_activation)
    parts = set()
    for name in next((n.input for n in model.graph.node if n.name == node), []):
        dequantize = edit.producer.get(name)
        if dequantize is None or dequantize.op_type != "DequantizeLinear":
            continue
        quantize = edit.producer.get(dequantize.input[0])
        if quantize is not None and quantize.op_type == "QuantizeLinear":
            parts.add("weights" if quantize.input[0] in edit.constants else "activations")
        elif dequantize.input[0] in edit.constants:  # a weight stored as its codes
            parts.add("weights")
    return frozenset(parts)


def undoes_anything(op: QuantizedOp, undo: frozenset[str], constants: dict[str, onnx.TensorProto]) -> bool:
    """Whether keeping `op` changes what it computes: a weight-only op (a quantized Gather, MatMulNBits at
    its default accuracy) kept with only its activations' quantization undone computes as before, and an op
    whose weights have scales per channel or block already, kept with "per_channel" undone."""
    rescaled = "per_channel" in undo and any(_op_weight_bits(w, constants) for w in op.weights)
    return bool(undo & {"weights", "casts"}) or (op.quantizes_activation and "activations" in undo) or rescaled


class FloatInputs:
    """What keeping nodes needs to know of the graph (types, producers, readers, the reference's weights),
    the float value each kept node reads instead of a narrow one, and what that added to the graph (Casts,
    weights from the reference). The switchboard of such a candidate reads its kept copies' inputs here too."""

    def __init__(self, graph: onnx.GraphProto, reference: onnx.ModelProto | None, undo: frozenset[str] = UNDO_ALL, values: ValueFile | None = None):
        self.graph, self.undo, self.values = graph, undo, values
        self.widen = "casts" in undo
        index = GraphIndex.of(graph)
        self.types = dict(index.types)  # its own: the values it adds are typed here
        self.constants, self.producer, self.readers, self.graph_outputs = index.constants, index.producer, index.readers, index.outputs
        self.widened = index.widened_constants(REDUCED_FLOATS)
        theirs = GraphIndex.of(reference.graph) if reference is not None else None
        self.reference_nodes = {node.name: node for node in reference.graph.node} if reference is not None else {}
        self.reference_weights = theirs.constants if theirs is not None else {}
        self._reference_producer = theirs.producer if theirs is not None else {}
        self._reference_readers = theirs.readers if theirs is not None else {}
        self.taken = set(self.types) | set(self.producer) | {vi.name for vi in graph.input}
        self.imported: list[onnx.TensorProto] = []
        self._imports: dict[str, str] = {}
        self.casts: dict[tuple[str, int], str] = {}
        self.wide: dict[str, str] = {}  # a narrow value a kept node computed -> its FP32 result
        self.ops: dict[str, QuantizedOp] = by_name(find_quantized_ops(index, theirs))
        self._dequantized: dict[str, str] = {}
        self._refolded: dict[tuple[str, str], str] = {}

    def keep_op(self, op: QuantizedOp, read=None) -> list[onnx.NodeProto]:
        """The float op `op` stands for, in place of its nodes: its weights the reference's (or its own
        dequantized) where `undo` takes weights back, else its own dequantized; its activation float, or
        quantized as the model runs where `undo` keeps that; its float inputs read by `read(node, index,
        name, before)` (default: as `keep` reads them)."""
        read = read or self.float_input
        weights = {w.position: self._kept_weight(op, w) for w in op.weights}
        nodes = float_nodes(op, weights, self.fresh, quantized_activation=op.quantizes_activation and "activations" not in self.undo)
        before: list[onnx.NodeProto] = []
        floats = {name for position, name in enumerate(op.inputs) if position not in weights and self.types.get(name) in FLOAT_TYPES}
        for node in nodes:
            for index, name in enumerate(node.input):
                if name in floats:
                    node.input[index] = read(node, index, name, before)
        for node in nodes:
            self._type_added(node, op)
        return [*before, *nodes]

    def _kept_weight(self, op: QuantizedOp, weight: QuantizedWeight) -> str:
        """What a kept op reads for `weight`: the reference's where `undo` takes weights back; on a grid with a
        scale per channel where it takes back one scale ("per_channel") and one covers it; else its own dequantized."""
        bits = _op_weight_bits(weight, self.constants) if "per_channel" in self.undo else None
        found = self._reference_weight(op.node, weight.position, bits) if "weights" in self.undo or bits else None
        return found or self._dequantized_weight(weight)

    def _type_added(self, node: onnx.NodeProto, op: QuantizedOp) -> None:
        """Type the values a kept op's nodes add: its activation's codes (like it, UINT8) and their scalar
        scale and zero point, the activation read back (FP32), the result before its bias (like the op's)."""
        for out in node.output:
            if out in self.types:
                continue
            if node.op_type == "DynamicQuantizeLinear" and out != node.output[0]:
                kind = TensorProto.FLOAT if out == node.output[1] else TensorProto.UINT8
                self.graph.value_info.append(onnx.helper.make_tensor_value_info(out, kind, []))
                self.types[out] = kind
            elif node.op_type in ("DynamicQuantizeLinear", "DequantizeLinear"):
                self.declare(out, node.input[0], TensorProto.UINT8 if node.op_type == "DynamicQuantizeLinear" else TensorProto.FLOAT)
            else:
                self.declare(out, op.outputs[0], self.types.get(op.outputs[0]))

    def _dequantized_weight(self, weight) -> str:
        """A weight's own values dequantized, added to the model once (in `values`' file, when given)."""
        key = f"{weight.codes}/{weight.position}/{weight.layout}"
        if key not in self._dequantized:
            name, compute = self.fresh(f"{weight.codes}__dequantized"), lambda: float_weight(weight, self.constants)
            tensor = self.values.value(key, name, compute) if self.values is not None else numpy_helper.from_array(compute(), name)
            self.imported.append(tensor)
            self.types[tensor.name] = TensorProto.FLOAT
            self._dequantized[key] = tensor.name
        return self._dequantized[key]

    def keep(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """`node` rewired to read float inputs (and the Casts that widen them, before it) and to compute in
        FP32 (and the Casts that narrow its results for the others, after it)."""
        before: list[onnx.NodeProto] = []
        for index, name in enumerate(node.input):
            if name and self.types.get(name) in FLOAT_TYPES:
                node.input[index] = self.float_input(node, index, name, before)
        after = self._unquantize_graph_outputs(node) if "activations" in self.undo else []
        if self.widen:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i in REDUCED_FLOATS:
                    attr.i = TensorProto.FLOAT
            for index, out in enumerate(node.output):
                kind = self.types.get(out)
                if kind in REDUCED_FLOATS:
                    node.output[index] = self.wide[out] = self.fresh(out + WIDE)
                    self.declare(self.wide[out], out, TensorProto.FLOAT)
                    after.append(onnx.helper.make_node("Cast", [self.wide[out]], [out], to=kind))
        return [*before, node, *after]

    def _unquantize_graph_outputs(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """A graph output a Q/DQ pair quantizes after this node (ONNX Runtime's quantizer quantizes graph
        outputs) is the node's own result again: that DequantizeLinear becomes an Identity of it (or of the
        activation folded into the pair applied to it, `refolded`: the nodes returned, to go after this one)."""
        after: list[onnx.NodeProto] = []
        for out in node.output:
            for quantize in self.readers.get(out, []):
                if quantize.op_type != "QuantizeLinear":
                    continue
                for dequantize in self.readers.get(quantize.output[0], []):
                    if dequantize.op_type == "DequantizeLinear" and dequantize.output[0] in self.graph_outputs:
                        source = self.refolded(dequantize.output[0], out, after)  # (a Relu the pair clipped in place of)
                        dequantize.op_type = "Identity"
                        dequantize.input[:] = [source]
                        del dequantize.attribute[:]
        return after

    @cached_property
    def declared(self) -> dict[str, onnx.ValueInfoProto]:
        """The graph's typed values by name (built when a value is first added: most keeps add none)."""
        return {vi.name: vi for vi in [*self.graph.value_info, *self.graph.input, *self.graph.output]}

    def declare(self, name: str, like: str, elem_type: int | None) -> None:
        """Type a value added, `name`, with the shape of `like` (the models accudiff builds stay typed)."""
        if elem_type:
            declare_like(self.graph, self.declared, name, like, elem_type)
            self.types[name] = elem_type

    def float_input(self, node: onnx.NodeProto, index: int, name: str, before: list[onnx.NodeProto]) -> str:
        """What `node` reads at input `index` (now `name`) when kept: the value before its narrowing, in FP32
        (`widen`), a Cast added to `before` where one is needed."""
        wanted = self.types.get(name)
        if self.widen and wanted in REDUCED_FLOATS:
            wanted = TensorProto.FLOAT
        source = self.before_narrowing(name)
        if source in self.wide:
            source = self.wide[source]
        elif (bits := self._one_scale_bits(name)) or self._narrow_weight(source):
            source = self._reference_weight(node.name, index, bits) or source
        source = self.refolded(name, source, before)
        if self.types.get(source) == wanted or source not in self.types:
            return source
        key = (source, wanted)
        if key not in self.casts:
            self.casts[key] = self.fresh(f"{source}__as_{TensorProto.DataType.Name(wanted).lower()}")
            before.append(onnx.helper.make_node("Cast", [source], [self.casts[key]], to=wanted))
            self.declare(self.casts[key], source, wanted)
        return self.casts[key]

    def before_narrowing(self, name: str) -> str:
        """The value `name` was made from by the narrowing `undo` takes back: Q/DQ pairs (of a weight:
        "weights", else "activations") and Casts to FP16/BF16 ("casts")."""
        while (step := self._step_back(name)) is not None:
            name = step[0]
        return name

    def _step_back(self, name: str) -> tuple[str, bool] | None:
        """One narrowing `undo` takes back that wrote `name`: (the value before it, whether it was a Q/DQ pair
        rather than a Cast); None where none did."""
        node = self.producer.get(name)
        if node is None:
            return None
        source = node.input[0] if node.input else ""
        feeder = self.producer.get(source)
        if node.op_type == "DequantizeLinear" and feeder is not None and feeder.op_type == "QuantizeLinear" and self._undoes_pair(feeder):
            return feeder.input[0], True
        if self.widen and node.op_type == "Cast" and _cast_to(node) in REDUCED_FLOATS and self.types.get(source) in FLOAT_TYPES:
            return source, False
        return None

    def refolded(self, name: str, source: str, before: list[onnx.NodeProto]) -> str:
        """`source`, what a kept node reads for `name` from before the narrowing undone, with the activation a
        quantizer folded into an undone Q/DQ pair on the way applied again (a node added to `before`, once
        for each source). ONNX Runtime's quantize_static (asymmetric activations, its default) removes a Relu
        or a Clip after a Conv and lets the pair clip in its stead: undone, the pair would take the Relu with
        it. The reference says what was folded: its node writing the value before the pair (the float model
        the tool was given), or the pair's own value (a float form, where a Clip stands for the pair)."""
        activation = self._folded_activation(name)
        if activation is None or self.types.get(source) != TensorProto.FLOAT:
            return source
        key = (activation.name, source)
        if key not in self._refolded:
            bounds = [self._reference_copy(bound) if bound else "" for bound in activation.input[1:]]
            if None in bounds:
                return source
            out = self.fresh(f"{source}__{activation.op_type.lower()}")
            node = onnx.NodeProto()
            node.CopyFrom(activation)
            node.name, node.input[:], node.output[:] = out, [source, *bounds], [out]
            before.append(node)
            self.declare(out, source, TensorProto.FLOAT)
            self._refolded[key] = out
        return self._refolded[key]

    def _folded_activation(self, name: str) -> onnx.NodeProto | None:
        """The reference's Relu or Clip that an undone Q/DQ pair on the way from `name` back stands for, if any."""
        while (step := self._step_back(name)) is not None:
            earlier, pair = step
            ours = self.producer.get(earlier) if pair else None
            found = self._folded_after(ours, name) if ours is not None else None
            if found is not None:
                return found
            name = earlier
        return None

    def _folded_after(self, ours: onnx.NodeProto, value: str) -> onnx.NodeProto | None:
        """The reference's Relu or Clip that reads what `ours` writes there and that a Q/DQ pair after `ours`
        (its value `value`) clips in place of: the float form's Clip that stands for the pair (writing
        `value`), or the float model's activation this model lacks (a quantizer removes one only where it is
        the single reader of what it reads)."""
        theirs = self._reference_producer.get(value)
        if theirs is None or theirs.op_type not in FOLDED_ACTIVATIONS:
            mine = self.reference_nodes.get(ours.name)
            readers = [r for out in (mine.output if mine is not None else []) for r in self._reference_readers.get(out, [])]
            theirs = readers[0] if len(readers) == 1 and readers[0].name not in self._names else None
        if theirs is None or theirs.op_type not in FOLDED_ACTIVATIONS or theirs.op_type == ours.op_type:
            return None
        feeding = self._reference_producer.get(theirs.input[0])
        return theirs if feeding is not None and feeding.name == ours.name else None

    @cached_property
    def _names(self) -> set[str]:
        """This model's node names (a reference node missing here was removed by the tool)."""
        return {node.name for node in self.graph.node}

    def _undoes_pair(self, quantize: onnx.NodeProto) -> bool:
        return ("weights" if quantize.input[0] in self.constants else "activations") in self.undo

    def _narrow_weight(self, name: str) -> bool:
        """A weight stored narrow: a dequantized constant ("weights"), or an FP16/BF16 constant, as it is or
        cast to FP32 ("casts")."""
        node = self.producer.get(name)
        if "weights" in self.undo and node is not None and node.op_type == "DequantizeLinear" and node.input[0] in self.constants:
            return True
        return self.widen and (name in self.widened or (name in self.constants and self.constants[name].data_type in REDUCED_FLOATS))

    def _reference_weight(self, node: str, index: int, bits: int | None = None) -> str | None:
        """The reference's float weight at this input of its node named `node`, added to the model (under its
        own name where that is free); None where there is none. Undoing "per_channel": on a grid of `bits`
        (the candidate's codes) scaled per output channel of the op (its values file holds it, where given)."""
        theirs = self.reference_nodes.get(node)
        name = theirs.input[index] if theirs is not None and index < len(theirs.input) else ""
        weight = self.reference_weights.get(name)
        if weight is None or weight.data_type not in FLOAT_TYPES - set(REDUCED_FLOATS):
            return None
        if "per_channel" in self.undo and bits:
            key = f"{name}/per_channel/{theirs.op_type}/{bits}"
            if key not in self._imports:
                fresh, compute = self.fresh(f"{name}__per_channel"), lambda: per_channel_grid(weight_values(weight), theirs.op_type, bits)
                tensor = self.values.value(key, fresh, compute) if self.values is not None else numpy_helper.from_array(compute(), fresh)
                self._imports[key] = tensor.name
                self.imported.append(tensor)
                self.types[tensor.name] = TensorProto.FLOAT
            return self._imports[key]
        return self._reference_copy(name)

    def _reference_copy(self, name: str) -> str | None:
        """A constant of the reference (a weight, a Clip's bound), added to the model once, under its own name
        where that is free; None where the reference computes it."""
        value = self.reference_weights.get(name)
        if value is None:
            return None
        if name not in self._imports:
            copy = onnx.TensorProto()
            copy.CopyFrom(value)
            copy.name = self._imports[name] = self.fresh(name if name not in self.taken else name + "__float")
            self.imported.append(copy)
            self.types[copy.name] = copy.data_type
        return self._imports[name]

    def _one_scale_bits(self, name: str) -> int | None:
        """Undoing "per_channel": the bits of the integer grid a weight read as `name` is quantized to with one
        scale, by a DequantizeLinear of its codes or a Q/DQ pair on it (None: another value, a float grid, or
        scales per channel or block already)."""
        node = self.producer.get(name)
        if "per_channel" not in self.undo or node is None or node.op_type != "DequantizeLinear" or len(node.input) < 2:
            return None
        scale, feeder = self.constants.get(node.input[1]), self.producer.get(node.input[0])
        if node.input[0] in self.constants:
            codes = self.constants[node.input[0]]
        elif feeder is not None and feeder.op_type == "QuantizeLinear" and feeder.input[0] in self.constants:
            codes = self.constants.get(feeder.input[2]) if len(feeder.input) > 2 and feeder.input[2] else onnx.TensorProto(data_type=TensorProto.UINT8)
        else:
            return None
        if scale is None or codes is None or int(np.prod(scale.dims)) != 1 or codes.data_type not in PACKED_4BIT and stored_dtype(codes).kind not in "iu":
            return None
        return 4 if codes.data_type in PACKED_4BIT else 8 * stored_dtype(codes).itemsize

    def fresh(self, name: str) -> str:
        return fresh_name(name, self.taken)


def _op_weight_bits(weight: QuantizedWeight, constants: dict[str, onnx.TensorProto]) -> int | None:
    """The bits of a weight's codes where one scale covers it all (what a scale per channel would refine), else None."""
    one = weight.layout == "axis" and not weight.block_size and weight.scale in constants and int(np.prod(constants[weight.scale].dims)) == 1
    return weight.bits if one else None


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def drop_unread_storage(graph: onnx.GraphProto) -> None:
    """Remove the Q/DQ, Cast and Constant nodes whose outputs nobody reads (repeatedly), then the weights
    nobody reads."""
    while True:
        read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        unread = [n for n in graph.node if n.op_type in STORAGE_OPS and not any(o in read for o in n.output)]
        if not unread:
            break
        for node in unread:
            graph.node.remove(node)
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    unused = [init for init in graph.initializer if init.name not in read]
    for init in unused:
        graph.initializer.remove(init)
