"""Specialize a model for the samples being compared: an If whose condition is known is replaced by the
nodes of the branch it takes.

Why: tensors inside an If body cannot be marked as graph outputs, so a network that sits in a branch
(voice-activity and streaming models exported by scripting do this) would be invisible to the comparison.
Inlined, its tensors are main-graph tensors: marked, compared, diagnosed, and converted to FP16/INT8 by
the ordinary transforms. Reference and candidate both run the specialized model, which computes exactly
what the If computes for those samples: an If only selects which nodes run.

Names are kept: an inlined tensor keeps the name the body gave it (value names are unique across scopes
in a valid model), and the If's outputs keep theirs, each written by an Identity (named
`<if node>/<output>`) from the value the branch returns.
"""

from __future__ import annotations

from typing import Mapping

import onnx
from onnx import helper

BRANCHES = {True: "then_branch", False: "else_branch"}


def if_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The If nodes of the main graph (nested ones surface as their enclosing If is inlined)."""
    return [node for node in graph.node if node.op_type == "If" and node.domain in ("", "ai.onnx")]


def inline_branches(model: onnx.ModelProto, taken: Mapping[str, bool]) -> onnx.ModelProto:
    """A copy of `model` where each If node named in `taken` is replaced by its then_branch (True) or
    else_branch (False)."""
    specialized = onnx.ModelProto()
    specialized.CopyFrom(model)
    graph = specialized.graph
    node_names = {node.name for node in graph.node}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "If" or node.name not in taken:
            nodes.append(node)
            continue
        body = next(a.g for a in node.attribute if a.name == BRANCHES[taken[node.name]])
        nodes += _inlined(node, body, graph, node_names)
    del graph.node[:]
    graph.node.extend(nodes)
    return specialized


def _inlined(if_node: onnx.NodeProto, body: onnx.GraphProto, graph: onnx.GraphProto, node_names: set[str]) -> list[onnx.NodeProto]:
    """The branch's nodes (value names are unique across scopes in a valid model, so they stay as they
    are; a node name the main graph already uses gets the If's name as a prefix), then Identities that
    write the If's outputs. The branch's weights and value_info move into `graph`."""
    nodes = []
    for node in body.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = _unique(copy.name or copy.op_type, node_names, prefix=f"{if_node.name}/")
        nodes.append(copy)
    for branch_output, if_output in zip(body.output, if_node.output):
        if if_output:
            nodes.append(helper.make_node("Identity", [branch_output.name], [if_output], name=_unique(f"{if_node.name}/{if_output}", node_names)))
    graph.initializer.extend(body.initializer)
    graph.value_info.extend(body.value_info)
    return nodes


def _unique(name: str, taken: set[str], prefix: str = "") -> str:
    """`name` if free, else `prefix + name`, else that with a counter; recorded as taken."""
    candidate = name if name not in taken else prefix + name
    k = 1
    while candidate in taken:
        k += 1
        candidate = f"{prefix}{name}_{k}"
    taken.add(candidate)
    return candidate
