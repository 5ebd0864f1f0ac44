"""A switchboard: the FP16 candidate in which chosen nodes can be put back in FP32 by a boolean input each.

Verification and `bisect precision` try many keep-lists on one candidate. Built one by one, each variant
costs a conversion, a save, a lowering and a session (about 0.4 s on the PP-OCRv4 recognizer, several
times its run); a switchboard is built and loaded once, and a keep-list is one run with its switches set.

Each switchable node X is computed twice: as the candidate has it, and as the FP32 model has it (reading
FP32 values: its switchable producers' switched values, the others' widened). A choice on the switch (an If
whose branches hand on the FP32 result or the candidate's result widened) is X's value for readers that read
it in FP32 (kept nodes, graph outputs);
the candidate's FP16 readers read that value rounded to FP16. So with its switch on, a node's readers see
exactly what they see when `to_fp16` keeps it (FP16 readers the FP32 result rounded once, FP32 readers
the FP32 result), and with it off exactly the candidate (an FP16 value widened and rounded again is
itself). tests/test_switches.py holds it to the variants `to_fp16` builds, keep-list by keep-list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import onnx
from onnx import TensorProto, helper

from accudiff.model.formats import REDUCED_FLOATS
from accudiff.model.graph import cast_target, declare_like, subgraph_outer_references, toposort
from accudiff.model.shapes import infer_shapes_unless_typed
from accudiff.model.value_file import ValueFile
from accudiff.transforms.fp16 import HALVES, elem_types
from accudiff.model.quantized_ops import QuantizedOp, quantized_members
from accudiff.transforms.keep_float import FLOAT_TYPES, FloatInputs

SWITCH_PREFIX = "accudiff_keep_"


@dataclass
class Switchboard:
    """The switchable candidate, and the boolean input that keeps each of its switchable nodes in FP32."""

    model: onnx.ModelProto
    switches: dict[str, str]  # node -> its switch input
    aliases: dict[str, str] = field(default_factory=dict)  # another name of a switchable node (a quantized op's) -> its own

    def settings(self, keep: Iterable[str]) -> dict[str, bool]:
        """Every switch's value for the keep-list `keep` (a subset of the switchable nodes)."""
        kept = {self.aliases.get(name, name) for name in keep}
        return {switch: node in kept for node, switch in self.switches.items()}


def build_switchboard(candidate: onnx.ModelProto, fp32: onnx.ModelProto, nodes: Iterable[str]) -> Switchboard:
    """The switchboard of `candidate` (made from `fp32` by `to_fp16`, FP16 or BF16, so its value_info has
    each value's type) for `nodes`: converted nodes of the main graph, present in both models under the
    same names."""
    wanted = list(dict.fromkeys(nodes))
    board = onnx.ModelProto()
    board.CopyFrom(candidate)
    graph = board.graph
    original = {node.name: node for node in fp32.graph.node}
    fp32_types, board_types = elem_types(fp32.graph, fp32.graph.initializer), elem_types(graph, graph.initializer)
    outputs = {o.name for o in graph.output}
    for node in graph.node:  # a graph output computed in FP16 is `<name>__fp16`, cast to `<name>` (see fp16.py)
        for half in HALVES.values():
            if node.op_type == "Cast" and node.output[0] in outputs and node.input[0] == node.output[0] + half.suffix:
                board_types[node.input[0]] = half.elem_type
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
            elif fp32_types.get(name) == TensorProto.FLOAT and board_types.get(name) in REDUCED_FLOATS:
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
                in_fp16 = board_types.get(produced) in REDUCED_FLOATS
                placed += _switch(node, j, kept, j, switches[node.name], board_types.get(produced, fp32_types.get(name)))
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


def build_candidate_switchboard(candidate: onnx.ModelProto, reference: onnx.ModelProto, nodes: Iterable[str], values: ValueFile | None = None) -> Switchboard:
    """The switchboard of a candidate made by another tool (transforms/tool_made.py) for `nodes`: with a
    node's switch on, it computes as `keep_in_float` keeps it (its inputs from before their Q/DQ pairs and
    narrowing Casts, the reference's float weights, FP32 arithmetic; its result rounded to its own type for
    the others, and a graph output quantized right after it its own result again). tests/test_switches.py
    holds it to keep_in_float's variants, keep-list by keep-list. `values`: as keep_in_float's."""
    board = onnx.ModelProto()
    board.CopyFrom(candidate)
    graph = board.graph
    infer_shapes_unless_typed(board)
    edit = FloatInputs(graph, reference, values=values)
    ops = {op.node: op for name, op in edit.ops.items() if name in set(nodes)}
    switches = {(edit.ops[node].node if node in edit.ops else node): None for node in nodes}
    switches = {node: f"{SWITCH_PREFIX}{k}" for k, node in enumerate(switches)}
    members = quantized_members(edit.ops.values())
    switched: dict[str, str] = {}  # an output of a switchable node -> its switched FP32 value
    owner: dict[str, str] = {}  # ... -> that node
    placed: list[onnx.NodeProto] = []
    for node in graph.node:
        placed.append(node)
        op = members.get(node.name)
        read = _reader(edit, switched)
        if op is not None:  # a quantized op's node: the op is switched at its last node
            if op.node not in ops or op.outputs[0] not in node.output:
                continue
            writers = {out: n for n in placed for out in n.output if out in op.outputs}
            name, kept = op.node, _kept_op(op, placed, edit, read)
            outputs = [(writers[out], list(writers[out].output).index(out), kept[out], list(kept[out].output).index(out)) for out in op.outputs]
        elif node.name in switches and node.name not in ops:  # (a node sharing a switched op's name, its codes Gather, only feeds it)
            name, kept_node = node.name, _kept_node(node, placed, edit, read)
            outputs = [(node, j, kept_node, j) for j in range(len(node.output))]
        else:
            continue
        for candidate_node, j, kept_node, k in outputs:
            produced = candidate_node.output[j]
            own = edit.types.get(produced)
            if not produced or own not in FLOAT_TYPES:
                continue
            placed += _switch(candidate_node, j, kept_node, k, switches[name], own)
            narrow = own in REDUCED_FLOATS
            for added, elem_type in _switched_values(produced, produced, TensorProto.FLOAT if narrow else own, own, narrow):
                edit.declare(added, produced, elem_type)
            switched[produced], owner[produced] = produced + "__switched", name
    placed += _switched_graph_outputs(placed, owner, switches, {o.name for o in graph.output}, edit)
    del graph.node[:]
    graph.node.extend(placed)
    graph.initializer.extend(edit.imported)
    graph.input.extend(helper.make_tensor_value_info(switch, TensorProto.BOOL, []) for switch in switches.values())
    return Switchboard(board, switches, {name: op.node for name, op in edit.ops.items() if name != op.node and op.node in switches})


def _reader(edit: FloatInputs, switched: dict[str, str]):
    """How a kept copy reads a float input: the switched value of a switchable producer (with the activation
    a quantizer folded into the pair between applied again), else as keep_in_float reads it (the nodes it
    needs added to the list it is given)."""
    def read(node: onnx.NodeProto, index: int, name: str, before: list[onnx.NodeProto]) -> str:
        source = switched.get(edit.before_narrowing(name))
        return edit.refolded(name, source, before) if source else edit.float_input(node, index, name, before)
    return read


def _kept_node(node: onnx.NodeProto, placed: list[onnx.NodeProto], edit: FloatInputs, read) -> onnx.NodeProto:
    """A switchable node's copy computing as keep_in_float keeps it (added to `placed`)."""
    kept = onnx.NodeProto()
    kept.CopyFrom(node)
    kept.name = node.name + "__kept"
    for i, name in enumerate(node.input):
        if name and edit.types.get(name) in FLOAT_TYPES:
            kept.input[i] = read(node, i, name, placed)
    for attr in kept.attribute:
        if kept.op_type == "Cast" and attr.name == "to" and attr.i in REDUCED_FLOATS:
            attr.i = TensorProto.FLOAT
    placed.append(kept)
    return kept


def _kept_op(op: QuantizedOp, placed: list[onnx.NodeProto], edit: FloatInputs, read) -> dict[str, onnx.NodeProto]:
    """A switchable quantized op's float op, as keep_in_float keeps it (added to `placed`); the node
    writing each of its outputs (under the op's names: _switch renames them)."""
    nodes = edit.keep_op(op, read)
    for node in nodes:
        node.name += "__kept"
    placed += nodes
    return {out: node for node in nodes for out in node.output if out in op.outputs}


def _switched_graph_outputs(placed: list[onnx.NodeProto], owner: dict[str, str], switches: dict[str, str], outputs: set[str],
                            edit: FloatInputs) -> list[onnx.NodeProto]:
    """A graph output a Q/DQ pair quantizes right after a switchable node: with the node's switch on, the
    node's own result (as keep_in_float makes it: with the activation folded into the pair applied again),
    else the quantized value."""
    producer = {out: node for node in placed for out in node.output if out}
    added = []
    for dequantize in [n for n in placed if n.op_type == "DequantizeLinear" and n.output[0] in outputs]:
        quantize = producer.get(dequantize.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear" or quantize.input[0] not in owner:
            continue
        name = dequantize.output[0]
        own = edit.refolded(name, quantize.input[0], added)  # (a Relu the pair clipped in place of, applied again)
        dequantize.output[0] = name + "__quantized"
        edit.declare(dequantize.output[0], name, edit.types.get(name))
        added.append(_choice(switches[owner[quantize.input[0]]], own, dequantize.output[0], name, edit.types.get(name), name + "__switched_output"))
    return added


def _switch(node: onnx.NodeProto, j: int, kept: onnx.NodeProto, k: int, switch: str, own: int | None) -> list[onnx.NodeProto]:
    """Output `j` of `node` switched with output `k` of its kept copy: the kept copy's FP32 value where
    `switch` is on, the candidate's (widened) where it is off, under `<value>__switched`; the candidate's
    own name then holds it in the candidate's type `own`. Renames the outputs of `node` and `kept`."""
    value, produced = kept.output[k], node.output[j]
    narrow = own in REDUCED_FLOATS  # the kept copy computes in FP32 (a double stays a double: the choice hands it on as it is)
    kept.output[k] = value + "__kept"
    node.output[j] = produced + "__candidate"
    added = []
    candidate_value = node.output[j]
    if narrow:
        candidate_value = produced + "__candidate_fp32"
        added.append(helper.make_node("Cast", [node.output[j]], [candidate_value], name=candidate_value, to=TensorProto.FLOAT))
    added.append(_choice(switch, kept.output[k], candidate_value, value + "__switched", TensorProto.FLOAT if narrow else own, value + "__switched"))
    if narrow:
        added.append(helper.make_node("Cast", [value + "__switched"], [produced], name=produced + "__from_switch", to=own))
    else:
        added.append(helper.make_node("Identity", [value + "__switched"], [produced], name=produced + "__from_switch"))
    return added


def _choice(switch: str, on: str, off: str, value: str, elem_type: int | None, name: str) -> onnx.NodeProto:
    """`value` is `on` where `switch` is on, else `off` (both computed before it, of type `elem_type`; None:
    not known, ONNX Runtime infers it): an If whose branches each hand one on. ONNX Runtime's Where, given
    the switch as a scalar condition, selects element by element: on the trained Magika's board of 63
    switches it took 60% of a run, and the same board with Ifs ran 2.8x as fast (PP-OCRv4's recognizer, 407
    switches: 1.3x), its outputs bit for bit the same."""
    def branch(side: str, source: str) -> onnx.GraphProto:
        handed = f"{value}__{side}"
        result = helper.make_tensor_value_info(handed, elem_type, None) if elem_type else onnx.ValueInfoProto(name=handed)
        return helper.make_graph([helper.make_node("Identity", [source], [handed])], f"{name}_{side}", [], [result])

    return helper.make_node("If", [switch], [value], name=name, then_branch=branch("on", on), else_branch=branch("off", off))


def _chosen(node: onnx.NodeProto, switches: set[str]) -> tuple[str, str] | None:
    """The values a `_choice` on one of `switches` hands on, (on, off); None for any other node."""
    if node.op_type != "If" or node.input[0] not in switches:
        return None
    branches = {attr.name: attr.g for attr in node.attribute}
    handed = [branches[side].node for side in ("then_branch", "else_branch")]
    if any(len(nodes) != 1 or nodes[0].op_type != "Identity" for nodes in handed):
        return None
    return handed[0][0].input[0], handed[1][0].input[0]


def _switched_values(produced: str, value: str, fp32_type: int | None, candidate_type: int | None, in_fp16: bool) -> list[tuple[str, int | None]]:
    """The values `_switch` adds for output `produced` (`value` in the FP32 model), with their types
    (None: unknown), so the switchboard stays typed."""
    added = [(value + "__kept", fp32_type), (produced + "__candidate", candidate_type), (value + "__switched", fp32_type)]
    return added + ([(produced + "__candidate_fp32", TensorProto.FLOAT)] if in_fp16 else [])


def gate_switches(board: Switchboard) -> None:
    """Compute each switchable node's FP32 copy only when its switch is on: the nodes that serve one switch
    alone move into the `then` branch of an If on that switch, whose `else` branch hands on the candidate's
    values (in place of the choices between the two). A run then costs the candidate's run and the kept
    nodes', not both models' (the ungated board computes every switchable node twice); and a
    kept copy's FP32 weights, read from their data files only when it runs, are neither prepacked nor paged
    in for keep-lists that do not take them. For models whose weights are large (trial.LARGE_MODEL_BYTES):
    below that, the ungated board's weights are prepacked like its variants', so it matches them bit for bit."""
    graph = board.model.graph
    nodes = list(graph.node)
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in [*node.input, *subgraph_outer_references([node])]:  # a choice reads its two values from within its branches
            readers.setdefault(name, []).append(index)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    outputs = {o.name for o in graph.output}
    declared = {vi.name: vi for vi in [*graph.value_info, *graph.input, *graph.output]}
    switches = set(board.switches.values())
    choices: dict[str, list[int]] = {}  # a switch -> its choices between a kept value and the candidate's
    chosen: dict[int, tuple[str, str]] = {}  # ... -> what each chooses between
    for index, node in enumerate(nodes):
        values = _chosen(node, switches)
        if values is not None and values[0] in producer:
            choices.setdefault(node.input[0], []).append(index)
            chosen[index] = values
    moved: set[int] = set()
    gates: dict[int, onnx.NodeProto] = {}  # the first choice on a switch -> the If that replaces its choices
    for switch, picks in choices.items():
        private: set[int] = set()
        queue = [producer[chosen[w][0]] for w in picks]
        while queue:  # a node serves this switch alone when every reader of its outputs does (or is one of its choices)
            index = queue.pop()
            if index in private or index in moved:
                continue
            node = nodes[index]
            if any(out in outputs or any(r not in private and r not in picks for r in readers.get(out, [])) for out in node.output if out):
                continue
            private.add(index)
            queue += [producer[name] for name in node.input if name in producer]
        then = [nodes[i] for i in sorted(private)]
        values = [nodes[w].output[0] for w in picks]
        kept, candidate = [chosen[w][0] for w in picks], [chosen[w][1] for w in picks]
        branch = lambda name, body, results: helper.make_graph(body, name, [], [_typed(result, declared) for result in results])  # noqa: E731
        on = branch(f"{switch}_on", then + [helper.make_node("Identity", [k], [f"{v}__on"]) for k, v in zip(kept, values)], [f"{v}__on" for v in values])
        off = branch(f"{switch}_off", [helper.make_node("Identity", [c], [f"{v}__off"]) for c, v in zip(candidate, values)], [f"{v}__off" for v in values])
        for body_output, value in zip([*on.output, *off.output], values * 2):
            body_output.type.CopyFrom(_typed(value, declared).type)
        gates[min(picks)] = helper.make_node("If", [switch], values, name=f"{switch}__gate", then_branch=on, else_branch=off)
        moved |= private | set(picks)
    placed = []
    for index, node in enumerate(nodes):
        if index in gates:
            placed.append(gates[index])
        elif index not in moved:
            placed.append(node)
    del graph.node[:]
    graph.node.extend(placed)
    toposort(graph)  # an If reads every candidate value its choices read: the later ones' casts come after its place


def _typed(name: str, declared: dict[str, onnx.ValueInfoProto]) -> onnx.ValueInfoProto:
    found = onnx.ValueInfoProto()
    if name in declared:
        found.CopyFrom(declared[name])
    found.name = name
    return found
