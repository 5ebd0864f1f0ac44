"""A switchboard: the FP16 candidate in which chosen nodes can be put back in FP32 by a boolean input each.

Verification and `bisect precision` try many keep-lists on one candidate. Built one by one, each variant
costs a conversion, a save, a lowering and a session (about 0.4 s on the PP-OCRv4 recognizer, several
times its run); a switchboard is built and loaded once, and a keep-list is one run with its switches set.

Each switchable node X is computed twice: as the candidate has it, and as the FP32 model has it (reading
FP32 values: its switchable producers' switched values, the others' widened). `Where(switch, FP32 result,
candidate's result widened)` is X's value for readers that read it in FP32 (kept nodes, graph outputs);
the candidate's FP16 readers read that value rounded to FP16. So with its switch on, a node's readers see
exactly what they see when `to_fp16` keeps it (FP16 readers the FP32 result rounded once, FP32 readers
the FP32 result), and with it off exactly the candidate (an FP16 value widened and rounded again is
itself). tests/test_switches.py holds it to the variants `to_fp16` builds, keep-list by keep-list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import onnx
from onnx import TensorProto, helper

from accudiff.model.loading import cast_target, declare_like
from accudiff.transforms.fp16 import elem_types

SWITCH_PREFIX = "accudiff_keep_"


@dataclass
class Switchboard:
    """The switchable candidate, and the boolean input that keeps each of its switchable nodes in FP32."""

    model: onnx.ModelProto
    switches: dict[str, str]  # node -> its switch input

    def settings(self, keep: Iterable[str]) -> dict[str, bool]:
        """Every switch's value for the keep-list `keep` (a subset of the switchable nodes)."""
        kept = set(keep)
        return {switch: node in kept for node, switch in self.switches.items()}


def build_switchboard(candidate: onnx.ModelProto, fp32: onnx.ModelProto, nodes: Iterable[str]) -> Switchboard:
    """The switchboard of `candidate` (made from `fp32` by `to_fp16`, so its value_info has each value's
    type) for `nodes`: converted nodes of the main graph, present in both models under the same names."""
    wanted = list(dict.fromkeys(nodes))
    board = onnx.ModelProto()
    board.CopyFrom(candidate)
    graph = board.graph
    original = {node.name: node for node in fp32.graph.node}
    fp32_types, board_types = elem_types(fp32.graph, fp32.graph.initializer), elem_types(graph, graph.initializer)
    outputs = {o.name for o in graph.output}
    for node in graph.node:  # a graph output computed in FP16 is `<name>__fp16`, cast to `<name>` (see fp16.py)
        if node.op_type == "Cast" and node.output[0] in outputs and node.input[0] == node.output[0] + "__fp16":
            board_types[node.input[0]] = TensorProto.FLOAT16
    declared = {vi.name: vi for vi in [*graph.input, *graph.value_info, *graph.output]}
    fp32_weights = {init.name: init for init in fp32.graph.initializer}
    held = {init.name for init in graph.initializer}
    switches = {node: f"{SWITCH_PREFIX}{k}" for k, node in enumerate(wanted)}
    switched: dict[str, str] = {}  # a value of a switchable node (FP32 model's name) -> its switched FP32 value
    redirected: dict[str, str] = {}  # a candidate's FP16 value -> the switched value its Casts to FP32 read instead
    widened: set[str] = set()
    placed: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "Cast" and cast_target(node) == TensorProto.FLOAT and node.input[0] in redirected:
            node.input[0] = redirected[node.input[0]]
        placed.append(node)
        if node.name not in switches:
            continue
        kept = onnx.NodeProto()
        kept.CopyFrom(original[node.name])
        kept.name = node.name + "__kept"
        for i, name in enumerate(kept.input):
            if name in switched:
                kept.input[i] = switched[name]
            elif fp32_types.get(name) == TensorProto.FLOAT and board_types.get(name) == TensorProto.FLOAT16:
                kept.input[i] = name + "__widened"
                if name not in widened:
                    widened.add(name)
                    placed.append(helper.make_node("Cast", [name], [kept.input[i]], name=kept.input[i], to=TensorProto.FLOAT))
                    declare_like(graph, declared, kept.input[i], name, TensorProto.FLOAT)
            elif name in fp32_weights and name not in held:
                graph.initializer.append(fp32_weights[name])  # an FP32 weight the candidate holds only in FP16
                held.add(name)
        placed.append(kept)
        for j, name in enumerate(kept.output):
            if name:
                produced = node.output[j]
                in_fp16 = board_types.get(produced) == TensorProto.FLOAT16
                placed += _switch(node, j, kept, switches[node.name], in_fp16)
                for added, elem_type in _switched_values(produced, name, fp32_types.get(name), board_types.get(produced), in_fp16):
                    if elem_type:
                        declare_like(graph, declared, added, produced, elem_type)
                switched[name] = name + "__switched"
                if in_fp16:
                    redirected[produced] = switched[name]
    del graph.node[:]
    graph.node.extend(placed)
    graph.input.extend(helper.make_tensor_value_info(switch, TensorProto.BOOL, []) for switch in switches.values())
    return Switchboard(board, switches)


def _switch(node: onnx.NodeProto, j: int, kept: onnx.NodeProto, switch: str, in_fp16: bool) -> list[onnx.NodeProto]:
    """Output `j` of `node` switched: the kept copy's FP32 value where `switch` is on, the candidate's
    (widened) where it is off, under `<value>__switched`; the candidate's own name then holds it in the
    candidate's type. Renames the outputs of `node` and `kept`."""
    value, produced = kept.output[j], node.output[j]
    kept.output[j] = value + "__kept"
    node.output[j] = produced + "__candidate"
    added = []
    candidate_value = node.output[j]
    if in_fp16:
        candidate_value = produced + "__candidate_fp32"
        added.append(helper.make_node("Cast", [node.output[j]], [candidate_value], name=candidate_value, to=TensorProto.FLOAT))
    added.append(helper.make_node("Where", [switch, kept.output[j], candidate_value], [value + "__switched"], name=value + "__switched"))
    if in_fp16:
        added.append(helper.make_node("Cast", [value + "__switched"], [produced], name=produced + "__from_switch", to=TensorProto.FLOAT16))
    else:
        added.append(helper.make_node("Identity", [value + "__switched"], [produced], name=produced + "__from_switch"))
    return added


def _switched_values(produced: str, value: str, fp32_type: int | None, candidate_type: int | None, in_fp16: bool) -> list[tuple[str, int | None]]:
    """The values `_switch` adds for output `produced` (`value` in the FP32 model), with their types
    (None: unknown), so the switchboard stays typed."""
    added = [(value + "__kept", fp32_type), (produced + "__candidate", candidate_type), (value + "__switched", fp32_type)]
    return added + ([(produced + "__candidate_fp32", TensorProto.FLOAT)] if in_fp16 else [])
