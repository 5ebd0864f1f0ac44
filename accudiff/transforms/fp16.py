"""FP32 -> FP16 (or BF16) mixed precision that keeps tensor names and never clamps silently.

Why our own pass instead of onnxconverter-common: that converter clamps constants to +-1e4 (silently
changing the model), renames tensors (so they no longer align with the reference) and breaks on Cast
retyping and subgraphs. Here:

* a node runs in FP16 when its op schema allows FP16 for its float inputs, unless it is kept;
* kept in FP32: nodes named by `keep_fp32`, nodes that read a constant beyond +-65504 (autokeep),
  nodes whose outputs If/Loop/Scan bodies read, ops outside the default domain that ONNX Runtime does not
  know or has no CPU kernel for in that format (contrib_ops.py);
* If/Loop/Scan bodies are converted by the same rules; the node's inputs and outputs, and so its
  bodies' inputs and outputs, keep their types (Casts inside the body bridge them);
* every node output keeps its name and holds the node's own result; Casts are inserted between
  FP16 and FP32 regions under new names, and graph inputs and outputs keep their FP32 types
  (a graph output computed in FP16 is produced by a Cast under its original name).
BF16 (`to_fp16(..., BF16)`) follows the same rules with its own type: its range is FP32's, so autokeep never
keeps a node for it in practice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

from accudiff.model.contrib_ops import contrib_schema, has_cpu_kernel, is_onnxruntime_op
from accudiff.model.formats import FP16_MAX
from accudiff.errors import AccudiffError
from accudiff.model.constant_rounding import ConstantRounding, denominator_reader, overflow_text, underflow_text
from accudiff.model.graph import copy_without_initializers, declare_like, readers_of, subgraph_outer_references
from accudiff.model.weights import weight_blocks
from accudiff.transforms.base import KeptNode, NodeSelector, TransformResult
from accudiff.transforms.opset import default_opset

@dataclass(frozen=True)
class Half:
    """A 16-bit float format a model is converted to: FP16 (11 significant bits, up to 65504) or BF16 (8
    significant bits, FP32's range)."""

    elem_type: int
    precision: str  # "fp16" / "bf16"
    type_str: str  # as ONNX schemas name it
    suffix: str  # of the copies of values and weights made in it
    maximum: float  # its largest finite value
    smallest: float  # its smallest subnormal

    @property
    def label(self) -> str:
        return self.precision.upper()

    def as_float32(self, stored: np.ndarray) -> np.ndarray:
        """Values as `values` stores them, back in FP32 (exactly: both formats are subsets of FP32)."""
        if self.elem_type == TensorProto.FLOAT16:
            return stored.view("<f2").astype(np.float32)
        return (stored.view("<u2").astype("<u4") << 16).view("<f4")

    def values(self, block: np.ndarray) -> np.ndarray:
        """FP32 values in this format (round to nearest even; Inf beyond its maximum), as ONNX stores them."""
        if self.elem_type == TensorProto.FLOAT16:
            with np.errstate(over="ignore"):
                return block.astype("<f2")
        bits = np.ascontiguousarray(block, dtype="<f4").view("<u4").astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        return np.where(np.isnan(block), np.uint16(0x7FC0), rounded).astype("<u2")


FP16 = Half(TensorProto.FLOAT16, "fp16", "tensor(float16)", "__fp16", FP16_MAX, 2.0**-24)
# BF16 has FP32's exponent but 8 significant bits: its largest finite value, (2 - 2^-7) * 2^127, is below
# FP32's, and FP32's extremes (which exporters write as mask fills) round to Inf.
BF16 = Half(TensorProto.BFLOAT16, "bf16", "tensor(bfloat16)", "__bf16", (2 - 2.0**-7) * 2.0**127, 2.0**-133)
HALVES = {h.precision: h for h in (FP16, BF16)}


def to_fp16(model: onnx.ModelProto, keep_fp32: Iterable[str] = (), autokeep: bool = True, half: Half = FP16,
            autokept: Mapping[str, str] | None = None) -> TransformResult:
    """Convert a shape-inferred FP32 model to FP16 (or BF16) mixed precision (see the module docstring).
    `autokept`: more nodes autokeep leaves in FP32, with the reason it measured (autokeep.py)."""
    source = {init.name: init for init in model.graph.initializer}
    model = copy_without_initializers(model)  # weights are added back as each is needed, in its new type
    conversion = _GraphConversion(default_opset(model), NodeSelector(keep_fp32), autokeep, half, dict(autokept or {}))
    conversion.convert(model.graph, source, {}, "")
    if not conversion.converted and not any(k.reason.startswith("selected by --keep-fp32") for k in conversion.kept):
        reasons = sorted({k.reason for k in conversion.kept})
        raise AccudiffError(f"no node of the model can compute in {half.label}{f' ({reasons[0]})' if len(reasons) == 1 else ''}, "
                            f"so --{half.precision} would compare it with itself")
    overflows = [(node, text) for node, found in conversion.constant_findings.items() for kind, text in found if kind == "constant_overflow"]
    return TransformResult(
        model=model,
        precision=half.precision,
        kept=conversion.kept,
        converted=conversion.converted,
        warnings=[f"node '{node}': {text} (--no-autokeep)" for node, text in overflows],
        constant_findings=conversion.constant_findings,
        storage_copies=conversion.copies,
    )


@dataclass
class _Graph:
    """One graph being converted: its weights (`source`, removed from it; `halves`, their values in the
    half format), the element types of its values before and after, and the type parameters each
    converted node (by index) binds to the half format."""

    graph: onnx.GraphProto
    source: dict[str, onnx.TensorProto]
    halves: dict[str, np.ndarray]
    types: dict[str, int]
    new_types: dict[str, int]
    converted_params: dict[int, set[str]]
    scope: str  # a suffix that keeps its Cast names unique


class _GraphConversion:
    """Converts a graph, then the bodies of its If/Loop/Scan nodes the same way: a body's inputs and
    outputs keep their types (so do the values it reads from outside), its inner nodes run in FP16."""

    def __init__(self, opset: int, selector: NodeSelector, autokeep: bool, half: Half, autokept: dict[str, str]):
        self.opset, self.selector, self.autokeep, self.half, self.autokept = opset, selector, autokeep, half, autokept
        self.kept: list[KeptNode] = []
        self.converted: set[str] = set()
        self.constant_findings: dict[str, list[tuple[str, str]]] = {}
        self.copies: dict[str, str] = {}

    def convert(self, graph: onnx.GraphProto, source: dict[str, onnx.TensorProto], outer_types: dict[str, int], scope: str) -> None:
        """Convert `graph` in place; `source` holds its weights (removed from it), `outer_types` the types of
        what it reads from enclosing graphs, `scope` a suffix that keeps its Cast names unique."""
        types = {**outer_types, **elem_types(graph, source.values())}
        roundings, halves = _read_weights(graph, source.values(), self.half)
        outer_refs = subgraph_outer_references(graph.node)
        state = _Graph(graph, source, halves, types, dict(types), {}, scope)
        for index, node in enumerate(graph.node):
            decision = self._decide(node, types, roundings, outer_refs)
            if isinstance(decision, KeptNode):
                self.kept.append(decision)
            elif decision:
                state.converted_params[index] = decision
                self.converted.add(node.name)
            for attr in node.attribute:
                for k, body in enumerate([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                    weights = {init.name: init for init in body.initializer}
                    del body.initializer[:]
                    inner = {**types, **_undeclared_body_inputs(node, body, types, self.opset)}
                    self.convert(body, weights, inner, f"{scope}_{node.name or node.op_type}_{attr.name}{k or ''}")

        # New element type of every FP32 value: FP16 when an FP16 node produced it through a converted parameter.
        readers = readers_of(graph.node)
        for index, params in state.converted_params.items():
            node = graph.node[index]
            schema = _schema(node, self.opset)
            for position, out in enumerate(node.output):
                if out and types.get(out) == TensorProto.FLOAT and _formal_type(schema.outputs, position) in params:
                    state.new_types[out] = self.half.elem_type
            found = self._constant_findings(node, schema, params, roundings, readers)
            if found:
                self.constant_findings[node.name] = found

        self._retype_graph_outputs(state)
        copies = self._insert_casts(state)
        if not scope:  # only the main graph's copies can be fed in an isolated run
            self.copies.update(copies)

    def _decide(self, node, types, roundings: dict[str, ConstantRounding], outer_refs) -> set[str] | KeptNode | None:
        """Type parameters bound to the half format for a convertible node, a KeptNode when it must stay
        FP32, None if neutral."""
        half = self.half
        float_inputs = [i for i, name in enumerate(node.input) if name and types.get(name) == TensorProto.FLOAT]
        float_outputs = [o for o in node.output if o and types.get(o) == TensorProto.FLOAT]
        if node.op_type == "Constant" or not (float_inputs or float_outputs):
            return None
        keep = lambda reason, autokept=False: KeptNode(node.name, node.op_type, reason, autokept)  # noqa: E731
        schema = _schema(node, self.opset)
        if schema is None:
            return keep(f"op of domain '{node.domain}' has no known {half.label} schema")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return None  # If/Loop/Scan: its inputs and outputs keep their types; its bodies are converted
        pattern = self.selector.matches(node)
        if pattern is not None:
            return keep(f"selected by --keep-fp32 {pattern}")
        if any(o in outer_refs for o in node.output):
            return keep("an If/Loop/Scan body reads its output")
        params = {_formal_type(schema.inputs, i) for i in float_inputs if _allows(schema, _formal_type(schema.inputs, i), half)}
        if not params:
            return keep(f"its op has no {half.label} form for these inputs") if float_inputs else None
        if is_onnxruntime_op(node) and not _cpu_kernel(node, schema, params, types, self.opset, half):
            return keep(f"ONNX Runtime's CPU provider has no {half.label} kernel for {node.op_type}")
        if self.autokeep:
            if node.name in self.autokept:
                return keep(self.autokept[node.name], True)
            for i in float_inputs:
                rounding = roundings.get(node.input[i])
                if rounding is not None and rounding.to_inf and _formal_type(schema.inputs, i) in params:
                    return keep(overflow_text(node.input[i], rounding, node.op_type, half.label, half.maximum, happened=False), True)
        return params

    def _constant_findings(self, node, schema, params: set[str], roundings: dict[str, ConstantRounding], readers) -> list[tuple[str, str]]:
        """What the half format did to the constants converted node `node` reads: Inf (--no-autokeep), 0."""
        found = []
        for position, name in enumerate(node.input):
            rounding = roundings.get(name)
            if rounding is None or _formal_type(schema.inputs, position) not in params:
                continue
            if rounding.to_inf:
                found.append(("constant_overflow", overflow_text(name, rounding, node.op_type, self.half.label, self.half.maximum, happened=True)))
            if rounding.underflow_matters:
                denominator = denominator_reader(node.output[0], readers.get(node.output[0], [])) if node.op_type == "Add" and rounding.size == 1 else None
                found.append(("constant_underflow", underflow_text(name, rounding, self.half.label, self.half.smallest, denominator)))
        return found

    def _retype_graph_outputs(self, state: _Graph) -> None:
        """A graph output converted to FP16 is renamed `<name>__fp16`; a Cast then restores `<name>` in FP32.
        (An output the model already computes in FP16 stays as it is.)"""
        graph, types, new_types, half = state.graph, state.types, state.new_types, self.half
        for out in graph.output:
            if new_types.get(out.name) != half.elem_type or types.get(out.name) == half.elem_type:
                continue
            inner = out.name + half.suffix
            for node in graph.node:
                node.output[:] = [inner if o == out.name else o for o in node.output]
                node.input[:] = [inner if i == out.name else i for i in node.input]
            types[inner], new_types[inner] = TensorProto.FLOAT, half.elem_type
            declared = graph.value_info.add()
            declared.CopyFrom(out)
            declared.name = inner  # its type becomes FP16 with the other converted values
            new_types[out.name] = TensorProto.FLOAT
            cast = helper.make_node("Cast", [inner], [out.name], name=out.name + "__to_fp32", to=TensorProto.FLOAT)
            state.converted_params[len(graph.node)] = {"T1"}  # the Cast reads the FP16 value as it is
            graph.node.append(cast)

    def _insert_casts(self, state: _Graph) -> dict[str, str]:
        """Give every node input the element type its node now needs: FP16 copies of weights (their values
        made as the weights were read), Casts otherwise.

        Original weights are added back only where something still reads them in their own type. Returns
        the activations' cast copies, {copy: tensor}.
        """
        graph, initializers, half = state.graph, state.source, self.half
        produced: dict[tuple[str, int], str] = {}
        new_nodes: list[onnx.NodeProto] = []
        copies: dict[str, str] = {}
        declared = {vi.name: vi for vi in [*graph.input, *graph.value_info, *graph.output]}

        def convert(name: str, target: int) -> str:
            key = (name, target)
            if key not in produced:
                suffix = (half.suffix if target == half.elem_type else "__fp32") + state.scope
                produced[key] = name + suffix
                if name in initializers and target == half.elem_type:
                    values = state.halves.pop(name)
                    # Built in place: a TensorProto made first and appended would be copied once more.
                    weight = graph.initializer.add(name=produced[key], data_type=half.elem_type, dims=initializers[name].dims)
                    weight.raw_data = values.tobytes()
                    del values
                else:
                    new_nodes.append(helper.make_node("Cast", [name], [produced[key]], name=produced[key] + "_cast", to=target))
                    copies[produced[key]] = name
                    declare_like(graph, declared, produced[key], name, target)
            return produced[key]

        for index, node in enumerate(list(graph.node)):
            params = state.converted_params.get(index, set())
            schema = _schema(node, self.opset) if params else None
            for i, name in enumerate(node.input):
                if state.types.get(name) != TensorProto.FLOAT:
                    continue  # only values that were FP32 change type; others stay as the author wrote them
                wanted = half.elem_type if schema is not None and _formal_type(schema.inputs, i) in params else TensorProto.FLOAT
                if state.new_types[name] != wanted:
                    node.input[i] = convert(name, wanted)
            new_nodes.append(node)
        del graph.node[:]
        graph.node.extend(new_nodes)  # each Cast sits right before its first reader: still topological
        still_read = {name for node in new_nodes for name in node.input} | subgraph_outer_references(new_nodes)
        still_read |= {i.name for i in graph.input} | {o.name for o in graph.output}
        graph.initializer.extend(init for name, init in initializers.items() if name in still_read)
        for vi in graph.value_info:
            if vi.name in state.new_types and vi.type.HasField("tensor_type"):
                vi.type.tensor_type.elem_type = state.new_types[vi.name]
        return copies


def _undeclared_body_inputs(node: onnx.NodeProto, body: onnx.GraphProto, types: dict[str, int], opset: int) -> dict[str, int]:
    """Element types of a Loop/Scan body's inputs that the body leaves undeclared (function expansions do),
    from the values the node feeds them: a carried FP32 value is then cast where an FP16 node reads it."""
    if node.op_type == "Loop":
        fed = [None, None, *node.input[2:]]  # iteration number, condition, then the carried values
    elif node.op_type == "Scan":
        fed = list(node.input[1:] if opset < 9 else node.input)  # opset 8 reads sequence_lens first
    else:
        return {}
    return {vi.name: types[name] for vi, name in zip(body.input, fed) if name and not vi.type.tensor_type.elem_type and types.get(name)}


def elem_types(graph: onnx.GraphProto, initializers: Iterable[onnx.TensorProto]) -> dict[str, int]:
    """The element type of every value the graph declares (inputs, value_info, outputs), weight and Constant."""
    types = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in initializers:
        types[init.name] = init.data_type
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
    return types


def _read_weights(graph: onnx.GraphProto, initializers: Iterable[onnx.TensorProto], half: Half) -> tuple[dict[str, ConstantRounding], dict[str, np.ndarray]]:
    """What the half format does to every FP32 weight and Constant (all autokeep and the findings need), and
    each FP32 weight's values in the half format (little-endian, as ONNX raw data is), made in the same
    read: a weight in a data file is read once, a block at a time, and never held whole in FP32."""
    roundings, halves = {}, {}
    for init in initializers:
        if init.data_type != TensorProto.FLOAT:
            continue
        values, filled, rounding = np.empty(int(np.prod(init.dims, dtype=np.int64)), "<u2"), 0, ConstantRounding()
        for block in weight_blocks(init):  # beyond FP16 only with --no-autokeep, and then reported
            stored = half.values(block).view("<u2")
            rounding.add(block, half.as_float32(stored))
            values[filled : filled + block.size] = stored.reshape(-1)
            filled += block.size
        roundings[init.name], halves[init.name] = rounding, values
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                    rounding = roundings[node.output[0]] = ConstantRounding()
                    for block in weight_blocks(attr.t):
                        rounding.add(block, half.as_float32(half.values(block).view("<u2")))
    return roundings, halves


def _schema(node: onnx.NodeProto, opset: int):
    """The op's schema: ONNX Runtime's for its own ops (contrib_ops.py), else ONNX's; None for an op neither knows."""
    if is_onnxruntime_op(node):
        return contrib_schema(node)
    if node.domain in ("", "ai.onnx"):
        return onnx.defs.get_schema(node.op_type, opset, node.domain)
    return None


def _cpu_kernel(node: onnx.NodeProto, schema, params: set[str], types: dict[str, int], opset: int, half: Half) -> bool:
    """ONNX Runtime's CPU provider runs `node` with the float values of `params` in the half format."""
    def kind(formals, position: int, name: str) -> int:
        own = types.get(name, 0) if name else 0
        return half.elem_type if own == TensorProto.FLOAT and _formal_type(formals, position) in params else own

    inputs = tuple(kind(schema.inputs, i, name) for i, name in enumerate(node.input))
    outputs = tuple(kind(schema.outputs, i, name) for i, name in enumerate(node.output))
    return has_cpu_kernel(node, inputs, outputs, opset)


def _formal_type(formals, index: int) -> str:
    """Type string of the formal parameter at `index` (the last one repeats for variadic parameters)."""
    formal = formals[min(index, len(formals) - 1)]
    return formal.type_str


def _allows(schema, type_str: str, half: Half) -> bool:
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            return half.type_str in constraint.allowed_type_strs
    return False  # a fixed type such as tensor(float): that input must stay FP32
