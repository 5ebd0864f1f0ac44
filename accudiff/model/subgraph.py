"""Cut a set of nodes out of a model as a valid, runnable ONNX model of its own."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx

from accudiff.model.graph import subgraph_outer_references


def extract(model: onnx.ModelProto, indices: Sequence[int], name: str | None = None, outputs: Sequence[str] | None = None) -> onnx.ModelProto:
    """The nodes at `indices` (kept in graph order) as a model: its inputs are what they read from outside
    (values of Constant nodes outside come along as initializers), its outputs `outputs` if given, else
    what the rest of the graph (or the graph's outputs) reads from them, or else the last node's outputs.
    Types and shapes come from the model's value_info (run shape inference first)."""
    graph = model.graph
    wanted = sorted(set(indices))
    cut = _Cut(graph, wanted)
    chosen, rest, produced, reads, inputs = cut.chosen, cut.rest, cut.produced, cut.reads, cut.inputs
    initializers = {init.name: init for init in graph.initializer}
    initializers.update({node.output[0]: _constant_tensor(node) for node in cut.outside_constants})
    needed_outside = {n for node in rest for n in node.input} | {o.name for o in graph.output}
    needed_outside |= subgraph_outer_references(rest)
    typed = {vi.name: vi for vi in [*graph.input, *graph.value_info, *graph.output]}
    if outputs is None:
        outputs = [o for node in chosen for o in node.output if o and o in needed_outside] or [o for o in chosen[-1].output if o]
    # Built in place: onnx.helper's make_graph and make_model would copy every node and weight twice.
    extracted = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import)
    sub = extracted.graph
    sub.name = name or f"{graph.name or 'graph'}_nodes_{wanted[0]}_{wanted[-1]}"
    sub.node.extend(chosen)
    sub.input.extend(_value_info(typed, n) for n in inputs)
    sub.output.extend(_value_info(typed, n) for n in outputs)
    sub.initializer.extend(initializers[n] for n in dict.fromkeys(reads) if n in initializers)
    sub.value_info.extend(typed[n] for n in produced if n in typed and n not in outputs)
    return extracted


def cut_inputs(model: onnx.ModelProto, indices: Sequence[int]) -> set[str]:
    """The inputs the model `extract(model, indices)` would have, without making it."""
    return set(_Cut(model.graph, sorted(set(indices))).inputs)


class _Cut:
    """Where a cut meets the rest of the graph: its nodes and the others, what it produces and reads, the
    Constant nodes outside whose values it reads, and its inputs (what it reads from outside that is
    neither a weight nor such a Constant's value)."""

    def __init__(self, graph: onnx.GraphProto, wanted: list[int]):
        kept = set(wanted)
        self.chosen = [graph.node[i] for i in wanted]
        self.rest = [node for i, node in enumerate(graph.node) if i not in kept]
        self.produced = {o for node in self.chosen for o in node.output if o}
        self.reads = [n for node in self.chosen for n in node.input if n] + sorted(subgraph_outer_references(self.chosen))
        read = set(self.reads)
        # A Constant node outside the cut is a weight (exporters write them so), not an input anyone feeds.
        self.outside_constants = [node for node in self.rest if node.op_type == "Constant" and node.output[0] in read]
        weights = {init.name for init in graph.initializer} | {node.output[0] for node in self.outside_constants}
        self.inputs = list(dict.fromkeys(n for n in self.reads if n not in self.produced and n not in weights))


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto:
    """The value of a Constant node (whichever of its attribute forms it uses), as an initializer."""
    for attr in node.attribute:
        if attr.name == "value":  # the usual form: a tensor as it is (the evaluator costs ~0.3 s to import)
            tensor = onnx.TensorProto()
            tensor.CopyFrom(attr.t)
            tensor.name = node.output[0]
            return tensor
    from onnx.reference import ReferenceEvaluator

    (value,) = ReferenceEvaluator(node).run(None, {})
    return onnx.numpy_helper.from_array(np.asarray(value), node.output[0])


def _value_info(typed: dict, name: str) -> onnx.ValueInfoProto:
    return typed[name] if name in typed else onnx.ValueInfoProto(name=name)


def drop_unread_nodes(graph: onnx.GraphProto) -> int:
    """Remove the nodes whose outputs nothing reads (no later node, no graph output), and return how many.
    ONNX Runtime runs every node of a graph, read or not: a segment cut before its last values' readers,
    lowered for FP16 emulation, would otherwise widen each of them back to FP32 for nobody."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed.update(n for n in node.input if n)
            needed |= subgraph_outer_references([node])
    dropped = len(graph.node) - len(kept)
    if dropped:
        kept.reverse()
        del graph.node[:]
        graph.node.extend(kept)
    return dropped
