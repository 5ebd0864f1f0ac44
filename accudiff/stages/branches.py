"""Control flow: which branch each If takes on each sample, the model specialized per group of samples
that take the same branches, and one result from the groups' results.

Tensors inside an If body cannot be marked as outputs, so a comparison of the model as written would
observe nothing of a network that sits in a branch. The conditions are evaluated on every sample (the
FP32 model cut down to what computes them, run by ONNX Runtime); samples that take the same branches form
a group, whose model has those branches inlined (transforms/inline_branches.py) and is compared like any
model. Nested Ifs surface as their enclosing If is inlined and are resolved the same way, round after
round. With one group (the usual case: the condition is a mode flag or a shape test) the comparison is
the plain one on the specialized model; with several, each group is compared on its own samples and the
statistics merge by tensor name: a tensor only one branch computes is compared over that branch's samples
(the table's `samples` column says how many).
"""

from __future__ import annotations

import heapq
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from accudiff.execution.messages import WorkerResult, merge_results
from accudiff.execution.probes import first_values
from accudiff.errors import AccudiffError
from accudiff.model.graph import all_nodes, subgraph_outer_references
from accudiff.model.inventory import ModelInfo
from accudiff.model.saving import save_model
from accudiff.model.shapes import infer_shapes_in_place
from accudiff.model.samples import Samples, samples_from_path
from accudiff.model.subgraph import extract
from accudiff.model.weights import weight_values
from accudiff.transforms import NodeSelector
from accudiff.transforms.candidate import CandidateRecipe
from accudiff.transforms.inline_branches import BRANCHES, if_nodes, inline_branches

MAX_NESTING = 16  # rounds of inlining (If inside If inside ...) before the rest is left as written


@dataclass
class BranchGroup:
    """Samples that take the same branches, and the model specialized for them."""

    model: onnx.ModelProto
    samples: list[int]
    taken: dict[str, str] = field(default_factory=dict)  # If node -> "then_branch" or "else_branch"
    calibration: Samples | None = None  # INT8 of a specialized model: the calibration samples that take these branches
    before: int = 0  # samples of the groups before this one (progress counts over all of them)


def plan_groups(info: ModelInfo, samples: Samples, recipe: CandidateRecipe, scratch: Path) -> list[BranchGroup]:
    """The branch-groups stage: the groups of `samples`, each with its own calibration samples (an INT8
    `recipe` calibrated on its own samples). With
    specialized groups, the keep-list is checked against their nodes (a pattern that selected only an If,
    now replaced by its branch, would keep nothing) and `info` lets go of its model: each group has its own."""
    groups = branch_groups(info.proto, samples)
    for k, group in enumerate(groups):
        group.before = sum(len(g.samples) for g in groups[:k])
    if not any(group.taken for group in groups):
        return groups
    NodeSelector(recipe.keep_fp32).require_matches([node for group in groups for node in all_nodes(group.model.graph)])
    if recipe.precision == "int8" and recipe.engine is None:
        for k, calibration in calibration_per_group(info, groups, recipe.calib_data, scratch).items():
            groups[k].calibration = calibration
    info.proto = onnx.ModelProto()
    return groups


def branch_groups(model: onnx.ModelProto, samples: Samples) -> list[BranchGroup]:
    """The groups of samples by the branches their Ifs take (one group, `model` itself, without Ifs)."""
    groups = [BranchGroup(model, list(range(len(samples))))]
    for _ in range(MAX_NESTING):
        if not any(if_nodes(group.model.graph) for group in groups):
            break
        split = []
        for group in groups:
            nodes = if_nodes(group.model.graph)
            if not nodes:
                split.append(group)
                continue
            by_branches: dict[tuple[bool, ...], list[int]] = {}
            values = _condition_values(group.model, [node.input[0] for node in nodes], samples, group.samples)
            for index, value in zip(group.samples, values):
                by_branches.setdefault(value, []).append(index)
            for value, indices in by_branches.items():
                taken = {node.name: branch for node, branch in zip(nodes, value)}
                specialized = inline_branches(group.model, taken)
                infer_shapes_in_place(specialized)
                split.append(BranchGroup(specialized, indices, {**group.taken, **{k: BRANCHES[v] for k, v in taken.items()}}))
        groups = split
    return groups


def calibration_per_group(info: ModelInfo, groups: Sequence[BranchGroup], calib_data, scratch: Path) -> dict[int, Samples]:
    """For a model specialized per branch group and calibrated on `calib_data`: each group's calibration
    samples are those that take its branches (a specialized model computes only those)."""
    if calib_data is None or not any(group.taken for group in groups):
        return {}
    calibration = samples_from_path(calib_data, info.inputs, "calibration", scratch)
    by_branches = {tuple(sorted(g.taken.items())): g.samples for g in branch_groups(info.proto, calibration)}
    chosen = {}
    for k, group in enumerate(groups):
        indices = by_branches.get(tuple(sorted(group.taken.items())))
        if indices is None:
            taken = ", ".join(f"If '{node}' its {branch}" for node, branch in list(group.taken.items())[:3])
            raise AccudiffError(
                f"no calibration sample takes the branches that sample(s) {', '.join(map(str, group.samples[:5]))} take ({taken}): add such samples to --calib-data"
            )
        chosen[k] = calibration.subset(indices)
    return chosen

def describe_groups(groups: Sequence[BranchGroup], total: int, shown: int = 3) -> list[str]:
    """What the report says about the specialization: per If, which branch was compared on which samples
    (beyond `shown` Ifs, one line with the count; summary.json lists them all)."""
    if not any(group.taken for group in groups):
        return []
    described = []
    for node in dict.fromkeys(name for group in groups for name in group.taken):
        per_branch: dict[str, list[int]] = {}
        for group in groups:
            if node in group.taken:
                per_branch.setdefault(group.taken[node], []).extend(group.samples)
        parts = [
            f"its {branch} on {f'every sample ({total})' if len(indices) == total else 'samples ' + _sample_list(indices)}"
            for branch, indices in per_branch.items()
        ]
        described.append(f"If '{node}' took {' and '.join(parts)}")
    lines = [f"{text}: the branch taken was inlined and compared like the rest of the model" for text in described[:shown]]
    if len(described) > shown:
        lines.append(f"{len(described) - shown} more If node(s) were resolved and inlined the same way (summary.json: branches)")
    if len(groups) > 1:
        lines.append(f"the samples take {len(groups)} different combinations of branches: each is compared on its own samples, and a tensor only one branch computes is compared over that branch's samples")
    return lines


def merge_group_results(groups: Sequence[tuple[Sequence[str], WorkerResult]]) -> tuple[list[str], WorkerResult]:
    """One result over the union of the groups' tensors (in an order that respects every group's
    topological order) from each group's (tensors, result); the groups ran one after another."""
    union = union_order([tensors for tensors, _ in groups])
    position = {name: k for k, name in enumerate(union)}
    return union, merge_results((result.widened([position[name] for name in tensors], len(union)) for tensors, result in groups), side_by_side=False)


def union_order(orders: Sequence[Sequence[str]]) -> list[str]:
    """Every name of every list once, each list's order kept; ties go to the name seen first."""
    first_seen: dict[str, tuple[int, int]] = {}
    after: dict[str, set[str]] = {}
    for k, order in enumerate(orders):
        for position, name in enumerate(order):
            first_seen.setdefault(name, (k, position))
            after.setdefault(name, set())
        for earlier, later in zip(order, order[1:]):
            after[earlier].add(later)
    waiting = {name: 0 for name in first_seen}
    for successors in after.values():
        for name in successors:
            waiting[name] += 1
    ready = [(first_seen[name], name) for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    merged = []
    while ready:
        _, name = heapq.heappop(ready)
        merged.append(name)
        for successor in after[name]:
            waiting[successor] -= 1
            if waiting[successor] == 0:
                heapq.heappush(ready, (first_seen[successor], successor))
    return merged


def _condition_values(model: onnx.ModelProto, conditions: list[str], samples: Samples, indices: Sequence[int]) -> list[tuple[bool, ...]]:
    """Each sample's value of every condition: from the sample, a weight, or the FP32 model cut down to
    the nodes that compute them, run by ONNX Runtime in a worker process (execution/probes.py)."""
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    computed = [name for name in conditions if name not in weights and name not in {i.name for i in graph.input}]
    chosen = samples.subset(indices)
    with tempfile.TemporaryDirectory(prefix="accudiff-conditions-") as scratch:
        got: list[dict[str, float]] = [{} for _ in indices]
        if computed:
            path = Path(scratch) / "conditions.onnx"
            save_model(extract(model, _producers(graph, computed), "conditions", outputs=computed), path)
            got = first_values(path, computed, chosen)
    values = []
    for feed, computed_values in zip(chosen, got):
        row = []
        for name in conditions:
            value = weight_values(weights[name]) if name in weights else feed[name] if name in feed else computed_values[name]
            row.append(bool(np.asarray(value).reshape(-1)[0]))
        values.append(tuple(row))
    return values


def _producers(graph: onnx.GraphProto, names: Sequence[str]) -> list[int]:
    """Indices of the nodes `names` depend on (what their bodies read from outside included)."""
    producer = {out: k for k, node in enumerate(graph.node) for out in node.output if out}
    chosen: set[int] = set()
    stack = list(names)
    while stack:
        k = producer.get(stack.pop())
        if k is None or k in chosen:
            continue
        chosen.add(k)
        node = graph.node[k]
        stack += [*node.input, *subgraph_outer_references([node])]
    return sorted(chosen)


def _sample_list(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in sorted(indices)[:8])
    return f"{shown}{', ...' if len(indices) > 8 else ''} ({len(indices)})"
